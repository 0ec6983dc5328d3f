"""SigLIP vision tower (transformers ``SiglipVisionModel``), in float32, as HunyuanVideo 1.5
image-to-video conditions on it (``last_hidden_state``).

Flax NNX module (:class:`SiglipVision`): a stride = kernel patch convolution (with bias), learned
positions (no class token), ``num_layers`` stacked pre-LN encoder layers
(:class:`vidax.text.encoder.EncoderBlock`) run by a scan, ``post_layernorm`` over every token, and
(``vision_use_head``) the multi-head attention-pooling head: a learned probe attends over the
tokens, then a residual LayerNorm + MLP; ``pooler_output`` is its one token. State::

    {"patch": {"kernel": [p, p, C, D], "bias": [D]}, "pos": {"embedding": [N, D]},
     "blocks": {...EncoderBlock stack...}, "post_norm": {"scale", "bias"},
     "head": {"probe": [1, 1, D], "q"/"k"/"v"/"o": {"kernel": [D, D], "bias": [D]}, "norm": {...},
              "fc1": {...}, "fc2": {...}}}                 # vision_use_head only

Checkpoint namings: ``vision_model.*`` (hub checkpoints, a full ``SiglipModel`` whose text half is
ignored) or no prefix (transformers 5 ``SiglipVisionModel.save_pretrained``). Images:
:func:`preprocess` reproduces ``SiglipImageProcessor`` (resize to ``size`` x ``size`` bicubic,
rescale 1/255, normalise with mean = std = 0.5).
"""
from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax.compat import CompatModel, register
from vidax.core import nn
from vidax.core.nn import ACTIVATIONS
from vidax.text import encoder
from vidax.text.lm import Output, check_kwargs, gqa_attention
from vidax.weights import KeyMap, Rule, load_params, open_checkpoint

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST

_HF_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    num_channels=3, image_size=224, patch_size=16, hidden_act="gelu_pytorch_tanh",
                    layer_norm_eps=1e-6, vision_use_head=True)


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6
    use_head: bool = True

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def from_hf(cls, config: dict) -> "SiglipVisionConfig":
        """From a ``SiglipVisionConfig`` dict or a ``SiglipConfig`` dict (its ``vision_config``)."""
        c = dict(config.get("vision_config") or {}) if "vision_config" in config else dict(config)
        k = {n: (c[n] if c.get(n) is not None else v) for n, v in _HF_DEFAULTS.items()}
        return cls(hidden_size=k["hidden_size"], intermediate_size=k["intermediate_size"],
                   num_layers=k["num_hidden_layers"], num_heads=k["num_attention_heads"], num_channels=k["num_channels"],
                   image_size=k["image_size"], patch_size=k["patch_size"], hidden_act=k["hidden_act"],
                   layer_norm_eps=float(k["layer_norm_eps"]), use_head=bool(k["vision_use_head"]))


class PoolingHead(nnx.Module):
    """Multi-head attention pooling (``SiglipMultiheadAttentionPoolingHead``)."""

    def __init__(self, cfg: SiglipVisionConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        D = cfg.hidden_size
        self.heads, self.act = cfg.num_heads, cfg.hidden_act
        self.probe = nn.param(rngs, nnx.initializers.normal(1.0), (1, 1, D), None, None, "embed", dtype=param_dtype)
        lin = partial(nn.Linear, rngs=rngs, param_dtype=param_dtype, precision=_HI)
        self.q, self.k, self.v = (lin(D, D, axes=("embed", "heads")) for _ in range(3))
        self.o = lin(D, D, axes=("heads", "embed"))
        self.norm = nn.LayerNorm(D, rngs=rngs, eps=cfg.layer_norm_eps, axis="embed", param_dtype=param_dtype)
        self.fc1 = lin(D, cfg.intermediate_size, axes=("embed", "ffn"))
        self.fc2 = lin(cfg.intermediate_size, D, axes=("ffn", "embed"))

    def __call__(self, x):
        B, N, D = x.shape
        hd = D // self.heads
        probe = jnp.broadcast_to(self.probe[...].astype(_F32), (B, 1, D))  # [1, 1, D] like the reference
        q = self.q(probe).reshape(B, 1, self.heads, hd)
        k, v = (p(x).reshape(B, N, self.heads, hd) for p in (self.k, self.v))
        h = self.o(gqa_attention(q, k, v, jnp.ones((B, 1, N), bool), hd**-0.5).reshape(B, 1, D))
        h = h + self.fc2(ACTIVATIONS[self.act](self.fc1(self.norm(h))))
        return h[:, 0]


class SiglipVision(nnx.Module):
    def __init__(self, cfg: SiglipVisionConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.cfg = cfg
        D, p = cfg.hidden_size, cfg.patch_size
        self.patch = nnx.Conv(cfg.num_channels, D, (p, p), strides=(p, p), padding="VALID", use_bias=True,
                              precision=_HI, param_dtype=param_dtype, rngs=rngs,
                              kernel_init=nn.logical(nnx.initializers.lecun_normal(), None, None, None, "embed"),
                              bias_init=nn.logical(nnx.initializers.zeros_init(), "embed"))
        self.pos = nn.Embed(cfg.grid**2, D, rngs=rngs, axes=(None, "embed"), std=0.02, param_dtype=param_dtype)
        self.blocks = nn.stack(lambda r: encoder.EncoderBlock(D, cfg.intermediate_size, cfg.num_heads,
                                                              act=cfg.hidden_act, eps=cfg.layer_norm_eps, rngs=r,
                                                              param_dtype=param_dtype), cfg.num_layers, rngs)
        self.post_norm = nn.LayerNorm(D, rngs=rngs, eps=cfg.layer_norm_eps, axis="embed", param_dtype=param_dtype)
        self.head = PoolingHead(cfg, rngs=rngs, param_dtype=param_dtype) if cfg.use_head else None

    def embed(self, pixel_values):
        cfg = self.cfg
        x = jnp.asarray(pixel_values, _F32)
        if x.ndim != 4 or x.shape[1] != cfg.num_channels:
            raise ValueError(f"pixel_values must be [B, {cfg.num_channels}, H, W], got {x.shape}")
        B, _, H, W = x.shape
        if (H, W) != (cfg.image_size, cfg.image_size):
            raise ValueError(f"image size {H}x{W} does not match the model's {cfg.image_size}x{cfg.image_size}; "
                             "position-embedding interpolation is not supported")
        patches = self.patch(x.transpose(0, 2, 3, 1)).reshape(B, cfg.grid**2, cfg.hidden_size)
        return patches + self.pos.embedding[...].astype(_F32)[None]

    def __call__(self, pixel_values, output_hidden_states: bool = False) -> dict:
        """pixels [B, C, H, W] (normalised, reference layout) -> dict of float32 arrays:
        ``last_hidden_state`` [B, N, D] (``post_layernorm`` applied), ``pooler_output`` [B, D]
        (with the head), ``hidden_states`` [L+1, B, N, D] (with ``output_hidden_states``; entry L
        before ``post_layernorm``, like the reference)."""
        x0 = self.embed(pixel_values)
        x, hs = encoder.run(self.blocks, x0, None, collect=output_hidden_states)
        last = self.post_norm(x)
        out = {"last_hidden_state": last}
        if self.head is not None:
            out["pooler_output"] = self.head(last)
        if output_hidden_states:
            out["hidden_states"] = jnp.concatenate([x0[None], hs], axis=0)
        return out


class SiglipVisionEncoder(nn.Split):
    """A SigLIP vision tower split once; ``enc(pixel_values, output_hidden_states=False)`` ->
    :meth:`SiglipVision.__call__`'s dict (one jitted function)."""

    def __call__(self, pixel_values, output_hidden_states: bool = False) -> dict:
        return self.apply("__call__", pixel_values, output_hidden_states=bool(output_hidden_states))


def _build(cfg: SiglipVisionConfig, seed: int = 0, dtype=np.float32):
    return lambda: SiglipVision(cfg, rngs=nnx.Rngs(seed), param_dtype=dtype)


def init(cfg: SiglipVisionConfig, seed: int = 0, dtype=np.float32) -> SiglipVisionEncoder:
    """Seeded random weights (tiny presets, tests): every parameter perturbed, made on the host."""
    from vidax.text.lm import random_params

    return from_params(cfg, random_params(param_shapes(cfg, dtype), seed, dtype=dtype))


def param_shapes(cfg: SiglipVisionConfig, dtype=np.float32) -> dict:
    return nn.shapes(_build(cfg, dtype=dtype))


def abstract(cfg: SiglipVisionConfig, dtype=np.float32) -> SiglipVisionEncoder:
    return SiglipVisionEncoder(*nn.abstract_state(_build(cfg, dtype=dtype)), cfg)


def _dtype_of(params) -> np.dtype:
    """Storage dtype of a parameter tree (the module is built with it so equal trees share compiles)."""
    return np.dtype(jax.tree.leaves(params)[0].dtype)


def from_params(cfg: SiglipVisionConfig, params: dict, device_put: bool = True) -> SiglipVisionEncoder:
    return SiglipVisionEncoder.from_pure(_build(cfg, dtype=_dtype_of(params)), params, device_put=device_put)


# ---------------------------------------------------------------------------------------------
# key maps and loading
# ---------------------------------------------------------------------------------------------
def hf_prefix(names) -> str:
    return "vision_model." if any(n.startswith("vision_model.") for n in names) else ""


def _split_in_proj(ckpt, prefix: str, D: int):
    """``head.attention.in_proj_{weight,bias}`` ([3D, D] / [3D], torch ``MultiheadAttention``) as
    three q / k / v tensors the key map can place (lazy, one slice at a time)."""
    from vidax.weights import Checkpoint, LazyTensor

    out = {n: ckpt[n] for n in ckpt}
    for kind in ("weight", "bias"):
        name = f"{prefix}head.attention.in_proj_{kind}"
        if name not in out:
            continue
        t = out.pop(name)
        shape = tuple(t.shape) if isinstance(t, LazyTensor) else np.shape(t)
        if shape[0] != 3 * D:
            raise ValueError(f"{name}: shape {list(shape)}, expected first dim {3 * D}")
        dtype = np.dtype(t.dtype) if isinstance(t, LazyTensor) else np.asarray(t).dtype
        for j, n in enumerate("qkv"):
            rows = slice(j * D, (j + 1) * D)

            def read(t=t, rows=rows):
                a = t.read() if isinstance(t, LazyTensor) else np.asarray(t)
                return np.ascontiguousarray(a[rows])

            tn = f"{prefix}head.attention.{n}_proj.{kind}"
            out[tn] = LazyTensor(tn, (D,) + tuple(shape[1:]), dtype, read)
    return Checkpoint(out, getattr(ckpt, "source", "checkpoint"))


def hf_keymap(cfg: SiglipVisionConfig, prefix: str = "vision_model.") -> KeyMap:
    """transformers naming under ``prefix`` (the head's fused ``in_proj`` is split first by
    :func:`load_params_from`). Ignored: a ``SiglipModel``'s text half, ``logit_scale`` /
    ``logit_bias``, the ``position_ids`` buffer."""
    p = prefix
    rules = [Rule(p + "embeddings.patch_embedding.weight", "patch.kernel", "conv2d"),
             Rule(p + "embeddings.patch_embedding.bias", "patch.bias"),
             Rule(p + "embeddings.position_embedding.weight", "pos.embedding"),
             Rule(p + "post_layernorm.weight", "post_norm.scale"),
             Rule(p + "post_layernorm.bias", "post_norm.bias")] + encoder.block_rules(p + "encoder.")
    ignore = [r"position_ids$", r"^text_model\.", r"^logit_(scale|bias)$"]
    if cfg.use_head:
        h = p + "head."
        rules += [Rule(h + "probe", "head.probe"), Rule(h + "layernorm.weight", "head.norm.scale"),
                  Rule(h + "layernorm.bias", "head.norm.bias"),
                  Rule(h + "attention.out_proj.weight", "head.o.kernel", "linear"),
                  Rule(h + "attention.out_proj.bias", "head.o.bias")]
        rules += [Rule(h + f"attention.{n}_proj.weight", f"head.{n}.kernel", "linear") for n in "qkv"]
        rules += [Rule(h + f"attention.{n}_proj.bias", f"head.{n}.bias") for n in "qkv"]
        for f in ("fc1", "fc2"):
            rules += [Rule(h + f"mlp.{f}.weight", f"head.{f}.kernel", "linear"), Rule(h + f"mlp.{f}.bias", f"head.{f}.bias")]
    else:
        ignore.append(r"(^|\.)head\.")
    return KeyMap(rules, ignore=ignore)


def load_params_from(ckpt, cfg: SiglipVisionConfig, dtype=np.float32) -> dict:
    prefix = hf_prefix(list(ckpt))
    src = getattr(ckpt, "source", "checkpoint")
    tensors = _split_in_proj(ckpt, prefix, cfg.hidden_size) if cfg.use_head else ckpt
    what = f"SigLIP vision tower (prefix {prefix!r}, from {src})"
    return load_params(tensors, hf_keymap(cfg, prefix), param_shapes(cfg, dtype), dtype=dtype, what=what)


def load_siglip(path, cfg: SiglipVisionConfig | None = None, dtype=np.float32, device_put: bool = True) -> SiglipVisionEncoder:
    """A SigLIP vision tower from a transformers folder (a diffusers pipeline folder's
    ``image_encoder/`` is found). ``dtype``: storage dtype (compute is float32)."""
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists() and (p / "image_encoder" / "config.json").exists():
        p = p / "image_encoder"
    if cfg is None:
        cfg = SiglipVisionConfig.from_hf(json.loads((p / "config.json").read_text()))
    return from_params(cfg, load_params_from(open_checkpoint(p), cfg, dtype=dtype), device_put=device_put)


# ---------------------------------------------------------------------------------------------
# image preprocessing (transformers SiglipImageProcessor)
# ---------------------------------------------------------------------------------------------
def preprocess(images, size: int = 384, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> np.ndarray:
    """Images -> ``pixel_values`` float32 [B, 3, size, size] as ``SiglipImageProcessor`` (PIL
    backend) makes them: resize to ``size`` x ``size`` (no aspect preservation, no crop) with PIL
    bicubic, rescale by 1/255, normalise. ``images``: PIL images or uint8 arrays [H, W, C] /
    [B, H, W, C] (an alpha channel is composited onto white). Needs Pillow."""
    from vidax.text.clip import _as_list, _pil, to_rgb_uint8

    Image = _pil()
    m, s = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    out = []
    for img in _as_list(images):
        a = to_rgb_uint8(img)
        if a.shape[:2] != (size, size):
            a = np.asarray(Image.fromarray(a).resize((size, size), resample=Image.Resampling.BICUBIC))
        x = (a.astype(np.float64) * (1 / 255)).astype(np.float32)
        out.append(((x - m) / s).transpose(2, 0, 1))
    if not out:
        raise ValueError("preprocess: no images")
    return np.ascontiguousarray(np.stack(out))


# ---------------------------------------------------------------------------------------------
# compat adapter
# ---------------------------------------------------------------------------------------------
class _SiglipCompat(CompatModel):
    """``forward(pixel_values=...)`` -> ``last_hidden_state``; ``outputs(...)`` / ``cm(...)`` ->
    ``last_hidden_state``, ``pooler_output`` and (``output_hidden_states``) ``hidden_states``."""

    def __init__(self, name: str, config: dict, enc: SiglipVisionEncoder):
        super().__init__(name, config, enc.state, model_config=enc.cfg)
        self.encoder = enc

    def outputs(self, pixel_values=None, output_hidden_states=False, interpolate_pos_encoding=False, **kwargs) -> Output:
        check_kwargs(self.name, kwargs)
        if pixel_values is None:
            raise ValueError("pixel_values is required")
        if interpolate_pos_encoding:
            raise ValueError(f"{self.name}: interpolate_pos_encoding is not supported")
        out = self.encoder(np.asarray(pixel_values, np.float32), output_hidden_states=bool(output_hidden_states))
        res = Output(last_hidden_state=np.asarray(out["last_hidden_state"]))
        res["pooler_output"] = np.asarray(out["pooler_output"]) if "pooler_output" in out else None
        if output_hidden_states:
            res["hidden_states"] = tuple(np.asarray(out["hidden_states"]))
        return res

    __call__ = outputs

    def forward(self, pixel_values=None, output_hidden_states=False, interpolate_pos_encoding=False, **kwargs):
        return self.outputs(pixel_values, False, interpolate_pos_encoding, **kwargs).last_hidden_state


@register("SiglipVisionModel")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **kw) -> CompatModel:
    cfg = SiglipVisionConfig.from_hf(config)
    name = (config.get("architectures") or ["SiglipVisionModel"])[0]
    return _SiglipCompat(name, config, from_params(cfg, load_params_from(open_checkpoint(folder), cfg, dtype=dtype)))


__all__ = ["SiglipVisionConfig", "SiglipVision", "SiglipVisionEncoder", "PoolingHead", "init", "param_shapes",
           "abstract", "from_params", "hf_prefix", "hf_keymap", "load_params_from", "load_siglip", "preprocess"]
