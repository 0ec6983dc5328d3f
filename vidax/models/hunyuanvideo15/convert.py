"""HunyuanVideo 1.5 DiT checkpoints: the diffusers key map (1.0's rules for 1.0's modules plus 1.5's
embedders) and the original release's names converted to diffusers' (lazily, on the host), and its
config read from tensor shapes."""
from __future__ import annotations

import numpy as np

from vidax.models.hunyuanvideo import convert as h10
from vidax.models.hunyuanvideo15.dit import HunyuanVideo15Config
from vidax.weights import Derived, KeyMap, Rule, View, view_of
from vidax.weights.views import window
from vidax.weights import linear_rules as linear

_SHARED = ("embed.patch.", "embed.refiner.", "double.", "head.")  # 1.0's names for 1.0's modules


def diffusers_keymap(cfg: HunyuanVideo15Config) -> KeyMap:
    """diffusers ``HunyuanVideo15Transformer3DModel`` names -> state paths: 1.0's rules for the
    patch embedding, token refiner, dual-stream blocks and head (same names, same modules), plus
    1.5's embedders."""
    shared = [r for r in h10.diffusers_keymap(cfg).rules if r.dst.startswith(_SHARED)]
    own = [*linear("time_embed.timestep_embedder.linear_1", "embed.time_in.l1"),
           *linear("time_embed.timestep_embedder.linear_2", "embed.time_in.l2"),
           ("context_embedder_2.norm.weight", "embed.glyph.norm.scale", "none"),
           ("context_embedder_2.norm.bias", "embed.glyph.norm.bias", "none"),
           *linear("context_embedder_2.linear_1", "embed.glyph.l1"), *linear("context_embedder_2.linear_2", "embed.glyph.l2"),
           *linear("context_embedder_2.linear_3", "embed.glyph.l3"),
           ("image_embedder.norm_in.weight", "embed.image.norm_in.scale", "none"),
           ("image_embedder.norm_in.bias", "embed.image.norm_in.bias", "none"),
           *linear("image_embedder.linear_1", "embed.image.l1"), *linear("image_embedder.linear_2", "embed.image.l2"),
           ("image_embedder.norm_out.weight", "embed.image.norm_out.scale", "none"),
           ("image_embedder.norm_out.bias", "embed.image.norm_out.bias", "none"),
           ("cond_type_embed.weight", "embed.cond_type.embedding", "none")]
    if cfg.use_meanflow:
        own += [*linear("time_embed.timestep_embedder_r.linear_1", "embed.time_r.l1"),
                *linear("time_embed.timestep_embedder_r.linear_2", "embed.time_r.l2")]
    return KeyMap(shared + [Rule(s, d, k) for s, d, k in own])


# The original release (tencent/HunyuanVideo-1.5 ``transformer/<variant>/*.safetensors``) names:
# plain renames of a name's prefix, per-block renames, the refiner's fused q/k/v split on the host
# and the final modulation's (shift, scale) swapped to (scale, shift) when read.
ORIGINAL_RENAMES = (
    ("time_in.mlp.0", "time_embed.timestep_embedder.linear_1"),
    ("time_in.mlp.2", "time_embed.timestep_embedder.linear_2"),
    ("time_r_in.mlp.0", "time_embed.timestep_embedder_r.linear_1"),
    ("time_r_in.mlp.2", "time_embed.timestep_embedder_r.linear_2"),
    ("txt_in.t_embedder.mlp.0", "context_embedder.time_text_embed.timestep_embedder.linear_1"),
    ("txt_in.t_embedder.mlp.2", "context_embedder.time_text_embed.timestep_embedder.linear_2"),
    ("txt_in.c_embedder.linear_1", "context_embedder.time_text_embed.text_embedder.linear_1"),
    ("txt_in.c_embedder.linear_2", "context_embedder.time_text_embed.text_embedder.linear_2"),
    ("txt_in.input_embedder", "context_embedder.proj_in"),
    ("byt5_in.layernorm", "context_embedder_2.norm"),
    ("byt5_in.fc1", "context_embedder_2.linear_1"),
    ("byt5_in.fc2", "context_embedder_2.linear_2"),
    ("byt5_in.fc3", "context_embedder_2.linear_3"),
    ("vision_in.proj.0", "image_embedder.norm_in"),
    ("vision_in.proj.1", "image_embedder.linear_1"),
    ("vision_in.proj.3", "image_embedder.linear_2"),
    ("vision_in.proj.4", "image_embedder.norm_out"),
    ("img_in.proj", "x_embedder.proj"),
    ("cond_type_embedding", "cond_type_embed"),
    ("final_layer.linear", "proj_out"),
)
ORIGINAL_DOUBLE = {
    "img_mod.linear": "norm1.linear", "txt_mod.linear": "norm1_context.linear",
    "img_attn_q": "attn.to_q", "img_attn_k": "attn.to_k", "img_attn_v": "attn.to_v",
    "img_attn_q_norm": "attn.norm_q", "img_attn_k_norm": "attn.norm_k", "img_attn_proj": "attn.to_out.0",
    "txt_attn_q": "attn.add_q_proj", "txt_attn_k": "attn.add_k_proj", "txt_attn_v": "attn.add_v_proj",
    "txt_attn_q_norm": "attn.norm_added_q", "txt_attn_k_norm": "attn.norm_added_k", "txt_attn_proj": "attn.to_add_out",
    "img_mlp.fc1": "ff.net.0.proj", "img_mlp.fc2": "ff.net.2", "txt_mlp.fc1": "ff_context.net.0.proj",
    "txt_mlp.fc2": "ff_context.net.2"}
ORIGINAL_REFINER = {"self_attn_proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj", "mlp.fc2": "ff.net.2",
                     "adaLN_modulation.1": "norm_out.linear"}


def is_original(names) -> bool:
    return any(n.startswith(("double_blocks.", "img_in.", "byt5_in.")) for n in names)


def rename(name: str, table) -> str:
    for a, b in table:
        if name == a or name.startswith(a + "."):
            return b + name[len(a):]
    return name


def original_to_diffusers(ckpt) -> View:
    """The original release's tensors under diffusers names (lazily)."""
    out = {}
    for name in ckpt:
        t = ckpt[name]
        head, _, wb = name.rpartition(".")
        parts = head.split(".")
        if parts[0] == "double_blocks":
            out[f"transformer_blocks.{parts[1]}.{ORIGINAL_DOUBLE.get('.'.join(parts[2:]), '.'.join(parts[2:]))}.{wb}"] = t
        elif head.startswith("txt_in.individual_token_refiner.blocks."):
            i, mid = parts[3], ".".join(parts[4:])
            base = f"context_embedder.token_refiner.refiner_blocks.{i}"
            if mid == "self_attn_qkv":
                n3 = t.shape[0] // 3
                for j, nm in enumerate(("to_q", "to_k", "to_v")):
                    key = f"{base}.attn.{nm}.{wb}"
                    out[key] = window(key, t, 0, j * n3, (j + 1) * n3)
            else:
                out[f"{base}.{ORIGINAL_REFINER.get(mid, mid)}.{wb}"] = t
        elif head == "final_layer.adaLN_modulation.1":
            key = f"norm_out.linear.{wb}"
            half = t.shape[0] // 2
            out[key] = Derived(key, t.shape, lambda a, h=half: np.concatenate([a[h:], a[:h]], axis=0), t)
        else:
            out[rename(name, ORIGINAL_RENAMES)] = t
    return view_of(out, ckpt)


def config_from_original(ckpt) -> HunyuanVideo15Config:
    """The DiT config from an original-release checkpoint's tensor shapes (head_dim 128, as every
    release; ``target_size`` / ``task_type`` are not in the weights: pass the config for 720p)."""
    sh = {k: tuple(v.shape) for k, v in ckpt.items()}
    d, cin, pt, ph, _ = sh["img_in.proj.weight"]
    head_dim = sh["double_blocks.0.img_attn_q_norm.weight"][0]
    if head_dim != 128:
        raise ValueError(f"original checkpoint with head_dim {head_dim}: its rope_axes_dim cannot be inferred; pass the config")
    n = 1 + max(int(k.split(".")[1]) for k in sh if k.startswith("double_blocks."))
    n_ref = 1 + max(int(k.split(".")[3]) for k in sh if k.startswith("txt_in.individual_token_refiner.blocks."))
    return HunyuanVideo15Config(
        in_channels=cin, out_channels=sh["final_layer.linear.weight"][0] // (pt * ph * ph), num_heads=d // head_dim,
        head_dim=head_dim, num_layers=n, num_refiner_layers=n_ref, mlp_ratio=sh["double_blocks.0.img_mlp.fc1.weight"][0] / d,
        patch_size=ph, patch_size_t=pt, text_embed_dim=sh["txt_in.input_embedder.weight"][1],
        text_embed_2_dim=sh["byt5_in.fc1.weight"][1], image_embed_dim=sh["vision_in.proj.1.weight"][1],
        use_meanflow="time_r_in.mlp.0.weight" in sh)
