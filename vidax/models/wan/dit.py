"""Wan2.1 / Wan2.2 diffusion transformer (diffusers ``WanTransformer3DModel``) as Flax NNX modules.

:class:`WanTransformer` = ``embed`` (patch + timestep / text / image embeddings) -> ``blocks`` (one
:class:`WanBlock` stacked ``num_layers`` times on a leading ``"layers"`` axis, run with
``lax.scan``) -> ``head``. Activations are channels-last; the model takes latents as
``[B, F, H, W, C]``. Covers T2V, I2V (CLIP image tokens through their own key/value
projections, FLF2V's learned image-token positions) and Wan2.2 TI2V's per-token timesteps.

Used as ``graphdef + state``: :func:`forward` is a pure function of the state (it merges the
cached graph definition inside, so ``jax.jit(forward, static_argnums=1)`` compiles once per
shape); :func:`runner` places or streams the same state on a ``(dp, tp, sp)`` mesh through the
one core runner. Every parameter carries logical axis names, mapped to mesh axes by the core table
(``vidax.core.sharding.LOGICAL_AXES``; Wan needs no deltas).
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
from vidax.core.layers import MLP, PatchEmbed, split_heads
from vidax.core.runner import DiTRunner, context_local, run_local
from vidax.core.embeddings import apply_rope_interleaved, rope_3d_angles, sinusoidal_embedding
from vidax.weights import KeyMap, Rule


@dataclass(frozen=True)
class WanDiTConfig(DiTConfig, num_heads=40, num_layers=40):
    patch_size: tuple = (1, 2, 2)
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    cross_attn_norm: bool = True
    eps: float = 1e-6
    image_dim: int | None = None  # CLIP image-embedding width (I2V)
    added_kv_proj_dim: int | None = None  # image key/value projections in cross-attention (I2V)
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None  # FLF2V learned image-token positions

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "WanDiTConfig":
        kw = diffusers_kwargs(cls, cfg)
        qk = cfg.get("qk_norm", "rms_norm_across_heads")
        if qk not in (None, "rms_norm_across_heads"):
            raise ValueError(f"WanTransformer3DModel config: qk_norm={qk!r} is not supported (expected 'rms_norm_across_heads')")
        return cls(**kw)


PRESETS = {
    "tiny": WanDiTConfig(num_heads=2, head_dim=12, in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=48,
                         num_layers=2),
    "1.3b": WanDiTConfig(num_heads=12, head_dim=128, ffn_dim=8960, num_layers=30),
    "14b": WanDiTConfig(num_heads=40, head_dim=128, ffn_dim=13824, num_layers=40),
}


# ----------------------------------------------------------------------------------- modules
F32 = jnp.float32
_zeros = nnx.initializers.zeros_init()


_heads = split_heads


class ImageEmbed(nnx.Module):
    """CLIP image tokens -> model width (I2V): LayerNorm, MLP (exact GELU), LayerNorm; FLF2V adds
    learned positions to the first + last frame's tokens, concatenated."""

    def __init__(self, cfg: WanDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        e, d = cfg.image_dim, cfg.dim
        self.norm1 = nn.LayerNorm(e, eps=1e-5, rngs=rngs, param_dtype=param_dtype)
        self.ff1 = nn.Linear(e, e, rngs=rngs, param_dtype=param_dtype)
        self.ff2 = nn.Linear(e, d, rngs=rngs, axes=(None, "embed"), param_dtype=param_dtype)
        self.norm2 = nn.LayerNorm(d, eps=1e-5, rngs=rngs, axis="embed", param_dtype=param_dtype)
        self.pos = None if cfg.pos_embed_seq_len is None else nn.param(
            rngs, nnx.initializers.normal(0.02), (1, cfg.pos_embed_seq_len, e), None, None, None, dtype=param_dtype)

    def __call__(self, img):
        if self.pos is not None:
            b, s, d = img.shape
            img = img.reshape(-1, 2 * s, d) + self.pos[...]
        h = self.norm1(img.astype(F32))
        return self.norm2(self.ff2(nn.gelu_exact(self.ff1(h))))


class WanEmbed(nnx.Module):
    """Patch embedding + condition embeddings (everything before the blocks); per token, so it
    runs unchanged on a token shard."""

    def __init__(self, cfg: WanDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        self.patch = PatchEmbed(cfg.patch_size, cfg.in_channels, d, **kw)
        self.time_in = MLP(cfg.freq_dim, d, d, "silu", **kw)
        self.time_proj = nn.Linear(d, 6 * d, axes=("embed", None), **kw)
        self.text_in = MLP(cfg.text_dim, d, d, "gelu_tanh", **kw)
        self.img_in = ImageEmbed(cfg, **kw) if cfg.image_dim is not None else None

    def __call__(self, a: dict, par: vsh.ParallelContext = vsh.LOCAL):
        """``a``: ``tokens`` [B, L, pt*ph*pw*C] (compute dtype), ``t`` [B] or [B, T], ``ctx``, ``img``
        (optional), the RoPE ``cos`` / ``sin``. Returns ``({"h"}, consts)``: ``temb`` [B, T, D] and
        ``temb6`` [B, T, 6, D] (float32), the embedded ``ctx`` / ``img_ctx`` and the RoPE tables."""
        cfg = self.cfg
        h = self.patch(a["tokens"])
        t = jnp.asarray(a["t"], F32)
        if t.ndim == 1:
            t = t[:, None]
        temb = self.time_in(sinusoidal_embedding(t, cfg.freq_dim, flip_sin_to_cos=True))
        temb6 = self.time_proj(jax.nn.silu(temb)).reshape(*temb.shape[:-1], 6, cfg.dim)
        consts = {"temb": temb.astype(F32), "temb6": temb6.astype(F32), "cos": a["cos"], "sin": a["sin"]}
        if "ctx" in a:  # (absent when the blocks' text keys / values were computed once: ``context``)
            consts.update(self.kv_context(a, par))
        return {"h": h}, consts

    def kv_context(self, a: dict, par: vsh.ParallelContext = vsh.LOCAL) -> dict:
        """The embedded text ``ctx`` (and I2V ``img_ctx``) the cross-attention keys / values read."""
        ctx = self.text_in(a["ctx"])
        consts = {"ctx": ctx}
        if a.get("img") is not None:
            if self.img_in is None:
                raise ValueError("image embeddings were given but this DiT has no image branch (image_dim is None)")
            consts["img_ctx"] = self.img_in(a["img"]).astype(ctx.dtype)
        return consts


class WanAttention(nnx.Module):
    """Wan attention: q/k/v column-parallel (split by heads under TP), q/k RMS norm across all heads,
    output row-parallel. The cross-attention of an I2V model also has image key/value projections."""

    def __init__(self, cfg: WanDiTConfig, *, rngs: nnx.Rngs, added_kv_dim: int | None = None, param_dtype=F32):
        d = cfg.dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(d, d, axes=("embed", "heads"), **kw)
        self.k = nn.Linear(d, d, axes=("embed", "heads"), **kw)
        self.v = nn.Linear(d, d, axes=("embed", "heads"), **kw)
        self.o = nn.Linear(d, d, axes=("heads", "embed"), **kw)
        self.norm_q = nn.RMSNorm(d, eps=cfg.eps, axis="heads", **kw)
        self.norm_k = nn.RMSNorm(d, eps=cfg.eps, axis="heads", **kw)
        if added_kv_dim is not None:
            self.add_k = nn.Linear(added_kv_dim, d, axes=(None, "heads"), **kw)
            self.add_v = nn.Linear(added_kv_dim, d, axes=(None, "heads"), **kw)
            self.norm_added_k = nn.RMSNorm(d, eps=cfg.eps, axis="heads", **kw)
        else:
            self.add_k = self.add_v = self.norm_added_k = None

    def self_attention(self, x, cos, sin, par: vsh.ParallelContext):
        """RoPE self-attention (Ulysses over ``sp`` inside ``shard_map``)."""
        hd = self.head_dim
        q = _heads(self.norm_q(par.linear(self.q, x), par), hd)
        k = _heads(self.norm_k(par.linear(self.k, x), par), hd)
        v = _heads(par.linear(self.v, x), hd)
        q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        o = par.self_attention(q, k, v)
        return par.linear(self.o, o.reshape(*o.shape[:2], -1))

    def context_kv(self, ctx, img_ctx, par: vsh.ParallelContext) -> dict:
        """The cross-attention keys / values [B, Lt, heads, head_dim] of the text (``k``, ``v``) and,
        I2V, of the image tokens (``ki``, ``vi``): the same every step."""
        hd = self.head_dim
        kv = {"k": _heads(self.norm_k(par.linear(self.k, ctx), par), hd), "v": _heads(par.linear(self.v, ctx), hd)}
        if img_ctx is not None:
            kv["ki"] = _heads(self.norm_added_k(par.linear(self.add_k, img_ctx), par), hd)
            kv["vi"] = _heads(par.linear(self.add_v, img_ctx), hd)
        return kv

    def cross_attention(self, x, ctx, img_ctx, par: vsh.ParallelContext, kv: dict | None = None):
        """Attention to the text tokens (and, I2V, to the image tokens through their own k/v);
        ``kv``: :meth:`context_kv` computed once (then ``ctx`` / ``img_ctx`` are not read)."""
        hd = self.head_dim
        q = _heads(self.norm_q(par.linear(self.q, x), par), hd)
        kv = self.context_kv(ctx, img_ctx, par) if kv is None else kv
        o = par.cross_attention(q, kv["k"], kv["v"])
        o = o.reshape(*o.shape[:2], -1)
        if "ki" in kv:
            oi = par.cross_attention(q, kv["ki"], kv["vi"])
            o = o + oi.reshape(*oi.shape[:2], -1)
        return par.linear(self.o, o)


class FeedForward(nnx.Module):
    """``down(gelu_tanh(up(x)))``: up column-parallel, down row-parallel (split by ``ffn``)."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, param_dtype=F32):
        self.up = nn.Linear(dim, hidden, rngs=rngs, axes=("embed", "ffn"), param_dtype=param_dtype)
        self.down = nn.Linear(hidden, dim, rngs=rngs, axes=("ffn", "embed"), param_dtype=param_dtype)

    def __call__(self, x, par: vsh.ParallelContext):
        return par.linear(self.down, nn.gelu_tanh(par.linear(self.up, x)))


class WanBlock(nnx.Module):
    """One transformer block: modulated self-attention, cross-attention, modulated feed-forward.

    ``par`` makes the same code run on one shard inside ``shard_map``: local heads / FFN columns
    under TP (row-parallel layers reduce across ``tp``, the q/k RMS norms their sum of squares),
    local tokens under SP (self-attention through Ulysses all_to_all)."""

    def __init__(self, cfg: WanDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.sst = nn.param(rngs, nnx.initializers.normal(d**-0.5), (1, 6, d), None, None, "embed", dtype=param_dtype)
        self.norm1 = nn.LayerNorm(d, eps=cfg.eps, affine=False, rngs=rngs)
        self.attn1 = WanAttention(cfg, **kw)
        self.norm2 = nn.LayerNorm(d, eps=cfg.eps, axis="embed", **kw) if cfg.cross_attn_norm else None
        self.attn2 = WanAttention(cfg, added_kv_dim=cfg.added_kv_proj_dim, **kw)
        self.norm3 = nn.LayerNorm(d, eps=cfg.eps, affine=False, rngs=rngs)
        self.ffn = FeedForward(d, cfg.ffn_dim, **kw)

    def __call__(self, x, ctx, img_ctx, temb6, cos, sin, par: vsh.ParallelContext = vsh.LOCAL, kv: dict | None = None):
        """x: [B, L, D] (compute dtype); temb6: [B, T, 6, D] float32 (T = 1 or L); ``kv``: this block's
        cross-attention keys / values computed once (``ctx`` / ``img_ctx`` then unused)."""
        dt = x.dtype
        mod = self.sst[...][None].astype(F32) + temb6  # [B, T, 6, D]
        shift1, scale1, gate1, shift2, scale2, gate2 = (mod[:, :, j] for j in range(6))
        h = (self.norm1(x.astype(F32)) * (1 + scale1) + shift1).astype(dt)
        o = self.attn1.self_attention(h, cos, sin, par)
        x = (x.astype(F32) + o * gate1).astype(dt)
        h = self.norm2(x.astype(F32)).astype(dt) if self.norm2 is not None else x
        x = x + self.attn2.cross_attention(h, ctx, img_ctx, par, kv)
        h = (self.norm3(x.astype(F32)) * (1 + scale2) + shift2).astype(dt)
        f = self.ffn(h, par)
        return (x.astype(F32) + f.astype(F32) * gate2).astype(dt)


class WanHead(nnx.Module):
    """Output norm + modulation + projection, per token -> [B, L, pt*ph*pw*Cout]."""

    def __init__(self, cfg: WanDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        self.norm = nn.LayerNorm(d, eps=cfg.eps, affine=False, rngs=rngs)
        self.proj = nn.Linear(d, cfg.out_channels * math.prod(cfg.patch_size), rngs=rngs, axes=("embed", None),
                              param_dtype=param_dtype)
        self.sst = nn.param(rngs, nnx.initializers.normal(d**-0.5), (1, 2, d), None, None, "embed", dtype=param_dtype)

    def __call__(self, carry, consts, par: vsh.ParallelContext = vsh.LOCAL):
        h = carry["h"]
        dt = h.dtype
        mod = self.sst[...][None].astype(F32) + consts["temb"][:, :, None, :]  # [B, T, 2, D]
        shift, scale = mod[:, :, 0], mod[:, :, 1]
        return {"y": self.proj((self.norm(h.astype(F32)) * (1 + scale) + shift).astype(dt))}


class WanTransformer(nn.LatentPatches, nn.StackedDiT):
    """The Wan DiT: ``embed`` -> stacked ``blocks`` -> ``head``, with the hooks of
    :class:`vidax.core.runner.DiTRunner` (``pack`` / ``prepare`` / ``finish`` patchify around them)."""

    EMBED, BLOCK, HEAD = WanEmbed, WanBlock, WanHead
    #: the inputs only the cross-attention keys / values read (computed once per sample stage)
    CONTEXT = ("ctx", "img")
    #: TeaCache's modulated input: the timestep projection (the published coefficients' ``e0``)
    TEACACHE_INPUT = "temb6"

    @staticmethod
    def step(blk, carry, c, par):
        return {"h": blk(carry["h"], c.get("ctx"), c.get("img_ctx"), c["temb6"], c["cos"], c["sin"], par, c.get("kv"))}

    @staticmethod
    def kv(blk, c, par):
        """This block's text (and image) cross-attention keys / values, from ``embed.kv_context``."""
        return blk.attn2.context_kv(c["ctx"], c.get("img_ctx"), par)

    @staticmethod
    def act_spec(name: str, shape: tuple) -> tuple:
        """Logical axes of an activation (see ``vidax.core.sharding.activation_axes``)."""
        return vsh.activation_axes(name, shape, tokens=("tokens", "h", "y"), tables=("cos", "sin"),
                                   kv=("k", "v", "ki", "vi"), per_token=("t", "temb", "temb6"))

    @staticmethod
    def pack(x, t, ctx, img=None) -> dict:
        """The call signature: ``x`` [B, F, H, W, C] latents, ``t`` [B] or per-token [B, L], ``ctx``
        [B, Lt, text_dim], ``img`` [B, Li, image_dim] or None."""
        return {"x": x, "t": jnp.asarray(t, F32), "ctx": ctx, "img": img}

    def prepare(self, a: dict, dtype) -> dict:
        out = {"tokens": patchify(self.cfg, a["x"].astype(dtype))[0], "t": a["t"].astype(F32),
               "cos": a["cos"], "sin": a["sin"]}
        if "ctx" in a:
            out["ctx"] = a["ctx"].astype(dtype)
        if "img" in a:
            out["img"] = a["img"].astype(dtype)
        return out

    def check(self, shapes: dict, mesh) -> None:
        """Input errors (patch size, per-token timesteps, tokens / batch against the mesh)."""
        tokens = math.prod(token_grid(self.cfg, shapes["x"]))
        t_shape = shapes.get("t")
        if t_shape is not None and len(t_shape) == 2 and t_shape[1] not in (1, tokens):
            raise ValueError(f"per-token timesteps: t has {t_shape[1]} entries per sample, the latents give {tokens} tokens")
        vmesh.check_divisible(parallel_constraints(self.cfg, tokens=tokens, batch=shapes["x"][0]), mesh)

    def table_key(self, shapes: dict):
        return token_grid(self.cfg, shapes["x"])

    def tables(self, grid) -> dict:
        cos, sin = rope_tables(self.cfg, grid)
        return {"cos": cos, "sin": sin}

    def __call__(self, x, t, ctx, img=None, *, par: vsh.ParallelContext = vsh.LOCAL, rope=None, context=None):
        """Velocity prediction. ``x``: [B, F, H, W, C] latents; ``t``: [B] (or [B, L] per-token);
        ``ctx``: [B, Lt, text_dim]; ``img``: [B, Li, image_dim] or None; ``rope``: the (cos, sin)
        tables of the token grid (:func:`rope_tables`; computed here when None); ``context``: the
        blocks' keys / values from :meth:`context` (``ctx`` / ``img`` then unused). Returns
        [B, F, H, W, Cout]."""
        inputs = {k: v for k, v in self.pack(x, t, ctx, img).items() if v is not None}
        if context is not None:
            inputs = {k: v for k, v in inputs.items() if k not in self.CONTEXT}
        cos, sin = rope_tables(self.cfg, token_grid(self.cfg, jnp.shape(x))) if rope is None else rope
        return run_local(self, inputs, {"cos": cos, "sin": sin}, self.embed.patch.kernel[...].dtype, par, context)

    def context(self, ctx, img=None, *, par: vsh.ParallelContext = vsh.LOCAL) -> dict:
        """The blocks' cross-attention keys / values of ``ctx`` [B, Lt, text_dim] (and ``img``):
        computed once per sample stage, passed to every step as ``context``."""
        return context_local(self, {"ctx": ctx, "img": img}, self.embed.patch.kernel[...].dtype, par)


# ----------------------------------------------------------------------------------- state
KIT = nn.ModelKit(WanTransformer, units=("embed", "blocks", "head"), dtype_leaf=("embed", "patch", "kernel"))
#: seeded random modules for presets and tests, the abstract state a checkpoint fills, its shapes
#: (the key maps' target), the graphdefs the runner merges unit by unit, the state's dtype, and
#: the module back from a state inside a traced function (the unit of ``jit``): see ``nn.ModelKit``
_build, init_model, init_state, abstract_state = KIT.build, KIT.init_model, KIT.init_state, KIT.abstract_state
param_shapes, graphdefs, state_dtype, merge = KIT.param_shapes, KIT.graphdefs, KIT.state_dtype, KIT.merge


# ----------------------------------------------------------------------------------- forward
def token_grid(cfg: WanDiTConfig, x_shape) -> tuple:
    """The (f, h, w) token grid of channels-last latents of shape ``x_shape``."""
    return geometry.token_grid(x_shape[1:4], cfg.patch_size)


def patchify(cfg: WanDiTConfig, x):
    """[B, F, H, W, C] -> tokens [B, f*h*w, pt*ph*pw*C] and the token grid (f, h, w)."""
    return geometry.patchify(x, cfg.patch_size)


def unpatchify(cfg: WanDiTConfig, y, grid):
    return geometry.unpatchify(y, grid, cfg.patch_size)


def rope_tables(cfg: WanDiTConfig, grid):
    for g in grid:
        if g > cfg.rope_max_seq_len:
            raise ValueError(f"token grid {grid} exceeds rope_max_seq_len={cfg.rope_max_seq_len}")
    ang = rope_3d_angles(cfg.head_dim, grid)
    return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def forward(state, cfg: WanDiTConfig, x, t, ctx, img=None, *, attn_impl=None, rope=None, context=None):
    """Velocity prediction from a state (pure: ``jax.jit(forward, static_argnums=1)``). ``x``:
    [B, F, H, W, C] latents; ``t``: [B] (or [B, L] per-token); ``ctx``: [B, Lt, text_dim]; ``img``:
    [B, Li, image_dim] or None; ``rope``: (cos, sin) from :func:`rope_tables` to pass them as
    arguments (else they are computed into the program). Returns [B, F, H, W, Cout].

    Single-device (or compiler-partitioned) path; for meshes and offloading see :func:`runner`."""
    return merge(state, cfg)(x, t, ctx, img, par=vsh.ParallelContext(attn_impl=attn_impl), rope=rope, context=context)


def context(state, cfg: WanDiTConfig, ctx, img=None, *, attn_impl=None) -> dict:
    """The blocks' text (and image) cross-attention keys / values from a state (pure): computed once
    per sample stage and passed to every :func:`forward` as ``context`` (``ctx`` / ``img`` unused)."""
    return merge(state, cfg).context(ctx, img, par=vsh.ParallelContext(attn_impl=attn_impl))


# ----------------------------------------------------------------------------------- sharding
def parallel_constraints(cfg: WanDiTConfig, *, tokens: int | None = None, batch: int | None = None):
    """Divisibility rules of the Wan DiT on a (dp, tp, sp) mesh. The text (and image-token)
    length has none: cross-attention keys are replicated over sp and split by heads over tp."""
    r = [vmesh.UlyssesHeads("num_heads", cfg.num_heads),
         vmesh.Divisible("ffn_dim", cfg.ffn_dim, ("tp",), "FFN up/down are split over tp")]
    return r + vmesh.input_rules(tokens, batch)


def runner(state, cfg: WanDiTConfig, mesh=None, parallelism=None, **kw) -> DiTRunner:
    """The Wan DiT on a ``(dp, tp, sp)`` mesh (``vidax.core.runner.DiTRunner``): weights placed by
    their logical axes (TP splits heads and FFN width; SP the tokens, Ulysses), the batch split over
    dp (CFG-parallel when it is the 2B conditional+unconditional batch), the blocks resident or
    streamed with ``offload_chunk_size``. Called as ``runner(x, t, ctx, img)`` (:func:`forward`'s
    contract)."""
    return KIT.runner(state, cfg, mesh, parallelism, constraints=parallel_constraints(cfg), **kw)


# ----------------------------------------------------------------------------------- key maps
# Reference tensor names -> paths of the NNX state (``nnx.to_pure_dict``): ``embed.*``, ``blocks.*``
# (stacked: ``{i}`` is the layer), ``head.*``; linear layers are ``kernel`` [in, out] + ``bias``,
# norms ``scale`` (+ ``bias``).
def _linear(ref: str, dst: str) -> list[tuple[str, str, str]]:
    return [(f"{ref}.weight", f"{dst}.kernel", "linear"), (f"{ref}.bias", f"{dst}.bias", "none")]


def _norm(ref: str, dst: str, bias: bool = True) -> list[tuple[str, str, str]]:
    return [(f"{ref}.weight", f"{dst}.scale", "none")] + ([(f"{ref}.bias", f"{dst}.bias", "none")] if bias else [])


def _keymap(top: list, block: list, ignore=()) -> KeyMap:
    """``top``: (reference name, state path, kind); ``block``: the same relative to one block
    (``blocks.{i}.<ref>`` -> ``blocks.<dst>``)."""
    rules = [Rule(s, d, k) for s, d, k in top]
    rules += [Rule(f"blocks.{{i}}.{s}", f"blocks.{d}", k) for s, d, k in block]
    return KeyMap(rules, ignore=ignore)


def diffusers_keymap(cfg: WanDiTConfig) -> KeyMap:
    ce = "condition_embedder"
    top = [("patch_embedding.weight", "embed.patch.kernel", "conv3d"), ("patch_embedding.bias", "embed.patch.bias", "none"),
           *_linear(f"{ce}.time_embedder.linear_1", "embed.time_in.l1"),
           *_linear(f"{ce}.time_embedder.linear_2", "embed.time_in.l2"),
           *_linear(f"{ce}.time_proj", "embed.time_proj"),
           *_linear(f"{ce}.text_embedder.linear_1", "embed.text_in.l1"),
           *_linear(f"{ce}.text_embedder.linear_2", "embed.text_in.l2"),
           *_norm(f"{ce}.image_embedder.norm1", "embed.img_in.norm1"),
           *_linear(f"{ce}.image_embedder.ff.net.0.proj", "embed.img_in.ff1"),
           *_linear(f"{ce}.image_embedder.ff.net.2", "embed.img_in.ff2"),
           *_norm(f"{ce}.image_embedder.norm2", "embed.img_in.norm2"),
           (f"{ce}.image_embedder.pos_embed", "embed.img_in.pos", "none"),
           *_linear("proj_out", "head.proj"), ("scale_shift_table", "head.sst", "none")]
    block = [("scale_shift_table", "sst", "none"), *_norm("norm2", "norm2"),
             *_linear("ffn.net.0.proj", "ffn.up"), *_linear("ffn.net.2", "ffn.down")]
    for a in ("attn1", "attn2"):
        for n, ref in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0")):
            block += _linear(f"{a}.{ref}", f"{a}.{n}")
        block += _norm(f"{a}.norm_q", f"{a}.norm_q", bias=False) + _norm(f"{a}.norm_k", f"{a}.norm_k", bias=False)
    block += [*_linear("attn2.add_k_proj", "attn2.add_k"), *_linear("attn2.add_v_proj", "attn2.add_v"),
              *_norm("attn2.norm_added_k", "attn2.norm_added_k", bias=False)]
    return _keymap(top, block, ignore=[r"\.norm_added_q\."])


def original_keymap(cfg: WanDiTConfig) -> KeyMap:
    """Names used by the original Wan release (``diffusion_pytorch_model*.safetensors`` of Wan-AI/Wan2.1-*)."""
    top = [("patch_embedding.weight", "embed.patch.kernel", "conv3d"), ("patch_embedding.bias", "embed.patch.bias", "none"),
           *_linear("time_embedding.0", "embed.time_in.l1"), *_linear("time_embedding.2", "embed.time_in.l2"),
           *_linear("time_projection.1", "embed.time_proj"),
           *_linear("text_embedding.0", "embed.text_in.l1"), *_linear("text_embedding.2", "embed.text_in.l2"),
           *_norm("img_emb.proj.0", "embed.img_in.norm1"), *_linear("img_emb.proj.1", "embed.img_in.ff1"),
           *_linear("img_emb.proj.3", "embed.img_in.ff2"), *_norm("img_emb.proj.4", "embed.img_in.norm2"),
           ("img_emb.emb_pos", "embed.img_in.pos", "none"),
           *_linear("head.head", "head.proj"), ("head.modulation", "head.sst", "none")]
    block = [("modulation", "sst", "none"), *_norm("norm3", "norm2"),
             *_linear("ffn.0", "ffn.up"), *_linear("ffn.2", "ffn.down")]
    for a, ref_a in (("attn1", "self_attn"), ("attn2", "cross_attn")):
        for n in ("q", "k", "v", "o"):
            block += _linear(f"{ref_a}.{n}", f"{a}.{n}")
        block += _norm(f"{ref_a}.norm_q", f"{a}.norm_q", bias=False) + _norm(f"{ref_a}.norm_k", f"{a}.norm_k", bias=False)
    block += [*_linear("cross_attn.k_img", "attn2.add_k"), *_linear("cross_attn.v_img", "attn2.add_v"),
              *_norm("cross_attn.norm_k_img", "attn2.norm_added_k", bias=False)]
    return _keymap(top, block)


def _is_original(names) -> bool:
    return any(n.startswith(("blocks.0.self_attn.", "head.head.")) for n in names)


def config_from_original(ckpt) -> WanDiTConfig:
    """Infer the DiT config from an original-format checkpoint's tensor shapes."""
    sh = {k: tuple(v.shape) for k, v in ckpt.items()}
    d, cin = sh["patch_embedding.weight"][:2]
    pt, ph, pw = sh["patch_embedding.weight"][2:]
    layers = 1 + max(int(k.split(".")[1]) for k in sh if k.startswith("blocks."))
    head_out = sh["head.head.weight"][0]
    num_heads = d // 128 if d % 128 == 0 else max(1, d // 64)
    img = sh.get("img_emb.proj.0.weight")
    return WanDiTConfig(
        patch_size=(pt, ph, pw), num_heads=num_heads, head_dim=d // num_heads, in_channels=cin,
        out_channels=head_out // (pt * ph * pw), text_dim=sh["text_embedding.0.weight"][1],
        freq_dim=sh["time_embedding.0.weight"][1], ffn_dim=sh["blocks.0.ffn.0.weight"][0], num_layers=layers,
        cross_attn_norm="blocks.0.norm3.weight" in sh, image_dim=None if img is None else img[0],
        added_kv_proj_dim=None if img is None else sh["blocks.0.cross_attn.k_img.weight"][1],
        pos_embed_seq_len=sh["img_emb.emb_pos"][1] if "img_emb.emb_pos" in sh else None,
    )


def load_dit(path, cfg: WanDiTConfig | None = None, dtype=np.float32):
    """Load DiT weights from a diffusers folder (config.json + safetensors) or an original-release
    checkpoint (file or folder). Returns ``(state, cfg)``: the abstract state filled tensor by
    tensor with host numpy (cast on the host); no random init is ever materialised."""
    return KIT.load(path, cfg, dtype, from_config=WanDiTConfig.from_diffusers, is_original=_is_original,
                    config_from_original=config_from_original, prefix="model.diffusion_model.", keep_others=True,
                    keymap=(diffusers_keymap, original_keymap), what="WanTransformer3DModel")


# ----------------------------------------------------------------------------------- compat
class _WanDiTCompat(compat.CompatModel):
    def __init__(self, config, state, cfg, runner: DiTRunner | None = None):
        super().__init__("WanTransformer3DModel", config, state, cfg)
        self.runner = runner
        if runner is None:
            self._fwd = jax.jit(partial(forward, cfg=cfg))
        else:
            self.params = None if runner.offload is not None else runner.params
            self._fwd = lambda params, x, t, ctx, img: runner(x, t, ctx, img)

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image=None, **_):
        x = jnp.asarray(np.asarray(hidden_states, np.float32)).transpose(0, 2, 3, 4, 1)
        img = None if encoder_hidden_states_image is None else jnp.asarray(encoder_hidden_states_image, jnp.float32)
        t = jnp.asarray(np.asarray(timestep), jnp.float32)
        if t.ndim == 0:
            t = jnp.broadcast_to(t, (x.shape[0],))
        y = self._fwd(self.params, x=x, t=t, ctx=jnp.asarray(encoder_hidden_states, jnp.float32), img=img)
        return np.asarray(y).transpose(0, 4, 1, 2, 3)


compat.register_dit("WanTransformer3DModel", WanDiTConfig.from_diffusers, _WanDiTCompat, load_dit, runner,
                    constraints=parallel_constraints)
