"""Cosmos-Predict2.5 diffusion transformer (diffusers ``CosmosTransformer3DModel``) as Flax NNX modules.

:class:`CosmosTransformer` = ``embed`` (patch, timestep and text-context embeddings) -> ``blocks``
(one :class:`CosmosBlock` stacked ``num_layers`` times on a leading ``"layers"`` axis, run with
``lax.scan``) -> ``head`` (AdaLN output norm + projection). Activations are channels-last inside; the
model takes latents as ``[B, F, H, W, C]``.

What the reference does, and how it is kept here:

- the input is ``[latents, condition_mask, padding_mask]`` concatenated on channels (the condition
  mask marks the latent frames given by an image or video, the padding mask is resized to the latent
  grid with nearest-neighbour sampling);
- the timestep is ``[B]`` or ``[B, 1, F, 1, 1]`` (one per latent frame, sigma in [0, 1] for
  Predict2.5); it is embedded per *frame* and every block's AdaLN-LoRA modulation is computed per
  frame, then broadcast to the frame's tokens (the reference computes the same rows once per token);
- 3D RoPE (rotate-half layout, NTK-scaled per axis, optional fps scaling of the temporal axis) on
  the self-attention queries/keys after their per-head RMS norms;
- the Qwen2.5-VL text features (every layer's hidden states, concatenated: 100352 channels for the
  7B reasoner) are projected once to ``text_embed_dim`` (``crossattn_proj``: linear + exact GELU);
- no preconditioning of any kind: the model sees the timestep the caller passes.

:func:`forward` is a pure function of the state; :func:`runner` (the core runner) places or streams the same
state on a ``(dp, tp, sp)`` mesh (Megatron TP over heads and FFN width, Ulysses SP over tokens;
cross-attention to the text stays local) and offloads the stacked blocks in chunks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax import compat
from vidax.core.config import DiTConfig, diffusers_kwargs
from vidax.core import mesh as vmesh
from vidax.core import nn
from vidax.core import geometry
from vidax.core import sharding as vsh
from vidax.core.layers import split_heads
from vidax.core.runner import DiTRunner, context_local, run_local
from vidax.core.attention import attention
from vidax.core.embeddings import sinusoidal_embedding
from vidax.weights import KeyMap, Rule

F32 = jnp.float32


@dataclass(frozen=True)
class CosmosDiTConfig(DiTConfig, in_channels=17, num_layers=28):
    """``in_channels``: 16 latent channels + the condition mask (Predict2.5)."""

    mlp_ratio: float = 4.0
    text_embed_dim: int = 1024
    adaln_lora_dim: int = 256
    max_size: tuple = (128, 240, 240)
    patch_size: tuple = (1, 2, 2)
    rope_scale: tuple = (1.0, 3.0, 3.0)
    concat_padding_mask: bool = True
    extra_pos_embed_type: str | None = None  # None | "learnable"
    use_crossattn_projection: bool = True
    crossattn_proj_in_channels: int = 100352
    encoder_hidden_states_channels: int = 1024
    base_fps: int = 24

    ffn_dim = DiTConfig.mlp_dim

    @property
    def context_dim(self) -> int:
        """Width of the ``encoder_hidden_states`` the model takes."""
        return self.crossattn_proj_in_channels if self.use_crossattn_projection else self.text_embed_dim

    @property
    def patch_in(self) -> int:
        return self.in_channels + (1 if self.concat_padding_mask else 0)

    @property
    def max_grid(self) -> tuple[int, int, int]:
        return tuple(s // p for s, p in zip(self.max_size, self.patch_size))

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "CosmosDiTConfig":
        kw = diffusers_kwargs(cls, cfg, defaults=())
        if cfg.get("img_context_dim_in"):
            raise ValueError("CosmosTransformer3DModel config: image-context cross-attention (img_context_dim_in) "
                             "is not ported (it is not part of Cosmos-Predict2.5)")
        if cfg.get("controlnet_block_every_n"):
            raise ValueError("CosmosTransformer3DModel config: controlnet residuals (Cosmos-Transfer2.5) are not ported")
        if kw.get("extra_pos_embed_type") not in (None, "learnable"):
            raise ValueError(f"CosmosTransformer3DModel config: extra_pos_embed_type={kw['extra_pos_embed_type']!r}")
        return cls(**kw)

#: the released sizes (diffusers' conversion configs for Cosmos-2.5-Predict-Base-2B / -14B)
PRESETS = {
    "tiny": CosmosDiTConfig(num_heads=2, head_dim=12, num_layers=2, text_embed_dim=16, adaln_lora_dim=8,
                            max_size=(16, 64, 64), crossattn_proj_in_channels=3 * 24,
                            encoder_hidden_states_channels=16),
    "2b": CosmosDiTConfig(num_heads=16, head_dim=128, num_layers=28),
    "14b": CosmosDiTConfig(num_heads=40, head_dim=128, num_layers=36),
}


# ----------------------------------------------------------------------------------- layers
_heads = split_heads


def apply_rope_half(x, cos, sin):
    """Rotate-half RoPE (``x * cos + [-x2, x1] * sin``) in float32. ``x``: [B, L, H, D];
    ``cos``/``sin``: [L, D] or [B, L, D]."""
    dt = x.dtype
    xf = x.astype(F32)
    d = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., d:], xf[..., :d]], axis=-1)
    if cos.ndim == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (xf * cos + rot * sin).astype(dt)


class AdaLNLoRA(nnx.Module):
    """``linear_2(linear_1(silu(e)))`` (+ the timestep embedding): ``n`` shift/scale(/gate) vectors
    from the (per-frame) embedded timestep, through a rank-``adaln_lora_dim`` bottleneck."""

    def __init__(self, dim: int, rank: int, n: int, *, rngs: nnx.Rngs, param_dtype=F32):
        self.l1 = nn.Linear(dim, rank, rngs=rngs, bias=False, param_dtype=param_dtype)
        self.l2 = nn.Linear(rank, n * dim, rngs=rngs, bias=False, param_dtype=param_dtype)

    def __call__(self, emb, temb):
        return self.l2(self.l1(jax.nn.silu(emb))) + temb


class CosmosAttention(nnx.Module):
    """q/k/v (column-parallel, no bias), per-head RMS norms on q and k, output row-parallel."""

    def __init__(self, cfg: CosmosDiTConfig, kv_dim: int, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        kw = dict(rngs=rngs, param_dtype=param_dtype, bias=False)
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(d, d, axes=("embed", "heads"), **kw)
        self.k = nn.Linear(kv_dim, d, axes=(None, "heads"), **kw)
        self.v = nn.Linear(kv_dim, d, axes=(None, "heads"), **kw)
        self.o = nn.Linear(d, d, axes=("heads", "embed"), **kw)
        self.norm_q = nn.RMSNorm(cfg.head_dim, eps=1e-5, rngs=rngs, param_dtype=param_dtype)
        self.norm_k = nn.RMSNorm(cfg.head_dim, eps=1e-5, rngs=rngs, param_dtype=param_dtype)

    def self_attention(self, x, cos, sin, par: vsh.ParallelContext):
        hd = self.head_dim
        q = apply_rope_half(self.norm_q(_heads(par.linear(self.q, x), hd)), cos, sin)
        k = apply_rope_half(self.norm_k(_heads(par.linear(self.k, x), hd)), cos, sin)
        v = _heads(par.linear(self.v, x), hd)
        o = par.self_attention(q, k, v)
        return par.linear(self.o, o.reshape(*o.shape[:2], -1))

    def context_kv(self, ctx, par: vsh.ParallelContext) -> dict:
        """The text keys / values [B, S, heads, head_dim] (the same every step)."""
        hd = self.head_dim
        return {"k": self.norm_k(_heads(par.linear(self.k, ctx), hd)), "v": _heads(par.linear(self.v, ctx), hd)}

    def cross_attention(self, x, ctx, ctx_mask, par: vsh.ParallelContext, kv: dict | None = None):
        """``kv``: :meth:`context_kv` computed once (``ctx`` then unused)."""
        hd = self.head_dim
        q = self.norm_q(_heads(par.linear(self.q, x), hd))
        kv = self.context_kv(ctx, par) if kv is None else kv
        k, v = kv["k"], kv["v"]
        if ctx_mask is None:
            o = par.cross_attention(q, k, v)
        else:
            o = attention(q, k, v, mask=ctx_mask[:, None, None, :], impl=par.attn_impl)
        return par.linear(self.o, o.reshape(*o.shape[:2], -1))


class FeedForward(nnx.Module):
    """``down(gelu(up(x)))`` (exact GELU, no biases in Predict2.5)."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, param_dtype=F32):
        self.up = nn.Linear(dim, hidden, rngs=rngs, bias=False, axes=("embed", "ffn"), param_dtype=param_dtype)
        self.down = nn.Linear(hidden, dim, rngs=rngs, bias=False, axes=("ffn", "embed"), param_dtype=param_dtype)

    def __call__(self, x, par: vsh.ParallelContext):
        return par.linear(self.down, nn.gelu_exact(par.linear(self.up, x)))


def _layer_norm(x, eps=1e-6):
    xf = x.astype(F32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    return (xf - mu) * jax.lax.rsqrt(var + eps)


def frame_to_tokens(m, frame_of_token):
    """Per-frame rows ``[B, Fm, ...]`` -> per-token rows ``[B, L, ...]`` (``Fm`` = 1 broadcasts)."""
    if m.shape[1] == 1:
        return m
    return jnp.take(m, frame_of_token, axis=1)


class CosmosBlock(nnx.Module):
    """AdaLN-LoRA-modulated self-attention (RoPE), cross-attention to the text, feed-forward."""

    def __init__(self, cfg: CosmosDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d, r = cfg.dim, cfg.adaln_lora_dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.mod1 = AdaLNLoRA(d, r, 3, **kw)
        self.attn1 = CosmosAttention(cfg, d, **kw)
        self.mod2 = AdaLNLoRA(d, r, 3, **kw)
        self.attn2 = CosmosAttention(cfg, cfg.text_embed_dim, **kw)
        self.mod3 = AdaLNLoRA(d, r, 3, **kw)
        self.ffn = FeedForward(d, cfg.ffn_dim, **kw)

    def __call__(self, x, c: dict, par: vsh.ParallelContext = vsh.LOCAL):
        """``x``: [B, L, D]; ``c``: ``emb`` / ``temb`` [B, Fm, D] / [B, Fm, 3D] (float32, per frame),
        ``fot`` (the frame of each local token), ``cos`` / ``sin``, ``ctx`` (+ ``ctx_mask``), ``pos``."""
        dt = x.dtype
        if c.get("pos") is not None:
            x = x + c["pos"].astype(dt)

        def modulation(mod):
            m = frame_to_tokens(mod(c["emb"], c["temb"]), c["fot"])  # [B, L|1, 3D] float32
            return jnp.split(m, 3, axis=-1)

        shift, scale, gate = modulation(self.mod1)
        h = (_layer_norm(x) * (1 + scale) + shift).astype(dt)
        x = (x.astype(F32) + gate * self.attn1.self_attention(h, c["cos"], c["sin"], par).astype(F32)).astype(dt)
        shift, scale, gate = modulation(self.mod2)
        h = (_layer_norm(x) * (1 + scale) + shift).astype(dt)
        o = self.attn2.cross_attention(h, c.get("ctx"), c.get("ctx_mask"), par, c.get("kv"))
        x = (x.astype(F32) + gate * o.astype(F32)).astype(dt)
        shift, scale, gate = modulation(self.mod3)
        h = (_layer_norm(x) * (1 + scale) + shift).astype(dt)
        return (x.astype(F32) + gate * self.ffn(h, par).astype(F32)).astype(dt)


class CosmosEmbed(nnx.Module):
    """Patch embedding (a linear over ``(C, pt, ph, pw)``), timestep embedding and the text projection.
    Per token / per frame, so it runs unchanged on a token shard."""

    def __init__(self, cfg: CosmosDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        self.patch = nn.Linear(cfg.patch_in * math.prod(cfg.patch_size), d, bias=False, axes=(None, "embed"), **kw)
        self.t1 = nn.Linear(d, d, bias=False, **kw)
        self.t2 = nn.Linear(d, 3 * d, bias=False, **kw)
        self.t_norm = nn.RMSNorm(d, eps=1e-6, **kw)
        self.ctx_proj = (nn.Linear(cfg.crossattn_proj_in_channels, cfg.encoder_hidden_states_channels, **kw)
                         if cfg.use_crossattn_projection else None)
        if cfg.extra_pos_embed_type == "learnable":
            gt, gh, gw = cfg.max_grid
            init = nnx.initializers.normal(0.02)
            self.pos_t = nn.param(rngs, init, (gt, d), None, None, dtype=param_dtype)
            self.pos_h = nn.param(rngs, init, (gh, d), None, None, dtype=param_dtype)
            self.pos_w = nn.param(rngs, init, (gw, d), None, None, dtype=param_dtype)
        else:
            self.pos_t = self.pos_h = self.pos_w = None

    def time(self, t):
        """``t`` [B, Fm] -> ``(temb [B, Fm, 3D], emb [B, Fm, D])`` in float32."""
        proj = sinusoidal_embedding(jnp.asarray(t, F32), self.cfg.dim, flip_sin_to_cos=True)
        dt = self.t1.kernel[...].dtype
        p = proj.astype(dt)
        temb = self.t2(jax.nn.silu(self.t1(p)))
        return temb.astype(F32), self.t_norm(p).astype(F32)

    def context(self, ctx):
        if self.ctx_proj is None:
            return ctx
        return nn.gelu_exact(self.ctx_proj(ctx))

    def __call__(self, a: dict, par: vsh.ParallelContext = vsh.LOCAL):
        """``a``: ``tokens``, ``t`` [B, Fm], ``ctx`` (+ ``ctx_mask``) and the per-token tables
        (``cos`` / ``sin`` / ``fot`` / ``pos_index``) of this shard. Returns ``({"h"}, consts)``."""
        temb, emb = self.time(a["t"])
        c = {"emb": emb, "temb": temb, **{k: a[k] for k in ("cos", "sin", "fot", "ctx_mask") if k in a}}
        if "ctx" in a:  # (absent when the blocks' text keys / values were computed once)
            c.update(self.kv_context(a, par))
        if self.pos_t is not None:
            c["pos"] = self.positions(a["pos_index"])
        return {"h": self.patch(a["tokens"])}, c

    def kv_context(self, a: dict, par: vsh.ParallelContext = vsh.LOCAL) -> dict:
        """The projected text context the cross-attention keys / values read."""
        return {"ctx": self.context(a["ctx"])}

    def positions(self, index):
        """The learnable absolute positions [L, D] of tokens with (t, h, w) ``index`` [L, 3]
        (:func:`grid_index`), normalised as the reference."""
        e = (self.pos_t[...][index[:, 0]] + self.pos_h[...][index[:, 1]] + self.pos_w[...][index[:, 2]]).astype(F32)
        norm = jnp.sqrt(jnp.sum(jnp.square(e), axis=-1, keepdims=True))
        return e / (1e-6 + norm * math.sqrt(1.0 / e.shape[-1]))


class CosmosHead(nnx.Module):
    """AdaLN output norm (shift/scale from the embedded timestep + the first 2D of the timestep
    embedding) and the output projection."""

    def __init__(self, cfg: CosmosDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.mod = AdaLNLoRA(d, cfg.adaln_lora_dim, 2, **kw)
        self.proj = nn.Linear(d, math.prod(cfg.patch_size) * cfg.out_channels, bias=False, axes=("embed", None), **kw)

    def __call__(self, carry, c, par: vsh.ParallelContext = vsh.LOCAL):
        h, emb = carry["h"], c["emb"]
        dt = h.dtype
        m = frame_to_tokens(self.mod(emb, c["temb"][..., : 2 * emb.shape[-1]]), c["fot"])
        shift, scale = jnp.split(m, 2, axis=-1)
        return {"y": self.proj((_layer_norm(h) * (1 + scale) + shift).astype(dt))}


class CosmosTransformer(nn.LatentPatches, nn.TextDiT):
    """The Cosmos-Predict2.5 DiT: ``embed`` -> stacked ``blocks`` -> ``head``, with the hooks of
    :class:`vidax.core.runner.DiTRunner`."""

    EMBED, BLOCK, HEAD = CosmosEmbed, CosmosBlock, CosmosHead
    PATCH_ORDER = "hwtc"  # the reference's output order

    @staticmethod
    def act_spec(name: str, shape: tuple) -> tuple:
        """Logical axes of an activation (see ``vidax.core.sharding.activation_axes``)."""
        if name in ("pad_mask", "cond_mask") and shape[0] == 1:  # [1, ...]: broadcast over the batch
            return (None,) * len(shape)
        return vsh.activation_axes(name, shape, tokens=("tokens", "h", "y"), kv=("k", "v"),
                                   tables=("cos", "sin", "pos", "pos_index", "fot"))

    @staticmethod
    def pack(x, t, ctx, *, cond_mask=None, pad_mask=None, ctx_mask=None, fps=None) -> dict:
        """The call signature (:meth:`__call__`'s); ``fps`` is static (it selects the RoPE tables)."""
        t = jnp.asarray(t, F32)
        if t.ndim == 1:  # one timestep for every sample: broadcast (the batch is split over dp)
            t = jnp.broadcast_to(t, (jnp.shape(x)[0],))
        return {"x": x, "t": t, "ctx": ctx, "cond_mask": cond_mask, "pad_mask": pad_mask,
                "ctx_mask": None if ctx_mask is None else jnp.asarray(ctx_mask, bool),
                "fps": None if fps is None else float(fps)}

    def prepare(self, a: dict, dtype) -> dict:
        cfg, x = self.cfg, a["x"]
        tokens, grid = patchify(cfg, model_input(cfg, x.astype(dtype), a.get("cond_mask"), a.get("pad_mask")).astype(dtype))
        t = a["t"]
        out = {"tokens": tokens, "t": time_per_frame(cfg, t, x.shape[0], grid[0]),
               **{k: a[k] for k in ("cos", "sin", "fot", "pos_index", "ctx_mask") if k in a}}
        if "ctx" in a:
            out["ctx"] = a["ctx"].astype(dtype)
        return out

    def check(self, shapes: dict, mesh) -> None:
        g = token_grid(self.cfg, shapes["x"])
        vmesh.check_divisible(parallel_constraints(self.cfg, tokens=math.prod(g), batch=shapes["x"][0]), mesh)

    def table_key(self, shapes: dict):
        return token_grid(self.cfg, shapes["x"]), shapes.get("fps")

    def tables(self, key) -> dict:
        """RoPE tables, each token's frame and (learned positions) its (t, h, w) index, per token."""
        grid, fps = key
        ang = rope_angles(self.cfg, grid, fps)
        out = {"cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32),
               "fot": np.arange(math.prod(grid), dtype=np.int32) // (grid[1] * grid[2])}
        if self.cfg.extra_pos_embed_type == "learnable":
            out["pos_index"] = grid_index(grid)
        return out

    def __call__(self, x, t, ctx, *, cond_mask=None, pad_mask=None, ctx_mask=None, fps=None,
                 par: vsh.ParallelContext = vsh.LOCAL, rope=None, context=None):
        """Velocity prediction. ``x``: [B, F, H, W, C] latents (C = ``in_channels`` minus one when a
        ``cond_mask`` [B, F, H, W, 1] is given); ``t``: [B] or [B, F] (per latent frame); ``ctx``:
        [B, S, context_dim]; ``pad_mask``: [1|B, H, W] at the latent size (zeros if None);
        ``ctx_mask``: [B, S] bool (True = attend); ``fps``: scales the temporal RoPE (None: images).
        ``rope``: the (cos, sin) tables of the grid (:func:`rope_tables`) as arguments (None: computed
        here); ``context``: the blocks' keys / values from :meth:`context` (``ctx`` then unused).
        Returns [B, F, H, W, out_channels]."""
        inputs = self.pack(x, t, ctx, cond_mask=cond_mask, pad_mask=pad_mask, ctx_mask=ctx_mask, fps=fps)
        inputs = {k: v for k, v in inputs.items() if v is not None and k != "fps"
                  and not (context is not None and k in self.CONTEXT)}
        tables = {k: jnp.asarray(v) for k, v in self.tables((token_grid(self.cfg, jnp.shape(x)), fps)).items()}
        if rope is not None:
            tables["cos"], tables["sin"] = rope
        return run_local(self, inputs, tables, self.embed.patch.kernel[...].dtype, par, context)

    def context(self, ctx, *, par: vsh.ParallelContext = vsh.LOCAL) -> dict:
        """The blocks' cross-attention keys / values of ``ctx`` [B, S, context_dim] (its projection
        included): computed once per sample stage, passed to every step as ``context``."""
        return context_local(self, {"ctx": ctx}, self.embed.patch.kernel[...].dtype, par)


# ----------------------------------------------------------------------------------- geometry helpers
def model_input(cfg: CosmosDiTConfig, x, cond_mask=None, pad_mask=None):
    """``[x, condition mask, padding mask]`` on channels (what the reference concatenates)."""
    parts = [x]
    if cond_mask is not None:
        parts.append(jnp.asarray(cond_mask, x.dtype))
    if cfg.concat_padding_mask:
        b, f, hh, ww = x.shape[:4]
        pm = jnp.zeros((1, hh, ww), x.dtype) if pad_mask is None else jnp.asarray(pad_mask, x.dtype)
        parts.append(jnp.broadcast_to(pm[:, None, :, :, None], (b, f, hh, ww, 1)))
    x = jnp.concatenate(parts, axis=-1) if len(parts) > 1 else x
    if x.shape[-1] != cfg.patch_in:
        raise ValueError(f"latents give {x.shape[-1]} input channels with the masks; the model takes {cfg.patch_in} "
                         f"(in_channels={cfg.in_channels}{' + padding mask' if cfg.concat_padding_mask else ''}): "
                         "pass condition_mask for a Video2World model")
    return x


def time_per_frame(cfg: CosmosDiTConfig, t, b: int, frames: int):
    """``t`` [B] / [1] / [B, F] -> [B|1, Fm] (Fm = 1 or the token-grid frame count)."""
    t = jnp.asarray(t, F32)
    if t.ndim == 1:
        return t[:, None]
    if t.ndim != 2 or t.shape[0] != b or t.shape[1] * 1 != frames * cfg.patch_size[0]:
        raise ValueError(f"per-frame timesteps must be [B={b}, F={frames * cfg.patch_size[0]}], got {t.shape}")
    if cfg.patch_size[0] != 1:
        raise ValueError("per-frame timesteps need a temporal patch size of 1 (as the reference)")
    return t


def token_grid(cfg: CosmosDiTConfig, x_shape) -> tuple:
    return geometry.token_grid(x_shape[1:4], cfg.patch_size)


def grid_index(grid) -> np.ndarray:
    """The (t, h, w) index [f*h*w, 3] of every token of a grid (frame-major token order)."""
    return np.stack(np.meshgrid(*(np.arange(g, dtype=np.int32) for g in grid), indexing="ij"), -1).reshape(-1, 3)


def patchify(cfg: CosmosDiTConfig, x):
    """[B, F, H, W, C] -> tokens [B, f*h*w, C*pt*ph*pw] (the reference's ``(C, pt, ph, pw)`` order)."""
    return geometry.patchify(x, cfg.patch_size, "cthw")


def unpatchify(cfg: CosmosDiTConfig, y, grid):
    """[B, L, ph*pw*pt*C] (the reference's output order: ``(ph, pw, pt, C)``) -> [B, F, H, W, C]."""
    return geometry.unpatchify(y, grid, cfg.patch_size, "hwtc")


def rope_angles(cfg: CosmosDiTConfig, grid, fps=None) -> np.ndarray:
    """RoPE angles [L, head_dim] for a token grid: ``[t, h, w, t, h, w]`` halves, each axis with
    its NTK-scaled base (``rope_scale``); with ``fps`` the temporal positions are ``i / fps * base_fps``."""
    d = cfg.head_dim
    dh = dw = d // 6 * 2
    dtt = d - dh - dw
    f, h, w = grid
    limits = cfg.max_grid
    for name, g, m in zip(("frames", "height", "width"), grid, limits):
        if g > m:
            raise ValueError(f"token grid {grid}: {g} {name} exceed the model's max_size ({m} after patching)")

    def freqs(dim, scale):
        theta = 10000.0 * scale ** (dim / (dim - 2))
        rng = np.arange(0, dim, 2, dtype=np.float32)[: dim // 2] / np.float32(dim)
        return (1.0 / np.power(np.float32(theta), rng, dtype=np.float32)).astype(np.float32)

    seq = np.arange(max(limits), dtype=np.float32)
    ft, fh, fw = freqs(dtt, cfg.rope_scale[0]), freqs(dh, cfg.rope_scale[1]), freqs(dw, cfg.rope_scale[2])
    pos_t = seq[:f] if fps is None else (seq[:f] / np.float32(fps) * np.float32(cfg.base_fps)).astype(np.float32)
    et = np.outer(pos_t, ft).astype(np.float32)
    eh = np.outer(seq[:h], fh).astype(np.float32)
    ew = np.outer(seq[:w], fw).astype(np.float32)
    et = np.broadcast_to(et[:, None, None], (f, h, w, et.shape[-1]))
    eh = np.broadcast_to(eh[None, :, None], (f, h, w, eh.shape[-1]))
    ew = np.broadcast_to(ew[None, None, :], (f, h, w, ew.shape[-1]))
    ang = np.concatenate([et, eh, ew] * 2, axis=-1)
    return ang.reshape(f * h * w, d)


def rope_tables(cfg: CosmosDiTConfig, grid, fps=None):
    ang = rope_angles(cfg, grid, fps)
    return jnp.asarray(np.cos(ang), F32), jnp.asarray(np.sin(ang), F32)


# ----------------------------------------------------------------------------------- state
KIT = nn.ModelKit(CosmosTransformer, units=("embed", "blocks", "head"), dtype_leaf=("embed", "patch", "kernel"))
#: seeded random modules for presets and tests, the abstract state a checkpoint fills, its shapes
#: (the key maps' target), the graphdefs the runner merges unit by unit, the state's dtype, and
#: the module back from a state inside a traced function (the unit of ``jit``): see ``nn.ModelKit``
_build, init_model, init_state, abstract_state = KIT.build, KIT.init_model, KIT.init_state, KIT.abstract_state
param_shapes, graphdefs, state_dtype, merge = KIT.param_shapes, KIT.graphdefs, KIT.state_dtype, KIT.merge


def forward(state, cfg: CosmosDiTConfig, x, t, ctx, *, cond_mask=None, pad_mask=None, ctx_mask=None, fps=None,
            attn_impl=None, rope=None, context=None):
    """Velocity prediction from a state (pure; ``jax.jit(forward, static_argnums=1,
    static_argnames="fps")``). See :meth:`CosmosTransformer.__call__`."""
    return merge(state, cfg)(x, t, ctx, cond_mask=cond_mask, pad_mask=pad_mask, ctx_mask=ctx_mask, fps=fps,
                             par=vsh.ParallelContext(attn_impl=attn_impl), rope=rope, context=context)


def context(state, cfg: CosmosDiTConfig, ctx, *, attn_impl=None) -> dict:
    """The blocks' text keys / values from a state (pure): computed once per sample stage and passed
    to every :func:`forward` as ``context`` (``ctx`` then unused)."""
    return merge(state, cfg).context(ctx, par=vsh.ParallelContext(attn_impl=attn_impl))


def resize_nearest(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    """torchvision ``resize(..., NEAREST)`` of ``[..., H, W]`` (source index ``floor(i * in / out)``)."""
    mask = np.asarray(mask)
    hi, wi = mask.shape[-2:]
    # ATen's nearest kernel: src = min(floor(dst * (float) in / out), in - 1), in float32
    ys = np.minimum(np.floor(np.arange(height, dtype=np.float32) * np.float32(hi / height)), hi - 1).astype(np.int64)
    xs = np.minimum(np.floor(np.arange(width, dtype=np.float32) * np.float32(wi / width)), wi - 1).astype(np.int64)
    return mask[..., ys, :][..., :, xs]


# ----------------------------------------------------------------------------------- sharding
def parallel_constraints(cfg: CosmosDiTConfig, *, tokens: int | None = None, batch: int | None = None):
    r = [vmesh.UlyssesHeads("num_heads", cfg.num_heads),
         vmesh.Divisible("ffn_dim", cfg.ffn_dim, ("tp",), "FFN up/down are split over tp")]
    return r + vmesh.input_rules(tokens, batch)


def runner(state, cfg: CosmosDiTConfig, mesh=None, parallelism=None, **kw) -> DiTRunner:
    """The Cosmos DiT on a ``(dp, tp, sp)`` mesh through ``vidax.core.runner.DiTRunner`` (TP splits
    heads and FFN width, SP the tokens), blocks resident or offloaded: ``runner(x, t, ctx,
    cond_mask=, pad_mask=, ctx_mask=, fps=)`` with channels-last latents."""
    return KIT.runner(state, cfg, mesh, parallelism, constraints=parallel_constraints(cfg), **kw)


# ----------------------------------------------------------------------------------- key maps
def _linear(ref: str, dst: str, bias: bool = False) -> list[tuple[str, str, str]]:
    return [(f"{ref}.weight", f"{dst}.kernel", "linear")] + ([(f"{ref}.bias", f"{dst}.bias", "none")] if bias else [])


def _norm(ref: str, dst: str) -> list[tuple[str, str, str]]:
    return [(f"{ref}.weight", f"{dst}.scale", "none")]


def _keymap(top, block, block_prefix: str, ignore=()) -> KeyMap:
    rules = [Rule(s, d, k) for s, d, k in top]
    rules += [Rule(f"{block_prefix}.{{i}}.{s}", f"blocks.{d}", k) for s, d, k in block]
    return KeyMap(rules, ignore=ignore)


def _names(original: bool) -> dict:
    """Reference module names in the diffusers layout, or the original Cosmos release's."""
    if not original:
        return dict(blocks="transformer_blocks", patch="patch_embed.proj", t_emb="time_embed.t_embedder",
                    t_norm="time_embed.norm", out_mod="norm_out", out="proj_out", mod=("norm1", "norm2", "norm3"),
                    lin=("linear_1", "linear_2"), attn=("attn1", "attn2"),
                    qkvo=("to_q", "to_k", "to_v", "to_out.0"), qk_norm=("norm_q", "norm_k"),
                    ff=("ff.net.0.proj", "ff.net.2"), pos="learnable_pos_embed", ctx="crossattn_proj.0")
    return dict(blocks="net.blocks", patch="net.x_embedder.proj.1", t_emb="net.t_embedder.1",
                t_norm="net.t_embedding_norm", out_mod="net.final_layer.adaln_modulation",
                out="net.final_layer.linear",
                mod=("adaln_modulation_self_attn", "adaln_modulation_cross_attn", "adaln_modulation_mlp"),
                lin=("1", "2"), attn=("self_attn", "cross_attn"), qkvo=("q_proj", "k_proj", "v_proj", "output_proj"),
                qk_norm=("q_norm", "k_norm"), ff=("mlp.layer1", "mlp.layer2"), pos="net.extra_pos_embedder",
                ctx="net.crossattn_proj.0")


def keymap(cfg: CosmosDiTConfig, original: bool = False) -> KeyMap:
    """Reference tensor names (diffusers, or the original release with ``original``) -> NNX state paths."""
    n = _names(original)
    l1, l2 = n["lin"]
    top = [(f"{n['patch']}.weight", "embed.patch.kernel", "linear"),
           *_linear(f"{n['t_emb']}.linear_1", "embed.t1"), *_linear(f"{n['t_emb']}.linear_2", "embed.t2"),
           *_norm(n["t_norm"], "embed.t_norm"),
           *_linear(f"{n['out_mod']}.{l1}", "head.mod.l1"), *_linear(f"{n['out_mod']}.{l2}", "head.mod.l2"),
           *_linear(n["out"], "head.proj")]
    if cfg.use_crossattn_projection:
        top += _linear(n["ctx"], "embed.ctx_proj", bias=True)
    if cfg.extra_pos_embed_type == "learnable":
        top += [(f"{n['pos']}.pos_emb_{a}", f"embed.pos_{a}", "none") for a in "thw"]
    block = []
    for ref, dst in zip(n["mod"], ("mod1", "mod2", "mod3")):
        block += _linear(f"{ref}.{l1}", f"{dst}.l1") + _linear(f"{ref}.{l2}", f"{dst}.l2")
    for ref_a, dst_a in zip(n["attn"], ("attn1", "attn2")):
        for ref, dst in zip(n["qkvo"], "qkvo"):
            block += _linear(f"{ref_a}.{ref}", f"{dst_a}.{dst}")
        block += _norm(f"{ref_a}.{n['qk_norm'][0]}", f"{dst_a}.norm_q") + _norm(f"{ref_a}.{n['qk_norm'][1]}",
                                                                                f"{dst_a}.norm_k")
    block += _linear(n["ff"][0], "ffn.up") + _linear(n["ff"][1], "ffn.down")
    ignore = ([r"^net\.accum_", r"^net\.pos_embedder\.", r"_extra_state$", r"^net\.logvar\."] if original else [])
    return _keymap(top, block, n["blocks"], ignore)


def diffusers_keymap(cfg: CosmosDiTConfig) -> KeyMap:
    return keymap(cfg, original=False)


def original_keymap(cfg: CosmosDiTConfig) -> KeyMap:
    return keymap(cfg, original=True)


def _is_original(names) -> bool:
    return any(n.startswith("net.blocks.") or n.startswith("net.x_embedder.") for n in names)


def config_from_original(ckpt) -> CosmosDiTConfig:
    """The DiT config from an original-release checkpoint's tensor shapes (the release's fixed
    choices: 128-wide heads, (1, 2, 2) patches, max_size (128, 240, 240), rope_scale (1, 3, 3))."""
    sh = {k: tuple(v.shape) for k, v in ckpt.items()}
    d = sh["net.x_embedder.proj.1.weight"][0]
    layers = 1 + max(int(k.split(".")[2]) for k in sh if k.startswith("net.blocks."))
    proj = sh.get("net.crossattn_proj.0.weight")
    patch_in = sh["net.x_embedder.proj.1.weight"][1] // 4
    heads = d // 128 if d % 128 == 0 else 1
    return CosmosDiTConfig(
        in_channels=patch_in - 1, out_channels=sh["net.final_layer.linear.weight"][0] // 4, num_heads=heads,
        head_dim=d // heads, num_layers=layers, mlp_ratio=sh["net.blocks.0.mlp.layer1.weight"][0] / d,
        text_embed_dim=sh["net.blocks.0.cross_attn.k_proj.weight"][1],
        adaln_lora_dim=sh["net.blocks.0.adaln_modulation_self_attn.1.weight"][0],
        extra_pos_embed_type="learnable" if "net.extra_pos_embedder.pos_emb_t" in sh else None,
        use_crossattn_projection=proj is not None,
        crossattn_proj_in_channels=proj[1] if proj else 100352,
        encoder_hidden_states_channels=proj[0] if proj else 1024)


def load_dit(path, cfg: CosmosDiTConfig | None = None, dtype=np.float32):
    """DiT weights from a diffusers folder (config.json + safetensors) or an original-release file
    (``*_ema_bf16.pt`` / safetensors with ``net.*`` names). Returns ``(state, cfg)``: the abstract state
    filled tensor by tensor with host numpy; no random init is materialised."""
    return KIT.load(path, cfg, dtype, from_config=CosmosDiTConfig.from_diffusers, is_original=_is_original,
                    config_from_original=config_from_original, keymap=keymap, what="CosmosTransformer3DModel")


# ----------------------------------------------------------------------------------- compat
def _ref_inputs(cfg: CosmosDiTConfig, hidden_states, timestep, condition_mask, padding_mask):
    """Reference-layout numpy inputs -> (channels-last x, t [B] or [B, F], cond mask, pad mask)."""
    x = np.asarray(hidden_states, np.float32)
    b, _, f, h, w = x.shape
    t = np.asarray(timestep, np.float32)
    if t.ndim == 0:
        t = t[None]
    if t.ndim == 5:
        if t.shape != (b, 1, f, 1, 1):
            raise ValueError(f"Expected timestep to have shape [B, 1, T, 1, 1] = {(b, 1, f, 1, 1)}, got {t.shape}")
        t = t.reshape(b, f)
    elif t.ndim != 1:
        raise ValueError(f"Expected timestep to have shape [B, 1, T, 1, 1] or [T], got {t.shape}")
    cm = None if condition_mask is None else np.asarray(condition_mask, np.float32).transpose(0, 2, 3, 4, 1)
    pm = None
    if cfg.concat_padding_mask:
        if padding_mask is None:
            raise ValueError("this model concatenates a padding mask: pass padding_mask [1, 1, H, W]")
        p = np.asarray(padding_mask, np.float32)
        pm = resize_nearest(p.reshape(-1, *p.shape[-2:]), h, w)
    return jnp.asarray(x.transpose(0, 2, 3, 4, 1)), jnp.asarray(t), cm, pm


class _CosmosDiTCompat(compat.CompatModel):
    def __init__(self, config, state, cfg, runner: DiTRunner | None = None):
        super().__init__("CosmosTransformer3DModel", config, state, cfg)
        self.runner = runner
        self._fwd = jax.jit(partial(forward, cfg=cfg), static_argnames=("fps",)) if runner is None else None

    def forward(self, hidden_states, timestep, encoder_hidden_states, attention_mask=None, fps=None,
                condition_mask=None, padding_mask=None, block_controlnet_hidden_states=None, **_):
        if block_controlnet_hidden_states is not None:
            raise NotImplementedError("controlnet residuals (Cosmos-Transfer2.5) are not ported")
        if isinstance(encoder_hidden_states, tuple):
            raise NotImplementedError("image-context cross-attention ((text, image) context) is not ported")
        cfg = self.model_config
        x, t, cm, pm = _ref_inputs(cfg, hidden_states, timestep, condition_mask, padding_mask)
        ctx = jnp.asarray(np.asarray(encoder_hidden_states, np.float32))
        mask = None if attention_mask is None else jnp.asarray(np.asarray(attention_mask).astype(bool))
        kw = dict(cond_mask=cm, pad_mask=pm, ctx_mask=mask, fps=None if fps is None else float(fps))
        y = self.runner(x, t, ctx, **kw) if self.runner is not None else self._fwd(self.params, x=x, t=t, ctx=ctx, **kw)
        return np.asarray(y).transpose(0, 4, 1, 2, 3)


compat.register_dit("CosmosTransformer3DModel", CosmosDiTConfig.from_diffusers, _CosmosDiTCompat, load_dit, runner,
                    constraints=parallel_constraints)
