"""Layers shared by the LTX-Video 0.9 and LTX-2 transformers (and the LTX-2 text connectors).

- :class:`TimestepEmbed`: diffusers' ``PixArtAlphaCombinedTimestepSizeEmbeddings`` without size
  conditions (256-channel sinusoid, ``flip_sin_to_cos``; linear, SiLU, linear);
- :class:`AdaLNSingle`: the embedded timestep and ``n`` modulation vectors from it
  (``AdaLayerNormSingle`` / ``LTX2AdaLayerNormSingle``);
- :class:`TextProjection`: ``PixArtAlphaTextProjection`` (linear, tanh-GELU, linear);
- :class:`Attention`: q/k/v with an RMS q/k norm across all heads, rotary embeddings (interleaved
  over the whole inner width, or LTX-2's "split" halves per head), an optional per-head sigmoid
  gate (LTX-2.x ``apply_gated_attention``) and an additive key bias (masked text);
- :class:`FeedForward`: ``up -> tanh-GELU -> down`` (4x width).

Parameters carry logical axes: ``heads`` (attention width: q/k/v outputs, the out projection's
input, the q/k norms, the gate), ``ffn`` (feed-forward width), ``embed``. Under tensor parallelism
(``ParallelContext``) the out / down projections are row-parallel and the q/k norms reduce their
statistics across devices; rotary tables are split with the heads.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax.core import nn
from vidax.core import sharding as vsh
from vidax.core.config import DiTConfig
from vidax.core.embeddings import sinusoidal_embedding
from vidax.weights import int_keys, linear_rules

F32 = jnp.float32


@dataclass(frozen=True)
class LTXDiTFields(DiTConfig, in_channels=128, out_channels=128, num_heads=32):
    """The config fields both LTX DiTs (LTX-Video, LTX-2's video stream) have, under diffusers' names."""

    patch_size: int = 1
    patch_size_t: int = 1
    cross_attention_dim: int = 2048
    norm_eps: float = 1e-6
    caption_channels: int = 4096
    attention_bias: bool = True
    attention_out_bias: bool = True
    base_height: int = 2048
    base_width: int = 2048


class TimestepEmbed(nnx.Module):
    """``t -> l2(silu(l1(sinusoid_256(t))))`` with diffusers' ``Timesteps(256, flip_sin_to_cos=True,
    downscale_freq_shift=0)``; ``t`` of any shape ``[...]`` -> ``[..., dim]``."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, param_dtype=F32, freq_dim: int = 256):
        self.freq_dim = freq_dim
        self.l1 = nn.Linear(freq_dim, dim, rngs=rngs, param_dtype=param_dtype)
        self.l2 = nn.Linear(dim, dim, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, t, dtype=F32):
        e = sinusoidal_embedding(jnp.asarray(t, F32), self.freq_dim, flip_sin_to_cos=True).astype(dtype)
        return self.l2(jax.nn.silu(self.l1(e)))


class AdaLNSingle(nnx.Module):
    """``(linear(silu(emb)) [..., n*dim], emb [..., dim])``, ``emb`` = :class:`TimestepEmbed`."""

    def __init__(self, dim: int, n: int, *, rngs: nnx.Rngs, param_dtype=F32):
        self.n = n
        self.emb = TimestepEmbed(dim, rngs=rngs, param_dtype=param_dtype)
        self.linear = nn.Linear(dim, n * dim, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, t, dtype=F32):
        e = self.emb(t, dtype)
        return self.linear(jax.nn.silu(e)), e


class TextProjection(nnx.Module):
    """``l2(gelu_tanh(l1(x)))`` (caption projection into the model width)."""

    def __init__(self, din: int, dim: int, *, rngs: nnx.Rngs, param_dtype=F32):
        self.l1 = nn.Linear(din, dim, rngs=rngs, param_dtype=param_dtype)
        self.l2 = nn.Linear(dim, dim, rngs=rngs, axes=(None, "embed"), param_dtype=param_dtype)

    def __call__(self, x):
        return self.l2(nn.gelu_tanh(self.l1(x)))


# ----------------------------------------------------------------------------------- rotary
def apply_rope(x, rope, head_dim: int = None):
    """Rotate ``x`` [B, L, W] with ``rope``: ``("interleaved", cos, sin)`` with cos/sin [B|1, L, W]
    (pairs (2i, 2i+1) over the whole width), or ``("split", cos, sin)`` with cos/sin
    [B|1, L, G, r] (the width in G groups of 2r: first and second half of every group rotated
    together, LTX-2's "split" type). Computed in float32."""
    kind, cos, sin = rope
    dt = x.dtype
    xf = x.astype(F32)
    if kind == "interleaved":
        pairs = xf.reshape(*xf.shape[:-1], -1, 2)
        rot = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(xf.shape)
        return (xf * cos + rot * sin).astype(dt)
    b, l, _ = xf.shape
    h = xf.reshape(b, l, -1, 2, cos.shape[-1])
    first, second = h[..., 0, :], h[..., 1, :]
    out = jnp.stack([first * cos - second * sin, second * cos + first * sin], axis=-2)
    return out.reshape(b, l, -1).astype(dt)


def _heads(x, head_dim):
    return x.reshape(*x.shape[:-1], -1, head_dim)


class Attention(nnx.Module):
    """LTX attention (``LTXAttention`` / ``LTX2Attention``). ``qdim``: query width; ``kvdim``: key /
    value input width (None: self-attention); inner width ``heads * head_dim``."""

    def __init__(self, qdim: int, heads: int, head_dim: int, *, kvdim: int | None = None, rngs: nnx.Rngs,
                 bias: bool = True, out_bias: bool = True, eps: float = 1e-6, gated: bool = False,
                 param_dtype=F32):
        inner = heads * head_dim
        kvdim = qdim if kvdim is None else kvdim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.head_dim = head_dim
        self.q = nn.Linear(qdim, inner, axes=("embed", "heads"), bias=bias, **kw)
        self.k = nn.Linear(kvdim, inner, axes=("embed", "heads"), bias=bias, **kw)
        self.v = nn.Linear(kvdim, inner, axes=("embed", "heads"), bias=bias, **kw)
        self.o = nn.Linear(inner, qdim, axes=("heads", "embed"), bias=out_bias, **kw)
        self.norm_q = nn.RMSNorm(inner, eps=eps, axis="heads", **kw)
        self.norm_k = nn.RMSNorm(inner, eps=eps, axis="heads", **kw)
        self.gate = nn.Linear(qdim, heads, axes=("embed", "heads"), **kw) if gated else None

    def project(self, x, ctx, q_rope, k_rope, par):
        hd = self.head_dim
        if q_rope is None:  # no rotary embedding: the text cross-attention, its keys / values as computed once
            kv = self.context_kv(ctx, par)
            return self.query(x, None, par), kv["k"], kv["v"]
        q = self.norm_q(par.linear(self.q, x), par)
        k = self.norm_k(par.linear(self.k, ctx), par)
        v = par.linear(self.v, ctx)
        if q_rope is not None:
            q = apply_rope(q, q_rope, hd)
            k = apply_rope(k, q_rope if k_rope is None else k_rope, hd)
        return _heads(q, hd), _heads(k, hd), _heads(v, hd)

    def query(self, x, q_rope, par):
        """The queries alone (when the keys / values were computed once: :meth:`context_kv`)."""
        q = self.norm_q(par.linear(self.q, x), par)
        if q_rope is not None:
            q = apply_rope(q, q_rope, self.head_dim)
        return _heads(q, self.head_dim)

    def context_kv(self, ctx, par) -> dict:
        """Cross-attention keys / values [B, Lk, h, hd] of a context without rotary embedding (the
        text): the same every step, computed once per sample stage."""
        hd = self.head_dim
        return {"k": _heads(self.norm_k(par.linear(self.k, ctx), par), hd), "v": _heads(par.linear(self.v, ctx), hd)}

    def finish(self, x, o, par):
        """Gate (per head, ``2 * sigmoid``) and out projection of the attention output ``o``
        [B, L, h, hd]; ``x`` is the layer's query input (the gate reads it)."""
        if self.gate is not None:
            g = 2.0 * jax.nn.sigmoid(par.linear(self.gate, x).astype(F32))
            o = (o.astype(F32) * g[..., None]).astype(o.dtype)
        return par.linear(self.o, o.reshape(*o.shape[:2], -1))

    def __call__(self, x, ctx=None, *, bias=None, q_rope=None, k_rope=None, par: vsh.ParallelContext = vsh.LOCAL,
                 mode: str = "self", kv: dict | None = None):
        """``mode``: "self" (``ctx`` is None; Ulysses over sp under sequence parallelism) or
        "cross" (keys local: replicated over sp). ``bias``: additive, [B, 1, 1, Lk]. ``kv``: the
        keys / values from :meth:`context_kv` computed once (``ctx`` then unused)."""
        if kv is None:
            q, k, v = self.project(x, x if ctx is None else ctx, q_rope, k_rope, par)
        else:
            q, k, v = self.query(x, q_rope, par), kv["k"], kv["v"]
        if mode == "self" and bias is None:
            o = par.self_attention(q, k, v)
        else:
            from vidax.core.attention import attention

            o = attention(q, k, v, bias=bias, impl=par.attn_impl)
        return self.finish(x, o, par)


class FeedForward(nnx.Module):
    """``down(gelu_tanh(up(x)))``, hidden ``mult * dim``: up column-parallel, down row-parallel."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, mult: int = 4, bias: bool = True, param_dtype=F32):
        self.up = nn.Linear(dim, mult * dim, rngs=rngs, axes=("embed", "ffn"), bias=bias, param_dtype=param_dtype)
        self.down = nn.Linear(mult * dim, dim, rngs=rngs, axes=("ffn", "embed"), bias=bias, param_dtype=param_dtype)

    def __call__(self, x, par: vsh.ParallelContext = vsh.LOCAL):
        return par.linear(self.down, nn.gelu_tanh(par.linear(self.up, x)))


def rms(x, eps: float):
    """RMS norm without affine parameters, statistics in float32 (diffusers ``RMSNorm`` with
    ``elementwise_affine=False``), returned in ``x``'s dtype."""
    xf = x.astype(F32)
    return (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)).astype(x.dtype)


def layer_norm(x, eps: float = 1e-6):
    """LayerNorm without affine parameters, float32 statistics (two-pass)."""
    xf = x.astype(F32)
    m = jnp.mean(xf, axis=-1, keepdims=True)
    v = jnp.mean(jnp.square(xf - m), axis=-1, keepdims=True)
    return ((xf - m) * jax.lax.rsqrt(v + eps)).astype(x.dtype)


def mask_bias(mask, dtype=F32):
    """A multiplicative text mask [B, L] (1 = attend) -> the references' additive bias
    ``(1 - mask) * -10000`` shaped [B, 1, 1, L]."""
    m = jnp.asarray(mask, dtype)
    return ((1.0 - m) * -10000.0)[:, None, None, :]


# ----------------------------------------------------------------------------------- linear keys
lin = linear_rules


def norm(ref: str, dst: str, bias: bool = False) -> list[tuple[str, str, str]]:
    return [(f"{ref}.weight", f"{dst}.scale", "none")] + ([(f"{ref}.bias", f"{dst}.bias", "none")] if bias else [])


def attn_keys(ref: str, dst: str, gated: bool = False, bias: bool = True, out_bias: bool = True) -> list:
    out = []
    for n, r in (("q", "to_q"), ("k", "to_k"), ("v", "to_v")):
        out += lin(f"{ref}.{r}", f"{dst}.{n}", bias)
    out += lin(f"{ref}.to_out.0", f"{dst}.o", out_bias)
    out += norm(f"{ref}.norm_q", f"{dst}.norm_q") + norm(f"{ref}.norm_k", f"{dst}.norm_k")
    if gated:
        out += lin(f"{ref}.to_gate_logits", f"{dst}.gate")
    return out


def ff_keys(ref: str, dst: str, bias: bool = True) -> list:
    return lin(f"{ref}.net.0.proj", f"{dst}.up", bias) + lin(f"{ref}.net.2", f"{dst}.down", bias)


intkeys = int_keys


def seeded_state(build, seed: int = 0, special: dict | None = None):
    return seeded_split(build, seed, special)[1]


def seeded_split(build, seed: int = 0, special: dict | None = None):
    """``(graphdef, state)`` with seeded random weights for presets and tests without running a single initializer on a
    device (each new shape would compile one): the module is built abstractly and filled from
    numpy. Kernels ~ N(0, 1/fan_in); biases and modulation tables small noise; norm scales
    1 +- noise; nothing is zero, nothing is one. ``special``: leaf name -> value fn(shape, rng)."""
    from vidax.core import nn as vnn

    graphdef, state = vnn.abstract_state(build)
    rng = np.random.default_rng(seed)
    special = special or {}

    def one(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        shape, dt = tuple(leaf.shape), leaf.dtype
        if name in special:
            a = special[name](shape, rng)
        elif name == "scale":
            a = 1.0 + 0.05 * rng.standard_normal(shape)
        elif name in ("kernel", "embedding") and len(shape) >= 2:
            fan_in = int(np.prod(shape[:-1])) if name == "kernel" else shape[-1]
            if name == "kernel" and len(shape) >= 3 and len(shape) != 5:  # stacked linear [layers, in, out]
                fan_in = shape[-2]
            a = rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))
        else:
            a = 0.05 * rng.standard_normal(shape) + (0.02 if not shape else 0.0)
        return np.asarray(a, dt)

    pure = jax.tree_util.tree_map_with_path(one, nnx.to_pure_dict(state))
    return graphdef, vnn.fill(state, pure)
