"""LTX-2 audio: the audio VAE (diffusers ``AutoencoderKLLTX2Audio``) and the vocoders
(``LTX2Vocoder``; ``LTX2VocoderWithBWE``: a vocoder at 16 kHz, a causal mel STFT of its output and a
bandwidth-extension vocoder added to a resampled skip path, 48 kHz) as Flax NNX modules.

The audio latents are a small 2D image over (time, mel bins): [B, 8, L, 16] decode to a stereo
log-mel spectrogram [B, 2, 4L - 3, 64] (causal along time: convolutions pad only the past), which
the vocoder turns into a waveform [B, 2, samples]. Channels-last inside ([B, T, M, C] / [B, N, C]);
the public calls take and return the reference's layouts.
"""
from __future__ import annotations

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
_HI = jax.lax.Precision.HIGHEST
_zeros = nnx.initializers.zeros_init()
LATENT_DOWNSAMPLE = 4


def _kernel(rngs, shape, dtype):
    return nn.param(rngs, nnx.initializers.lecun_normal(), shape, *([None] * len(shape)), dtype=dtype)


# ----------------------------------------------------------------------------------- audio VAE
@dataclass(frozen=True)
class AudioVAEConfig:
    base_channels: int = 128
    output_channels: int = 2
    ch_mult: tuple = (1, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple | None = None
    in_channels: int = 2
    resolution: int = 256
    latent_channels: int = 8
    norm_type: str = "pixel"
    causality_axis: str | None = "height"
    mid_block_add_attention: bool = False
    sample_rate: int = 16000
    mel_hop_length: int = 160
    is_causal: bool = True
    mel_bins: int | None = 64
    double_z: bool = True

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "AudioVAEConfig":
        names = {f.name for f in fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if k in names}
        return cls(**kw)

    @property
    def latent_mel_bins(self) -> int:
        return (self.mel_bins or 64) // LATENT_DOWNSAMPLE


class Conv2d(nnx.Module):
    """``LTX2AudioCausalConv2d`` (padding per ``causality_axis``) or a plain ``nn.Conv2d`` with
    ``padding`` (``axis=None``). Channels-last [B, T, M, C]; kernel [kh, kw, Cin, Cout]."""

    def __init__(self, cin, cout, k, *, rngs, stride=1, axis="height", padding=None, param_dtype=F32):
        self.k, self.stride, self.axis, self.padding = k, stride, axis, padding
        self.kernel = _kernel(rngs, (k, k, cin, cout), param_dtype)
        self.bias = nn.param(rngs, _zeros, (cout,), None, dtype=param_dtype)

    def __call__(self, x):
        k = self.k
        if self.axis is None:
            p = self.padding if self.padding is not None else 0
            pads = ((p, p), (p, p))
        else:
            ph = pw = k - 1
            pads = {"none": ((ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2)),
                    "width": ((ph // 2, ph - ph // 2), (pw, 0)), "width-compatibility": ((ph // 2, ph - ph // 2), (pw, 0)),
                    "height": ((ph, 0), (pw // 2, pw - pw // 2))}[self.axis]
        # the padding goes into the conv (XLA:CPU's conv of an input padded beforehand, VALID, is
        # several times slower than the padded conv: vidax.core.conv.conv2d)
        if self.stride == 1:  # by Winograd along the rows where that costs less (vconv.rows_conv2d)
            y = vconv.rows_conv2d(x, self.kernel[...].astype(x.dtype), pads)
        else:
            y = vconv.conv2d(x, self.kernel[...].astype(x.dtype), (self.stride,) * 2, pads)
        return y + self.bias[...].astype(y.dtype)


class Norm2d(nnx.Module):
    """Pixel norm (RMS over channels, eps 1e-6) or GroupNorm(32, eps 1e-6) with affine."""

    def __init__(self, c, kind, *, rngs, param_dtype=F32):
        self.kind = kind
        if kind == "group":
            self.scale = nn.param(rngs, nnx.initializers.ones_init(), (c,), None, dtype=param_dtype)
            self.bias = nn.param(rngs, _zeros, (c,), None, dtype=param_dtype)

    def __call__(self, x):
        xf = x.astype(F32)
        if self.kind == "pixel":
            return (xf / jnp.sqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)
        b, h, w, c = xf.shape
        g = xf.reshape(b, h, w, 32, c // 32)
        m = g.mean(axis=(1, 2, 4), keepdims=True)
        v = jnp.square(g - m).mean(axis=(1, 2, 4), keepdims=True)
        y = ((g - m) * jax.lax.rsqrt(v + 1e-6)).reshape(b, h, w, c)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class AttnBlock(nnx.Module):
    def __init__(self, c, kind, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm = Norm2d(c, kind, **kw)
        self.q, self.k, self.v, self.o = (Conv2d(c, c, 1, axis=None, **kw) for _ in range(4))

    def __call__(self, x):
        h = self.norm(x)
        b, t, m, c = h.shape
        q, k, v = (f(h).reshape(b, t * m, c) for f in (self.q, self.k, self.v))
        a = jax.nn.softmax(jnp.einsum("bic,bjc->bij", q, k, precision=_HI) * (c ** -0.5), axis=-1)
        o = jnp.einsum("bij,bjc->bic", a, v, precision=_HI).reshape(b, t, m, c)
        return x + self.o(o)


class ResBlock2d(nnx.Module):
    def __init__(self, cin, cout, cfg: AudioVAEConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        ax = cfg.causality_axis
        pad = None if ax is not None else 1
        self.norm1 = Norm2d(cin, cfg.norm_type, **kw)
        self.conv1 = Conv2d(cin, cout, 3, axis=ax, padding=pad, **kw)
        self.norm2 = Norm2d(cout, cfg.norm_type, **kw)
        self.conv2 = Conv2d(cout, cout, 3, axis=ax, padding=pad, **kw)
        self.nin = Conv2d(cin, cout, 1, axis=ax, padding=None if ax is not None else 0, **kw) if cin != cout else None

    def __call__(self, x):
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        return (self.nin(x) if self.nin is not None else x) + h


class Upsample2d(nnx.Module):
    def __init__(self, c, cfg, *, rngs, param_dtype=F32):
        ax = cfg.causality_axis
        self.axis = ax
        self.conv = Conv2d(c, c, 3, axis=ax, padding=None if ax is not None else 1, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x):
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        x = self.conv(x)
        if self.axis == "height":
            x = x[:, 1:]
        elif self.axis == "width":
            x = x[:, :, 1:]
        return x


class Downsample2d(nnx.Module):
    def __init__(self, c, cfg, *, rngs, param_dtype=F32):
        self.axis = cfg.causality_axis or "none"
        self.conv = Conv2d(c, c, 3, stride=2, axis=None, padding=0, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x):
        # reference F.pad order (left, right, top, bottom) over (mel, time)
        l, r, t, b = {"none": (0, 1, 0, 1), "width": (2, 0, 0, 1), "height": (0, 1, 2, 0),
                      "width-compatibility": (1, 0, 0, 1)}[self.axis]
        return self.conv(jnp.pad(x, ((0, 0), (t, b), (l, r), (0, 0))))


class AudioDecoder(nnx.Module):
    def __init__(self, cfg: AudioVAEConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        ax = cfg.causality_axis
        pad = None if ax is not None else 1
        n = len(cfg.ch_mult)
        c = cfg.base_channels * cfg.ch_mult[-1]
        res = cfg.resolution // 2 ** (n - 1)
        self.conv_in = Conv2d(cfg.latent_channels, c, 3, axis=ax, padding=pad, **kw)
        self.mid1 = ResBlock2d(c, c, cfg, **kw)
        self.mid_attn = AttnBlock(c, cfg.norm_type, **kw) if cfg.mid_block_add_attention else None
        self.mid2 = ResBlock2d(c, c, cfg, **kw)
        ups = {}
        for level in reversed(range(n)):
            out = cfg.base_channels * cfg.ch_mult[level]
            blocks, attns = [], []
            for _ in range(cfg.num_res_blocks + 1):
                blocks.append(ResBlock2d(c, out, cfg, **kw))
                c = out
                if cfg.attn_resolutions and res in cfg.attn_resolutions:
                    attns.append(AttnBlock(c, cfg.norm_type, **kw))
            up = Upsample2d(c, cfg, **kw) if level != 0 else None
            if level != 0:
                res *= 2
            ups[level] = (nnx.List(blocks), nnx.List(attns), up)
        self.up_blocks = nnx.List([ups[i][0] for i in range(n)])
        self.up_attns = nnx.List([ups[i][1] for i in range(n)])
        self.upsamples = nnx.List([ups[i][2] for i in range(n) if ups[i][2] is not None])
        self.norm_out = Norm2d(c, cfg.norm_type, **kw)
        self.conv_out = Conv2d(c, cfg.output_channels, 3, axis=ax, padding=pad, **kw)

    def __call__(self, z):
        """z [B, L, M', C] -> mel [B, T, M, out] (channels-last)."""
        cfg = self.cfg
        frames, mel = z.shape[1], z.shape[2]
        target_t = frames * LATENT_DOWNSAMPLE
        if cfg.causality_axis is not None:
            target_t = max(target_t - (LATENT_DOWNSAMPLE - 1), 1)
        target_m = cfg.mel_bins if cfg.mel_bins is not None else mel
        h = self.mid2(self.mid_attn(self.mid1(self.conv_in(z))) if self.mid_attn is not None
                      else self.mid1(self.conv_in(z)))
        for level in reversed(range(len(cfg.ch_mult))):
            attns = self.up_attns[level]
            for j, blk in enumerate(self.up_blocks[level]):
                h = blk(h)
                if len(attns):
                    h = attns[j](h)
            if level != 0:
                h = self.upsamples[level - 1](h)
        h = self.conv_out(jax.nn.silu(self.norm_out(h)))
        h = h[:, :target_t, :target_m]
        pt, pm = target_t - h.shape[1], target_m - h.shape[2]
        if pt > 0 or pm > 0:
            h = jnp.pad(h, ((0, 0), (0, max(pt, 0)), (0, max(pm, 0)), (0, 0)))
        return h


class AudioEncoder(nnx.Module):
    def __init__(self, cfg: AudioVAEConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        ax = cfg.causality_axis
        pad = None if ax is not None else 1
        c = cfg.base_channels
        res = cfg.resolution
        self.conv_in = Conv2d(cfg.in_channels, c, 3, axis=ax, padding=pad, **kw)
        blocks, attns, downs = [], [], []
        for level in range(len(cfg.ch_mult)):
            out = cfg.base_channels * cfg.ch_mult[level]
            bl, at = [], []
            for _ in range(cfg.num_res_blocks):
                bl.append(ResBlock2d(c, out, cfg, **kw))
                c = out
                if cfg.attn_resolutions and res in cfg.attn_resolutions:
                    at.append(AttnBlock(c, cfg.norm_type, **kw))
            blocks.append(nnx.List(bl))
            attns.append(nnx.List(at))
            if level != len(cfg.ch_mult) - 1:
                downs.append(Downsample2d(c, cfg, **kw))
                res //= 2
        self.blocks, self.attns, self.downs = nnx.List(blocks), nnx.List(attns), nnx.List(downs)
        self.mid1 = ResBlock2d(c, c, cfg, **kw)
        self.mid_attn = AttnBlock(c, cfg.norm_type, **kw) if cfg.mid_block_add_attention else None
        self.mid2 = ResBlock2d(c, c, cfg, **kw)
        self.norm_out = Norm2d(c, cfg.norm_type, **kw)
        zc = 2 * cfg.latent_channels if cfg.double_z else cfg.latent_channels
        self.conv_out = Conv2d(c, zc, 3, axis=ax, padding=pad, **kw)

    def __call__(self, x):
        h = self.conv_in(x)
        for level in range(len(self.blocks)):
            for j, blk in enumerate(self.blocks[level]):
                h = blk(h)
                if len(self.attns[level]):
                    h = self.attns[level][j](h)
            if level < len(self.downs):
                h = self.downs[level](h)
        h = self.mid1(h)
        if self.mid_attn is not None:
            h = self.mid_attn(h)
        h = self.mid2(h)
        return self.conv_out(jax.nn.silu(self.norm_out(h)))


class AudioVAE(nnx.Module):
    def __init__(self, cfg: AudioVAEConfig, *, rngs, param_dtype=F32, encoder: bool = True):
        self.cfg = cfg
        self.encoder = AudioEncoder(cfg, rngs=rngs, param_dtype=param_dtype) if encoder else None
        self.decoder = AudioDecoder(cfg, rngs=rngs, param_dtype=param_dtype)

    def encode(self, x):
        h = self.encoder(x)
        return h[..., : self.cfg.latent_channels]

    def decode(self, z):
        return self.decoder(z)


def _conv_keys(ref, dst, causal=True):
    base = f"{ref}.conv" if causal else ref
    return [Rule(f"{base}.weight", f"{dst}.kernel", "conv2d"), Rule(f"{base}.bias", f"{dst}.bias")]


def _norm_keys(ref, dst, kind):
    return [Rule(f"{ref}.weight", f"{dst}.scale"), Rule(f"{ref}.bias", f"{dst}.bias")] if kind == "group" else []


def _res_keys(ref, dst, blk: ResBlock2d, cfg):
    c = cfg.causality_axis is not None
    k = (_norm_keys(f"{ref}.norm1", f"{dst}.norm1", cfg.norm_type) + _norm_keys(f"{ref}.norm2", f"{dst}.norm2", cfg.norm_type)
         + _conv_keys(f"{ref}.conv1", f"{dst}.conv1", c) + _conv_keys(f"{ref}.conv2", f"{dst}.conv2", c))
    if blk.nin is not None:
        k += _conv_keys(f"{ref}.nin_shortcut", f"{dst}.nin", c)
    return k


def _attn_keys(ref, dst, cfg):
    k = _norm_keys(f"{ref}.norm", f"{dst}.norm", cfg.norm_type)
    for a, b in (("q", "q"), ("k", "k"), ("v", "v"), ("proj_out", "o")):
        k += _conv_keys(f"{ref}.{a}", f"{dst}.{b}", False)
    return k


def audio_vae_keymap(cfg: AudioVAEConfig, encoder: bool = True) -> KeyMap:
    m = nn.abstract_module(lambda: AudioVAE(cfg, rngs=nnx.Rngs(0), encoder=encoder))
    c = cfg.causality_axis is not None
    d = m.decoder
    k = _conv_keys("decoder.conv_in", "decoder.conv_in", c) + _conv_keys("decoder.conv_out", "decoder.conv_out", c)
    k += _norm_keys("decoder.norm_out", "decoder.norm_out", cfg.norm_type)
    k += _res_keys("decoder.mid.block_1", "decoder.mid1", d.mid1, cfg) + _res_keys("decoder.mid.block_2", "decoder.mid2", d.mid2,
                                                                                   cfg)
    if d.mid_attn is not None:
        k += _attn_keys("decoder.mid.attn_1", "decoder.mid_attn", cfg)
    for level in range(len(cfg.ch_mult)):
        for j, blk in enumerate(d.up_blocks[level]):
            k += _res_keys(f"decoder.up.{level}.block.{j}", f"decoder.up_blocks.{level}.{j}", blk, cfg)
        for j in range(len(d.up_attns[level])):
            k += _attn_keys(f"decoder.up.{level}.attn.{j}", f"decoder.up_attns.{level}.{j}", cfg)
        if level != 0:
            k += _conv_keys(f"decoder.up.{level}.upsample.conv", f"decoder.upsamples.{level - 1}.conv", c)
    if encoder:
        e = m.encoder
        k += _conv_keys("encoder.conv_in", "encoder.conv_in", c) + _conv_keys("encoder.conv_out", "encoder.conv_out", c)
        k += _norm_keys("encoder.norm_out", "encoder.norm_out", cfg.norm_type)
        k += _res_keys("encoder.mid.block_1", "encoder.mid1", e.mid1, cfg) + _res_keys("encoder.mid.block_2", "encoder.mid2",
                                                                                       e.mid2, cfg)
        if e.mid_attn is not None:
            k += _attn_keys("encoder.mid.attn_1", "encoder.mid_attn", cfg)
        for level in range(len(cfg.ch_mult)):
            for j, blk in enumerate(e.blocks[level]):
                k += _res_keys(f"encoder.down.{level}.block.{j}", f"encoder.blocks.{level}.{j}", blk, cfg)
            for j in range(len(e.attns[level])):
                k += _attn_keys(f"encoder.down.{level}.attn.{j}", f"encoder.attns.{level}.{j}", cfg)
            if level < len(e.downs):
                k += _conv_keys(f"encoder.down.{level}.downsample.conv", f"encoder.downs.{level}.conv", False)
    return KeyMap(k, ignore=[r"^latents_(mean|std)$"] + ([] if encoder else [r"^encoder\."]))


# ----------------------------------------------------------------------------------- vocoder
@dataclass(frozen=True)
class VocoderConfig:
    in_channels: int = 128
    hidden_channels: int = 1024
    out_channels: int = 2
    upsample_kernel_sizes: tuple = (16, 15, 8, 4, 4)
    upsample_factors: tuple = (6, 5, 2, 2, 2)
    resnet_kernel_sizes: tuple = (3, 7, 11)
    resnet_dilations: tuple = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    act_fn: str = "leaky_relu"
    leaky_relu_negative_slope: float = 0.1
    antialias: bool = False
    antialias_ratio: int = 2
    antialias_kernel_size: int = 12
    final_act_fn: str | None = "tanh"
    final_bias: bool = True
    output_sampling_rate: int = 24000


@dataclass(frozen=True)
class BWEConfig:
    """``LTX2VocoderWithBWE``: ``vocoder`` then ``bwe`` (same architecture) on its mel spectrogram."""

    vocoder: VocoderConfig
    bwe: VocoderConfig
    filter_length: int = 512
    hop_length: int = 80
    window_length: int = 512
    num_mel_channels: int = 64
    input_sampling_rate: int = 16000
    output_sampling_rate: int = 48000


def vocoder_config(cfg: dict):
    """A ``LTX2Vocoder`` or ``LTX2VocoderWithBWE`` config dict -> VocoderConfig / BWEConfig."""
    names = {f.name for f in fields(VocoderConfig)}
    tup = lambda v: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v  # noqa: E731
    if cfg.get("_class_name") == "LTX2VocoderWithBWE" or "bwe_in_channels" in cfg:
        defaults = dict(hidden_channels=1536, upsample_kernel_sizes=(11, 4, 4, 4, 4, 4), upsample_factors=(5, 2, 2, 2, 2, 2),
                        act_fn="snakebeta", antialias=True, final_act_fn=None, final_bias=False)
        v = {**defaults, **{k: tup(x) for k, x in cfg.items() if k in names}}
        v["output_sampling_rate"] = cfg.get("input_sampling_rate", 16000)
        bdef = dict(in_channels=128, hidden_channels=512, out_channels=2, upsample_kernel_sizes=(12, 11, 4, 4, 4),
                    upsample_factors=(6, 5, 2, 2, 2), act_fn="snakebeta", antialias=True, final_act_fn=None,
                    final_bias=False)
        b = {**bdef, **{k[4:]: tup(x) for k, x in cfg.items() if k.startswith("bwe_") and k[4:] in names}}
        b["output_sampling_rate"] = cfg.get("output_sampling_rate", 48000)
        top = {k: cfg[k] for k in ("filter_length", "hop_length", "window_length", "num_mel_channels",
                                   "input_sampling_rate", "output_sampling_rate") if k in cfg}
        return BWEConfig(VocoderConfig(**v), VocoderConfig(**b), **top)
    return VocoderConfig(**{k: tup(x) for k, x in cfg.items() if k in names})


def kaiser_sinc(cutoff: float, half_width: float, k: int) -> np.ndarray:
    """``kaiser_sinc_filter1d`` (float32)."""
    delta = 4 * half_width
    half = k // 2
    amp = 2.285 * (half - 1) * math.pi * delta + 7.95
    beta = 0.1102 * (amp - 8.7) if amp > 50.0 else (0.5842 * (amp - 21) ** 0.4 + 0.07886 * (amp - 21.0) if amp >= 21.0 else 0.0)
    win = np.kaiser(k, beta).astype(np.float32)
    t = (np.arange(-half, half) + 0.5) if k % 2 == 0 else (np.arange(k) - half)
    t = (2 * cutoff * t).astype(np.float32)
    sinc = np.where(t == 0, 1.0, np.sin(math.pi * t) / math.pi / np.where(t == 0, 1.0, t)).astype(np.float32)
    f = (2 * cutoff * win * sinc).astype(np.float32)
    return (f / f.sum()).astype(np.float32)


def _conv1d(x, w, stride=1, dilation=1, pad=(0, 0), groups=1):
    """x [B, N, Cin]; w [K, Cin/groups, Cout]."""
    if stride == 1 and groups == 1:  # by Winograd where that costs less (vconv.conv1d)
        return vconv.conv1d(x, w, dilation, pad)
    return jax.lax.conv_general_dilated(x, w.astype(x.dtype), (stride,), [pad], rhs_dilation=(dilation,),
                                        dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=groups,
                                        precision=_HI)


def _conv_transpose1d(x, w, stride, pad, groups=1):
    """``ConvTranspose1d``: x [B, N, Cin]; w as torch [Cin, Cout/groups, K]."""
    cin, cog, k = w.shape
    if groups == 1:
        kern = jnp.flip(w, -1).transpose(2, 0, 1)  # [K, Cin, Cout]
    else:  # depthwise: [K, 1, C]
        kern = jnp.flip(w, -1).transpose(2, 1, 0)
    return jax.lax.conv_general_dilated(x, kern.astype(x.dtype), (1,), [(k - 1 - pad, k - 1 - pad)], lhs_dilation=(stride,),
                                        dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=groups,
                                        precision=_HI)


class Conv1d(nnx.Module):
    def __init__(self, cin, cout, k, *, rngs, dilation=1, padding="same", bias=True, param_dtype=F32):
        self.k, self.dilation, self.padding = k, dilation, padding
        self.kernel = _kernel(rngs, (k, cin, cout), param_dtype)
        self.bias = nn.param(rngs, _zeros, (cout,), None, dtype=param_dtype) if bias else None

    def __call__(self, x):
        if self.padding == "same":
            tot = self.dilation * (self.k - 1)
            pad = (tot // 2, tot - tot // 2)
        else:
            pad = (self.padding, self.padding)
        y = _conv1d(x, self.kernel[...], dilation=self.dilation, pad=pad)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


class SnakeBeta(nnx.Module):
    def __init__(self, c, *, rngs, use_beta=True, param_dtype=F32):
        self.alpha = nn.param(rngs, _zeros, (c,), None, dtype=param_dtype)
        self.beta = nn.param(rngs, _zeros, (c,), None, dtype=param_dtype) if use_beta else None

    def __call__(self, x):
        a = jnp.exp(self.alpha[...].astype(F32))
        amp = jnp.exp(self.beta[...].astype(F32)) if self.beta is not None else a
        return x + (1.0 / (amp + 1e-9)) * jnp.square(jnp.sin(x * a))


class Filter(nnx.Module):
    """A stored low-pass filter buffer (``...filter`` in the checkpoint)."""

    def __init__(self, k, *, rngs, param_dtype=F32):
        self.filter = nn.param(rngs, _zeros, (k,), None, dtype=param_dtype)


def _replicate(x, l, r):
    return jnp.pad(x, ((0, 0), (l, r), (0, 0)), mode="edge")


class AntiAlias(nnx.Module):
    """``AntiAliasAct1d``: kaiser-sinc upsample x ratio, activation, kaiser-sinc downsample."""

    def __init__(self, act, ratio, k, *, rngs, param_dtype=F32):
        self.act, self.ratio, self.k = act, ratio, k
        self.up = Filter(k, rngs=rngs, param_dtype=param_dtype)
        self.down = Filter(k, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x):
        r, k = self.ratio, self.k
        c = x.shape[-1]
        pad = k // r - 1
        pl, pr = pad * r + (k - r) // 2, pad * r + (k - r + 1) // 2
        f = self.up.filter[...].astype(F32)
        y = r * _conv_transpose1d(_replicate(x, pad, pad), jnp.broadcast_to(f, (c, 1, k)), r, 0, groups=c)
        y = y[:, pl: y.shape[1] - pr]
        y = self.act(y)
        dl, dr = k // 2 + k % 2 - 1, k // 2
        fd = self.down.filter[...].astype(F32)
        return _conv1d(_replicate(y, dl, dr), jnp.broadcast_to(fd[:, None, None], (k, 1, c)), stride=r, groups=c)


def _leaky(slope):
    return lambda x: jnp.where(x >= 0, x, slope * x)


class VResBlock(nnx.Module):
    def __init__(self, c, k, dilations, cfg: VocoderConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.convs1 = nnx.List([Conv1d(c, c, k, dilation=d, **kw) for d in dilations])
        self.convs2 = nnx.List([Conv1d(c, c, k, dilation=1, **kw) for _ in dilations])
        snake = cfg.act_fn in ("snakebeta", "snake")

        def act():
            if not snake:
                return None
            a = SnakeBeta(c, use_beta=cfg.act_fn == "snakebeta", **kw)
            return AntiAlias(a, cfg.antialias_ratio, cfg.antialias_kernel_size, **kw) if cfg.antialias else a

        self.acts1 = nnx.List([act() for _ in dilations]) if snake else None
        self.acts2 = nnx.List([act() for _ in dilations]) if snake else None
        self.slope = cfg.leaky_relu_negative_slope
        self.leaky_aa = (AntiAlias(_leaky(self.slope), cfg.antialias_ratio, cfg.antialias_kernel_size, **kw)
                         if (not snake and cfg.antialias) else None)

    def __call__(self, x):
        for i, (c1, c2) in enumerate(zip(self.convs1, self.convs2)):
            if self.acts1 is not None:
                a1, a2 = self.acts1[i], self.acts2[i]
            else:  # the reference's leaky-ReLU branch: one activation module shared (acts2 = acts1[-1])
                a1 = a2 = self.leaky_aa if self.leaky_aa is not None else _leaky(self.slope)
            xt = c2(a2(c1(a1(x))))
            x = x + xt
        return x


class Vocoder(nnx.Module):
    """``LTX2Vocoder``: mel [B, T, 2*M] (channels c*M + m) -> waveform [B, N, 2] (channels-last)."""

    def __init__(self, cfg: VocoderConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        self.conv_in = Conv1d(cfg.in_channels, cfg.hidden_channels, 7, padding=3, **kw)
        ups, res = [], []
        c = cfg.hidden_channels
        for s, k in zip(cfg.upsample_factors, cfg.upsample_kernel_sizes):
            o = c // 2
            ups.append(nn.param(rngs, nnx.initializers.lecun_normal(), (c, o, k), None, None, None, dtype=param_dtype))
            for rk, dil in zip(cfg.resnet_kernel_sizes, cfg.resnet_dilations):
                res.append(VResBlock(o, rk, tuple(dil), cfg, **kw))
            c = o
        self.ups = nnx.List([_UpConv(w, b) for w, b in zip(ups, [nn.param(rngs, _zeros, (w.shape[1],), None, dtype=param_dtype)
                                                                 for w in ups])])
        self.resnets = nnx.List(res)
        if cfg.act_fn in ("snakebeta", "snake"):
            self.act_out = AntiAlias(SnakeBeta(c, use_beta=True, **kw), cfg.antialias_ratio, cfg.antialias_kernel_size, **kw)
        else:
            self.act_out = None
        self.conv_out = Conv1d(c, cfg.out_channels, 7, padding=3, bias=cfg.final_bias, **kw)

    def __call__(self, x):
        cfg = self.cfg
        n = len(cfg.resnet_kernel_sizes)
        h = self.conv_in(x)
        for i, (s, k) in enumerate(zip(cfg.upsample_factors, cfg.upsample_kernel_sizes)):
            if cfg.act_fn == "leaky_relu":
                h = _leaky(cfg.leaky_relu_negative_slope)(h)
            h = self.ups[i](h, s, (k - s) // 2)
            h = sum(self.resnets[i * n + j](h) for j in range(n)) / n
        h = self.act_out(h) if self.act_out is not None else _leaky(0.01)(h)
        h = self.conv_out(h)
        if cfg.final_act_fn == "tanh":
            h = jnp.tanh(h)
        elif cfg.final_act_fn == "clamp":
            h = jnp.clip(h, -1, 1)
        return h


class _UpConv(nnx.Module):
    def __init__(self, w, b):
        self.kernel, self.bias = w, b

    def __call__(self, x, stride, pad):
        return _conv_transpose1d(x, self.kernel[...], stride, pad) + self.bias[...].astype(x.dtype)


def _hann_upsample_filter(ratio: int):
    rolloff, width_ = 0.99, 6
    width = math.ceil(width_ / rolloff)
    k = 2 * width * ratio + 1
    t = (np.arange(k, dtype=np.float32) / np.float32(ratio) - np.float32(width)) * np.float32(rolloff)
    tc = np.clip(t, -width_, width_)
    win = np.cos(tc * np.float32(math.pi) / np.float32(width_) / np.float32(2)) ** 2
    f = (np.sinc(t) * win * np.float32(rolloff) / np.float32(ratio)).astype(np.float32)
    return f, width, k


class VocoderBWE(nnx.Module):
    def __init__(self, cfg: BWEConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        self.vocoder = Vocoder(cfg.vocoder, **kw)
        self.bwe = Vocoder(cfg.bwe, **kw)
        nf = cfg.filter_length // 2 + 1
        self.forward_basis = nn.param(rngs, _zeros, (2 * nf, cfg.filter_length), None, None, dtype=param_dtype)
        self.mel_basis = nn.param(rngs, _zeros, (cfg.num_mel_channels, nf), None, None, dtype=param_dtype)

    def __call__(self, mel):
        cfg = self.cfg
        x = self.vocoder(mel)  # [B, N, C]
        b, n, c = x.shape
        rem = n % cfg.hop_length
        if rem:
            x = jnp.pad(x, ((0, 0), (0, cfg.hop_length - rem), (0, 0)))
        w = x.transpose(0, 2, 1).reshape(b * c, -1, 1)
        w = jnp.pad(w, ((0, 0), (max(0, cfg.window_length - cfg.hop_length), 0), (0, 0)))
        basis = self.forward_basis[...].astype(F32).T[:, None, :]  # [K, 1, 2F]
        spec = _conv1d(w, basis, stride=cfg.hop_length)  # [B*C, frames, 2F]
        nf = spec.shape[-1] // 2
        mag = jnp.sqrt(jnp.square(spec[..., :nf]) + jnp.square(spec[..., nf:]))
        mel2 = jnp.log(jnp.maximum(jnp.einsum("mf,btf->btm", self.mel_basis[...].astype(F32), mag, precision=_HI), 1e-5))
        mel2 = mel2.reshape(b, c, -1, mel2.shape[-1]).transpose(0, 2, 1, 3).reshape(b, -1, c * mel2.shape[-1])
        residual = self.bwe(mel2)
        ratio = cfg.output_sampling_rate // cfg.input_sampling_rate
        f, width, k = _hann_upsample_filter(ratio)
        pl, pr = 2 * width * ratio, k - ratio
        y = ratio * _conv_transpose1d(_replicate(x, width, width), jnp.broadcast_to(jnp.asarray(f), (c, 1, k)), ratio, 0,
                                      groups=c)
        skip = y[:, pl: y.shape[1] - pr]
        out = jnp.clip(residual + skip, -1, 1)
        return out[:, : n * cfg.output_sampling_rate // cfg.input_sampling_rate]


def _vocoder_keys(prefix: str, dst: str, m: Vocoder) -> list:
    cfg = m.cfg
    k = [Rule(f"{prefix}conv_in.weight", f"{dst}conv_in.kernel", "conv1d"), Rule(f"{prefix}conv_in.bias", f"{dst}conv_in.bias"),
         Rule(f"{prefix}conv_out.weight", f"{dst}conv_out.kernel", "conv1d")]
    if cfg.final_bias:
        k.append(Rule(f"{prefix}conv_out.bias", f"{dst}conv_out.bias"))
    for i in range(len(cfg.upsample_factors)):
        k += [Rule(f"{prefix}upsamplers.{i}.weight", f"{dst}ups.{i}.kernel"), Rule(f"{prefix}upsamplers.{i}.bias",
                                                                                   f"{dst}ups.{i}.bias")]

    def act(ref, d, a):
        if isinstance(a, AntiAlias):
            return ([Rule(f"{ref}.upsample.filter", f"{d}.up.filter"), Rule(f"{ref}.downsample.filter", f"{d}.down.filter")]
                    + act(f"{ref}.act", f"{d}.act", a.act))
        if isinstance(a, SnakeBeta):
            return [Rule(f"{ref}.alpha", f"{d}.alpha")] + ([Rule(f"{ref}.beta", f"{d}.beta")] if a.beta is not None else [])
        return []

    for j, r in enumerate(m.resnets):
        for n in range(len(r.convs1)):
            for which in ("convs1", "convs2"):
                k += [Rule(f"{prefix}resnets.{j}.{which}.{n}.weight", f"{dst}resnets.{j}.{which}.{n}.kernel", "conv1d"),
                      Rule(f"{prefix}resnets.{j}.{which}.{n}.bias", f"{dst}resnets.{j}.{which}.{n}.bias")]
            if r.acts1 is not None:
                k += act(f"{prefix}resnets.{j}.acts1.{n}", f"{dst}resnets.{j}.acts1.{n}", r.acts1[n])
                k += act(f"{prefix}resnets.{j}.acts2.{n}", f"{dst}resnets.{j}.acts2.{n}", r.acts2[n])
        if r.leaky_aa is not None:
            k += act(f"{prefix}resnets.{j}.acts1.{len(r.convs1) - 1}", f"{dst}resnets.{j}.leaky_aa", r.leaky_aa)
    if m.act_out is not None:
        k += act(f"{prefix}act_out", f"{dst}act_out", m.act_out)
    return k


def vocoder_keymap(cfg, model) -> KeyMap:
    if isinstance(cfg, BWEConfig):
        k = (_vocoder_keys("vocoder.", "vocoder.", model.vocoder) + _vocoder_keys("bwe_generator.", "bwe.", model.bwe)
             + [Rule("mel_stft.stft_fn.forward_basis", "forward_basis"), Rule("mel_stft.mel_basis", "mel_basis")])
        return KeyMap(k, ignore=[r"^mel_stft\.stft_fn\.inverse_basis$", r"^resampler\.filter$",
                                 r"resnets\.\d+\.acts[12]\.\d+\.act\.act\."])
    return KeyMap(_vocoder_keys("", "", model), ignore=[r"resnets\.\d+\.acts[12]\."])


# ----------------------------------------------------------------------------------- states and calls
def _build_vae(cfg, dtype=np.float32, encoder=True):
    return AudioVAE(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(dtype), encoder=encoder)


def _build_vocoder(cfg, dtype=np.float32):
    cls = VocoderBWE if isinstance(cfg, BWEConfig) else Vocoder
    return cls(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(dtype))


def init_vae(cfg: AudioVAEConfig, seed: int = 0, encoder: bool = True) -> nn.Split:
    g, st = L.seeded_split(lambda: _build_vae(cfg, encoder=encoder), seed)
    return nn.Split(g, jax.device_put(st), cfg)


def init_vocoder(cfg, seed: int = 0) -> nn.Split:
    sp = {"filter": lambda s, r: kaiser_sinc(0.25, 0.3, s[0]),
          "alpha": lambda s, r: 0.05 * r.standard_normal(s), "beta": lambda s, r: 0.05 * r.standard_normal(s)}
    g, st = L.seeded_split(lambda: _build_vocoder(cfg), seed, sp)
    return nn.Split(g, jax.device_put(st), cfg)


def load_vae(folder, cfg: AudioVAEConfig | None = None, encoder: bool = False):
    """(split module, cfg, stats) from a diffusers ``audio_vae/`` folder (``encoder=False``: the
    decoder only); ``stats``: ``latents_mean`` / ``latents_std`` (over the packed C*M channels)."""
    folder = Path(folder)
    cfg = cfg or AudioVAEConfig.from_diffusers(compat.read_config(folder))
    ckpt = open_checkpoint(folder)
    stats = {k: np.asarray(ckpt[k].read() if hasattr(ckpt[k], "read") else ckpt[k], np.float32)
             for k in ("latents_mean", "latents_std") if k in ckpt}
    stats.setdefault("latents_mean", np.zeros(cfg.base_channels, np.float32))
    stats.setdefault("latents_std", np.ones(cfg.base_channels, np.float32))
    pure = load_params(ckpt, audio_vae_keymap(cfg, encoder), nn.shapes(lambda: _build_vae(cfg, encoder=encoder)),
                       dtype=np.float32, what="AutoencoderKLLTX2Audio")
    g, st = nn.abstract_state(lambda: _build_vae(cfg, encoder=encoder))
    return nn.Split(g, jax.device_put(nn.fill(st, L.intkeys(pure))), cfg), cfg, stats


def load_vocoder(folder) -> nn.Split:
    folder = Path(folder)
    raw = compat.read_config(folder)
    cfg = vocoder_config(raw)
    model = nn.abstract_module(lambda: _build_vocoder(cfg))
    ck = open_checkpoint(folder)
    ckpt = {}
    for k in ck:  # buffers stored [1, 1, K] / [2F, 1, K]: read flat (small)
        if k.endswith(".filter") or k == "mel_stft.stft_fn.forward_basis":
            a = ck[k].read() if hasattr(ck[k], "read") else np.asarray(ck[k])
            ckpt[k] = a.reshape(-1) if k.endswith(".filter") else a.reshape(a.shape[0], a.shape[-1])
        else:
            ckpt[k] = ck[k]
    km = vocoder_keymap(cfg, model)
    pure = load_params(ckpt, km, nn.shapes(lambda: _build_vocoder(cfg)), dtype=np.float32,
                       what=type(model).__name__)
    g, st = nn.abstract_state(lambda: _build_vocoder(cfg))
    return nn.Split(g, jax.device_put(nn.fill(st, L.intkeys(pure))), cfg)


def sample_rate(vcfg) -> int:
    return vcfg.output_sampling_rate


def decode_mel(vae: nn.Split, z) -> np.ndarray:
    """Audio latents [B, C, L, M'] (denormalised) -> mel [B, 2, T, M]."""
    x = jnp.asarray(np.asarray(z, np.float32)).transpose(0, 2, 3, 1)
    return np.asarray(vae.apply("decode", x)).transpose(0, 3, 1, 2)


def encode_mel(vae: nn.Split, mel) -> np.ndarray:
    x = jnp.asarray(np.asarray(mel, np.float32)).transpose(0, 2, 3, 1)
    return np.asarray(vae.apply("encode", x)).transpose(0, 3, 1, 2)


def vocode(voc: nn.Split, mel) -> np.ndarray:
    """mel [B, C, T, M] -> waveform [B, out, samples] (the reference's ``vocoder(mel)``)."""
    m = np.asarray(mel, np.float32)
    b, c, t, mm = m.shape
    x = m.transpose(0, 2, 1, 3).reshape(b, t, c * mm)  # channels (c, mel) as transpose(2, 3).flatten(1, 2)
    return np.asarray(voc(jnp.asarray(x))).transpose(0, 2, 1)


# ----------------------------------------------------------------------------------- compat
class _VAECompat(compat.CompatModel):
    def __init__(self, config, split, stats):
        super().__init__("AutoencoderKLLTX2Audio", config, split.state, split.cfg)
        self.split, self.stats = split, stats

    def encode(self, x):
        return encode_mel(self.split, x)

    def decode(self, z):
        return decode_mel(self.split, z)


class _VocoderCompat(compat.CompatModel):
    def __init__(self, config, split, name):
        super().__init__(name, config, split.state, split.cfg)
        self.split = split

    def forward(self, hidden_states=None, mel_spec=None, **_):
        return vocode(self.split, hidden_states if hidden_states is not None else mel_spec)


@compat.register("AutoencoderKLLTX2Audio")
def _load_vae_compat(config: dict, folder: Path, **_):
    split, cfg, stats = load_vae(folder, AudioVAEConfig.from_diffusers(config), encoder=True)
    return _VAECompat(config, split, stats)


@compat.register("LTX2Vocoder", "LTX2VocoderWithBWE")
def _load_vocoder_compat(config: dict, folder: Path, **_):
    return _VocoderCompat(config, load_vocoder(folder), config.get("_class_name"))
