"""HunyuanVideo 1.0 DiT checkpoints: the diffusers key map and the original release's names and fused
tensors converted to diffusers' (lazily, on the host), and its config read from tensor shapes."""
from __future__ import annotations

import re

import numpy as np

from vidax.models.hunyuanvideo.dit import HunyuanVideoConfig
from vidax.weights import Derived, KeyMap, Rule, View, view_of
from vidax.weights.views import window
from vidax.weights import linear_rules as linear


def split_proj_out(ckpt, dim: int):
    """diffusers names -> the names :func:`diffusers_keymap` reads: each single block's
    ``proj_out.weight`` [D, D + mlp] becomes ``proj_out.weight:attn`` [D, D] and ``:mlp``."""
    out = {}
    for name in ckpt:
        t = ckpt[name]
        m = re.fullmatch(r"single_transformer_blocks\.(\d+)\.proj_out\.weight", name)
        if m and len(t.shape) == 2 and t.shape[1] > dim:
            o, i = t.shape
            out[name + ":attn"] = window(name + ":attn", t, 1, 0, dim)  # lazily: a device's part only
            out[name + ":mlp"] = window(name + ":mlp", t, 1, dim, i)
        else:
            out[name] = t
    return view_of(out, ckpt)


def diffusers_keymap(cfg: HunyuanVideoConfig) -> KeyMap:
    """diffusers ``HunyuanVideoTransformer3DModel`` names (after :func:`split_proj_out`) -> state paths."""
    tte, ce = "time_text_embed", "context_embedder"
    top = [("x_embedder.proj.weight", "embed.patch.kernel", "conv3d"), ("x_embedder.proj.bias", "embed.patch.bias", "none"),
           *linear(f"{tte}.timestep_embedder.linear_1", "embed.time_in.l1"),
           *linear(f"{tte}.timestep_embedder.linear_2", "embed.time_in.l2"),
           *linear(f"{tte}.text_embedder.linear_1", "embed.vec_in.l1"),
           *linear(f"{tte}.text_embedder.linear_2", "embed.vec_in.l2"),
           *linear(f"{tte}.guidance_embedder.linear_1", "embed.guidance_in.l1"),
           *linear(f"{tte}.guidance_embedder.linear_2", "embed.guidance_in.l2"),
           *linear(f"{ce}.time_text_embed.timestep_embedder.linear_1", "embed.refiner.time_in.l1"),
           *linear(f"{ce}.time_text_embed.timestep_embedder.linear_2", "embed.refiner.time_in.l2"),
           *linear(f"{ce}.time_text_embed.text_embedder.linear_1", "embed.refiner.text_in.l1"),
           *linear(f"{ce}.time_text_embed.text_embedder.linear_2", "embed.refiner.text_in.l2"),
           *linear(f"{ce}.proj_in", "embed.refiner.proj_in"),
           *linear("norm_out.linear", "head.mod"), *linear("proj_out", "head.proj")]
    rb = f"{ce}.token_refiner.refiner_blocks.{{i}}"
    refiner = [(f"{rb}.norm1.weight", "embed.refiner.blocks.norm1.scale", "none"),
               (f"{rb}.norm1.bias", "embed.refiner.blocks.norm1.bias", "none"),
               (f"{rb}.norm2.weight", "embed.refiner.blocks.norm2.scale", "none"),
               (f"{rb}.norm2.bias", "embed.refiner.blocks.norm2.bias", "none")]
    for n, ref in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0")):
        refiner += linear(f"{rb}.attn.{ref}", f"embed.refiner.blocks.{n}")
    refiner += linear(f"{rb}.ff.net.0.proj", "embed.refiner.blocks.up") + linear(f"{rb}.ff.net.2", "embed.refiner.blocks.down")
    refiner += linear(f"{rb}.norm_out.linear", "embed.refiner.blocks.ada")
    db = "transformer_blocks.{i}"
    double = [*linear(f"{db}.norm1.linear", "double.mod"), *linear(f"{db}.norm1_context.linear", "double.mod_ctx")]
    for n, ref in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"), ("add_q", "add_q_proj"),
                   ("add_k", "add_k_proj"), ("add_v", "add_v_proj"), ("add_o", "to_add_out")):
        double += linear(f"{db}.attn.{ref}", f"double.{n}")
    for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
        double.append((f"{db}.attn.{n}.weight", f"double.{n}.scale", "none"))
    double += [*linear(f"{db}.ff.net.0.proj", "double.ff_up"), *linear(f"{db}.ff.net.2", "double.ff_down"),
               *linear(f"{db}.ff_context.net.0.proj", "double.ffc_up"), *linear(f"{db}.ff_context.net.2", "double.ffc_down")]
    sb = "single_transformer_blocks.{i}"
    single = [*linear(f"{sb}.norm.linear", "single.mod"), *linear(f"{sb}.proj_mlp", "single.mlp"),
              (f"{sb}.attn.norm_q.weight", "single.norm_q.scale", "none"),
              (f"{sb}.attn.norm_k.weight", "single.norm_k.scale", "none"),
              (f"{sb}.proj_out.weight:attn", "single.out_attn.kernel", "linear"),
              (f"{sb}.proj_out.bias", "single.out_attn.bias", "none"),
              (f"{sb}.proj_out.weight:mlp", "single.out_mlp.kernel", "linear")]
    for n, ref in (("q", "to_q"), ("k", "to_k"), ("v", "to_v")):
        single += linear(f"{sb}.attn.{ref}", f"single.{n}")
    return KeyMap([Rule(s, d, k) for s, d, k in top + refiner + double + single])


# The original release (tencent/HunyuanVideo ``mp_rank_00_model_states.pt``) names, as plain
# renames (applied in order to a name's pieces) plus fused tensors split on the host.
ORIGINAL_RENAMES = (
    ("img_in.proj", "x_embedder.proj"),
    ("time_in.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
    ("time_in.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
    ("guidance_in.mlp.0", "time_text_embed.guidance_embedder.linear_1"),
    ("guidance_in.mlp.2", "time_text_embed.guidance_embedder.linear_2"),
    ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
    ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
    ("txt_in.t_embedder.mlp.0", "context_embedder.time_text_embed.timestep_embedder.linear_1"),
    ("txt_in.t_embedder.mlp.2", "context_embedder.time_text_embed.timestep_embedder.linear_2"),
    ("txt_in.c_embedder.linear_1", "context_embedder.time_text_embed.text_embedder.linear_1"),
    ("txt_in.c_embedder.linear_2", "context_embedder.time_text_embed.text_embedder.linear_2"),
    ("txt_in.input_embedder", "context_embedder.proj_in"),
    ("final_layer.linear", "proj_out"),
)
ORIGINAL_BLOCK_RENAMES = {  # per block kind: original piece -> diffusers piece
    "double_blocks": {
        "img_mod.linear": "norm1.linear", "txt_mod.linear": "norm1_context.linear",
        "img_attn_q_norm": "attn.norm_q", "img_attn_k_norm": "attn.norm_k", "img_attn_proj": "attn.to_out.0",
        "txt_attn_q_norm": "attn.norm_added_q", "txt_attn_k_norm": "attn.norm_added_k", "txt_attn_proj": "attn.to_add_out",
        "img_mlp.fc1": "ff.net.0.proj", "img_mlp.fc2": "ff.net.2", "txt_mlp.fc1": "ff_context.net.0.proj",
        "txt_mlp.fc2": "ff_context.net.2"},
    "single_blocks": {"modulation.linear": "norm.linear", "linear2": "proj_out", "q_norm": "attn.norm_q",
                      "k_norm": "attn.norm_k"},
    "txt_in.individual_token_refiner.blocks": {
        "self_attn_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2",
        "adaLN_modulation.1": "norm_out.linear"},
}
BLOCK_PREFIX = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks",
                "txt_in.individual_token_refiner.blocks": "context_embedder.token_refiner.refiner_blocks"}
QKV = {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
       "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
       "self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}
BLOCK_RE = re.compile(r"(double_blocks|single_blocks|txt_in\.individual_token_refiner\.blocks)\.(\d+)\.(.+)\.(weight|bias)")


def is_original(names) -> bool:
    return any(n.startswith(("double_blocks.", "single_blocks.", "img_in.")) for n in names)


def original_to_diffusers(ckpt, cfg: HunyuanVideoConfig) -> View:
    """The original release's tensors under diffusers names (lazily: fused q/k/v and q/k/v/MLP
    projections split, the final modulation's (shift, scale) swapped to (scale, shift), when read)."""
    d = cfg.dim
    out = {}
    for name in ckpt:
        t = ckpt[name]
        m = BLOCK_RE.fullmatch(name)
        if m:
            kind, i, mid, wb = m.groups()
            base = f"{BLOCK_PREFIX[kind]}.{i}"
            if mid in QKV:
                n3 = t.shape[0] // 3
                for j, nm in enumerate(QKV[mid]):
                    key = f"{base}.{nm}.{wb}"
                    out[key] = window(key, t, 0, j * n3, (j + 1) * n3)
            elif kind == "single_blocks" and mid == "linear1":
                for nm, a0, a1 in (("attn.to_q", 0, d), ("attn.to_k", d, 2 * d), ("attn.to_v", 2 * d, 3 * d),
                                   ("proj_mlp", 3 * d, t.shape[0])):
                    key = f"{base}.{nm}.{wb}"
                    out[key] = window(key, t, 0, a0, a1)
            else:
                out[f"{base}.{ORIGINAL_BLOCK_RENAMES[kind].get(mid, mid)}.{wb}"] = t
            continue
        if name.startswith("final_layer.adaLN_modulation.1."):
            key = "norm_out.linear." + name.rsplit(".", 1)[1]
            half = t.shape[0] // 2
            out[key] = Derived(key, t.shape, lambda a, h=half: np.concatenate([a[h:], a[:h]], axis=0), t)
            continue
        new = name
        for a, b in ORIGINAL_RENAMES:
            if new.startswith(a + "."):
                new = b + new[len(a):]
                break
        out[new] = t
    return view_of(out, ckpt)


def config_from_original(ckpt) -> HunyuanVideoConfig:
    """The DiT config from an original-release checkpoint's tensor shapes (head_dim 128, as every
    HunyuanVideo release)."""
    sh = {k: tuple(v.shape) for k, v in ckpt.items()}
    d, cin, pt, ph, _ = sh["img_in.proj.weight"]
    n_double = 1 + max(int(k.split(".")[1]) for k in sh if k.startswith("double_blocks."))
    n_single = 1 + max(int(k.split(".")[1]) for k in sh if k.startswith("single_blocks."))
    n_ref = 1 + max(int(k.split(".")[3]) for k in sh if k.startswith("txt_in.individual_token_refiner.blocks."))
    out = sh["final_layer.linear.weight"][0] // (pt * ph * ph)
    mlp = sh["double_blocks.0.img_mlp.fc1.weight"][0]
    head_dim = sh["double_blocks.0.img_attn_q_norm.weight"][0]
    if head_dim != 128:
        raise ValueError(f"original checkpoint with head_dim {head_dim}: its rope_axes_dim cannot be inferred "
                         f"(the releases use 128 = 16 + 56 + 56); pass the config")
    return HunyuanVideoConfig(
        in_channels=cin, out_channels=out, num_heads=d // head_dim, head_dim=head_dim, num_layers=n_double,
        num_single_layers=n_single, num_refiner_layers=n_ref, mlp_ratio=mlp / d, patch_size=ph, patch_size_t=pt,
        guidance_embeds="guidance_in.mlp.0.weight" in sh, text_embed_dim=sh["txt_in.input_embedder.weight"][1],
        pooled_projection_dim=sh["vector_in.in_layer.weight"][1],
        image_condition_type="latent_concat" if cin == 2 * out + 1 else None)
