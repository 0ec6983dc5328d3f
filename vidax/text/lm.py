"""Decoder-only language models as prompt encoders (Llama 3, Qwen2 / Qwen2.5-VL text, Gemma 3), in float32.

One implementation serves the three LM families; their real differences are configuration
(:class:`LMConfig`):

- **Llama** (HunyuanVideo 1.0's Llama-3-8B text tower): RMSNorm ``w * x``, SwiGLU, GQA, RoPE with
  optional ``linear`` / ``llama3`` frequency scaling, optional biases (``attention_bias``,
  ``mlp_bias``).
- **Qwen2 / Qwen2.5-VL text** (HunyuanVideo 1.5, Cosmos-Predict2.5): Llama plus q/k/v biases.
  Qwen2.5-VL's multimodal RoPE splits the rotary frequencies into (temporal, height, width)
  sections fed by three position rows; for text all three rows are the same position, which is
  ordinary RoPE. ``position_ids`` of shape ``[3, B, T]`` are accepted and applied per section.
- **Gemma 3** (LTX-2): embeddings scaled by ``sqrt(D)``, ``(1 + w)`` RMSNorm, q/k RMSNorm per head,
  norms after attention and after the MLP as well as before ("sandwich"), query scale
  ``query_pre_attn_scalar ** -0.5``, GELU-tanh MLP, interleaved sliding-window (local) and global
  layers with their own RoPE base (and the global one's ``linear`` scaling).

The model is a Flax NNX module (:class:`DecoderLM`); its layers are stacked along a leading layer
axis (``nn.stack``) and run with one ``lax.scan`` (sliding and global layers share parameter
shapes; a per-layer flag picks the mask and rotary table). The state, as ``nnx.to_pure_dict``
nests it::

    {"embed": {"embedding": [V, D]},
     "blocks": {"attn_norm"/"ffn_norm": {"scale": [N, D]},
                "q": {"kernel": [N, D, H*hd], "bias"?}, "k"/"v": {"kernel": [N, D, KV*hd], "bias"?},
                "o": {"kernel": [N, H*hd, D], "bias"?},
                "gate"/"up": {"kernel": [N, D, F], "bias"?}, "down": {"kernel": [N, F, D], "bias"?},
                # Gemma 3 only
                "q_norm"/"k_norm": {"scale": [N, hd]}, "attn_out_norm"/"ffn_out_norm": {"scale": [N, D]}},
     "final_norm": {"scale": [D]}}

Parameters carry logical axis names (``vocab``, ``embed``, ``heads``, ``kv_heads``, ``ffn``;
``layers`` on the stack); :func:`tp_rules` maps them onto a ``tp`` mesh axis and the compiler
partitions the jitted encode (GSPMD). A loaded model is an :class:`LMEncoder`: the module split
once, called through one jitted pure function of its state.

Numerics follow transformers' default (sdpa) path: positions ``arange(T)`` unless given; keys
masked by ``attention_mask`` and causality (and the window); a query with no visible key (a
left-padded row) gets a zero attention output, as torch's sdpa gives it.
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
from vidax.core.nn import ACTIVATIONS
from vidax.weights import KeyMap, Rule, load_params, open_checkpoint

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary table parameters: ``kind`` "default" | "linear" | "llama3" (transformers' rope_type)."""

    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ("default", "linear", "llama3"):
            raise ValueError(f"RoPE type {self.kind!r} is not supported (default, linear, llama3)")

    def inv_freq(self, dim: int) -> np.ndarray:
        """Inverse frequencies [dim/2] float32, the reference's arithmetic (float32 pow)."""
        inv = (1.0 / (np.float32(self.theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32)
                                                 / np.float32(dim)))).astype(np.float32)
        if self.kind == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.kind == "llama3":
            old = self.original_max_position_embeddings
            low_wl, high_wl = old / self.low_freq_factor, old / self.high_freq_factor
            wl = (2 * math.pi / inv).astype(np.float32)
            scaled = np.where(wl > low_wl, inv / np.float32(self.factor), inv).astype(np.float32)
            smooth = ((old / wl - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)).astype(np.float32)
            smoothed = ((1 - smooth) * scaled / np.float32(self.factor) + smooth * scaled).astype(np.float32)
            medium = ~(wl < high_wl) & ~(wl > low_wl)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        return inv

    @classmethod
    def from_hf(cls, p: dict | None, theta_default: float) -> "Rope":
        p = dict(p or {})
        kind = p.get("rope_type", p.get("type", "default")) or "default"
        if kind == "mrope":  # Qwen2-VL's old name: plain RoPE frequencies, M-RoPE sections apart
            kind = "default"
        return cls(theta=float(p.get("rope_theta") or theta_default), kind=kind,
                   factor=float(p.get("factor", 1.0) or 1.0),
                   low_freq_factor=float(p.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(p.get("high_freq_factor", 4.0)),
                   original_max_position_embeddings=int(p.get("original_max_position_embeddings", 8192)))


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_offset: float = 0.0          # Gemma: (1 + w) RMSNorm
    embed_scale: float | None = None  # Gemma: sqrt(hidden_size)
    qk_norm: bool = False             # Gemma 3: RMSNorm of q and k per head
    sandwich_norm: bool = False       # Gemma 2/3: norms after attention and after the MLP too
    query_scale: float | None = None  # None: head_dim ** -0.5
    layer_types: tuple = ()           # per layer "full" | "sliding"; () = all full
    sliding_window: int | None = None
    rope: Rope = Rope()
    rope_local: Rope | None = None    # sliding layers' RoPE (Gemma 3); None: same as ``rope``
    mrope_section: tuple = ()         # Qwen2.5-VL M-RoPE sections (only matter for [3, B, T] positions)
    model_type: str = "llama"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; known: {sorted(ACTIVATIONS)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if any(t not in ("full", "sliding") for t in self.layer_types):
            raise ValueError(f"layer_types entries must be 'full' or 'sliding', got {set(self.layer_types)}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need sliding_window")
        if self.mrope_section and 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} does not cover head_dim {self.head_dim}")

    @property
    def sliding(self) -> np.ndarray:
        """bool [num_layers]: which layers use the sliding window."""
        return np.asarray([t == "sliding" for t in self.layer_types] or [False] * self.num_layers)

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

    @classmethod
    def from_hf(cls, config: dict) -> "LMConfig":
        """From a transformers config dict (``config.json`` / ``to_dict()``) of Llama, Qwen2,
        Qwen2.5-VL (or its text config) or Gemma 3 (or its text config). Multimodal configs: the
        text model's (``text_config``); fields a hub ``config.json`` leaves out take the
        transformers defaults of that model type."""
        top = dict(config)
        tc = top.get("text_config")
        c = dict(tc) if isinstance(tc, dict) and tc else {}
        mt = str(c.get("model_type") or top.get("model_type") or "")
        if not c or "hidden_size" not in c and "hidden_size" in top and mt.startswith("qwen2"):
            # old Qwen2.5-VL configs keep the text fields at the top level
            c = {k: v for k, v in top.items() if k not in ("text_config", "vision_config")} | c
        archs = " ".join(str(a) for a in (top.get("architectures") or []))
        if not mt:
            mt = "gemma3" if "Gemma3" in archs else "qwen2_5_vl" if "Qwen2_5_VL" in archs else \
                 "qwen2" if "Qwen2" in archs else "llama"
        if mt.startswith("gemma3"):
            return _gemma3_from_hf(c)
        if mt.startswith("qwen2_5_vl") or mt.startswith("qwen2_vl"):
            return _llama_like(c, _QWEN25VL_DEFAULTS, "qwen2_5_vl")
        if mt.startswith("qwen2"):
            return _llama_like(c, _QWEN2_DEFAULTS, "qwen2")
        if mt in ("llama", "mistral", "") or "Llama" in archs:
            return _llama_like(c, _LLAMA_DEFAULTS, "llama")
        raise ValueError(f"decoder LM model_type {mt!r} is not supported (llama, qwen2, qwen2_5_vl, gemma3)")


_LLAMA_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=None, rms_norm_eps=1e-6, hidden_act="silu",
                       rope_theta=10000.0, attention_bias=False, mlp_bias=False)
_QWEN2_DEFAULTS = dict(_LLAMA_DEFAULTS, vocab_size=151936, intermediate_size=22016, rope_theta=10000.0)
_QWEN25VL_DEFAULTS = dict(_LLAMA_DEFAULTS, vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, rms_norm_eps=1e-5,
                          rope_theta=1000000.0)
_GEMMA3_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=4096,
                        attention_bias=False)


def _get(c: dict, defaults: dict, k: str):
    v = c.get(k)
    return defaults.get(k) if v is None else v


def _rope_params(c: dict) -> dict:
    """The single (not per-layer-type) rope dict of a config, old or new format."""
    p = c.get("rope_parameters")
    if isinstance(p, dict) and p and not any(isinstance(v, dict) for v in p.values()):
        return dict(p)
    out = dict(c.get("rope_scaling") or {})
    if c.get("rope_theta") is not None:
        out.setdefault("rope_theta", c["rope_theta"])
    return out


def _llama_like(c: dict, d: dict, kind: str) -> LMConfig:
    H = int(_get(c, d, "num_attention_heads"))
    D = int(_get(c, d, "hidden_size"))
    KV = int(c.get("num_key_value_heads") or d.get("num_key_value_heads") or H)
    L = int(_get(c, d, "num_hidden_layers"))
    rp = _rope_params(c)
    qwen = kind.startswith("qwen2")
    if qwen:
        hd = D // H  # Qwen2 attention ignores any head_dim field
        window = c.get("sliding_window") if c.get("use_sliding_window") else None
        types = c.get("layer_types")
        if types is None:
            mwl = int(c.get("max_window_layers") if c.get("max_window_layers") is not None else L)
            types = ["sliding_attention" if window is not None and i >= mwl else "full_attention" for i in range(L)]
    else:
        hd = int(c.get("head_dim") or D // H)
        window, types = None, None
    lt = tuple("sliding" if t == "sliding_attention" else "full" for t in types) if types else ()
    if "sliding" not in lt:
        lt, window = (), None
    mrope = tuple(rp.get("mrope_section") or ()) if kind == "qwen2_5_vl" else ()
    if kind == "qwen2_5_vl" and not mrope:
        mrope = (16, 24, 24) if hd == 128 else ()
    return LMConfig(
        vocab_size=int(_get(c, d, "vocab_size")), hidden_size=D, intermediate_size=int(_get(c, d, "intermediate_size")),
        num_layers=L, num_heads=H, num_kv_heads=KV, head_dim=hd, rms_norm_eps=float(_get(c, d, "rms_norm_eps")),
        hidden_act=str(_get(c, d, "hidden_act")),
        qkv_bias=True if qwen else bool(_get(c, d, "attention_bias")),
        o_bias=False if qwen else bool(_get(c, d, "attention_bias")),
        mlp_bias=False if qwen else bool(_get(c, d, "mlp_bias")),
        layer_types=lt, sliding_window=window, rope=Rope.from_hf(rp, float(d["rope_theta"])),
        mrope_section=mrope if mrope and 2 * sum(mrope) == hd else (), model_type=kind)


def _gemma3_from_hf(c: dict) -> LMConfig:
    d = _GEMMA3_DEFAULTS
    L = int(_get(c, d, "num_hidden_layers"))
    D = int(_get(c, d, "hidden_size"))
    types = c.get("layer_types")
    if types is None:
        pat = int(c.get("sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % pat else "full_attention" for i in range(L)]
    lt = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
    p = c.get("rope_parameters")
    if isinstance(p, dict) and any(isinstance(v, dict) for v in p.values()):
        full = Rope.from_hf(p.get("full_attention"), 1_000_000.0)
        local = Rope.from_hf(p.get("sliding_attention"), 10_000.0)
    else:  # old format: rope_theta (+ rope_scaling) for global layers, rope_local_base_freq for local ones
        g = dict(c.get("rope_scaling") or {})
        g.setdefault("rope_theta", c.get("rope_theta") or 1_000_000.0)
        full = Rope.from_hf(g, 1_000_000.0)
        local = Rope(theta=float(c.get("rope_local_base_freq") or 10_000.0))
    if c.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 has none)")
    if c.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported")
    act = c.get("hidden_activation") or c.get("hidden_act") or d["hidden_activation"]
    return LMConfig(
        vocab_size=int(_get(c, d, "vocab_size")), hidden_size=D, intermediate_size=int(_get(c, d, "intermediate_size")),
        num_layers=L, num_heads=int(_get(c, d, "num_attention_heads")), num_kv_heads=int(_get(c, d, "num_key_value_heads")),
        head_dim=int(_get(c, d, "head_dim")), rms_norm_eps=float(_get(c, d, "rms_norm_eps")), hidden_act=str(act),
        qkv_bias=bool(_get(c, d, "attention_bias")), o_bias=bool(_get(c, d, "attention_bias")), mlp_bias=False,
        norm_offset=1.0, embed_scale=float(D**0.5), qk_norm=True, sandwich_norm=True,
        query_scale=float(_get(c, d, "query_pre_attn_scalar")) ** -0.5,
        layer_types=lt if "sliding" in lt else (), sliding_window=int(_get(c, d, "sliding_window")) if "sliding" in lt else None,
        rope=full, rope_local=local, model_type="gemma3")


# ---------------------------------------------------------------------------------------------
# layers
# ---------------------------------------------------------------------------------------------
class RMSNorm(nnx.Module):
    """RMS norm over the last axis with float32 statistics: ``x / rms(x) * (offset + w)``
    (``offset`` 0: Llama / Qwen, 1: Gemma's zero-centred weight)."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, eps: float, offset: float = 0.0, axis: str | None = None,
                 param_dtype=jnp.float32):
        self.eps, self.offset = eps, offset
        init = nnx.initializers.zeros_init() if offset else nnx.initializers.ones_init()
        self.scale = nn.param(rngs, init, (dim,), axis, dtype=param_dtype)

    def __call__(self, x):
        x = x.astype(_F32)
        y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return y * (self.offset + self.scale[...].astype(_F32))


def rotate(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` on [B, T, heads, hd] with cos/sin [B, T, hd]."""
    h = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos[:, :, None] + rot * sin[:, :, None]


def rope_table(rope: Rope, positions, head_dim: int, mrope_section: tuple = ()):
    """positions [B, T] (or [3, B, T] for M-RoPE) -> (cos, sin) [B, T, head_dim] float32."""
    inv = jnp.asarray(rope.inv_freq(head_dim))
    pos = jnp.asarray(positions).astype(_F32)
    if pos.ndim == 3:
        f = pos[..., None] * inv  # [3, B, T, hd/2]
        if mrope_section:
            sec = np.concatenate([np.full(n, i % 3) for i, n in enumerate(mrope_section)])
            pick = jnp.asarray(np.eye(3, dtype=np.float32)[sec].T)  # [3, hd/2] one-hot section rows
            f = jnp.sum(f * pick[:, None, None, :], axis=0)
        else:
            f = f[0]
    else:
        f = pos[..., None] * inv
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def gqa_attention(q, k, v, mask, scale: float):
    """Grouped-query attention, float32 softmax. ``q`` [B, T, H, hd], ``k``/``v`` [B, S, KV, hd]
    (query head ``h`` reads kv head ``h // (H / KV)``, like transformers' ``repeat_kv``), ``mask``
    bool [B, T, S] (True = visible). Rows without a visible key give zeros (torch sdpa)."""
    B, T, H, hd = q.shape
    KV = k.shape[2]
    qg = q.reshape(B, T, KV, H // KV, hd)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=_HI) * scale
    m = mask[:, None, None]
    logits = jnp.where(m, logits, jnp.finfo(_F32).min)
    p = jax.nn.softmax(logits, axis=-1)
    p = jnp.where(jnp.any(m, axis=-1, keepdims=True), p, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v, precision=_HI)
    return out.reshape(B, T, H, hd)


class LMBlock(nnx.Module):
    """One decoder layer: pre-norm causal self-attention (GQA, RoPE), pre-norm gated MLP, both
    residual; Gemma's extra norms after each sub-layer and its q/k norms when configured."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.cfg = cfg
        D, H, KV, hd, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        lin = partial(nn.Linear, rngs=rngs, param_dtype=param_dtype, precision=_HI)
        norm = partial(RMSNorm, rngs=rngs, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, param_dtype=param_dtype)
        self.attn_norm = norm(D, axis="embed")
        self.q = lin(D, H * hd, axes=("embed", "heads"), bias=cfg.qkv_bias)
        self.k = lin(D, KV * hd, axes=("embed", "kv_heads"), bias=cfg.qkv_bias)
        self.v = lin(D, KV * hd, axes=("embed", "kv_heads"), bias=cfg.qkv_bias)
        self.o = lin(H * hd, D, axes=("heads", "embed"), bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = norm(hd), norm(hd)
        if cfg.sandwich_norm:
            self.attn_out_norm, self.ffn_out_norm = norm(D, axis="embed"), norm(D, axis="embed")
        self.ffn_norm = norm(D, axis="embed")
        self.gate = lin(D, F, axes=("embed", "ffn"), bias=cfg.mlp_bias)
        self.up = lin(D, F, axes=("embed", "ffn"), bias=cfg.mlp_bias)
        self.down = lin(F, D, axes=("ffn", "embed"), bias=cfg.mlp_bias)

    def __call__(self, x, mask, cos, sin):
        """``x`` [B, T, D] float32, ``mask`` bool [B, T, T], ``cos``/``sin`` [B, T, hd]."""
        cfg = self.cfg
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k(h).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v(h).reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        a = self.o(gqa_attention(q, k, v, mask, cfg.scale).reshape(B, T, cfg.num_heads * cfg.head_dim))
        if cfg.sandwich_norm:
            a = self.attn_out_norm(a)
        x = x + a
        h = self.ffn_norm(x)
        f = self.down(ACTIVATIONS[cfg.hidden_act](self.gate(h)) * self.up(h))
        if cfg.sandwich_norm:
            f = self.ffn_out_norm(f)
        return x + f


class DecoderLM(nnx.Module):
    """Token embedding (Gemma: scaled), ``num_layers`` stacked :class:`LMBlock` run by one scan,
    final RMS norm. Computes in float32 whatever the parameters' dtype."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.cfg = cfg
        self.embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs, axes=("vocab", "embed"), param_dtype=param_dtype)
        self.blocks = nn.stack(lambda r: LMBlock(cfg, rngs=r, param_dtype=param_dtype), cfg.num_layers, rngs)
        self.final_norm = RMSNorm(cfg.hidden_size, rngs=rngs, eps=cfg.rms_norm_eps, offset=cfg.norm_offset,
                                  axis="embed", param_dtype=param_dtype)

    # ---- pieces
    def embed_tokens(self, input_ids):
        """ids [B, T] -> embeddings [B, T, D] float32 (``hidden_states[0]``)."""
        x = self.embed(jnp.asarray(input_ids, jnp.int32)).astype(_F32)
        return x if self.cfg.embed_scale is None else x * jnp.float32(self.cfg.embed_scale)

    def _context(self, B: int, T: int, attention_mask, position_ids):
        cfg = self.cfg
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        position_ids = jnp.asarray(position_ids)
        if position_ids.ndim == 3 and not cfg.mrope_section:
            position_ids = position_ids[0]
        causal = jnp.tril(jnp.ones((T, T), bool))
        keys = jnp.ones((B, T), bool) if attention_mask is None else jnp.asarray(attention_mask) != 0
        full = causal[None] & keys[:, None, :]
        cos, sin = rope_table(cfg.rope, position_ids, cfg.head_dim, cfg.mrope_section)
        if not cfg.sliding.any():
            return (full, cos, sin), None
        i = jnp.arange(T)
        window = (i[None, :] > i[:, None] - cfg.sliding_window)  # kv > q - window
        local = full & window[None]
        rl = cfg.rope_local or cfg.rope
        lcos, lsin = rope_table(rl, position_ids, cfg.head_dim, cfg.mrope_section)
        return (full, cos, sin), (local, lcos, lsin)

    def _run(self, x, attention_mask, position_ids, start: int, stop: int, collect: bool):
        """Layers ``start .. stop-1`` on x: (output, per-layer outputs [stop-start, B, T, D] or None)."""
        if stop <= start:
            return x, (jnp.zeros((0,) + x.shape, x.dtype) if collect else None)
        B, T, _ = x.shape
        glob, loc = self._context(B, T, attention_mask, position_ids)
        flags = jnp.asarray(self.cfg.sliding)
        graphdef, state = nnx.split(self.blocks)

        def step(h, i):
            block = nnx.merge(graphdef, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), state))
            if loc is None:
                ctx = glob
            else:
                ctx = jax.tree.map(lambda g, l: jnp.where(flags[i], l, g), glob, loc)
            h = block(h, *ctx)
            return h, (h if collect else None)

        return jax.lax.scan(step, x, jnp.arange(start, stop, dtype=jnp.int32))

    # ---- public
    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        """ids [B, T] (+ mask [B, T], 1 = token; positions [B, T] or [3, B, T]) ->
        ``last_hidden_state`` [B, T, D] float32 (final norm applied)."""
        x, _ = self._run(self.embed_tokens(input_ids), attention_mask, position_ids, 0, self.cfg.num_layers, False)
        return self.final_norm(x)

    def forward_embeds(self, inputs_embeds, attention_mask=None, position_ids=None):
        """The stack on input embeddings [B, T, D] (used as given: no embedding scale) -> last hidden state."""
        x, _ = self._run(jnp.asarray(inputs_embeds, _F32), attention_mask, position_ids, 0, self.cfg.num_layers, False)
        return self.final_norm(x)

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None):
        """All hidden states [L+1, B, T, D] float32: the reference's ``output_hidden_states`` tuple
        stacked (0: embeddings, i: output of layer i, L: final-normed output)."""
        x0 = self.embed_tokens(input_ids)
        return self._all(x0, attention_mask, position_ids)

    def hidden_states_embeds(self, inputs_embeds, attention_mask=None, position_ids=None):
        return self._all(jnp.asarray(inputs_embeds, _F32), attention_mask, position_ids)

    def _all(self, x0, attention_mask, position_ids):
        L = self.cfg.num_layers
        last, hs = self._run(x0, attention_mask, position_ids, 0, L, True)
        return jnp.concatenate([x0[None], hs[:-1], self.final_norm(last)[None]], axis=0)

    def layer(self, input_ids, attention_mask=None, position_ids=None, index: int = -1):
        """``hidden_states[index]`` [B, T, D] (python-style index into the L+1 entries); runs only
        the layers below it."""
        L = self.cfg.num_layers
        i = index + L + 1 if index < 0 else index
        if not 0 <= i <= L:
            raise IndexError(f"hidden state index {index} out of range for {L} layers (L+1 = {L + 1} entries)")
        x, _ = self._run(self.embed_tokens(input_ids), attention_mask, position_ids, 0, i, False)
        return self.final_norm(x) if i == L else x


class LMEncoder(nn.Split):
    """A decoder LM split once (``graphdef``, ``state``, ``cfg``); its calls are one jitted pure
    function of the state (one compile per method, index and input shapes).

    - ``enc(input_ids, attention_mask=None, position_ids=None)`` -> last hidden state [B, T, D];
    - :meth:`hidden_states` -> [L+1, B, T, D]; :meth:`layer` -> ``hidden_states[index]``."""

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        return self.apply("__call__", input_ids, attention_mask, position_ids)

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None):
        return self.apply("hidden_states", input_ids, attention_mask, position_ids)

    def layer(self, input_ids, attention_mask=None, index: int = -1, position_ids=None):
        return self.apply("layer", input_ids, attention_mask, position_ids, index=int(index))

    def forward_embeds(self, inputs_embeds, attention_mask=None, position_ids=None):
        return self.apply("forward_embeds", inputs_embeds, attention_mask, position_ids)

    def hidden_states_embeds(self, inputs_embeds, attention_mask=None, position_ids=None):
        return self.apply("hidden_states_embeds", inputs_embeds, attention_mask, position_ids)


# ---------------------------------------------------------------------------------------------
# selections the pipelines use
# ---------------------------------------------------------------------------------------------
def crop(x, mask, start: int):
    """Drop a prompt template's first ``start`` tokens: ``x[:, start:]``, ``mask[:, start:]``
    (x: [B, T, ...] or stacked layers [L+1, B, T, D] -> cropped on the token axis)."""
    x = x[:, :, start:] if x.ndim == 4 else x[:, start:]
    return x, (None if mask is None else mask[:, start:])


def prefix_length(tokenizer, template: str, placeholder: str = "{}") -> int:
    """Tokens a prompt template puts before the prompt (special tokens such as ``<bos>``
    included): the ``crop_start`` to pass to :func:`crop`. ``tokenizer`` is a
    :class:`vidax.text.tokenizer.HFTokenizer` (``encode``); ``template`` holds one ``placeholder``.
    Templates end their prefix with a special token or newline, so tokenising the prefix alone
    gives the same tokens as inside the full prompt (checked by the tests)."""
    if template.count(placeholder) != 1:
        raise ValueError(f"template must contain the placeholder {placeholder!r} exactly once")
    return len(tokenizer.encode(template.split(placeholder)[0], add_special_tokens=True))


# ---------------------------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------------------------
def _build(cfg: LMConfig, seed: int = 0, dtype=np.float32):
    return lambda: DecoderLM(cfg, rngs=nnx.Rngs(seed), param_dtype=dtype)


def random_params(shapes: dict, seed: int = 0, zero_centred_scales: bool = False, dtype=np.float32) -> dict:
    """Seeded random weights on the host for a nested dict of parameter shapes (tiny presets,
    tests) — what ``nn.perturb`` of a freshly initialised module gives, without running the
    initialisers on the device (no per-op compiles): kernels lecun-normal, embeddings / other
    tensors N(0, 1), biases 0.02 N(0, 1), norm scales 1 + 0.05 N(0, 1) (``zero_centred_scales``:
    0.02 N(0, 1), for Gemma's (1 + w) norms). Nothing is zero, nothing is one."""
    rng = np.random.default_rng(seed)
    out: dict = {}
    for path, s in sorted(jax.tree_util.tree_leaves_with_path(shapes), key=lambda kv: jax.tree_util.keystr(kv[0])):
        keys = [str(getattr(k, "key", k)) for k in path]
        shape, name = tuple(s.shape), keys[-1]
        z = rng.standard_normal(shape)
        if name == "bias":
            a = 0.02 * z
        elif name == "scale":
            a = 0.02 * z if zero_centred_scales else 1 + 0.05 * z
        elif name == "kernel":
            fan_in = int(np.prod(shape[-4:-1])) if len(shape) >= 4 and "patch" in keys else shape[-2]
            a = z / np.sqrt(fan_in)
        else:
            a = z
        d = out
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = np.asarray(a, dtype)
    return out


def init(cfg: LMConfig, seed: int = 0, dtype=np.float32) -> LMEncoder:
    """Seeded random weights (tiny presets, tests): every parameter perturbed (:func:`random_params`)."""
    params = random_params(param_shapes(cfg, dtype), seed, zero_centred_scales=bool(cfg.norm_offset), dtype=dtype)
    return from_params(cfg, params)


def param_shapes(cfg: LMConfig, dtype=np.float32) -> dict:
    return nn.shapes(_build(cfg, dtype=dtype))


def abstract(cfg: LMConfig, dtype=np.float32) -> LMEncoder:
    return LMEncoder(*nn.abstract_state(_build(cfg, dtype=dtype)), cfg)


def _dtype_of(params) -> np.dtype:
    """Storage dtype of a parameter tree (the module is built with it so equal trees share compiles)."""
    return np.dtype(jax.tree.leaves(params)[0].dtype)


def from_params(cfg: LMConfig, params: dict, device_put: bool = True) -> LMEncoder:
    return LMEncoder.from_pure(_build(cfg, dtype=_dtype_of(params)), params, device_put=device_put)


# ---------------------------------------------------------------------------------------------
# tensor parallelism
# ---------------------------------------------------------------------------------------------
def tp_rules(cfg: LMConfig, tp: int) -> dict[str, str]:
    """Logical axis -> ``"tp"`` for a ``tp``-way mesh axis: each of ``heads`` (query heads, with
    the output projection's input), ``kv_heads``, ``ffn`` and ``vocab`` is sharded when it divides
    by ``tp``, else replicated. GQA: when ``num_kv_heads`` does not divide (Llama-3-8B has 8, Qwen2.5-7B
    4, Gemma-3-12B 8), the k/v projections (1/G of the attention weights) are replicated and every
    device computes all kv heads; query heads stay sharded. Qwen2.5-7B's 28 query heads shard over
    tp = 2 or 4 (on tp = 8 its attention is replicated and only the MLP and vocabulary shard)."""
    from vidax.core.sharding import axis_rules

    rules = axis_rules("tp", {"vocab": "tp"}, dims=dict(heads=cfg.num_heads, ffn=cfg.intermediate_size,
                                                        vocab=cfg.vocab_size), sizes={"tp": tp})
    if "heads" in rules and tp > 1 and cfg.num_kv_heads % tp == 0:
        rules["kv_heads"] = "tp"
    return rules


def shardings(enc_or_state, cfg: LMConfig, mesh):
    """``NamedSharding`` s of the state on ``mesh`` (axis ``tp``) under :func:`tp_rules`."""
    from vidax.core import mesh as vmesh
    from vidax.core import sharding as vsh

    mesh = vmesh.make_mesh(mesh)
    tp = vmesh.axis_sizes(mesh)["tp"]
    state = enc_or_state.state if isinstance(enc_or_state, nn.Split) else enc_or_state
    specs = vsh.param_specs(state, tp_rules(cfg, tp))
    vsh.check_param_divisibility(state, specs, mesh)
    return mesh, specs, vsh.named_shardings(mesh, specs)


def shard(enc: LMEncoder, mesh) -> LMEncoder:
    """``enc`` with its state placed on ``mesh`` (a Mesh or a spec like ``"tp=8"``) by
    :func:`tp_rules`; calls then run partitioned by the compiler (each device holds its shard)."""
    from vidax.core import mesh as vmesh
    from vidax.core.sharding import shard_split

    mesh = vmesh.make_mesh(mesh)
    return shard_split(enc, tp_rules(enc.cfg, vmesh.axis_sizes(mesh)["tp"]), mesh)


# ---------------------------------------------------------------------------------------------
# key maps and loading
# ---------------------------------------------------------------------------------------------
#: key prefixes of the text model inside the checkpoints the three families ship
PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.", "model.", "language_model.", "")


def detect_prefix(names) -> str:
    names = set(names)
    for p in PREFIXES:
        if f"{p}layers.0.input_layernorm.weight" in names and f"{p}embed_tokens.weight" in names:
            return p
    raise ValueError("no decoder-LM text model found in the checkpoint (looked for "
                     f"<prefix>embed_tokens.weight with prefixes {PREFIXES}; first names: {sorted(names)[:5]})")


def hf_keymap(cfg: LMConfig, prefix: str = "") -> KeyMap:
    """transformers naming of the text model under ``prefix``; everything else in the file
    (vision tower, projector, ``lm_head``, rotary buffers) is ignored."""
    b = prefix + "layers.{i}."
    rules = [
        Rule(prefix + "embed_tokens.weight", "embed.embedding"),
        Rule(prefix + "norm.weight", "final_norm.scale"),
        Rule(b + "input_layernorm.weight", "blocks.attn_norm.scale"),
        Rule(b + "mlp.gate_proj.weight", "blocks.gate.kernel", "linear"),
        Rule(b + "mlp.up_proj.weight", "blocks.up.kernel", "linear"),
        Rule(b + "mlp.down_proj.weight", "blocks.down.kernel", "linear"),
    ]
    for n in "qkvo":
        rules.append(Rule(b + f"self_attn.{n}_proj.weight", f"blocks.{n}.kernel", "linear"))
        if (cfg.o_bias if n == "o" else cfg.qkv_bias):
            rules.append(Rule(b + f"self_attn.{n}_proj.bias", f"blocks.{n}.bias"))
    if cfg.mlp_bias:
        rules += [Rule(b + f"mlp.{n}_proj.bias", f"blocks.{n}.bias") for n in ("gate", "up", "down")]
    if cfg.sandwich_norm:
        rules += [Rule(b + "post_attention_layernorm.weight", "blocks.attn_out_norm.scale"),
                  Rule(b + "pre_feedforward_layernorm.weight", "blocks.ffn_norm.scale"),
                  Rule(b + "post_feedforward_layernorm.weight", "blocks.ffn_out_norm.scale")]
    else:
        rules.append(Rule(b + "post_attention_layernorm.weight", "blocks.ffn_norm.scale"))
    if cfg.qk_norm:
        rules += [Rule(b + "self_attn.q_norm.weight", "blocks.q_norm.scale"),
                  Rule(b + "self_attn.k_norm.weight", "blocks.k_norm.scale")]
    esc = re.escape(prefix)
    ignore = [rf"^(?!{esc})"] if prefix else []  # anything outside the text model
    ignore += [r"(^|\.)rotary_emb\.", r"^lm_head\.", r"^(model\.)?(visual|vision_tower|multi_modal_projector)\."]
    return KeyMap(rules, ignore=ignore)


def load_params_from(ckpt, cfg: LMConfig, dtype=np.float32, prefix: str | None = None) -> dict:
    prefix = detect_prefix(list(ckpt)) if prefix is None else prefix
    return load_params(ckpt, hf_keymap(cfg, prefix), param_shapes(cfg, dtype), dtype=dtype,
                       what=f"{cfg.model_type} decoder LM (prefix {prefix!r})")


def _folder(path) -> Path:
    p = Path(path)
    if p.is_dir() and not (p / "config.json").exists() and (p / "text_encoder" / "config.json").exists():
        p = p / "text_encoder"  # diffusers pipeline folder
    return p


def load_lm(path, cfg: LMConfig | None = None, dtype=np.float32, mesh=None, device_put: bool = True) -> LMEncoder:
    """A decoder LM from a transformers folder (``config.json`` + safetensors, sharded or not; a
    diffusers pipeline folder's ``text_encoder/``), any of the :data:`PREFIXES`. ``dtype``: storage
    dtype of the parameters (compute is float32). ``mesh``: shard over its ``tp`` axis
    (:func:`tp_rules`; each device receives only its slices)."""
    p = _folder(path)
    if cfg is None:
        cfg = LMConfig.from_hf(json.loads((p / "config.json").read_text()))
    params = load_params_from(open_checkpoint(p), cfg, dtype=dtype)
    if mesh is None:
        return from_params(cfg, params, device_put=device_put)
    return shard(from_params(cfg, params, device_put=False), mesh)


# ---------------------------------------------------------------------------------------------
# compat adapters (transformers calling convention)
# ---------------------------------------------------------------------------------------------
class Output(dict):
    """The reference's ``ModelOutput`` fields as a dict with attribute access (numpy values;
    ``hidden_states`` a tuple)."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None

    def to_tuple(self):
        return tuple(self.values())


_IGNORED_KW = ("return_dict", "output_attentions", "use_cache", "cache", "past_key_values", "logits_to_keep",
               "cache_position", "token_type_ids", "mm_token_type_ids")


def check_kwargs(name: str, kwargs: dict, allowed=()) -> None:
    for k, v in kwargs.items():
        if k in allowed:
            continue
        if k == "output_attentions" and v:
            raise ValueError(f"{name}: output_attentions is not supported")
        if k in ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw") and v is not None:
            raise ValueError(f"{name}: only the text tower is ported ({k} given)")
        if v is not None and k not in _IGNORED_KW:
            raise TypeError(f"{name}.forward: unsupported argument {k!r}")


class _LMCompat(CompatModel):
    """``forward(input_ids=..., attention_mask=..., position_ids=..., inputs_embeds=...)`` ->
    ``last_hidden_state``; ``outputs(..., output_hidden_states=True)`` (also ``cm(...)``) -> an
    :class:`Output` with ``last_hidden_state`` and the ``hidden_states`` tuple. The LM head is not
    loaded, so ``*ForCausalLM`` / ``*ForConditionalGeneration`` return hidden states, not logits."""

    def __init__(self, name: str, config: dict, encoder: LMEncoder):
        super().__init__(name, config, encoder.state, model_config=encoder.cfg)
        self.encoder = encoder

    def _args(self, input_ids, attention_mask, position_ids, inputs_embeds, kwargs):
        check_kwargs(self.name, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids / inputs_embeds")
        mask = None if attention_mask is None else np.asarray(attention_mask)
        pos = None if position_ids is None else np.asarray(position_ids)
        return mask, pos

    def outputs(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                output_hidden_states=False, **kwargs) -> Output:
        mask, pos = self._args(input_ids, attention_mask, position_ids, inputs_embeds, kwargs)
        if output_hidden_states:
            if input_ids is not None:
                hs = np.asarray(self.encoder.hidden_states(np.asarray(input_ids), mask, pos))
            else:
                hs = np.asarray(self.encoder.hidden_states_embeds(np.asarray(inputs_embeds, np.float32), mask, pos))
            return Output(last_hidden_state=hs[-1], hidden_states=tuple(hs))
        if input_ids is not None:
            out = self.encoder(np.asarray(input_ids), mask, pos)
        else:
            out = self.encoder.forward_embeds(np.asarray(inputs_embeds, np.float32), mask, pos)
        return Output(last_hidden_state=np.asarray(out))

    __call__ = outputs

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                output_hidden_states=False, **kwargs) -> np.ndarray:
        return self.outputs(input_ids, attention_mask, position_ids, inputs_embeds, False, **kwargs).last_hidden_state


LM_CLASSES = (
    "LlamaModel", "LlamaForCausalLM", "Qwen2Model", "Qwen2ForCausalLM", "Qwen2_5_VLTextModel",
    "Qwen2_5_VLModel", "Qwen2_5_VLForConditionalGeneration", "Gemma3TextModel", "Gemma3ForCausalLM", "Gemma3Model",
    "Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration",
)


@register(*LM_CLASSES, scalable=True)
def _load_compat(config: dict, folder: Path, dtype=np.float32, mesh=None, parallelism=None, offload_chunk_size=None,
                 **kw) -> CompatModel:
    """``mesh`` (a Mesh or a spec like ``"tp=8"``): tensor parallel over its ``tp`` axis
    (:func:`tp_rules`); sequence parallelism and offloading are not offered for prompt encoders."""
    if offload_chunk_size is not None:
        raise ValueError("decoder-LM encoders do not offload (shard them over tp instead)")
    if parallelism not in (None, "tp", "none"):
        raise ValueError(f"decoder-LM encoders support parallelism='tp' only, got {parallelism!r}")
    cfg = LMConfig.from_hf(config)
    enc = from_params(cfg, load_params_from(open_checkpoint(folder), cfg, dtype=dtype), device_put=mesh is None)
    if mesh is not None:
        enc = shard(enc, mesh)
    name = (config.get("architectures") or ["LlamaModel"])[0]
    return _LMCompat(name, config, enc)


__all__ = [
    "Rope", "LMConfig", "RMSNorm", "LMBlock", "DecoderLM", "LMEncoder", "Output", "rope_table", "gqa_attention",
    "crop", "prefix_length", "random_params", "init", "param_shapes", "abstract", "from_params", "tp_rules", "shardings",
           "shard", "PREFIXES",
    "detect_prefix", "hf_keymap", "load_params_from", "load_lm", "LM_CLASSES",
]
