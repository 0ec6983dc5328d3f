"""HunyuanVideo LoRA names, beside the DiT's key tables (:mod:`~.dit`): the diffusers layout
(``transformer_blocks.0.attn.to_q``, PEFT / diffusers training) and the original release's
(``double_blocks.0.img_attn_qkv``, ``single_blocks.0.linear1``: ComfyUI, kohya, musubi-tuner).
The original release fuses projections that diffusers keeps apart (q/k/v; q/k/v + MLP in a single
block) and orders the final modulation (shift, scale): a LoRA on a fused module adapts row ranges
of the separate diffusers tensors, the same split :func:`~.dit.original_to_diffusers` applies to
the weights."""
from __future__ import annotations

import re

from vidax.models.hunyuanvideo import convert as hconv

_BLOCK = re.compile(r"(transformer_blocks|single_transformer_blocks|context_embedder\.token_refiner\.refiner_blocks)"
                    r"\.(\d+)\.(.+)\.(weight|bias)")
_SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def _fused(okind: str, mid: str):
    """(original fused module, its diffusers members in row order) for a diffusers block piece."""
    if okind == "single_blocks" and mid in _SINGLE_FUSED:
        return "linear1", _SINGLE_FUSED
    if mid in hconv.QKV["txt_attn_qkv"]:
        return "txt_attn_qkv", hconv.QKV["txt_attn_qkv"]
    if mid in hconv.QKV["img_attn_qkv"]:
        return ("img_attn_qkv" if okind == "double_blocks" else "self_attn_qkv"), hconv.QKV["img_attn_qkv"]
    return None


def table(shapes) -> dict:
    """``{alias: name or row parts}`` for a diffusers-layout checkpoint's ``{name: shape}`` (an
    original-layout checkpoint answers to its own names only)."""
    out = {n: n for n in shapes}
    if hconv.is_original(list(shapes)):
        return out
    prefix_inv = {v: k for k, v in hconv.BLOCK_PREFIX.items()}
    for name, shape in shapes.items():
        m = _BLOCK.fullmatch(name)
        if m:
            kind, i, mid, wb = m.groups()
            okind = prefix_inv[kind]
            fused = _fused(okind, mid)
            if fused is not None:
                members = [f"{kind}.{i}.{p}.{wb}" for p in fused[1]]
                if all(x in shapes for x in members):
                    parts, off = [], 0
                    for x in members:
                        n = shapes[x][0]
                        parts.append((x, off, off + n, 0, n))
                        off += n
                    out.setdefault(f"{okind}.{i}.{fused[0]}.{wb}", tuple(parts))
                continue
            inv = {v: k for k, v in hconv.ORIGINAL_BLOCK_RENAMES[okind].items()}
            out.setdefault(f"{okind}.{i}.{inv.get(mid, mid)}.{wb}", name)
            continue
        if name.startswith("norm_out.linear."):
            h = shape[0] // 2
            out.setdefault("final_layer.adaLN_modulation.1." + name.rsplit(".", 1)[1],
                           ((name, h, 2 * h, 0, h), (name, 0, h, h, 2 * h)))
            continue
        for orig, dif in hconv.ORIGINAL_RENAMES:
            if name.startswith(dif + "."):
                out.setdefault(orig + name[len(dif):], name)
                break
    return out


def aliases(cfg=None):
    return table


def compat_aliases(class_name: str, config: dict):
    if class_name != "HunyuanVideoTransformer3DModel":
        raise KeyError(class_name)
    return table
