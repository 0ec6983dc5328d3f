"""Wan2.1 / Wan2.2 diffusion transformer (diffusers ``WanTransformer3DModel``) in JAX.

Blocks are stacked along a leading layer axis and run with ``lax.scan``. Activations are
channels-last; :func:`forward` takes latents as ``[B, F, H, W, C]``. Covers T2V, I2V (CLIP image
tokens through their own key/value projections) and Wan2.2 TI2V's per-token timesteps.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from vidax import compat
from vidax.core import mesh as vmesh
from vidax.core import nn
from vidax.core import offload as voff
from vidax.core import sharding as vsh
from vidax.core.attention import attention
from vidax.core.embeddings import apply_rope_interleaved, rope_3d_angles, sinusoidal_embedding
from vidax.weights import KeyMap, Rule, load_checkpoint_params, open_checkpoint


@dataclass(frozen=True)
class WanDiTConfig:
    patch_size: tuple = (1, 2, 2)
    num_heads: int = 40
    head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    eps: float = 1e-6
    image_dim: int | None = None  # CLIP image-embedding width (I2V)
    added_kv_proj_dim: int | None = None  # image key/value projections in cross-attention (I2V)
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None  # FLF2V learned image-token positions

    @property
    def dim(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "WanDiTConfig":
        ren = {"num_attention_heads": "num_heads", "attention_head_dim": "head_dim"}
        names = {f.name for f in fields(cls)}
        kw = {}
        for k, v in cfg.items():
            k = ren.get(k, k)
            if k in names:
                kw[k] = tuple(v) if k == "patch_size" else v
        if kw.get("out_channels") is None:
            kw["out_channels"] = kw.get("in_channels", cls.in_channels)
        qk = cfg.get("qk_norm", "rms_norm_across_heads")
        if qk not in (None, "rms_norm_across_heads"):
            raise ValueError(f"WanTransformer3DModel config: qk_norm={qk!r} is not supported (expected 'rms_norm_across_heads')")
        return cls(**kw)


PRESETS = {
    "tiny": WanDiTConfig(num_heads=2, head_dim=12, in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=48, num_layers=2),
    "1.3b": WanDiTConfig(num_heads=12, head_dim=128, ffn_dim=8960, num_layers=30),
    "14b": WanDiTConfig(num_heads=40, head_dim=128, ffn_dim=13824, num_layers=40),
}


# ----------------------------------------------------------------------------------- params
def init_params(cfg: WanDiTConfig, seed: int = 0, dtype=np.float32):
    ini = nn.Init(seed, dtype)
    d, L = cfg.dim, cfg.num_layers
    pt, ph, pw = cfg.patch_size
    lead = (L,)
    p = {
        "patch": ini.conv((pt, ph, pw), cfg.in_channels, d),
        "time_in": {"l1": ini.linear(cfg.freq_dim, d), "l2": ini.linear(d, d)},
        "time_proj": ini.linear(d, 6 * d),
        "text_in": {"l1": ini.linear(cfg.text_dim, d), "l2": ini.linear(d, d)},
        "blocks": {
            "sst": ini.normal((L, 1, 6, d), std=d**-0.5),
            "attn1": {
                **{n: ini.linear(d, d, lead=lead) for n in ("q", "k", "v", "o")},
                "norm_q": ini.norm_weight((L, d)),
                "norm_k": ini.norm_weight((L, d)),
            },
            "attn2": {
                **{n: ini.linear(d, d, lead=lead) for n in ("q", "k", "v", "o")},
                "norm_q": ini.norm_weight((L, d)),
                "norm_k": ini.norm_weight((L, d)),
            },
            "ffn": {"up": ini.linear(d, cfg.ffn_dim, lead=lead), "down": ini.linear(cfg.ffn_dim, d, lead=lead)},
        },
        "head": ini.linear(d, cfg.out_channels * pt * ph * pw),
        "head_sst": ini.normal((1, 2, d), std=d**-0.5),
    }
    if cfg.cross_attn_norm:
        p["blocks"]["norm2"] = {"w": ini.norm_weight((L, d)), "b": ini.bias((L, d))}
    if cfg.added_kv_proj_dim is not None:
        a = p["blocks"]["attn2"]
        a["add_k"] = ini.linear(cfg.added_kv_proj_dim, d, lead=lead)
        a["add_v"] = ini.linear(cfg.added_kv_proj_dim, d, lead=lead)
        a["norm_added_k"] = ini.norm_weight((L, d))
    if cfg.image_dim is not None:
        e = cfg.image_dim
        p["img_in"] = {
            "norm1": {"w": ini.norm_weight((e,)), "b": ini.bias((e,))},
            "ff1": ini.linear(e, e),
            "ff2": ini.linear(e, d),
            "norm2": {"w": ini.norm_weight((d,)), "b": ini.bias((d,))},
        }
        if cfg.pos_embed_seq_len is not None:
            p["img_in"]["pos"] = ini.normal((1, cfg.pos_embed_seq_len, e))
    return p


def param_shapes(cfg: WanDiTConfig):
    return jax.eval_shape(lambda: jax.tree.map(jnp.asarray, init_params(cfg)))


# ----------------------------------------------------------------------------------- forward
def _heads(x, head_dim):
    """[..., H * head_dim] -> [..., H, head_dim] (H may be a shard's local head count)."""
    return x.reshape(*x.shape[:-1], -1, head_dim)


def _block(cfg: WanDiTConfig, x, p, ctx, img_ctx, temb6, cos, sin, attn_impl, par=None):
    """One transformer block. x: [B, L, D] (compute dtype); temb6: [B, T, 6, D] float32.

    ``par`` (a :class:`vidax.core.sharding.ParallelContext`, only inside ``shard_map``) makes the
    same code run on one shard: local heads / FFN columns under TP (row-parallel layers reduce
    across ``tp``, the q/k RMS norms reduce their sum of squares across ``tp``), local tokens under
    SP (self-attention through Ulysses all_to_all). ``par=None`` is the plain single-device path."""
    dt = x.dtype
    eps = cfg.eps
    if par is None:
        def lin(path, q, h):
            return nn.dense(q, h)

        def rms(path, h, w):
            return nn.rms_norm(h, w, eps)

        self_attn = cross_attn = partial(attention, impl=attn_impl)
    else:
        def lin(path, q, h):
            return par.dense("blocks." + path, q, h)

        def rms(path, h, w):
            return par.rms_norm("blocks." + path, h, w, eps)

        self_attn, cross_attn = par.self_attention, par.cross_attention
    hd = cfg.head_dim
    mod = p["sst"][None].astype(jnp.float32) + temb6  # [B, T, 6, D]
    shift1, scale1, gate1, shift2, scale2, gate2 = (mod[:, :, j] for j in range(6))

    # 1. self-attention (RoPE on q, k)
    h = (nn.layer_norm(x.astype(jnp.float32), eps=eps) * (1 + scale1) + shift1).astype(dt)
    a = p["attn1"]
    q = rms("attn1.norm_q", lin("attn1.q", a["q"], h), a["norm_q"])
    k = rms("attn1.norm_k", lin("attn1.k", a["k"], h), a["norm_k"])
    v = lin("attn1.v", a["v"], h)
    q, k, v = _heads(q, hd), _heads(k, hd), _heads(v, hd)
    q, k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
    o = self_attn(q, k, v)
    o = lin("attn1.o", a["o"], o.reshape(*o.shape[:2], -1))
    x = (x.astype(jnp.float32) + o * gate1).astype(dt)

    # 2. cross-attention to text (and image tokens, I2V)
    if cfg.cross_attn_norm:
        h = nn.layer_norm(x.astype(jnp.float32), p["norm2"]["w"], p["norm2"]["b"], eps).astype(dt)
    else:
        h = x
    c = p["attn2"]
    q = _heads(rms("attn2.norm_q", lin("attn2.q", c["q"], h), c["norm_q"]), hd)
    k = _heads(rms("attn2.norm_k", lin("attn2.k", c["k"], ctx), c["norm_k"]), hd)
    v = _heads(lin("attn2.v", c["v"], ctx), hd)
    o = cross_attn(q, k, v)
    o = o.reshape(*o.shape[:2], -1)
    if img_ctx is not None:
        ki = _heads(rms("attn2.norm_added_k", lin("attn2.add_k", c["add_k"], img_ctx), c["norm_added_k"]), hd)
        vi = _heads(lin("attn2.add_v", c["add_v"], img_ctx), hd)
        oi = cross_attn(q, ki, vi)
        o = o + oi.reshape(*oi.shape[:2], -1)
    x = x + lin("attn2.o", c["o"], o)

    # 3. feed-forward
    h = (nn.layer_norm(x.astype(jnp.float32), eps=eps) * (1 + scale2) + shift2).astype(dt)
    f = lin("ffn.down", p["ffn"]["down"], nn.gelu_tanh(lin("ffn.up", p["ffn"]["up"], h)))
    return (x.astype(jnp.float32) + f.astype(jnp.float32) * gate2).astype(dt)


def embed_conditions(params, cfg: WanDiTConfig, t, ctx, img=None):
    """Timestep / text / image embeddings. ``t``: [B] or [B, T] -> temb [B, T, D], temb6 [B, T, 6, D]."""
    t = jnp.asarray(t, jnp.float32)
    if t.ndim == 1:
        t = t[:, None]
    e = sinusoidal_embedding(t, cfg.freq_dim, flip_sin_to_cos=True)
    ti = params["time_in"]
    temb = nn.dense(ti["l2"], jax.nn.silu(nn.dense(ti["l1"], e)))
    temb6 = nn.dense(params["time_proj"], jax.nn.silu(temb)).reshape(*temb.shape[:-1], 6, cfg.dim)
    tx = params["text_in"]
    ctx = nn.dense(tx["l2"], nn.gelu_tanh(nn.dense(tx["l1"], ctx)))
    img_ctx = None
    if img is not None:
        if "img_in" not in params:
            raise ValueError("image embeddings were given but this DiT has no image branch (image_dim is None)")
        ip = params["img_in"]
        if "pos" in ip:
            b, s, d = img.shape
            img = img.reshape(-1, 2 * s, d) + ip["pos"]
        h = nn.layer_norm(img.astype(jnp.float32), ip["norm1"]["w"], ip["norm1"]["b"], 1e-5)
        h = nn.dense(ip["ff2"], nn.gelu_exact(nn.dense(ip["ff1"], h)))
        img_ctx = nn.layer_norm(h, ip["norm2"]["w"], ip["norm2"]["b"], 1e-5).astype(ctx.dtype)
    return temb.astype(jnp.float32), temb6.astype(jnp.float32), ctx, img_ctx


def patchify(cfg: WanDiTConfig, x):
    """[B, F, H, W, C] -> tokens [B, f*h*w, pt*ph*pw*C] and the token grid (f, h, w)."""
    b, f, h, w, c = x.shape
    pt, ph, pw = cfg.patch_size
    if f % pt or h % ph or w % pw:
        raise ValueError(f"latent shape (F={f}, H={h}, W={w}) is not divisible by the patch size {cfg.patch_size}")
    x = x.reshape(b, f // pt, pt, h // ph, ph, w // pw, pw, c).transpose(0, 1, 3, 5, 2, 4, 6, 7)
    grid = (f // pt, h // ph, w // pw)
    return x.reshape(b, grid[0] * grid[1] * grid[2], pt * ph * pw * c), grid


def unpatchify(cfg: WanDiTConfig, y, grid):
    b = y.shape[0]
    pt, ph, pw = cfg.patch_size
    f, h, w = grid
    y = y.reshape(b, f, h, w, pt, ph, pw, -1).transpose(0, 1, 4, 2, 5, 3, 6, 7)
    return y.reshape(b, f * pt, h * ph, w * pw, -1)


def rope_tables(cfg: WanDiTConfig, grid):
    for g in grid:
        if g > cfg.rope_max_seq_len:
            raise ValueError(f"token grid {grid} exceeds rope_max_seq_len={cfg.rope_max_seq_len}")
    ang = rope_3d_angles(cfg.head_dim, grid)
    return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def prologue(params, cfg: WanDiTConfig, tokens, t, ctx, img=None):
    """Patch embedding + condition embeddings. ``tokens``: [B, L, pt*ph*pw*C] (compute dtype).
    Returns ``(h, temb, temb6, ctx, img_ctx)``; per token, so it runs unchanged on a token shard."""
    h = nn.dense({"w": params["patch"]["w"].reshape(-1, cfg.dim), "b": params["patch"]["b"]}, tokens)
    temb, temb6, ctx, img_ctx = embed_conditions(params, cfg, t, ctx, img)
    return h, temb, temb6, ctx, img_ctx


def run_blocks(blocks, cfg: WanDiTConfig, h, ctx, img_ctx, temb6, cos, sin, attn_impl=None, par=None):
    """``lax.scan`` of :func:`_block` over a stack of blocks (all of them, or one offload chunk)."""

    def body(carry, p):
        return _block(cfg, carry, p, ctx, img_ctx, temb6, cos, sin, attn_impl, par), None

    h, _ = jax.lax.scan(body, h, blocks)
    return h


def epilogue(params, cfg: WanDiTConfig, h, temb):
    """Output norm + modulation + projection, per token -> [B, L, pt*ph*pw*Cout]."""
    dt = h.dtype
    mod = params["head_sst"][None].astype(jnp.float32) + temb[:, :, None, :]  # [B, T, 2, D]
    shift, scale = mod[:, :, 0], mod[:, :, 1]
    h = (nn.layer_norm(h.astype(jnp.float32), eps=cfg.eps) * (1 + scale) + shift).astype(dt)
    return nn.dense(params["head"], h)


def forward(params, cfg: WanDiTConfig, x, t, ctx, img=None, *, attn_impl=None):
    """Velocity prediction. ``x``: [B, F, H, W, C] latents; ``t``: [B] (or [B, L] per-token);
    ``ctx``: [B, Lt, text_dim]; ``img``: [B, Li, image_dim] or None. Returns [B, F, H, W, Cout].

    Single-device (or compiler-partitioned) path; for meshes and offloading see :class:`WanDiTRunner`."""
    dt = params["patch"]["w"].dtype
    tokens, grid = patchify(cfg, x.astype(dt))
    h, temb, temb6, ctx, img_ctx = prologue(params, cfg, tokens, t, ctx.astype(dt), None if img is None else img.astype(dt))
    cos, sin = rope_tables(cfg, grid)
    h = run_blocks(params["blocks"], cfg, h, ctx, img_ctx, temb6, cos, sin, attn_impl)
    return unpatchify(cfg, epilogue(params, cfg, h, temb), grid)


# ----------------------------------------------------------------------------------- sharding
# Parameter path (regex, dotted) -> one logical axis per dim. Unmatched parameters (embeddings,
# head, modulation tables, LayerNorm affine) are replicated. Column-parallel: q/k/v, FFN up (and
# cross-attention q/k/v, I2V add_k/add_v) split their output ("heads"/"ffn"); row-parallel: the
# attention outputs and FFN down split their input, their biases stay whole (added once, after
# the psum). The q/k RMS norms span all heads, so their weights split with the heads and the
# sum of squares is reduced across tp.
SHARDING_RULES = (
    (r"blocks\.attn[12]\.[qkv]\.w", ("layers", "embed", "heads")),
    (r"blocks\.attn[12]\.[qkv]\.b", ("layers", "heads")),
    (r"blocks\.attn2\.add_[kv]\.w", ("layers", "embed_in", "heads")),
    (r"blocks\.attn2\.add_[kv]\.b", ("layers", "heads")),
    (r"blocks\.attn[12]\.norm_(q|k|added_k)", ("layers", "heads")),
    (r"blocks\.attn[12]\.o\.w", ("layers", "heads", "embed")),
    (r"blocks\.attn[12]\.o\.b", ("layers", "embed")),
    (r"blocks\.ffn\.up\.w", ("layers", "embed", "ffn")),
    (r"blocks\.ffn\.up\.b", ("layers", "ffn")),
    (r"blocks\.ffn\.down\.w", ("layers", "ffn", "embed")),
    (r"blocks\.ffn\.down\.b", ("layers", "embed")),
)
# Logical axis -> mesh axis under tensor parallelism (sequence parallelism keeps weights whole).
TP_LOGICAL = {"heads": "tp", "ffn": "tp"}


def parallel_constraints(cfg: WanDiTConfig, *, tokens: int | None = None, batch: int | None = None):
    """Divisibility rules of the Wan DiT on a (dp, tp, sp) mesh. The text (and image-token)
    length has none: cross-attention keys are replicated over sp and split by heads over tp."""
    r = [vmesh.Divisible("num_heads", cfg.num_heads, ("tp", "sp"),
                   "attention heads are split over tp (weights) and sp (Ulysses all_to_all): tp*sp must divide them"),
         vmesh.Divisible("ffn_dim", cfg.ffn_dim, ("tp",), "FFN up/down are split over tp")]
    if tokens is not None:
        r.append(vmesh.Divisible("tokens", tokens, ("sp",), "sequence parallel splits the f*h*w patch tokens (and per-token timesteps)"))
    if batch is not None:
        r.append(vmesh.Divisible("batch", batch, ("dp",), "the batch (2B with CFG) is split over dp"))
    return r


class WanDiTRunner:
    """The Wan DiT on a ``(dp, tp, sp)`` mesh, with the block weights resident or offloaded.

    ``mesh``: a Mesh (axes dp/tp/sp), a spec like ``"tp=2,sp=2"``, or None (one device).
    ``parallelism``: "tp" | "sp" | "tp+sp" | "none" (None: what the mesh implies). TP shards the
    weights by :data:`SHARDING_RULES`; SP shards tokens (Ulysses); the batch is always split over
    dp (CFG-parallel when it is the 2B conditional+unconditional batch).
    ``offload_chunk_size``: None keeps the blocks resident; an int (dividing num_layers) or "all"
    streams them from host memory through :class:`vidax.core.offload.OffloadRunner`.

    Model-level divisibility is checked here, input-level (tokens, batch) on every call, both
    before anything is placed or compiled. ``params``: host numpy tree (or arrays)."""

    def __init__(self, params, cfg: WanDiTConfig, mesh=None, parallelism: str | None = None, *,
                 offload_chunk_size=None, prefetch: bool = True, attn_impl: str | None = None,
                 naive_row_bias: bool = False, local_norm: bool = False, track_memory: bool = False):
        self.cfg, self.attn_impl = cfg, attn_impl
        self.mesh = vmesh.make_mesh(mesh)  # None: a 1x1x1 mesh on the first device
        self.parallelism = vsh.resolve_parallelism(parallelism, self.mesh)
        vmesh.check_divisible(parallel_constraints(cfg), self.mesh)
        mapping = vsh.logical_mapping(self.parallelism, TP_LOGICAL)
        self.par = vsh.ParallelContext.create(SHARDING_RULES, mapping, self.mesh, attn_impl=attn_impl,
                                              naive_row_bias=naive_row_bias, local_norm=local_norm)
        self.specs = vsh.param_specs(params, SHARDING_RULES, mapping)
        vsh.check_param_divisibility(params, self.specs, self.mesh)
        rest = {k: v for k, v in params.items() if k != "blocks"}
        self.rest_specs = {k: v for k, v in self.specs.items() if k != "blocks"}
        self.block_specs = self.specs["blocks"]
        self.rest = vsh.place(rest, vsh.named_shardings(self.mesh, self.rest_specs))
        block_shardings = vsh.named_shardings(self.mesh, self.block_specs)
        self.dtype = np.dtype(params["patch"]["w"].dtype)
        self._rope: dict = {}
        self.offload = None
        if offload_chunk_size is None:
            self.blocks = vsh.place(params["blocks"], block_shardings)
            self._fwd = jax.jit(self._resident)
        else:
            self.blocks = None
            self.offload = voff.OffloadRunner(prefetch=prefetch, track_memory=track_memory)
            self.offload.add_stack("blocks", params["blocks"], self._chunk, offload_chunk_size, block_shardings)
            self._pre = jax.jit(self._prologue)
            self._post = jax.jit(self._epilogue, static_argnums=(3,))

    # ------------------------------------------------------------------ specs and checks
    def check_inputs(self, x_shape, t_shape=None) -> None:
        b, f, h, w, _ = x_shape
        pt, ph, pw = self.cfg.patch_size
        if f % pt or h % ph or w % pw:
            raise ValueError(f"latent shape (F={f}, H={h}, W={w}) is not divisible by the patch size {self.cfg.patch_size}")
        tokens = (f // pt) * (h // ph) * (w // pw)
        if t_shape is not None and len(t_shape) == 2 and t_shape[1] not in (1, tokens):
            raise ValueError(f"per-token timesteps: t has {t_shape[1]} entries per sample, the latents give {tokens} tokens")
        vmesh.check_divisible(parallel_constraints(self.cfg, tokens=tokens, batch=b), self.mesh)

    @staticmethod
    def _act_specs(acts):
        per_tok = lambda a: a.ndim >= 2 and a.shape[1] > 1  # [B, T, ...] with T = L tokens
        specs = {}
        for k, a in acts.items():
            if k in ("tokens", "h", "y"):
                specs[k] = P("dp", "sp", None)
            elif k in ("cos", "sin"):
                specs[k] = P("sp", None)
            elif k == "t":
                specs[k] = P("dp", "sp") if a.ndim == 2 and a.shape[1] > 1 else P("dp")
            elif k in ("temb", "temb6"):
                specs[k] = P("dp", "sp" if per_tok(a) else None, *([None] * (a.ndim - 2)))
            else:  # ctx, img, img_ctx: replicated over tp and sp
                specs[k] = P("dp", *([None] * (a.ndim - 1)))
        return specs

    def _smap(self, fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)

    def rope(self, grid):
        """RoPE tables for a token grid, placed token-sharded over sp (cached)."""
        if grid not in self._rope:
            cos, sin = rope_tables(self.cfg, grid)
            s = NamedSharding(self.mesh, P("sp", None))
            self._rope[grid] = tuple(vsh.place([np.asarray(cos), np.asarray(sin)], [s, s]))
        return self._rope[grid]

    def _inputs(self, x, t, ctx, img):
        dt = self.dtype
        tokens, grid = patchify(self.cfg, x.astype(dt))
        a = {"tokens": tokens, "t": jnp.asarray(t, jnp.float32), "ctx": ctx.astype(dt)}
        if img is not None:
            a["img"] = img.astype(dt)
        return a, grid

    # ------------------------------------------------------------------ resident
    def _resident(self, rest, blocks, x, t, ctx, img, cos, sin):
        cfg, par = self.cfg, self.par
        acts, grid = self._inputs(x, t, ctx, img)
        acts.update(cos=cos, sin=sin)

        def inner(rest, blocks, a):
            h, temb, temb6, c, ic = prologue(rest, cfg, a["tokens"], a["t"], a["ctx"], a.get("img"))
            h = run_blocks(blocks, cfg, h, c, ic, temb6, a["cos"], a["sin"], self.attn_impl, par)
            return epilogue(rest, cfg, h, temb)

        y = self._smap(inner, (self.rest_specs, self.block_specs, self._act_specs(acts)), P("dp", "sp", None))(rest, blocks, acts)
        y = vsh.with_constraint(y, self.mesh, P("dp", None, None))  # gather the tokens before unpatchify
        return unpatchify(cfg, y, grid)

    # ------------------------------------------------------------------ offloaded
    def _prologue(self, rest, x, t, ctx, img):
        cfg = self.cfg
        acts, _ = self._inputs(x, t, ctx, img)

        def inner(rest, a):
            h, temb, temb6, c, ic = prologue(rest, cfg, a["tokens"], a["t"], a["ctx"], a.get("img"))
            out = {"h": h, "temb": temb, "temb6": temb6, "ctx": c}
            if ic is not None:
                out["img_ctx"] = ic
            return out

        shapes = jax.eval_shape(lambda r, a: prologue(r, cfg, a["tokens"], a["t"], a["ctx"], a.get("img")), rest, acts)
        out_shapes = {"h": shapes[0], "temb": shapes[1], "temb6": shapes[2], "ctx": shapes[3]}
        if shapes[4] is not None:
            out_shapes["img_ctx"] = shapes[4]
        specs = self._act_specs(out_shapes)
        return self._smap(inner, (self.rest_specs, self._act_specs(acts)), specs)(rest, acts)

    def _chunk(self, blocks, h, consts):
        cfg, par = self.cfg, self.par

        def inner(blocks, h, c):
            return run_blocks(blocks, cfg, h, c["ctx"], c.get("img_ctx"), c["temb6"], c["cos"], c["sin"], self.attn_impl, par)

        return self._smap(inner, (self.block_specs, P("dp", "sp", None), self._act_specs(consts)), P("dp", "sp", None))(blocks, h, consts)

    def _epilogue(self, rest, h, temb, grid):
        cfg = self.cfg
        specs = self._act_specs({"h": h, "temb": temb})
        y = self._smap(lambda r, h, te: epilogue(r, cfg, h, te), (self.rest_specs, specs["h"], specs["temb"]),
                       P("dp", "sp", None))(rest, h, temb)
        y = vsh.with_constraint(y, self.mesh, P("dp", None, None))
        return unpatchify(cfg, y, grid)

    # ------------------------------------------------------------------ call
    def __call__(self, x, t, ctx, img=None):
        """Same contract as :func:`forward` (channels-last latents, ``t`` [B] or [B, L])."""
        x = jnp.asarray(x)
        t = jnp.asarray(t, jnp.float32)
        self.check_inputs(x.shape, t.shape)
        pt, ph, pw = self.cfg.patch_size
        grid = (x.shape[1] // pt, x.shape[2] // ph, x.shape[3] // pw)
        cos, sin = self.rope(grid)
        if self.offload is None:
            return self._fwd(self.rest, self.blocks, x, t, ctx, img, cos, sin)
        a = self._pre(self.rest, x, t, ctx, img)
        consts = {k: v for k, v in a.items() if k not in ("h", "temb")}
        consts.update(cos=cos, sin=sin)
        h = self.offload.run("blocks", a["h"], consts)
        return self._post(self.rest, h, a["temb"], grid)

    @property
    def params(self):
        """The placed parameters (resident runner): pass them to :meth:`apply`."""
        if self.offload is not None:
            raise ValueError("an offloading runner streams its blocks; call the runner, not apply()")
        return {"rest": self.rest, "blocks": self.blocks}

    def apply(self, params, x, t, ctx, img=None):
        """Traceable ``model_fn(params, x, t, ctx)`` for :func:`vidax.core.sampling.make_step`
        (params = :attr:`params`; they stay arguments, never baked-in constants). With dp > 1 the
        2B classifier-free-guidance batch runs conditional / unconditional on separate devices."""
        self.check_inputs(x.shape, jnp.shape(t))
        pt, ph, pw = self.cfg.patch_size
        cos, sin = rope_tables(self.cfg, (x.shape[1] // pt, x.shape[2] // ph, x.shape[3] // pw))
        return self._resident(params["rest"], params["blocks"], x, t, ctx, img, cos, sin)

    def lower(self, x, t, ctx, img=None):
        """``jax.jit(...).lower`` of the resident forward (for ``compile().memory_analysis()``)."""
        x, t = jnp.asarray(x), jnp.asarray(t, jnp.float32)
        self.check_inputs(x.shape, t.shape)
        pt, ph, pw = self.cfg.patch_size
        cos, sin = self.rope((x.shape[1] // pt, x.shape[2] // ph, x.shape[3] // pw))
        return self._fwd.lower(self.rest, self.blocks, x, t, ctx, img, cos, sin)


# ----------------------------------------------------------------------------------- key maps
def _block_rules(blk: dict):
    """Stacked block rules; ``blk`` maps vidax sub-paths to (reference sub-name, kind)."""
    return [Rule(f"blocks.{{i}}.{ref}", f"blocks.{dst}", kind) for dst, (ref, kind) in blk.items()]


def diffusers_keymap(cfg: WanDiTConfig) -> KeyMap:
    r = [
        Rule("patch_embedding.weight", "patch.w", "conv3d"),
        Rule("patch_embedding.bias", "patch.b"),
        Rule("condition_embedder.time_embedder.linear_1.weight", "time_in.l1.w", "linear"),
        Rule("condition_embedder.time_embedder.linear_1.bias", "time_in.l1.b"),
        Rule("condition_embedder.time_embedder.linear_2.weight", "time_in.l2.w", "linear"),
        Rule("condition_embedder.time_embedder.linear_2.bias", "time_in.l2.b"),
        Rule("condition_embedder.time_proj.weight", "time_proj.w", "linear"),
        Rule("condition_embedder.time_proj.bias", "time_proj.b"),
        Rule("condition_embedder.text_embedder.linear_1.weight", "text_in.l1.w", "linear"),
        Rule("condition_embedder.text_embedder.linear_1.bias", "text_in.l1.b"),
        Rule("condition_embedder.text_embedder.linear_2.weight", "text_in.l2.w", "linear"),
        Rule("condition_embedder.text_embedder.linear_2.bias", "text_in.l2.b"),
        Rule("proj_out.weight", "head.w", "linear"),
        Rule("proj_out.bias", "head.b"),
        Rule("scale_shift_table", "head_sst"),
        Rule("condition_embedder.image_embedder.norm1.weight", "img_in.norm1.w"),
        Rule("condition_embedder.image_embedder.norm1.bias", "img_in.norm1.b"),
        Rule("condition_embedder.image_embedder.ff.net.0.proj.weight", "img_in.ff1.w", "linear"),
        Rule("condition_embedder.image_embedder.ff.net.0.proj.bias", "img_in.ff1.b"),
        Rule("condition_embedder.image_embedder.ff.net.2.weight", "img_in.ff2.w", "linear"),
        Rule("condition_embedder.image_embedder.ff.net.2.bias", "img_in.ff2.b"),
        Rule("condition_embedder.image_embedder.norm2.weight", "img_in.norm2.w"),
        Rule("condition_embedder.image_embedder.norm2.bias", "img_in.norm2.b"),
        Rule("condition_embedder.image_embedder.pos_embed", "img_in.pos"),
    ]
    blk = {"sst": ("scale_shift_table", "none"), "norm2.w": ("norm2.weight", "none"), "norm2.b": ("norm2.bias", "none"),
           "ffn.up.w": ("ffn.net.0.proj.weight", "linear"), "ffn.up.b": ("ffn.net.0.proj.bias", "none"),
           "ffn.down.w": ("ffn.net.2.weight", "linear"), "ffn.down.b": ("ffn.net.2.bias", "none")}
    for a in ("attn1", "attn2"):
        for n, ref in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0")):
            blk[f"{a}.{n}.w"] = (f"{a}.{ref}.weight", "linear")
            blk[f"{a}.{n}.b"] = (f"{a}.{ref}.bias", "none")
        blk[f"{a}.norm_q"] = (f"{a}.norm_q.weight", "none")
        blk[f"{a}.norm_k"] = (f"{a}.norm_k.weight", "none")
    blk.update({"attn2.add_k.w": ("attn2.add_k_proj.weight", "linear"), "attn2.add_k.b": ("attn2.add_k_proj.bias", "none"),
                "attn2.add_v.w": ("attn2.add_v_proj.weight", "linear"), "attn2.add_v.b": ("attn2.add_v_proj.bias", "none"),
                "attn2.norm_added_k": ("attn2.norm_added_k.weight", "none")})
    return KeyMap(r + _block_rules(blk), ignore=[r"\.norm_added_q\."])


def original_keymap(cfg: WanDiTConfig) -> KeyMap:
    """Names used by the original Wan release (``diffusion_pytorch_model*.safetensors`` of Wan-AI/Wan2.1-*)."""
    r = [
        Rule("patch_embedding.weight", "patch.w", "conv3d"),
        Rule("patch_embedding.bias", "patch.b"),
        Rule("time_embedding.0.weight", "time_in.l1.w", "linear"),
        Rule("time_embedding.0.bias", "time_in.l1.b"),
        Rule("time_embedding.2.weight", "time_in.l2.w", "linear"),
        Rule("time_embedding.2.bias", "time_in.l2.b"),
        Rule("time_projection.1.weight", "time_proj.w", "linear"),
        Rule("time_projection.1.bias", "time_proj.b"),
        Rule("text_embedding.0.weight", "text_in.l1.w", "linear"),
        Rule("text_embedding.0.bias", "text_in.l1.b"),
        Rule("text_embedding.2.weight", "text_in.l2.w", "linear"),
        Rule("text_embedding.2.bias", "text_in.l2.b"),
        Rule("head.head.weight", "head.w", "linear"),
        Rule("head.head.bias", "head.b"),
        Rule("head.modulation", "head_sst"),
        Rule("img_emb.proj.0.weight", "img_in.norm1.w"),
        Rule("img_emb.proj.0.bias", "img_in.norm1.b"),
        Rule("img_emb.proj.1.weight", "img_in.ff1.w", "linear"),
        Rule("img_emb.proj.1.bias", "img_in.ff1.b"),
        Rule("img_emb.proj.3.weight", "img_in.ff2.w", "linear"),
        Rule("img_emb.proj.3.bias", "img_in.ff2.b"),
        Rule("img_emb.proj.4.weight", "img_in.norm2.w"),
        Rule("img_emb.proj.4.bias", "img_in.norm2.b"),
        Rule("img_emb.emb_pos", "img_in.pos"),
    ]
    blk = {"sst": ("modulation", "none"), "norm2.w": ("norm3.weight", "none"), "norm2.b": ("norm3.bias", "none"),
           "ffn.up.w": ("ffn.0.weight", "linear"), "ffn.up.b": ("ffn.0.bias", "none"),
           "ffn.down.w": ("ffn.2.weight", "linear"), "ffn.down.b": ("ffn.2.bias", "none")}
    for a, ref_a in (("attn1", "self_attn"), ("attn2", "cross_attn")):
        for n in ("q", "k", "v", "o"):
            blk[f"{a}.{n}.w"] = (f"{ref_a}.{n}.weight", "linear")
            blk[f"{a}.{n}.b"] = (f"{ref_a}.{n}.bias", "none")
        blk[f"{a}.norm_q"] = (f"{ref_a}.norm_q.weight", "none")
        blk[f"{a}.norm_k"] = (f"{ref_a}.norm_k.weight", "none")
    blk.update({"attn2.add_k.w": ("cross_attn.k_img.weight", "linear"), "attn2.add_k.b": ("cross_attn.k_img.bias", "none"),
                "attn2.add_v.w": ("cross_attn.v_img.weight", "linear"), "attn2.add_v.b": ("cross_attn.v_img.bias", "none"),
                "attn2.norm_added_k": ("cross_attn.norm_k_img.weight", "none")})
    return KeyMap(r + _block_rules(blk))


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
    checkpoint (file or folder). Returns ``(params, cfg)`` with host numpy params."""
    path = Path(path)
    if cfg is None and path.is_dir() and (path / "config.json").exists():
        cfg = WanDiTConfig.from_diffusers(compat.read_config(path))
    ckpt = open_checkpoint(path)
    names = list(ckpt)
    if any(n.startswith("model.diffusion_model.") for n in names):
        ckpt = {n.removeprefix("model.diffusion_model."): ckpt[n] for n in names}
    return load_checkpoint_params(
        ckpt, cfg, is_original=_is_original, config_from_original=config_from_original,
        keymap=lambda c, original: original_keymap(c) if original else diffusers_keymap(c), shapes=param_shapes, dtype=dtype,
        what=lambda c: f"WanTransformer3DModel (dim {c.dim}, {c.num_layers} layers)", source=path)


# ----------------------------------------------------------------------------------- compat
class _WanDiTCompat(compat.CompatModel):
    def __init__(self, config, params, cfg, runner: WanDiTRunner | None = None):
        super().__init__("WanTransformer3DModel", config, params, cfg)
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


@compat.register("WanTransformer3DModel", scalable=True)
def _load_compat(config: dict, folder: Path, dtype=np.float32, mesh=None, parallelism=None, offload_chunk_size=None,
                 prefetch: bool = True, attn_impl=None, **_):
    cfg = WanDiTConfig.from_diffusers(config)
    if mesh is None and parallelism in (None, "none") and offload_chunk_size is None:
        params, cfg = load_dit(folder, cfg, dtype=dtype)
        return _WanDiTCompat(config, jax.tree.map(jnp.asarray, params), cfg)
    # fail on an impossible layout before reading a single tensor
    m = vmesh.make_mesh(mesh) if mesh is not None else vmesh.single_device_mesh()
    vsh.resolve_parallelism(parallelism, m)
    vmesh.check_divisible(parallel_constraints(cfg), m)
    if offload_chunk_size is not None:
        voff.resolve_chunk_size(offload_chunk_size, cfg.num_layers)
    params, cfg = load_dit(folder, cfg, dtype=dtype)  # host numpy; placed shard by shard below
    runner = WanDiTRunner(params, cfg, m, parallelism, offload_chunk_size=offload_chunk_size, prefetch=prefetch,
                          attn_impl=attn_impl)
    return _WanDiTCompat(config, None, cfg, runner)
