"""HunyuanVideo 1.5 causal 3D VAE (diffusers ``AutoencoderKLHunyuanVideo15``) as Flax NNX modules: staged,
temporally chunked and spatially tiled decode (design notes: this family's README.md, "VAE")."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax import compat
from vidax.core import conv as vconv
from vidax.core import nn
from vidax.models.hunyuanvideo import vae as h10
from vidax.models.hunyuanvideo.vae import CausalConv3d, Conv3d
from vidax.core.tiles import blend_grid, spatial_tiled
from vidax.weights import KeyMap, Rule, int_keys, load_params, open_checkpoint, str_keys, view_of

F32 = jnp.float32


@dataclass(frozen=True)
class HunyuanVideo15VAEConfig:
    """Mirrors diffusers' ``AutoencoderKLHunyuanVideo15`` config (defaults = the release)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 32
    block_out_channels: tuple = (128, 256, 512, 1024, 1024)
    layers_per_block: int = 2
    spatial_compression_ratio: int = 16
    temporal_compression_ratio: int = 4
    downsample_match_channel: bool = True
    upsample_match_channel: bool = True
    scaling_factor: float = 1.03682

    def __post_init__(self):
        object.__setattr__(self, "block_out_channels", tuple(int(c) for c in self.block_out_channels))

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "HunyuanVideo15VAEConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if k in names})

    def down_levels(self) -> list[tuple[int, int | None, bool]]:
        """Per encoder level: ``(out channels, downsample out channels or None, temporal)``."""
        ch, out = self.block_out_channels, []
        ls = math.log2(self.spatial_compression_ratio)
        lt = math.log2(self.spatial_compression_ratio // self.temporal_compression_ratio)
        for i, c in enumerate(ch):
            if i < ls:
                out.append((c, ch[i + 1] if self.downsample_match_channel else c, i >= lt))
            else:
                out.append((c, None, False))
        return out

    def up_levels(self) -> list[tuple[int, int | None, bool]]:
        """Per decoder level: ``(out channels, upsample out channels or None, temporal)``."""
        ch, out = self.block_out_channels[::-1], []
        ls, lt = math.log2(self.spatial_compression_ratio), math.log2(self.temporal_compression_ratio)
        for i, c in enumerate(ch):
            if i < ls or i < lt:
                out.append((c, ch[i + 1] if self.upsample_match_channel else c, i < lt))
            else:
                out.append((c, None, False))
        return out


@dataclass(frozen=True)
class Tiling:
    """The reference's ``enable_tiling`` settings (square tiles). ``spatial``: diffusers'
    ``use_tiling`` (off there by default; the pipelines' examples turn it on)."""

    spatial: bool = False
    sample: int = 256  # tile_sample_min_height / width
    latent: int | None = None  # tile_latent_min_height / width (default sample // 16)
    overlap: float = 0.25  # tile_overlap_factor

    def latent_tile(self, s: int) -> int:
        return self.latent if self.latent is not None else self.sample // s


PRESETS = {
    "tiny": HunyuanVideo15VAEConfig(latent_channels=4, block_out_channels=(8, 16, 16), layers_per_block=1,
                                    spatial_compression_ratio=4),
    "release": HunyuanVideo15VAEConfig(),
}


# ----------------------------------------------------------------------------------- modules
def _p(rngs, init, shape, dtype):
    return nn.param(rngs, init, shape, *([None] * len(shape)), dtype=dtype)


class RMSNorm(nnx.Module):
    """``HunyuanVideo15RMS_norm``: ``x / max(|x|, 1e-12) * sqrt(C) * gamma`` over the channels
    (float32 statistics)."""

    def __init__(self, c: int, *, rngs: nnx.Rngs, param_dtype=F32):
        self.gamma = _p(rngs, nnx.initializers.ones_init(), (c,), param_dtype)

    def __call__(self, x):
        xf = x.astype(F32)
        n = jnp.sqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True))
        y = xf / jnp.maximum(n, 1e-12) * math.sqrt(x.shape[-1]) * self.gamma[...].astype(F32)
        return y.astype(x.dtype)


class Whole:
    """The causal state of a call over a whole sequence: every causal conv replicate-pads its first
    frame (``CausalConv3d``), the attention is frame-causal over the call's frames."""

    first = True

    def conv(self, m: CausalConv3d, x):
        return m(x)

    def attention(self, q, k, v, hw: int):
        return h10.frame_causal_attention(q, k, v, hw)


WHOLE = Whole()


class Chunk(Whole):
    """The causal state of one temporal chunk of a decode. ``prev``: the state the previous chunk
    left (None: the video's first chunk, which pads as :class:`Whole` does); ``offset``: the latent
    frame the chunk starts at (traced: every later chunk runs one program); ``kv_frames``: the
    frames the attention's key/value buffer holds (the whole padded sequence). Each causal conv
    reads the last ``kt - 1`` frames of its (padded) input from ``prev`` and leaves its own; the
    mid-block attention keeps every earlier frame's keys and values. ``new`` collects the state in
    call order (the order ``prev`` is read)."""

    def __init__(self, prev, offset, kv_frames: int):
        self.prev, self.offset, self.kv_frames = prev, offset, kv_frames
        self.first = prev is None
        self.i, self.new = 0, []

    def _take(self):
        self.i += 1
        return self.prev[self.i - 1]

    def conv(self, m: CausalConv3d, x):
        kt, kh, kw = m.conv.k
        if m.conv.stride == (1, 1, 1) and kt > 1:
            # the padded input is never built (vconv.causal_conv3d; the same cache)
            prev = None if self.first else self._take()
            self.new.append(vconv.causal_tail(x, prev, kt))
            return vconv.causal_conv3d(x, vconv.kernel_value(m.conv.kernel), m.conv.bias[...], prev,
                                       ((kh // 2, kh // 2), (kw // 2, kw // 2)), mode="edge")
        if self.first:
            xt = jnp.pad(x, ((0, 0), (kt - 1, 0), (0, 0), (0, 0), (0, 0)), mode="edge")
        else:
            xt = jnp.concatenate([self._take().astype(x.dtype), x], axis=1)
        self.new.append(xt[:, xt.shape[1] - (kt - 1):])
        return m.conv(jnp.pad(xt, ((0, 0), (0, 0), (kh // 2, kh // 2), (kw // 2, kw // 2), (0, 0)), mode="edge"))

    def attention(self, q, k, v, hw: int):
        n = k.shape[1]
        if self.first:
            o = h10.frame_causal_attention(q, k, v, hw)
            pad = ((0, 0), (0, self.kv_frames * hw - n), (0, 0))
            kb, vb = jnp.pad(k, pad), jnp.pad(v, pad)
        else:
            kb = jax.lax.dynamic_update_slice_in_dim(self._take(), k, self.offset * hw, axis=1)
            vb = jax.lax.dynamic_update_slice_in_dim(self._take(), v, self.offset * hw, axis=1)
            o = cached_attention(q, kb, vb, hw, self.offset)
        self.new += [kb, vb]
        return o


def cached_attention(q, k, v, hw: int, offset, q_block: int = 512):
    """Frame-causal attention of a chunk's queries (frames ``offset + i // hw``) over a key/value
    buffer of the whole sequence (frame ``j // hw``; frames not decoded yet are masked, as are
    later ones): the rows of :func:`~vidax.models.hunyuanvideo.vae.frame_causal_attention` of the
    whole sequence that belong to the chunk. Query blocks under ``lax.scan``."""
    b, n, c = q.shape
    scale = c ** -0.5
    nb = -(-n // q_block)
    qp = jnp.pad(q, ((0, 0), (0, nb * q_block - n), (0, 0)))
    kf = jnp.arange(k.shape[1], dtype=jnp.int32) // hw

    def body(_, i):
        qb = jax.lax.dynamic_slice_in_dim(qp, i * q_block, q_block, axis=1)
        s = jnp.einsum("bqc,bkc->bqk", qb, k, precision=jax.lax.Precision.HIGHEST).astype(F32) * scale
        qf = offset + (i * q_block + jnp.arange(q_block, dtype=jnp.int32)) // hw
        s = jnp.where(kf[None, None, :] <= qf[None, :, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return None, jnp.einsum("bqk,bkc->bqc", p.astype(v.dtype), v, precision=jax.lax.Precision.HIGHEST)

    _, out = jax.lax.scan(body, None, jnp.arange(nb, dtype=jnp.int32))
    return out.transpose(1, 0, 2, 3).reshape(b, nb * q_block, c)[:, :n]


class Resnet(nnx.Module):
    def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm1, self.conv1 = RMSNorm(cin, **kw), CausalConv3d(cin, cout, 3, **kw)
        self.norm2, self.conv2 = RMSNorm(cout, **kw), CausalConv3d(cout, cout, 3, **kw)
        self.conv_shortcut = Conv3d(cin, cout, 1, **kw) if cin != cout else None

    def __call__(self, x, io: Whole = WHOLE):
        h = io.conv(self.conv1, vconv.silu(self.norm1(x)))
        h = io.conv(self.conv2, vconv.silu(self.norm2(h)))
        return h + (self.conv_shortcut(x) if self.conv_shortcut is not None else x)


class Attention(nnx.Module):
    """The mid block's single-head frame-causal attention over every token (1x1x1 conv q/k/v/out)."""

    def __init__(self, c: int, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm = RMSNorm(c, **kw)
        self.to_q, self.to_k, self.to_v, self.proj_out = (Conv3d(c, c, 1, **kw) for _ in range(4))

    def __call__(self, x, io: Whole = WHOLE):
        b, t, h, w, c = x.shape
        n = self.norm(x)
        flat = lambda a: a.reshape(b, t * h * w, c)  # noqa: E731
        o = io.attention(flat(self.to_q(n)), flat(self.to_k(n)), flat(self.to_v(n)), h * w)
        return x + self.proj_out(o.reshape(x.shape))


class MidBlock(nnx.Module):
    def __init__(self, c: int, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.resnets = nnx.List([Resnet(c, c, **kw) for _ in range(2)])
        self.attentions = nnx.List([Attention(c, **kw)])

    def __call__(self, x, io: Whole = WHOLE):
        return self.resnets[1](self.attentions[0](self.resnets[0](x, io), io), io)


def to_space(x, r1: int, r2: int = 2, r3: int = 2):
    """``_dcae_upsample_rearrange`` channels-last: [B, F, H, W, (r1 r2 r3 c)] -> [B, F r1, H r2, W r3, c]."""
    b, f, h, w, pc = x.shape
    c = pc // (r1 * r2 * r3)
    x = x.reshape(b, f, h, w, r1, r2, r3, c).transpose(0, 1, 4, 2, 5, 3, 6, 7)
    return x.reshape(b, f * r1, h * r2, w * r3, c)


def to_channels(x, r1: int, r2: int = 2, r3: int = 2):
    """``_dcae_downsample_rearrange`` channels-last: [B, F r1, H r2, W r3, c] -> [B, F, H, W, (r1 r2 r3 c)]."""
    b, pf, ph, pw, c = x.shape
    f, h, w = pf // r1, ph // r2, pw // r3
    x = x.reshape(b, f, r1, h, r2, w, r3, c).transpose(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(b, f, h, w, r1 * r2 * r3 * c)


def _group_mean(x, groups: int):
    """Channel ``i * groups + j`` averaged over ``j`` (the reference's ``view(B, C, g, ...).mean(2)``)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // groups, groups).mean(axis=-1)


class Upsample(nnx.Module):
    def __init__(self, cin: int, cout: int, temporal: bool, *, rngs: nnx.Rngs, param_dtype=F32):
        factor = 8 if temporal else 4
        self.temporal = temporal
        self.conv = CausalConv3d(cin, cout * factor, 3, rngs=rngs, param_dtype=param_dtype)
        self.repeats = factor * cout // cin

    def __call__(self, x, io: Whole = WHOLE):
        h = io.conv(self.conv, x)
        if not self.temporal:
            return to_space(h, 1) + to_space(jnp.repeat(x, self.repeats, axis=-1), 1)
        if not io.first:  # a later chunk: no frame of it is the video's first
            return to_space(h, 2) + jnp.repeat(to_space(x, 2), self.repeats, axis=-1)
        hf = to_space(h[:, :1], 1)
        hf = hf[..., : hf.shape[-1] // 2]
        h = jnp.concatenate([hf, to_space(h[:, 1:], 2)], axis=1)
        xf = jnp.repeat(to_space(x[:, :1], 1), self.repeats // 2, axis=-1)
        xn = jnp.repeat(to_space(x[:, 1:], 2), self.repeats, axis=-1)
        return h + jnp.concatenate([xf, xn], axis=1)


class Downsample(nnx.Module):
    def __init__(self, cin: int, cout: int, temporal: bool, *, rngs: nnx.Rngs, param_dtype=F32):
        factor = 8 if temporal else 4
        self.temporal = temporal
        self.conv = CausalConv3d(cin, cout // factor, 3, rngs=rngs, param_dtype=param_dtype)
        self.group = factor * cin // cout

    def __call__(self, x):
        h = self.conv(x)
        if not self.temporal:
            return to_channels(h, 1) + _group_mean(to_channels(x, 1), self.group)
        hf = to_channels(h[:, :1], 1)
        h = jnp.concatenate([jnp.concatenate([hf, hf], axis=-1), to_channels(h[:, 1:], 2)], axis=1)
        xf = _group_mean(to_channels(x[:, :1], 1), self.group // 2)
        xn = _group_mean(to_channels(x[:, 1:], 2), self.group)
        return h + jnp.concatenate([xf, xn], axis=1)


class Block(nnx.Module):
    """``HunyuanVideo15DownBlock3D`` / ``...UpBlock3D``: resnets, then the resampler."""

    def __init__(self, cin: int, cout: int, n: int, down=None, up=None, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.resnets = nnx.List([Resnet(cin if i == 0 else cout, cout, **kw) for i in range(n)])
        self.downsamplers = nnx.List([Downsample(cout, down[0], down[1], **kw)]) if down is not None else None
        self.upsamplers = nnx.List([Upsample(cout, up[0], up[1], **kw)]) if up is not None else None

    def __call__(self, x, io: Whole = WHOLE):
        for r in self.resnets:
            x = r(x, io)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, io)
        return x


class Encoder(nnx.Module):
    def __init__(self, cfg: HunyuanVideo15VAEConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        ch = cfg.block_out_channels
        self.conv_in = CausalConv3d(cfg.in_channels, ch[0], 3, **kw)
        blocks, cin = [], ch[0]
        for c, dout, temporal in cfg.down_levels():
            blocks.append(Block(cin, c, cfg.layers_per_block, down=None if dout is None else (dout, temporal), **kw))
            cin = c if dout is None else dout
        self.down_blocks = nnx.List(blocks)
        self.mid_block = MidBlock(ch[-1], **kw)
        self.norm_out = RMSNorm(ch[-1], **kw)
        self.conv_out = CausalConv3d(ch[-1], 2 * cfg.latent_channels, 3, **kw)
        self.group = ch[-1] // (2 * cfg.latent_channels)

    def __call__(self, x):
        x = self.conv_in(x)
        for b in self.down_blocks:
            x = b(x)
        x = self.mid_block(x)
        return self.conv_out(vconv.silu(self.norm_out(x))) + _group_mean(x, self.group)


class Decoder(nnx.Module):
    def __init__(self, cfg: HunyuanVideo15VAEConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        ch = cfg.block_out_channels[::-1]
        self.repeat = ch[0] // cfg.latent_channels
        self.conv_in = CausalConv3d(cfg.latent_channels, ch[0], 3, **kw)
        self.mid_block = MidBlock(ch[0], **kw)
        blocks, cin = [], ch[0]
        for c, uout, temporal in cfg.up_levels():
            blocks.append(Block(cin, c, cfg.layers_per_block + 1, up=None if uout is None else (uout, temporal), **kw))
            cin = c if uout is None else uout
        self.up_blocks = nnx.List(blocks)
        self.norm_out = RMSNorm(ch[-1], **kw)
        self.conv_out = CausalConv3d(ch[-1], cfg.out_channels, 3, **kw)

    def level(self, x, level: int, io: Whole = WHOLE):
        """Decoder stage ``level``: 0 = conv_in + mid block, 1..n = up block n-1, n+1 = the output."""
        if level == 0:
            return self.mid_block(io.conv(self.conv_in, x) + jnp.repeat(x, self.repeat, axis=-1), io)
        if level <= len(self.up_blocks):
            return self.up_blocks[level - 1](x, io)
        return io.conv(self.conv_out, vconv.silu(self.norm_out(x)))

    @property
    def levels(self) -> int:
        return len(self.up_blocks) + 2

    def __call__(self, z):
        for i in range(self.levels):
            z = self.level(z, i)
        return z


class HunyuanVideo15VAE(nnx.Module):
    """``encoder`` (-> mean, logvar) and ``decoder``; the methods below are the units the tiling
    loops call (one jitted program per tile shape, per decoder level)."""

    def __init__(self, cfg: HunyuanVideo15VAEConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        self.cfg = cfg
        self.encoder = Encoder(cfg, rngs=rngs, param_dtype=param_dtype)
        self.decoder = Decoder(cfg, rngs=rngs, param_dtype=param_dtype)

    def encode_tile(self, x):
        """[B, T, H, W, 3] -> the posterior's moments [B, t, h, w, 2z] (mean, logvar), float32."""
        dt = vconv.kernel_dtype(self.encoder.conv_in.conv.kernel)
        return self.encoder(x.astype(dt)).astype(F32)

    def decode_level(self, x, level: int):
        dt = vconv.kernel_dtype(self.decoder.conv_in.conv.kernel)
        y = self.decoder.level(x.astype(dt), level)
        return y.astype(F32) if level == self.decoder.levels - 1 else y

    def decode_level_chunk(self, x, state, offset, level: int, kv_frames: int):
        """Decoder ``level`` of one temporal chunk: ``(output, the causal state the next chunk
        reads)``. ``state``: the previous chunk's (None: the first chunk); ``offset``: int32 latent
        frame the chunk starts at."""
        dt = vconv.kernel_dtype(self.decoder.conv_in.conv.kernel)
        io = Chunk(state, offset, kv_frames)
        y = self.decoder.level(x.astype(dt), level, io)
        return (y.astype(F32) if level == self.decoder.levels - 1 else y), io.new


def _build(cfg, dtype=np.float32):
    return HunyuanVideo15VAE(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(dtype))


def init(cfg: HunyuanVideo15VAEConfig, seed: int = 0, dtype=np.float32) -> nn.Split:
    """A seeded random VAE (presets, tests), split once (host-drawn weights)."""
    from vidax.models.hunyuanvideo.dit import seeded_state

    graphdef, state = seeded_state(lambda: _build(cfg, dtype), seed)
    return vconv.conv_model(nn.Split(graphdef, jax.device_put(state), cfg))


# ----------------------------------------------------------------------------------- decode / encode
def decode_tile(vae: nn.Split, z, chunk: int | None = None, total: int | None = None):
    """One tile (channels-last latents [B, T, h, w, C]) through the staged decoder: each level its
    own compiled call. ``chunk``: latent frames per call -- the tile is decoded in temporal chunks,
    each level carrying its causal state (every causal conv's last input frames, the mid-block
    attention's keys and values) to the next chunk, so a call holds ``chunk`` frames' activations
    whatever the clip's length. The first chunk pads as the whole decode does, the last is padded
    with copies of the last latent frame (the decoder is causal: they change no kept frame beyond
    float rounding). One
    program per level for the first chunk and one for all others; ``None`` or a clip of at most
    ``chunk`` frames: one call per level over every frame (the reference's decode). ``total``:
    ``z`` is the prefix of a sequence this long (decoded with that sequence's programs: its first
    chunks, bitwise)."""
    t = z.shape[1]
    total = max(t, total or t)
    levels = len(vae.cfg.block_out_channels) + 2
    if not chunk or total <= chunk:
        x = jax.device_put(np.ascontiguousarray(z))  # (jnp.asarray of host data builds a program per shape)
        for i in range(levels):
            x = vae.apply("decode_level", x, level=i)
        return np.asarray(x)
    n, kv = -(-t // chunk), -(-total // chunk) * chunk
    z = np.concatenate([z, np.repeat(z[:, -1:], n * chunk - t, axis=1)], axis=1)
    state, out, tc = [None] * levels, [], vae.cfg.temporal_compression_ratio
    for c in range(n):
        x = jax.device_put(np.ascontiguousarray(z[:, c * chunk:(c + 1) * chunk]))
        for i in range(levels):
            x, state[i] = vae.apply("decode_level_chunk", x, state[i], np.int32(c * chunk), level=i,
                                    kv_frames=kv)
        keep = min(chunk, t - c * chunk)
        out.append(np.asarray(x)[:, : (1 + tc * (keep - 1) if c == 0 else tc * keep)])
    return np.concatenate(out, axis=1)


def tile_grid(h: int, w: int, tiling: Tiling, s: int) -> list[list[tuple[int, int, int, int]]]:
    """The reference's ``tiled_decode`` tiles of an ``h x w`` latent: rows of latent boxes
    ``(y0, y1, x0, x1)`` of ``latent_tile`` every ``(1 - overlap)`` of it, in its loop order (edge
    tiles cut at the border). One box when tiling is off or the latent fits one tile."""
    lt = tiling.latent_tile(s)
    if not tiling.spatial or (h <= lt and w <= lt):
        return [[(0, h, 0, w)]]
    stride = int(lt * (1 - tiling.overlap))
    return [[(i, min(i + lt, h), j, min(j + lt, w)) for j in range(0, w, stride)] for i in range(0, h, stride)]


def assemble_tiles(rows, tiling: Tiling, out_h: int, out_w: int) -> np.ndarray:
    """The reference's blend of decoded tiles (channels-last [B, F, H, W, 3], in :func:`tile_grid`
    order): each tile cross-faded linearly from its upper neighbour over ``sample * overlap`` rows,
    then from its left one over as many columns (the reference blends in place: a neighbour is
    already blended when the next tile reads it), cropped to ``sample - blend``, joined, cropped to
    ``(out_h, out_w)``."""
    blend = int(tiling.sample * tiling.overlap)
    keep = tiling.sample - blend
    return blend_grid([list(r) for r in rows], blend, keep, (2, 3))[:, :, :out_h, :out_w]


def _decode_spatial(vae: nn.Split, z, tiling: Tiling, chunk: int | None = None, total: int | None = None):
    """The reference's ``_decode`` of channels-last latents (spatially tiled when on and larger
    than a tile; each tile decoded in temporal chunks of ``chunk`` latent frames)."""
    s = vae.cfg.spatial_compression_ratio
    grid = tile_grid(z.shape[2], z.shape[3], tiling, s)
    if len(grid) == 1 and len(grid[0]) == 1:
        return decode_tile(vae, z, chunk, total)
    rows = [[decode_tile(vae, z[:, :, y0:y1, x0:x1], chunk, total) for y0, y1, x0, x1 in row] for row in grid]
    return assemble_tiles(rows, tiling, z.shape[2] * s, z.shape[3] * s)


def decode(vae: nn.Split, z, tiling: Tiling = Tiling(), chunk: int | None = None, total: int | None = None) -> np.ndarray:
    """The reference's ``decode``: latents [B, C, T, h, w] (divided by ``scaling_factor``) ->
    pixels [B, 3, F, H, W] (float32, not clipped). ``chunk``: temporal chunks (:func:`decode_tile`)."""
    z = np.ascontiguousarray(np.asarray(z, np.float32).transpose(0, 2, 3, 4, 1))
    return _decode_spatial(vae, z, tiling, chunk, total).transpose(0, 4, 1, 2, 3)


def frame_range(a: int, b: int, temporal: int = 4) -> tuple[int, int]:
    """The pixel frames ``[start, stop)`` decoded from latent frames ``[a, b)`` (latent 0 -> one
    frame, every later latent -> ``temporal`` frames)."""
    f = lambda k: 0 if k == 0 else 1 + temporal * (k - 1)  # noqa: E731
    return f(a), f(b)


def decode_frames(vae: nn.Split, z, a: int, b: int, tiling: Tiling = Tiling(), prefix_only: bool = False,
                  chunk: int | None = None) -> np.ndarray:
    """The pixels of latent frames ``[a, b)`` ([B, 3, F_ab, H, W]). The decoder is causal, so
    they are the same decoded from any prefix that holds them: by default the whole latent
    sequence is decoded (every range runs the same compiled programs, and the ranges concatenate
    bitwise to :func:`decode`); ``prefix_only`` decodes just ``[0, b)`` -- with ``chunk``, the
    whole sequence's first chunks, through the one holding frame ``b - 1`` (the same programs and
    inputs: the ranges still concatenate bitwise to the chunked :func:`decode`), without, one
    compile per range length."""
    z = np.asarray(z, np.float32)
    if prefix_only:
        # with chunks, through the end of the chunk holding frame b - 1: the whole decode's chunks as
        # they are (padded copies of frame b - 1 would change the kept frames' rounding: the convs
        # over time combine the frames of a block, vidax.core.conv.winograd_time_conv)
        end = min(z.shape[2], -(-b // chunk) * chunk) if chunk else b
        px = decode(vae, z[:, :, :end], tiling, chunk, total=z.shape[2] if chunk else None)
    else:
        px = decode(vae, z, tiling, chunk)
    start, stop = frame_range(a, b, vae.cfg.temporal_compression_ratio)
    return px[:, :, start:stop]


def encode_moments(vae: nn.Split, x, tiling: Tiling = Tiling()) -> np.ndarray:
    """The reference's ``_encode``: video [B, 3, F, H, W] in [-1, 1] -> moments [B, 2z, T, h, w]."""
    s = vae.cfg.spatial_compression_ratio
    x = np.ascontiguousarray(np.asarray(x, np.float32).transpose(0, 2, 3, 4, 1))
    fn = lambda xx: np.asarray(vae.apply("encode_tile", jax.device_put(np.ascontiguousarray(xx))))  # noqa: E731
    if tiling.spatial and (x.shape[2] > tiling.sample or x.shape[3] > tiling.sample):
        lt = tiling.latent_tile(s)
        blend = int(lt * tiling.overlap)
        m = spatial_tiled(fn, x, tiling.sample, int(tiling.sample * (1 - tiling.overlap)), lt, lt - blend,
                          x.shape[2] // s, x.shape[3] // s)
    else:
        m = fn(x)
    return m.transpose(0, 4, 1, 2, 3)


def encode(vae: nn.Split, x, tiling: Tiling = Tiling()) -> np.ndarray:
    """Posterior mean (the reference's ``latent_dist.mode()``): [B, 3, F, H, W] -> [B, z, T, h, w]."""
    return encode_moments(vae, x, tiling)[:, : vae.cfg.latent_channels]


# ----------------------------------------------------------------------------------- weights
def _ref_name(path: str) -> tuple[str, str]:
    """A state path -> (diffusers tensor name, layout kind)."""
    mods, _, leaf = path.rpartition(".")
    if leaf == "kernel":
        return f"{mods}.weight", "conv3d"
    if leaf == "gamma":
        return f"{mods}.gamma", "flat"
    return f"{mods}.{leaf}", "none"


def keymap(cfg: HunyuanVideo15VAEConfig) -> KeyMap:
    from vidax.core.sharding import tree_paths

    state = nn.abstract_state(lambda: _build(cfg))[1]
    rules = []
    for p in tree_paths(state):
        ref, kind = _ref_name(p)
        rules.append(Rule(ref, p, kind))
    return KeyMap(rules)


_ORIG_RES = re.compile(r"(encoder|decoder)\.(down|up)\.(\d+)\.block\.(\d+)\.(.+)")
_ORIG_RESAMPLE = re.compile(r"(encoder|decoder)\.(down|up)\.(\d+)\.(downsample|upsample)\.(.+)")
_ORIG_MID = re.compile(r"(encoder|decoder)\.mid\.(block_1|block_2|attn_1)\.(.+)")
_ATTN = {"q": "to_q", "k": "to_k", "v": "to_v"}


def original_name(name: str) -> str:
    """The original release's VAE name (``encoder.down.0.block.1...``) -> diffusers'."""
    m = _ORIG_RES.fullmatch(name)
    if m:
        part, kind, i, j, rest = m.groups()
        return f"{part}.{kind}_blocks.{i}.resnets.{j}.{rest}"
    m = _ORIG_RESAMPLE.fullmatch(name)
    if m:
        part, kind, i, which, rest = m.groups()
        return f"{part}.{kind}_blocks.{i}.{which}rs.0.{rest}"
    m = _ORIG_MID.fullmatch(name)
    if m:
        part, which, rest = m.groups()
        if which == "attn_1":
            mod, _, leaf = rest.partition(".")
            return f"{part}.mid_block.attentions.0.{_ATTN.get(mod, mod)}.{leaf}"
        return f"{part}.mid_block.resnets.{0 if which == 'block_1' else 1}.{rest}"
    return name


def param_shapes(cfg: HunyuanVideo15VAEConfig, dtype=np.float32) -> dict:
    """Every parameter's shape, keyed as the key map's dotted paths address them."""
    return str_keys(nn.shapes(lambda: _build(cfg, dtype)))


def load_vae(path, cfg: HunyuanVideo15VAEConfig | None = None, dtype=np.float32) -> nn.Split:
    """A diffusers ``vae/`` folder (config.json + safetensors) or the original release's
    ``vae/diffusion_pytorch_model.safetensors`` (its own names) -> the split VAE."""
    path = Path(path)
    if cfg is None:
        cfg = (HunyuanVideo15VAEConfig.from_diffusers(compat.read_config(path))
               if path.is_dir() and (path / "config.json").exists() else HunyuanVideo15VAEConfig())
    ckpt = open_checkpoint(path)
    names = list(ckpt)
    if any(n.startswith(("encoder.down.", "decoder.up.")) for n in names):
        ckpt = view_of({original_name(n): ckpt[n] for n in names}, ckpt)
    flat = load_params(ckpt, keymap(cfg), param_shapes(cfg, dtype), dtype=dtype,
                       what=f"AutoencoderKLHunyuanVideo15 (channels {cfg.block_out_channels})")
    return vconv.conv_model(nn.Split.from_pure(lambda: _build(cfg, dtype), int_keys(flat)))


# ----------------------------------------------------------------------------------- compat
class _Compat(compat.CompatModel):
    def __init__(self, config, vae: nn.Split):
        super().__init__("AutoencoderKLHunyuanVideo15", config, vae.state, vae.cfg)
        self.vae, self.tiling = vae, Tiling()

    def enable_tiling(self, tile_sample_min_height=None, tile_sample_min_width=None, tile_latent_min_height=None,
                      tile_latent_min_width=None, tile_overlap_factor=None):
        """diffusers' ``enable_tiling`` (same keywords; square tiles)."""
        t = self.tiling
        sh, sw = tile_sample_min_height or t.sample, tile_sample_min_width or t.sample
        s = self.vae.cfg.spatial_compression_ratio
        lh, lw = tile_latent_min_height or t.latent_tile(s), tile_latent_min_width or t.latent_tile(s)
        if sh != sw or lh != lw:
            raise ValueError("AutoencoderKLHunyuanVideo15 port: spatial tiles must be square")
        self.tiling = Tiling(True, int(sh), int(lh), float(tile_overlap_factor or t.overlap))

    def disable_tiling(self):
        self.tiling = Tiling(False, self.tiling.sample, self.tiling.latent, self.tiling.overlap)

    def encode(self, x):
        return encode(self.vae, x, self.tiling)

    def decode(self, z):
        return decode(self.vae, z, self.tiling)


@compat.register("AutoencoderKLHunyuanVideo15")
def _load_compat(config: dict, folder: Path, dtype=np.float32, **_):
    return _Compat(config, load_vae(folder, HunyuanVideo15VAEConfig.from_diffusers(config), dtype))
