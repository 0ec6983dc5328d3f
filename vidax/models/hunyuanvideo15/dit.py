"""HunyuanVideo 1.5 diffusion transformer (diffusers ``HunyuanVideo15Transformer3DModel``) as Flax NNX modules.

:class:`HunyuanVideo15Transformer` = ``embed`` -> ``double`` (54 dual-stream blocks, stacked on
one ``"layers"`` axis, one ``lax.scan``) -> ``head``. The blocks, the token refiner, the head,
the joint attention, RoPE and the patchify rules are HunyuanVideo 1.0's
(:mod:`vidax.models.hunyuanvideo.dit`), imported, not rewritten; what 1.5 adds is all in
:class:`Embed`:

- three condition streams, each projected to the model width and tagged by ``cond_type_embed``
  (0 text, 1 glyph, 2 image): the Qwen2.5-VL hidden states through the token refiner (its mask
  rule: valid tokens see valid tokens only), the ByT5 glyph embeddings through
  ``context_embedder_2`` (LayerNorm, three linears, exact GELU), the SigLIP image tokens through
  ``image_embedder``. **All-zero image embeddings (over the whole batch, the reference's test)
  select the T2V branch**: the image tokens are zeroed and masked out;
- the streams are **reordered so the valid tokens come first** -- ``[valid image, valid glyph,
  valid text, invalid image, invalid glyph (zeroed), invalid text (zeroed)]`` per row, exactly
  the reference's order (a stable per-row argsort: one gather, no Python loop) -- so the joint
  attention's key mask is a prefix (``video tokens + valid count``), as in 1.0;
- timestep modulation only (no pooled text, no embedded guidance; ``use_meanflow`` adds a second
  timestep embedder for ``timestep_r``);
- image-to-video conditioning is only more input channels (``[latents, image latent on frame 0,
  frame-0 mask]``, 65 = 2 x 32 + 1), built by the pipeline.

Activations are channels-last; the model takes latents as ``[B, F, H, W, C]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax import compat
from vidax.core import nn
from vidax.core import offload as voff
from vidax.core import sharding as vsh
from vidax.core.layers import MLP
from vidax.core.runner import DiTRunner
from vidax.models.hunyuanvideo import dit as h10

F32 = jnp.float32


# ----------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class HunyuanVideo15Config(h10.HunyuanDiTFields, in_channels=65, out_channels=32, num_layers=54, patch_size=1,
                           text_embed_dim=3584):
    """Mirrors diffusers' ``HunyuanVideo15Transformer3DModel`` config (defaults = the 8.3B release)."""

    text_embed_2_dim: int = 1472
    image_embed_dim: int = 1152
    target_size: int = 640
    task_type: str = "i2v"
    use_meanflow: bool = False

    FAMILY = "HunyuanVideo 1.5"
    # what the 1.0 blocks read
    token_replace = False
    num_single_layers = 0


_TINY = dict(num_heads=4, head_dim=8, in_channels=9, out_channels=4, num_layers=2, num_refiner_layers=1,
             text_embed_dim=24, text_embed_2_dim=20, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=64)
PRESETS = {
    "tiny": HunyuanVideo15Config(task_type="t2v", **_TINY),
    "tiny-i2v": HunyuanVideo15Config(task_type="i2v", **_TINY),
    "480p-t2v": HunyuanVideo15Config(task_type="t2v", target_size=640),
    "480p-i2v": HunyuanVideo15Config(task_type="i2v", target_size=640),
    "720p-t2v": HunyuanVideo15Config(task_type="t2v", target_size=960),
    "720p-i2v": HunyuanVideo15Config(task_type="i2v", target_size=960),
}


# ----------------------------------------------------------------------------------- modules
class TokenRefiner(h10.TokenRefiner):
    """1.0's token refiner with 1.5's mask rule (token ``i`` sees token ``j`` iff both are valid)."""

    SEE_FIRST = False


class GlyphProjection(nnx.Module):
    """``HunyuanVideo15ByT5TextProjection``: LayerNorm -> linear -> GELU -> linear -> GELU -> linear."""

    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm = nn.LayerNorm(din, eps=1e-5, **kw)
        self.l1, self.l2, self.l3 = nn.Linear(din, hidden, **kw), nn.Linear(hidden, hidden, **kw), nn.Linear(hidden, dout, **kw)

    def __call__(self, x):
        dt = x.dtype
        h = self.norm(x.astype(F32)).astype(dt)
        h = nn.gelu_exact(self.l2(nn.gelu_exact(self.l1(h))))
        return self.l3(h)


class ImageProjection(nnx.Module):
    """``HunyuanVideo15ImageProjection``: LayerNorm -> linear -> GELU -> linear -> LayerNorm."""

    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm_in = nn.LayerNorm(din, eps=1e-5, **kw)
        self.l1, self.l2 = nn.Linear(din, din, **kw), nn.Linear(din, dout, **kw)
        self.norm_out = nn.LayerNorm(dout, eps=1e-5, **kw)

    def __call__(self, x):
        dt = x.dtype
        h = self.l2(nn.gelu_exact(self.l1(self.norm_in(x.astype(F32)).astype(dt))))
        return self.norm_out(h.astype(F32)).astype(dt)


def reorder(streams, masks):
    """The reference's per-row reordering of the condition tokens: ``streams`` ([B, Li, D] each)
    concatenated, then every row's valid tokens first (in stream order, then position), the
    invalid ones after (same order). ``masks``: bool [B, Li] each. Returns ``(tokens [B, L, D],
    valid count int32 [B])`` -- the joint attention's key mask is then a prefix."""
    y = jnp.concatenate(streams, axis=1)
    m = jnp.concatenate(masks, axis=1)
    n = m.shape[1]
    key = jnp.where(m, 0, n) + jnp.arange(n, dtype=jnp.int32)[None, :]
    order = jnp.argsort(key, axis=1, stable=True)
    return jnp.take_along_axis(y, order[..., None], axis=1), jnp.sum(m, axis=1).astype(jnp.int32)


class Embed(h10.PatchTimeEmbed):
    """Everything before the blocks: patch embedding (per token), the timestep modulation vector
    and the three condition streams, tagged, T2V-switched and reordered (module docstring)."""

    def __init__(self, cfg: HunyuanVideo15Config, *, rngs: nnx.Rngs, param_dtype=F32):
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype)
        d, kw = cfg.dim, dict(rngs=rngs, param_dtype=param_dtype)
        self.time_r = MLP(256, d, d, "silu", **kw) if cfg.use_meanflow else None
        self.refiner = TokenRefiner(cfg.text_embed_dim, d, cfg.num_heads, cfg.num_refiner_layers, 4.0, **kw)
        self.glyph = GlyphProjection(cfg.text_embed_2_dim, 2048, d, **kw)
        self.image = ImageProjection(cfg.image_embed_dim, d, **kw)
        self.cond_type = nn.Embed(3, d, axes=(None, None), **kw)

    def conditioning(self, t, t_r=None):
        dt = self.patch.kernel[...].dtype
        temb = self.time_in(h10.timestep_features(t).astype(dt))
        if self.time_r is not None and t_r is not None:
            temb = temb + self.time_r(h10.timestep_features(t_r).astype(dt))
        return temb.astype(F32)

    def context(self, t, ctx, mask, ctx2, mask2, image):
        """``(tokens [B, Lt + L2 + Li, D], valid count [B])``."""
        dt = self.patch.kernel[...].dtype
        tag = self.cond_type.embedding[...].astype(dt)
        m1, m2 = jnp.asarray(mask) != 0, jnp.asarray(mask2) != 0
        y1 = self.refiner(ctx.astype(dt), t, mask) + tag[0]
        y2 = self.glyph(ctx2.astype(dt)) + tag[1]
        image = jnp.asarray(image)
        t2v = jnp.all(image == 0)
        y3 = jnp.where(t2v, 0.0, self.image(image.astype(dt))).astype(dt) + tag[2]
        m3 = jnp.broadcast_to(~t2v, y3.shape[:2])
        y1 = jnp.where(m1[..., None], y1, 0).astype(dt)
        y2 = jnp.where(m2[..., None], y2, 0).astype(dt)
        return reorder([y3, y2, y1], [m3, m2, m1])

    def __call__(self, a: dict, par: vsh.ParallelContext = vsh.LOCAL):
        """``a``: patch ``tokens`` (this shard's), ``t``, the three condition streams and masks,
        ``t_r`` and the per-token tables. Returns ``({"h", "y"}, consts)``."""
        y, n = self.context(a["t"], a["ctx"], a["mask"], a["ctx2"], a["mask2"], a["image"])
        c = {"temb": self.conditioning(a["t"], a.get("t_r")), "text_len": n, "cos": a["cos"], "sin": a["sin"]}
        return {"h": self.patch(a["tokens"]), "y": y}, c


class HunyuanVideo15Transformer(h10.DualStreamHooks, nnx.Module):
    """The HunyuanVideo 1.5 DiT: ``embed`` -> stacked ``double`` (1.0's dual-stream block) -> ``head``."""

    STACKS = ("double",)

    def __init__(self, cfg: HunyuanVideo15Config, *, rngs: nnx.Rngs, param_dtype=F32):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs=rngs, param_dtype=param_dtype)
        self.double = nn.stack(lambda r: h10.DoubleBlock(cfg, rngs=r, param_dtype=param_dtype), cfg.num_layers, rngs)
        self.head = h10.Head(cfg, rngs=rngs, param_dtype=param_dtype)

    @staticmethod
    def pack(x, t, ctx, mask, ctx2, mask2, image, t_r=None) -> dict:
        return {"x": x, "t": jnp.asarray(t, F32), "ctx": ctx, "mask": jnp.asarray(mask, F32), "ctx2": ctx2,
                "mask2": jnp.asarray(mask2, F32), "image": image, "t_r": None if t_r is None else jnp.asarray(t_r, F32)}

    def prepare(self, a: dict, dtype) -> dict:
        cast = lambda v: jnp.asarray(v).astype(dtype)  # noqa: E731
        return {"tokens": h10.patchify(self.cfg, a["x"].astype(dtype))[0], "t": a["t"], "ctx": cast(a["ctx"]),
                "mask": a["mask"], "ctx2": cast(a["ctx2"]), "mask2": a["mask2"], "image": cast(a["image"]),
                **{k: a[k] for k in ("t_r", "cos", "sin") if k in a}}

    def chunk_sizes(self, offload_chunk_size) -> dict:
        return parse_chunk_sizes(offload_chunk_size, self.cfg)

    def __call__(self, x, t, ctx, mask, ctx2, mask2, image, t_r=None, *, par: vsh.ParallelContext = vsh.LOCAL,
                 rope=None):
        """Velocity prediction. ``x``: [B, F, H, W, Cin] latents (channels-last, the I2V condition
        already concatenated); ``t``: [B]; ``ctx``/``mask``: Qwen2.5-VL hidden states [B, Lt,
        text_embed_dim] and mask; ``ctx2``/``mask2``: ByT5 glyph embeddings [B, L2, text_embed_2_dim]
        and mask; ``image``: SigLIP tokens [B, Li, image_embed_dim] (all zero: text-to-video);
        ``t_r``: meanflow's second timestep; ``rope``: the grid's (cos, sin) tables as arguments
        (None: computed here). Returns [B, F, H, W, Cout]."""
        return self.run(self.pack(x, t, ctx, mask, ctx2, mask2, image, t_r), par, rope)


# ----------------------------------------------------------------------------------- state
UNITS = ("embed", "double", "head")
KIT = nn.ModelKit(HunyuanVideo15Transformer, units=UNITS, dtype_leaf=("embed", "patch", "kernel"))
_build, abstract_state, param_shapes = KIT.build, KIT.abstract_state, KIT.param_shapes
graphdefs, state_dtype, merge = KIT.graphdefs, KIT.state_dtype, KIT.merge


def init_state(cfg: HunyuanVideo15Config, seed: int = 0, dtype=np.float32) -> nnx.State:
    """A seeded random DiT's state in host memory (numpy leaves; presets, tests): nothing zero,
    nothing one (:func:`vidax.models.hunyuanvideo.dit.seeded_state`)."""
    return h10.seeded_state(lambda: _build(cfg, 0, dtype), seed)[1]


def forward(state, cfg: HunyuanVideo15Config, x, t, ctx, mask, ctx2, mask2, image, t_r=None, *, attn_impl=None,
            rope=None):
    """Velocity prediction from a state (pure: ``jax.jit(forward, static_argnums=1)``)."""
    return merge(state, cfg)(x, t, ctx, mask, ctx2, mask2, image, t_r, par=vsh.ParallelContext(attn_impl=attn_impl),
                             rope=rope)


# ----------------------------------------------------------------------------------- sharding
#: 1.0's rules (the core table + ``h10.DualStreamHooks.AXIS_DELTAS``: TP splits heads, MLP width
#: and the modulation columns; SP the video tokens) and divisibility rules: the same blocks.
parallel_constraints = h10.parallel_constraints


def parse_chunk_sizes(offload_chunk_size, cfg: HunyuanVideo15Config) -> dict[str, int]:
    """Chunk size of the one offload pool (``double``): an int dividing ``num_layers``, "all",
    ``"double=N"`` or ``{"double": N}``."""
    v = offload_chunk_size
    if isinstance(v, str) and "=" in v:
        k, _, v = v.replace(" ", "").partition("=")
        if k != "double":
            raise voff.OffloadConfigError(f"offload_chunk_size={offload_chunk_size!r}: the only pool is double")
    if isinstance(v, dict):
        bad = sorted(set(v) - {"double"})
        if bad:
            raise voff.OffloadConfigError(f"offload_chunk_size: unknown pools {bad}; the only pool is double")
        v = v.get("double", "all")
    if isinstance(v, str) and v.isdigit():
        v = int(v)
    return {"double": voff.resolve_chunk_size(v, cfg.num_layers)}


def runner(state, cfg: HunyuanVideo15Config, mesh=None, parallelism=None, **kw) -> DiTRunner:
    """The HunyuanVideo 1.5 DiT on a ``(dp, tp, sp)`` mesh through ``vidax.core.runner.DiTRunner``
    (1.0's blocks and joint attention under Ulysses SP), its stack resident or streamed
    (``offload_chunk_size``). Called like :func:`forward`."""
    return KIT.runner(state, cfg, mesh, parallelism, constraints=parallel_constraints(cfg), **kw)


# ----------------------------------------------------------------------------------- checkpoints
def load_dit(path, cfg: HunyuanVideo15Config | None = None, dtype=np.float32):
    """DiT weights from a diffusers folder (config.json + safetensors) or the original release
    (a folder or file of safetensors with its names). Returns ``(state, cfg)``."""
    from vidax.models.hunyuanvideo15 import convert  # (it imports this module's config)

    return KIT.load(path, cfg, dtype, from_config=HunyuanVideo15Config.from_diffusers, is_original=convert.is_original,
                    config_from_original=convert.config_from_original, keymap=lambda c, original: convert.diffusers_keymap(c),
                    view=lambda ckpt, c, original: convert.original_to_diffusers(ckpt) if original else ckpt,
                    what=lambda c: f"HunyuanVideo15Transformer3DModel (dim {c.dim}, {c.num_layers} blocks)")


# ----------------------------------------------------------------------------------- compat
class _Compat(compat.CompatModel):
    def __init__(self, config, state, cfg, runner=None):
        super().__init__("HunyuanVideo15Transformer3DModel", config, state, cfg)
        self.runner = runner
        self._fwd = jax.jit(lambda state, *a: forward(state, cfg, *a)) if runner is None else None

    def forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, timestep_r=None,
                encoder_hidden_states_2=None, encoder_attention_mask_2=None, image_embeds=None, **_):
        cfg = self.model_config
        x = jnp.asarray(np.asarray(hidden_states, np.float32)).transpose(0, 2, 3, 4, 1)
        b = x.shape[0]
        vec = lambda v: jnp.broadcast_to(jnp.asarray(np.asarray(v), F32), (b,))  # noqa: E731
        if encoder_hidden_states_2 is None:
            encoder_hidden_states_2 = np.zeros((b, 1, cfg.text_embed_2_dim), np.float32)
            encoder_attention_mask_2 = np.zeros((b, 1), np.float32)
        if image_embeds is None:
            image_embeds = np.zeros((b, 1, cfg.image_embed_dim), np.float32)
        args = (x, vec(timestep), jnp.asarray(np.asarray(encoder_hidden_states), F32),
                jnp.asarray(np.asarray(encoder_attention_mask), F32),
                jnp.asarray(np.asarray(encoder_hidden_states_2), F32), jnp.asarray(np.asarray(encoder_attention_mask_2), F32),
                jnp.asarray(np.asarray(image_embeds), F32), None if timestep_r is None else vec(timestep_r))
        y = self.runner(*args) if self.runner is not None else self._fwd(self.params, *args)
        return np.asarray(y).transpose(0, 4, 1, 2, 3)


compat.register_dit("HunyuanVideo15Transformer3DModel", HunyuanVideo15Config.from_diffusers, _Compat, load_dit, runner,
                    constraints=parallel_constraints, check_chunks=parse_chunk_sizes)
