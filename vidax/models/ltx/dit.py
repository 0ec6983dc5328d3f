"""LTX-Video 0.9.x diffusion transformer (diffusers ``LTXVideoTransformer3DModel``) as Flax NNX modules.

:class:`LTXTransformer` = ``embed`` (token projection, AdaLN-single timestep embedding, caption
projection) -> ``blocks`` (one :class:`LTXBlock` stacked ``num_layers`` times, ``lax.scan``) ->
``head``. Tokens are the pipeline's packed latents ``[B, S, C]`` (patch 1: one token per latent
cell, frame-major), as the reference takes them. Self-attention uses 3D rotary embeddings from
(frame, height, width) scaled by ``rope_interpolation_scale`` (or precomputed ``video_coords``);
cross-attention honours the T5 mask as the reference does (an additive ``-10000`` on padded keys);
``timestep`` is ``[B]`` or per token ``[B, S]`` (image-to-video: 0 on the known first frame).

Runs on one device (:func:`forward`, ``jax.jit`` compiles once per shape) or on a mesh / with
offloaded blocks through :class:`vidax.core.runner.DiTRunner` (:func:`runner`).
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
from vidax.core.config import diffusers_kwargs
from vidax.core import mesh as vmesh
from vidax.core import nn
from vidax.core import sharding as vsh
from vidax.models.ltx import layers as L
from vidax.core.runner import DiTRunner, context_local, run_local
from vidax.weights import KeyMap, Rule

F32 = jnp.float32


@dataclass(frozen=True)
class LTXDiTConfig(L.LTXDiTFields, head_dim=64, num_layers=28):
    base_num_frames: int = 20
    theta: float = 10000.0

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "LTXDiTConfig":
        kw = diffusers_kwargs(cls, cfg)
        for key, want in (("qk_norm", "rms_norm_across_heads"), ("activation_fn", "gelu-approximate"),
                          ("norm_elementwise_affine", False)):
            if key in cfg and cfg[key] != want:
                raise ValueError(f"LTXVideoTransformer3DModel config: {key}={cfg[key]!r} is not supported (expected {want!r})")
        if kw.get("cross_attention_dim", cls.cross_attention_dim) != kw.get("num_heads", cls.num_heads) * kw.get("head_dim",
                                                                                                                 cls.head_dim):
            raise ValueError("LTXVideoTransformer3DModel config: cross_attention_dim must equal the model width "
                             "(the caption projection feeds the cross-attention)")
        return cls(**kw)


PRESETS = {
    "tiny": LTXDiTConfig(in_channels=8, out_channels=8, num_heads=2, head_dim=12, cross_attention_dim=24,
                         num_layers=2, caption_channels=32),
    "2b": LTXDiTConfig(),
    "13b": LTXDiTConfig(num_heads=32, head_dim=128, cross_attention_dim=4096, num_layers=48),
}


# ----------------------------------------------------------------------------------- modules
class LTXEmbed(nnx.Module):
    def __init__(self, cfg: LTXDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        self.proj_in = nn.Linear(cfg.in_channels, d, axes=(None, "embed"), **kw)
        self.time = L.AdaLNSingle(d, 6, **kw)
        self.caption = L.TextProjection(cfg.caption_channels, d, **kw)

    def __call__(self, a, par=vsh.LOCAL):
        dt = self.proj_in.kernel[...].dtype
        h = self.proj_in(a["tokens"].astype(dt))
        t = a["t"]
        t = t[:, None] if t.ndim == 1 else t
        temb, emb = self.time(t, dt)  # [B, T, 6D], [B, T, D]
        b, n = temb.shape[:2]
        consts = {"temb6": temb.reshape(b, n, 6, -1).astype(F32), "emb": emb.astype(F32),
                  "bias": a["bias"], "cos": a["cos"], "sin": a["sin"]}
        if "ctx" in a:  # (absent when the blocks' text keys / values were computed once)
            consts.update(self.kv_context(a, par))
        return {"h": h}, consts

    def kv_context(self, a, par=vsh.LOCAL) -> dict:
        """The projected caption the cross-attention keys / values read."""
        return {"ctx": self.caption(a["ctx"].astype(self.proj_in.kernel[...].dtype))}


class LTXBlock(nnx.Module):
    def __init__(self, cfg: LTXDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.eps = cfg.norm_eps
        self.sst = nn.param(rngs, nnx.initializers.normal(d ** -0.5), (6, d), None, "embed", dtype=param_dtype)
        ak = dict(bias=cfg.attention_bias, out_bias=cfg.attention_out_bias, eps=1e-5, **kw)
        self.attn1 = L.Attention(d, cfg.num_heads, cfg.head_dim, **ak)
        self.attn2 = L.Attention(d, cfg.num_heads, cfg.head_dim, kvdim=cfg.cross_attention_dim, **ak)
        self.ff = L.FeedForward(d, **kw)
        self.head_dim = cfg.head_dim

    def __call__(self, x, c, par=vsh.LOCAL):
        dt = x.dtype
        mod = self.sst[...].astype(F32) + c["temb6"]  # [B, T, 6, D]
        shift1, scale1, gate1, shift2, scale2, gate2 = (mod[:, :, j] for j in range(6))
        h = (L.rms(x, self.eps).astype(F32) * (1 + scale1) + shift1).astype(dt)
        rope = ("interleaved", c["cos"], c["sin"])
        o = self.attn1(h, q_rope=rope, par=par, mode="self")
        x = (x.astype(F32) + o.astype(F32) * gate1).astype(dt)
        x = x + self.attn2(x, c.get("ctx"), bias=c["bias"], par=par, mode="cross", kv=c.get("kv"))
        h = (L.rms(x, self.eps).astype(F32) * (1 + scale2) + shift2).astype(dt)
        f = self.ff(h, par)
        return (x.astype(F32) + f.astype(F32) * gate2).astype(dt)


class LTXHead(nnx.Module):
    def __init__(self, cfg: LTXDiTConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        self.sst = nn.param(rngs, nnx.initializers.normal(d ** -0.5), (2, d), None, "embed", dtype=param_dtype)
        self.proj_out = nn.Linear(d, cfg.out_channels, rngs=rngs, axes=("embed", None), param_dtype=param_dtype)

    def __call__(self, carry, c, par=vsh.LOCAL):
        h = carry["h"]
        mod = self.sst[...].astype(F32)[None, None] + c["emb"][:, :, None]  # [B, T, 2, D]
        shift, scale = mod[:, :, 0], mod[:, :, 1]
        y = (L.layer_norm(h, 1e-6).astype(F32) * (1 + scale) + shift).astype(h.dtype)
        return {"y": self.proj_out(y)}


class LTXTransformer(nn.TextDiT):
    """The LTX-Video DiT: ``embed`` -> stacked ``blocks`` -> ``head`` over named activations."""

    EMBED, BLOCK, HEAD = LTXEmbed, LTXBlock, LTXHead

    @staticmethod
    def act_spec(name: str, shape: tuple) -> tuple:
        """Logical axes of an activation (see ``vidax.core.sharding.activation_axes``)."""
        if name in ("cos", "sin"):  # the rotary width goes with the heads
            return (None if shape[0] == 1 else "batch", "tokens", "heads", *(None,) * (len(shape) - 3))
        return vsh.activation_axes(name, shape, tokens=("tokens", "h", "y"), kv=("k", "v"), per_token=("t", "temb6", "emb"))

    def __call__(self, inputs: dict, par=vsh.LOCAL, context: dict | None = None) -> dict:
        """``context``: the blocks' keys / values from :meth:`context` (``inputs["ctx"]`` then unused)."""
        if context is not None:
            inputs = {k: v for k, v in inputs.items() if k not in self.CONTEXT}
        return run_local(self, inputs, {}, self.embed.proj_in.kernel[...].dtype, par, context)

    def context(self, ctx, par=vsh.LOCAL) -> dict:
        """The blocks' text keys / values of ``ctx`` [B, L, caption_channels]: once per sample stage."""
        return context_local(self, {"ctx": ctx}, self.embed.proj_in.kernel[...].dtype, par)


# ----------------------------------------------------------------------------------- rotary tables
def video_coords(num_frames: int, height: int, width: int, rope_interpolation_scale=None, cfg: LTXDiTConfig = None,
                 batch: int = 1) -> np.ndarray:
    """The reference's fractional (frame, height, width) grid [B, S, 3] (float32) for latent
    ``num_frames x height x width`` tokens, scaled by ``rope_interpolation_scale`` (the pipelines pass
    ``(temporal_ratio / frame_rate, spatial_ratio, spatial_ratio)``)."""
    cfg = cfg or LTXDiTConfig()
    f32 = np.float32
    g = np.stack(np.meshgrid(np.arange(num_frames, dtype=f32), np.arange(height, dtype=f32),
                             np.arange(width, dtype=f32), indexing="ij"), axis=0)  # [3, F, H, W]
    if rope_interpolation_scale is not None:
        s = [np.asarray(v, f32) for v in rope_interpolation_scale]
        g = g.copy()
        g[0] = g[0] * s[0] * f32(cfg.patch_size_t) / f32(cfg.base_num_frames)
        g[1] = g[1] * s[1] * f32(cfg.patch_size) / f32(cfg.base_height)
        g[2] = g[2] * s[2] * f32(cfg.patch_size) / f32(cfg.base_width)
    g = g.reshape(3, -1).T.astype(f32)
    return np.broadcast_to(g[None], (batch, *g.shape))


def grid_from_coords(video_coords_: np.ndarray, cfg: LTXDiTConfig) -> np.ndarray:
    """Precomputed ``video_coords`` [B, 3, S] (the reference's argument) -> the grid [B, S, 3]."""
    vc = np.asarray(video_coords_, np.float32)
    return np.stack([vc[:, 0] / np.float32(cfg.base_num_frames), vc[:, 1] / np.float32(cfg.base_height),
                     vc[:, 2] / np.float32(cfg.base_width)], axis=-1)


def rope_tables(grid: np.ndarray, cfg: LTXDiTConfig):
    """cos, sin [B, S, dim] (interleaved pairs over the whole width, ``dim % 6`` identity channels
    first), float32, from the grid [B, S, 3] -- ``LTXVideoRotaryPosEmbed``."""
    dim = cfg.dim
    n = dim // 6
    freqs = np.float32(cfg.theta) ** np.linspace(0.0, 1.0, n, dtype=np.float32)
    freqs = (freqs * np.float32(math.pi / 2.0)).astype(np.float32)
    ang = freqs[None, None, None, :] * (np.asarray(grid, np.float32)[..., None] * 2 - 1)  # [B, S, 3, n]
    ang = np.swapaxes(ang, -1, -2).reshape(*ang.shape[:2], 3 * n)
    cos = np.repeat(np.cos(ang), 2, axis=-1)
    sin = np.repeat(np.sin(ang), 2, axis=-1)
    pad = dim % 6
    if pad:
        cos = np.concatenate([np.ones((*cos.shape[:2], pad), np.float32), cos], axis=-1)
        sin = np.concatenate([np.zeros((*sin.shape[:2], pad), np.float32), sin], axis=-1)
    return cos.astype(np.float32), sin.astype(np.float32)


def model_inputs(cfg: LTXDiTConfig, tokens, t, ctx, mask, cos, sin) -> dict:
    b = tokens.shape[0]
    t = jnp.asarray(t, F32)
    if t.ndim == 0:
        t = jnp.broadcast_to(t, (b,))
    mask = jnp.ones(ctx.shape[:2], F32) if mask is None else jnp.asarray(mask, F32)
    out = {"tokens": jnp.asarray(tokens), "t": t, "bias": L.mask_bias(mask), "cos": jnp.asarray(cos), "sin": jnp.asarray(sin)}
    if ctx is not None:  # (None: the text keys / values were computed once, ``context``)
        out["ctx"] = jnp.asarray(ctx)
    return out


# ----------------------------------------------------------------------------------- state
KIT = nn.ModelKit(LTXTransformer, units=("embed", "blocks", "head"), dtype_leaf=("embed", "proj_in", "kernel"))
abstract_state, param_shapes, abstract_model, state_dtype = (KIT.abstract_state, KIT.param_shapes, KIT.abstract_model,
                                                             KIT.state_dtype)


def init_state(cfg: LTXDiTConfig, seed: int = 0, dtype=np.float32) -> nnx.State:
    """Seeded random weights (every parameter perturbed), host numpy."""
    return L.seeded_state(lambda: KIT.build(cfg, 0, dtype), seed)


def forward(state, cfg: LTXDiTConfig, inputs: dict, *, attn_impl=None, context=None) -> dict:
    """``{"y": [B, S, Cout]}`` from a state and :func:`model_inputs` (pure; ``jax.jit(forward,
    static_argnums=1)`` compiles once per shape); ``context``: :func:`context`'s keys / values."""
    m = KIT.merge(state, cfg)
    return m(inputs, vsh.ParallelContext(attn_impl=attn_impl), context)


def context(state, cfg: LTXDiTConfig, ctx, *, attn_impl=None) -> dict:
    """The blocks' text keys / values from a state (pure): once per sample stage, then every
    :func:`forward` takes them as ``context``."""
    m = KIT.merge(state, cfg)
    return m.context(ctx, vsh.ParallelContext(attn_impl=attn_impl))


# ----------------------------------------------------------------------------------- sharding
def parallel_constraints(cfg: LTXDiTConfig, *, tokens: int | None = None, batch: int | None = None):
    r = [vmesh.UlyssesHeads("num_heads", cfg.num_heads),
         vmesh.Divisible("ffn_dim", 4 * cfg.dim, ("tp",), "FFN up/down are split over tp")]
    return r + vmesh.input_rules(tokens, batch, what="video tokens")


def runner(state, cfg: LTXDiTConfig, mesh=None, parallelism=None, **kw) -> DiTRunner:
    """The DiT on a (dp, tp, sp) mesh, resident or with ``offload_chunk_size`` blocks streamed."""
    return KIT.runner(state, cfg, mesh, parallelism, constraints=parallel_constraints(cfg), **kw)


# ----------------------------------------------------------------------------------- key maps
def diffusers_keymap(cfg: LTXDiTConfig) -> KeyMap:
    top = [*L.lin("proj_in", "embed.proj_in"),
           *L.lin("time_embed.emb.timestep_embedder.linear_1", "embed.time.emb.l1"),
           *L.lin("time_embed.emb.timestep_embedder.linear_2", "embed.time.emb.l2"),
           *L.lin("time_embed.linear", "embed.time.linear"),
           *L.lin("caption_projection.linear_1", "embed.caption.l1"),
           *L.lin("caption_projection.linear_2", "embed.caption.l2"),
           ("scale_shift_table", "head.sst", "none"), *L.lin("proj_out", "head.proj_out")]
    ab = dict(bias=cfg.attention_bias, out_bias=cfg.attention_out_bias)
    block = [("scale_shift_table", "sst", "none"), *L.attn_keys("attn1", "attn1", **ab),
             *L.attn_keys("attn2", "attn2", **ab), *L.ff_keys("ff", "ff")]
    rules = [Rule(s, d, k) for s, d, k in top] + [Rule(f"transformer_blocks.{{i}}.{s}", f"blocks.{d}", k) for s, d, k in block]
    return KeyMap(rules)


def original_keymap(cfg: LTXDiTConfig) -> KeyMap:
    """Names of the original LTX-Video release (``ltx-video-2b-v0.9*.safetensors``, the DiT under
    ``model.diffusion_model.``): ``patchify_proj``, ``adaln_single``, ``q_norm`` / ``k_norm``."""
    ren = (("proj_in", "patchify_proj"), ("time_embed", "adaln_single"), ("norm_q", "q_norm"), ("norm_k", "k_norm"))

    def orig(src):
        for a, b in ren:
            src = src.replace(a, b)
        return src

    return KeyMap([Rule(orig(r.src), r.dst, r.kind) for r in diffusers_keymap(cfg).rules])


def _is_original(names) -> bool:
    return any(n.startswith(("patchify_proj.", "adaln_single.")) for n in names)


def config_from_original(ckpt) -> LTXDiTConfig:
    """The config of an original-release checkpoint from its shapes (every released LTX-Video DiT
    has 32 heads: 2B = 32 x 64, 13B = 32 x 128)."""
    sh = {k: tuple(v.shape) for k, v in ckpt.items()}
    d, cin = sh["patchify_proj.weight"]
    if d % 32:
        raise ValueError(f"LTX-Video DiT of width {d}: not a released shape (32 heads); pass the config")
    layers = 1 + max(int(k.split(".")[1]) for k in sh if k.startswith("transformer_blocks."))
    return LTXDiTConfig(in_channels=cin, out_channels=sh["proj_out.weight"][0], num_heads=32, head_dim=d // 32,
                        cross_attention_dim=sh["transformer_blocks.0.attn2.to_k.weight"][1], num_layers=layers,
                        caption_channels=sh["caption_projection.linear_1.weight"][1])


def load_dit(path, cfg: LTXDiTConfig | None = None, dtype=np.float32):
    """(host state, cfg) from a diffusers folder or an original-release file; nothing random is
    materialised."""
    return KIT.load(path, cfg, dtype, from_config=LTXDiTConfig.from_diffusers, is_original=_is_original,
                    config_from_original=config_from_original, prefix="model.diffusion_model.",
                    keymap=(diffusers_keymap, original_keymap), what="LTXVideoTransformer3DModel")


# ----------------------------------------------------------------------------------- compat
class _Compat(compat.CompatModel):
    def __init__(self, config, state, cfg, run: DiTRunner | None = None):
        super().__init__("LTXVideoTransformer3DModel", config, state, cfg)
        self.runner = run
        self._fwd = jax.jit(partial(forward, cfg=cfg)) if run is None else None

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_attention_mask=None, num_frames=None,
                height=None, width=None, rope_interpolation_scale=None, video_coords=None, **_):
        cfg = self.model_config
        x = np.asarray(hidden_states, np.float32)
        b = x.shape[0]
        if video_coords is not None:
            grid = grid_from_coords(video_coords, cfg)
        else:
            ris = None if rope_interpolation_scale is None else [float(np.asarray(v)) for v in rope_interpolation_scale]
            grid = video_coords_fn(num_frames, height, width, ris, cfg, 1)
        cos, sin = rope_tables(grid, cfg)
        t = np.asarray(timestep, np.float32)
        if t.ndim == 0:
            t = np.full((b,), t, np.float32)
        inputs = model_inputs(cfg, x, t, np.asarray(encoder_hidden_states, np.float32), encoder_attention_mask, cos, sin)
        y = self._fwd(self.params, inputs=inputs)["y"] if self.runner is None else self.runner(inputs)["y"]
        return np.asarray(y)


video_coords_fn = video_coords


compat.register_dit("LTXVideoTransformer3DModel", LTXDiTConfig.from_diffusers, _Compat, load_dit, runner,
                    constraints=parallel_constraints)
