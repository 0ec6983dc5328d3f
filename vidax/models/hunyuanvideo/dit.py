"""HunyuanVideo 1.0 diffusion transformer (diffusers ``HunyuanVideoTransformer3DModel``) as Flax NNX modules.

:class:`HunyuanVideoTransformer` = ``embed`` (patch embedding, timestep / pooled-CLIP / embedded-
guidance conditioning, the token refiner over the text with its mask) -> ``double`` (dual-stream
blocks: video and text keep their own weights and meet in one joint attention) -> ``single``
(single-stream blocks: one sequence [video; text], parallel attention + MLP) -> ``head``. The two
block stacks have different shapes, so each is stacked on its own leading ``"layers"`` axis and
runs with its own ``lax.scan`` -- and streams from host memory through its own offload pool with
its own chunk size (:func:`runner`, the core runner).

Particulars of this family, each with its place in the code:

- joint attention over ``[video; text]`` with the text mask: every video key is valid, a text key
  only while its index is below the row's mask count (the reference's rule:
  ``effective length = video tokens + mask.sum()``); queries are never masked
  (:func:`joint_attention`). Under sequence parallelism only the video q/k/v go through the
  Ulysses all_to_all; the text q/k/v (replicated over ``sp``) are cut to the device's head range,
  and the text output is gathered back over the heads;
- 3D RoPE on the video tokens only, the head dim split by ``rope_axes_dim`` over (t, h, w)
  (:func:`rope_tables`); the text tokens get none;
- modulation (``temb``) from the timestep + the pooled CLIP-L text vector + the **embedded
  guidance** (``guidance * 1000`` -- the caller multiplies -- through its own timestep embedder),
  no CFG batch;
- image-to-video as configuration (``image_condition_type``): ``latent_concat`` is only more input
  channels; ``token_replace`` modulates the first latent frame's tokens with a second embedding
  (timestep 0, no guidance) in every block (:func:`pick`).

Activations are channels-last; the model takes latents as ``[B, F, H, W, C]``. Every parameter
carries logical axis names, mapped to mesh axes by the core table plus ``AXIS_DELTAS``. The
single-stream block's output projection reads ``[attention; MLP]``: it is kept as two kernels
(``out_attn`` split by heads, ``out_mlp`` split by the MLP width) so that under tensor
parallelism both halves are row-parallel with one reduction and the bias added once.

The blocks (:class:`DoubleBlock`, :class:`SingleBlock`, :class:`TokenRefiner`,
:func:`joint_attention`, :func:`modulation`) import nothing of the pipeline, for other Hunyuan
families to reuse.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax import compat
from vidax.core.config import DiTConfig, diffusers_kwargs
from vidax.core import mesh as vmesh
from vidax.core import nn
from vidax.core import offload as voff
from vidax.core import geometry
from vidax.core import sharding as vsh
from vidax.core.layers import MLP, PatchEmbed, split_heads
from vidax.core.runner import DiTRunner, run_local
from vidax.core.attention import attention
from vidax.core.embeddings import apply_rope_interleaved, sinusoidal_embedding

F32 = jnp.float32
IMAGE_CONDITION_TYPES = (None, "latent_concat", "token_replace")


# ----------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class HunyuanDiTFields(DiTConfig):
    """The config fields (and their checks) HunyuanVideo 1.0 and 1.5 share, under diffusers' names."""

    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 2
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"
    text_embed_dim: int = 4096
    rope_theta: float = 256.0
    rope_axes_dim: tuple = (16, 56, 56)

    FAMILY = "HunyuanVideo"

    def __post_init__(self):
        object.__setattr__(self, "rope_axes_dim", tuple(int(d) for d in self.rope_axes_dim))
        if self.qk_norm != "rms_norm":
            raise ValueError(f"qk_norm={self.qk_norm!r} is not supported ({self.FAMILY} uses 'rms_norm')")
        if len(self.rope_axes_dim) != 3 or sum(self.rope_axes_dim) != self.head_dim or any(d % 2 for d in self.rope_axes_dim):
            raise ValueError(f"rope_axes_dim={self.rope_axes_dim} must be three even sizes summing to head_dim={self.head_dim}")

    @property
    def patch(self) -> tuple[int, int, int]:
        return (self.patch_size_t, self.patch_size, self.patch_size)

    @classmethod
    def from_diffusers(cls, cfg: dict):
        return cls(**diffusers_kwargs(cls, cfg))


@dataclass(frozen=True)
class HunyuanVideoConfig(HunyuanDiTFields, num_heads=24, num_layers=20):
    """Mirrors diffusers' ``HunyuanVideoTransformer3DModel`` config (defaults = the 13B release);
    ``num_layers`` counts the dual-stream blocks."""

    num_single_layers: int = 40  # single-stream blocks
    guidance_embeds: bool = True
    pooled_projection_dim: int = 768
    image_condition_type: str | None = None

    def __post_init__(self):
        if self.image_condition_type not in IMAGE_CONDITION_TYPES:
            raise ValueError(f"image_condition_type={self.image_condition_type!r}; supported: {IMAGE_CONDITION_TYPES}")
        super().__post_init__()

    @property
    def token_replace(self) -> bool:
        return self.image_condition_type == "token_replace"


PRESETS = {
    "tiny": HunyuanVideoConfig(num_heads=4, head_dim=8, in_channels=16, out_channels=16, num_layers=2,
                               num_single_layers=4, num_refiner_layers=1, text_embed_dim=32, pooled_projection_dim=24,
                               rope_axes_dim=(2, 2, 4)),
    "13b": HunyuanVideoConfig(),
    "13b-i2v": HunyuanVideoConfig(image_condition_type="token_replace"),
    "13b-i2v-33ch": HunyuanVideoConfig(in_channels=33, guidance_embeds=False, image_condition_type="latent_concat"),
}


# ----------------------------------------------------------------------------------- helpers
_heads = split_heads


def modulation(layer: nnx.Linear, temb, n: int, par: vsh.ParallelContext):
    """``layer(silu(temb))`` as ``[B, n, D]`` (float32). The kernel's output may be split over tp
    (logical ``"mod"``: these projections are a quarter of the model's weights): each device
    computes its columns and one all_gather joins them."""
    y = layer(jax.nn.silu(temb.astype(layer.kernel[...].dtype))).astype(F32)
    ax = par.mesh_axis(layer.kernel, -1)
    if ax is not None:
        y = jax.lax.all_gather(y, ax, axis=y.ndim - 1, tiled=True, to="invarying")
    return y.reshape(*y.shape[:-1], n, -1)


def pick(first, normal, replaced):
    """Per-token modulation: ``replaced`` ([B, D]) on the first latent frame's tokens (``first``:
    bool [L] over this device's tokens), ``normal`` ([B, D]) elsewhere -> [B, L, D]; without
    ``first`` just ``normal[:, None]`` (token_replace off)."""
    if first is None or replaced is None:
        return normal[:, None]
    return jnp.where(first[None, :, None], replaced[:, None], normal[:, None])


def _modulate(norm, x, shift, scale):
    return norm(x.astype(F32)) * (1 + scale) + shift


def _rows(layer: nnx.Linear, x):
    """``x @ kernel`` without the bias (a row-parallel partial sum)."""
    kernel = layer.kernel[...]
    x, kernel = layer.promote_dtype((x, kernel), dtype=layer.dtype)
    return layer.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=layer.precision)


def masked_attention(q, k, v, kv_len, impl: str | None = None):
    """Attention where key ``j`` of row ``b`` is valid iff ``j < kv_len[b]`` (queries are never
    masked). ``q``: [B, Lq, H, D], ``k``/``v``: [B, Lk, H, D], ``kv_len``: int [B]. On GPU in
    half precision this is cuDNN's fused kernel with ``key_value_seq_lengths``; elsewhere the dense
    reference with a key mask (query blocks scanned, the score matrix never whole)."""
    which = impl
    if which in (None, "auto"):
        from vidax.core import attention as vatt

        which = vatt._default if vatt._default != "auto" else "auto"
    if which == "auto":
        which = "cudnn" if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) else "xla"
    if which == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len.astype(jnp.int32),
                                            implementation="cudnn")
    mask = (jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] < kv_len[:, None])[:, None, None, :]
    return attention(q, k, v, mask=mask, impl="xla")


def joint_attention(qv, kv, vv, qt, kt, vt, text_len, par: vsh.ParallelContext):
    """Joint attention over ``[video; text]``. ``qv``/``kv``/``vv``: [B, Lv_local, Hl, D] (this
    device's video tokens, its tp heads); ``qt``/``kt``/``vt``: [B, Lt, Hl, D] (every text token,
    replicated over sp); ``text_len``: int [B], the valid text tokens (the mask's count).
    Returns ``(video out [B, Lv_local, Hl, D], text out [B, Lt, Hl, D])``.

    Under sequence parallelism (``sp`` > 1, inside ``shard_map``) the video q/k/v go through the
    Ulysses all_to_all (every video token, Hl/sp heads), the text q/k/v are cut to the same head
    range (they are already whole on every device), one attention runs, then the video output
    goes back to token shards and the text output is gathered over the heads."""
    sp = par.size("sp")
    lt = qt.shape[1]
    if sp > 1 and (par.valid is not None or par.usp(qv.shape[2])[1] > 1):
        # padded video tokens or a ring: the core's USP attention, the text padding as a key mask
        tm = jnp.arange(lt, dtype=jnp.int32)[None, :] < text_len.astype(jnp.int32)[:, None]
        return par.joint_attention(qv, kv, vv, qt, kt, vt, extra_mask=tm)
    if sp > 1:
        hl = qv.shape[2]
        if hl % sp:
            raise vmesh.ShardingConfigError(f"joint attention: {hl} local heads are not divisible by sp={sp}")
        h = hl // sp

        def to_heads(x):
            return jax.lax.all_to_all(x, "sp", split_axis=2, concat_axis=1, tiled=True)

        i = jax.lax.axis_index("sp")
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, i * h, h, axis=2)  # noqa: E731
        qv, kv, vv = to_heads(qv), to_heads(kv), to_heads(vv)
        qt, kt, vt = cut(qt), cut(kt), cut(vt)
    lv = qv.shape[1]
    q = jnp.concatenate([qv, qt], axis=1)
    k = jnp.concatenate([kv, kt], axis=1)
    v = jnp.concatenate([vv, vt], axis=1)
    o = masked_attention(q, k, v, lv + text_len.astype(jnp.int32), par.attn_impl)
    ov, ot = o[:, :lv], o[:, lv:lv + lt]
    if sp > 1:
        ov = jax.lax.all_to_all(ov, "sp", split_axis=1, concat_axis=2, tiled=True)
    if "sp" in dict(par.sizes):
        # the text output: whole on every device (inside shard_map it also depends on the video
        # shard, so even with sp=1 it is gathered to be typed replicated over sp)
        ot = jax.lax.all_gather(ot, "sp", axis=2, tiled=True, to="invarying")
    return ov, ot


def _qkv(q_lin, k_lin, v_lin, norm_q, norm_k, x, head_dim, par):
    q = norm_q(_heads(par.linear(q_lin, x), head_dim))
    k = norm_k(_heads(par.linear(k_lin, x), head_dim))
    return q, k, _heads(par.linear(v_lin, x), head_dim)


# ----------------------------------------------------------------------------------- modules
def timestep_features(t):
    """diffusers ``Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)``: [B] -> [B, 256] f32."""
    return sinusoidal_embedding(jnp.asarray(t, F32), 256, flip_sin_to_cos=True)


class RefinerBlock(nnx.Module):
    """One token-refiner block: LayerNorm -> masked self-attention (no q/k norm) gated by the
    refiner's own conditioning, LayerNorm -> SiLU MLP gated likewise."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6, **kw)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, **kw) for _ in range(4))
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, **kw)
        self.up = nn.Linear(dim, int(dim * mlp_ratio), **kw)
        self.down = nn.Linear(int(dim * mlp_ratio), dim, **kw)
        self.ada = nn.Linear(dim, 2 * dim, **kw)

    def __call__(self, x, temb, mask):
        dt = x.dtype
        hd = x.shape[-1] // self.heads
        h = self.norm1(x.astype(F32)).astype(dt)
        q, k, v = (_heads(lin(h), hd) for lin in (self.q, self.k, self.v))
        o = attention(q, k, v, mask=mask, impl="xla")
        o = self.o(o.reshape(*o.shape[:2], -1))
        gates = self.ada(jax.nn.silu(temb.astype(dt))).astype(F32)
        g_attn, g_mlp = gates[:, None, : x.shape[-1]], gates[:, None, x.shape[-1]:]
        x = (x.astype(F32) + o.astype(F32) * g_attn).astype(dt)
        f = self.down(jax.nn.silu(self.up(self.norm2(x.astype(F32)).astype(dt))))
        return (x.astype(F32) + f.astype(F32) * g_mlp).astype(dt)


class TokenRefiner(nnx.Module):
    """diffusers ``HunyuanVideoTokenRefiner``: the text's masked mean + the timestep condition the
    refiner blocks over ``proj_in(text)``. Attention mask: token ``i`` sees token ``j`` when both
    are valid, and every token sees token 0 (the reference's rule; ``SEE_FIRST = False`` drops
    that last part, for HunyuanVideo 1.5's refiner). Replicated over the mesh (it runs once per
    step on a few hundred text tokens)."""

    SEE_FIRST = True

    def __init__(self, text_dim: int, dim: int, heads: int, num_layers: int, mlp_ratio: float = 4.0, *,
                 rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.time_in = MLP(256, dim, dim, "silu", **kw)
        self.text_in = MLP(text_dim, dim, dim, "silu", **kw)
        self.proj_in = nn.Linear(text_dim, dim, **kw)
        self.blocks = nn.stack(lambda r: RefinerBlock(dim, heads, mlp_ratio, rngs=r, param_dtype=param_dtype),
                               num_layers, rngs)

    def __call__(self, x, t, mask):
        """``x``: [B, L, text_dim]; ``t``: [B]; ``mask``: [B, L] (nonzero = valid)."""
        dt = x.dtype
        m = (jnp.asarray(mask) != 0)
        mf = m.astype(F32)[..., None]
        pooled = (jnp.sum(x.astype(F32) * mf, axis=1) / jnp.sum(mf, axis=1)).astype(dt)
        temb = self.time_in(timestep_features(t).astype(dt)) + self.text_in(pooled)
        h = self.proj_in(x)
        am = m[:, None, :, None] & m[:, None, None, :]  # [B, 1, L, L]
        if self.SEE_FIRST:
            am = am.at[..., 0].set(True)
        return nn.scan(self.blocks, h, lambda blk, h: blk(h, temb, am))


class PatchTimeEmbed(nnx.Module):
    """What both HunyuanVideos embed first: the latent patches (``patch``) and the timestep
    (``time_in``, an MLP of its 256 sinusoidal features), at the model width."""

    def __init__(self, cfg: HunyuanDiTFields, *, rngs: nnx.Rngs, param_dtype=F32):
        self.cfg = cfg
        self.patch = PatchEmbed(cfg.patch, cfg.in_channels, cfg.dim, rngs=rngs, param_dtype=param_dtype)
        self.time_in = MLP(256, cfg.dim, cfg.dim, "silu", rngs=rngs, param_dtype=param_dtype)


class Embed(PatchTimeEmbed):
    """Everything before the blocks: patch embedding (per token: runs on a token shard), the
    modulation vector ``temb`` (timestep + pooled CLIP text + embedded guidance), token_replace's
    second vector, and the token refiner over the text."""

    def __init__(self, cfg: HunyuanVideoConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype)
        d, kw = cfg.dim, dict(rngs=rngs, param_dtype=param_dtype)
        self.vec_in = MLP(cfg.pooled_projection_dim, d, d, "silu", **kw)
        self.guidance_in = MLP(256, d, d, "silu", **kw) if cfg.guidance_embeds else None
        # the reference builds the refiner with its own default MLP ratio (4), whatever mlp_ratio says
        self.refiner = TokenRefiner(cfg.text_embed_dim, d, cfg.num_heads, cfg.num_refiner_layers, 4.0, **kw)

    def conditioning(self, t, pooled, guidance=None):
        """``(temb [B, D], token-replace temb [B, D] or None)``, float32."""
        dt = self.patch.kernel[...].dtype
        vec = self.vec_in(pooled.astype(dt))
        temb = self.time_in(timestep_features(t).astype(dt))
        tr = None
        if self.cfg.token_replace:
            tr = (self.time_in(timestep_features(jnp.zeros_like(jnp.asarray(t, F32))).astype(dt)) + vec).astype(F32)
        if self.guidance_in is not None:
            if guidance is None:
                raise ValueError("this DiT embeds the guidance scale (guidance_embeds=True): pass guidance (scale * 1000)")
            temb = temb + self.guidance_in(timestep_features(guidance).astype(dt)) + vec
        else:
            temb = temb + vec
        return temb.astype(F32), tr

    def __call__(self, a: dict, par: vsh.ParallelContext = vsh.LOCAL):
        """``a``: patch ``tokens`` (this shard's), ``t``, ``ctx``, ``mask``, ``pooled``, ``guidance``
        and the per-token tables. Returns ``({"h", "y"}, consts)``."""
        temb, tr = self.conditioning(a["t"], a["pooled"], a.get("guidance"))
        c = {"temb": temb, "text_len": text_lengths(a["mask"]), "cos": a["cos"], "sin": a["sin"]}
        if tr is not None:
            c.update(tr=tr, first=a["first"])
        return {"h": self.patch(a["tokens"]), "y": self.refiner(a["ctx"], a["t"], a["mask"])}, c


class DoubleBlock(nnx.Module):
    """Dual-stream block (``HunyuanVideoTransformerBlock`` / ``...TokenReplaceTransformerBlock``):
    video and text each have their modulation, q/k/v (+ per-head RMS q/k norms), output projection
    and MLP; they meet in one joint attention. Under TP: q/k/v column-parallel by heads, outputs and
    MLP-down row-parallel (bias once), modulation split by columns and gathered."""

    def __init__(self, cfg: HunyuanVideoConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d, hd, m = cfg.dim, cfg.head_dim, cfg.mlp_dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.head_dim = hd
        self.token_replace = cfg.token_replace
        self.mod = nn.Linear(d, 6 * d, axes=("embed", "mod"), **kw)
        self.mod_ctx = nn.Linear(d, 6 * d, axes=("embed", "mod"), **kw)
        col, row = ("embed", "heads"), ("heads", "embed")
        self.q, self.k, self.v = (nn.Linear(d, d, axes=col, **kw) for _ in range(3))
        self.o = nn.Linear(d, d, axes=row, **kw)
        self.add_q, self.add_k, self.add_v = (nn.Linear(d, d, axes=col, **kw) for _ in range(3))
        self.add_o = nn.Linear(d, d, axes=row, **kw)
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = (nn.RMSNorm(hd, eps=1e-6, **kw) for _ in range(4))
        self.ff_up = nn.Linear(d, m, axes=("embed", "ffn"), **kw)
        self.ff_down = nn.Linear(m, d, axes=("ffn", "embed"), **kw)
        self.ffc_up = nn.Linear(d, m, axes=("embed", "ffn"), **kw)
        self.ffc_down = nn.Linear(m, d, axes=("ffn", "embed"), **kw)
        self.norm = nn.LayerNorm(d, eps=1e-6, affine=False, rngs=rngs)

    def __call__(self, carry, c, par: vsh.ParallelContext = vsh.LOCAL):
        """``carry``: ``(video [B, Lv, D], text [B, Lt, D])`` (compute dtype); ``c``: ``temb``
        [B, D], ``tr`` (token_replace) [B, D], ``first`` bool [Lv], ``cos``/``sin`` [Lv, hd/2],
        ``text_len`` int [B]."""
        x, y = carry
        dt = x.dtype
        hd = self.head_dim
        first = c.get("first") if self.token_replace else None
        mv = modulation(self.mod, c["temb"], 6, par)
        mt = modulation(self.mod_ctx, c["temb"], 6, par)
        mr = modulation(self.mod, c["tr"], 6, par) if first is not None else None
        sel = lambda j: pick(first, mv[:, j], None if mr is None else mr[:, j])  # noqa: E731
        hx = _modulate(self.norm, x, sel(0), sel(1)).astype(dt)
        hy = _modulate(self.norm, y, mt[:, None, 0], mt[:, None, 1]).astype(dt)
        qv, kv, vv = _qkv(self.q, self.k, self.v, self.norm_q, self.norm_k, hx, hd, par)
        qv, kv = apply_rope_interleaved(qv, c["cos"], c["sin"]), apply_rope_interleaved(kv, c["cos"], c["sin"])
        qt, kt, vt = _qkv(self.add_q, self.add_k, self.add_v, self.norm_added_q, self.norm_added_k, hy, hd, par)
        ov, ot = joint_attention(qv, kv, vv, qt, kt, vt, c["text_len"], par)
        ov = par.linear(self.o, ov.reshape(*ov.shape[:2], -1))
        ot = par.linear(self.add_o, ot.reshape(*ot.shape[:2], -1))
        x = x.astype(F32) + ov.astype(F32) * sel(2)
        y = y.astype(F32) + ot.astype(F32) * mt[:, None, 2]
        hx = _modulate(self.norm, x, sel(3), sel(4)).astype(dt)
        hy = _modulate(self.norm, y, mt[:, None, 3], mt[:, None, 4]).astype(dt)
        fx = par.linear(self.ff_down, nn.gelu_tanh(par.linear(self.ff_up, hx)))
        fy = par.linear(self.ffc_down, nn.gelu_tanh(par.linear(self.ffc_up, hy)))
        x = (x + fx.astype(F32) * sel(5)).astype(dt)
        y = (y + fy.astype(F32) * mt[:, None, 5]).astype(dt)
        return x, y


class SingleBlock(nnx.Module):
    """Single-stream block (``HunyuanVideoSingleTransformerBlock`` / ``...TokenReplaceSingle...``):
    one modulated LayerNorm over ``[video; text]``, then attention (q/k/v by heads, RoPE on the
    video part) and an MLP side by side, one output projection over ``[attention; MLP]`` (kept as
    two row-parallel kernels, one reduction, one bias), gated. Video and text stay two arrays (the
    video sharded over sp, the text replicated); every op but the joint attention is per token."""

    def __init__(self, cfg: HunyuanVideoConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d, hd, m = cfg.dim, cfg.head_dim, cfg.mlp_dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.head_dim = hd
        self.token_replace = cfg.token_replace
        self.mod = nn.Linear(d, 3 * d, axes=("embed", "mod"), **kw)
        self.q, self.k, self.v = (nn.Linear(d, d, axes=("embed", "heads"), **kw) for _ in range(3))
        self.norm_q, self.norm_k = (nn.RMSNorm(hd, eps=1e-6, **kw) for _ in range(2))
        self.mlp = nn.Linear(d, m, axes=("embed", "ffn"), **kw)
        self.out_attn = nn.Linear(d, d, axes=("heads", "embed"), **kw)  # carries proj_out's bias
        self.out_mlp = nn.Linear(m, d, axes=("ffn", "embed"), bias=False, **kw)
        self.norm = nn.LayerNorm(d, eps=1e-6, affine=False, rngs=rngs)

    def _out(self, a, f, par: vsh.ParallelContext):
        """``proj_out([a; f])``: both halves are partial sums under TP -> one psum, bias once."""
        y = _rows(self.out_attn, a) + _rows(self.out_mlp, f)
        ax = par.mesh_axis(self.out_attn.kernel, -2)
        if ax is not None:
            y = jax.lax.psum(y, ax)
        return y + self.out_attn.bias[...].astype(y.dtype)

    def __call__(self, carry, c, par: vsh.ParallelContext = vsh.LOCAL):
        x, y = carry
        dt = x.dtype
        hd = self.head_dim
        first = c.get("first") if self.token_replace else None
        m = modulation(self.mod, c["temb"], 3, par)
        mr = modulation(self.mod, c["tr"], 3, par) if first is not None else None
        sel = lambda j: pick(first, m[:, j], None if mr is None else mr[:, j])  # noqa: E731
        hx = _modulate(self.norm, x, sel(0), sel(1)).astype(dt)
        hy = _modulate(self.norm, y, m[:, None, 0], m[:, None, 1]).astype(dt)
        qv, kv, vv = _qkv(self.q, self.k, self.v, self.norm_q, self.norm_k, hx, hd, par)
        qv, kv = apply_rope_interleaved(qv, c["cos"], c["sin"]), apply_rope_interleaved(kv, c["cos"], c["sin"])
        qt, kt, vt = _qkv(self.q, self.k, self.v, self.norm_q, self.norm_k, hy, hd, par)
        ov, ot = joint_attention(qv, kv, vv, qt, kt, vt, c["text_len"], par)
        outx = self._out(ov.reshape(*ov.shape[:2], -1), nn.gelu_tanh(par.linear(self.mlp, hx)), par)
        outy = self._out(ot.reshape(*ot.shape[:2], -1), nn.gelu_tanh(par.linear(self.mlp, hy)), par)
        x = (x.astype(F32) + outx.astype(F32) * sel(2)).astype(dt)
        y = (y.astype(F32) + outy.astype(F32) * m[:, None, 2]).astype(dt)
        return x, y


class Head(nnx.Module):
    """``AdaLayerNormContinuous`` (scale, then shift) + the output projection, per video token."""

    def __init__(self, cfg: HunyuanVideoConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        self.norm = nn.LayerNorm(d, eps=1e-6, affine=False, rngs=rngs)
        self.mod = nn.Linear(d, 2 * d, rngs=rngs, param_dtype=param_dtype)
        self.proj = nn.Linear(d, cfg.out_channels * math.prod(cfg.patch), rngs=rngs, param_dtype=param_dtype)

    def __call__(self, carry, c, par: vsh.ParallelContext = vsh.LOCAL):
        h = carry["h"]
        dt = h.dtype
        m = self.mod(jax.nn.silu(c["temb"].astype(dt))).astype(F32)
        d = h.shape[-1]
        scale, shift = m[:, None, :d], m[:, None, d:]
        return {"out": self.proj((self.norm(h.astype(F32)) * (1 + scale) + shift).astype(dt))}


class DualStreamHooks:
    """The :class:`vidax.core.runner.DiTRunner` hooks HunyuanVideo 1.0 and 1.5 share: a video carry
    ``h`` split over sp and a text carry ``y`` whole on every device through the dual-stream (and
    single-stream) stacks, the RoPE tables (+ token_replace's first-frame flags) per video token, the
    modulation projections' columns split over tp (``"mod"``)."""

    AXIS_DELTAS = {"mod": "tp"}

    @staticmethod
    def step_double(blk, carry, c, par):
        h, y = blk((carry["h"], carry["y"]), c, par)
        return {"h": h, "y": y}

    step_single = step_double

    @staticmethod
    def act_spec(name: str, shape: tuple) -> tuple:
        """Logical axes of an activation (see ``vidax.core.sharding.activation_axes``)."""
        return vsh.activation_axes(name, shape, tokens=("tokens", "h", "out"), tables=("cos", "sin", "first"))

    def finish(self, out: dict, shapes: dict):
        return unpatchify(self.cfg, out["out"], grid_of(self.cfg, shapes["x"]))

    def check(self, shapes: dict, mesh) -> None:
        tokens = math.prod(geometry.token_grid(shapes["x"][1:4], self.cfg.patch))
        vmesh.check_divisible(parallel_constraints(self.cfg, tokens=tokens, batch=shapes["x"][0]), mesh)

    def table_key(self, shapes: dict):
        return grid_of(self.cfg, shapes["x"])

    def tables(self, grid) -> dict:
        ang = rope_angles(self.cfg.rope_axes_dim, grid, self.cfg.rope_theta)
        out = {"cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32)}
        if getattr(self.cfg, "token_replace", False):
            out["first"] = np.arange(math.prod(grid)) < grid[1] * grid[2]
        return out

    def run(self, inputs: dict, par, rope=None):
        """The one-device forward through the same hooks (what the runner runs per shard)."""
        inputs = {k: v for k, v in inputs.items() if v is not None}
        tables = {k: jnp.asarray(v) for k, v in self.tables(grid_of(self.cfg, jnp.shape(inputs["x"]))).items()}
        if rope is not None:
            tables["cos"], tables["sin"] = rope
        return run_local(self, inputs, tables, self.embed.patch.kernel[...].dtype, par)


class HunyuanVideoTransformer(DualStreamHooks, nnx.Module):
    """The HunyuanVideo DiT: ``embed`` -> stacked ``double`` -> stacked ``single`` -> ``head``."""

    STACKS = ("double", "single")

    @staticmethod
    def teacache_input(blk, carry, c, par):
        """TeaCache's modulated input (the TeaCache authors' HunyuanVideo script): the first double
        block's normalised video tokens with its first shift / scale (float32)."""
        first = c.get("first") if blk.token_replace else None
        mv = modulation(blk.mod, c["temb"], 6, par)
        mr = modulation(blk.mod, c["tr"], 6, par) if first is not None else None
        sel = lambda j: pick(first, mv[:, j], None if mr is None else mr[:, j])  # noqa: E731
        return _modulate(blk.norm, carry["h"], sel(0), sel(1))

    def __init__(self, cfg: HunyuanVideoConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs=rngs, param_dtype=param_dtype)
        self.double = nn.stack(lambda r: DoubleBlock(cfg, rngs=r, param_dtype=param_dtype), cfg.num_layers, rngs)
        self.single = nn.stack(lambda r: SingleBlock(cfg, rngs=r, param_dtype=param_dtype), cfg.num_single_layers, rngs)
        self.head = Head(cfg, rngs=rngs, param_dtype=param_dtype)

    @staticmethod
    def pack(x, t, ctx, mask, pooled, guidance=None) -> dict:
        return {"x": x, "t": jnp.asarray(t, F32), "ctx": ctx, "mask": jnp.asarray(mask, F32), "pooled": pooled,
                "guidance": None if guidance is None else jnp.asarray(guidance, F32)}

    def prepare(self, a: dict, dtype) -> dict:
        return {"tokens": patchify(self.cfg, a["x"].astype(dtype))[0], "t": a["t"], "ctx": jnp.asarray(a["ctx"]).astype(dtype),
                "mask": a["mask"], "pooled": jnp.asarray(a["pooled"]).astype(dtype),
                **{k: a[k] for k in ("guidance", "cos", "sin", "first") if k in a}}

    def chunk_sizes(self, offload_chunk_size) -> dict:
        return parse_chunk_sizes(offload_chunk_size, self.cfg)

    def __call__(self, x, t, ctx, mask, pooled, guidance=None, *, par: vsh.ParallelContext = vsh.LOCAL, rope=None):
        """Velocity prediction. ``x``: [B, F, H, W, C] latents; ``t``: [B]; ``ctx``: [B, Lt,
        text_embed_dim]; ``mask``: [B, Lt]; ``pooled``: [B, pooled_projection_dim]; ``guidance``:
        [B] (already ``scale * 1000``) for guidance-embedding models; ``rope``: the grid's (cos, sin)
        tables (:func:`rope_tables`) as arguments (None: computed here). Returns [B, F, H, W, Cout]."""
        return self.run(self.pack(x, t, ctx, mask, pooled, guidance), par, rope)


# ----------------------------------------------------------------------------------- state
UNITS = ("embed", "double", "single", "head")
KIT = nn.ModelKit(HunyuanVideoTransformer, units=UNITS, dtype_leaf=("embed", "patch", "kernel"))
#: the abstract state a checkpoint fills, its shapes, the graphdefs the runner merges unit by unit,
#: the state's dtype and the module back from a state: see ``nn.ModelKit`` (the seeded weights
#: below are drawn in numpy instead: :func:`seeded_state`)
_build, abstract_state, param_shapes = KIT.build, KIT.abstract_state, KIT.param_shapes
graphdefs, state_dtype, merge = KIT.graphdefs, KIT.state_dtype, KIT.merge


def seeded_state(build, seed: int = 0):
    """``(graphdef, state)`` of ``build()`` with seeded random host-numpy weights, drawn without
    running a single JAX initializer (each would compile once per shape: tens of seconds for a
    tiny model on a CPU): kernels ``N(0, 1/fan_in)`` (the stacked ``layers`` axis excluded from
    the fan-in), norm scales ``1 +- 0.05``, everything else ``N(0, 0.02)`` -- nothing zero, nothing
    one, as :func:`vidax.core.nn.perturb` requires."""
    graphdef, state = nn.abstract_state(build)
    specs = nnx.get_partition_spec(state)
    leaves, treedef = jax.tree.flatten(state)
    names = jax.tree.leaves(specs, is_leaf=vsh.is_spec)
    rng = np.random.default_rng(seed)
    out = []
    for path, leaf, spec in zip(vsh.tree_paths(state), leaves, names):
        shape, dt = tuple(leaf.shape), np.dtype(leaf.dtype)
        last = path.rsplit(".", 1)[-1]
        if last == "kernel":
            fan = int(np.prod([d for d, n in zip(shape[:-1], tuple(spec)[:-1] + (None,) * len(shape)) if n != nn.LAYERS]))
            a = rng.standard_normal(shape) / np.sqrt(max(fan, 1))
        elif last == "scale":
            a = 1.0 + 0.05 * rng.standard_normal(shape)
        else:
            a = 0.02 * rng.standard_normal(shape)
        out.append(a.astype(dt))
    return graphdef, jax.tree.unflatten(treedef, out)


def init_state(cfg: HunyuanVideoConfig, seed: int = 0, dtype=np.float32) -> nnx.State:
    """A seeded random DiT's state in host memory (numpy leaves; presets, tests), see :func:`seeded_state`."""
    return seeded_state(lambda: _build(cfg, 0, dtype), seed)[1]


def init_model(cfg: HunyuanVideoConfig, seed: int = 0, dtype=np.float32) -> HunyuanVideoTransformer:
    return nnx.merge(graphdefs(cfg, np.dtype(dtype).name)["model"], jax.tree.map(jnp.asarray, init_state(cfg, seed, dtype)))


# ----------------------------------------------------------------------------------- geometry
def patchify(cfg: HunyuanVideoConfig, x):
    """[B, F, H, W, C] -> tokens [B, f*h*w, pt*ph*pw*C] and the token grid (f, h, w)."""
    return geometry.patchify(x, cfg.patch, "thwc")


def unpatchify(cfg: HunyuanVideoConfig, y, grid):
    """[B, L, Cout*pt*ph*pw] (the reference's per-token order: channel, then t, h, w) -> [B, F, H, W, Cout]."""
    return geometry.unpatchify(y, grid, cfg.patch, "cthw")


def grid_of(cfg: HunyuanVideoConfig, x_shape) -> tuple[int, int, int]:
    pt, ph, pw = cfg.patch
    return (x_shape[1] // pt, x_shape[2] // ph, x_shape[3] // pw)


def rope_angles(axes_dim, grid, theta: float) -> np.ndarray:
    """Angles [f*h*w, head_dim/2]: each axis' positions times its ``1 / theta^(2i/d)`` frequencies,
    concatenated over (t, h, w) (diffusers ``HunyuanVideoRotaryPosEmbed``; positions t-major)."""
    parts = []
    pos = np.meshgrid(*[np.arange(g, dtype=np.float64) for g in grid], indexing="ij")
    for d, p in zip(axes_dim, pos):
        inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64)[: d // 2] / d)
        parts.append(np.outer(p.reshape(-1), inv))
    return np.concatenate(parts, axis=1)


def rope_tables(cfg: HunyuanVideoConfig, grid):
    ang = rope_angles(cfg.rope_axes_dim, grid, cfg.rope_theta)
    return jnp.asarray(np.cos(ang), F32), jnp.asarray(np.sin(ang), F32)


def first_frame_tokens(grid) -> jnp.ndarray:
    """bool [f*h*w]: the tokens of the first latent frame (token_replace)."""
    f, h, w = grid
    return jnp.arange(f * h * w) < h * w


def text_lengths(mask) -> jnp.ndarray:
    """The valid text tokens per row: the mask's count (the reference keeps the first ``count``
    text keys)."""
    return jnp.sum(jnp.asarray(mask) != 0, axis=1).astype(jnp.int32)


def forward(state, cfg: HunyuanVideoConfig, x, t, ctx, mask, pooled, guidance=None, *, attn_impl=None, rope=None):
    """Velocity prediction from a state (pure: ``jax.jit(forward, static_argnums=1)``); single
    device or compiler-partitioned. For meshes and offloading see :func:`runner`."""
    return merge(state, cfg)(x, t, ctx, mask, pooled, guidance, par=vsh.ParallelContext(attn_impl=attn_impl),
                             rope=rope)


# ----------------------------------------------------------------------------------- sharding
#: TP splits the heads (q/k/v and their text twins by output, attention outputs by input), the MLP
#: width (up by output, down and the single block's MLP half of proj_out by input) and, HunyuanVideo's
#: delta to the core table (``DualStreamHooks.AXIS_DELTAS``), the modulation projections' columns
#: (gathered after; they hold a quarter of the weights). The token refiner, embedders and head stay
#: whole. SP keeps every weight whole and splits the video tokens.
def parallel_constraints(cfg: HunyuanVideoConfig, *, tokens: int | None = None, batch: int | None = None):
    r = [vmesh.UlyssesHeads("num_heads", cfg.num_heads),
         vmesh.Divisible("mlp_dim", cfg.mlp_dim, ("tp",), "the MLP width is split over tp")]
    return r + vmesh.input_rules(tokens, batch, what="video tokens")


def parse_chunk_sizes(offload_chunk_size, cfg: HunyuanVideoConfig) -> dict[str, int]:
    """Chunk size per pool from ``offload_chunk_size``: one value for both stacks (an int dividing
    both block counts, or "all"), a mapping, or a spec ``"double=4,single=8"`` (a pool not named
    streams whole). Each must divide its stack (one compiled chunk program per pool)."""
    counts = {"double": cfg.num_layers, "single": cfg.num_single_layers}
    v = offload_chunk_size
    if isinstance(v, str) and "=" in v:
        items = {}
        for part in v.replace(" ", "").split(","):
            k, _, n = part.partition("=")
            if k not in counts or not (n == "all" or n.isdigit()):
                raise voff.OffloadConfigError(f"offload_chunk_size={v!r}: expected pools double=N,single=M "
                                              f"(N, M block counts or all)")
            items[k] = n if n == "all" else int(n)
        v = items
    if isinstance(v, dict):
        bad = sorted(set(v) - set(counts))
        if bad:
            raise voff.OffloadConfigError(f"offload_chunk_size: unknown pools {bad}; pools are double, single")
        out = {}
        for k, n in counts.items():
            try:
                out[k] = voff.resolve_chunk_size(v.get(k, "all"), n)
            except voff.OffloadConfigError as e:
                raise voff.OffloadConfigError(f"{k} blocks: {e}") from None
        return out
    out = {}
    for k, n in counts.items():
        try:
            out[k] = voff.resolve_chunk_size(v, n)
        except voff.OffloadConfigError as e:
            raise voff.OffloadConfigError(f"{k} blocks: {e}; or give each pool its own: "
                                          f"offload_chunk_size='double=N,single=M'") from None
    return out


def runner(state, cfg: HunyuanVideoConfig, mesh=None, parallelism=None, **kw) -> DiTRunner:
    """The HunyuanVideo DiT on a ``(dp, tp, sp)`` mesh through ``vidax.core.runner.DiTRunner``, both
    block stacks resident or each streamed through its own offload pool (``offload_chunk_size``:
    :func:`parse_chunk_sizes`, e.g. ``"double=5,single=8"``). Called like :func:`forward`."""
    return KIT.runner(state, cfg, mesh, parallelism, constraints=parallel_constraints(cfg), **kw)


# ----------------------------------------------------------------------------------- checkpoints
def load_dit(path, cfg: HunyuanVideoConfig | None = None, dtype=np.float32):
    """DiT weights from a diffusers folder (config.json + safetensors) or an original-release
    checkpoint (``mp_rank_00_model_states.pt`` or a safetensors file with its names). Returns
    ``(state, cfg)``: the abstract state filled tensor by tensor with host numpy (cast on the host)."""
    from vidax.models.hunyuanvideo import convert  # (it imports this module's config)

    def view(ckpt, c, original):
        return convert.split_proj_out(convert.original_to_diffusers(ckpt, c) if original else ckpt, c.dim)

    return KIT.load(path, cfg, dtype, from_config=HunyuanVideoConfig.from_diffusers, is_original=convert.is_original,
                    config_from_original=convert.config_from_original, view=view,
                    keymap=lambda c, original: convert.diffusers_keymap(c),
                    what=lambda c: f"HunyuanVideoTransformer3DModel (dim {c.dim}, {c.num_layers}+{c.num_single_layers} blocks)")


# ----------------------------------------------------------------------------------- compat
class _Compat(compat.CompatModel):
    def __init__(self, config, state, cfg, runner: DiTRunner | None = None):
        super().__init__("HunyuanVideoTransformer3DModel", config, state, cfg)
        self.runner = runner
        self._fwd = jax.jit(lambda state, *a: forward(state, cfg, *a)) if runner is None else None

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, pooled_projections,
                guidance=None, **_):
        x = jnp.asarray(np.asarray(hidden_states, np.float32)).transpose(0, 2, 3, 4, 1)
        t = jnp.asarray(np.asarray(timestep), F32)
        if t.ndim == 0:
            t = jnp.broadcast_to(t, (x.shape[0],))
        g = None if guidance is None else jnp.broadcast_to(jnp.asarray(np.asarray(guidance), F32), (x.shape[0],))
        args = (x, t, jnp.asarray(encoder_hidden_states, F32), jnp.asarray(encoder_attention_mask, F32),
                jnp.asarray(pooled_projections, F32), g)
        y = self.runner(*args) if self.runner is not None else self._fwd(self.params, *args)
        return np.asarray(y).transpose(0, 4, 1, 2, 3)


compat.register_dit("HunyuanVideoTransformer3DModel", HunyuanVideoConfig.from_diffusers, _Compat, load_dit, runner,
                    constraints=parallel_constraints, check_chunks=parse_chunk_sizes)
