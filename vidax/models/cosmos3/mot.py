"""Cosmos3 omni model (diffusers ``Cosmos3OmniTransformer``): a Mixture-of-Transformers, as Flax NNX.

One packed sequence ``[text tokens (the "understanding" part, und_len tokens); vision tokens (the
"generation" part)]`` runs through ``num_hidden_layers`` layers. Every layer holds **two full
weight sets** -- q/k/v/o projections, q/k norms, pre-attention and pre-MLP RMS norms and the MLP --
one used by every text token, one (``*_moe_gen``, ``add_*``) by every vision token: no routing, no
gate, the modality decides (a Mixture-of-Transformers, not a sparse MoE). Attention is
one-directional:

- text tokens attend **causally** to text tokens only (the Qwen3 / Nemotron reasoner, unchanged);
- vision tokens attend to **all** text keys and all vision keys (full attention), never the reverse.

There is no AdaLN anywhere: the diffusion timestep (``t * timestep_scale``, a 256-wide sinusoid and
a two-layer MLP kept in float32) is added once to the noisy frames' tokens after ``proj_in``;
conditioning frames get nothing. Positions are a 3D multimodal RoPE (temporal / height / width
frequencies interleaved; text positions on all three axes), the vision positions offset past the
text by ``unified_3d_mrope_temporal_modality_margin`` and, with fps modulation, their temporal
index scaled to the base frame rate.

Because text never attends to vision and the timestep never reaches the text pathway, the text
pathway's keys/values are the same at every denoising step: :func:`text_cache` computes them once
per prompt (every layer; the shared runner's once-computed context, its ``KV_FROM`` text stack), and
:func:`vision` runs only the vision pathway against that cache each step. Together they are exactly the reference's forward, whose
calling convention (``input_ids``, ``text_indexes``, ``position_ids``, ``und_len``,
``sequence_length``, lists of ``vision_tokens`` with their shapes and index tensors...) is
:func:`reference_forward` and the ``load_pretrained`` adapter.

Ported: the vision generation path (text-to-image/video, image- and video-conditioned frames) for
the Qwen3 (``silu``, q/k norms) and Nemotron (``relu2``, no text q/k norms, a separate text-key norm
for the vision pathway) variants. Not ported: sound and action generation (their projections are
left unread).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from vidax import compat
from vidax.core.config import diffusers_kwargs
from vidax.core import mesh as vmesh
from vidax.core import nn
from vidax.core import offload as voff
from vidax.core import sharding as vsh
from vidax.core.runner import DiTRunner, context_local, run_local
from vidax.core.attention import attention
from vidax.core.embeddings import sinusoidal_embedding
from vidax.weights import KeyMap, Rule, load_checkpoint_params, open_checkpoint

F32 = jnp.float32


@dataclass(frozen=True)
class Cosmos3Config:
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"  # "silu" (Qwen3: gated MLP) | "relu2" (Nemotron: relu(x)^2 MLP)
    qk_norm_for_text: bool = True
    use_und_k_norm_for_gen: bool = False
    vocab_size: int = 151936
    latent_channel: int = 48
    latent_patch_size: int = 2
    patch_latent_dim: int = 192
    rope_theta: float = 5000000.0
    rope_axes_dim: tuple = (24, 20, 20)
    base_fps: int = 24
    enable_fps_modulation: bool = True
    unified_3d_mrope_reset_spatial_ids: bool = True
    unified_3d_mrope_temporal_modality_margin: int = 15000
    timestep_scale: float = 0.001
    sound_gen: bool = False
    action_gen: bool = False

    def __post_init__(self):
        if self.hidden_act not in ("silu", "relu2"):
            raise ValueError(f"Cosmos3 hidden_act must be 'silu' or 'relu2', got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.patch_latent_dim != self.latent_channel * self.latent_patch_size ** 2:
            raise ValueError(f"patch_latent_dim {self.patch_latent_dim} != latent_channel x patch^2 "
                             f"({self.latent_channel} x {self.latent_patch_size}^2)")
        if 3 * max(self.rope_axes_dim[1:]) > self.head_dim // 2 + 2:
            raise ValueError(f"rope_axes_dim {self.rope_axes_dim} does not fit head_dim {self.head_dim}")
        object.__setattr__(self, "rope_axes_dim", tuple(int(a) for a in self.rope_axes_dim))

    @property
    def k_norm_for_gen(self) -> bool:
        """A separate RMS norm on the text keys the vision pathway reads (Nemotron / Edge)."""
        return self.use_und_k_norm_for_gen and not self.qk_norm_for_text

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "Cosmos3Config":
        kw = diffusers_kwargs(cls, cfg, {}, ())
        if cfg.get("rope_axes_dim") is None:
            rs = cfg.get("rope_scaling") or {}
            kw["rope_axes_dim"] = tuple(rs.get("mrope_section", (24, 20, 20)))
        return cls(**kw)

#: the released Cosmos3 sizes (Nano: Qwen3-VL-8B backbone; Edge: Nemotron-2B-Dense-VL, from the
#: cosmos-framework release configs; its diffusers checkpoint is not public yet)
PRESETS = {
    "tiny": Cosmos3Config(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=12, vocab_size=384, latent_channel=8, patch_latent_dim=32,
                          rope_axes_dim=(2, 2, 2), rope_theta=10000.0),
    "tiny-edge": Cosmos3Config(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=12, vocab_size=384, latent_channel=8,
                               patch_latent_dim=32, rope_axes_dim=(2, 2, 2), rope_theta=10000.0, hidden_act="relu2",
                               qk_norm_for_text=False, use_und_k_norm_for_gen=True, rms_norm_eps=1e-5),
    "nano": Cosmos3Config(),
    "edge": Cosmos3Config(hidden_size=2048, intermediate_size=9216, num_hidden_layers=28, num_attention_heads=16,
                          num_key_value_heads=8, head_dim=128, vocab_size=131072, hidden_act="relu2",
                          qk_norm_for_text=False, use_und_k_norm_for_gen=True, rope_theta=1e8, rms_norm_eps=1e-5),
}


# ----------------------------------------------------------------------------------- layers
def _rotate_half(x):
    d = x.shape[-1] // 2
    return jnp.concatenate([-x[..., d:], x[..., :d]], axis=-1)


def apply_rope(x, cos, sin):
    """``x * cos + rotate_half(x) * sin`` in float32. ``x``: [B, L, H, D]; ``cos``/``sin``: [B, L, D]."""
    xf = x.astype(F32)
    return (xf * cos[:, :, None] + _rotate_half(xf) * sin[:, :, None]).astype(x.dtype)


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))`` (Qwen3) or ``down(relu(up(x))^2)`` (Nemotron)."""

    def __init__(self, cfg: Cosmos3Config, *, rngs: nnx.Rngs, param_dtype=F32):
        d, f = cfg.hidden_size, cfg.intermediate_size
        kw = dict(rngs=rngs, param_dtype=param_dtype, bias=False)
        self.act = cfg.hidden_act
        self.gate = nn.Linear(d, f, axes=("embed", "ffn"), **kw) if cfg.hidden_act == "silu" else None
        self.up = nn.Linear(d, f, axes=("embed", "ffn"), **kw)
        self.down = nn.Linear(f, d, axes=("ffn", "embed"), **kw)

    def __call__(self, x, par: vsh.ParallelContext):
        if self.act == "relu2":
            return par.linear(self.down, jnp.square(jax.nn.relu(par.linear(self.up, x))))
        return par.linear(self.down, jax.nn.silu(par.linear(self.gate, x)) * par.linear(self.up, x))


class Pathway(nnx.Module):
    """One modality's weight set of a layer: norms, q/k/v/o, q/k head norms, MLP."""

    def __init__(self, cfg: Cosmos3Config, *, qk_norm: bool, k_norm_for_gen: bool = False, rngs: nnx.Rngs,
                 param_dtype=F32):
        d, h, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = dict(rngs=rngs, param_dtype=param_dtype, bias=cfg.attention_bias)
        nk = dict(rngs=rngs, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.head_dim = hd
        self.ln1 = nn.RMSNorm(d, **nk)
        self.q = nn.Linear(d, h * hd, axes=("embed", "heads"), **kw)
        self.k = nn.Linear(d, kv * hd, axes=("embed", "kv_heads"), **kw)
        self.v = nn.Linear(d, kv * hd, axes=("embed", "kv_heads"), **kw)
        self.o = nn.Linear(h * hd, d, axes=("heads", "embed"), **kw)
        self.norm_q = nn.RMSNorm(hd, **nk) if qk_norm else None
        self.norm_k = nn.RMSNorm(hd, **nk) if qk_norm else None
        self.norm_k_gen = nn.RMSNorm(hd, **nk) if k_norm_for_gen else None  # text keys as the vision pathway reads them
        self.ln2 = nn.RMSNorm(d, **nk)
        self.mlp = MLP(cfg, rngs=rngs, param_dtype=param_dtype)

    def qkv(self, x, cos, sin, par: vsh.ParallelContext):
        """Normed, roped ``q`` [B, L, Hl, hd], ``k`` and (text pathway with a separate key norm) the
        vision pathway's view of ``k``, and ``v`` [B, L, KVl, hd]."""
        hd = self.head_dim
        h = self.ln1(x)
        q = par.linear(self.q, h).reshape(*h.shape[:2], -1, hd)
        k = par.linear(self.k, h).reshape(*h.shape[:2], -1, hd)
        v = par.linear(self.v, h).reshape(*h.shape[:2], -1, hd)
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        k_gen = self.norm_k_gen(k) if self.norm_k_gen is not None else k
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), apply_rope(k_gen, cos, sin), v

    def finish(self, x, o, par: vsh.ParallelContext):
        """Output projection, residual, MLP, residual."""
        x = x + par.linear(self.o, o.reshape(*o.shape[:2], -1)).astype(x.dtype)
        return x + self.mlp(self.ln2(x), par).astype(x.dtype)


def _expand_kv(k, groups: int):
    """GQA: every group of ``groups`` query heads reads one key/value head."""
    return k if groups == 1 else jnp.repeat(k, groups, axis=2)


def text_layer(und: Pathway, x, cos, sin, groups: int, par: vsh.ParallelContext = vsh.LOCAL):
    """Causal text self-attention + MLP. Returns ``(x, k_for_vision, v)`` (the cache entries)."""
    q, k, k_gen, v = und.qkv(x, cos, sin, par)
    lq = x.shape[1]
    causal = jnp.tril(jnp.ones((lq, lq), bool))[None, None]
    o = attention(q, _expand_kv(k, groups), _expand_kv(v, groups), mask=causal, impl=par.attn_impl)
    return und.finish(x, o, par), k_gen, v


def vision_layer(gen: Pathway, x, cos, sin, k_text, v_text, text_mask, groups: int,
                 par: vsh.ParallelContext = vsh.LOCAL):
    """Vision tokens attend to every (real) text key and every vision key; MLP."""
    q, k, _, v = gen.qkv(x, cos, sin, par)
    o = joint_attention(q, _expand_kv(k, groups), _expand_kv(v, groups), _expand_kv(k_text, groups),
                        _expand_kv(v_text, groups), text_mask, par)
    return gen.finish(x, o, par)


def joint_attention(q, k, v, k_text, v_text, text_mask, par: vsh.ParallelContext):
    """Vision queries over ``[text keys; vision keys]``. ``q``/``k``/``v``: [B, Lg(/sp), Hl, hd]
    (this device's vision tokens under sequence parallelism); ``k_text``/``v_text``: [B, Lu, Hl, hd]
    (replicated over sp); ``text_mask``: [B, Lu] (1 = a real text token).

    Under sp the core's USP attention (Ulysses x ring) exchanges only the vision part; the text
    keys are already whole on every device, so each takes its own head slice, masked by
    ``text_mask`` (padded vision tokens are masked too)."""
    return par.joint_attention(q, k, v, None, k_text.astype(k.dtype), v_text.astype(v.dtype),
                               extra_mask=jnp.asarray(text_mask, bool), extra_first=True)[0]


class Cosmos3Embed(nnx.Module):
    """Token embeddings, the latent patch projection and the timestep MLP (float32)."""

    def __init__(self, cfg: Cosmos3Config, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.hidden_size
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        self.tokens = nn.Embed(cfg.vocab_size, d, rngs=rngs, axes=("vocab", "embed"), std=0.02, param_dtype=param_dtype)
        self.proj_in = nn.Linear(cfg.patch_latent_dim, d, axes=(None, "embed"), **kw)
        self.t1 = nn.Linear(256, d, rngs=rngs, param_dtype=F32)
        self.t2 = nn.Linear(d, d, rngs=rngs, param_dtype=F32)

    def text(self, ids, par: vsh.ParallelContext = vsh.LOCAL):
        return par.lookup(self.tokens, jnp.asarray(ids, jnp.int32))

    def vision(self, patches, t, noisy):
        """``patches`` [B, L, p*p*C], ``t`` [B, L] (the scheduler's timestep, e.g. 999), ``noisy``
        [B, L] (1 where the token's frame is noisy) -> tokens [B, L, D]."""
        h = self.proj_in(patches)
        e = sinusoidal_embedding(jnp.asarray(t, F32) * self.cfg.timestep_scale, 256, flip_sin_to_cos=True)
        temb = self.t2(jax.nn.silu(self.t1(e)))
        return h + (temb * jnp.asarray(noisy, F32)[..., None]).astype(h.dtype)

    def __call__(self, a: dict, par: vsh.ParallelContext = vsh.LOCAL):
        """The runner's embed: the vision tokens (carry) and what every layer's step reads."""
        return {"h": self.vision(a["patches"], a["t"], a["noisy"])}, {k: a[k] for k in ("cos", "sin", "tm")}

    def kv_context(self, a: dict, par: vsh.ParallelContext = vsh.LOCAL) -> dict:
        """The text pathway's start: the embedded prompt and its RoPE tables, carried through the layers."""
        return {"x": self.text(a["ids"], par), "cos_u": a["cos_u"], "sin_u": a["sin_u"]}


class Cosmos3Head(nnx.Module):
    def __init__(self, cfg: Cosmos3Config, *, rngs: nnx.Rngs, param_dtype=F32):
        self.norm = nn.RMSNorm(cfg.hidden_size, rngs=rngs, eps=cfg.rms_norm_eps, param_dtype=param_dtype)
        self.proj_out = nn.Linear(cfg.hidden_size, cfg.patch_latent_dim, axes=("embed", None), rngs=rngs,
                                  param_dtype=param_dtype)

    def __call__(self, carry: dict, consts: dict, par: vsh.ParallelContext = vsh.LOCAL):
        return {"y": self.proj_out(self.norm(carry["h"]))}


# ----------------------------------------------------------------------------------- sharding
#: Tensor parallelism: attention heads and key/value heads of both pathways split over tp (q/k/v
#: column-parallel, o row-parallel), the MLP width and the token-embedding table too (looked up
#: outside shard_map, partitioned by the compiler); the head norms are per head. Sequence
#: parallelism splits the vision tokens (Ulysses); the text pathway and its cache stay whole on
#: every device (they are short and computed once per prompt). Cosmos3's deltas to the core table:
AXIS_DELTAS = {"kv_heads": "tp", "vocab": "tp"}


class Cosmos3Omni(nnx.Module):
    """The Cosmos3 omni model (vision generation) on the hooks of :class:`vidax.core.runner.DiTRunner`:
    ``embed`` -> the stacked vision pathway ``gen`` -> ``head`` (its final norm + ``proj_out``), run
    against the text keys / values the stacked text pathway ``und`` computes once per prompt (the
    runner's context, ``KV_FROM``). The text pathway's final norm only shapes text outputs (unused)."""

    STACKS = ("gen",)
    KV_FROM = {"gen": "und"}
    CONTEXT = ("ids", "cos_u", "sin_u")
    AXIS_DELTAS = AXIS_DELTAS

    def __init__(self, cfg: Cosmos3Config, *, rngs: nnx.Rngs, param_dtype=F32):
        self.cfg = cfg
        self.embed = Cosmos3Embed(cfg, rngs=rngs, param_dtype=param_dtype)
        self.und = nn.stack(lambda r: Pathway(cfg, qk_norm=cfg.qk_norm_for_text, k_norm_for_gen=cfg.k_norm_for_gen,
                                              rngs=r, param_dtype=param_dtype), cfg.num_hidden_layers, rngs)
        self.gen = nn.stack(lambda r: Pathway(cfg, qk_norm=True, rngs=r, param_dtype=param_dtype),
                            cfg.num_hidden_layers, rngs)
        self.head = Cosmos3Head(cfg, rngs=rngs, param_dtype=param_dtype)

    @property
    def groups(self) -> int:
        return self.cfg.num_attention_heads // self.cfg.num_key_value_heads

    def kv_gen(self, und: Pathway, c: dict, par):
        """One text layer: the constants the next one starts from, and the keys / values the vision
        layer of the same depth reads."""
        x, k, v = text_layer(und, c["x"], c["cos_u"], c["sin_u"], self.groups, par)
        return {**c, "x": x}, {"k": k, "v": v}

    def step_gen(self, gen: Pathway, carry: dict, c: dict, par):
        if "kv" not in c:
            raise ValueError("Cosmos3 runs against its text cache: pass context= (mot.text_cache)")
        kv = c["kv"]
        return {"h": vision_layer(gen, carry["h"], c["cos"], c["sin"], kv["k"], kv["v"], c["tm"], self.groups, par)}

    @staticmethod
    def act_spec(name: str, shape: tuple) -> tuple:
        """Logical axes: the vision tokens split over sp, the text (and its cache) whole on every device."""
        return vsh.activation_axes(name, shape, tokens=("h", "y", "patches", "t", "noisy", "cos", "sin"),
                                   kv=("k", "v"), kv_axis="kv_heads")

    @staticmethod
    def pack(patches, t, noisy, cos, sin, text_mask) -> dict:
        return {"patches": patches, "t": t, "noisy": noisy, "cos": cos, "sin": sin, "tm": text_mask}

    @staticmethod
    def prepare(a: dict, dtype) -> dict:
        return {"patches": a["patches"].astype(dtype), "tm": a["tm"].astype(bool),
                **{k: a[k].astype(F32) for k in ("t", "noisy", "cos", "sin")}}

    @staticmethod
    def prepare_context(a: dict, dtype) -> dict:
        return {"ids": a["ids"].astype(jnp.int32), "cos_u": a["cos_u"].astype(F32), "sin_u": a["sin_u"].astype(F32)}

    @staticmethod
    def finish(out: dict, shapes: dict):
        return out["y"]

    def check(self, shapes: dict, mesh) -> None:
        b, n = shapes["patches"][:2]
        vmesh.check_divisible(parallel_constraints(self.cfg, tokens=n, batch=b), mesh)


# ----------------------------------------------------------------------------------- positions
def text_positions(n: int, float_positions: bool) -> np.ndarray:
    """[3, n]: the same increasing position on all three axes."""
    ids = np.arange(n, dtype=np.float32 if float_positions else np.int64)
    return np.broadcast_to(ids, (3, n)).copy()


def vision_positions(cfg: Cosmos3Config, grid, offset, fps=None, temporal_compression: int = 4) -> np.ndarray:
    """[3, T*h*w] mRoPE positions of a vision grid starting at ``offset`` (the reference's
    ``get_3d_mrope_ids_vae_tokens``): with fps modulation (and more than one frame) the temporal
    index is ``frame / (fps / tc) * (base_fps / tc) + offset`` in float32."""
    gt, gh, gw = grid
    fps = fps if cfg.enable_fps_modulation else None
    h_idx = np.broadcast_to(np.arange(gh)[None, :, None], (gt, gh, gw)).reshape(-1)
    w_idx = np.broadcast_to(np.arange(gw)[None, None, :], (gt, gh, gw)).reshape(-1)
    if not cfg.unified_3d_mrope_reset_spatial_ids:
        h_idx, w_idx = h_idx + int(offset), w_idx + int(offset)
    if fps is not None and gt > 1:
        tps = float(fps) / temporal_compression
        base_tps = float(cfg.base_fps) / temporal_compression
        frames = np.arange(gt, dtype=np.float32)
        scaled = (frames / np.float32(tps) * np.float32(base_tps) + np.float32(offset)).astype(np.float32)
        t_idx = np.repeat(scaled, gh * gw)
        return np.stack([t_idx, h_idx.astype(np.float32), w_idx.astype(np.float32)])
    t_idx = np.repeat(np.arange(gt, dtype=np.int64), gh * gw) + int(offset)
    return np.stack([t_idx, h_idx, w_idx]).astype(np.int64)


def vision_offset(cfg: Cosmos3Config, und_len: int) -> int:
    return und_len + cfg.unified_3d_mrope_temporal_modality_margin


def rope_angles(cfg: Cosmos3Config, positions) -> np.ndarray:
    """[N, head_dim] angles from mRoPE positions [3, N] (interleaved T/H/W frequency slots)."""
    hd = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd)))).astype(np.float32)
    pos = np.asarray(positions, np.float32)  # [3, N]
    freqs = (pos[:, :, None] * inv[None, None, :]).astype(np.float32)  # [3, N, hd/2]
    f = freqs[0].copy()
    for axis, offset in ((1, 1), (2, 2)):
        sl = slice(offset, cfg.rope_axes_dim[axis] * 3, 3)
        f[:, sl] = freqs[axis][:, sl]
    return np.concatenate([f, f], axis=-1)


def rope_tables(cfg: Cosmos3Config, positions):
    a = rope_angles(cfg, positions)
    return np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)


# ----------------------------------------------------------------------------------- (un)patchify
def patch_grid(cfg: Cosmos3Config, latent_thw) -> tuple[int, int, int]:
    p = cfg.latent_patch_size
    t, h, w = latent_thw
    return t, -(-h // p), -(-w // p)


def patchify(cfg: Cosmos3Config, x):
    """Channels-last latents [B, T, H, W, C] -> [B, T*hp*wp, p*p*C] (zero-padded to the patch grid;
    the reference's ``(p_h, p_w, C)`` order)."""
    b, t, h, w, c = x.shape
    p = cfg.latent_patch_size
    _, hp, wp = patch_grid(cfg, (t, h, w))
    if hp * p != h or wp * p != w:
        x = jnp.pad(x, ((0, 0), (0, 0), (0, hp * p - h), (0, wp * p - w), (0, 0)))
    x = x.reshape(b, t, hp, p, wp, p, c).transpose(0, 1, 2, 4, 3, 5, 6)
    return x.reshape(b, t * hp * wp, p * p * c)


def unpatchify(cfg: Cosmos3Config, y, thw):
    """[B, T*hp*wp, p*p*C] -> [B, T, H, W, C] (the padding cropped)."""
    t, h, w = thw
    p = cfg.latent_patch_size
    _, hp, wp = patch_grid(cfg, thw)
    b = y.shape[0]
    y = y.reshape(b, t, hp, wp, p, p, -1).transpose(0, 1, 2, 4, 3, 5, 6).reshape(b, t, hp * p, wp * p, -1)
    return y[:, :, :h, :w]


# ----------------------------------------------------------------------------------- state
KIT = nn.ModelKit(Cosmos3Omni, units=("embed", "und", "gen", "head"), dtype_leaf=("embed", "proj_in", "kernel"))
#: seeded random modules for presets and tests, the abstract state a checkpoint fills, its shapes
#: (the key maps' target), the graphdefs the runner merges unit by unit, the state's dtype, and
#: the module back from a state inside a traced function (the unit of ``jit``): see ``nn.ModelKit``
_build, init_model, init_state, abstract_state = KIT.build, KIT.init_model, KIT.init_state, KIT.abstract_state
param_shapes, state_dtype, merge = KIT.param_shapes, KIT.state_dtype, KIT.merge


def runner(state, cfg: Cosmos3Config, mesh=None, parallelism=None, **kw) -> DiTRunner:
    """The Cosmos3 model on a ``(dp, tp, sp)`` mesh through :class:`vidax.core.runner.DiTRunner`,
    layers resident or offloaded (the text pathway streamed once per prompt batch for its cache, the
    vision pathway every step)."""
    return KIT.runner(state, cfg, mesh, parallelism, constraints=parallel_constraints(cfg), **kw)


@partial(jax.jit, static_argnums=(1,))
def _text_cache_jit(state, cfg: Cosmos3Config, ids, cos, sin):
    kv = context_local(merge(state, cfg), {"ids": ids, "cos_u": cos, "sin_u": sin}, state_dtype(state))["gen"]
    return kv["k"], kv["v"]


def text_cache(model, cfg: Cosmos3Config, ids, cos, sin):
    """The text pathway over ``ids`` [B, Lu] (padded at the end: a real token never sees a pad), once
    per prompt: on one device (``model`` a state) ``(keys, values)`` [layers, B, Lu, KV, hd]; on a
    :func:`runner`, its context tree. What every vision step reads (``cache``)."""
    if isinstance(model, DiTRunner):
        return model.context({"ids": ids, "cos_u": cos, "sin_u": sin})
    return _text_cache_jit(model, cfg, jnp.asarray(ids, jnp.int32), jnp.asarray(cos, F32), jnp.asarray(sin, F32))


def vision_forward(state, cfg: Cosmos3Config, patches, t, noisy, cos, sin, cache, text_mask, *, attn_impl=None):
    """One denoising evaluation on one device (pure; jit it with ``static_argnums=1``): vision tokens
    ``patches`` [B, Lg, p*p*C] against the text ``cache`` -> predictions [B, Lg, p*p*C]."""
    inputs = Cosmos3Omni.pack(patches, t, noisy, cos, sin, text_mask)
    return run_local(merge(state, cfg), {k: jnp.asarray(v) for k, v in inputs.items()}, {}, state_dtype(state),
                     vsh.ParallelContext(attn_impl=attn_impl), {"gen": {"k": cache[0], "v": cache[1]}})


def vision(model, cfg: Cosmos3Config, patches, t, noisy, cos, sin, cache, text_mask):
    """:func:`vision_forward` on one device (``model`` a state, jitted) or on a :func:`runner`."""
    if isinstance(model, DiTRunner):
        return model(patches, t, noisy, cos, sin, text_mask, context=cache)
    return _vision_jit(model, cfg, patches, t, noisy, cos, sin, cache, text_mask)


# ----------------------------------------------------------------------------------- the reference's calling convention
def reference_forward(state, cfg: Cosmos3Config, *, input_ids, text_indexes, position_ids, und_len: int,
                      sequence_length: int, vision_tokens, vision_token_shapes, vision_sequence_indexes,
                      vision_mse_loss_indexes, vision_timesteps, vision_noisy_frame_indexes, runner=None, **extra):
    """``Cosmos3OmniTransformer.forward`` (vision generation) on numpy inputs in the reference's layout:
    one packed sample whose text fills ``[0, und_len)`` and whose vision items follow it in order.
    Returns the list of per-item predictions ``[1, C, T, H, W]`` (zeros on conditioning frames).
    ``runner``: a :func:`runner` (mesh / offloading) instead of ``state`` on one device."""
    for k, v in extra.items():
        if k.startswith(("sound_", "action_")) and v is not None:
            raise NotImplementedError(f"Cosmos3 {k}: sound and action generation are not ported")
    und_len = int(und_len)
    text_indexes = np.asarray(text_indexes).reshape(-1)
    ids = np.asarray(input_ids).reshape(-1)
    if len(ids) != und_len or not np.array_equal(text_indexes, np.arange(und_len)):
        raise NotImplementedError("Cosmos3: the text must fill the understanding prefix [0, und_len) "
                                  "(vision understanding tokens are not ported)")
    vis_idx = np.asarray(vision_sequence_indexes).reshape(-1)
    if not np.array_equal(vis_idx, np.arange(und_len, int(sequence_length))):
        raise NotImplementedError("Cosmos3: the vision tokens must follow the text, packed, up to sequence_length")
    p = cfg.latent_patch_size
    pos = np.asarray(position_ids)
    if pos.ndim == 1:
        pos = np.broadcast_to(pos, (3, pos.shape[0]))
    cos, sin = rope_tables(cfg, pos)
    patches, noisy, t_tok, shapes = [], [], [], []
    timesteps = np.asarray(vision_timesteps, np.float32).reshape(-1)
    n_seen = 0
    for lat, shape, noisy_frames in zip(vision_tokens, vision_token_shapes, vision_noisy_frame_indexes):
        lat = np.asarray(lat, np.float32)[0]  # [C, T, H, W]
        c, tt, hh, ww = lat.shape
        grid = patch_grid(cfg, (tt, hh, ww))
        if tuple(int(s) for s in shape) != grid:
            raise ValueError(f"vision_token_shapes {tuple(shape)} != the latent's patch grid {grid}")
        patches.append(np.asarray(patchify(cfg, jnp.asarray(lat.transpose(1, 2, 3, 0))[None]))[0])
        per_frame = grid[1] * grid[2]
        m = np.zeros(tt, np.float32)
        m[np.asarray(noisy_frames, np.int64).reshape(-1)] = 1.0
        noisy.append(np.repeat(m, per_frame))
        # the noisy frames' tokens take the timesteps in order; the others none
        t = np.zeros(tt * per_frame, np.float32)
        sel = np.nonzero(np.repeat(m, per_frame))[0]
        t[sel] = timesteps[n_seen:n_seen + len(sel)]
        n_seen += len(sel)
        t_tok.append(t)
        shapes.append(((tt, hh, ww), np.asarray(noisy_frames, np.int64).reshape(-1), grid))
    model = state if runner is None else runner
    dt = state_dtype(state) if runner is None else runner.dtype
    cache = text_cache(model, cfg, jnp.asarray(ids[None], jnp.int32), jnp.asarray(cos[None, :und_len]),
                       jnp.asarray(sin[None, :und_len]))
    out = vision(model, cfg, jnp.asarray(np.concatenate(patches)[None], dt), jnp.asarray(np.concatenate(t_tok)[None]),
                 jnp.asarray(np.concatenate(noisy)[None]), jnp.asarray(cos[None, und_len:]),
                 jnp.asarray(sin[None, und_len:]), cache, jnp.ones((1, und_len), bool))
    last = np.asarray(out, np.float32)[0]  # [Lg, p*p*C] for every vision token
    preds = last[np.asarray(vision_mse_loss_indexes).reshape(-1) - und_len]
    results, start = [], 0
    for thw, noisy_frames, grid in shapes:
        tt, hh, ww = thw
        _, hp, wp = grid
        y = np.zeros((cfg.latent_channel, tt, hh, ww), np.float32)
        n = len(noisy_frames) * hp * wp
        if n:
            blk = preds[start:start + n].reshape(len(noisy_frames), hp, wp, p, p, cfg.latent_channel)
            blk = blk.transpose(5, 0, 1, 3, 2, 4).reshape(cfg.latent_channel, len(noisy_frames), hp * p, wp * p)
            y[:, noisy_frames] = blk[:, :, :hh, :ww]
            start += n
        results.append(y[None])
    return results


_vision_jit = jax.jit(vision_forward, static_argnums=(1,))


def parallel_constraints(cfg: Cosmos3Config, *, tokens: int | None = None, batch: int | None = None):
    r = [vmesh.UlyssesHeads("num_attention_heads", cfg.num_attention_heads),
         vmesh.Divisible("num_key_value_heads", cfg.num_key_value_heads, ("tp",),
                         "key/value heads are split over tp"),
         vmesh.Divisible("intermediate_size", cfg.intermediate_size, ("tp",), "the MLPs are split over tp"),
         vmesh.Divisible("vocab_size", cfg.vocab_size, ("tp",), "the token-embedding table is split over tp")]
    return r + vmesh.input_rules(tokens, batch, what="vision tokens")


# ----------------------------------------------------------------------------------- key maps
def keymap(cfg: Cosmos3Config, prefix: str = "") -> KeyMap:
    """diffusers ``Cosmos3OmniTransformer`` names (optionally under a ``model.`` prefix) -> state paths.
    The LM head and the sound / action projections are not read."""

    def lin(ref, dst, bias):
        return [(f"{ref}.weight", f"{dst}.kernel", "linear")] + ([(f"{ref}.bias", f"{dst}.bias", "none")] if bias else [])

    b = cfg.attention_bias
    top = [("embed_tokens.weight", "embed.tokens.embedding", "none"), *lin("proj_in", "embed.proj_in", True),
           *lin("proj_out", "head.proj_out", True), *lin("time_embedder.linear_1", "embed.t1", True),
           *lin("time_embedder.linear_2", "embed.t2", True), ("norm_moe_gen.weight", "head.norm.scale", "none")]
    layer = []
    for path, names in (("und", dict(q="to_q", k="to_k", v="to_v", o="to_out", nq="norm_q", nk="norm_k",
                                    ln1="input_layernorm", ln2="post_attention_layernorm", mlp="mlp")),
                        ("gen", dict(q="add_q_proj", k="add_k_proj", v="add_v_proj", o="to_add_out", nq="norm_added_q",
                                     nk="norm_added_k", ln1="input_layernorm_moe_gen",
                                     ln2="post_attention_layernorm_moe_gen", mlp="mlp_moe_gen"))):
        for x in "qkvo":
            layer += lin(f"self_attn.{names[x]}", f"{path}.{x}", b)
        if path == "gen" or cfg.qk_norm_for_text:
            layer += [(f"self_attn.{names['nq']}.weight", f"{path}.norm_q.scale", "none"),
                      (f"self_attn.{names['nk']}.weight", f"{path}.norm_k.scale", "none")]
        layer += [(f"{names['ln1']}.weight", f"{path}.ln1.scale", "none"),
                  (f"{names['ln2']}.weight", f"{path}.ln2.scale", "none")]
        if cfg.hidden_act == "silu":
            layer += lin(f"{names['mlp']}.gate_proj", f"{path}.mlp.gate", False)
        layer += lin(f"{names['mlp']}.up_proj", f"{path}.mlp.up", False) + lin(f"{names['mlp']}.down_proj",
                                                                            f"{path}.mlp.down", False)
    if cfg.k_norm_for_gen:
        layer += [("self_attn.k_norm_und_for_gen.weight", "und.norm_k_gen.scale", "none")]
    rules = [Rule(prefix + s, d, k) for s, d, k in top]
    rules += [Rule(f"{prefix}layers.{{i}}.{s}", d, k) for s, d, k in layer]
    p = prefix.replace(".", r"\.")
    ignore = [rf"^{p}lm_head\.", rf"^{p}norm\.weight$", rf"^{p}audio_", rf"^{p}action_"]
    return KeyMap(rules, ignore=ignore)


def load_model(path, cfg: Cosmos3Config | None = None, dtype=np.float32):
    """Weights from a diffusers ``transformer/`` folder (or a file with the same names, optionally
    under ``model.``). Returns ``(state, cfg)`` (host numpy; nothing random materialised)."""
    path = Path(path)
    if cfg is None:
        if not (path.is_dir() and (path / "config.json").exists()):
            raise ValueError(f"{path}: no config.json; pass the Cosmos3 config")
        cfg = Cosmos3Config.from_diffusers(compat.read_config(path))
    ckpt = open_checkpoint(path)
    prefix = "model." if any(n.startswith("model.layers.") for n in ckpt) else ""
    pure, cfg = load_checkpoint_params(
        ckpt, cfg, is_original=lambda names: False, config_from_original=None,
        keymap=lambda c, original: keymap(c, prefix), shapes=lambda c: param_shapes(c, dtype), dtype=dtype,
        what=lambda c: f"Cosmos3OmniTransformer (hidden {c.hidden_size}, {c.num_hidden_layers} layers)", source=path)
    return nn.fill(abstract_state(cfg, dtype), pure), cfg


# ----------------------------------------------------------------------------------- compat
class _Cosmos3Compat(compat.CompatModel):
    def __init__(self, config, state, cfg, runner=None):
        super().__init__("Cosmos3OmniTransformer", config, state, cfg)
        self.runner = runner

    def forward(self, **kw):
        """The reference's keywords (numpy) -> the per-item vision predictions (its first output)."""
        kw.pop("return_dict", None)
        return reference_forward(self.params, self.model_config, runner=self.runner, **kw)


compat.register_dit("Cosmos3OmniTransformer", Cosmos3Config.from_diffusers, _Cosmos3Compat, load_model, runner,
                    constraints=parallel_constraints,
                    check_chunks=lambda c, cfg: voff.resolve_chunk_size(c, cfg.num_hidden_layers))
