"""CLIP ViT vision tower (transformers ``CLIPVisionModel``), as Wan2.1 image-to-video uses it, in float32.

Wan2.1 I2V conditions on the **penultimate** hidden state of an open-clip XLM-RoBERTa ViT-H/14
image encoder: diffusers' ``WanImageToVideoPipeline`` calls
``image_encoder(**image, output_hidden_states=True).hidden_states[-2]``, the original release runs
``visual(x, use_31_block=True)`` (the first 31 of its 32 blocks). Both are the output of the
second-to-last encoder layer, before ``post_layernorm``; :meth:`CLIPVision.penultimate` computes exactly that
and runs only ``num_layers - 1`` layers.

The model is a Flax NNX module (:class:`CLIPVision`); its layers are stacked along a leading
layer axis (``nn.stack``) and run with a scan. The state, as ``nnx.to_pure_dict`` nests it::

    {"patch": {"kernel": [p, p, C, D]},             # stride = kernel conv, no bias
     "cls": [D], "pos": [1 + (S/p)^2, D],
     "pre_norm": {"scale": [D], "bias": [D]},
     "blocks": {"norm1"/"norm2": {"scale": [N, D], "bias": [N, D]},
                "q"/"k"/"v"/"o": {"kernel": [N, D, D], "bias": [N, D]},
                "fc1": {"kernel": [N, D, F], "bias": [N, F]}, "fc2": {"kernel": [N, F, D], "bias": [N, D]}},
     "post_norm": {"scale": [D], "bias": [D]},
     "proj": {"kernel": [D, P]}}                    # CLIPVisionModelWithProjection / Wan's head only

Parameters carry logical axis names (``embed``, ``heads``, ``ffn``; ``layers`` on the stack). A
loaded tower is a :class:`CLIPVisionEncoder`: the module split once, called through one jitted
pure function of its state. Everything is computed in float32 at ``Precision.HIGHEST`` whatever
the parameter dtype.

Two checkpoint namings are understood:

- transformers' (:func:`hf_keymap`), with the ``vision_model.`` prefix (hub checkpoints,
  ``CLIPVisionModelWithProjection``, a full ``CLIPModel`` whose text half is ignored) or without it
  (what transformers 5 ``CLIPVisionModel.save_pretrained`` writes);
- the original Wan2.1 release ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``
  (``wan/modules/clip.py``: ``XLMRobertaCLIP.visual``). That file fuses q/k/v into one
  ``attn.to_qkv`` and stores ``cls_embedding`` / ``pos_embedding`` with leading singleton axes, which
  the declarative :class:`~vidax.weights.KeyMap` cannot express; :func:`wan_to_hf` therefore
  renames / splits / reshapes it on the host into transformers naming (lazily, one tensor at a time)
  after checking it against :func:`wan_expected_shapes`, and the transformers key map does the rest.
  ``textual.*`` and ``log_scale`` (the text tower) are ignored.

Image preprocessing (:func:`preprocess`) reproduces transformers' ``CLIPImageProcessor`` (PIL
backend) as the diffusers pipeline applies it; it needs Pillow.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax.compat import CompatModel, register
from vidax.core import nn
from vidax.core.attention import attention
from vidax.core.nn import ACTIVATIONS
from vidax.weights import KeyMap, LazyTensor, Rule, load_params, open_checkpoint
from vidax.weights.keymap import mismatch_error

_F32 = jnp.float32

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAI_CLIP_MEAN
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)  # OPENAI_CLIP_STD


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
_HF_DEFAULTS = dict(  # transformers CLIPVisionConfig defaults
    image_size=224, patch_size=32, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
    num_attention_heads=12, num_channels=3, layer_norm_eps=1e-5, hidden_act="quick_gelu", projection_dim=512,
)
_WITH_PROJECTION = ("CLIPVisionModelWithProjection", "CLIPModel")


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig:
    image_size: int = 224
    patch_size: int = 32
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    projection_dim: int | None = None  # set: the model has a visual projection (image_embeds)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"CLIP: unsupported hidden_act {self.hidden_act!r}; known: {sorted(ACTIVATIONS)}")
        if self.num_layers < 1 or self.image_size < self.patch_size:
            raise ValueError("CLIP: need num_layers >= 1 and image_size >= patch_size")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def seq_len(self) -> int:
        return self.grid**2 + 1

    @classmethod
    def from_hf(cls, config: dict, with_projection: bool | None = None) -> "CLIPVisionConfig":
        """From a transformers ``CLIPVisionConfig`` dict, or a ``CLIPConfig`` dict (its ``vision_config``).

        ``with_projection`` (default: from ``architectures``): keep ``projection_dim``, i.e. expect
        ``visual_projection`` (``CLIPVisionModelWithProjection``, ``CLIPModel``)."""
        archs = [str(a) for a in (config.get("architectures") or [])]
        c = dict(config.get("vision_config") or {}) if "vision_config" in config else dict(config)
        if with_projection is None:
            with_projection = any(a in _WITH_PROJECTION for a in archs)
        if "vision_config" in config and config.get("projection_dim") is not None:
            c["projection_dim"] = config["projection_dim"]  # CLIPModel's visual_projection uses the top level
        kw = {k: (c[k] if c.get(k) is not None else v) for k, v in _HF_DEFAULTS.items()}
        return cls(image_size=kw["image_size"], patch_size=kw["patch_size"], hidden_size=kw["hidden_size"],
                   intermediate_size=kw["intermediate_size"], num_layers=kw["num_hidden_layers"],
                   num_heads=kw["num_attention_heads"], num_channels=kw["num_channels"],
                   layer_norm_eps=float(kw["layer_norm_eps"]), hidden_act=kw["hidden_act"],
                   projection_dim=kw["projection_dim"] if with_projection else None)


# The vision tower of Wan2.1's open-clip XLM-RoBERTa-large ViT-H/14 (clip_xlm_roberta_vit_h_14 in
# wan/modules/clip.py: vision_dim 1280, mlp_ratio 4, 16 heads, 32 layers, patch 14, 224 px, exact
# GELU, LayerNorm eps 1e-5, pre-norm, 'token' pooling, head 1280 -> embed_dim 1024).
WAN_VIT_H_14 = CLIPVisionConfig(image_size=224, patch_size=14, hidden_size=1280, intermediate_size=5120,
                                num_layers=32, num_heads=16, num_channels=3, layer_norm_eps=1e-5,
                                hidden_act="gelu", projection_dim=1024)


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
class CLIPBlock(nnx.Module):
    """One pre-LN encoder layer: self-attention, then the MLP (``fc2(act(fc1(x)))``), both residual."""

    def __init__(self, cfg: CLIPVisionConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.cfg = cfg
        D, F = cfg.hidden_size, cfg.intermediate_size
        lin = partial(nn.Linear, rngs=rngs, param_dtype=param_dtype, precision=jax.lax.Precision.HIGHEST)
        norm = partial(nn.LayerNorm, D, rngs=rngs, eps=cfg.layer_norm_eps, axis="embed", param_dtype=param_dtype)
        self.norm1 = norm()
        self.q, self.k, self.v = (lin(D, D, axes=("embed", "heads")) for _ in range(3))
        self.o = lin(D, D, axes=("heads", "embed"))
        self.norm2 = norm()
        self.fc1 = lin(D, F, axes=("embed", "ffn"))
        self.fc2 = lin(F, D, axes=("ffn", "embed"))

    def __call__(self, x):
        cfg = self.cfg
        B, L, D = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).reshape(B, L, cfg.num_heads, cfg.head_dim) for p in (self.q, self.k, self.v))
        a = attention(q, k, v, scale=cfg.head_dim**-0.5, impl="xla")
        x = x + self.o(a.reshape(B, L, D))
        return x + self.fc2(ACTIVATIONS[cfg.hidden_act](self.fc1(self.norm2(x))))


class CLIPVision(nnx.Module):
    """The vision tower: patch embedding (a stride = kernel convolution without bias), class token,
    learned positions, pre-LN; ``num_layers`` stacked :class:`CLIPBlock` run by a scan; post-LN of
    the class token; the visual projection (``projection_dim`` set). Computes in float32 whatever
    the parameters' dtype."""

    def __init__(self, cfg: CLIPVisionConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.cfg = cfg
        D, p = cfg.hidden_size, cfg.patch_size
        self.patch = nnx.Conv(cfg.num_channels, D, (p, p), strides=(p, p), padding="VALID", use_bias=False,
                              precision=jax.lax.Precision.HIGHEST, param_dtype=param_dtype, rngs=rngs,
                              kernel_init=nn.logical(nnx.initializers.lecun_normal(), None, None, None, "embed"))
        self.cls = nnx.Param(nn.logical(nnx.initializers.normal(D**-0.5), "embed")(rngs.params(), (D,), param_dtype))
        self.pos = nnx.Param(nn.logical(nnx.initializers.normal(0.02), None, "embed")(
            rngs.params(), (cfg.seq_len, D), param_dtype))
        norm = partial(nn.LayerNorm, D, rngs=rngs, eps=cfg.layer_norm_eps, axis="embed", param_dtype=param_dtype)
        self.pre_norm = norm()
        self.blocks = nn.stack(lambda r: CLIPBlock(cfg, rngs=r, param_dtype=param_dtype), cfg.num_layers, rngs)
        self.post_norm = norm()
        self.proj = None if cfg.projection_dim is None else nn.Linear(
            D, cfg.projection_dim, rngs=rngs, axes=("embed", None), bias=False, param_dtype=param_dtype,
            precision=jax.lax.Precision.HIGHEST)

    def embed(self, pixel_values):
        """Pixels [B, C, H, W] (reference layout, normalised) -> pre-normed tokens [B, 1 + grid^2, D]:
        ``hidden_states[0]`` of the reference."""
        cfg = self.cfg
        x = jnp.asarray(pixel_values, _F32)
        if x.ndim != 4 or x.shape[1] != cfg.num_channels:
            raise ValueError(f"pixel_values must be [B, {cfg.num_channels}, H, W], got {x.shape}")
        B, _, H, W = x.shape
        if (H, W) != (cfg.image_size, cfg.image_size):
            raise ValueError(f"Input image size ({H}*{W}) doesn't match model ({cfg.image_size}*{cfg.image_size}); "
                             "position-embedding interpolation is not supported")
        patches = self.patch(x.transpose(0, 2, 3, 1)).reshape(B, cfg.grid**2, cfg.hidden_size)
        cls = jnp.broadcast_to(self.cls[...].astype(_F32), (B, 1, cfg.hidden_size))
        return self.pre_norm(jnp.concatenate([cls, patches], axis=1) + self.pos[...].astype(_F32)[None])

    def _layers(self, x, start: int, stop: int, collect: bool = False):
        """Layers ``start .. stop-1``: (output, per-layer outputs [stop-start, B, L, D] or None)."""
        return nn.scan_range(self.blocks, x, lambda block, h: block(h), start, stop, collect=collect)

    def __call__(self, pixel_values, output_hidden_states: bool = False) -> dict:
        """Pixels [B, C, H, W] (normalised, reference layout) -> dict of float32 arrays:

        - ``last_hidden_state`` [B, L, D] (no final norm, like the reference);
        - ``pooler_output`` [B, D]: ``post_layernorm`` of the class token;
        - ``penultimate`` [B, L, D]: ``hidden_states[-2]``, what Wan2.1 I2V conditions on;
        - ``image_embeds`` [B, P]: the visual projection of ``pooler_output`` (models with a projection);
        - ``hidden_states`` [N + 1, B, L, D] (with ``output_hidden_states``): the reference's
          ``hidden_states`` tuple, stacked (entry 0 = pre-normed embeddings).
        """
        n = self.cfg.num_layers
        x0 = self.embed(pixel_values)
        pen, hs = self._layers(x0, 0, n - 1, collect=output_hidden_states)
        last, _ = self._layers(pen, n - 1, n)
        pooled = self.post_norm(last[:, 0])
        out = {"last_hidden_state": last, "pooler_output": pooled, "penultimate": pen}
        if self.proj is not None:
            out["image_embeds"] = self.proj(pooled)
        if output_hidden_states:
            out["hidden_states"] = jnp.concatenate([x0[None], hs, last[None]], axis=0)
        return out

    def penultimate(self, pixel_values):
        """``hidden_states[-2]`` [B, L, D] float32 (Wan2.1 I2V image tokens): runs only
        ``num_layers - 1`` encoder layers; ``post_layernorm`` and the projection are not applied."""
        return self._layers(self.embed(pixel_values), 0, self.cfg.num_layers - 1)[0]


class CLIPVisionEncoder(nn.Split):
    """A CLIP vision tower split once (``graphdef``, ``state``, ``cfg``); its calls are one jitted
    pure function of the state. Calling it returns :meth:`CLIPVision.__call__`'s dict;
    :meth:`penultimate` gives only ``hidden_states[-2]`` (Wan2.1 I2V)."""

    def __call__(self, pixel_values, output_hidden_states: bool = False) -> dict:
        return self.apply("__call__", pixel_values, output_hidden_states=bool(output_hidden_states))

    def penultimate(self, pixel_values):
        return self.apply("penultimate", pixel_values)


def _build(cfg: CLIPVisionConfig, seed: int = 0, dtype=np.float32):
    return lambda: CLIPVision(cfg, rngs=nnx.Rngs(seed), param_dtype=dtype)


def init(cfg: CLIPVisionConfig, seed: int = 0, dtype=np.float32) -> CLIPVisionEncoder:
    """Seeded random weights (tiny presets, tests): every parameter perturbed (nothing zero or one)."""
    return CLIPVisionEncoder.of(nn.perturb(_build(cfg, seed, dtype)(), seed))


def param_shapes(cfg: CLIPVisionConfig, dtype=np.float32) -> dict:
    """Every parameter as a ``jax.ShapeDtypeStruct``, nested like the NNX state (the key maps' target)."""
    return nn.shapes(_build(cfg, dtype=dtype))


def abstract(cfg: CLIPVisionConfig, dtype=np.float32) -> CLIPVisionEncoder:
    """An encoder whose state holds only ``jax.ShapeDtypeStruct`` s (shape checks with
    ``jax.eval_shape``; nothing allocated)."""
    return CLIPVisionEncoder(*nn.abstract_state(_build(cfg, dtype=dtype)), cfg)


# ---------------------------------------------------------------------------------------------
# key maps
# ---------------------------------------------------------------------------------------------
HF_PREFIX = "vision_model."


def hf_keymap(cfg: CLIPVisionConfig, prefix: str = HF_PREFIX) -> KeyMap:
    """transformers naming. ``prefix``: ``"vision_model."`` (hub checkpoints, ``...WithProjection``,
    ``CLIPModel``) or ``""`` (transformers 5 ``CLIPVisionModel.save_pretrained``).

    Ignored: the non-persistent ``position_ids`` buffer older versions saved, a full ``CLIPModel``'s
    text half, and ``visual_projection`` when the config has no projection."""
    P, b = prefix, prefix + "encoder.layers.{i}"
    rules = [
        Rule(f"{P}embeddings.patch_embedding.weight", "patch.kernel", "conv2d"),
        Rule(f"{P}embeddings.class_embedding", "cls"),
        Rule(f"{P}embeddings.position_embedding.weight", "pos"),
        Rule(f"{P}pre_layrnorm.weight", "pre_norm.scale"),
        Rule(f"{P}pre_layrnorm.bias", "pre_norm.bias"),
        Rule(f"{P}post_layernorm.weight", "post_norm.scale"),
        Rule(f"{P}post_layernorm.bias", "post_norm.bias"),
    ]
    for ours, theirs in (("norm1", "layer_norm1"), ("norm2", "layer_norm2")):
        rules += [Rule(f"{b}.{theirs}.weight", f"blocks.{ours}.scale"), Rule(f"{b}.{theirs}.bias", f"blocks.{ours}.bias")]
    for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                         ("o", "self_attn.out_proj"), ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2")):
        rules += [Rule(f"{b}.{theirs}.weight", f"blocks.{ours}.kernel", "linear"),
                  Rule(f"{b}.{theirs}.bias", f"blocks.{ours}.bias")]
    ignore = [r"(^|\.)embeddings\.position_ids$", r"^text_model\.", r"^text_projection\.", r"^logit_scale$"]
    if cfg.projection_dim is not None:
        rules.append(Rule("visual_projection.weight", "proj.kernel", "linear"))
    else:
        ignore.append(r"^visual_projection\.")
    return KeyMap(rules, ignore=ignore)


WAN_PREFIX = "visual."
WAN_IGNORE = re.compile(r"^(textual\.|log_scale$)")


def wan_expected_shapes(cfg: CLIPVisionConfig) -> dict[str, tuple]:
    """Every tensor of the original release's vision tower (``visual.*``) for ``cfg``, with its
    shape in that file's layout (``wan/modules/clip.py``: ``VisionTransformer`` with ``pre_norm=True``,
    so the patch conv has no bias; ``head`` is a bare ``[dim, out_dim]`` parameter)."""
    D, F, p, C, S = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.num_channels, cfg.seq_len
    v = WAN_PREFIX
    out = {
        f"{v}patch_embedding.weight": (D, C, p, p), f"{v}cls_embedding": (1, 1, D), f"{v}pos_embedding": (1, S, D),
        f"{v}pre_norm.weight": (D,), f"{v}pre_norm.bias": (D,),
        f"{v}post_norm.weight": (D,), f"{v}post_norm.bias": (D,),
    }
    for i in range(cfg.num_layers):
        t = f"{v}transformer.{i}."
        out.update({
            t + "norm1.weight": (D,), t + "norm1.bias": (D,),
            t + "attn.to_qkv.weight": (3 * D, D), t + "attn.to_qkv.bias": (3 * D,),
            t + "attn.proj.weight": (D, D), t + "attn.proj.bias": (D,),
            t + "norm2.weight": (D,), t + "norm2.bias": (D,),
            t + "mlp.0.weight": (F, D), t + "mlp.0.bias": (F,), t + "mlp.2.weight": (D, F), t + "mlp.2.bias": (D,),
        })
    if cfg.projection_dim is not None:
        out[f"{v}head"] = (D, cfg.projection_dim)
    return out


def _shape(t) -> tuple:
    return tuple(t.shape) if isinstance(t, LazyTensor) else tuple(np.shape(t))


def _read(t) -> np.ndarray:
    return t.read() if isinstance(t, LazyTensor) else np.asarray(t)


def wan_to_hf(ckpt, cfg: CLIPVisionConfig) -> dict[str, LazyTensor]:
    """The original release's vision tower as a transformers-named (``vision_model.`` prefix) mapping
    of lazy tensors: ``to_qkv`` split into q/k/v (rows ``[0:D]``, ``[D:2D]``, ``[2D:3D]``, as Wan's
    ``view(b, s, 3, n, d)`` reads them), singleton axes of ``cls_embedding`` / ``pos_embedding``
    dropped, ``head [D, P]`` transposed to ``visual_projection.weight [P, D]``.

    Checks the file first: raises :class:`CheckpointMismatchError` naming missing, unexpected and
    mis-shaped tensors in the release's own names. The text tower and ``log_scale`` are ignored
    (``visual.head`` too when ``cfg`` has no projection)."""
    want = wan_expected_shapes(cfg)
    missing = [n for n in want if n not in ckpt]
    unexpected, misshaped = [], []
    for n in ckpt:
        if n in want:
            if _shape(ckpt[n]) != want[n]:
                misshaped.append(f"{n} (shape {list(_shape(ckpt[n]))}, expected {list(want[n])})")
        elif not (WAN_IGNORE.match(n) or (n == f"{WAN_PREFIX}head" and cfg.projection_dim is None)):
            unexpected.append(n)
    if missing or unexpected or misshaped:
        raise mismatch_error(getattr(ckpt, "source", "checkpoint"), "CLIP vision tower (Wan naming)",
                             missing, unexpected, misshaped)

    D, v, P = cfg.hidden_size, WAN_PREFIX, HF_PREFIX
    out: dict[str, LazyTensor] = {}

    def put(name, src, fn, shape):
        t = ckpt[src]
        dtype = t.dtype if isinstance(t, LazyTensor) else np.asarray(t).dtype
        out[name] = LazyTensor(name, tuple(shape), np.dtype(dtype),
                               lambda t=t, fn=fn: np.ascontiguousarray(fn(_read(t))))

    same = lambda a: a  # noqa: E731
    put(f"{P}embeddings.patch_embedding.weight", f"{v}patch_embedding.weight", same, want[f"{v}patch_embedding.weight"])
    put(f"{P}embeddings.class_embedding", f"{v}cls_embedding", lambda a: a.reshape(D), (D,))
    put(f"{P}embeddings.position_embedding.weight", f"{v}pos_embedding", lambda a: a.reshape(cfg.seq_len, D),
        (cfg.seq_len, D))
    for theirs, ours in (("pre_norm", "pre_layrnorm"), ("post_norm", "post_layernorm")):
        for s in ("weight", "bias"):
            put(f"{P}{ours}.{s}", f"{v}{theirs}.{s}", same, (D,))
    ren = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
           "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2"}
    for i in range(cfg.num_layers):
        t, h = f"{v}transformer.{i}.", f"{P}encoder.layers.{i}."
        for theirs, ours in ren.items():
            for s in ("weight", "bias"):
                put(h + f"{ours}.{s}", t + f"{theirs}.{s}", same, want[t + f"{theirs}.{s}"])
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            rows = slice(j * D, (j + 1) * D)
            put(h + f"self_attn.{name}.weight", t + "attn.to_qkv.weight", lambda a, r=rows: a[r], (D, D))
            put(h + f"self_attn.{name}.bias", t + "attn.to_qkv.bias", lambda a, r=rows: a[r], (D,))
    if cfg.projection_dim is not None:
        put("visual_projection.weight", f"{v}head", lambda a: a.T, (cfg.projection_dim, D))
    return out


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------
def detect_naming(names) -> str:
    """``"wan"`` (original release, ``visual.*``) or ``"hf"`` (transformers, either prefix)."""
    names = set(names)
    if f"{WAN_PREFIX}cls_embedding" in names or any(n.startswith(f"{WAN_PREFIX}transformer.") for n in names):
        return "wan"
    if any(n.endswith("embeddings.class_embedding") or ".encoder.layers." in f".{n}" for n in names):
        return "hf"
    raise ValueError("checkpoint is neither a transformers- nor a Wan-named CLIP vision tower "
                     f"(first names: {sorted(names)[:5]})")


def hf_prefix(names) -> str:
    return HF_PREFIX if any(n.startswith(HF_PREFIX) for n in names) else ""


# head count per width: open-clip ViTs use 64-wide heads up to ViT-L and 16 heads from ViT-H on
_HEADS_BY_WIDTH = {1280: 16, 1408: 16, 1664: 16}


def infer_config(ckpt, num_heads: int | None = None) -> CLIPVisionConfig:
    """Architecture of an original-release (Wan-named) file from its tensor shapes.

    Exact for Wan2.1's ViT-H/14 (gives :data:`WAN_VIT_H_14`): the release's code fixes exact GELU and
    eps 1e-5. The head count is not stored in the weights: ``num_heads`` or 16 for widths 1280 / 1408
    / 1664, else ``width // 64``. transformers-named files need their ``config.json``."""
    names = list(ckpt)
    if detect_naming(names) != "wan":
        raise ValueError("a transformers-named CLIP checkpoint needs its config.json (or pass cfg=)")
    v = WAN_PREFIX
    D, C, p, _ = _shape(ckpt[f"{v}patch_embedding.weight"])
    S = _shape(ckpt[f"{v}pos_embedding"])[1]
    grid = math.isqrt(S - 1)
    if grid * grid != S - 1:
        raise ValueError(f"{v}pos_embedding has {S} positions: not 1 + a square grid")
    F = _shape(ckpt[f"{v}transformer.0.mlp.0.weight"])[0]
    pat = re.compile(rf"^{re.escape(v)}transformer\.(\d+)\.")
    N = max(int(m.group(1)) for n in names if (m := pat.match(n))) + 1
    head = f"{v}head"
    proj = _shape(ckpt[head])[1] if head in ckpt and len(_shape(ckpt[head])) == 2 else None
    H = num_heads or _HEADS_BY_WIDTH.get(D, max(1, D // 64))
    return CLIPVisionConfig(image_size=grid * p, patch_size=p, hidden_size=D, intermediate_size=F, num_layers=N,
                            num_heads=H, num_channels=C, layer_norm_eps=1e-5, hidden_act="gelu",
                            projection_dim=proj)


def load_params_from(ckpt, cfg: CLIPVisionConfig, dtype=np.float32, naming: str | None = None) -> dict:
    """Read a checkpoint (an opened ``Checkpoint`` or a name -> array mapping) into the tower's
    state as a nested dict of host numpy arrays (``nnx.to_pure_dict`` layout), cast to ``dtype``."""
    naming = naming or detect_naming(list(ckpt))
    if naming == "wan":
        src = getattr(ckpt, "source", "checkpoint")
        ckpt = wan_to_hf(ckpt, cfg)
        return load_params(ckpt, hf_keymap(cfg, HF_PREFIX), param_shapes(cfg, dtype), dtype=dtype,
                           what=f"CLIP vision tower (Wan naming, from {src})")
    if naming != "hf":
        raise ValueError(f"unknown naming {naming!r}")
    return load_params(ckpt, hf_keymap(cfg, hf_prefix(list(ckpt))), param_shapes(cfg, dtype), dtype=dtype,
                       what="CLIP vision tower (transformers naming)")


def from_params(cfg: CLIPVisionConfig, params: dict, device_put: bool = True) -> CLIPVisionEncoder:
    """A tower whose state is ``params`` (:func:`load_params_from`'s nested dict); no random
    weights are created."""
    return CLIPVisionEncoder.from_pure(_build(cfg), params, device_put=device_put)


def load_clip(path, cfg: CLIPVisionConfig | None = None, dtype=np.float32, device_put: bool = True,
              num_heads: int | None = None) -> CLIPVisionEncoder:
    """Load a CLIP vision tower from a transformers folder (``config.json`` + safetensors; a diffusers
    pipeline folder's ``image_encoder/`` is found) or a single checkpoint file, e.g. Wan2.1's original
    ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`` (config inferred from its shapes:
    ViT-H/14, 32 layers, width 1280, 16 heads, exact GELU, projection 1024; Wan uses the penultimate
    layer, see :meth:`CLIPVisionEncoder.penultimate`). ``dtype``: parameter storage dtype (compute is
    float32)."""
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists() and (p / "image_encoder" / "config.json").exists():
        p = p / "image_encoder"
    if p.is_dir() and cfg is None and (p / "config.json").exists():
        cfg = CLIPVisionConfig.from_hf(json.loads((p / "config.json").read_text()))
    ckpt = open_checkpoint(p)
    if cfg is None:
        cfg = infer_config(ckpt, num_heads=num_heads)
    return from_params(cfg, load_params_from(ckpt, cfg, dtype=dtype), device_put=device_put)


# ---------------------------------------------------------------------------------------------
# image preprocessing (transformers CLIPImageProcessor, PIL backend)
# ---------------------------------------------------------------------------------------------
def _pil():
    try:
        import PIL.Image
    except ImportError as e:  # pragma: no cover
        raise ImportError("vidax.text.clip.preprocess needs Pillow (pip install pillow)") from e
    return PIL.Image


def to_rgb_uint8(img) -> np.ndarray:
    """One image -> uint8 [H, W, 3], converted as the reference converts it (alpha onto white)."""
    Image = _pil()
    if isinstance(img, Image.Image):
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return np.asarray(img.convert("RGB"))
    a = np.asarray(img)
    if a.dtype.kind == "f" or a.dtype == np.bool_:
        raise TypeError("preprocess takes uint8 images (channels last) or PIL images; convert float frames first, "
                        "e.g. np.round((x + 1) * 127.5).astype(np.uint8) for [-1, 1]")
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3, 4):
        raise ValueError(f"expected an image [H, W, 1|3|4] (channels last), got shape {a.shape}")
    if a.dtype != np.uint8:
        if a.min() < 0 or a.max() > 255:
            raise ValueError(f"integer image values outside [0, 255]: [{a.min()}, {a.max()}]")
        a = a.astype(np.uint8)
    if a.shape[-1] == 1:
        return np.repeat(a, 3, axis=-1)
    if a.shape[-1] == 4:
        alpha = a[..., 3:4] / 255
        return np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return a


def _as_list(images) -> list:
    Image = _pil()
    if isinstance(images, Image.Image):
        return [images]
    if isinstance(images, np.ndarray) or hasattr(images, "__array__") and not isinstance(images, (list, tuple)):
        a = np.asarray(images)
        if a.ndim == 4:
            return list(a)
        return [a]
    return list(images)


def preprocess(images, size: int = 224, crop_size: int = 224, mean=CLIP_MEAN, std=CLIP_STD) -> np.ndarray:
    """Images -> ``pixel_values`` float32 [B, 3, crop_size, crop_size], as transformers'
    ``CLIPImageProcessor`` (PIL backend, the defaults in Wan2.1 I2V's ``image_processor``) makes them:
    resize the shortest side to ``size`` (longer side ``int(size * long / short)``) with PIL bicubic
    (antialiased), center crop (zero padding if the crop is larger), rescale by 1/255, normalise
    with the CLIP mean / std.

    ``images``: a PIL image, a uint8 array [H, W, C] or [B, H, W, C] (channels last, C = 1, 3 or 4; an
    alpha channel is composited onto white like the reference), or a list of those. Needs Pillow."""
    Image = _pil()
    mean32, std32 = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    out = []
    for img in _as_list(images):
        a = to_rgb_uint8(img)
        h, w = a.shape[:2]
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = size, int(size * long / short)
        nh, nw = (new_long, new_short) if w <= h else (new_short, new_long)
        if (nh, nw) != (h, w):
            a = np.asarray(Image.fromarray(a).resize((nw, nh), resample=Image.Resampling.BICUBIC))
        a = _center_crop(a, crop_size, crop_size)
        x = (a.astype(np.float64) * (1 / 255)).astype(np.float32)
        x = (x - mean32) / std32
        out.append(x.transpose(2, 0, 1))
    if not out:
        raise ValueError("preprocess: no images")
    return np.ascontiguousarray(np.stack(out))


def _center_crop(a: np.ndarray, ch: int, cw: int) -> np.ndarray:
    h, w = a.shape[:2]
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0:
        return a[top: top + ch, left: left + cw]
    nh, nw = max(ch, h), max(cw, w)
    tp, lp = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    padded = np.zeros((nh, nw) + a.shape[2:], a.dtype)
    padded[tp: tp + h, lp: lp + w] = a
    top, left = top + tp, left + lp
    return padded[max(top, 0): max(top, 0) + ch, max(left, 0): max(left, 0) + cw]


# ---------------------------------------------------------------------------------------------
# compat adapter (transformers calling convention)
# ---------------------------------------------------------------------------------------------
class _CLIPVisionCompat(CompatModel):
    """``forward(pixel_values=...)`` returns the first element of the reference's
    ``return_dict=False`` tuple: ``last_hidden_state`` (``CLIPVisionModel``) or ``image_embeds``
    (``CLIPVisionModelWithProjection``). The other outputs: :meth:`outputs` (all, as a dict; with
    ``output_hidden_states`` the ``hidden_states`` tuple) and :meth:`penultimate`
    (``hidden_states[-2]``, only ``num_layers - 1`` layers run)."""

    def __init__(self, name: str, config: dict, encoder: CLIPVisionEncoder):
        super().__init__(name, config, encoder.state, model_config=encoder.cfg)
        self.encoder = encoder

    def _pixels(self, pixel_values):
        if pixel_values is None:
            raise ValueError("pixel_values is required")
        return np.asarray(pixel_values, np.float32)

    def outputs(self, pixel_values=None, output_hidden_states: bool = False) -> dict:
        out = self.encoder(self._pixels(pixel_values), output_hidden_states=bool(output_hidden_states))
        res = {k: np.asarray(v) for k, v in out.items() if k != "hidden_states"}
        if output_hidden_states:
            res["hidden_states"] = tuple(np.asarray(out["hidden_states"]))
        return res

    def forward(self, pixel_values=None, interpolate_pos_encoding=False, **kwargs) -> np.ndarray:
        for k, v in kwargs.items():
            if v is not None and k not in ("return_dict", "output_hidden_states", "output_attentions"):
                raise TypeError(f"{self.name}.forward: unsupported argument {k!r}")
        if kwargs.get("output_attentions"):
            raise ValueError(f"{self.name}: output_attentions is not supported")
        if interpolate_pos_encoding:
            raise ValueError(f"{self.name}: interpolate_pos_encoding is not supported")
        out = self.encoder(self._pixels(pixel_values))
        return np.asarray(out["image_embeds" if self.model_config.projection_dim is not None else "last_hidden_state"])

    def penultimate(self, pixel_values) -> np.ndarray:
        return np.asarray(self.encoder.penultimate(self._pixels(pixel_values)))


@register("CLIPVisionModel", "CLIPVisionModelWithProjection")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **kw) -> CompatModel:
    name = (config.get("architectures") or ["CLIPVisionModel"])[0]
    cfg = CLIPVisionConfig.from_hf(config, with_projection=name == "CLIPVisionModelWithProjection")
    enc = from_params(cfg, load_params_from(open_checkpoint(folder), cfg, dtype=dtype, naming="hf"))
    return _CLIPVisionCompat(name, config, enc)


__all__ = [
    "CLIPVisionConfig", "CLIPVision", "CLIPBlock", "CLIPVisionEncoder", "WAN_VIT_H_14", "CLIP_MEAN", "CLIP_STD",
    "init", "abstract", "param_shapes", "hf_keymap", "wan_expected_shapes", "wan_to_hf", "detect_naming",
    "hf_prefix", "infer_config", "load_params_from", "from_params", "load_clip", "preprocess",
]
