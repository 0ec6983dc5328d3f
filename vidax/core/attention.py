"""Multi-head attention with a dense reference path and the backends' fused paths.

Layout everywhere: ``q``: [B, Lq, H, D], ``k``/``v``: [B, Lk, H, D] -> [B, Lq, H, D].

``impl``:
- ``"xla"``: dense reference (float32 softmax, query-blocked), runs anywhere;
- ``"splash"``: Pallas splash attention (TPU): any sequence length (queries and keys padded to the
  block size, padded keys masked with segment ids, the head dim padded to 128 lanes), per-sample
  key masks (text padding) as segment ids too, block sizes per chip and shape from
  :data:`SPLASH_BLOCKS`; it runs per device inside ``shard_map`` (Ulysses sequence parallelism).
  Off TPU it runs in Pallas interpret mode (tests check it against the dense path);
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, fp16/bf16);
- ``"flash"``: the legacy Pallas flash attention (TPU; lengths divisible by its block size only);
- ``"auto"`` (default): TPU -> splash when there is no additive bias and any mask is a key mask;
  GPU -> cuDNN for bf16/fp16. Float32 on GPU keeps the dense path at full float32 precision (the
  references' numerics; cuDNN has no float32 flash kernel and TF32 would change results), so run the
  DiT in bf16 (``--dtype bfloat16``) for the fused kernel. Everything else: dense.
The default can be overridden with ``VIDAX_ATTENTION=xla|splash|cudnn|flash|auto`` or
:func:`set_default_impl`.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

_IMPLS = ("auto", "xla", "splash", "cudnn", "flash")
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
    if backend == "tpu" and bias is None and (mask is None or _key_mask(mask) is not None):
        return "splash"
    return "xla"


def _key_mask(mask):
    """A boolean mask that only depends on (batch, key) -- [B or 1, 1, 1, Lk] -- as [B or 1, Lk];
    else None (query- or head-dependent masks stay on the dense path)."""
    if mask is None or mask.ndim != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        return None
    return mask[:, 0, 0, :]


#: splash block sizes (block_q, block_kv, block_kv_compute) per TPU generation, clamped to the
#: padded sequence lengths; lengths are padded to the (clamped) block size
SPLASH_BLOCKS = {"v5 lite": (512, 1024, 512), "v5e": (512, 1024, 512), "v5p": (512, 1024, 512),
                 "v6": (1024, 1024, 512), "v4": (512, 512, 512), "default": (512, 512, 512)}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def splash_blocks(lq: int, lk: int, device_kind: str | None = None) -> tuple[int, int, int]:
    """(block_q, block_kv, block_kv_compute) for these lengths on this chip: the chip's entry of
    :data:`SPLASH_BLOCKS`, shrunk (in multiples of 128) for short sequences."""
    kind = (device_kind if device_kind is not None else jax.devices()[0].device_kind).lower()
    bq, bkv, bc = next((v for k, v in SPLASH_BLOCKS.items() if k != "default" and k in kind), SPLASH_BLOCKS["default"])
    bq = min(bq, _round_up(lq, 128))
    bkv = min(bkv, _round_up(lk, 128))
    bc = min(bc, bkv)
    while bkv % bc:
        bc //= 2
    return bq, bkv, bc


@functools.lru_cache(maxsize=64)
def _splash_kernel(lq: int, lk: int, heads: int, blocks: tuple[int, int, int], interpret: bool,
                   save_residuals: bool = False):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    bq, bkv, bc = blocks
    mask = sm.MultiHeadMask([sm.FullMask((lq, lk))] * heads)
    return sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, interpret=interpret, save_residuals=save_residuals,
                              block_sizes=sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bc))


def splash_attention(q, k, v, *, mask=None, scale=None, interpret: bool | None = None, device_kind: str | None = None,
                     return_lse: bool = False):
    """Pallas splash attention for any lengths (see the module docstring). ``mask``: a key mask
    broadcastable to [B, 1, 1, Lk] (True = attend) or None. ``interpret``: None runs the kernel
    natively on TPU and in Pallas interpret mode elsewhere. ``return_lse``: also the rows'
    log-sum-exp [B, H, Lq] (the kernel's saved residual), for a ring step's merge."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    b, lq, h, d = q.shape
    lk = k.shape[1]
    scale = d**-0.5 if scale is None else scale
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    bq, bkv, bc = splash_blocks(lq, lk, device_kind)
    lqp, lkp, dp = _round_up(lq, bq), _round_up(lk, bkv), _round_up(d, 128)

    def prep(x, length, s=1.0):
        x = (x * s).astype(x.dtype).transpose(0, 2, 1, 3)  # [B, H, L, D]
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, dp - d)))

    qh, kh, vh = prep(q, lqp, scale), prep(k, lkp), prep(v, lkp)
    km = _key_mask(mask) if mask is not None else None
    if mask is not None and km is None:
        raise ValueError(f"splash attention takes key masks [B, 1, 1, Lk]; got a mask of shape {mask.shape}")
    valid = jnp.arange(lkp) < lk
    kv_seg = jnp.broadcast_to(valid, (b, lkp))
    if km is not None:
        kv_seg = kv_seg & jnp.pad(jnp.broadcast_to(km, (b, lk)), ((0, 0), (0, lkp - lk)))
    kernel = _splash_kernel(lqp, lkp, h, (bq, bkv, bc), bool(interpret), bool(return_lse))
    q_seg = jnp.ones((lqp,), jnp.int32)  # every query in segment 1: padded and masked keys are segment 0

    def one(qb, kb, vb, seg):
        return kernel(qb, kb, vb, segment_ids=sk.SegmentIds(q=q_seg, kv=seg.astype(jnp.int32)))

    if return_lse:
        out, (lse,) = jax.vmap(one)(qh, kh, vh, kv_seg)
        return out[:, :, :lq, :d].transpose(0, 2, 1, 3).astype(jnp.float32), lse[:, :, :lq].astype(jnp.float32)
    out = jax.vmap(one)(qh, kh, vh, kv_seg)
    return out[:, :, :lq, :d].transpose(0, 2, 1, 3).astype(v.dtype)


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
    if which == "splash":
        if bias is not None:
            raise ValueError("splash attention takes no additive bias; use impl='xla'")
        return splash_attention(q, k, v, mask=mask, scale=scale)
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


# ----------------------------------------------------------------------------------- blocks with their log-sum-exp
def _attend_lse(q, k, v, kmask, scale):
    """[B, H, Lq, D] x [B, H, Lk, D] (``kmask``: [B or 1, Lk] bool or None) -> (out [B, H, Lq, D]
    float32, normalised; lse [B, H, Lq] float32). A row whose keys are all masked gets an lse near
    float32's lowest value, so its weight in a merge is zero."""
    logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST).astype(jnp.float32) * scale
    if kmask is not None:
        logits = jnp.where(kmask[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
    m = jnp.max(logits, axis=-1, keepdims=True)
    e = jnp.exp(logits - m)
    den = jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.einsum("bhqk,bhkd->bhqd", e.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST)
    return out.astype(jnp.float32) / den, (m + jnp.log(den))[..., 0]


def dense_attention_lse(q, k, v, kmask=None, scale=None, q_block: int = _Q_BLOCK):
    """Dense attention of one key/value block with the log-sum-exp of its rows (the unit ring
    attention merges). ``q`` [B, Lq, H, D], ``k``/``v`` [B, Lk, H, D], ``kmask`` a key mask
    [B or 1, Lk] (True = attend) or None. Returns ``(out [B, Lq, H, D] float32, lse [B, H, Lq])``;
    long query sequences go ``q_block`` at a time, as in :func:`dense_attention`."""
    b, lq, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qh, kh, vh = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    if lq <= 2 * q_block:
        o, lse = _attend_lse(qh, kh, vh, kmask, scale)
        return o.transpose(0, 2, 1, 3), lse
    nb = -(-lq // q_block)
    pad = nb * q_block - lq
    qp = jnp.pad(qh, ((0, 0), (0, 0), (0, pad), (0, 0))) if pad else qh
    blocks = qp.reshape(b, h, nb, q_block, d).transpose(2, 0, 1, 3, 4)
    _, (o, lse) = jax.lax.scan(lambda _, qb: (None, _attend_lse(qb, kh, vh, kmask, scale)), None, blocks)
    o = o.transpose(1, 0, 3, 2, 4).reshape(b, nb * q_block, h, d)[:, :lq]
    lse = lse.transpose(1, 2, 0, 3).reshape(b, h, nb * q_block)[:, :, :lq]
    return o, lse


def attention_lse(q, k, v, *, kmask=None, scale=None, impl: str | None = None):
    """One ring step's attention: ``(out float32, lse [B, H, Lq])`` of queries over one key/value
    block with a key mask ``kmask`` [B or 1, Lk]. ``impl`` resolves as in :func:`attention`: on TPU
    Pallas splash (its saved log-sum-exp residual), elsewhere the dense path; cuDNN returns no
    softmax statistics through ``jax.nn.dot_product_attention``, so a GPU ring step runs dense (the
    whole-sequence Ulysses path keeps cuDNN)."""
    which = _resolve(impl, q, None, None if kmask is None else kmask[:, None, None, :])
    if which == "splash":
        return splash_attention(q, k, v, mask=None if kmask is None else kmask[:, None, None, :], scale=scale,
                                return_lse=True)
    return dense_attention_lse(q, k, v, kmask=kmask, scale=scale)


def merge_lse(acc, part):
    """Online-softmax merge of two partial attentions ``(out [B, L, H, D] f32, lse [B, H, L])``
    over disjoint key sets: the attention over their union."""
    (o1, l1), (o2, l2) = acc, part
    lse = jnp.logaddexp(l1, l2)
    w1 = jnp.exp(l1 - lse).transpose(0, 2, 1)[..., None]
    w2 = jnp.exp(l2 - lse).transpose(0, 2, 1)[..., None]
    return o1 * w1 + o2 * w2, lse
