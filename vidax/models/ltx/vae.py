"""The LTX video VAEs as Flax NNX modules: diffusers ``AutoencoderKLLTXVideo`` (LTX-Video 0.9.x,
``version=1``) and ``AutoencoderKLLTX2Video`` (LTX-2.x, ``version=2``).

32x spatial (a 4x4 patch, then three or four 2x levels) and 8x temporal compression; the first
frame is its own latent frame (``8k+1`` frames). Causal 3D convolutions pad time with copies of the
first frame (or, non-causal, of the first and last); LTX-2's decoder pads space by reflection.
Up/down sampling is depth-to-space / space-to-depth around a convolution, optionally with a
residual. The newer LTX-Video decoders (0.9.1+) are timestep-conditioned: the pipeline mixes the
latents with ``decode_noise_scale`` noise and passes ``decode_timestep`` (scaled by a learned
``timestep_scale_multiplier``), which modulates every resnet and the output norm.

Channels-last inside (``[B, F, H, W, C]``); the public calls take and return the reference's
``[B, C, F, H, W]``. ``encode`` returns the posterior mean (the LTX encoders emit one shared
log-variance channel). :func:`tiled_decode` is the reference's spatially tiled decode (overlapping
tiles blended linearly); the pipelines run its tiles as persisted decode stages
(:class:`TiledDecode`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax import compat
from vidax.core import conv as vconv
from vidax.core import nn
from vidax.models.ltx import layers as L
from vidax.weights import KeyMap, Rule, open_checkpoint
from vidax.weights.keymap import load_params

F32 = jnp.float32
_zeros = nnx.initializers.zeros_init()


def _tuple(v, n):
    return tuple(v) if isinstance(v, (list, tuple)) else (v,) * n


@dataclass(frozen=True)
class LTXVAEConfig:
    version: int = 1  # 1: AutoencoderKLLTXVideo, 2: AutoencoderKLLTX2Video
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    block_out_channels: tuple = (128, 256, 512, 512)
    down_block_types: tuple = ("LTXVideoDownBlock3D",) * 4
    decoder_block_out_channels: tuple = (128, 256, 512, 512)
    layers_per_block: tuple = (4, 3, 3, 3, 4)
    decoder_layers_per_block: tuple = (4, 3, 3, 3, 4)
    spatio_temporal_scaling: tuple = (True, True, True, False)
    decoder_spatio_temporal_scaling: tuple = (True, True, True, False)
    decoder_inject_noise: tuple = (False, False, False, False, False)
    downsample_type: tuple = ("conv", "conv", "conv", "conv")
    upsample_type: tuple = ("spatiotemporal",) * 4
    upsample_residual: tuple = (False, False, False, False)
    upsample_factor: tuple = (1, 1, 1, 1)
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    encoder_causal: bool = True
    decoder_causal: bool = False
    encoder_spatial_padding_mode: str = "zeros"
    decoder_spatial_padding_mode: str = "zeros"
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    @property
    def spatial_ratio(self) -> int:
        return self.spatial_compression_ratio or self.patch_size * 2 ** sum(self.spatio_temporal_scaling)

    @property
    def temporal_ratio(self) -> int:
        return self.temporal_compression_ratio or self.patch_size_t * 2 ** sum(self.spatio_temporal_scaling)

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "LTXVAEConfig":
        version = 2 if cfg.get("_class_name") == "AutoencoderKLLTX2Video" else 1
        base = cls() if version == 1 else V2_DEFAULTS
        names = {f.name for f in fields(cls)}
        kw = {f.name: getattr(base, f.name) for f in fields(cls)}
        kw.update({k: v for k, v in cfg.items() if k in names})
        kw["version"] = version
        n_enc, n_dec = len(kw["layers_per_block"]), len(kw["decoder_layers_per_block"])
        if version == 2:
            kw["spatio_temporal_scaling"] = _tuple(kw["spatio_temporal_scaling"], n_enc - 1)
            kw["decoder_spatio_temporal_scaling"] = _tuple(kw["decoder_spatio_temporal_scaling"], n_dec - 1)
            kw["decoder_inject_noise"] = _tuple(kw["decoder_inject_noise"], n_dec)
            kw["upsample_residual"] = _tuple(kw["upsample_residual"], n_dec - 1)
        for k, v in kw.items():
            if isinstance(v, list):
                kw[k] = tuple(v)
        return cls(**kw)


V2_DEFAULTS = LTXVAEConfig(
    version=2, block_out_channels=(256, 512, 1024, 2048), down_block_types=("LTX2VideoDownBlock3D",) * 4,
    decoder_block_out_channels=(256, 512, 1024), layers_per_block=(4, 6, 6, 2, 2), decoder_layers_per_block=(5, 5, 5, 5),
    spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False), downsample_type=("spatial", "temporal", "spatiotemporal",
                                                                        "spatiotemporal"),
    upsample_type=("spatiotemporal",) * 3, upsample_residual=(True, True, True), upsample_factor=(2, 2, 2),
    decoder_causal=True, decoder_spatial_padding_mode="reflect", spatial_compression_ratio=32, temporal_compression_ratio=8)


# ----------------------------------------------------------------------------------- layers
def _pad_time(x, k: int, causal: bool):
    if k <= 1:
        return x
    if causal:
        return jnp.concatenate([jnp.repeat(x[:, :1], k - 1, axis=1), x], axis=1)
    p = (k - 1) // 2
    return jnp.concatenate([jnp.repeat(x[:, :1], p, axis=1), x, jnp.repeat(x[:, -1:], p, axis=1)], axis=1)


class CausalConv3d(nnx.Module):
    """``LTXVideoCausalConv3d`` / ``LTX2VideoCausalConv3d``: time padded with edge frames, space
    padded ``k // 2`` with zeros or by reflection. ``kernel``: [kt, kh, kw, Cin, Cout]."""

    def __init__(self, cin, cout, k=3, stride=1, *, rngs, pad_mode="zeros", causal=None, param_dtype=F32):
        self.k = (k, k, k) if isinstance(k, int) else tuple(k)
        self.stride = (stride,) * 3 if isinstance(stride, int) else tuple(stride)
        self.pad_mode, self.causal = pad_mode, causal
        self.kernel = nn.param(rngs, nnx.initializers.lecun_normal(), (*self.k, cin, cout), None, None, None, None, None,
                               dtype=param_dtype)
        self.bias = nn.param(rngs, _zeros, (cout,), None, dtype=param_dtype)

    def __call__(self, x, causal=None):
        causal = self.causal if causal is None else causal
        kt, kh, kw = self.k
        ph, pw = kh // 2, kw // 2
        w = vconv.kernel_value(self.kernel)  # whole, or split by time tap (vconv.split_taps)
        if self.stride == (1, 1, 1):  # the time-padded input never built (vconv.edge_time_conv3d)
            tpad = (kt - 1, 0) if causal else ((kt - 1) // 2,) * 2
            return vconv.edge_time_conv3d(x, w, self.bias[...], tpad, ((ph, ph), (pw, pw)),
                                          mode="reflect" if self.pad_mode == "reflect" else "zeros")
        x = _pad_time(x, kt, causal)
        if ph or pw:
            mode = "reflect" if self.pad_mode == "reflect" else "constant"
            x = jnp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw), (0, 0)), mode=mode)
        return vconv.conv3d(x, w, self.bias[...], self.stride, "VALID")


class Conv1x1(nnx.Module):
    """A pointwise Conv3d (LTX-2's resnet shortcut), kernel [1, 1, 1, Cin, Cout]."""

    def __init__(self, cin, cout, *, rngs, param_dtype=F32):
        self.kernel = nn.param(rngs, nnx.initializers.lecun_normal(), (1, 1, 1, cin, cout), None, None, None, None, None,
                               dtype=param_dtype)
        self.bias = nn.param(rngs, _zeros, (cout,), None, dtype=param_dtype)

    def __call__(self, x):
        y = vconv.matmul(x, self.kernel[...][0, 0, 0])  # (a few pixels' rows: as a 1x1 conv)
        return y + self.bias[...].astype(y.dtype)


def _pixel_rms(x, version: int, eps: float = 1e-8):
    xf = x.astype(F32)
    ms = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
    y = xf / jnp.sqrt(ms + eps) if version == 2 else xf * jax.lax.rsqrt(ms + eps)
    return y.astype(x.dtype)


class Noise:
    """Where an injecting decoder's spatial noise comes from: a JAX key (split per draw), or the
    exact arrays in the reference's draw order (parity tests: ``torch.randn`` recorded)."""

    def __init__(self, source):
        self.key = source if not isinstance(source, (list, tuple)) else None
        self.arrays = None if self.key is not None else list(source)
        self.n = 0

    def __call__(self, shape):
        self.n += 1
        if self.arrays is not None:
            a = jnp.asarray(self.arrays[self.n - 1], F32)
            if tuple(a.shape) != tuple(shape):
                raise ValueError(f"noise draw {self.n - 1}: shape {a.shape}, expected {tuple(shape)}")
            return a
        return jax.random.normal(jax.random.fold_in(self.key, self.n), shape, F32)


class ResBlock(nnx.Module):
    def __init__(self, cin, cout, *, rngs, version, eps=1e-6, inject_noise=False, tcond=False, pad_mode="zeros",
                 causal=None, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.version = version
        self.conv1 = CausalConv3d(cin, cout, 3, pad_mode=pad_mode, causal=causal, **kw)
        self.conv2 = CausalConv3d(cout, cout, 3, pad_mode=pad_mode, causal=causal, **kw)
        self.norm3 = nn.LayerNorm(cin, eps=eps, rngs=rngs, param_dtype=param_dtype) if cin != cout else None
        self.shortcut = None if cin == cout else (
            Conv1x1(cin, cout, **kw) if version == 2 else CausalConv3d(cin, cout, 1, causal=causal, **kw))
        self.noise1 = nn.param(rngs, _zeros, (cin,), None, dtype=param_dtype) if inject_noise else None
        self.noise2 = nn.param(rngs, _zeros, (cin,), None, dtype=param_dtype) if inject_noise else None
        self.sst = (nn.param(rngs, nnx.initializers.normal(cin ** -0.5), (4, cin), None, None, dtype=param_dtype)
                    if tcond else None)

    def __call__(self, x, temb=None, causal=None, noise: Noise | None = None):
        dt = x.dtype
        h = _pixel_rms(x, self.version)
        if self.sst is not None:
            t = temb.reshape(temb.shape[0], 4, -1).astype(F32) + self.sst[...].astype(F32)  # [B, 4, C]
            sh1, sc1, sh2, sc2 = (t[:, j][:, None, None, None] for j in range(4))
            h = (h.astype(F32) * (1 + sc1) + sh1).astype(dt)
        h = self.conv1(vconv.silu(h), causal)
        if self.noise1 is not None:
            n = noise(h.shape[2:4])
            h = h + (n[None, None, :, :, None] * self.noise1[...].astype(F32)).astype(dt)
        h = _pixel_rms(h, self.version)
        if self.sst is not None:
            h = (h.astype(F32) * (1 + sc2) + sh2).astype(dt)
        h = self.conv2(vconv.silu(h), causal)
        if self.noise2 is not None:
            n = noise(h.shape[2:4])
            h = h + (n[None, None, :, :, None] * self.noise2[...].astype(F32)).astype(dt)
        if self.norm3 is not None:
            x = self.norm3(x.astype(F32)).astype(dt)
        if self.shortcut is not None:
            x = self.shortcut(x) if self.version == 2 else self.shortcut(x, causal)
        return h + x


def _space_to_depth(x, s):
    b, f, h, w, c = x.shape
    x = x.reshape(b, f // s[0], s[0], h // s[1], s[1], w // s[2], s[2], c)
    x = x.transpose(0, 1, 3, 5, 7, 2, 4, 6)
    return x.reshape(b, f // s[0], h // s[1], w // s[2], c * s[0] * s[1] * s[2])


def _depth_to_space(x, s):
    b, f, h, w, c = x.shape
    n = s[0] * s[1] * s[2]
    x = x.reshape(b, f, h, w, c // n, s[0], s[1], s[2]).transpose(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, f * s[0], h * s[1], w * s[2], c // n)


class Downsampler(nnx.Module):
    """Space-to-depth around a convolution, plus the group-mean of the space-to-depth input."""

    def __init__(self, cin, cout, stride, *, rngs, pad_mode="zeros", causal=None, param_dtype=F32):
        self.stride = tuple(stride)
        n = math.prod(self.stride)
        self.group = cin * n // cout
        self.conv = CausalConv3d(cin, cout // n, 3, pad_mode=pad_mode, causal=causal, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x, causal=None):
        s = self.stride
        x = jnp.concatenate([x[:, : s[0] - 1], x], axis=1)
        r = _space_to_depth(x, s)
        r = r.reshape(*r.shape[:-1], -1, self.group).mean(axis=-1)
        return _space_to_depth(self.conv(x, causal), s) + r


class Upsampler(nnx.Module):
    """A convolution to ``prod(stride) * C / upscale`` channels, depth-to-space, the first
    ``stride_t - 1`` frames dropped; optionally plus the depth-to-space input tiled on channels."""

    def __init__(self, cin, stride, *, rngs, residual=False, upscale=1, cout=None, pad_mode="zeros", causal=None,
                 param_dtype=F32):
        self.stride, self.residual, self.upscale = tuple(stride), residual, upscale
        cout = (cout or cin) * math.prod(self.stride) // upscale
        self.conv = CausalConv3d(cin, cout, 3, pad_mode=pad_mode, causal=causal, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x, causal=None):
        s = self.stride
        y = _depth_to_space(self.conv(x, causal), s)[:, s[0] - 1:]
        if self.residual:
            r = _depth_to_space(x, s)
            r = jnp.tile(r, (1, 1, 1, 1, math.prod(s) // self.upscale))[:, s[0] - 1:]
            y = y + r
        return y


# ----------------------------------------------------------------------------------- blocks
class DownBlock(nnx.Module):
    def __init__(self, cfg: LTXVAEConfig, i: int, cin: int, cout: int, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        v, eps, pad = cfg.version, cfg.resnet_norm_eps, cfg.encoder_spatial_padding_mode
        causal = cfg.encoder_causal if v == 1 else None
        self.resnets = nnx.List([ResBlock(cin, cin, version=v, eps=eps, pad_mode=pad, causal=causal, **kw)
                                 for _ in range(cfg.layers_per_block[i])])
        kind = cfg.down_block_types[i]
        down = None
        if cfg.spatio_temporal_scaling[i]:
            dt = "conv" if kind == "LTXVideoDownBlock3D" else cfg.downsample_type[i]
            if dt == "conv":
                down = CausalConv3d(cin, cin, 3, stride=2, pad_mode=pad, causal=causal, **kw)
            else:
                stride = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}[dt]
                down = Downsampler(cin, cout, stride, pad_mode=pad, causal=causal, **kw)
        self.down = down
        self.conv_out = (ResBlock(cin, cout, version=v, eps=eps, pad_mode=pad, causal=causal, **kw)
                         if kind == "LTXVideoDownBlock3D" and cin != cout else None)

    def __call__(self, x, causal=None):
        for r in self.resnets:
            x = r(x, causal=causal)
        if self.down is not None:
            x = self.down(x, causal)
        if self.conv_out is not None:
            x = self.conv_out(x, causal=causal)
        return x


class MidBlock(nnx.Module):
    def __init__(self, cfg, c: int, layers: int, *, rngs, side: str, inject_noise=False, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        dec = side == "decoder"
        tcond = cfg.timestep_conditioning and dec
        pad = cfg.decoder_spatial_padding_mode if dec else cfg.encoder_spatial_padding_mode
        causal = (cfg.decoder_causal if dec else cfg.encoder_causal) if cfg.version == 1 else None
        self.time = L.TimestepEmbed(4 * c, **kw) if tcond else None
        self.resnets = nnx.List([ResBlock(c, c, version=cfg.version, eps=cfg.resnet_norm_eps, inject_noise=inject_noise,
                                          tcond=tcond, pad_mode=pad, causal=causal, **kw) for _ in range(layers)])

    def __call__(self, x, temb=None, causal=None, noise=None):
        if self.time is not None:
            temb = self.time(temb.reshape(-1), x.dtype)
        for r in self.resnets:
            x = r(x, temb, causal, noise)
        return x


class UpBlock(nnx.Module):
    def __init__(self, cfg: LTXVAEConfig, i: int, cin: int, cout: int, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        rev = lambda t: tuple(reversed(t))  # noqa: E731
        scaling, layers = rev(cfg.decoder_spatio_temporal_scaling), rev(cfg.decoder_layers_per_block)
        noise, resid, factor = rev(cfg.decoder_inject_noise), rev(cfg.upsample_residual), rev(cfg.upsample_factor)
        utype = rev(cfg.upsample_type[: len(scaling)])
        v, eps, pad = cfg.version, cfg.resnet_norm_eps, cfg.decoder_spatial_padding_mode
        tcond = cfg.timestep_conditioning
        causal = cfg.decoder_causal if v == 1 else None
        rk = dict(version=v, eps=eps, inject_noise=noise[i + 1], tcond=tcond, pad_mode=pad, causal=causal, **kw)
        self.time = L.TimestepEmbed(4 * cin, **kw) if tcond else None
        self.conv_in = ResBlock(cin, cout, **rk) if cin != cout else None
        up = None
        if scaling[i]:
            stride = {"spatial": (1, 2, 2), "temporal": (2, 1, 1),
                      "spatiotemporal": (2, 2, 2)}[utype[i] if v == 2 else "spatiotemporal"]
            up = Upsampler(cout * factor[i], stride, residual=resid[i], upscale=factor[i], pad_mode=pad, causal=causal, **kw)
        self.up = up
        self.resnets = nnx.List([ResBlock(cout, cout, **rk) for _ in range(layers[i + 1])])

    def __call__(self, x, temb=None, causal=None, noise=None):
        if self.conv_in is not None:
            x = self.conv_in(x, temb, causal, noise)
        if self.time is not None:
            temb = self.time(temb.reshape(-1), x.dtype)
        if self.up is not None:
            x = self.up(x, causal)
        for r in self.resnets:
            x = r(x, temb, causal, noise)
        return x


def patchify(x, p: int, pt: int = 1):
    """[B, F, H, W, C] -> [B, F/pt, H/p, W/p, C*pt*p*p], channel order (c, t, w, h) as the reference."""
    b, f, h, w, c = x.shape
    x = x.reshape(b, f // pt, pt, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 7, 2, 6, 4)
    return x.reshape(b, f // pt, h // p, w // p, c * pt * p * p)


def unpatchify(x, p: int, pt: int = 1):
    b, f, h, w, c = x.shape
    c0 = c // (pt * p * p)
    x = x.reshape(b, f, h, w, c0, pt, p, p).transpose(0, 1, 5, 2, 7, 3, 6, 4)
    return x.reshape(b, f * pt, h * p, w * p, c0)


class Encoder(nnx.Module):
    def __init__(self, cfg: LTXVAEConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        cin = cfg.in_channels * cfg.patch_size ** 2
        pad = cfg.encoder_spatial_padding_mode
        causal = cfg.encoder_causal if cfg.version == 1 else None
        boc = cfg.block_out_channels
        if cfg.version == 2:
            c = cfg.latent_channels
            chans = []
            for i in range(len(boc)):
                chans.append((c, boc[i]))
                c = boc[i]
        else:
            is095 = cfg.down_block_types[-1] == "LTXVideo095DownBlock3D"
            n = len(boc) - (1 if is095 else 0)
            c = boc[0]
            chans = []
            for i in range(n):
                o = boc[i + 1] if (is095 or i + 1 < n) else boc[i]
                chans.append((c, o))
                c = o
        self.conv_in = CausalConv3d(cin, chans[0][0], 3, pad_mode=pad, causal=causal, **kw)
        self.down = nnx.List([DownBlock(cfg, i, a, b, **kw) for i, (a, b) in enumerate(chans)])
        self.mid = MidBlock(cfg, c, cfg.layers_per_block[-1], side="encoder", **kw)
        self.conv_out = CausalConv3d(c, cfg.latent_channels + 1, 3, pad_mode=pad, causal=causal, **kw)

    def __call__(self, x, causal=None):
        """[B, F, H, W, 3] -> posterior mean [B, f, h, w, latent]."""
        return self.moments(x, causal)[0]

    def moments(self, x, causal=None):
        """(mean, logvar): the posterior ``DiagonalGaussianDistribution`` (one log-variance channel
        repeated over every latent channel, clipped to [-30, 20] as the reference clips it)."""
        cfg = self.cfg
        if cfg.version == 2:
            causal = bool(causal) or cfg.encoder_causal
        h = self.conv_in(patchify(x, cfg.patch_size, cfg.patch_size_t), causal)
        for d in self.down:
            h = d(h, causal)
        h = self.mid(h, causal=causal)
        h = self.conv_out(vconv.silu(_pixel_rms(h, cfg.version)), causal)
        logvar = jnp.clip(h[..., -1:], -30.0, 20.0)
        return h[..., : cfg.latent_channels], jnp.broadcast_to(logvar, h[..., : cfg.latent_channels].shape)


class Decoder(nnx.Module):
    def __init__(self, cfg: LTXVAEConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        rev = lambda t: tuple(reversed(t))  # noqa: E731
        boc, factor = rev(cfg.decoder_block_out_channels), rev(cfg.upsample_factor)
        layers, noise = rev(cfg.decoder_layers_per_block), rev(cfg.decoder_inject_noise)
        pad = cfg.decoder_spatial_padding_mode
        causal = cfg.decoder_causal if cfg.version == 1 else None
        c = boc[0]
        self.conv_in = CausalConv3d(cfg.latent_channels, c, 3, pad_mode=pad, causal=causal, **kw)
        self.mid = MidBlock(cfg, c, layers[0], side="decoder", inject_noise=noise[0], **kw)
        ups = []
        for i in range(len(boc)):
            cin, c = c // factor[i], boc[i] // factor[i]
            ups.append(UpBlock(cfg, i, cin, c, **kw))
        self.up = nnx.List(ups)
        self.conv_out = CausalConv3d(c, cfg.out_channels * cfg.patch_size ** 2, 3, pad_mode=pad, causal=causal, **kw)
        tc = cfg.timestep_conditioning
        self.tscale = nn.param(rngs, nnx.initializers.constant(1000.0), (), dtype=param_dtype) if tc else None
        self.time = L.TimestepEmbed(2 * c, **kw) if tc else None
        self.sst = nn.param(rngs, nnx.initializers.normal(c ** -0.5), (2, c), None, None, dtype=param_dtype) if tc else None

    @property
    def noisy(self) -> bool:
        return any(self.cfg.decoder_inject_noise)

    def __call__(self, z, temb=None, causal=None, key=None):
        """[B, f, h, w, latent] (+ ``temb`` [B] decode timesteps) -> pixels [B, F, H, W, 3] in [-1, 1]."""
        cfg = self.cfg
        if cfg.version == 2:
            causal = bool(causal) or cfg.decoder_causal
        if self.noisy and key is None:
            raise ValueError("this LTX VAE decoder injects noise: pass a key (or the noise arrays)")
        noise = None if key is None else Noise(key)
        h = self.conv_in(z, causal)
        if self.tscale is not None:
            if temb is None:
                raise ValueError("this LTX VAE decoder is timestep-conditioned: pass the decode timestep")
            temb = jnp.asarray(temb, F32).reshape(-1) * self.tscale[...].astype(F32)
        h = self.mid(h, temb, causal, noise)
        for u in self.up:
            h = u(h, temb, causal, noise)
        h = _pixel_rms(h, cfg.version)
        if self.time is not None:
            t = self.time(temb.reshape(-1), h.dtype).reshape(h.shape[0], 2, -1).astype(F32) + self.sst[...].astype(F32)
            shift, scale = t[:, 0][:, None, None, None], t[:, 1][:, None, None, None]
            h = (h.astype(F32) * (1 + scale) + shift).astype(h.dtype)
        h = self.conv_out(vconv.silu(h), causal)
        return unpatchify(h, cfg.patch_size, cfg.patch_size_t)


class LTXVAE(nnx.Module):
    def __init__(self, cfg: LTXVAEConfig, *, rngs, param_dtype=F32, encoder: bool = True):
        self.cfg = cfg
        self.encoder = Encoder(cfg, rngs=rngs, param_dtype=param_dtype) if encoder else None
        self.decoder = Decoder(cfg, rngs=rngs, param_dtype=param_dtype)

    def encode(self, x):
        return self.encoder(x)

    def moments(self, x):
        return self.encoder.moments(x)

    def decode(self, z, temb=None, key=None):
        return self.decoder(z, temb, key=key)


# ----------------------------------------------------------------------------------- state
def _build(cfg: LTXVAEConfig, seed=0, dtype=np.float32, encoder=True):
    return LTXVAE(cfg, rngs=nnx.Rngs(seed), param_dtype=jnp.dtype(dtype), encoder=encoder)


def init_state(cfg: LTXVAEConfig, seed: int = 0, dtype=np.float32, encoder: bool = True):
    """Seeded random weights (host numpy; see :func:`vidax.models.ltx.layers.seeded_state`), conv
    kernels as :func:`load_vae` holds them."""
    return vconv.split_taps(L.seeded_state(lambda: _build(cfg, 0, dtype, encoder), seed,
                                           {"tscale": lambda s, r: np.float32(1000.0 * (1 + 0.05 * r.standard_normal()))}),
                            combos=True)


@functools.lru_cache(maxsize=None)
def graphdef(cfg: LTXVAEConfig, dtype: str = "float32", encoder: bool = True):
    return nnx.graphdef(nn.abstract_module(lambda: _build(cfg, 0, dtype, encoder)))


def _dtype(state) -> str:
    return np.dtype(jax.tree.leaves(state)[0].dtype).name


@vconv.jit(static_argnums=(1,))
def _encode(state, cfg, x):
    return nnx.merge(graphdef(cfg, _dtype(state), True), state).encode(x)


@vconv.jit(static_argnums=(1, 2))
def _decode(state, cfg, has_enc, z, temb, key):
    return nnx.merge(graphdef(cfg, _dtype(state), has_enc), state).decode(z, temb, key)


def _has_encoder(state) -> bool:
    return "encoder" in state and len(jax.tree.leaves(state["encoder"])) > 0


@vconv.jit(static_argnums=(1,))
def _moments(state, cfg, x):
    return nnx.merge(graphdef(cfg, _dtype(state), True), state).moments(x)


def encode_sample(state, cfg: LTXVAEConfig, video, key) -> jax.Array:
    """A posterior sample ``mean + exp(logvar / 2) * N(0, 1)`` (the reference's ``retrieve_latents``
    in "sample" mode) [B, C, f, h, w], the noise from ``key``."""
    x = jnp.asarray(video, F32).transpose(0, 2, 3, 4, 1)
    mean, logvar = _moments(state, cfg, x)
    z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape, F32)
    return z.transpose(0, 4, 1, 2, 3)


def encode(state, cfg: LTXVAEConfig, video) -> jax.Array:
    """``video`` [B, 3, F, H, W] in [-1, 1] -> posterior mean [B, C, f, h, w] (raw, not normalised)."""
    x = jnp.asarray(video, F32).transpose(0, 2, 3, 4, 1)
    return _encode(state, cfg, x).transpose(0, 4, 1, 2, 3)


def decode(state, cfg: LTXVAEConfig, z, timestep=None, key=None) -> jax.Array:
    """Latents [B, C, f, h, w] (raw) -> pixels [B, 3, F, H, W] in about [-1, 1]. ``timestep``: the
    decode timestep [B] of a timestep-conditioned decoder; ``key``: for decoders that inject noise
    (LTX-Video 0.9.1): a JAX key, or the spatial noise arrays in the reference's draw order."""
    x = jnp.asarray(z, F32).transpose(0, 2, 3, 4, 1)
    t = None if timestep is None else jnp.asarray(timestep, F32).reshape(-1)
    return _decode(state, cfg, _has_encoder(state), x, t, key).transpose(0, 4, 1, 2, 3)


def normalize(stats: dict, cfg: LTXVAEConfig, z, axis: int = 1, scaling_factor: float | None = None):
    """``(z - mean) * scaling_factor / std`` over the channel axis (the pipelines' ``_normalize_latents``)."""
    sf = cfg.scaling_factor if scaling_factor is None else scaling_factor
    shape = [1] * np.ndim(z)
    shape[axis] = -1
    m, s = (np.asarray(stats[k], np.float32).reshape(shape) for k in ("latents_mean", "latents_std"))
    return (np.asarray(z, np.float32) - m) * np.float32(sf) / s


def denormalize(stats: dict, cfg: LTXVAEConfig, z, axis: int = 1, scaling_factor: float | None = None):
    sf = cfg.scaling_factor if scaling_factor is None else scaling_factor
    shape = [1] * np.ndim(z)
    shape[axis] = -1
    m, s = (np.asarray(stats[k], np.float32).reshape(shape) for k in ("latents_mean", "latents_std"))
    return np.asarray(z, np.float32) * s / np.float32(sf) + m


# ----------------------------------------------------------------------------------- tiling
def blend_tiles(tiles, blend_h: int, blend_w: int, stride_h: int, stride_w: int, height: int, width: int):
    """The reference's ``tiled_decode`` assembly: tiles ``[[ [B, C, F, h, w] ]]`` (rows of columns)
    blended with the (already blended) tile above and to the left over ``blend_*`` pixels, each
    cropped to the stride, concatenated and cropped to ``height x width``."""
    rows = [[np.array(t, np.float32, copy=True) for t in row] for row in tiles]
    out_rows = []
    for i, row in enumerate(rows):
        parts = []
        for j, tile in enumerate(row):
            if i > 0:
                _blend_v(rows[i - 1][j], tile, blend_h)
            if j > 0:
                _blend_h(row[j - 1], tile, blend_w)
            parts.append(tile[..., :stride_h, :stride_w])
        out_rows.append(np.concatenate(parts, axis=-1))
    return np.concatenate(out_rows, axis=-2)[..., :height, :width]


def _blend_v(a, b, extent):
    extent = min(a.shape[-2], b.shape[-2], extent)
    for y in range(extent):
        b[..., y, :] = a[..., -extent + y, :] * (1 - y / extent) + b[..., y, :] * (y / extent)
    return b


def _blend_h(a, b, extent):
    extent = min(a.shape[-1], b.shape[-1], extent)
    for x in range(extent):
        b[..., x] = a[..., -extent + x] * (1 - x / extent) + b[..., x] * (x / extent)
    return b


@dataclass(frozen=True)
class Tiling:
    """Spatial tiles in pixels (the reference's ``enable_tiling`` sizes)."""

    min_height: int = 512
    min_width: int = 512
    stride_height: int = 448
    stride_width: int = 448

    def grid(self, cfg: LTXVAEConfig, lh: int, lw: int):
        """Latent tile boxes ``[(y0, y1, x0, x1)]`` by rows, as the reference iterates them."""
        r = cfg.spatial_ratio
        th, tw, sh, sw = self.min_height // r, self.min_width // r, self.stride_height // r, self.stride_width // r
        return [[(i, min(i + th, lh), j, min(j + tw, lw)) for j in range(0, lw, sw)] for i in range(0, lh, sh)]


def blend_tile(raw, i: int, j: int, carry: dict | None, tiling: Tiling, last: bool):
    """One tile of :func:`blend_tiles` on its own (a persisted decode stage): blend the raw decoded
    tile (i, j) [B, C, F, h, w] with the blended strips of its upper and left neighbours that
    ``carry`` holds, and return ``(region kept for the output, carry for the next tile)``. Tiles
    run in raster order; the concatenated regions equal :func:`blend_tiles` exactly."""
    bh, bw = tiling.min_height - tiling.stride_height, tiling.min_width - tiling.stride_width
    t = np.array(raw, np.float32, copy=True)
    carry = dict(carry or {})
    if i > 0:
        _blend_v(carry[f"above_{j}"], t, bh)
    if j > 0:
        _blend_h(carry["left"], t, bw)
    region = t[..., : tiling.stride_height, : tiling.stride_width]
    if last:
        return region, None
    carry[f"above_{j}"] = t[..., t.shape[-2] - min(bh, t.shape[-2]):, :]
    carry["left"] = t[..., t.shape[-1] - min(bw, t.shape[-1]):]
    return region, carry


def tiled_decode(state, cfg: LTXVAEConfig, z, timestep=None, tiling: Tiling = Tiling(), key=None) -> np.ndarray:
    """The reference's tiled decode (``enable_tiling``): the latent split into overlapping tiles,
    each decoded alone, blended back. Returns [B, 3, F, H, W] (numpy)."""
    z = np.asarray(z, np.float32)
    lh, lw = z.shape[-2:]
    r = cfg.spatial_ratio
    if not (lw > tiling.min_width // r or lh > tiling.min_height // r):
        return np.asarray(decode(state, cfg, z, timestep, key))
    grid = tiling.grid(cfg, lh, lw)
    tiles = [[np.asarray(decode(state, cfg, z[..., y0:y1, x0:x1], timestep, key)) for (y0, y1, x0, x1) in row]
             for row in grid]
    return blend_tiles(tiles, tiling.min_height - tiling.stride_height, tiling.min_width - tiling.stride_width,
                       tiling.stride_height, tiling.stride_width, lh * r, lw * r)


# ----------------------------------------------------------------------------------- key maps
def _conv_keys(ref, dst, v2_plain=False):
    base = ref if v2_plain else f"{ref}.conv"
    return [(f"{base}.weight", f"{dst}.kernel", "conv3d"), (f"{base}.bias", f"{dst}.bias", "none")]


def _res_keys(ref, dst, r: ResBlock):
    out = _conv_keys(f"{ref}.conv1", f"{dst}.conv1") + _conv_keys(f"{ref}.conv2", f"{dst}.conv2")
    if r.norm3 is not None:
        out += [(f"{ref}.norm3.weight", f"{dst}.norm3.scale", "none"), (f"{ref}.norm3.bias", f"{dst}.norm3.bias", "none")]
    if r.shortcut is not None:
        out += _conv_keys(f"{ref}.conv_shortcut", f"{dst}.shortcut", v2_plain=r.version == 2)
    if r.noise1 is not None:
        out += [(f"{ref}.per_channel_scale1", f"{dst}.noise1", "flat"), (f"{ref}.per_channel_scale2", f"{dst}.noise2", "flat")]
    if r.sst is not None:
        out += [(f"{ref}.scale_shift_table", f"{dst}.sst", "none")]
    return out


def _time_keys(ref, dst):
    return (L.lin(f"{ref}.timestep_embedder.linear_1", f"{dst}.l1") + L.lin(f"{ref}.timestep_embedder.linear_2", f"{dst}.l2"))


def diffusers_keymap(cfg: LTXVAEConfig, encoder: bool = True) -> KeyMap:
    m = nn.abstract_module(lambda: _build(cfg, 0, "float32", encoder))
    k = []
    if encoder:
        e = m.encoder
        k += _conv_keys("encoder.conv_in", "encoder.conv_in") + _conv_keys("encoder.conv_out", "encoder.conv_out")
        for i, d in enumerate(e.down):
            for j, r in enumerate(d.resnets):
                k += _res_keys(f"encoder.down_blocks.{i}.resnets.{j}", f"encoder.down.{i}.resnets.{j}", r)
            if d.down is not None:
                ref = f"encoder.down_blocks.{i}.downsamplers.0"
                k += _conv_keys(ref if isinstance(d.down, CausalConv3d) else f"{ref}.conv", f"encoder.down.{i}.down"
                                if isinstance(d.down, CausalConv3d) else f"encoder.down.{i}.down.conv")
            if d.conv_out is not None:
                k += _res_keys(f"encoder.down_blocks.{i}.conv_out", f"encoder.down.{i}.conv_out", d.conv_out)
        for j, r in enumerate(e.mid.resnets):
            k += _res_keys(f"encoder.mid_block.resnets.{j}", f"encoder.mid.resnets.{j}", r)
    d = m.decoder
    k += _conv_keys("decoder.conv_in", "decoder.conv_in") + _conv_keys("decoder.conv_out", "decoder.conv_out")
    if d.mid.time is not None:
        k += _time_keys("decoder.mid_block.time_embedder", "decoder.mid.time")
    for j, r in enumerate(d.mid.resnets):
        k += _res_keys(f"decoder.mid_block.resnets.{j}", f"decoder.mid.resnets.{j}", r)
    for i, u in enumerate(d.up):
        ref, dst = f"decoder.up_blocks.{i}", f"decoder.up.{i}"
        if u.time is not None:
            k += _time_keys(f"{ref}.time_embedder", f"{dst}.time")
        if u.conv_in is not None:
            k += _res_keys(f"{ref}.conv_in", f"{dst}.conv_in", u.conv_in)
        if u.up is not None:
            k += _conv_keys(f"{ref}.upsamplers.0.conv", f"{dst}.up.conv")
        for j, r in enumerate(u.resnets):
            k += _res_keys(f"{ref}.resnets.{j}", f"{dst}.resnets.{j}", r)
    if d.time is not None:
        k += [("decoder.timestep_scale_multiplier", "decoder.tscale", "none"),
              ("decoder.scale_shift_table", "decoder.sst", "none")] + _time_keys("decoder.time_embedder", "decoder.time")
    return KeyMap([Rule(*r) for r in k], ignore=[r"^latents_(mean|std)$"] + ([] if encoder else [r"^encoder\."]))


def _param_shapes(cfg, dtype, encoder):
    return nn.shapes(lambda: _build(cfg, 0, dtype, encoder))


def load_vae(folder, cfg: LTXVAEConfig | None = None, dtype=np.float32, encoder: bool = True):
    """``(host state, cfg, stats)`` from a diffusers ``vae/`` folder; ``stats``: ``latents_mean`` and
    ``latents_std`` (float32). ``encoder=False`` reads only the decoder."""
    folder = Path(folder)
    if cfg is None:
        cfg = LTXVAEConfig.from_diffusers(compat.read_config(folder))
    ckpt = open_checkpoint(folder)
    stats = {k: np.asarray(ckpt[k].read() if hasattr(ckpt[k], "read") else ckpt[k], np.float32)
             for k in ("latents_mean", "latents_std") if k in ckpt}
    for k, v in (("latents_mean", 0.0), ("latents_std", 1.0)):
        stats.setdefault(k, np.full((cfg.latent_channels,), v, np.float32))
    pure = load_params(ckpt, diffusers_keymap(cfg, encoder), _param_shapes(cfg, dtype, encoder), dtype=dtype,
                       what=f"{'AutoencoderKLLTX2Video' if cfg.version == 2 else 'AutoencoderKLLTXVideo'}")
    state = nn.abstract_state(lambda: _build(cfg, 0, dtype, encoder))[1]
    # 3-tap kernels as tuples of their taps: a per-tap conv of a stored 5-D kernel copies the tap's
    # slice on every call (at the released widths up to 151 MB per tap, 71% of a decode's op time);
    # on CPU with their Winograd combinations, made once here (vconv.Taps)
    return vconv.split_taps(nn.fill(state, L.intkeys(pure)), combos=True), cfg, stats


# ----------------------------------------------------------------------------------- compat
class _Compat(compat.CompatModel):
    def __init__(self, name, config, state, cfg, stats):
        super().__init__(name, config, state, cfg)
        self.stats = stats

    def encode(self, x, causal=None):
        return np.asarray(encode(self.params, self.model_config, np.asarray(x, np.float32)))

    def decode(self, z, temb=None, causal=None, key=None):
        cfg = self.model_config
        if causal is not None and cfg.version == 2 and bool(causal) != cfg.decoder_causal:
            import dataclasses

            cfg = dataclasses.replace(cfg, decoder_causal=bool(causal))
        return np.asarray(decode(self.params, cfg, np.asarray(z, np.float32), temb, key))

    def tiled_decode(self, z, temb=None, tiling: Tiling = Tiling(), key=None):
        return tiled_decode(self.params, self.model_config, z, temb, tiling, key)


@compat.register("AutoencoderKLLTXVideo", "AutoencoderKLLTX2Video")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **_):
    state, cfg, stats = load_vae(folder, LTXVAEConfig.from_diffusers(config), dtype=dtype)
    return _Compat(config.get("_class_name"), config, jax.device_put(state), cfg, stats)
