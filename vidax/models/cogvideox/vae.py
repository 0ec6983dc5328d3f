"""The CogVideoX VAE (diffusers ``AutoencoderKLCogVideoX``) as Flax NNX modules.

A causal 3D-conv VAE (8x spatial, 4x temporal): group-normed residual blocks, the encoder's
temporal compression by average pooling frame pairs, the decoder's spatially conditioned norms
(the latent chunk, nearest-upsampled, scales and shifts every group norm).

Frame batching follows the reference exactly, because its group norms take statistics over a
whole batch of frames: the decoder runs ``2 + F % 2`` latent frames first and then 2 at a time
(:func:`decode_batches`), the encoder ``8 + F % 8`` video frames first and then 8. Between batches
every causal 3x3x3 conv carries the last two frames of its (time-padded) input — the *cache*, a
flat dict ``name -> array`` with the same structure after every batch. The very first batch pads
time by repeating its first frame instead. A temporal up/downsample treats an odd-length batch's
first frame apart (that is the reference's rule, so it depends on the batching too).

Each batch is one call of one jitted function (``first`` static; at most two programs per
spatial size and direction), driven from a Python loop. :func:`decode` can start at any batch
boundary given the cache left by the previous one, so decode stages persist the cache and resume:
spans of whole batches concatenate bitwise to one decode.

Layout: the public functions take and return the reference layout ``[B, C, F, H, W]``; inside,
everything is channels-last. Convs over time run as 3-D convs (``conv_impl="native"``) or, on CPU
where XLA's 3-D conv is slow, as one 2-D conv per time tap (``"taps"``, :mod:`vidax.core.conv`); in the
spatially conditioned norms the 1x1 convs run at the latent's resolution before the nearest
upsampling (the same numbers: both are per position).

Spatial tiling (the reference's ``enable_tiling``) is :func:`tiled_decode`: overlapping latent
tiles decoded independently (each with its own cache) and blended linearly, as the reference.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax import compat
from vidax.core import conv as vconv
from vidax.core import nn
from vidax.weights import KeyMap, Rule, load_params, open_checkpoint

F32 = jnp.float32
DECODE_BATCH = 2  # latent frames per decoder batch (the reference's num_latent_frames_batch_size)
ENCODE_BATCH = 8  # video frames per encoder batch (num_sample_frames_batch_size)


# ----------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class CogVideoXVAEConfig:
    """Mirrors diffusers' ``AutoencoderKLCogVideoX`` config (defaults = the CogVideoX-2B release)."""

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple = (128, 256, 256, 512)
    latent_channels: int = 16
    layers_per_block: int = 3
    act_fn: str = "silu"
    norm_eps: float = 1e-6
    norm_num_groups: int = 32
    temporal_compression_ratio: int = 4
    sample_height: int = 480
    sample_width: int = 720
    scaling_factor: float = 1.15258426
    shift_factor: float | None = None
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    invert_scale_latents: bool = False

    def __post_init__(self):
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
        for c in self.block_out_channels:
            if c % self.norm_num_groups:
                raise ValueError(f"block_out_channels {self.block_out_channels}: {c} is not divisible by "
                                 f"norm_num_groups={self.norm_num_groups}")
        if 2 ** self.temporal_levels != self.temporal_compression_ratio:
            raise ValueError(f"temporal_compression_ratio must be a power of two, got {self.temporal_compression_ratio}")
        nn.activation(self.act_fn)

    @property
    def temporal_levels(self) -> int:
        return int(round(math.log2(self.temporal_compression_ratio)))

    @property
    def spatial_ratio(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "CogVideoXVAEConfig":
        names = {f.name for f in fields(cls)}
        kw, unknown = {}, []
        known = {"down_block_types", "up_block_types", "latents_mean", "latents_std", "force_upcast", "sample_size"}
        for k, v in cfg.items():
            if k.startswith("_"):
                continue
            if k in names:
                kw[k] = tuple(v) if isinstance(v, list) else v
            elif k not in known:
                unknown.append(k)
        for k in ("down_block_types", "up_block_types"):
            bad = [t for t in cfg.get(k) or () if t not in ("CogVideoXDownBlock3D", "CogVideoXUpBlock3D")]
            if bad:
                raise ValueError(f"AutoencoderKLCogVideoX config: unsupported {k} {bad}")
        if unknown:
            warnings.warn(f"AutoencoderKLCogVideoX config: ignoring unknown fields {sorted(unknown)}")
        return cls(**kw)


PRESETS = {
    "tiny": CogVideoXVAEConfig(block_out_channels=(8, 16, 16, 16), latent_channels=4, layers_per_block=1,
                               norm_num_groups=4, sample_height=64, sample_width=64, scaling_factor=0.7),
    "2b": CogVideoXVAEConfig(),
    "5b": CogVideoXVAEConfig(scaling_factor=0.7),
    "1.5": CogVideoXVAEConfig(scaling_factor=0.7, invert_scale_latents=True),
}


def decode_batches(num_frames: int) -> list[tuple[int, int]]:
    """The reference decoder's latent frame batches: ``[0, 2 + F % 2)``, then 2 frames at a time."""
    return _batches(num_frames, DECODE_BATCH)


def encode_batches(num_frames: int) -> list[tuple[int, int]]:
    """The reference encoder's video frame batches: ``[0, 8 + F % 8)``, then 8 frames at a time."""
    return _batches(num_frames, ENCODE_BATCH)


def _batches(n: int, size: int) -> list[tuple[int, int]]:
    rem = n % size
    out = []
    for i in range(max(n // size, 1)):
        a, b = size * i + (0 if i == 0 else rem), min(size * (i + 1) + rem, n)
        if a < b:
            out.append((a, b))
    return out


def latent_frames(cfg: CogVideoXVAEConfig, num_frames: int) -> int:
    """Latent frames the encoder gives for ``num_frames`` video frames."""
    t = 0
    for a, b in encode_batches(num_frames):
        n = b - a
        for _ in range(cfg.temporal_levels):
            n = 1 + (n - 1) // 2 if n % 2 else n // 2
        t += n
    return t


# ----------------------------------------------------------------------------------- layers
class _Ctx:
    """The conv caches of one batch: ``old`` (None on the video's first batch) and the new ones."""

    def __init__(self, old, conv_impl: str):
        self.old, self.new, self.conv_impl = old, {}, conv_impl

    @property
    def first(self) -> bool:
        return self.old is None


_conv_impl = vconv.conv_impl


def _conv2d(x, w, stride=1, padding=((1, 1), (1, 1))):
    """[N, H, W, C] x [kh, kw, C, O]."""
    return vconv.conv2d(x, w, (stride, stride), padding)


def _per_frame(fn, x):
    b, t = x.shape[:2]
    y = fn(x.reshape(b * t, *x.shape[2:]))
    return y.reshape(b, t, *y.shape[1:])


def _pointwise(kernel, bias, x):
    k = kernel.reshape(-1, kernel.shape[-1])
    y = jnp.matmul(x, k.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
    return y if bias is None else y + bias.astype(y.dtype)


class Conv(nnx.Module):
    """A conv kernel ``[*k, Cin, Cout]`` + bias (the reference's Conv3d / Conv2d weights)."""

    def __init__(self, kernel: tuple, cin: int, cout: int, *, rngs: nnx.Rngs, param_dtype=F32):
        fan = cin * int(np.prod(kernel))
        init = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
        self.kernel = nn.param(rngs, init, (*kernel, cin, cout), *([None] * (len(kernel) + 2)), dtype=param_dtype)
        self.bias = nn.param(rngs, nnx.initializers.uniform(1 / math.sqrt(fan)), (cout,), None, dtype=param_dtype)

    def pointwise(self, x):
        return _pointwise(self.kernel[...], self.bias[...], x)


class CausalConv3d(Conv):
    """``CogVideoXCausalConv3d`` (pad mode "first"): time padded by the cache, or on the first batch
    by repeating the first frame; space zero-padded; its cache is the last ``kt - 1`` padded frames."""

    def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs, kernel=(3, 3, 3), param_dtype=F32):
        super().__init__(kernel, cin, cout, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, ctx: _Ctx, name: str, x):
        k = vconv.kernel_value(self.kernel)  # whole, or split by time tap (vconv.split_taps)
        kt, (kh, kw) = (len(k), k[0].shape[:2]) if isinstance(k, (tuple, list)) else (k.shape[0], k.shape[1:3])
        ph, pw = (kh - 1) // 2, (kw - 1) // 2
        if kt == 1:
            return vconv.conv3d(x, k, self.bias[...], padding=((0, 0), (ph, ph), (pw, pw)), impl=ctx.conv_impl)
        # time padded by the cache or the first frame repeated, without building the padded input
        prev = None if ctx.first else ctx.old[name]
        ctx.new[name] = vconv.causal_tail(x, prev, kt)
        return vconv.causal_conv3d(x, k, self.bias[...], prev, ((ph, ph), (pw, pw)), impl=ctx.conv_impl)


class GroupNorm(nnx.Module):
    """``nn.GroupNorm`` over a frame batch: statistics over (T, H, W, C / G) per sample, float32."""

    def __init__(self, c: int, groups: int, eps: float, *, rngs: nnx.Rngs, param_dtype=F32):
        self.groups, self.eps = groups, eps
        self.scale = nn.param(rngs, nnx.initializers.ones_init(), (c,), None, dtype=param_dtype)
        self.bias = nn.param(rngs, nnx.initializers.zeros_init(), (c,), None, dtype=param_dtype)

    def __call__(self, x):
        shape, dt = x.shape, x.dtype
        g = self.groups
        xf = x.astype(F32).reshape(shape[0], -1, g, shape[-1] // g)
        mean = jnp.mean(xf, axis=(1, 3), keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=(1, 3), keepdims=True)
        y = ((xf - mean) * jax.lax.rsqrt(var + self.eps)).reshape(shape)
        return (y * self.scale[...].astype(F32) + self.bias[...].astype(F32)).astype(dt)


def _nearest_index(n_in: int, n_out: int) -> np.ndarray:
    scale = np.float32(n_in / n_out)
    return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int64), n_in - 1)


def _nearest(x, size: tuple[int, int, int]):
    """``F.interpolate(mode="nearest", size=...)`` over (T, H, W) of [B, T, H, W, C]."""
    for axis, n in zip((1, 2, 3), size):
        m = x.shape[axis]
        if n == m:
            continue
        x = jnp.repeat(x, n // m, axis=axis) if n % m == 0 else jnp.take(x, _nearest_index(m, n), axis=axis)
    return x


class SpatialNorm(nnx.Module):
    """``CogVideoXSpatialNorm3D``: ``group_norm(f) * conv_y(zq) + conv_b(zq)``, ``zq`` resized to
    ``f`` by nearest interpolation (an odd multi-frame batch: its first frame apart)."""

    def __init__(self, c: int, zc: int, groups: int, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm = GroupNorm(c, groups, 1e-6, **kw)
        self.conv_y = Conv((1, 1, 1), zc, c, **kw)
        self.conv_b = Conv((1, 1, 1), zc, c, **kw)

    def __call__(self, f, zq):
        tf, hf, wf = f.shape[1:4]
        zq = zq.astype(f.dtype)
        y, b = self.conv_y.pointwise(zq), self.conv_b.pointwise(zq)  # per position: commutes with nearest
        if tf > 1 and tf % 2 == 1:
            y = jnp.concatenate([_nearest(y[:, :1], (1, hf, wf)), _nearest(y[:, 1:], (tf - 1, hf, wf))], axis=1)
            b = jnp.concatenate([_nearest(b[:, :1], (1, hf, wf)), _nearest(b[:, 1:], (tf - 1, hf, wf))], axis=1)
        else:
            y, b = _nearest(y, (tf, hf, wf)), _nearest(b, (tf, hf, wf))
        return (self.norm(f).astype(F32) * y.astype(F32) + b.astype(F32)).astype(f.dtype)


class ResBlock(nnx.Module):
    """``CogVideoXResnetBlock3D`` (no timestep embedding): norm, act, causal conv, norm, act, causal
    conv, plus a 1x1x1 conv shortcut when the width changes; spatial norms in the decoder."""

    def __init__(self, cin: int, cout: int, cfg: CogVideoXVAEConfig, zc: int | None, *, rngs: nnx.Rngs,
                 param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        g = cfg.norm_num_groups
        if zc is None:
            self.norm1, self.norm2 = GroupNorm(cin, g, cfg.norm_eps, **kw), GroupNorm(cout, g, cfg.norm_eps, **kw)
        else:
            self.norm1, self.norm2 = SpatialNorm(cin, zc, g, **kw), SpatialNorm(cout, zc, g, **kw)
        self.conv1 = CausalConv3d(cin, cout, **kw)
        self.conv2 = CausalConv3d(cout, cout, **kw)
        self.shortcut = Conv((1, 1, 1), cin, cout, **kw) if cin != cout else None
        self.spatial = zc is not None
        self.act = cfg.act_fn

    def __call__(self, ctx: _Ctx, name: str, x, zq=None):
        act = vconv.activation(self.act)  # SiLU ending in a division: vconv.silu
        h = act(self.norm1(x, zq) if self.spatial else self.norm1(x))
        h = self.conv1(ctx, f"{name}.conv1", h)
        h = act(self.norm2(h, zq) if self.spatial else self.norm2(h))
        h = self.conv2(ctx, f"{name}.conv2", h)
        return h + (x if self.shortcut is None else self.shortcut.pointwise(x))


class Downsample(nnx.Module):
    """``CogVideoXDownsample3D``: average frame pairs (an odd batch keeps its first frame), then a
    3x3 stride-2 conv per frame after padding right and bottom by one."""

    def __init__(self, c: int, compress_time: bool, *, rngs: nnx.Rngs, param_dtype=F32):
        self.conv = Conv((3, 3), c, c, rngs=rngs, param_dtype=param_dtype)
        self.compress_time = compress_time

    def __call__(self, x):
        if self.compress_time:
            b, t, h, w, c = x.shape
            if t % 2:
                rest = x[:, 1:]
                rest = rest.reshape(b, (t - 1) // 2, 2, h, w, c).mean(axis=2) if t > 1 else rest
                x = jnp.concatenate([x[:, :1], rest], axis=1)
            else:
                x = x.reshape(b, t // 2, 2, h, w, c).mean(axis=2)
        k, bias = self.conv.kernel[...], self.conv.bias[...]
        y = _per_frame(lambda f: _conv2d(f, k, stride=2, padding=((0, 1), (0, 1))), x)
        return y + bias.astype(y.dtype)


class Upsample(nnx.Module):
    """``CogVideoXUpsample3D``: nearest 2x in space (and in time for a multi-frame batch when
    compressing time; an odd one's first frame only in space), then a 3x3 conv per frame."""

    def __init__(self, c: int, compress_time: bool, *, rngs: nnx.Rngs, param_dtype=F32):
        self.conv = Conv((3, 3), c, c, rngs=rngs, param_dtype=param_dtype)
        self.compress_time = compress_time

    def __call__(self, x):
        # the conv is per frame: it runs on the frames before their time repeat (the repeat moves to
        # its output), and on each frame as four 2x2 phase convs of the low-resolution frame
        # (vconv.up2_conv2d: no upsampled copy, 4/9 of the taps)
        k, bias = self.conv.kernel[...], self.conv.bias[...]
        y = _per_frame(lambda f: vconv.up2_conv2d(f, k), x) + bias.astype(x.dtype)
        t = x.shape[1]
        if self.compress_time and t > 1 and t % 2:
            return jnp.concatenate([y[:, :1], jnp.repeat(y[:, 1:], 2, axis=1)], axis=1)
        if self.compress_time and t > 1:
            return jnp.repeat(y, 2, axis=1)
        return y


class Encoder(nnx.Module):
    def __init__(self, cfg: CogVideoXVAEConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        boc = cfg.block_out_channels
        self.conv_in = CausalConv3d(cfg.in_channels, boc[0], **kw)
        self.n_blocks, self.layers = len(boc), cfg.layers_per_block
        cout = boc[0]
        for i in range(len(boc)):
            cin, cout = cout, boc[i]
            for j in range(cfg.layers_per_block):
                setattr(self, f"down{i}_res{j}", ResBlock(cin if j == 0 else cout, cout, cfg, None, **kw))
            if i < len(boc) - 1:
                setattr(self, f"down{i}_sample", Downsample(cout, i < cfg.temporal_levels, **kw))
        self.mid_res0 = ResBlock(boc[-1], boc[-1], cfg, None, **kw)
        self.mid_res1 = ResBlock(boc[-1], boc[-1], cfg, None, **kw)
        self.norm_out = GroupNorm(boc[-1], cfg.norm_num_groups, 1e-6, **kw)
        self.conv_out = CausalConv3d(boc[-1], 2 * cfg.latent_channels, **kw)

    def __call__(self, ctx: _Ctx, x):
        x = self.conv_in(ctx, "enc.conv_in", x)
        for i in range(self.n_blocks):
            for j in range(self.layers):
                x = getattr(self, f"down{i}_res{j}")(ctx, f"enc.down{i}.res{j}", x)
            if i < self.n_blocks - 1:
                x = getattr(self, f"down{i}_sample")(x)
        x = self.mid_res0(ctx, "enc.mid0", x)
        x = self.mid_res1(ctx, "enc.mid1", x)
        x = vconv.silu(self.norm_out(x))
        return self.conv_out(ctx, "enc.conv_out", x)


class Decoder(nnx.Module):
    def __init__(self, cfg: CogVideoXVAEConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        rev = cfg.block_out_channels[::-1]
        zc = cfg.latent_channels
        self.conv_in = CausalConv3d(zc, rev[0], **kw)
        self.mid_res0 = ResBlock(rev[0], rev[0], cfg, zc, **kw)
        self.mid_res1 = ResBlock(rev[0], rev[0], cfg, zc, **kw)
        self.n_blocks, self.layers = len(rev), cfg.layers_per_block + 1
        cout = rev[0]
        for i in range(len(rev)):
            cin, cout = cout, rev[i]
            for j in range(self.layers):
                setattr(self, f"up{i}_res{j}", ResBlock(cin if j == 0 else cout, cout, cfg, zc, **kw))
            if i < len(rev) - 1:
                setattr(self, f"up{i}_sample", Upsample(cout, i < cfg.temporal_levels, **kw))
        self.norm_out = SpatialNorm(rev[-1], zc, cfg.norm_num_groups, **kw)
        self.conv_out = CausalConv3d(rev[-1], cfg.out_channels, **kw)

    def __call__(self, ctx: _Ctx, z):
        x = self.conv_in(ctx, "dec.conv_in", z)
        x = self.mid_res0(ctx, "dec.mid0", x, z)
        x = self.mid_res1(ctx, "dec.mid1", x, z)
        for i in range(self.n_blocks):
            for j in range(self.layers):
                x = getattr(self, f"up{i}_res{j}")(ctx, f"dec.up{i}.res{j}", x, z)
            if i < self.n_blocks - 1:
                x = getattr(self, f"up{i}_sample")(x)
        x = vconv.silu(self.norm_out(x, z))
        return self.conv_out(ctx, "dec.conv_out", x)


class CogVideoXVAE(nnx.Module):
    """``AutoencoderKLCogVideoX``: encoder, decoder, optional (post-)quant 1x1x1 convs. Methods run
    one frame batch each (channels-last inside, the reference layout at their boundary)."""

    def __init__(self, cfg: CogVideoXVAEConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        # (the config is not kept on the module: latent scaling does not change the graph, so VAEs
        # that differ only there share their compiled programs; the split carries it)
        self.encoder = Encoder(cfg, **kw)
        self.decoder = Decoder(cfg, **kw)
        z2 = 2 * cfg.latent_channels
        self.quant_conv = Conv((1, 1, 1), z2, z2, **kw) if cfg.use_quant_conv else None
        self.post_quant_conv = Conv((1, 1, 1), cfg.latent_channels, cfg.latent_channels, **kw) \
            if cfg.use_post_quant_conv else None

    def _dtype(self):
        return vconv.kernel_dtype(self.decoder.conv_in.kernel)

    def decode_batch(self, z, cache, *, conv_impl: str = "taps"):
        """One decoder batch: ``z`` [B, C, T, h, w] -> (pixels [B, 3, T', H, W] (unclamped, as the
        reference), new cache). ``cache`` None: the video's first batch."""
        ctx = _Ctx(cache, conv_impl)
        z = z.transpose(0, 2, 3, 4, 1).astype(self._dtype())
        if self.post_quant_conv is not None:
            z = self.post_quant_conv.pointwise(z)
        x = self.decoder(ctx, z)
        return x.transpose(0, 4, 1, 2, 3), ctx.new

    def encode_batch(self, x, cache, *, conv_impl: str = "taps"):
        """One encoder batch: ``x`` [B, 3, T, H, W] -> (moments [B, 2 z, t, h, w], new cache)."""
        ctx = _Ctx(cache, conv_impl)
        x = x.transpose(0, 2, 3, 4, 1).astype(self._dtype())
        h = self.encoder(ctx, x)
        if self.quant_conv is not None:
            h = self.quant_conv.pointwise(h)
        return h.transpose(0, 4, 1, 2, 3), ctx.new


class CogVAE(nn.Split):
    """The VAE split once (graphdef, state, cfg); batches run through one jitted pure function."""

    def decode_batch(self, z, cache, conv_impl=None):
        return self.apply("decode_batch", _device(z), cache, conv_impl=_conv_impl(conv_impl))

    def encode_batch(self, x, cache, conv_impl=None):
        return self.apply("encode_batch", _device(x), cache, conv_impl=_conv_impl(conv_impl))


def _device(a):
    return jax.device_put(a) if isinstance(a, np.ndarray) else a


# ----------------------------------------------------------------------------------- public API
def decode(vae: CogVAE, z, *, start: int = 0, stop: int | None = None, cache=None, return_cache: bool = False,
           conv_impl=None):
    """VAE latents ``z`` [B, C, F, h, w] (already divided by the scaling factor) -> pixels
    [B, 3, T, H, W] (host numpy, unclamped: ``vae.decode(z).sample``).

    Resumable at the reference's batch boundaries (:func:`decode_batches`): decodes the batches in
    latent frames ``start .. stop-1`` given the ``cache`` the batch before ``start`` left."""
    z = np.asarray(z)
    n = z.shape[2]
    stop = n if stop is None else stop
    bounds = decode_batches(n)
    starts, stops = {a for a, _ in bounds}, {b for _, b in bounds}
    if start not in starts or stop not in stops or stop <= start:
        raise ValueError(f"decode: latent frames {start}..{stop} are not whole decoder batches of {n} frames "
                         f"({bounds})")
    if start > 0 and cache is None:
        raise ValueError("decode(start > 0) needs the cache left by the previous batch")
    outs = []
    for a, b in bounds:
        if a < start or b > stop:
            continue
        px, cache = vae.decode_batch(z[:, :, a:b], None if a == 0 else cache, conv_impl)
        outs.append(np.asarray(px))
    pixels = np.concatenate(outs, axis=2)
    return (pixels, cache) if return_cache else pixels


def encode(vae: CogVAE, x, *, return_logvar: bool = False, conv_impl=None):
    """Video ``x`` [B, 3, F, H, W] in [-1, 1] -> the posterior mean [B, z, f, h, w] (host numpy;
    ``vae.encode(x).latent_dist.mean``); with ``return_logvar`` also the log-variance, clamped to
    [-30, 20] as the reference."""
    x = np.asarray(x)
    cache, outs = None, []
    for a, b in encode_batches(x.shape[2]):
        m, cache = vae.encode_batch(x[:, :, a:b], cache, conv_impl)
        outs.append(np.asarray(m))
    moments = np.concatenate(outs, axis=2)
    zc = vae.cfg.latent_channels
    mean, logvar = moments[:, :zc], np.clip(moments[:, zc:], -30.0, 20.0)
    return (mean, logvar) if return_logvar else mean


def sample_posterior(mean, logvar, noise):
    """``latent_dist.sample()`` with the given standard-normal ``noise``: ``mean + exp(logvar / 2) noise``."""
    return mean + np.exp(0.5 * logvar) * noise


def to_latents(cfg: CogVideoXVAEConfig, z):
    """Encoder latents -> the DiT's (the I2V pipelines' image latents): ``z * scaling_factor``, or
    ``z / scaling_factor`` with ``invert_scale_latents`` (CogVideoX 1.5)."""
    s = cfg.scaling_factor
    return (z / s if cfg.invert_scale_latents else z * s).astype(np.float32)


def from_latents(cfg: CogVideoXVAEConfig, z):
    """The DiT's latents -> the decoder's (every CogVideoX pipeline): ``z / scaling_factor``."""
    return (np.asarray(z) / cfg.scaling_factor).astype(np.float32)


def cache_to_numpy(cache):
    return {k: np.asarray(v) for k, v in cache.items()}


# ----------------------------------------------------------------------------------- tiling
def _blend(a, b, extent: int, axis: int):
    """The reference's ``blend_v`` / ``blend_h``: the first ``extent`` rows/cols of ``b`` fade in from
    the last ones of ``a``."""
    extent = min(a.shape[axis], b.shape[axis], extent)
    if extent <= 0:
        return b
    b = b.copy()
    for y in range(extent):
        sa = [slice(None)] * b.ndim
        sb = [slice(None)] * b.ndim
        sa[axis], sb[axis] = a.shape[axis] - extent + y, y
        b[tuple(sb)] = a[tuple(sa)] * (1 - y / extent) + b[tuple(sb)] * (y / extent)
    return b


@dataclass(frozen=True)
class Tiling:
    """The reference's tiled decode parameters (``enable_tiling()`` defaults: half the config's
    sample size, overlap factors 1/6 and 1/5)."""

    tile_sample_min_height: int
    tile_sample_min_width: int
    spatial_ratio: int = 8
    overlap_height: float = 1 / 6
    overlap_width: float = 1 / 5

    @classmethod
    def default(cls, cfg: CogVideoXVAEConfig) -> "Tiling":
        return cls(cfg.sample_height // 2, cfg.sample_width // 2, cfg.spatial_ratio)

    @property
    def latent_tile(self):
        return (int(self.tile_sample_min_height / self.spatial_ratio), int(self.tile_sample_min_width / self.spatial_ratio))

    def tiles(self, h: int, w: int):
        """Latent tile origins ``[(y, x), ...]`` row by row, and the row / col counts."""
        th, tw = self.latent_tile
        sy = int(th * (1 - self.overlap_height))
        sx = int(tw * (1 - self.overlap_width))
        ys, xs = list(range(0, h, sy)), list(range(0, w, sx))
        return ys, xs

    def applies(self, h: int, w: int) -> bool:
        th, tw = self.latent_tile
        return w > tw or h > th


def tiled_decode(vae: CogVAE, z, tiling: Tiling, *, start: int = 0, stop: int | None = None, cache=None,
                 return_cache: bool = False, conv_impl=None):
    """The reference's ``tiled_decode``: overlapping latent tiles, each decoded through the frame
    batches with its own cache, blended (rows, then columns) and cropped. Resumable like
    :func:`decode` (``cache``: one cache per tile, keys ``"<row>.<col>/<name>"``)."""
    z = np.asarray(z)
    h, w = z.shape[3:]
    th, tw = tiling.latent_tile
    ys, xs = tiling.tiles(h, w)
    bh = int(tiling.tile_sample_min_height * tiling.overlap_height)
    bw = int(tiling.tile_sample_min_width * tiling.overlap_width)
    lim_h, lim_w = tiling.tile_sample_min_height - bh, tiling.tile_sample_min_width - bw
    rows, new_cache = [], {}
    for i, y in enumerate(ys):
        row = []
        for j, x in enumerate(xs):
            pre = f"{i}.{j}/"
            tc = None if cache is None else {k[len(pre):]: v for k, v in cache.items() if k.startswith(pre)}
            px, tc = decode(vae, z[:, :, :, y:y + th, x:x + tw], start=start, stop=stop, cache=tc, return_cache=True,
                            conv_impl=conv_impl)
            new_cache.update({pre + k: v for k, v in tc.items()})
            row.append(px)
        rows.append(row)
    out_rows = []
    for i, row in enumerate(rows):
        cols = []
        for j in range(len(row)):
            tile = row[j]
            if i > 0:
                tile = _blend(rows[i - 1][j], tile, bh, 3)
            if j > 0:
                tile = _blend(row[j - 1], tile, bw, 4)
            row[j] = tile  # the reference blends in place: later tiles blend with this blended one
            cols.append(tile[:, :, :, :lim_h, :lim_w])
        out_rows.append(np.concatenate(cols, axis=4))
    pixels = np.concatenate(out_rows, axis=3)
    return (pixels, new_cache) if return_cache else pixels


# ----------------------------------------------------------------------------------- state, keys
def _build(cfg: CogVideoXVAEConfig, seed: int = 0, dtype=np.float32):
    return lambda: CogVideoXVAE(cfg, rngs=nnx.Rngs(seed), param_dtype=jnp.dtype(dtype))


def init(cfg: CogVideoXVAEConfig, seed: int = 0, dtype=np.float32) -> CogVAE:
    """Seeded random weights (presets, tests): every parameter perturbed."""
    return vconv.conv_model(CogVAE(*nnx.split(nn.perturb(_build(cfg, seed, dtype)(), seed)), cfg))


def param_shapes(cfg: CogVideoXVAEConfig, dtype=np.float32) -> dict:
    return nn.shapes(_build(cfg, dtype=dtype))


def _conv_rules(ref: str, dst: str, kind: str) -> list[Rule]:
    return [Rule(f"{ref}.weight", f"{dst}.kernel", kind), Rule(f"{ref}.bias", f"{dst}.bias")]


def _norm_rules(ref: str, dst: str) -> list[Rule]:
    return [Rule(f"{ref}.weight", f"{dst}.scale"), Rule(f"{ref}.bias", f"{dst}.bias")]


def _res_rules(ref: str, dst: str, spatial: bool, shortcut: bool) -> list[Rule]:
    r = []
    for n in ("norm1", "norm2"):
        if spatial:
            r += _norm_rules(f"{ref}.{n}.norm_layer", f"{dst}.{n}.norm")
            r += _conv_rules(f"{ref}.{n}.conv_y.conv", f"{dst}.{n}.conv_y", "conv3d")
            r += _conv_rules(f"{ref}.{n}.conv_b.conv", f"{dst}.{n}.conv_b", "conv3d")
        else:
            r += _norm_rules(f"{ref}.{n}", f"{dst}.{n}")
    r += _conv_rules(f"{ref}.conv1.conv", f"{dst}.conv1", "conv3d") + _conv_rules(f"{ref}.conv2.conv", f"{dst}.conv2", "conv3d")
    if shortcut:
        r += _conv_rules(f"{ref}.conv_shortcut", f"{dst}.shortcut", "conv3d")
    return r


def diffusers_keymap(cfg: CogVideoXVAEConfig) -> KeyMap:
    boc, rev = cfg.block_out_channels, cfg.block_out_channels[::-1]
    r = _conv_rules("encoder.conv_in.conv", "encoder.conv_in", "conv3d")
    cout = boc[0]
    for i in range(len(boc)):
        cin, cout = cout, boc[i]
        for j in range(cfg.layers_per_block):
            r += _res_rules(f"encoder.down_blocks.{i}.resnets.{j}", f"encoder.down{i}_res{j}", False,
                            (cin if j == 0 else cout) != cout)
        if i < len(boc) - 1:
            r += _conv_rules(f"encoder.down_blocks.{i}.downsamplers.0.conv", f"encoder.down{i}_sample.conv", "conv2d")
    for j in range(2):
        r += _res_rules(f"encoder.mid_block.resnets.{j}", f"encoder.mid_res{j}", False, False)
        r += _res_rules(f"decoder.mid_block.resnets.{j}", f"decoder.mid_res{j}", True, False)
    r += _norm_rules("encoder.norm_out", "encoder.norm_out") + _conv_rules("encoder.conv_out.conv", "encoder.conv_out", "conv3d")
    r += _conv_rules("decoder.conv_in.conv", "decoder.conv_in", "conv3d")
    cout = rev[0]
    for i in range(len(rev)):
        cin, cout = cout, rev[i]
        for j in range(cfg.layers_per_block + 1):
            r += _res_rules(f"decoder.up_blocks.{i}.resnets.{j}", f"decoder.up{i}_res{j}", True,
                            (cin if j == 0 else cout) != cout)
        if i < len(rev) - 1:
            r += _conv_rules(f"decoder.up_blocks.{i}.upsamplers.0.conv", f"decoder.up{i}_sample.conv", "conv2d")
    r += _norm_rules("decoder.norm_out.norm_layer", "decoder.norm_out.norm")
    r += _conv_rules("decoder.norm_out.conv_y.conv", "decoder.norm_out.conv_y", "conv3d")
    r += _conv_rules("decoder.norm_out.conv_b.conv", "decoder.norm_out.conv_b", "conv3d")
    r += _conv_rules("decoder.conv_out.conv", "decoder.conv_out", "conv3d")
    if cfg.use_quant_conv:
        r += _conv_rules("quant_conv", "quant_conv", "conv3d")
    if cfg.use_post_quant_conv:
        r += _conv_rules("post_quant_conv", "post_quant_conv", "conv3d")
    return KeyMap(r)


# The original (SAT) release names, from diffusers' scripts/convert_cogvideox_to_diffusers.py:
# ``block.`` -> ``resnets.``, ``down.`` -> ``down_blocks.``, ``downsample`` -> ``downsamplers.0``,
# ``upsample`` -> ``upsamplers.0``, ``nin_shortcut`` -> ``conv_shortcut``, ``{enc,dec}oder.mid.block_{1,2}``
# -> ``mid_block.resnets.{0,1}``, and the decoder's ``up.{i}`` counted from the top (``up_blocks.{3 - i}``).
def original_to_diffusers(name: str, num_levels: int = 4) -> str | None:
    """The diffusers name of an original-release VAE tensor (None: a training-only tensor)."""
    if name.startswith("loss"):
        return None
    n = name
    for a, b in (("block.", "resnets."), ("down.", "down_blocks."), ("downsample", "downsamplers.0"),
                 ("upsample", "upsamplers.0"), ("nin_shortcut", "conv_shortcut"),
                 ("encoder.mid.block_1", "encoder.mid_block.resnets.0"), ("encoder.mid.block_2", "encoder.mid_block.resnets.1"),
                 ("decoder.mid.block_1", "decoder.mid_block.resnets.0"), ("decoder.mid.block_2", "decoder.mid_block.resnets.1")):
        n = n.replace(a, b)
    parts = n.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "up":
        parts[1], parts[2] = "up_blocks", str(num_levels - 1 - int(parts[2]))
        n = ".".join(parts)
    return n


def _is_original(names) -> bool:
    return any(".mid.block_1." in n or n.startswith(("encoder.down.", "decoder.up.")) for n in names)


def load_vae(path, cfg: CogVideoXVAEConfig | None = None, dtype=np.float32) -> CogVAE:
    """A VAE from a diffusers folder (config.json + safetensors) or an original-release checkpoint
    (``cfg`` then describes it; default: the 2B release's). Weights read tensor by tensor into host
    numpy, cast on the host; unknown / missing / misshaped tensors are one error naming them."""
    path = Path(path)
    if cfg is None and path.is_dir() and (path / "config.json").exists():
        cfg = CogVideoXVAEConfig.from_diffusers(compat.read_config(path))
    cfg = cfg or CogVideoXVAEConfig()
    ckpt = open_checkpoint(path)
    names = list(ckpt)
    if _is_original(names):
        from vidax.weights.io import Checkpoint

        levels = len(cfg.block_out_channels)
        ren = {}
        for n in names:
            d = original_to_diffusers(n, levels)
            if d is not None:
                ren[d] = ckpt[n]
        ckpt = Checkpoint(ren, getattr(ckpt, "source", str(path)))
    pure = load_params(ckpt, diffusers_keymap(cfg), param_shapes(cfg, dtype), dtype=dtype,
                       what=f"AutoencoderKLCogVideoX (block_out_channels {cfg.block_out_channels})")
    return vconv.conv_model(CogVAE.from_pure(_build(cfg, dtype=dtype), pure).replace(cfg=cfg))


# ----------------------------------------------------------------------------------- compat
class _VAECompat(compat.CompatModel):
    """``encode(x)`` = ``vae.encode(x).latent_dist.mean``; ``decode(z)`` = ``vae.decode(z).sample``
    (reference layout [B, C, F, H, W]); ``tiled_decode(z)`` after ``enable_tiling()``."""

    def __init__(self, config, vae: CogVAE):
        super().__init__("AutoencoderKLCogVideoX", config, vae.state, vae.cfg)
        self.vae = vae
        self.tiling = None

    def enable_tiling(self, **kw):
        t = Tiling.default(self.vae.cfg)
        self.tiling = Tiling(kw.get("tile_sample_min_height") or t.tile_sample_min_height,
                             kw.get("tile_sample_min_width") or t.tile_sample_min_width, t.spatial_ratio,
                             kw.get("tile_overlap_factor_height") or t.overlap_height,
                             kw.get("tile_overlap_factor_width") or t.overlap_width)

    def encode(self, x) -> np.ndarray:
        return encode(self.vae, np.asarray(x, np.float32))

    def decode(self, z) -> np.ndarray:
        z = np.asarray(z, np.float32)
        if self.tiling is not None and self.tiling.applies(*z.shape[3:]):
            return tiled_decode(self.vae, z, self.tiling)
        return decode(self.vae, z)


@compat.register("AutoencoderKLCogVideoX")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **_):
    return _VAECompat(config, load_vae(folder, CogVideoXVAEConfig.from_diffusers(config), dtype=dtype))


__all__ = ["CogVAE", "CogVideoXVAE", "CogVideoXVAEConfig", "PRESETS", "Tiling", "cache_to_numpy", "decode",
           "decode_batches", "diffusers_keymap", "encode", "encode_batches", "from_latents", "init", "latent_frames",
           "load_vae", "original_to_diffusers", "sample_posterior", "tiled_decode", "to_latents"]
