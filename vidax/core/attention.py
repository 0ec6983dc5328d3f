"""Multi-head attention with a dense reference path and the backend's fused path.

Layout everywhere: ``q``: [B, Lq, H, D], ``k``/``v``: [B, Lk, H, D] -> [B, Lq, H, D].

``impl``:
- ``"xla"``: dense reference (float32 softmax), runs anywhere;
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, fp16/bf16);
- ``"flash"``: Pallas flash attention (TPU);
- ``"auto"`` (default): the fused path where the backend and dtype allow it, else dense.
The default can be overridden with ``VIDAX_ATTENTION=xla|cudnn|flash|auto`` or
:func:`set_default_impl`.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

_IMPLS = ("auto", "xla", "cudnn", "flash")
_default = os.environ.get("VIDAX_ATTENTION", "auto")


def set_default_impl(impl: str) -> None:
    global _default
    if impl not in _IMPLS:
        raise ValueError(f"attention impl must be one of {_IMPLS}, got {impl!r}")
    _default = impl


def _resolve(impl, q, bias, mask):
    impl = impl or _default
    if impl not in _IMPLS:
        raise ValueError(f"attention impl must be one of {_IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    backend = jax.default_backend()
    if backend == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and bias is None:
        return "cudnn"
    if backend == "tpu" and bias is None and mask is None and q.shape[-1] % 128 == 0:
        return "flash"
    return "xla"


_Q_BLOCK = 256


def _softmax_attend(q, k, v, bias, mask, scale):
    """[B, H, Lq, D] x [B, H, Lk, D] -> [B, H, Lq, D]; normalises after the PV product."""
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST).astype(jnp.float32) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - m)
    den = jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum("bhqk,bhkd->bhqd", e.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST)
    return (out.astype(jnp.float32) / den).astype(v.dtype)


def dense_attention(q, k, v, bias=None, mask=None, scale=None, q_block: int = _Q_BLOCK):
    """Reference attention (float32 softmax). ``bias``: additive, broadcastable to [B, H, Lq, Lk];
    ``mask``: boolean (True = attend), broadcastable to [B, H, Lq, Lk].

    Long query sequences are processed ``q_block`` queries at a time with ``lax.scan`` (same math;
    the [Lq, Lk] score matrix is never materialised whole, which keeps it in cache on CPU and
    bounds the temporary memory everywhere)."""
    b, lq, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qh, kh, vh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    per_query = any(t is not None and t.ndim >= 2 and t.shape[-2] != 1 for t in (bias, mask))
    if lq <= 2 * q_block or per_query:
        return _softmax_attend(qh, kh, vh, bias, mask, scale).transpose(0, 2, 1, 3)
    nb = -(-lq // q_block)
    pad = nb * q_block - lq
    qp = jnp.pad(qh, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else qh
    blocks = qp.reshape(b, h, nb, q_block, d).transpose(2, 0, 1, 3, 4)

    def body(_, qb):
        return None, _softmax_attend(qb, kh, vh, bias, mask, scale)

    _, out = jax.lax.scan(body, None, blocks)
    out = out.transpose(1, 0, 3, 2, 4).reshape(b, nb * q_block, h, d)
    return out[:, :lq] if pad else out


def attention(q, k, v, *, bias=None, mask=None, scale=None, impl: str | None = None):
    which = _resolve(impl, q, bias, mask)
    if which == "xla":
        return dense_attention(q, k, v, bias=bias, mask=mask, scale=scale)
    if which == "cudnn":
        m = None if mask is None else jnp.broadcast_to(mask, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
        return jax.nn.dot_product_attention(q, k, v, mask=m, scale=scale, implementation="cudnn")
    # TPU Pallas flash attention: [B, H, L, D] layout.
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    d = q.shape[-1]
    out = flash_attention(
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
        sm_scale=d**-0.5 if scale is None else scale,
    )
    return out.transpose(0, 2, 1, 3)
