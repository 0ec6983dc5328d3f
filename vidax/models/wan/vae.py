"""Wan video VAE (diffusers ``AutoencoderKLWan``: Wan2.1, Wan2.2) in JAX: modules, key maps, the
chunk programs, encode/decode with the causal cache, loading (design notes: this family's README.md)."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from functools import lru_cache, partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax import compat
from vidax.core import conv as vconv
from vidax.core import nn
from vidax.core.attention import attention
from vidax.weights import KeyMap, Rule, load_checkpoint_params, open_checkpoint

# Wan2.1 latent statistics (diffusers' AutoencoderKLWan defaults).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)

ENCODE_CHUNK_FRAMES = 4  # frames per encode chunk after the first (the reference's fixed value)


# ----------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class WanVAEConfig:
    """Mirrors diffusers' ``AutoencoderKLWan`` config (field names and defaults = Wan2.1 release).

    ``in_channels`` / ``out_channels`` count channels after patchify (Wan2.2: 12 = 3 x 2 x 2); the
    video itself has ``in_channels // patch**2`` channels."""

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple = ()
    temperal_downsample: tuple = (False, True, True)
    dropout: float = 0.0  # inference only: unused
    latents_mean: tuple = WAN21_LATENTS_MEAN
    latents_std: tuple = WAN21_LATENTS_STD
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8

    def __post_init__(self):
        # normalise lists to tuples (hashable: the config is a static jit argument)
        for f in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            v = getattr(self, f)
            if v is not None and not isinstance(v, tuple):
                object.__setattr__(self, f, tuple(v))
        object.__setattr__(self, "attn_scales", tuple(float(s) for s in self.attn_scales))
        object.__setattr__(self, "temperal_downsample", tuple(bool(t) for t in self.temperal_downsample))
        if self.patch_size is not None and (int(self.patch_size) != self.patch_size or self.patch_size < 1):
            raise ValueError(f"patch_size must be None or a positive integer, got {self.patch_size!r}")
        if len(self.dim_mult) < 1:
            raise ValueError("dim_mult must not be empty")
        if len(self.temperal_downsample) < len(self.dim_mult) - 1:
            raise ValueError(
                f"temperal_downsample has {len(self.temperal_downsample)} entries; "
                f"dim_mult {self.dim_mult} needs {len(self.dim_mult) - 1}"
            )
        if 2 ** sum(self.temperal_downsample[: len(self.dim_mult) - 1]) > ENCODE_CHUNK_FRAMES:
            raise ValueError(
                f"temperal_downsample {self.temperal_downsample}: more than 2 temporal downsamples do not fit "
                f"the reference's {ENCODE_CHUNK_FRAMES}-frame encode chunks"
            )
        if self.is_residual:  # the shortcuts fold/unfold (t, h, w) neighbourhoods into channels
            n = len(self.dim_mult)
            enc = [self.base_dim * u for u in (1, *self.dim_mult)]
            dec = [self.dec_base_dim * u for u in (self.dim_mult[-1], *self.dim_mult[::-1])]
            for i in range(n - 1):
                f_down = (2 if self.temperal_downsample[i] else 1) * 4
                f_up = (2 if self.temperal_upsample[i] else 1) * 4
                if enc[i] * f_down % enc[i + 1] or dec[i + 1] * f_up % dec[i]:
                    raise ValueError(
                        f"is_residual: level {i} channel counts do not divide evenly for the pooling/"
                        f"duplicating shortcuts (dim_mult {self.dim_mult}, base_dim {self.base_dim}, "
                        f"decoder_base_dim {self.decoder_base_dim})"
                    )
            if enc[n - 1] % enc[n]:
                raise ValueError(f"is_residual: the last encoder level's shortcut cannot average {enc[n - 1]} "
                                 f"channels down to {enc[n]}")
        if self.latents_mean is not None and len(self.latents_mean) != self.z_dim:
            warnings.warn(f"latents_mean has {len(self.latents_mean)} entries for z_dim={self.z_dim}")

    @property
    def dec_base_dim(self) -> int:
        return self.base_dim if self.decoder_base_dim is None else self.decoder_base_dim

    @property
    def temperal_upsample(self) -> tuple:
        return tuple(self.temperal_downsample[: len(self.dim_mult) - 1][::-1])

    @property
    def temporal_ratio(self) -> int:
        return 2 ** sum(self.temperal_downsample[: len(self.dim_mult) - 1])

    @property
    def patch(self) -> int:
        return self.patch_size or 1

    @property
    def spatial_ratio(self) -> int:
        return 2 ** (len(self.dim_mult) - 1) * self.patch

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "WanVAEConfig":
        names = {f.name for f in fields(cls)}
        kw, unknown = {}, []
        for k, v in cfg.items():
            if k.startswith("_"):
                continue
            if k in names:
                kw[k] = tuple(v) if isinstance(v, list) else v
            else:
                unknown.append(k)
        if unknown:
            warnings.warn(f"AutoencoderKLWan config: ignoring unknown fields {sorted(unknown)}")
        return cls(**kw)



def _latent_stats(cfg: WanVAEConfig, z, axis: int):
    if cfg.latents_mean is None or cfg.latents_std is None:
        raise ValueError("this VAE config has no latents_mean / latents_std")
    shape = [1] * np.ndim(z)
    shape[axis] = -1
    m = np.asarray(cfg.latents_mean, np.float32).reshape(shape)
    s = np.asarray(cfg.latents_std, np.float32).reshape(shape)
    return m, s


def normalize_latents(cfg: WanVAEConfig, z, axis: int = 1):
    """VAE latents -> the DiT's latents, ``(z - latents_mean) / latents_std`` (as the Wan pipelines do);
    channels on ``axis`` (1: the reference layout [B, C, F, H, W]; -1: channels-last)."""
    m, s = _latent_stats(cfg, z, axis)
    return ((z - m) / s).astype(z.dtype)


def denormalize_latents(cfg: WanVAEConfig, z, axis: int = 1):
    """The DiT's latents -> VAE latents, ``z * latents_std + latents_mean`` (before :func:`decode`)."""
    m, s = _latent_stats(cfg, z, axis)
    return (z * s + m).astype(z.dtype)


PRESETS = {
    "tiny": WanVAEConfig(base_dim=16, z_dim=4, dim_mult=(1, 2, 4, 4), num_res_blocks=1,
                         latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4),
    "wan2.1": WanVAEConfig(),
    # structure only: the real latents_mean/std (48 each) come with the checkpoint's config.json
    "wan2.2": WanVAEConfig(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, patch_size=2,
                           in_channels=12, out_channels=12, scale_factor_spatial=16,
                           latents_mean=(0.0,) * 48, latents_std=(1.0,) * 48),
}


# ----------------------------------------------------------------------------------- structure
class _Enc(NamedTuple):
    kind: str  # "res" | "attn" | "down2d" | "down3d"
    cin: int
    cout: int


class _Up(NamedTuple):
    cin: int
    cout: int
    mode: str | None  # None | "up2d" | "up3d"
    up_out: int  # channels after the upsampler


class _Down(NamedTuple):  # a Wan2.2 residual down block
    cin: int
    cout: int
    mode: str | None  # None | "down2d" | "down3d"


def _encoder_plan(cfg: WanVAEConfig) -> tuple[list[_Enc], int]:
    """The encoder's ``down_blocks`` in order (diffusers indices = list indices)."""
    dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
    n = len(cfg.dim_mult)
    out, scale = [], 1.0
    for i in range(n):
        cin, cout = dims[i], dims[i + 1]
        for _ in range(cfg.num_res_blocks):
            out.append(_Enc("res", cin, cout))
            if scale in cfg.attn_scales:
                out.append(_Enc("attn", cout, cout))
            cin = cout
        if i != n - 1:
            out.append(_Enc("down3d" if cfg.temperal_downsample[i] else "down2d", cout, cout))
            scale /= 2.0
    return out, dims[-1]


def _residual_encoder_plan(cfg: WanVAEConfig) -> tuple[list[_Down], int]:
    """Wan2.2: ``down_blocks`` are residual blocks (num_res_blocks resnets, an optional downsampler,
    plus a parameter-free average-pooling shortcut); attn_scales is not used."""
    dims = [cfg.base_dim * u for u in (1, *cfg.dim_mult)]
    n = len(cfg.dim_mult)
    out = []
    for i in range(n):
        mode = None if i == n - 1 else ("down3d" if cfg.temperal_downsample[i] else "down2d")
        out.append(_Down(dims[i], dims[i + 1], mode))
    return out, dims[-1]


def _decoder_plan(cfg: WanVAEConfig) -> tuple[list[_Up], int]:
    """The decoder's ``up_blocks`` (num_res_blocks + 1 resnets each, then an optional upsampler)."""
    d = cfg.dec_base_dim
    dims = [d * u for u in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
    n = len(cfg.dim_mult)
    ups = cfg.temperal_upsample
    out = []
    for i in range(n):
        cin, cout = dims[i], dims[i + 1]
        if i > 0 and not cfg.is_residual:
            cin //= 2  # Wan2.1: the previous upsampler halves the channels
        mode = None if i == n - 1 else ("up3d" if ups[i] else "up2d")
        # Wan2.2's upsamplers keep the channel count
        out.append(_Up(cin, cout, mode, cout if cfg.is_residual or not mode else cout // 2))
    return out, dims[0]



# ----------------------------------------------------------------------------------- array helpers
_HIGHEST = jax.lax.Precision.HIGHEST
#: how the convs over time run (see :meth:`CausalConv3d.over_time`): ``"taps"`` (the default on CPU),
#: ``"fold"`` or ``"native"`` (the default elsewhere, and under ``vidax.core.conv.default_impl``)
_conv_impl = vconv.conv_impl


class _Ctx:
    """Per-chunk trace-time state: the incoming cache (None on the first chunk), the new one, and
    how attention and the convs over time run."""

    def __init__(self, old: dict | None, attn_impl, conv_impl: str = "native"):
        self.old, self.new, self.attn_impl, self.conv_impl = old, {}, attn_impl, conv_impl

    @property
    def first(self) -> bool:
        return self.old is None


def _matmul(x, w, b=None):
    """``x [..., in] @ w [in, out] (+ b)`` at full precision: a 1x1 conv over the channel axis."""
    y = jnp.matmul(x, w.astype(x.dtype), precision=_HIGHEST)
    return y if b is None else y + b.astype(y.dtype)


def _conv2d(x, w, b=None, *, padding):
    """Channels-last 2-D conv of frames ``x`` [N, H, W, in] with a computed kernel ``w``
    [kh, kw, in, out] (folded time taps, upsampling phases) at full precision; 1x1: a matmul."""
    if w.shape[:2] == (1, 1):
        return _matmul(x, w[0, 0], b)
    if w.shape[-1] <= vconv.NARROW_MAX_OUT:  # the conv to RGB: a matmul and a shifted sum
        y = vconv.conv2d(x, w, padding=padding)
    else:
        y = jax.lax.conv_general_dilated(x, w.astype(x.dtype), (1, 1), padding,
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"), precision=_HIGHEST)
    return y if b is None else y + b.astype(y.dtype)


def _per_frame(fn, x):
    """Apply a 2-D (``[N, H, W, C]``) function to every frame of ``x`` [B, T, H, W, C]."""
    b, t = x.shape[:2]
    y = fn(x.reshape(b * t, *x.shape[2:]))
    return y.reshape(b, t, *y.shape[1:])


def _tail(old, x, n: int):
    """The last ``n`` frames of ``[old, x]`` (concatenated on the frame axis); ``old=None``: zeros."""
    t = x.shape[1]
    if t >= n:
        return x[:, t - n:]
    if old is None:
        old = jnp.zeros((x.shape[0], n, *x.shape[2:]), x.dtype)
    return jnp.concatenate([old[:, old.shape[1] - (n - t):].astype(x.dtype), x], axis=1)


def _tap(old, x, k: int, n_old: int, span: int, stride: int):
    """Frames ``k, k + stride, ... < k + span`` of ``[old, x]`` (``old=None``: ``n_old`` zero frames),
    taken from ``old`` and ``x`` directly (the concatenation itself is never materialised)."""
    idx = range(k, k + span, stride)
    n_in_old = sum(1 for j in idx if j < n_old)
    parts = []
    if n_in_old:
        parts.append(jnp.zeros((x.shape[0], n_in_old, *x.shape[2:]), x.dtype) if old is None
                     else old[:, k: min(n_old, k + span): stride].astype(x.dtype))
    if n_in_old < len(idx):
        parts.append(x[:, idx[n_in_old] - n_old: k + span - n_old: stride])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)


def _up_taps(w, axis: int):
    """Nearest 2x upsampling then a 3-tap 'same' conv along ``axis`` = per output phase a 2-tap conv
    of the original: phase 0 sees offsets (-1, 0) with (w0, w1 + w2), phase 1 offsets (0, +1) with
    (w0 + w1, w2)."""
    w0, w1, w2 = (jax.lax.index_in_dim(w, i, axis) for i in range(3))
    return jnp.concatenate([w0, w1 + w2], axis), jnp.concatenate([w0 + w1, w2], axis)


def _avg_down(x, cout: int, ft: int, fs: int):
    """Wan2.2 ``AvgDown3D`` shortcut: fold (ft, fs, fs) neighbourhoods into channels (zero-padding time
    in front to a multiple of ft), then average groups of consecutive channels down to ``cout``."""
    b, t, h, w, c = x.shape
    pad = (-t) % ft
    if pad:
        x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0), (0, 0), (0, 0)))
    t2 = (t + pad) // ft
    x = x.reshape(b, t2, ft, h // fs, fs, w // fs, fs, c).transpose(0, 1, 3, 5, 7, 2, 4, 6)
    x = x.reshape(b, t2, h // fs, w // fs, cout, c * ft * fs * fs // cout)
    return jnp.mean(x, axis=-1)


def _dup_up(x, cout: int, ft: int, fs: int, first: bool):
    """Wan2.2 ``DupUp3D`` shortcut: repeat channels, unfold them into (ft, fs, fs) neighbourhoods;
    the first chunk keeps only the last of its ft frames."""
    b, t, h, w, c = x.shape
    x = jnp.repeat(x, cout * ft * fs * fs // c, axis=-1)
    x = x.reshape(b, t, h, w, cout, ft, fs, fs).transpose(0, 1, 5, 2, 6, 3, 7, 4)
    x = x.reshape(b, t * ft, h * fs, w * fs, cout)
    return x[:, ft - 1:] if first else x


def patchify(x, p: int):
    """[B, F, H, W, C] -> [B, F, H/p, W/p, C p p] with the reference's channel order (c, w-offset, h-offset)."""
    if p == 1:
        return x
    b, f, h, w, c = x.shape
    if h % p or w % p:
        raise ValueError(f"height {h} and width {w} must be divisible by patch_size {p}")
    x = x.reshape(b, f, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, f, h // p, w // p, c * p * p)


def unpatchify(x, p: int):
    """Inverse of :func:`patchify`."""
    if p == 1:
        return x
    b, f, h, w, cpp = x.shape
    x = x.reshape(b, f, h, w, cpp // (p * p), p, p).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, f, h * p, w * p, cpp // (p * p))


# ----------------------------------------------------------------------------------- modules
# VAE weights are never sharded (the decode runs replicated or tiled): every axis is logical None.
def _replicated(init, ndim: int):
    return nn.logical(init, *(None,) * ndim)


class Conv(nnx.Conv):
    """``nnx.Conv`` (channels-last, kernel ``[*k, in, out]``) at full precision; a 1x1 kernel runs
    as a matmul over the channel axis (the same product; XLA's dot beats its 1x1 conv on CPU)."""

    def __init__(self, cin: int, cout: int, kernel: tuple, *, rngs: nnx.Rngs, strides=1, padding="VALID",
                 param_dtype=jnp.float32):
        super().__init__(cin, cout, kernel_size=tuple(kernel), strides=strides, padding=padding,
                         precision=_HIGHEST, param_dtype=param_dtype, rngs=rngs,
                         kernel_init=_replicated(nnx.initializers.lecun_normal(), len(kernel) + 2),
                         bias_init=_replicated(nnx.initializers.zeros_init(), 1))
        st = (strides,) * len(kernel) if isinstance(strides, int) else tuple(strides)
        self.pointwise = all(k == 1 for k in self.kernel_size) and all(s == 1 for s in st)

    def __call__(self, x):
        if self.pointwise:
            return _matmul(x, self.kernel[...].reshape(self.in_features, self.out_features), self.bias[...])
        w = vconv.kernel_value(self.kernel)
        if isinstance(w, tuple):  # stored split by time tap (vconv.split_taps): one 3-D conv of them
            return vconv.conv3d(x, w, self.bias[...], self.strides, self.padding, impl="native")
        return super().__call__(x)


class CausalConv3d(Conv):
    """diffusers' ``WanCausalConv3d`` on ``[B, T, H, W, C]``: kernel ``(kt, kh, kw)``, causal in time
    (the last ``kt - 1`` frames of the previous chunk in front, zeros before the video's first),
    'same' zero padding in space. Its cache entry is ``ctx.new[self.cache_name]`` (the module path,
    set by :class:`WanVAE`)."""

    def __init__(self, cin: int, cout: int, kernel: tuple = (3, 3, 3), *, rngs: nnx.Rngs, stride: int = 1,
                 param_dtype=jnp.float32):
        _, kh, kw = kernel
        super().__init__(cin, cout, kernel, strides=(stride, 1, 1), padding=((0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2)),
                         rngs=rngs, param_dtype=param_dtype)
        self.cache_name = ""

    def __call__(self, x, ctx: _Ctx):
        kt = self.kernel_size[0]
        if kt == 1:
            return super().__call__(x)
        old = None if ctx.first else ctx.old[self.cache_name]
        ctx.new[self.cache_name] = _tail(old, x, kt - 1)
        return self.over_time(ctx, old, x)

    def over_time(self, ctx: _Ctx, old, x):
        """VALID conv over time (stride ``self.strides[0]``) of ``[old, x]`` (concatenated on the frame
        axis; ``old=None``: kt-1 zero frames), 'same' zero padding in space.

        ``"native"`` runs it as one 3-D conv (``nnx.Conv``). ``"fold"`` folds the kt time taps into
        the channel axis (one copy of the input, kt times wider) and runs one 2-D conv (a matmul for
        1x1 spatial kernels) per frame: XLA's CPU backend has a fast 2-D conv and dot but a slow
        generic 3-D conv. ``"taps"`` runs one 2-D conv per time tap (kernel ``w[k]``, a contiguous
        slice of the stored kernel: no per-call weight transpose, no kt-times-wider input copy) and
        sums them: the fastest on XLA:CPU (``benchmarks/profile_wan_vae.py``). With ``old=None`` the
        taps that only ever see the zero frames are left out."""
        kt, kh, kw = self.kernel_size
        stride = self.strides[0]
        n_old = kt - 1 if old is None else old.shape[1]
        if ctx.conv_impl == "native":
            old = jnp.zeros((x.shape[0], n_old, *x.shape[2:]), x.dtype) if old is None else old.astype(x.dtype)
            return Conv.__call__(self, jnp.concatenate([old, x], axis=1))
        tout = (n_old + x.shape[1] - kt) // stride + 1
        span = stride * (tout - 1) + 1
        k0 = max(0, n_old - span + 1) if old is None else 0  # taps below k0 only meet zero frames
        w = vconv.kernel_value(self.kernel)  # whole, or split by time tap (state_from_pure)
        m = (vconv.winograd_blocks(tout, kt, (kt - k0) * tout, x.shape[2] * x.shape[3], self.out_features)
             if ctx.conv_impl == "taps" and stride == 1 else 0)
        if m:  # fewer frame convs by Winograd along time (vconv.winograd_time_conv)
            xp = jnp.concatenate([_tap(old, x, 0, n_old, n_old, 1), x], axis=1) if n_old else x
            y = vconv.winograd_time_conv(xp, [w[k] for k in range(kt)], m,
                                         lambda f, wk: _conv2d(f, wk, padding=self.padding[1:]))
            return y + self.bias[...].astype(y.dtype)
        if ctx.conv_impl == "taps":
            y = None
            for k in range(k0, kt):
                xk = _tap(old, x, k, n_old, span, stride)  # [B, tout, H, W, cin]
                yk = _per_frame(lambda f, k=k: _conv2d(f, w[k], padding=self.padding[1:]), xk)
                y = yk if y is None else y + yk
            return y + self.bias[...].astype(y.dtype)
        xs = [_tap(old, x, k, n_old, span, stride) for k in range(k0, kt)]
        xc = xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=-1)  # [B, tout, H, W, (kt - k0) cin]
        w = jnp.stack(w[k0:]).transpose(1, 2, 0, 3, 4).reshape(kh, kw, (kt - k0) * self.in_features, self.out_features)
        return _per_frame(lambda f: _conv2d(f, w, self.bias[...], padding=self.padding[1:]), xc)


class ChannelNorm(nnx.Module):
    """diffusers' ``WanRMS_norm`` (channels-last): ``x / max(||x||_2, 1e-12) * sqrt(C) * gamma`` over
    the channel axis, in float32. Not ``nnx.RMSNorm``: the reference divides by the clamped L2 norm
    (not ``sqrt(mean + eps)``), which differs near zero."""

    def __init__(self, dim: int, *, param_dtype=jnp.float32):
        self.gamma = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=(None,))  # logical axes: replicated

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        n = jnp.sqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True))
        y = xf / jnp.maximum(n, 1e-12) * math.sqrt(x.shape[-1]) * self.gamma[...].astype(jnp.float32)
        return y.astype(x.dtype)


class ResidualBlock(nnx.Module):
    """diffusers' ``WanResidualBlock``: (norm, SiLU, causal 3x3x3 conv) x 2 plus a shortcut (a 1x1x1
    conv when the width changes)."""

    def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm1 = ChannelNorm(cin, param_dtype=param_dtype)
        self.conv1 = CausalConv3d(cin, cout, **kw)
        self.norm2 = ChannelNorm(cout, param_dtype=param_dtype)
        self.conv2 = CausalConv3d(cout, cout, **kw)
        self.conv_shortcut = CausalConv3d(cin, cout, (1, 1, 1), **kw) if cin != cout else None

    def __call__(self, x, ctx: _Ctx):
        h = x if self.conv_shortcut is None else self.conv_shortcut(x, ctx)
        y = self.conv1(jax.nn.silu(self.norm1(x)), ctx)
        y = self.conv2(jax.nn.silu(self.norm2(y)), ctx)
        return y + h


class AttentionBlock(nnx.Module):
    """diffusers' ``WanAttentionBlock``: single-head self-attention over each frame's pixels."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm = ChannelNorm(dim, param_dtype=param_dtype)
        self.to_qkv = Conv(dim, 3 * dim, (1, 1), **kw)
        self.proj = Conv(dim, dim, (1, 1), **kw)

    def __call__(self, x, ctx: _Ctx):
        b, t, h, w, c = x.shape
        qkv = self.to_qkv(self.norm(x).reshape(b * t, h * w, c)).reshape(b * t, h * w, 3, 1, c)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        # the single head has the full channel width (384 for Wan2.1): fused kernels rarely take it
        impl = ctx.attn_impl or ("xla" if c > 128 else None)
        o = attention(q, k, v, impl=impl).reshape(b, t, h, w, c)
        return x + self.proj(o)


class Resample(nnx.Module):
    """diffusers' ``WanResample``. ``down2d``/``down3d``: ZeroPad2d((0, 1, 0, 1)) then a stride-2 3x3
    conv per frame (``down3d``: then a stride-2 (3, 1, 1) time conv, keeping the input's last frame
    as cache). ``up2d``/``up3d``: (``up3d``: a (3, 1, 1) time conv to 2C channels, read as two
    frames per frame) then nearest 2x upsampling and a 3x3 conv per frame, run as four 2x2 convs of
    the low-resolution frames. The first chunk skips the time convs, as the reference does."""

    def __init__(self, dim: int, mode: str, cout: int | None = None, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.mode = mode
        if mode.startswith("down"):
            self.conv = Conv(dim, dim, (3, 3), strides=2, padding=((0, 1), (0, 1)), **kw)
        else:
            self.conv = Conv(dim, dim if cout is None else cout, (3, 3), padding=((1, 1), (1, 1)), **kw)
        if mode == "down3d":
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=2, **kw)
        elif mode == "up3d":
            self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1), **kw)
        else:
            self.time_conv = None

    def __call__(self, x, ctx: _Ctx):
        return self._down(x, ctx) if self.mode.startswith("down") else self._up(x, ctx)

    def _down(self, x, ctx: _Ctx):
        y = self.conv(x)  # nnx.Conv folds [B, T] into one batch axis: a 2-D conv per frame
        if self.time_conv is None:
            return y
        key = self.time_conv.cache_name
        old = None if ctx.first else ctx.old[key]
        ctx.new[key] = y[:, -1:]
        if ctx.first:
            return y  # the reference skips the time conv on the first chunk
        return self.time_conv.over_time(ctx, old, y)

    def _up(self, x, ctx: _Ctx):
        if self.time_conv is not None:
            key = self.time_conv.cache_name
            if ctx.first:
                # the reference skips the time conv on the first chunk and starts the next one from zeros
                ctx.new[key] = jnp.zeros((x.shape[0], 2, *x.shape[2:]), x.dtype)
            else:
                old = ctx.old[key]
                ctx.new[key] = _tail(old, x, 2)
                y = self.time_conv.over_time(ctx, old, x)  # [B, T, H, W, 2C]
                b, t, h, w, c2 = y.shape
                # channels [0, C) are each pair's first frame, [C, 2C) its second
                x = y.reshape(b, t, h, w, 2, c2 // 2).transpose(0, 1, 4, 2, 3, 5).reshape(b, 2 * t, h, w, c2 // 2)
        return _per_frame(self._upsample_conv, x)

    def _upsample_conv(self, y):
        """Nearest 2x upsampling followed by the 3x3 'same' conv, on frames ``y`` [N, h, w, C], as four
        2x2 convs of ``y`` (one per output pixel phase; 16 instead of 36 taps per input pixel, and no
        upsampled copy of the input), interleaved into [N, 2h, 2w, C']."""
        n, h, w, _ = y.shape
        rows = _up_taps(self.conv.kernel[...], 0)
        outs = []
        for a in range(2):
            cols = _up_taps(rows[a], 1)
            for c in range(2):
                outs.append(_conv2d(y, cols[c], padding=((1 - a, a), (1 - c, c))))
        o = jnp.stack(outs).reshape(2, 2, n, h, w, -1).transpose(2, 3, 0, 4, 1, 5).reshape(n, 2 * h, 2 * w, -1)
        return o + self.conv.bias[...].astype(o.dtype)


class MidBlock(nnx.Module):
    """diffusers' ``WanMidBlock``: residual block, attention, residual block."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.resnets = nnx.List([ResidualBlock(dim, dim, **kw), ResidualBlock(dim, dim, **kw)])
        self.attentions = nnx.List([AttentionBlock(dim, **kw)])

    def __call__(self, x, ctx: _Ctx):
        x = self.resnets[0](x, ctx)
        x = self.attentions[0](x, ctx)
        return self.resnets[1](x, ctx)


class ResidualDownBlock(nnx.Module):
    """Wan2.2's ``WanResidualDownBlock``: residual blocks, an optional downsampler, plus the
    parameter-free ``AvgDown3D`` shortcut."""

    def __init__(self, blk: _Down, num_res_blocks: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.resnets = nnx.List([ResidualBlock(blk.cin if r == 0 else blk.cout, blk.cout, **kw)
                                 for r in range(num_res_blocks)])
        self.downsampler = Resample(blk.cout, blk.mode, **kw) if blk.mode else None
        self.cout = blk.cout
        self.factors = (2 if blk.mode == "down3d" else 1, 2 if blk.mode else 1)

    def __call__(self, x, ctx: _Ctx):
        x0 = x
        for r in self.resnets:
            x = r(x, ctx)
        if self.downsampler is not None:
            x = self.downsampler(x, ctx)
        return x + _avg_down(x0, self.cout, *self.factors)


class UpBlock(nnx.Module):
    """A decoder level: ``num_res_blocks + 1`` residual blocks, then an optional upsampler (diffusers'
    ``WanUpBlock``); Wan2.2 (``residual``, ``WanResidualUpBlock``) adds the parameter-free
    ``DupUp3D`` shortcut around the level when it upsamples."""

    def __init__(self, lv: _Up, num_res_blocks: int, residual: bool, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.resnets = nnx.List([ResidualBlock(lv.cin if r == 0 else lv.cout, lv.cout, **kw)
                                 for r in range(num_res_blocks + 1)])
        self.upsampler = Resample(lv.cout, lv.mode, lv.up_out, **kw) if lv.mode else None
        self.shortcut_t = (2 if lv.mode == "up3d" else 1) if residual and lv.mode else None
        self.cout = lv.cout

    def __call__(self, x, ctx: _Ctx):
        x0 = x
        for r in self.resnets:
            x = r(x, ctx)
        if self.upsampler is not None:
            x = self.upsampler(x, ctx)
        if self.shortcut_t is not None:
            x = x + _dup_up(x0, self.cout, self.shortcut_t, 2, ctx.first)
        return x


class Encoder(nnx.Module):
    """diffusers' ``WanEncoder3d`` (channels-last; the patchified video in, moments' features out)."""

    def __init__(self, cfg: WanVAEConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.conv_in = CausalConv3d(cfg.in_channels, cfg.base_dim, **kw)
        if cfg.is_residual:
            plan, top = _residual_encoder_plan(cfg)
            blocks = [ResidualDownBlock(blk, cfg.num_res_blocks, **kw) for blk in plan]
        else:
            plan, top = _encoder_plan(cfg)
            blocks = [ResidualBlock(e.cin, e.cout, **kw) if e.kind == "res"
                      else AttentionBlock(e.cout, **kw) if e.kind == "attn"
                      else Resample(e.cout, e.kind, **kw) for e in plan]
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock(top, **kw)
        self.norm_out = ChannelNorm(top, param_dtype=param_dtype)
        self.conv_out = CausalConv3d(top, 2 * cfg.z_dim, **kw)

    def __call__(self, x, ctx: _Ctx):
        x = self.conv_in(x, ctx)
        for blk in self.down_blocks:
            x = blk(x, ctx)
        x = self.mid_block(x, ctx)
        return self.conv_out(jax.nn.silu(self.norm_out(x)), ctx)


class Decoder(nnx.Module):
    """diffusers' ``WanDecoder3d`` (channels-last; latents' features in, patchified pixels out)."""

    def __init__(self, cfg: WanVAEConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        plan, top = _decoder_plan(cfg)
        self.conv_in = CausalConv3d(cfg.z_dim, top, **kw)
        self.mid_block = MidBlock(top, **kw)
        self.up_blocks = nnx.List([UpBlock(lv, cfg.num_res_blocks, cfg.is_residual, **kw) for lv in plan])
        self.norm_out = ChannelNorm(plan[-1].cout, param_dtype=param_dtype)
        self.conv_out = CausalConv3d(plan[-1].cout, cfg.out_channels, **kw)

    def __call__(self, x, ctx: _Ctx):
        x = self.conv_in(x, ctx)
        x = self.mid_block(x, ctx)
        for blk in self.up_blocks:
            x = blk(x, ctx)
        return self.conv_out(jax.nn.silu(self.norm_out(x)), ctx)


class WanVAE(nnx.Module):
    """diffusers' ``AutoencoderKLWan`` as an NNX module (one chunk at a time, channels-last)."""

    def __init__(self, cfg: WanVAEConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.encoder = Encoder(cfg, **kw)
        self.quant_conv = CausalConv3d(2 * cfg.z_dim, 2 * cfg.z_dim, (1, 1, 1), **kw)
        self.post_quant_conv = CausalConv3d(cfg.z_dim, cfg.z_dim, (1, 1, 1), **kw)
        self.decoder = Decoder(cfg, **kw)
        self.patch = cfg.patch
        for path, m in nnx.iter_modules(self):  # each conv's cache entry is named by its module path
            if isinstance(m, CausalConv3d):
                m.cache_name = ".".join(map(str, path))

    @property
    def dtype(self):
        """The compute dtype: the parameters'."""
        return vconv.kernel_dtype(self.decoder.conv_in.kernel)

    def encode(self, x, ctx: _Ctx):
        """Video frames [B, t, H, W, C] -> moments [B, f, h, w, 2 z_dim] (mean, then logvar)."""
        x = patchify(x.astype(self.dtype), self.patch)
        return self.quant_conv(self.encoder(x, ctx), ctx)

    def decode(self, z, ctx: _Ctx, raw: bool = False):
        """One latent frame [B, 1, h, w, z_dim] -> pixels [B, t, H, W, C] clamped to [-1, 1]; ``raw``:
        the decoder's output as it is (still patchified, not clamped: what tiles are blended from)."""
        x = self.post_quant_conv(z.astype(self.dtype), ctx)  # 1x1x1: per chunk = on the whole latent
        if raw:
            return self.decoder(x, ctx)
        return jnp.clip(unpatchify(self.decoder(x, ctx), self.patch), -1.0, 1.0)


# ----------------------------------------------------------------------------------- key maps
class _P(NamedTuple):
    dst: str  # NNX state path (dotted; what nnx.to_pure_dict nests)
    diff: str  # diffusers name
    orig: str | None  # original-release name (None: not representable)
    kind: str  # key-map layout kind


def _conv(dst, diff, orig, kind):
    return [_P(f"{dst}.kernel", f"{diff}.weight", orig and f"{orig}.weight", kind),
            _P(f"{dst}.bias", f"{diff}.bias", orig and f"{orig}.bias", "none")]


def _gamma(dst, diff, orig):
    return [_P(f"{dst}.gamma", f"{diff}.gamma", orig and f"{orig}.gamma", "flat")]


def _res_spec(dst, diff, orig, shortcut: bool):
    r = orig and f"{orig}.residual"
    s = (
        _gamma(f"{dst}.norm1", f"{diff}.norm1", r and f"{r}.0")
        + _conv(f"{dst}.conv1", f"{diff}.conv1", r and f"{r}.2", "conv3d")
        + _gamma(f"{dst}.norm2", f"{diff}.norm2", r and f"{r}.3")
        + _conv(f"{dst}.conv2", f"{diff}.conv2", r and f"{r}.6", "conv3d")
    )
    if shortcut:  # the width changes
        s += _conv(f"{dst}.conv_shortcut", f"{diff}.conv_shortcut", orig and f"{orig}.shortcut", "conv3d")
    return s


def _attn_spec(dst, diff, orig):
    return (
        _gamma(f"{dst}.norm", f"{diff}.norm", orig and f"{orig}.norm")
        + _conv(f"{dst}.to_qkv", f"{diff}.to_qkv", orig and f"{orig}.to_qkv", "conv2d")
        + _conv(f"{dst}.proj", f"{diff}.proj", orig and f"{orig}.proj", "conv2d")
    )


def _resample_spec(dst, diff, orig, mode):
    s = _conv(f"{dst}.conv", f"{diff}.resample.1", orig and f"{orig}.resample.1", "conv2d")
    if mode in ("down3d", "up3d"):
        s += _conv(f"{dst}.time_conv", f"{diff}.time_conv", orig and f"{orig}.time_conv", "conv3d")
    return s


def _mid_spec(side):
    return (
        _res_spec(f"{side}.mid_block.resnets.0", f"{side}.mid_block.resnets.0", f"{side}.middle.0", False)
        + _attn_spec(f"{side}.mid_block.attentions.0", f"{side}.mid_block.attentions.0", f"{side}.middle.1")
        + _res_spec(f"{side}.mid_block.resnets.1", f"{side}.mid_block.resnets.1", f"{side}.middle.2", False)
    )


def _original_decoder_has_attention(cfg: WanVAEConfig) -> bool:
    # The original Decoder3d puts attention blocks in its upsamples where scale is in attn_scales
    # (scale starts at 1 / 2**(n-2) and doubles per level); diffusers' decoder never does.
    n = len(cfg.dim_mult)
    scale = 1.0 / 2 ** (n - 2)
    for _ in range(n):
        if scale in cfg.attn_scales:
            return True
        scale *= 2.0
    return False


def _spec(cfg: WanVAEConfig) -> list[_P]:
    """Every parameter: NNX state path, diffusers name, original-release name, layout kind."""
    s: list[_P] = []
    s += _conv("encoder.conv_in", "encoder.conv_in", "encoder.conv1", "conv3d")
    if cfg.is_residual:
        for i, blk in enumerate(_residual_encoder_plan(cfg)[0]):
            cin, name = blk.cin, f"encoder.down_blocks.{i}"
            for r in range(cfg.num_res_blocks):
                s += _res_spec(f"{name}.resnets.{r}", f"{name}.resnets.{r}", None, cin != blk.cout)
                cin = blk.cout
            if blk.mode:
                s += _resample_spec(f"{name}.downsampler", f"{name}.downsampler", None, blk.mode)
    else:
        for j, layer in enumerate(_encoder_plan(cfg)[0]):
            name, orig = f"encoder.down_blocks.{j}", f"encoder.downsamples.{j}"
            if layer.kind == "res":
                s += _res_spec(name, name, orig, layer.cin != layer.cout)
            elif layer.kind == "attn":
                s += _attn_spec(name, name, orig)
            else:
                s += _resample_spec(name, name, orig, layer.kind)
    s += _mid_spec("encoder")
    s += _gamma("encoder.norm_out", "encoder.norm_out", "encoder.head.0")
    s += _conv("encoder.conv_out", "encoder.conv_out", "encoder.head.2", "conv3d")
    s += _conv("quant_conv", "quant_conv", "conv1", "conv3d")
    s += _conv("post_quant_conv", "post_quant_conv", "conv2", "conv3d")

    s += _conv("decoder.conv_in", "decoder.conv_in", "decoder.conv1", "conv3d")
    s += _mid_spec("decoder")
    flat = 0  # the original release numbers the decoder's upsamples flat
    for i, lv in enumerate(_decoder_plan(cfg)[0]):
        cin, name = lv.cin, f"decoder.up_blocks.{i}"
        for r in range(cfg.num_res_blocks + 1):
            s += _res_spec(f"{name}.resnets.{r}", f"{name}.resnets.{r}",
                           None if cfg.is_residual else f"decoder.upsamples.{flat}", cin != lv.cout)
            cin = lv.cout
            flat += 1
        if lv.mode:
            s += _resample_spec(f"{name}.upsampler", f"{name}." + ("upsampler" if cfg.is_residual else "upsamplers.0"),
                                None if cfg.is_residual else f"decoder.upsamples.{flat}", lv.mode)
            flat += 1
    s += _gamma("decoder.norm_out", "decoder.norm_out", "decoder.head.0")
    s += _conv("decoder.conv_out", "decoder.conv_out", "decoder.head.2", "conv3d")
    return s


def diffusers_keymap(cfg: WanVAEConfig) -> KeyMap:
    """diffusers ``AutoencoderKLWan`` names -> NNX state paths of :class:`WanVAE`."""
    return KeyMap([Rule(e.diff, e.dst, e.kind) for e in _spec(cfg)])


def original_keymap(cfg: WanVAEConfig) -> KeyMap:
    """Names of the original release file ``Wan2.1_VAE.pth`` (``WanVAE_`` of the Wan repository) ->
    NNX state paths of :class:`WanVAE`."""
    if cfg.is_residual:
        raise NotImplementedError(
            "original_keymap: is_residual=True (Wan2.2_VAE.pth naming) is not mapped; use a diffusers folder"
        )
    if _original_decoder_has_attention(cfg):
        raise NotImplementedError(
            f"attn_scales={cfg.attn_scales}: the original Wan decoder would have attention blocks in its "
            "upsamples, which diffusers' AutoencoderKLWan (the reference ported here) does not model"
        )
    return KeyMap([Rule(e.orig, e.dst, e.kind) for e in _spec(cfg)])


# ----------------------------------------------------------------------------------- state
@lru_cache(maxsize=16)
def _abstract(cfg: WanVAEConfig):
    """``(graphdef, abstract state)`` of :class:`WanVAE` for ``cfg`` (traced once per config: ``nn.abstract_state``)."""
    return nn.abstract_state(lambda: WanVAE(cfg, rngs=nnx.Rngs(0)))


def _abstract_state(cfg: WanVAEConfig):
    """A fresh abstract state, the caller's own (``nn.fill`` fills it in place; ``_abstract`` is shared)."""
    return jax.tree.map(lambda x: x, _abstract(cfg)[1])


def graphdef(cfg: WanVAEConfig) -> nnx.GraphDef:
    """The :class:`WanVAE` graph for ``cfg`` (one object per config, traced once). It merges with a
    state of any parameter dtype."""
    return _abstract(cfg)[0]


def init_params(cfg: WanVAEConfig, seed: int = 0, dtype=np.float32) -> nnx.State:
    """The state of a :class:`WanVAE` with seeded random weights (host numpy), for presets and tests.

    The modules' own initialisers (lecun-normal kernels, zero biases, unit gains) are reproduced on
    the host with numpy rather than run: run eagerly, each distinct parameter shape compiles its
    own small random program (about 60 compiles, tens of seconds on CPU, for a tiny VAE). Then
    ``nn.perturb`` moves every bias and gain off 0 and 1."""
    state = _abstract_state(cfg)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = path[-1].key
        if name == "kernel":  # [*kernel, in, out]
            a = rng.standard_normal(leaf.shape) / math.sqrt(math.prod(leaf.shape[:-1]))
        else:
            a = np.full(leaf.shape, 1.0 if name == "gamma" else 0.0)
        return a.astype(dtype)

    pure = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(state))
    return vconv.split_taps(nnx.state(nn.perturb(nnx.merge(graphdef(cfg), nn.fill(state, pure)), seed)))


def param_shapes(cfg: WanVAEConfig, dtype=np.float32) -> dict:
    """Every parameter's shape and dtype as a pure nested dict (the key maps' target; NNX state
    paths); nothing is allocated."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.dtype(dtype)), nnx.to_pure_dict(_abstract(cfg)[1]))


def state_from_pure(cfg: WanVAEConfig, pure: dict) -> nnx.State:
    """A :class:`WanVAE` state holding the arrays of the pure nested dict ``pure`` (what the key maps
    produce: host numpy stays host numpy until the caller places it); no random initialisation.
    Causal conv kernels are held split by time tap (:func:`vidax.core.conv.split_taps`)."""
    return vconv.split_taps(nn.fill(_abstract_state(cfg), pure))


def _state_dtype(state):
    return np.dtype(vconv.kernel_dtype(state["decoder"]["conv_in"]["kernel"]))


# ----------------------------------------------------------------------------------- chunks
# The programs take the config (cheap to hash) as their static argument and merge the state with its
# graphdef inside the trace: one program per (config, first, impls) and input shape.
# The causal cache is donated: each chunk's new cache takes the old one's buffers (at 720p the
# cache is ~8 GiB, held once instead of twice).
@vconv.jit(static_argnames=("cfg", "first", "attn_impl", "conv_impl", "raw"), donate_argnames=("cache",))
def decode_chunk_jit(state, z, cache, *, cfg, first, attn_impl, conv_impl, raw=False):
    ctx = _Ctx(None if first else cache, attn_impl, conv_impl)
    x = nnx.merge(graphdef(cfg), state).decode(z.transpose(0, 2, 3, 4, 1), ctx, raw)
    return x.transpose(0, 4, 1, 2, 3), ctx.new


@vconv.jit(static_argnames=("cfg", "first", "attn_impl", "conv_impl"))
def encode_chunk_jit(state, x, cache, *, cfg, first, attn_impl, conv_impl):
    ctx = _Ctx(None if first else cache, attn_impl, conv_impl)
    h = nnx.merge(graphdef(cfg), state).encode(x.transpose(0, 2, 3, 4, 1), ctx)
    return h.transpose(0, 4, 1, 2, 3), ctx.new


def _check_chunk(first, cache, frames, want_first, want_later, what):
    if not first and cache is None:
        raise ValueError(f"{what}: a chunk after the first needs the cache returned by the previous chunk")
    want = want_first if first else want_later
    if frames != want:
        raise ValueError(f"{what}: {'the first' if first else 'a later'} chunk must have {want} frame(s), got {frames}")


def to_device(a):
    # host -> device without dispatching an XLA computation (one compile per program, no more)
    return jax.device_put(a) if isinstance(a, np.ndarray) else a


def decode_chunk(state, cfg: WanVAEConfig, z_chunk, cache, first: bool, *, attn_impl=None, conv_impl=None):
    """Decode one latent frame ``z_chunk`` [B, z_dim, 1, h, w] (VAE latents: denormalised) with the
    :class:`WanVAE` ``state`` (:func:`init_params`, :func:`load_vae`).

    ``first``: whether it is the video's first latent frame (then ``cache`` is ignored and may be
    None). Returns ``(pixels [B, C, t, H, W] clamped to [-1, 1] (device array), cache)``, t = 1 for
    the first chunk and ``cfg.temporal_ratio`` after; pass the cache on to the next chunk.

    ``conv_impl``: how the convs over time run, ``"taps"`` (one 2-D conv per time tap, summed: the
    fastest on CPU), ``"fold"`` (time taps folded into channels, one 2-D conv) or ``"native"`` (3-D
    convs); None: ``"taps"`` on CPU, ``"native"`` elsewhere.
    Both give the same result up to float rounding; the cache is the same either way.
    """
    _check_chunk(first, cache, z_chunk.shape[2], 1, 1, "decode_chunk")
    return decode_chunk_jit(state, to_device(z_chunk), None if first else cache, cfg=cfg,
                             first=bool(first), attn_impl=attn_impl, conv_impl=_conv_impl(conv_impl))


def encode_chunk(state, cfg: WanVAEConfig, x_chunk, cache, first: bool, *, attn_impl=None, conv_impl=None):
    """Encode one chunk of video frames ``x_chunk`` [B, C, t, H, W] (t = 1 for the first chunk, 4
    after; see :func:`encode_chunk_frames`). Returns ``(moments [B, 2 z_dim, f, h, w] (mean, then
    logvar, unclamped; device array), cache)``. ``conv_impl``: as for :func:`decode_chunk`."""
    _check_chunk(first, cache, x_chunk.shape[2], 1, ENCODE_CHUNK_FRAMES, "encode_chunk")
    return encode_chunk_jit(state, to_device(x_chunk), None if first else cache, cfg=cfg,
                             first=bool(first), attn_impl=attn_impl, conv_impl=_conv_impl(conv_impl))


def num_encode_chunks(num_frames: int) -> int:
    return 1 + (num_frames - 1) // ENCODE_CHUNK_FRAMES


def encode_chunk_frames(i: int) -> slice:
    """The frames of encode chunk ``i``."""
    return slice(0, 1) if i == 0 else slice(1 + ENCODE_CHUNK_FRAMES * (i - 1), 1 + ENCODE_CHUNK_FRAMES * i)


def decode(state, cfg: WanVAEConfig, z, *, start: int = 0, stop: int | None = None, cache=None,
           return_cache: bool = False, attn_impl=None, conv_impl=None):
    """Decode VAE latents ``z`` [B, z_dim, F, h, w] (denormalised: see :func:`denormalize_latents`) to
    pixels [B, C, T, H, W] in [-1, 1] (host numpy), T = 1 + temporal_ratio * (F - 1) for a full
    decode: ``AutoencoderKLWan.decode(z).sample``. ``state``: the :class:`WanVAE` state.

    Resumable: decodes latent frames ``start .. stop-1`` given the ``cache`` left by frame
    ``start - 1``; with ``return_cache`` the cache after the last decoded chunk is returned too."""
    z = np.asarray(z)  # latents are small: slice chunks on the host (no per-slice device programs)
    stop = z.shape[2] if stop is None else stop
    if start > 0 and cache is None:
        raise ValueError("decode(start > 0) needs the cache left by the previous chunk")
    outs = []
    for i in range(start, stop):
        px, cache = decode_chunk(state, cfg, z[:, :, i:i + 1], cache, first=i == 0, attn_impl=attn_impl,
                                 conv_impl=conv_impl)
        outs.append(px)
    pixels = np.concatenate([np.asarray(o) for o in outs], axis=2) if outs else None
    return (pixels, cache) if return_cache else pixels


def plan_decode_unit(cfg: WanVAEConfig, batch: int, height: int, width: int, dtype=np.float32, tiled: bool = False,
                     devices: int = 1):
    """The program a decode stage repeats -- one latent frame with the causal cache (donated) --
    at abstract shapes on the accelerators' conv path (``vidax plan``; latents ``height x width``;
    ``tiled``: tiles of :func:`vidax.models.wan.tiles.tiled_decode`, one per device of a
    ``devices``-chip decode slice: :func:`vidax.models.wan.tiles.plan_tiles_unit`)."""
    from vidax.core import plan as vplan

    if tiled:
        from vidax.models.wan.tiles import plan_tiles_unit

        return plan_tiles_unit(cfg, batch, height, width, dtype, devices)
    state = state_from_pure(cfg, param_shapes(cfg, dtype))
    z = vplan.abstract((batch, cfg.z_dim, 1, height, width), np.float32)
    static = dict(cfg=cfg, attn_impl=None, conv_impl="native")
    _, cache = jax.eval_shape(partial(decode_chunk_jit, first=True, **static), state, z, None)
    return vplan.Unit("decode", "VAE decode, one latent frame", decode_chunk_jit, (state, z, cache),
                      kwargs=dict(first=False, **static), weights=state,
                      note=f"{batch} x {height}x{width} latents with the causal cache")


def encode(state, cfg: WanVAEConfig, x, *, return_logvar: bool = False, attn_impl=None, conv_impl=None):
    """Encode a video ``x`` [B, C, F, H, W] (values in [-1, 1]) to the latent distribution's mean
    [B, z_dim, f, h, w] (host numpy; ``AutoencoderKLWan.encode(x).latent_dist.mean``); with
    ``return_logvar`` also its log-variance (clamped to [-30, 20] as the reference does). Frames past
    the last full chunk (``1 + 4 k``) are dropped, as in the reference."""
    x = np.asarray(x)
    cache, outs = None, []
    for i in range(num_encode_chunks(x.shape[2])):
        xc = x[:, :, encode_chunk_frames(i)]
        m, cache = encode_chunk(state, cfg, xc, cache, first=i == 0, attn_impl=attn_impl, conv_impl=conv_impl)
        outs.append(m)
    moments = np.concatenate([np.asarray(o) for o in outs], axis=2)
    mean, logvar = moments[:, : cfg.z_dim], moments[:, cfg.z_dim:]
    if return_logvar:
        return mean, np.clip(logvar, -30.0, 20.0)
    return mean


def cache_to_numpy(cache):
    """Host copy of a chunk cache (to persist between pipeline stages)."""
    return {k: np.asarray(v) for k, v in cache.items()}


def decode_cache_spec(state, cfg: WanVAEConfig, batch: int, height: int, width: int):
    """Shapes/dtypes of the decode cache for latents of spatial size (height, width); no compile."""
    z = jax.ShapeDtypeStruct((batch, cfg.z_dim, 1, height, width), _state_dtype(state))
    fn = partial(decode_chunk_jit, cfg=cfg, first=True, attn_impl=None, conv_impl=_conv_impl(None))
    return jax.eval_shape(fn, state, z, None)[1]


# ----------------------------------------------------------------------------------- loading
def _is_original(names) -> bool:
    return any(n.startswith(("encoder.conv1.", "decoder.head.", "encoder.downsamples.")) for n in names)


def config_from_original(ckpt) -> WanVAEConfig:
    """Infer the config from an original-format (``Wan2.1_VAE.pth``) checkpoint's tensor shapes."""
    sh = {k: tuple(v.shape) for k, v in ckpt.items()}
    base, cin = sh["encoder.conv1.weight"][:2]
    z_dim = sh["conv2.weight"][0]
    n_down = 1 + max(int(k.split(".")[2]) for k in sh if k.startswith("encoder.downsamples."))
    levels, cur, attn_scales, temporal = [[]], None, [], []
    scale = 1.0
    for j in range(n_down):
        pre = f"encoder.downsamples.{j}."
        if pre + "residual.2.weight" in sh:
            cur = sh[pre + "residual.2.weight"][0]
            levels[-1].append(cur)
        elif pre + "to_qkv.weight" in sh:
            if scale not in attn_scales:
                attn_scales.append(scale)
        elif pre + "resample.1.weight" in sh:
            temporal.append(pre + "time_conv.weight" in sh)
            levels.append([])
            scale /= 2.0
        else:
            raise ValueError(f"original Wan VAE checkpoint: cannot tell what encoder.downsamples.{j} is")
    if any(len(lv) != len(levels[0]) for lv in levels) or any(lv[-1] % base for lv in levels):
        raise ValueError("original Wan VAE checkpoint: irregular encoder structure")
    dim_mult = tuple(lv[-1] // base for lv in levels)
    dec_top = sh["decoder.head.2.weight"][1] // dim_mult[0]
    kw = {}
    if z_dim != len(WAN21_LATENTS_MEAN):
        kw = dict(latents_mean=(0.0,) * z_dim, latents_std=(1.0,) * z_dim)
    return WanVAEConfig(
        base_dim=base, decoder_base_dim=None if dec_top == base else dec_top, z_dim=z_dim, dim_mult=dim_mult,
        num_res_blocks=len(levels[0]), attn_scales=tuple(attn_scales), temperal_downsample=tuple(temporal),
        in_channels=cin, out_channels=sh["decoder.head.2.weight"][0], **kw,
    )


def load_vae(path, cfg: WanVAEConfig | None = None, dtype=np.float32):
    """Load VAE weights from a diffusers folder (config.json + safetensors) or an original-release
    checkpoint (``Wan2.1_VAE.pth``, or a safetensors file with the same names). Returns
    ``(state, cfg)``: the :class:`WanVAE` state with host numpy leaves (read tensor by tensor, cast on
    the host; nothing is randomly initialised), for ``jax.device_put``. Raises
    ``CheckpointMismatchError`` naming any missing, unexpected or mis-shaped tensor."""
    path = Path(path)
    if cfg is None and path.is_dir() and (path / "config.json").exists():
        cfg = WanVAEConfig.from_diffusers(compat.read_config(path))
    pure, cfg = load_checkpoint_params(
        open_checkpoint(path), cfg, is_original=_is_original, config_from_original=config_from_original,
        keymap=lambda c, original: original_keymap(c) if original else diffusers_keymap(c), shapes=param_shapes, dtype=dtype,
        what=lambda c: f"AutoencoderKLWan {c}", source=path)
    return state_from_pure(cfg, pure), cfg


# ----------------------------------------------------------------------------------- compat
class _WanVAECompat(compat.CompatModel):
    """``encode(x)`` = ``vae.encode(x).latent_dist.mean``; ``decode(z)`` = ``vae.decode(z).sample``;
    both in the reference layout [B, C, F, H, W]."""

    def __init__(self, config, state, cfg):
        super().__init__("AutoencoderKLWan", config, state, cfg)

    def encode(self, x) -> np.ndarray:
        return encode(self.params, self.model_config, np.asarray(x, np.float32))

    def decode(self, z) -> np.ndarray:
        return decode(self.params, self.model_config, np.asarray(z, np.float32))


@compat.register("AutoencoderKLWan")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **_):
    state, cfg = load_vae(folder, WanVAEConfig.from_diffusers(config), dtype=dtype)
    return _WanVAECompat(config, jax.device_put(state), cfg)
