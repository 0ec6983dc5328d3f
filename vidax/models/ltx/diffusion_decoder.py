"""LTX-2.5's diffusion video decoder (diffusers ``LTX2VideoDiffusionDecoderModel``) as Flax NNX.

Not a convolutional decoder: stages 1-4 upsample the latent deterministically (linear in,
neighbourhood-attention blocks, linear pixel-shuffle up) into a context volume; stage 5 is a small
diffusion transformer on 4x4-patchified pixels that denoises pixel noise conditioned on that
context (AdaLN scale/shift from the timestep, the context added before every block). LTX-2.5 ships
one step with x0 prediction: the prediction from pure noise is the output.

Attention is local: every token attends to a ``kernel_size`` window (time, height, width) centred
on it and shifted inward at the borders (NATTEN's ``na3d``). :func:`neighborhood_attention`
computes it exactly, tile by tile in ``lax.scan``: a block of queries against the slab of keys
that holds all of their windows, with the window mask, so memory is bounded by a tile however
large the video. The pixel noise is drawn from a JAX key (the run's seed); :func:`denoise` /
``denoise(z, x_t, steps)`` take it given.

Tensor parallelism: every attention's heads and the SwiGLU width carry logical axes (``heads``,
``ffn``); :func:`shard` places the state on a mesh and the jitted decode is partitioned by the
compiler (the seed notes: tensor parallelism, not chunking, bounded this decoder's memory).
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
from vidax.core import nn
from vidax.models.ltx import layers as L
from vidax.weights import KeyMap, Rule, open_checkpoint
from vidax.weights.keymap import load_params

F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST
#: query tile (frames, rows, columns) of the windowed attention: with stage 5's 11^3 windows a
#: tile's scores are 2048 queries x 15288 keys per head (~60 MB), 3.4k tiles for 1216x704x121
TILE = (4, 16, 32)


@dataclass(frozen=True)
class DiffusionDecoderConfig:
    out_channels: int = 3
    latent_channels: int = 128
    patch_size: int = 4
    scaling_factor: float = 1.0
    decoder_head_dim: int = 64
    decoder_stage_channels: tuple = (2048, 1024, 512, 512, 256)
    decoder_stage_depths: tuple = (4, 6, 4, 2, 8)
    decoder_stage_kernels: tuple = ((3, 7, 7), (3, 7, 7), (3, 5, 5), (3, 5, 5))
    decoder_upsample_strides: tuple = ((1, 2, 2), (2, 1, 1), (2, 2, 2), (2, 2, 2))
    decoder_upsample_channel_reductions: tuple = (2, 2, 1, 2)
    decoder_stage5_kernel: tuple = (11, 11, 11)
    decoder_t_emb_dim: int = 384
    decoder_timestep_scale_multiplier: float = 1000.0
    decoder_model_output_type: str = "x0"
    decoder_num_inference_steps: int = 1
    spatial_compression_ratio: int = 32
    temporal_compression_ratio: int = 8

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "DiffusionDecoderConfig":
        names = {f.name for f in fields(cls)}

        def tup(v):
            return tuple(tup(x) for x in v) if isinstance(v, (list, tuple)) else v

        return cls(**{k: tup(v) for k, v in cfg.items() if k in names})

    @property
    def trailing_pad(self) -> int:
        return (self.decoder_stage_kernels[0][0] // 2) * 2


PRESETS = {"tiny": DiffusionDecoderConfig(
    latent_channels=8, decoder_head_dim=8, decoder_stage_channels=(32, 16, 16, 16, 16), decoder_stage_depths=(1, 1, 1, 1, 2),
    decoder_stage_kernels=((3, 1, 1), (3, 3, 3), (3, 3, 3), (3, 3, 3)), decoder_upsample_channel_reductions=(2, 1, 1, 1),
    decoder_stage5_kernel=(3, 3, 3), decoder_t_emb_dim=16)}


# ----------------------------------------------------------------------------------- local attention
def _window_starts(n: int, k: int):
    """Per position, the start of its ``k`` window shifted inward at the borders."""
    return np.clip(np.arange(n) - k // 2, 0, n - k)


def neighborhood_attention(q, k, v, kernel, tile=TILE):
    """NATTEN-style 3D neighbourhood attention, exact, tile by tile.

    ``q``, ``k``, ``v``: [B, T, H, W, heads, d] (``q`` already scaled); ``kernel``: (kt, kh, kw),
    each at most its axis. Queries run in tiles of ``tile`` cells under ``lax.scan``; each tile
    attends to the slab of keys holding all of its windows (tile + kernel - 1 per axis), masked
    to each query's own window, so the score matrix is one tile x one slab."""
    b, t, h, w, nh, d = q.shape
    grid = (t, h, w)
    kern = tuple(min(kk, n) for kk, n in zip(kernel, grid))
    tl = tuple(min(a, n) for a, n in zip(tile, grid))
    nt = tuple(-(-n // a) for n, a in zip(grid, tl))
    slab = tuple(min(a + kk - 1, n) for a, kk, n in zip(tl, kern, grid))
    pads = [(0, 0)] + [(0, m * a - n) for m, a, n in zip(nt, tl, grid)] + [(0, 0), (0, 0)]
    qp = jnp.pad(q, pads)
    starts = [jnp.asarray(_window_starts(n, kk), jnp.int32) for n, kk in zip(grid, kern)]

    def one(idx):
        it, ih, iw = idx // (nt[1] * nt[2]), (idx // nt[2]) % nt[1], idx % nt[2]
        q0 = (it * tl[0], ih * tl[1], iw * tl[2])
        s0 = [jnp.clip(q0[a] - kern[a] // 2, 0, grid[a] - slab[a]) for a in range(3)]
        qt = jax.lax.dynamic_slice(qp, (0, *q0, 0, 0), (b, *tl, nh, d))
        ks = jax.lax.dynamic_slice(k, (0, *s0, 0, 0), (b, *slab, nh, d))
        vs = jax.lax.dynamic_slice(v, (0, *s0, 0, 0), (b, *slab, nh, d))
        # window membership per axis: key position p is in query position r's window
        ms = []
        for a in range(3):
            qpos = jnp.minimum(q0[a] + jnp.arange(tl[a]), grid[a] - 1)
            ws = starts[a][qpos]
            kpos = s0[a] + jnp.arange(slab[a])
            ms.append((kpos[None, :] >= ws[:, None]) & (kpos[None, :] < ws[:, None] + kern[a]))
        m = (ms[0][:, None, None, :, None, None] & ms[1][None, :, None, None, :, None]
             & ms[2][None, None, :, None, None, :]).reshape(math.prod(tl), math.prod(slab))
        qf = qt.reshape(b, -1, nh, d)
        kf, vf = ks.reshape(b, -1, nh, d), vs.reshape(b, -1, nh, d)
        s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision=_HI).astype(F32)
        s = jnp.where(m[None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", p.astype(vf.dtype), vf, precision=_HI)
        return o.reshape(b, *tl, nh, d)

    n = nt[0] * nt[1] * nt[2]
    _, out = jax.lax.scan(lambda c, i: (c, one(i)), None, jnp.arange(n))
    out = out.reshape(*nt, b, *tl, nh, d).transpose(3, 0, 4, 1, 5, 2, 6, 7, 8)
    out = out.reshape(b, nt[0] * tl[0], nt[1] * tl[1], nt[2] * tl[2], nh, d)
    return out[:, :t, :h, :w]


def _rope_split(head_dim: int):
    dt = (head_dim // 4) // 2 * 2
    dhw = (head_dim - dt) // 2
    if dhw % 2:
        dt -= 2
        dhw = (head_dim - dt) // 2
    return dt, dhw, dhw


def _inv_freqs(dim: int, base: float) -> np.ndarray:
    return (1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)).astype(np.float32)


def rope3d(x, base: float = 10000.0):
    """``LTX2VideoVaeRotaryPosEmbed3D``: x [B, T, H, W, heads, hd], pairs rotated by their own
    axis position (time, row, column) over the (dt, dh, dw) chunks of the head dim."""
    hd = x.shape[-1]
    split = _rope_split(hd)
    out, o = [], 0
    for axis, dim in zip((1, 2, 3), split):
        part = x[..., o: o + dim].astype(F32)
        o += dim
        pos = jnp.arange(x.shape[axis], dtype=F32)
        ang = pos[:, None] * jnp.asarray(_inv_freqs(dim, base))[None]
        shape = [1, 1, 1, 1, 1, dim // 2]
        shape[axis] = x.shape[axis]
        c, s = jnp.cos(ang).reshape(shape), jnp.sin(ang).reshape(shape)
        pr = part.reshape(*part.shape[:-1], dim // 2, 2)
        e, od = pr[..., 0], pr[..., 1]
        out.append(jnp.stack([e * c - od * s, e * s + od * c], axis=-1).reshape(part.shape).astype(x.dtype))
    return jnp.concatenate(out, axis=-1)


# ----------------------------------------------------------------------------------- modules
class NAttention(nnx.Module):
    def __init__(self, dim, kernel, head_dim, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.kernel, self.head_dim = tuple(kernel), head_dim
        self.q = nn.Linear(dim, dim, axes=("embed", "heads"), precision=_HI, **kw)
        self.k = nn.Linear(dim, dim, axes=("embed", "heads"), precision=_HI, **kw)
        self.v = nn.Linear(dim, dim, axes=("embed", "heads"), precision=_HI, **kw)
        self.o = nn.Linear(dim, dim, axes=("heads", "embed"), precision=_HI, **kw)
        self.norm_q = nn.RMSNorm(head_dim, eps=1e-6, **kw)
        self.norm_k = nn.RMSNorm(head_dim, eps=1e-6, **kw)

    def __call__(self, x, tile):
        b, t, h, w, c = x.shape
        hd = self.head_dim
        sh = (b, t, h, w, c // hd, hd)
        q = self.norm_q(self.q(x).reshape(sh)) * (hd ** -0.5)
        k = self.norm_k(self.k(x).reshape(sh))
        v = self.v(x).reshape(sh)
        o = neighborhood_attention(rope3d(q), rope3d(k), v, self.kernel, tile)
        return self.o(o.reshape(b, t, h, w, c))


def _swiglu_hidden(dim, ratio=4.0):
    return (int(dim * ratio) + 15) // 16 * 16


class SwiGLU(nnx.Module):
    def __init__(self, dim, *, rngs, param_dtype=F32):
        hid = _swiglu_hidden(dim)
        kw = dict(rngs=rngs, param_dtype=param_dtype, bias=False, precision=_HI)
        self.up = nn.Linear(dim, hid, axes=("embed", "ffn"), **kw)
        self.gate = nn.Linear(dim, hid, axes=("embed", "ffn"), **kw)
        self.down = nn.Linear(hid, dim, axes=("ffn", "embed"), **kw)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class NABlock(nnx.Module):
    def __init__(self, dim, kernel, head_dim, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm1 = nn.RMSNorm(dim, eps=1e-6, **kw)
        self.attn = NAttention(dim, kernel, head_dim, **kw)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6, **kw)
        self.mlp = SwiGLU(dim, **kw)

    def __call__(self, x, tile):
        x = x + self.attn(self.norm1(x), tile)
        return x + self.mlp(self.norm2(x))


class DiffBlock(nnx.Module):
    def __init__(self, dim, kernel, ctx_dim, head_dim, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.ctx = nn.Linear(ctx_dim, dim, precision=_HI, **kw)
        self.sst = nn.param(rngs, nnx.initializers.zeros_init(), (7, dim), None, None, dtype=param_dtype)
        self.norm1 = nn.RMSNorm(dim, eps=1e-6, **kw)
        self.attn = NAttention(dim, kernel, head_dim, **kw)
        self.norm2 = nn.RMSNorm(dim, eps=1e-6, **kw)
        self.mlp = SwiGLU(dim, **kw)

    def __call__(self, x, ctx, mod, tile):
        m = mod + self.sst[...].astype(F32)[None]  # [B, 7, C]
        sc1, sh1, sc2, sh2 = (m[:, j][:, None, None, None] for j in (0, 1, 3, 4))
        x = x + self.ctx(ctx)
        x = x + self.attn((self.norm1(x).astype(F32) * (1 + sc1) + sh1).astype(x.dtype), tile)
        return x + self.mlp((self.norm2(x).astype(F32) * (1 + sc2) + sh2).astype(x.dtype))


def pixel_shuffle(x, stride, drop_leading=True):
    b, t, h, w, c = x.shape
    st, sh, sw = stride
    co = c // (st * sh * sw)
    x = x.reshape(b, t, h, w, co, st, sh, sw).transpose(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, t * st, h * sh, w * sw, co)
    return x[:, 1:] if st == 2 and drop_leading else x


def patchify(x, p):
    """[B, F, H, W, C] -> [B, F, H/p, W/p, C*p*p], channel order (c, w offset, h offset)."""
    b, f, h, w, c = x.shape
    return x.reshape(b, f, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3).reshape(b, f, h // p, w // p, c * p * p)


def unpatchify(x, p):
    b, f, h, w, c = x.shape
    co = c // (p * p)
    return x.reshape(b, f, h, w, co, p, p).transpose(0, 1, 2, 6, 3, 5, 4).reshape(b, f, h * p, w * p, co)


class DiffusionDecoder(nnx.Module):
    def __init__(self, cfg: DiffusionDecoderConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        ch = cfg.decoder_stage_channels
        hd = cfg.decoder_head_dim
        self.conv_in = nn.Linear(cfg.latent_channels, ch[0], precision=_HI, **kw)
        stages, ups = [], []
        for i, stride in enumerate(cfg.decoder_upsample_strides):
            c, kern = ch[i], cfg.decoder_stage_kernels[i]
            stages.append(nn.stack(lambda r, c=c, kern=kern: NABlock(c, kern, hd, rngs=r, param_dtype=param_dtype),
                                   cfg.decoder_stage_depths[i], rngs))
            ups.append(nn.Linear(c, math.prod(stride) * c // cfg.decoder_upsample_channel_reductions[i], precision=_HI, **kw))
        self.stages, self.ups = nnx.List(stages), nnx.List(ups)
        c5 = ch[-1]
        self.t_embed = L.TimestepEmbed(cfg.decoder_t_emb_dim, **kw)
        self.conv_in_x = nn.Linear(cfg.out_channels * cfg.patch_size ** 2, c5, precision=_HI, **kw)
        self.adaln = nn.Linear(cfg.decoder_t_emb_dim, 7 * c5, precision=_HI, **kw)
        self.blocks = nn.stack(lambda r: DiffBlock(c5, cfg.decoder_stage5_kernel, c5, hd, rngs=r, param_dtype=param_dtype),
                               cfg.decoder_stage_depths[-1], rngs)
        self.norm_out = nn.RMSNorm(c5, eps=1e-6, **kw)
        self.conv_out = nn.Linear(c5, cfg.out_channels * cfg.patch_size ** 2, precision=_HI, **kw)

    def _stage(self, i, x, tile):
        return nn.scan(self.stages[i], x, lambda blk, h: blk(h, tile))

    def context(self, z, tile=TILE):
        """Stages 1-4: latents [B, T, H, W, C] -> the context volume (channels-last)."""
        cfg = self.cfg
        n = cfg.trailing_pad
        if n:
            z = jnp.concatenate([z, jnp.repeat(z[:, -1:], n, axis=1)], axis=1)
        h = self.conv_in(z)
        strides = cfg.decoder_upsample_strides
        for i in range(len(strides)):
            h = self._stage(i, h, tile)
            h = pixel_shuffle(self.ups[i](h), strides[i])
        if n:
            h = h[:, : h.shape[1] - n * cfg.temporal_compression_ratio]
        return h

    def step(self, ctx, x_t, t, tile=TILE):
        """One stage-5 prediction: pixels x_t [B, F, H, W, 3], t [B] -> [B, F, H, W, 3]."""
        cfg = self.cfg
        e = self.t_embed(cfg.decoder_timestep_scale_multiplier * t, ctx.dtype)
        mod = self.adaln(jax.nn.silu(e)).reshape(e.shape[0], 7, -1).astype(F32)
        h = self.conv_in_x(patchify(x_t, cfg.patch_size))
        h = nn.scan(self.blocks, h, lambda blk, x: blk(x, ctx, mod, tile))
        return unpatchify(self.conv_out(self.norm_out(h)), cfg.patch_size)


# ----------------------------------------------------------------------------------- calls
def denoise_context(split: nn.Split, cfg: DiffusionDecoderConfig, ctx, x_t, steps: int | None = None, tile=TILE):
    """``LTX2VideoDiffusionDecoder3d.denoise``: one jitted stage-5 call per step in a Python loop."""
    steps = steps or cfg.decoder_num_inference_steps
    b = x_t.shape[0]
    ts = np.linspace(1.0, 1.0 / steps, steps, dtype=np.float32)
    if steps == 1 and cfg.decoder_model_output_type == "x0":
        return split.apply("step", ctx, x_t, jnp.full((b,), ts[0], F32), tile=tile)
    x = jnp.asarray(x_t, F32)
    for i in range(steps):
        tn = jnp.full((b,), ts[i], F32)
        nxt = np.float32(ts[i + 1]) if i + 1 < steps else np.float32(0.0)
        out = split.apply("step", ctx, x, tn, tile=tile).astype(F32)
        if cfg.decoder_model_output_type == "x0":
            out = (x - out) / tn[:, None, None, None, None]
        x = x - (tn[:, None, None, None, None] - nxt) * out
    return x


def denoise(split: nn.Split, cfg: DiffusionDecoderConfig, z, x_t, steps: int | None = None, tile=TILE):
    """Decode latents ``z`` [B, C, f, h, w] (denormalised) with the pixel noise ``x_t``
    [B, 3, F, H, W] given -> pixels [B, 3, F, H, W] (numpy)."""
    zc = jnp.asarray(np.asarray(z, np.float32)).transpose(0, 2, 3, 4, 1)
    ctx = split.apply("context", zc, tile=tile)
    x = jnp.asarray(np.asarray(x_t, np.float32)).transpose(0, 2, 3, 4, 1)
    return np.asarray(denoise_context(split, cfg, ctx, x, steps, tile)).transpose(0, 4, 1, 2, 3)


def pixel_shape(cfg: DiffusionDecoderConfig, z_shape) -> tuple:
    b, _, f, h, w = z_shape
    return (b, cfg.out_channels, (f - 1) * cfg.temporal_compression_ratio + 1, h * cfg.spatial_compression_ratio,
            w * cfg.spatial_compression_ratio)


def decode(split: nn.Split, cfg: DiffusionDecoderConfig, z, key, steps: int | None = None, tile=TILE):
    """``decode``: pixel noise from ``key`` (the run's seed), then :func:`denoise`."""
    x_t = jax.random.normal(key, pixel_shape(cfg, np.shape(z)), F32)
    return denoise(split, cfg, z, x_t, steps, tile)


# ----------------------------------------------------------------------------------- state / loading
def _build(cfg, dtype=np.float32):
    return DiffusionDecoder(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(dtype))


def init(cfg: DiffusionDecoderConfig, seed: int = 0) -> nn.Split:
    g, st = L.seeded_split(lambda: _build(cfg), seed)
    return nn.Split(g, jax.device_put(st), cfg)


def keymap(cfg: DiffusionDecoderConfig) -> KeyMap:
    def na(ref, dst):
        k = []
        for a, b in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "o")):
            k += L.lin(f"{ref}.attn.{a}", f"{dst}.attn.{b}")
        k += L.norm(f"{ref}.attn.norm_q", f"{dst}.attn.norm_q") + L.norm(f"{ref}.attn.norm_k", f"{dst}.attn.norm_k")
        k += L.norm(f"{ref}.norm1", f"{dst}.norm1") + L.norm(f"{ref}.norm2", f"{dst}.norm2")
        for a, b in (("w_up", "up"), ("w_gate", "gate"), ("w_down", "down")):
            k += L.lin(f"{ref}.mlp.{a}", f"{dst}.mlp.{b}", bias=False)
        return k

    rules = [Rule(*r) for r in L.lin("decoder.conv_in", "conv_in") + L.lin("decoder.conv_in_x_t", "conv_in_x")
             + L.lin("decoder.t_embedder.timestep_embedder.linear_1", "t_embed.l1")
             + L.lin("decoder.t_embedder.timestep_embedder.linear_2", "t_embed.l2")
             + L.lin("decoder.shared_adaln.proj", "adaln") + L.norm("decoder.norm_out", "norm_out")
             + L.lin("decoder.conv_out", "conv_out")]
    for i in range(len(cfg.decoder_upsample_strides)):
        rules += [Rule(*r) for r in L.lin(f"decoder.upsamples.{i}.proj", f"ups.{i}")]
        rules += [Rule(s.replace("@", "{i}"), d, k) for s, d, k in na(f"decoder.det_stages.{i}.@", f"stages.{i}")]
    blk = na("decoder.diff_blocks.@", "blocks") + L.lin("decoder.diff_blocks.@.context_proj", "blocks.ctx")
    rules += [Rule(s.replace("@", "{i}"), d, k) for s, d, k in blk]
    rules.append(Rule("decoder.diff_blocks.{i}.scale_shift_table", "blocks.sst"))
    return KeyMap(rules, ignore=[r"^latents_(mean|std)$"])


def load(folder):
    """(split module, cfg, stats) from a diffusers ``diffusion_decoder/`` folder."""
    folder = Path(folder)
    cfg = DiffusionDecoderConfig.from_diffusers(compat.read_config(folder))
    ckpt = open_checkpoint(folder)
    stats = {k: np.asarray(ckpt[k].read() if hasattr(ckpt[k], "read") else ckpt[k], np.float32)
             for k in ("latents_mean", "latents_std") if k in ckpt}
    stats.setdefault("latents_mean", np.zeros(cfg.latent_channels, np.float32))
    stats.setdefault("latents_std", np.ones(cfg.latent_channels, np.float32))
    pure = load_params(ckpt, keymap(cfg), nn.shapes(lambda: _build(cfg)), dtype=np.float32,
                       what="LTX2VideoDiffusionDecoderModel")
    g, st = nn.abstract_state(lambda: _build(cfg))
    return nn.Split(g, jax.device_put(nn.fill(st, L.intkeys(pure))), cfg), cfg, stats


def shard(split: nn.Split, mesh) -> nn.Split:
    """The decoder's state placed on ``mesh`` by its logical axes (heads / ffn over ``tp``); the
    jitted calls are then partitioned by the compiler."""
    from vidax.core import mesh as vmesh
    from vidax.core import sharding as vsh

    m = vmesh.make_mesh(mesh)
    specs = vsh.param_specs(split.state, vsh.axis_rules("tp"))  # heads (q/k/v, out) and the SwiGLU width
    vsh.check_param_divisibility(split.state, specs, m)
    return split.replace(state=vsh.place(jax.tree.map(np.asarray, split.state), vsh.named_shardings(m, specs)))


class _Compat(compat.CompatModel):
    def __init__(self, config, split, cfg, stats):
        super().__init__("LTX2VideoDiffusionDecoderModel", config, split.state, cfg)
        self.split, self.stats = split, stats

    def denoise(self, z, x_t, num_inference_steps=None, tile=TILE):
        """Decode ``z`` with the pixel noise ``x_t`` given (the reference decoder's
        ``denoise(forward_stage_4(forward_stages_1_to_3(z)), x_t, steps)``)."""
        return denoise(self.split, self.model_config, z, x_t, num_inference_steps, tile)

    def decode(self, z, key=None, num_inference_steps=None):
        key = jax.random.key(0) if key is None else key
        return decode(self.split, self.model_config, z, key, num_inference_steps)


@compat.register("LTX2VideoDiffusionDecoderModel", scalable=True)
def _load_compat(config: dict, folder: Path, mesh=None, parallelism=None, offload_chunk_size=None, **_):
    if offload_chunk_size is not None or parallelism not in (None, "tp", "none"):
        raise ValueError("LTX2VideoDiffusionDecoderModel: tensor parallelism only (mesh='tp=N')")
    split, cfg, stats = load(folder)
    if mesh is not None:
        split = shard(split, mesh)
    return _Compat(config, split, cfg, stats)
