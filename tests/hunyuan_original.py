"""Test helpers: diffusers state dicts re-packed under the HunyuanVideo 1.0 and 1.5 original releases'
names and fusions (the inverses of the families' ``convert.original_to_diffusers``), to build
original-format checkpoint files."""
from __future__ import annotations

import re

import numpy as np

from vidax.models.hunyuanvideo import convert as h10
from vidax.models.hunyuanvideo15 import convert as h15


def hunyuanvideo_original_names(cfg, sd: dict) -> dict:
    """A diffusers state dict (numpy) re-packed under the original release's names and fusions
    (the inverse of ``vidax.models.hunyuanvideo.convert.original_to_diffusers``)."""
    prefix_inv = {v: k for k, v in h10.BLOCK_PREFIX.items()}
    block_re = re.compile(r"(transformer_blocks|single_transformer_blocks|context_embedder\.token_refiner\.refiner_blocks)"
                          r"\.(\d+)\.(.+)\.(weight|bias)")
    out, done = {}, set()
    for name, a in sd.items():
        if name in done:
            continue
        m = block_re.fullmatch(name)
        if m:
            kind, i, mid, wb = m.groups()
            okind = prefix_inv[kind]
            base = f"{kind}.{i}"
            fused = None
            if okind == "single_blocks" and mid in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"):
                fused = ("linear1", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"))
            elif mid in h10.QKV["txt_attn_qkv"]:
                fused = ("txt_attn_qkv", h10.QKV["txt_attn_qkv"])
            elif mid in h10.QKV["img_attn_qkv"]:
                fused = ("img_attn_qkv" if okind == "double_blocks" else "self_attn_qkv", h10.QKV["img_attn_qkv"])
            if fused is not None:
                srcs = [f"{base}.{p}.{wb}" for p in fused[1]]
                out[f"{okind}.{i}.{fused[0]}.{wb}"] = np.concatenate([sd[s_] for s_ in srcs], axis=0)
                done.update(srcs)
                continue
            inv = {v: k for k, v in h10.ORIGINAL_BLOCK_RENAMES[okind].items()}
            out[f"{okind}.{i}.{inv.get(mid, mid)}.{wb}"] = a
            continue
        if name.startswith("norm_out.linear."):
            h = a.shape[0] // 2
            out["final_layer.adaLN_modulation.1." + name.rsplit(".", 1)[1]] = np.concatenate([a[h:], a[:h]], axis=0)
            continue
        new = name
        for orig, dif in h10.ORIGINAL_RENAMES:
            if new.startswith(dif + "."):
                new = orig + new[len(dif):]
                break
        out[new] = a
    return out


def hunyuanvideo15_original_names(sd: dict) -> dict:
    """A diffusers state dict (numpy) under the original release's names (the inverse of
    ``vidax.models.hunyuanvideo15.convert.original_to_diffusers``)."""
    inv_top = tuple((b, a) for a, b in h15.ORIGINAL_RENAMES)
    inv_double = {v: k for k, v in h15.ORIGINAL_DOUBLE.items()}
    inv_ref = {v: k for k, v in h15.ORIGINAL_REFINER.items()}
    out = {}
    for name, a in sd.items():
        head, _, wb = name.rpartition(".")
        parts = head.split(".")
        if parts[0] == "transformer_blocks":
            mid = ".".join(parts[2:])
            out[f"double_blocks.{parts[1]}.{inv_double.get(mid, mid)}.{wb}"] = a
        elif head.startswith("context_embedder.token_refiner.refiner_blocks."):
            i, mid = parts[3], ".".join(parts[4:])
            base = f"txt_in.individual_token_refiner.blocks.{i}"
            if mid in ("attn.to_q", "attn.to_k", "attn.to_v"):
                if mid == "attn.to_q":
                    p = f"context_embedder.token_refiner.refiner_blocks.{i}.attn"
                    out[f"{base}.self_attn_qkv.{wb}"] = np.concatenate([sd[f"{p}.{n}.{wb}"] for n in ("to_q", "to_k", "to_v")])
            else:
                out[f"{base}.{inv_ref.get(mid, mid)}.{wb}"] = a
        elif head == "norm_out.linear":
            h = a.shape[0] // 2
            out[f"final_layer.adaLN_modulation.1.{wb}"] = np.concatenate([a[h:], a[:h]], axis=0)
        else:
            out[h15.rename(name, inv_top)] = a
    return out
