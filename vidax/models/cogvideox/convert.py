"""CogVideoX DiT checkpoints of the original (SAT) release: its names, fused q/k/v and adaLN table
converted to diffusers' (lazily, on the host), and its config read from tensor shapes."""
from __future__ import annotations

import numpy as np

from vidax.models.cogvideox.dit import CogVideoXConfig
from vidax.weights import Checkpoint, LazyTensor

# The original (SAT) release: ``model.diffusion_model.`` prefix, fused q/k/v, per-layer q/k norms in
# lists, and the two LayerNorm-Zero modulations of every layer in one 12-way adaLN table (see
# ``scripts/convert_cogvideox_to_diffusers.py`` of diffusers). Converted on the host, tensor by tensor.
SAT_PREFIX = "model.diffusion_model."


def sat_names(cfg: CogVideoXConfig) -> dict[str, str]:
    """Plain renames original -> diffusers (everything but the fused / regrouped tensors)."""
    out = {"mixins.patch_embed.proj.weight": "patch_embed.proj.weight",
           "mixins.patch_embed.proj.bias": "patch_embed.proj.bias",
           "mixins.patch_embed.text_proj.weight": "patch_embed.text_proj.weight",
           "mixins.patch_embed.text_proj.bias": "patch_embed.text_proj.bias",
           "mixins.pos_embed.pos_embedding": "patch_embed.pos_embedding",
           "time_embed.0.weight": "time_embedding.linear_1.weight", "time_embed.0.bias": "time_embedding.linear_1.bias",
           "time_embed.2.weight": "time_embedding.linear_2.weight", "time_embed.2.bias": "time_embedding.linear_2.bias",
           "ofs_embed.0.weight": "ofs_embedding.linear_1.weight", "ofs_embed.0.bias": "ofs_embedding.linear_1.bias",
           "ofs_embed.2.weight": "ofs_embedding.linear_2.weight", "ofs_embed.2.bias": "ofs_embedding.linear_2.bias",
           "transformer.final_layernorm.weight": "norm_final.weight",
           "transformer.final_layernorm.bias": "norm_final.bias",
           "mixins.final_layer.norm_final.weight": "norm_out.norm.weight",
           "mixins.final_layer.norm_final.bias": "norm_out.norm.bias",
           "mixins.final_layer.adaLN_modulation.1.weight": "norm_out.linear.weight",
           "mixins.final_layer.adaLN_modulation.1.bias": "norm_out.linear.bias",
           "mixins.final_layer.linear.weight": "proj_out.weight", "mixins.final_layer.linear.bias": "proj_out.bias"}
    for i in range(cfg.num_layers):
        s, d = f"transformer.layers.{i}.", f"transformer_blocks.{i}."
        for wb in ("weight", "bias"):
            out[f"{s}input_layernorm.{wb}"] = f"{d}norm1.norm.{wb}"
            out[f"{s}post_attention_layernorm.{wb}"] = f"{d}norm2.norm.{wb}"
            out[f"{s}attention.dense.{wb}"] = f"{d}attn1.to_out.0.{wb}"
            out[f"{s}mlp.dense_h_to_4h.{wb}"] = f"{d}ff.net.0.proj.{wb}"
            out[f"{s}mlp.dense_4h_to_h.{wb}"] = f"{d}ff.net.2.{wb}"
            out[f"mixins.adaln_layer.query_layernorm_list.{i}.{wb}"] = f"{d}attn1.norm_q.{wb}"
            out[f"mixins.adaln_layer.key_layernorm_list.{i}.{wb}"] = f"{d}attn1.norm_k.{wb}"
    return out


_SAT_IGNORED = ("freqs_sin", "freqs_cos", "position_embedding", "embed_tokens")


def is_original(names) -> bool:
    return any(n.startswith(SAT_PREFIX) or n.startswith(("transformer.layers.", "mixins.")) for n in names)


def sat_view(ckpt, cfg: CogVideoXConfig) -> Checkpoint:
    """An original (SAT) checkpoint under diffusers names: renames, the fused q/k/v split in three
    and the 12-way adaLN table regrouped into ``norm1`` / ``norm2`` on read (lazy, per tensor).
    Tensors it does not know keep their names, so the loader reports them."""
    names = list(ckpt)
    pre = SAT_PREFIX if any(n.startswith(SAT_PREFIX) for n in names) else ""
    ren = sat_names(cfg)
    out: dict = {}

    def derived(name, t, kind, j):
        parts = 3 if kind == "qkv" else 2
        shape = (t.shape[0] // parts, *t.shape[1:])

        def read():
            a = t.read() if hasattr(t, "read") else np.asarray(t)
            if kind == "qkv":
                return np.split(a, 3, axis=0)[j]
            c = np.split(a, 12, axis=0)
            return np.concatenate(c[0:3] + c[6:9] if j == 1 else c[3:6] + c[9:12], axis=0)

        return LazyTensor(name, shape, getattr(t, "dtype", np.float32), read)

    for n in names:
        k = n[len(pre):] if pre and n.startswith(pre) else n
        t = ckpt[n]
        if any(s in k for s in _SAT_IGNORED):
            continue
        if k in ren:
            out[ren[k]] = t
        elif ".attention.query_key_value." in k:
            i, wb = k.split(".")[2], k.rsplit(".", 1)[1]
            for j, qkv in enumerate(("to_q", "to_k", "to_v")):
                out[f"transformer_blocks.{i}.attn1.{qkv}.{wb}"] = derived(n, t, "qkv", j)
        elif k.startswith("mixins.adaln_layer.adaLN_modulations."):
            i, wb = k.split(".")[3], k.rsplit(".", 1)[1]
            for j in (1, 2):
                out[f"transformer_blocks.{i}.norm{j}.linear.{wb}"] = derived(n, t, "adaln", j)
        else:
            out[n] = t
    return Checkpoint(out, getattr(ckpt, "source", "checkpoint"))


def config_from_original(ckpt) -> CogVideoXConfig:
    """Infer the config from an original (SAT) checkpoint's tensor shapes."""
    names = list(ckpt)
    pre = SAT_PREFIX if any(n.startswith(SAT_PREFIX) for n in names) else ""
    sh = {n[len(pre):]: tuple(ckpt[n].shape) for n in names}
    d, _ = sh["mixins.patch_embed.text_proj.weight"]
    text_dim = sh["mixins.patch_embed.text_proj.weight"][1]
    layers = 1 + max(int(k.split(".")[2]) for k in sh if k.startswith("transformer.layers."))
    proj = sh["mixins.patch_embed.proj.weight"]
    hd = sh["mixins.adaln_layer.query_layernorm_list.0.weight"][0]
    tdim = sh["time_embed.2.weight"][0]
    out = sh["mixins.final_layer.linear.weight"][0]
    rope = any("freqs_" in k for k in sh) or "mixins.pos_embed.pos_embedding" in sh
    kw = dict(num_heads=d // hd, head_dim=hd, text_embed_dim=text_dim, num_layers=layers, time_embed_dim=tdim,
              attention_bias="transformer.layers.0.attention.query_key_value.bias" in sh,
              patch_bias="mixins.patch_embed.proj.bias" in sh)
    if len(proj) == 4:  # 1.0: Conv2d
        p = proj[2]
        kw.update(patch_size=p, in_channels=proj[1], out_channels=out // (p * p))
    else:  # 1.5: Linear over (c, pt, p, p), patch 2 x 2 x 2
        kw.update(patch_size=2, patch_size_t=2, in_channels=proj[1] // 8, out_channels=out // 8, patch_bias=False,
                  sample_height=300, sample_width=300, sample_frames=81)
    if "ofs_embed.0.weight" in sh:
        kw["ofs_embed_dim"] = sh["ofs_embed.0.weight"][0]
    learned = "mixins.pos_embed.pos_embedding" in sh
    kw.update(use_learned_positional_embeddings=learned,
              use_rotary_positional_embeddings=rope or learned or kw.get("patch_size_t") is not None)
    return CogVideoXConfig(**kw)
