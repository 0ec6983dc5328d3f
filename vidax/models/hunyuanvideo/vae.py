"""HunyuanVideo causal 3D VAE (diffusers ``AutoencoderKLHunyuanVideo``) as Flax NNX modules, with the
reference's temporal and spatial tiling (design notes: this family's README.md, "VAE")."""
from __future__ import annotations

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
from vidax.core import tiles as vtiles
from vidax.weights import KeyMap, Rule, int_keys, load_params, open_checkpoint, str_keys

F32 = jnp.float32


# ----------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class HunyuanVAEConfig:
    """Mirrors diffusers' ``AutoencoderKLHunyuanVideo`` config (defaults = the release)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 16
    block_out_channels: tuple = (128, 256, 512, 512)
    layers_per_block: int = 2
    act_fn: str = "silu"
    norm_num_groups: int = 32
    scaling_factor: float = 0.476986
    spatial_compression_ratio: int = 8
    temporal_compression_ratio: int = 4
    mid_block_add_attention: bool = True

    def __post_init__(self):
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))
        if self.temporal_compression_ratio != 4:
            raise ValueError(f"temporal_compression_ratio={self.temporal_compression_ratio}: the reference decoder "
                             f"supports 4 only")
        if any(c % self.norm_num_groups for c in self.block_out_channels):
            raise ValueError(f"block_out_channels {self.block_out_channels} must be multiples of "
                             f"norm_num_groups={self.norm_num_groups}")

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "HunyuanVAEConfig":
        names = {f.name for f in fields(cls)}
        kw, unknown = {}, []
        for k, v in cfg.items():
            if k.startswith("_"):
                continue
            if k in ("down_block_types", "up_block_types"):
                want = "HunyuanVideoDownBlock3D" if k.startswith("down") else "HunyuanVideoUpBlock3D"
                if any(b != want for b in v):
                    raise ValueError(f"AutoencoderKLHunyuanVideo config: {k}={v} (only {want} is supported)")
                continue
            if k in names:
                kw[k] = tuple(v) if isinstance(v, list) else v
            else:
                unknown.append(k)
        if unknown:
            warnings.warn(f"AutoencoderKLHunyuanVideo config: ignoring unknown fields {sorted(unknown)}")
        return cls(**kw)

    def down_strides(self) -> list[tuple | None]:
        """Per encoder block: its downsample stride (t, h, w), or None (the reference's rule)."""
        n = len(self.block_out_channels)
        ns, nt = int(np.log2(self.spatial_compression_ratio)), int(np.log2(self.temporal_compression_ratio))
        out = []
        for i in range(n):
            final = i == n - 1
            s = i < ns
            t = i >= (n - 1 - nt) and not final
            out.append(((2 if t else 1), (2 if s else 1), (2 if s else 1)) if (s or t) else None)
        return out

    up_factors = down_strides  # the decoder mirrors the encoder: block i upsamples by the same factors


@dataclass(frozen=True)
class Tiling:
    """The reference's tiling settings (``enable_tiling(...)`` / ``use_framewise_*``). ``spatial``
    is diffusers' ``use_tiling`` (off by default there; the HunyuanVideo examples turn it on)."""

    spatial: bool = False
    framewise: bool = True
    min_h: int = 256
    min_w: int = 256
    min_t: int = 16
    stride_h: int = 192
    stride_w: int = 192
    stride_t: int = 12


PRESETS = {
    "tiny": HunyuanVAEConfig(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4),
    "release": HunyuanVAEConfig(),
}


# ----------------------------------------------------------------------------------- modules
def _p(rngs, init, shape, dtype):
    return nn.param(rngs, init, shape, *([None] * len(shape)), dtype=dtype)


class Conv3d(nnx.Module):
    """A plain 3-D conv (channels-last; ``kernel`` [kt, kh, kw, Cin, Cout]), no padding; per time tap on
    CPU (:func:`vidax.core.conv.conv3d`)."""

    def __init__(self, cin: int, cout: int, k=1, stride=1, *, rngs: nnx.Rngs, param_dtype=F32):
        k = (k,) * 3 if isinstance(k, int) else tuple(k)
        self.k, self.stride = k, ((stride,) * 3 if isinstance(stride, int) else tuple(stride))
        self.kernel = _p(rngs, nnx.initializers.lecun_normal(), (*k, cin, cout), param_dtype)
        self.bias = _p(rngs, nnx.initializers.zeros_init(), (cout,), param_dtype)

    def __call__(self, x):
        w = vconv.kernel_value(self.kernel)  # whole, or split by time tap (vconv.split_taps)
        if self.k == (1, 1, 1) and self.stride == (1, 1, 1):
            y = jnp.matmul(x, w.astype(x.dtype).reshape(w.shape[-2:]), precision=jax.lax.Precision.HIGHEST)
            return y + self.bias[...].astype(y.dtype)
        return vconv.conv3d(x, w, self.bias[...], self.stride, "VALID")


class CausalConv3d(nnx.Module):
    """``HunyuanVideoCausalConv3d``: replicate-pad ``kt - 1`` frames before (none after) and
    ``k // 2`` pixels on each side, then the conv (``conv``) with its stride."""

    def __init__(self, cin: int, cout: int, k=3, stride=1, *, rngs: nnx.Rngs, param_dtype=F32):
        self.conv = Conv3d(cin, cout, k, stride, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x):
        kt, kh, kw = self.conv.k
        if (kt, kh, kw) == (1, 1, 1):
            return self.conv(x)
        if self.conv.stride == (1, 1, 1) and kt > 1:
            # the time padding is never built: each tap convolves the frames it meets once
            # (vconv.causal_conv3d: at 5 frames 12 instead of 15 frame convs per conv)
            return vconv.causal_conv3d(x, vconv.kernel_value(self.conv.kernel), self.conv.bias[...], None,
                                       ((kh // 2, kh // 2), (kw // 2, kw // 2)), mode="edge")
        x = jnp.pad(x, ((0, 0), (kt - 1, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)), mode="edge")
        return self.conv(x)


class GroupNorm(nnx.Module):
    """``nn.GroupNorm`` over a whole chunk: statistics per (sample, group) over (T, H, W, C/G),
    float32, two-pass variance."""

    def __init__(self, groups: int, c: int, eps: float = 1e-6, *, rngs: nnx.Rngs, param_dtype=F32):
        self.groups, self.eps = groups, eps
        self.scale = _p(rngs, nnx.initializers.ones_init(), (c,), param_dtype)
        self.bias = _p(rngs, nnx.initializers.zeros_init(), (c,), param_dtype)

    def __call__(self, x):
        dt = x.dtype
        g = self.groups
        xf = x.astype(F32).reshape(*x.shape[:-1], g, x.shape[-1] // g)
        axes = tuple(range(1, x.ndim - 1)) + (x.ndim,)
        mean = jnp.mean(xf, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
        y = ((xf - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
        return (y * self.scale[...].astype(F32) + self.bias[...].astype(F32)).astype(dt)


class Resnet(nnx.Module):
    def __init__(self, cin: int, cout: int, groups: int, act: str, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.act = act
        self.norm1 = GroupNorm(groups, cin, **kw)
        self.conv1 = CausalConv3d(cin, cout, 3, **kw)
        self.norm2 = GroupNorm(groups, cout, **kw)
        self.conv2 = CausalConv3d(cout, cout, 3, **kw)
        self.conv_shortcut = CausalConv3d(cin, cout, 1, **kw) if cin != cout else None

    def __call__(self, x):
        a = vconv.activation(self.act)  # SiLU ending in a division: vconv.silu
        h = self.conv1(a(self.norm1(x)))
        h = self.conv2(a(self.norm2(h)))
        return h + (self.conv_shortcut(x) if self.conv_shortcut is not None else x)


def frame_causal_attention(q, k, v, hw: int, q_block: int = 512):
    """Single-head attention where a query of frame ``f`` sees the keys of frames ``<= f``
    (``prepare_causal_attention_mask``). ``q``/``k``/``v``: [B, N, C] with N = frames * hw.
    Query blocks run under ``lax.scan`` with the mask built from indices, so the [N, N] score
    matrix (and mask) is never whole."""
    b, n, c = q.shape
    scale = c ** -0.5
    nb = -(-n // q_block)
    pad = nb * q_block - n
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0))) if pad else q
    kf = jnp.arange(n, dtype=jnp.int32) // hw

    def body(_, i):
        qb = jax.lax.dynamic_slice_in_dim(qp, i * q_block, q_block, axis=1)
        s = jnp.einsum("bqc,bkc->bqk", qb, k, precision=jax.lax.Precision.HIGHEST).astype(F32) * scale
        qf = (i * q_block + jnp.arange(q_block, dtype=jnp.int32)) // hw
        s = jnp.where(kf[None, None, :] <= qf[None, :, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return None, jnp.einsum("bqk,bkc->bqc", p.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST)

    if nb == 1:
        return body(None, 0)[1][:, :n]
    _, out = jax.lax.scan(body, None, jnp.arange(nb, dtype=jnp.int32))
    return out.transpose(1, 0, 2, 3).reshape(b, nb * q_block, c)[:, :n]


class MidAttention(nnx.Module):
    """The mid block's attention (``Attention(_from_deprecated_attn_block=True)``, one head over all
    channels): GroupNorm, q/k/v, frame-causal attention over every token of the chunk, output
    projection, residual."""

    def __init__(self, c: int, groups: int, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.group_norm = GroupNorm(groups, c, **kw)
        self.to_q, self.to_k, self.to_v = (nn.Linear(c, c, precision=jax.lax.Precision.HIGHEST, **kw) for _ in range(3))
        self.to_out = nnx.List([nn.Linear(c, c, precision=jax.lax.Precision.HIGHEST, **kw)])

    def __call__(self, x):
        b, t, h, w, c = x.shape
        hn = self.group_norm(x).reshape(b, t * h * w, c)
        o = frame_causal_attention(self.to_q(hn), self.to_k(hn), self.to_v(hn), h * w)
        return x + self.to_out[0](o).reshape(x.shape)


class MidBlock(nnx.Module):
    def __init__(self, c: int, groups: int, act: str, attention: bool, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.resnets = nnx.List([Resnet(c, c, groups, act, **kw) for _ in range(2)])
        self.attentions = nnx.List([MidAttention(c, groups, **kw)]) if attention else None

    def __call__(self, x):
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class Downsample(nnx.Module):
    def __init__(self, c: int, stride, *, rngs: nnx.Rngs, param_dtype=F32):
        self.conv = CausalConv3d(c, c, 3, stride, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x):
        return self.conv(x)


class Upsample(nnx.Module):
    """Nearest upsampling -- the first frame in space only, the rest in time and space -- then a
    causal conv."""

    def __init__(self, c: int, factor, *, rngs: nnx.Rngs, param_dtype=F32):
        self.factor = tuple(factor)
        self.conv = CausalConv3d(c, c, 3, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x):
        ft, fh, fw = self.factor
        if (fh, fw) == (2, 2) and ft in (1, 2) and self.conv.conv.k == (3, 3, 3) and self.conv.conv.stride == (1, 1, 1) \
                and vconv.conv_impl(None) != "native":
            return self._phases(x, ft > 1 and x.shape[1] > 1)
        x = jnp.repeat(jnp.repeat(x, fh, axis=2), fw, axis=3)
        if ft > 1 and x.shape[1] > 1:
            x = jnp.concatenate([x[:, :1], jnp.repeat(x[:, 1:], ft, axis=1)], axis=1)
        return self.conv(x)

    def _phases(self, x, in_time: bool):
        """The nearest 2x upsampling and the replicate-padded causal 3x3x3 conv without the
        upsampled copy: per output pixel phase a 2x2 conv of the low-resolution frames (16 instead of
        36 taps per input pixel; the replicate padding of the upsampled frames is that of the low-
        resolution ones), and, when time is upsampled too (the first frame kept once, the others
        twice), per output frame parity two time taps of the low-resolution frames instead of three:
        output frames 0, 1, 3, 5, ... are (w0 + w1) g[j] + w2 g[j + 1] over g = (f0, f0, f1, ...),
        frames 2, 4, ... are w0 f[m - 1] + (w1 + w2) f[m]."""
        w = vconv.kernel_value(self.conv.conv.kernel)
        w = [wk.astype(x.dtype) for wk in (w if isinstance(w, (tuple, list)) else list(w))]
        xp = jnp.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
        first = xp[:, :1]
        if in_time:
            odd = _phase_conv(jnp.concatenate([first, xp], axis=1), [w[0] + w[1], w[2]])
            even = _phase_conv(xp, [w[0], w[1] + w[2]])
            b, n, *rest = odd.shape
            y = jnp.concatenate([odd[:, :1], jnp.stack([odd[:, 1:], even], axis=2).reshape(b, 2 * (n - 1), *rest)],
                                axis=1)
        else:
            y = _phase_conv(jnp.concatenate([first, first, xp], axis=1), w)
        return y + self.conv.conv.bias[...].astype(y.dtype)


def _phase_conv(g, taps):
    """``g`` [B, T, h + 2, w + 2, C] (low-resolution frames, replicate-padded by one pixel) through
    the time taps ``taps`` ([3, 3, C, O] each; output frame t sees frames t .. t + kt - 1), each
    nearest-2x upsampled in space and 3x3-convolved: [B, T - kt + 1, 2h, 2w, O]."""
    b, t, hp, wp, _ = g.shape
    h, wd, kt = hp - 2, wp - 2, len(taps)
    tout = t - kt + 1
    frames = [g[:, k:k + tout].reshape(b * tout, hp, wp, -1) for k in range(kt)]
    outs = []
    for a in range(2):
        rows = [vconv.up2_taps(wk, 0)[a] for wk in taps]
        for c in range(2):
            y = None
            for fk, rk in zip(frames, rows):
                yk = vconv.conv2d(fk[:, a:a + h + 1, c:c + wd + 1], vconv.up2_taps(rk, 1)[c])
                y = yk if y is None else y + yk
            outs.append(y)
    o = jnp.stack(outs).reshape(2, 2, b * tout, h, wd, -1).transpose(2, 3, 0, 4, 1, 5)
    return o.reshape(b, tout, 2 * h, 2 * wd, -1)


class Block(nnx.Module):
    """``HunyuanVideoDownBlock3D`` / ``HunyuanVideoUpBlock3D``: resnets, then the resampler."""

    def __init__(self, cin: int, cout: int, n: int, groups: int, act: str, down=None, up=None, *, rngs: nnx.Rngs,
                 param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.resnets = nnx.List([Resnet(cin if i == 0 else cout, cout, groups, act, **kw) for i in range(n)])
        self.downsamplers = nnx.List([Downsample(cout, down, **kw)]) if down is not None else None
        self.upsamplers = nnx.List([Upsample(cout, up, **kw)]) if up is not None else None

    def __call__(self, x):
        for r in self.resnets:
            x = r(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class Encoder(nnx.Module):
    def __init__(self, cfg: HunyuanVAEConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        ch, g, act = cfg.block_out_channels, cfg.norm_num_groups, cfg.act_fn
        self.act = act
        self.conv_in = CausalConv3d(cfg.in_channels, ch[0], 3, **kw)
        blocks, cin = [], ch[0]
        for i, s in enumerate(cfg.down_strides()):
            blocks.append(Block(cin, ch[i], cfg.layers_per_block, g, act, down=s, **kw))
            cin = ch[i]
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock(ch[-1], g, act, cfg.mid_block_add_attention, **kw)
        self.conv_norm_out = GroupNorm(g, ch[-1], **kw)
        self.conv_out = CausalConv3d(ch[-1], 2 * cfg.latent_channels, 3, **kw)

    def __call__(self, x):
        x = self.conv_in(x)
        for b in self.down_blocks:
            x = b(x)
        x = self.mid_block(x)
        return self.conv_out(vconv.activation(self.act)(self.conv_norm_out(x)))


class Decoder(nnx.Module):
    def __init__(self, cfg: HunyuanVAEConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        ch, g, act = cfg.block_out_channels, cfg.norm_num_groups, cfg.act_fn
        rev = ch[::-1]
        self.act = act
        self.conv_in = CausalConv3d(cfg.latent_channels, ch[-1], 3, **kw)
        self.mid_block = MidBlock(ch[-1], g, act, cfg.mid_block_add_attention, **kw)
        blocks, cin = [], rev[0]
        for i, f in enumerate(cfg.up_factors()):
            blocks.append(Block(cin, rev[i], cfg.layers_per_block + 1, g, act, up=f, **kw))
            cin = rev[i]
        self.up_blocks = nnx.List(blocks)
        self.conv_norm_out = GroupNorm(g, ch[0], **kw)
        self.conv_out = CausalConv3d(ch[0], cfg.out_channels, 3, **kw)

    def __call__(self, z):
        x = self.mid_block(self.conv_in(z))
        for b in self.up_blocks:
            x = b(x)
        return self.conv_out(vconv.activation(self.act)(self.conv_norm_out(x)))


class HunyuanVideoVAE(nnx.Module):
    """``encoder`` + ``quant_conv`` (-> mean, logvar) and ``post_quant_conv`` + ``decoder``; the
    methods below are the units the tiling loops call (one jitted program per tile shape)."""

    def __init__(self, cfg: HunyuanVAEConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        self.encoder = Encoder(cfg, **kw)
        self.decoder = Decoder(cfg, **kw)
        self.quant_conv = Conv3d(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1, **kw)
        self.post_quant_conv = Conv3d(cfg.latent_channels, cfg.latent_channels, 1, **kw)

    def encode_tile(self, x):
        """[B, T, H, W, 3] -> the posterior's moments [B, t, h, w, 2z] (mean, logvar)."""
        dt = vconv.kernel_dtype(self.quant_conv.kernel)
        return self.quant_conv(self.encoder(x.astype(dt))).astype(F32)

    def decode_tile(self, z):
        """[B, t, h, w, z] -> pixels [B, T, H, W, 3] (float32)."""
        dt = vconv.kernel_dtype(self.post_quant_conv.kernel)
        return self.decoder(self.post_quant_conv(z.astype(dt))).astype(F32)


def init(cfg: HunyuanVAEConfig, seed: int = 0, dtype=np.float32) -> nn.Split:
    """A seeded random VAE (presets, tests), split once (host-drawn weights, see
    :func:`vidax.models.hunyuanvideo.dit.seeded_state`)."""
    from vidax.models.hunyuanvideo.dit import seeded_state

    graphdef, state = seeded_state(lambda: _build(cfg, dtype), seed)
    return vconv.conv_model(nn.Split(graphdef, jax.device_put(state), cfg))


def _build(cfg, dtype=np.float32):
    return HunyuanVideoVAE(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(dtype))


# ----------------------------------------------------------------------------------- tiling
def _decode_one(vae: nn.Split, z, tiling: Tiling):
    """``_decode`` of one temporal tile (channels-last numpy in and out): spatially tiled when
    tiling is on and the tile is larger than a spatial tile."""
    cfg = vae.cfg
    s = cfg.spatial_compression_ratio
    th, tw = tiling.min_h // s, tiling.min_w // s
    fn = lambda zz: vae.apply("decode_tile", jnp.asarray(zz))  # noqa: E731
    if tiling.spatial and (z.shape[3] > tw or z.shape[2] > th):
        if tiling.min_h != tiling.min_w or tiling.stride_h != tiling.stride_w:
            raise ValueError("spatial tiling: non-square tiles are not supported")
        return vtiles.spatial_tiled(fn, z, th, tiling.stride_h // s, tiling.min_h, tiling.stride_h,
                                    z.shape[2] * s, z.shape[3] * s)
    return np.asarray(fn(z))


def temporal_tiles(latent_frames: int, tiling: Tiling = Tiling(), temporal: int = 4) -> list[tuple[int, int]]:
    """The latent frame range ``[start, stop)`` of each temporal tile the reference decodes (one
    tile, the whole range, when the video is short or ``framewise`` is off). A last tile of one
    latent frame decodes to nothing the reference keeps, and is left out."""
    n = latent_frames
    t_min, t_stride = tiling.min_t // temporal, tiling.stride_t // temporal
    if not tiling.framewise or n <= t_min:
        return [(0, n)]
    out = [(i, min(i + t_min + 1, n)) for i in range(0, n, t_stride)]
    return [r for k, r in enumerate(out) if k == 0 or r[1] - r[0] > 1]


def decode_tiles(vae: nn.Split, z, first: int, stop: int, tail=None, tiling: Tiling = Tiling()):
    """Decode temporal tiles ``first..stop-1`` (indices into :func:`temporal_tiles`) of latents
    ``z`` ([B, C, T, H, W], reference layout, *unscaled*: already divided by ``scaling_factor``).
    ``tail``: the previous tile's last (cross-faded) frames, channels-last, as returned by the call
    for the tiles before (None for tile 0). Returns ``(pixels [B, 3, F, H, W] in [-1, 1]-ish,
    tail)``; the pixels of consecutive calls concatenate to :func:`decode`'s."""
    cfg = vae.cfg
    tc = cfg.temporal_compression_ratio
    z = np.asarray(z, np.float32).transpose(0, 2, 3, 4, 1)
    n = z.shape[1]
    tiles = temporal_tiles(n, tiling, tc)
    total = (n - 1) * tc + 1
    if len(tiles) == 1:
        px = _decode_one(vae, z, tiling)
        return px.transpose(0, 4, 1, 2, 3), None
    blend = tiling.min_t - tiling.stride_t
    keep0, keep = tiling.stride_t + 1, tiling.stride_t
    out = []
    for k in range(first, stop):
        a, b = tiles[k]
        px = _decode_one(vae, z[:, a:b], tiling)
        if k > 0:
            px = px[:, 1:]
            if tail is None:
                raise ValueError(f"decode_tiles: tile {k} needs the previous tile's tail")
            px = vtiles.blend(tail, px, blend, 1)
        start = 0 if k == 0 else keep0 + (k - 1) * keep  # this tile's first output frame
        kept = px[:, :keep0 if k == 0 else keep]
        out.append(kept[:, :max(0, total - start)])
        tail = px[:, max(0, px.shape[1] - blend):]
    px = np.concatenate(out, axis=1)
    return px.transpose(0, 4, 1, 2, 3), tail


def decode(vae: nn.Split, z, tiling: Tiling = Tiling()) -> np.ndarray:
    """The reference's ``decode``: latents [B, C, T, H, W] (divided by ``scaling_factor``) -> pixels
    [B, 3, F, H, W] (float32, not clipped)."""
    n = np.shape(z)[2]
    return decode_tiles(vae, z, 0, len(temporal_tiles(n, tiling, vae.cfg.temporal_compression_ratio)), None, tiling)[0]


def _encode_one(vae: nn.Split, x, tiling: Tiling):
    cfg = vae.cfg
    s = cfg.spatial_compression_ratio
    fn = lambda xx: vae.apply("encode_tile", jnp.asarray(xx))  # noqa: E731
    if tiling.spatial and (x.shape[3] > tiling.min_w or x.shape[2] > tiling.min_h):
        if tiling.min_h != tiling.min_w or tiling.stride_h != tiling.stride_w:
            raise ValueError("spatial tiling: non-square tiles are not supported")
        return vtiles.spatial_tiled(fn, x, tiling.min_h, tiling.stride_h, tiling.min_h // s, tiling.stride_h // s,
                                    x.shape[2] // s, x.shape[3] // s)
    return np.asarray(fn(x))


def encode_moments(vae: nn.Split, x, tiling: Tiling = Tiling()) -> np.ndarray:
    """The reference's ``_encode``: video [B, 3, F, H, W] in [-1, 1] -> moments [B, 2z, T, h, w]."""
    cfg = vae.cfg
    tc = cfg.temporal_compression_ratio
    x = np.asarray(x, np.float32).transpose(0, 2, 3, 4, 1)
    f = x.shape[1]
    if not (tiling.framewise and f > tiling.min_t):
        return _encode_one(vae, x, tiling).transpose(0, 4, 1, 2, 3)
    n_lat = (f - 1) // tc + 1
    t_min, t_stride = tiling.min_t // tc, tiling.stride_t // tc
    blend = t_min - t_stride
    row = []
    for i in range(0, f, tiling.stride_t):
        m = _encode_one(vae, x[:, i:i + tiling.min_t + 1], tiling)
        row.append(m[:, 1:] if i > 0 else m)
    out = []
    for k, m in enumerate(row):
        if k > 0:
            m = vtiles.blend(row[k - 1], m, blend, 1)
            row[k] = m
            out.append(m[:, :t_stride])
        else:
            out.append(m[:, :t_stride + 1])
    return np.concatenate(out, axis=1)[:, :n_lat].transpose(0, 4, 1, 2, 3)


def encode(vae: nn.Split, x, tiling: Tiling = Tiling()) -> np.ndarray:
    """Posterior mean (the reference's ``latent_dist.mode()``): [B, 3, F, H, W] -> [B, z, T, h, w]."""
    m = encode_moments(vae, x, tiling)
    return m[:, : vae.cfg.latent_channels]


# ----------------------------------------------------------------------------------- weights
def _ref_name(path: str) -> tuple[str, str]:
    """A state path -> (reference tensor name, layout kind)."""
    parts = path.split(".")
    leaf = parts[-1]
    mods = ".".join(parts[:-1])
    if leaf == "kernel":
        return f"{mods}.weight", ("conv3d" if any(p in ("conv", "quant_conv", "post_quant_conv") for p in parts[-2:])
                                  else "linear")
    if leaf == "scale":
        return f"{mods}.weight", "none"
    return f"{mods}.{leaf}", "none"


def keymap(cfg: HunyuanVAEConfig) -> KeyMap:
    """diffusers names (= the original release's: the reference's conversion renames nothing)."""
    from vidax.core.sharding import tree_paths

    state = nn.abstract_state(lambda: _build(cfg))[1]
    rules = []
    for p in tree_paths(state):
        ref, kind = _ref_name(p)
        rules.append(Rule(ref, p, kind))
    return KeyMap(rules)


def load_vae(path, cfg: HunyuanVAEConfig | None = None, dtype=np.float32) -> nn.Split:
    """A diffusers ``vae/`` folder (config.json + safetensors) or the original release's
    ``pytorch_model.pt`` (same tensor names, an optional ``vae.`` prefix) -> the split VAE."""
    path = Path(path)
    if cfg is None:
        if path.is_dir() and (path / "config.json").exists():
            cfg = HunyuanVAEConfig.from_diffusers(compat.read_config(path))
        else:
            cfg = HunyuanVAEConfig()
    ckpt = open_checkpoint(path)
    names = list(ckpt)
    if names and all(n.startswith("vae.") for n in names):
        ckpt = {n.removeprefix("vae."): ckpt[n] for n in names}
    shapes = nn.shapes(lambda: _build(cfg, dtype))
    flat = load_params(ckpt, keymap(cfg), str_keys(shapes), dtype=dtype,
                       what=f"AutoencoderKLHunyuanVideo (channels {cfg.block_out_channels})")
    return vconv.conv_model(nn.Split.from_pure(lambda: _build(cfg, dtype), int_keys(flat)))


# ----------------------------------------------------------------------------------- compat
class _Compat(compat.CompatModel):
    def __init__(self, config, vae: nn.Split, tiling: Tiling):
        super().__init__("AutoencoderKLHunyuanVideo", config, vae.state, vae.cfg)
        self.vae, self.tiling = vae, tiling

    def enable_tiling(self, **kw):
        """diffusers' ``enable_tiling`` (same keyword names)."""
        ren = {"tile_sample_min_height": "min_h", "tile_sample_min_width": "min_w",
               "tile_sample_min_num_frames": "min_t", "tile_sample_stride_height": "stride_h",
               "tile_sample_stride_width": "stride_w", "tile_sample_stride_num_frames": "stride_t"}
        from dataclasses import replace

        self.tiling = replace(self.tiling, spatial=True, **{ren[k]: int(v) for k, v in kw.items() if v is not None})

    def encode(self, x):
        return encode(self.vae, x, self.tiling)

    def decode(self, z):
        return decode(self.vae, z, self.tiling)


@compat.register("AutoencoderKLHunyuanVideo")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **_):
    return _Compat(config, load_vae(folder, HunyuanVAEConfig.from_diffusers(config), dtype), Tiling())
