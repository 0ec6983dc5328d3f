"""CogVideoX diffusion transformer (diffusers ``CogVideoXTransformer3DModel``) as Flax NNX modules.

One sequence of ``[text; video]`` tokens runs through full self-attention (no cross-attention):
every block modulates the text and the video part separately (LayerNorm-Zero, a shared norm with
two sets of shift / scale / gate from the timestep embedding), normalises q and k per head
(LayerNorm over the head dim), and runs one feed-forward on both parts.

Variants, all configuration of one module (:class:`CogVideoXConfig`, the diffusers config):

- **CogVideoX-2B**: a fixed 3D sin-cos positional embedding added to the joint sequence (zeros on
  the text part, so the text length must be ``max_text_seq_length``), recomputed for the actual
  latent size (:func:`sincos_table`);
- **CogVideoX-5B / 1.5**: 3D rotary embedding on the video tokens only, taken precomputed
  (``image_rotary_emb``: ``(cos, sin)`` each ``[L_video, head_dim]``, as the reference takes it);
  the pipelines build it with :func:`rope_tables` ('linspace' grid for 1.0, 'slice' grid with
  ``max_size`` for 1.5);
- **CogVideoX-5B-I2V**: a learned positional embedding (the checkpoint's ``pos_embedding`` over
  the joint sequence) at the native size; another frame count falls back to sin-cos, as the
  reference does;
- **CogVideoX 1.5**: temporal patch size 2 (a Linear patch embedding over ``(c, pt, ph, pw)``) and,
  for I2V, the ``ofs`` embedding added to the timestep embedding.

Layout: the model takes latents channels-last ``[B, F, H, W, C]``; the ``compat`` adapter takes the
reference's ``[B, F, C, H, W]``. Timesteps are the scheduler's integers (any float works).

The blocks are stacked (``nn.stack``) and run with ``lax.scan``; :func:`runner` (the core runner) places or
streams the same state on a ``(dp, tp, sp)`` mesh: Megatron TP over heads / FFN width, and joint
sequence parallelism (:func:`joint_attention`): Ulysses all-to-all over the **video** tokens only,
the replicated text tokens' q/k/v sliced to the local heads.
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
from vidax.core.runner import DiTRunner, run_local
from vidax.core.embeddings import sinusoidal_embedding
from vidax.weights import KeyMap, Rule

F32 = jnp.float32


# ----------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class CogVideoXConfig(DiTConfig, num_heads=30, head_dim=64, num_layers=30):
    """Mirrors diffusers' ``CogVideoXTransformer3DModel`` config (defaults = CogVideoX-2B)."""

    flip_sin_to_cos: bool = True
    freq_shift: float = 0
    time_embed_dim: int = 512
    ofs_embed_dim: int | None = None
    text_embed_dim: int = 4096
    attention_bias: bool = True
    sample_width: int = 90
    sample_height: int = 60
    sample_frames: int = 49
    patch_size: int = 2
    patch_size_t: int | None = None
    temporal_compression_ratio: int = 4
    max_text_seq_length: int = 226
    activation_fn: str = "gelu-approximate"
    timestep_activation_fn: str = "silu"
    norm_elementwise_affine: bool = True
    norm_eps: float = 1e-5
    spatial_interpolation_scale: float = 1.875
    temporal_interpolation_scale: float = 1.0
    use_rotary_positional_embeddings: bool = False
    use_learned_positional_embeddings: bool = False
    patch_bias: bool = True

    def __post_init__(self):
        if self.use_learned_positional_embeddings and not self.use_rotary_positional_embeddings:
            raise ValueError("CogVideoX config: learned positional embeddings without rotary embeddings are not "
                             "supported (no such checkpoint; the reference refuses it too)")
        if self.ofs_embed_dim and self.ofs_embed_dim != self.time_embed_dim:
            raise ValueError(f"CogVideoX config: ofs_embed_dim={self.ofs_embed_dim} must equal time_embed_dim="
                             f"{self.time_embed_dim} (the ofs embedding is added to the timestep embedding)")
        if self.uses_sincos and self.dim % 16:
            raise ValueError(f"CogVideoX config: the 3D sin-cos positional embedding needs a width divisible by 16, "
                             f"got {self.dim}")
        nn.activation(self.activation_fn)
        nn.activation(self.timestep_activation_fn)

    @property
    def pt(self) -> int:
        return self.patch_size_t or 1

    @property
    def patch(self) -> tuple[int, int, int]:
        return (self.pt, self.patch_size, self.patch_size)

    @property
    def ffn_dim(self) -> int:
        return 4 * self.dim

    @property
    def patch_has_bias(self) -> bool:
        """1.0's Conv2d honours ``patch_bias``; 1.5's Linear patch embedding always has a bias."""
        return self.patch_bias or self.patch_size_t is not None

    @property
    def uses_sincos(self) -> bool:
        return not self.use_rotary_positional_embeddings

    @property
    def sample_grid(self) -> tuple[int, int, int]:
        """The token grid of the config's sample size (what a learned embedding covers)."""
        f = (self.sample_frames - 1) // self.temporal_compression_ratio + 1
        return (f // self.pt, self.sample_height // self.patch_size, self.sample_width // self.patch_size)

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "CogVideoXConfig":
        kw = diffusers_kwargs(cls, cfg)
        if not kw.get("ofs_embed_dim"):
            kw["ofs_embed_dim"] = None
        return cls(**kw)


PRESETS = {
    "tiny": CogVideoXConfig(num_heads=2, head_dim=16, in_channels=4, out_channels=4, time_embed_dim=24,
                            text_embed_dim=32, num_layers=2, sample_width=8, sample_height=8, sample_frames=9,
                            max_text_seq_length=16),
    "2b": CogVideoXConfig(),
    "5b": CogVideoXConfig(num_heads=48, num_layers=42, use_rotary_positional_embeddings=True),
    "5b-i2v": CogVideoXConfig(num_heads=48, num_layers=42, in_channels=32, out_channels=16,
                              use_rotary_positional_embeddings=True, use_learned_positional_embeddings=True),
    "1.5-5b": CogVideoXConfig(num_heads=48, num_layers=42, patch_size_t=2, patch_bias=False, sample_height=300,
                              sample_width=300, sample_frames=81, use_rotary_positional_embeddings=True),
    "1.5-5b-i2v": CogVideoXConfig(num_heads=48, num_layers=42, in_channels=32, out_channels=16, ofs_embed_dim=512,
                                  patch_size_t=2, patch_bias=False, sample_height=300, sample_width=300,
                                  sample_frames=81, use_rotary_positional_embeddings=True),
}


# ----------------------------------------------------------------------------------- positions (host)
def sincos_1d(dim: int, pos: np.ndarray) -> np.ndarray:
    """``[sin, cos]`` of ``pos`` at ``dim // 2`` frequencies (float64), diffusers' 1D sin-cos table."""
    omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    out = np.outer(np.asarray(pos, np.float64).reshape(-1), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_table(cfg: CogVideoXConfig, grid: tuple[int, int, int]) -> np.ndarray:
    """The 2B's 3D sin-cos positional embedding of the video tokens ``[f*h*w, D]`` (float32): a
    quarter of the width for time, three quarters for space (half on the column, half on the row
    coordinate), positions divided by the interpolation scales."""
    f, h, w = grid
    d = cfg.dim
    ds, dt = 3 * d // 4, d // 4
    gh = np.arange(h, dtype=np.float32) / np.float32(cfg.spatial_interpolation_scale)
    gw = np.arange(w, dtype=np.float32) / np.float32(cfg.spatial_interpolation_scale)
    cols, rows = np.meshgrid(gw, gh, indexing="xy")  # [h, w] each
    spatial = np.concatenate([sincos_1d(ds // 2, cols), sincos_1d(ds // 2, rows)], axis=1)  # [h*w, ds]
    gt = np.arange(f, dtype=np.float32) / np.float32(cfg.temporal_interpolation_scale)
    temporal = sincos_1d(dt, gt)  # [f, dt]
    table = np.concatenate([np.broadcast_to(temporal[:, None, :], (f, h * w, dt)),
                            np.broadcast_to(spatial[None], (f, h * w, ds))], axis=-1)
    return table.reshape(f * h * w, d).astype(np.float32)


def _torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace`` in float32 (its two-sided formula), on the host."""
    s, e = np.float32(start), np.float32(end)
    if steps == 1:
        return np.array([s], np.float32)
    step = (e - s) / np.float32(steps - 1)
    i = np.arange(steps)
    half = steps // 2
    lo = s + step * i.astype(np.float32)
    hi = e - step * (steps - 1 - i).astype(np.float32)
    return np.where(i < half, lo, hi).astype(np.float32)


def _rope_1d(dim: int, pos: np.ndarray, theta: float = 10000.0):
    freqs = (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    ang = np.outer(pos.astype(np.float32), freqs.astype(np.float32)).astype(np.float32)
    return np.repeat(np.cos(ang), 2, axis=1), np.repeat(np.sin(ang), 2, axis=1)


def resize_crop_region(src: tuple[int, int], tgt_width: int, tgt_height: int):
    """diffusers' ``get_resize_crop_region_for_grid``."""
    th, tw = tgt_height, tgt_width
    h, w = src
    if h / w > th / tw:
        rh, rw = th, int(round(th / h * w))
    else:
        rw, rh = tw, int(round(tw / w * h))
    top, left = int(round((th - rh) / 2.0)), int(round((tw - rw) / 2.0))
    return (top, left), (top + rh, left + rw)


def rope_3d(head_dim: int, grid: tuple[int, int, int], *, grid_type: str = "linspace", crops_coords=None,
            max_size=None, theta: float = 10000.0):
    """diffusers' ``get_3d_rotary_pos_embed(use_real=True)``: ``(cos, sin)`` each
    ``[f*h*w, head_dim]`` float32 (head dim split t : h : w = 1/4 : 3/8 : 3/8, pairs interleaved)."""
    f, gh_n, gw_n = grid
    if grid_type == "linspace":
        (start, stop) = crops_coords
        gh = _torch_linspace(start[0], stop[0] * (gh_n - 1) / gh_n, gh_n)
        gw = _torch_linspace(start[1], stop[1] * (gw_n - 1) / gw_n, gw_n)
        gt = _torch_linspace(0, f * (f - 1) / f, f)
    elif grid_type == "slice":
        max_h, max_w = max_size
        if gh_n > max_h or gw_n > max_w:
            raise ValueError(f"token grid {gh_n}x{gw_n} exceeds the rotary table's max_size {max_h}x{max_w}")
        gh, gw, gt = (np.arange(n, dtype=np.float32) for n in (max_h, max_w, f))
    else:
        raise ValueError(f"grid_type must be 'linspace' or 'slice', got {grid_type!r}")
    dim_t, dim_h, dim_w = head_dim // 4, head_dim // 8 * 3, head_dim // 8 * 3
    tc, ts = _rope_1d(dim_t, gt, theta)
    hc, hs = _rope_1d(dim_h, gh, theta)
    wc, ws = _rope_1d(dim_w, gw, theta)
    hc, hs, wc, ws = hc[:gh_n], hs[:gh_n], wc[:gw_n], ws[:gw_n]

    def combine(a, b, c):
        return np.concatenate([np.broadcast_to(a[:, None, None], (f, gh_n, gw_n, a.shape[-1])),
                               np.broadcast_to(b[None, :, None], (f, gh_n, gw_n, b.shape[-1])),
                               np.broadcast_to(c[None, None, :], (f, gh_n, gw_n, c.shape[-1]))],
                              axis=-1).reshape(f * gh_n * gw_n, -1).astype(np.float32)

    return combine(tc, hc, wc), combine(ts, hs, ws)


def rope_tables(cfg: CogVideoXConfig, grid: tuple[int, int, int]):
    """The rotary tables the CogVideoX pipelines build for a token grid ``(f, h, w)`` (``f`` counts
    temporal patches): 1.0 crops a 'linspace' grid to the config's sample size, 1.5 slices a grid of
    ``max_size`` = the sample size in tokens. None when the model has no rotary embedding."""
    if not cfg.use_rotary_positional_embeddings:
        return None
    f, h, w = grid
    base_w, base_h = cfg.sample_width // cfg.patch_size, cfg.sample_height // cfg.patch_size
    if cfg.patch_size_t is None:
        return rope_3d(cfg.head_dim, grid, crops_coords=resize_crop_region((h, w), base_w, base_h))
    return rope_3d(cfg.head_dim, grid, grid_type="slice", max_size=(base_h, base_w))


def pos_mode(cfg: CogVideoXConfig, grid: tuple[int, int, int]) -> str:
    """``"none"`` (rotary only), ``"learned"`` (the checkpoint's table at its native size) or
    ``"sincos"`` (computed for this grid), as the reference's patch embedding decides."""
    if cfg.use_learned_positional_embeddings:
        _, h, w = grid
        _, sh, sw = cfg.sample_grid
        if (h, w) != (sh, sw):
            raise ValueError(f"this CogVideoX model has learned positional embeddings for {sh}x{sw} tokens "
                             f"({cfg.sample_height * 8}x{cfg.sample_width * 8} pixels) and cannot run at {h}x{w}")
        return "learned" if tuple(grid) == cfg.sample_grid else "sincos"
    return "sincos" if cfg.uses_sincos else "none"


# ----------------------------------------------------------------------------------- modules
_heads = split_heads


def apply_rope(x, cos, sin):
    """The reference's ``apply_rotary_emb`` (pairs interleaved): ``x`` [B, L, H, D], ``cos``/``sin``
    [L, D] (each angle repeated twice)."""
    dt = x.dtype
    xf = x.astype(F32)
    pairs = xf.reshape(*x.shape[:-1], -1, 2)
    rot = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(x.shape)
    return (xf * cos[None, :, None, :] + rot * sin[None, :, None, :]).astype(dt)


class PatchEmbed(nnx.Module):
    """1.0: the reference's per-frame Conv2d (stride = kernel = p) as one matmul over patch tokens,
    kernel ``[p, p, C, D]`` (token features ``(ph, pw, c)``); 1.5: its Linear over ``(c, pt, ph,
    pw)`` features, kernel ``[C*pt*p*p, D]``."""

    def __init__(self, cfg: CogVideoXConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        p, c, d = cfg.patch_size, cfg.in_channels, cfg.dim
        init = nnx.initializers.lecun_normal()
        if cfg.patch_size_t is None:
            self.kernel = nn.param(rngs, init, (p, p, c, d), None, None, None, "embed", dtype=param_dtype)
        else:
            self.kernel = nn.param(rngs, init, (c * cfg.patch_size_t * p * p, d), None, "embed", dtype=param_dtype)
        self.bias = nn.param(rngs, nnx.initializers.zeros_init(), (d,), "embed", dtype=param_dtype) \
            if cfg.patch_has_bias else None

    def __call__(self, tokens):
        k = self.kernel[...]
        y = jnp.matmul(tokens, k.reshape(-1, k.shape[-1]).astype(tokens.dtype), precision=jax.lax.Precision.HIGHEST)
        return y if self.bias is None else y + self.bias[...].astype(y.dtype)


class TimeMLP(nnx.Module):
    """diffusers' ``TimestepEmbedding``: ``l2(act(l1(x)))``."""

    def __init__(self, din: int, dout: int, act: str, *, rngs: nnx.Rngs, param_dtype=F32):
        self.l1 = nn.Linear(din, dout, rngs=rngs, param_dtype=param_dtype)
        self.l2 = nn.Linear(dout, dout, rngs=rngs, param_dtype=param_dtype)
        self.act = act

    def __call__(self, x):
        return self.l2(nn.activation(self.act)(self.l1(x)))


class CogEmbed(nnx.Module):
    """Patch + text projections, positional embeddings, timestep (+ ofs) embedding."""

    def __init__(self, cfg: CogVideoXConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        d = cfg.dim
        self.cfg = cfg
        self.patch = PatchEmbed(cfg, **kw)
        self.text = nn.Linear(cfg.text_embed_dim, d, axes=(None, "embed"), **kw)
        self.time = TimeMLP(d, cfg.time_embed_dim, cfg.timestep_activation_fn, **kw)
        self.ofs = TimeMLP(cfg.ofs_embed_dim, cfg.ofs_embed_dim, cfg.timestep_activation_fn, **kw) \
            if cfg.ofs_embed_dim else None
        if cfg.use_learned_positional_embeddings:
            f, h, w = cfg.sample_grid
            self.pos = nn.param(rngs, nnx.initializers.normal(0.02), (1, cfg.max_text_seq_length + f * h * w, d),
                                None, None, "embed", dtype=param_dtype)
        else:
            self.pos = None

    def temb(self, t, ofs=None):
        """Timestep (+ ofs) embedding [B, time_embed_dim], float32."""
        cfg = self.cfg
        e = sinusoidal_embedding(jnp.asarray(t, F32), cfg.dim, flip_sin_to_cos=cfg.flip_sin_to_cos,
                                 downscale_freq_shift=cfg.freq_shift)
        dt = self.text.kernel[...].dtype
        emb = self.time(e.astype(dt)).astype(F32)
        if self.ofs is not None:
            if ofs is None:
                raise ValueError("this CogVideoX model has an ofs embedding (1.5 I2V): pass ofs (the pipelines use 2.0)")
            o = sinusoidal_embedding(jnp.reshape(jnp.asarray(ofs, F32), (-1,)), cfg.ofs_embed_dim,
                                     flip_sin_to_cos=cfg.flip_sin_to_cos, downscale_freq_shift=cfg.freq_shift)
            emb = emb + self.ofs(o.astype(dt)).astype(F32)
        return emb

    def __call__(self, a: dict, par: vsh.ParallelContext = vsh.LOCAL):
        """``a``: patch ``tokens`` [B, Lv, feat] (this shard's), ``ctx`` [B, Lt, text_dim], ``t``,
        ``ofs``, the video tables (``cos`` / ``sin``, the sin-cos ``pos``). Returns ``({"vid",
        "txt"}, {"temb", "cos", "sin"})``; without a ``pos`` table a learned table (at the
        checkpoint's native grid) is added, its video rows sliced to this token shard."""
        vid = self.patch(a["tokens"])
        txt = self.text(a["ctx"])
        pos_txt, pos_vid = None, a.get("pos")
        if pos_vid is None and self.pos is not None:
            lt = self.cfg.max_text_seq_length
            p = self.pos[...][0]
            pos_txt, pos_vid = p[:lt], par.token_slice(p[lt:], vid.shape[1])
        if pos_vid is not None:
            vid = vid + pos_vid[None].astype(vid.dtype)
        if pos_txt is not None:
            txt = txt + pos_txt[None].astype(txt.dtype)
        return {"vid": vid, "txt": txt}, {"temb": self.temb(a["t"], a.get("ofs")),
                                          **{k: a[k] for k in ("cos", "sin") if k in a}}


def joint_attention(par: vsh.ParallelContext, txt, vid):
    """Full attention over ``[text; video]`` tokens. ``txt``, ``vid``: ``(q, k, v)`` each
    ``[B, L, H_local, d]``; returns ``(text out, video out)`` in the same layout.

    Inside ``shard_map`` with ``sp > 1`` the video tokens are split over ``sp`` and the text tokens
    replicated: the core's USP attention (``ParallelContext.joint_attention``) takes the video
    q/k/v through Ulysses (every video token of a group, a slice of the heads) and/or the ring,
    the text q/k/v are cut to the same heads (they are whole on every device), padded video tokens
    are masked, and the text output comes back whole (typed replicated over sp, as the text carry
    is)."""
    (qt, kt, vt), (qv, kv, vv) = txt, vid
    ov, ot = par.joint_attention(qv, kv, vv, qt, kt, vt, extra_first=True)
    return ot, ov


class CogBlock(nnx.Module):
    """One block: LayerNorm-Zero (text and video modulated separately), joint self-attention with
    per-head q/k LayerNorm (RoPE on the video part), LayerNorm-Zero, one feed-forward for both."""

    def __init__(self, cfg: CogVideoXConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d, hd = cfg.dim, cfg.head_dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        aff = cfg.norm_elementwise_affine
        self.head_dim = hd
        self.mod1 = nn.Linear(cfg.time_embed_dim, 6 * d, **kw)
        self.norm1 = nn.LayerNorm(d, eps=cfg.norm_eps, affine=aff, axis="embed", **kw)
        self.q = nn.Linear(d, d, axes=("embed", "heads"), bias=cfg.attention_bias, **kw)
        self.k = nn.Linear(d, d, axes=("embed", "heads"), bias=cfg.attention_bias, **kw)
        self.v = nn.Linear(d, d, axes=("embed", "heads"), bias=cfg.attention_bias, **kw)
        self.norm_q = nn.LayerNorm(hd, eps=1e-6, **kw)
        self.norm_k = nn.LayerNorm(hd, eps=1e-6, **kw)
        self.o = nn.Linear(d, d, axes=("heads", "embed"), **kw)
        self.mod2 = nn.Linear(cfg.time_embed_dim, 6 * d, **kw)
        self.norm2 = nn.LayerNorm(d, eps=cfg.norm_eps, affine=aff, axis="embed", **kw)
        self.up = nn.Linear(d, cfg.ffn_dim, axes=("embed", "ffn"), **kw)
        self.down = nn.Linear(cfg.ffn_dim, d, axes=("ffn", "embed"), **kw)
        self.act = cfg.activation_fn

    def _qkv(self, h, par):
        hd, dt = self.head_dim, h.dtype
        q = self.norm_q(_heads(par.linear(self.q, h), hd)).astype(dt)
        k = self.norm_k(_heads(par.linear(self.k, h), hd)).astype(dt)
        return q, k, _heads(par.linear(self.v, h), hd)

    def attention(self, hv, ht, cos, sin, par):
        qv, kv, vv = self._qkv(hv, par)
        qt, kt, vt = self._qkv(ht, par)
        if cos is not None:
            qv, kv = apply_rope(qv, cos, sin), apply_rope(kv, cos, sin)
        ot, ov = joint_attention(par, (qt, kt, vt), (qv, kv, vv))
        return par.linear(self.o, ov.reshape(*ov.shape[:2], -1)), par.linear(self.o, ot.reshape(*ot.shape[:2], -1))

    def _ff(self, h, par):
        return par.linear(self.down, nn.activation(self.act)(par.linear(self.up, h)))

    @staticmethod
    def _modulate(norm, x, shift, scale):
        return (norm(x.astype(F32)) * (1 + scale[:, None]) + shift[:, None]).astype(x.dtype)

    def __call__(self, vid, txt, temb, cos, sin, par: vsh.ParallelContext = vsh.LOCAL):
        """``vid`` [B, Lv, D], ``txt`` [B, Lt, D] (compute dtype), ``temb`` [B, Dt] float32."""
        dt = vid.dtype
        e = jax.nn.silu(temb).astype(dt)
        m = self.mod1(e).astype(F32)
        shift, scale, gate, tshift, tscale, tgate = jnp.split(m, 6, axis=-1)
        av, at = self.attention(self._modulate(self.norm1, vid, shift, scale),
                                self._modulate(self.norm1, txt, tshift, tscale), cos, sin, par)
        vid = (vid.astype(F32) + gate[:, None] * av.astype(F32)).astype(dt)
        txt = (txt.astype(F32) + tgate[:, None] * at.astype(F32)).astype(dt)
        m = self.mod2(e).astype(F32)
        shift, scale, gate, tshift, tscale, tgate = jnp.split(m, 6, axis=-1)
        fv = self._ff(self._modulate(self.norm2, vid, shift, scale), par)
        ft = self._ff(self._modulate(self.norm2, txt, tshift, tscale), par)
        vid = (vid.astype(F32) + gate[:, None] * fv.astype(F32)).astype(dt)
        txt = (txt.astype(F32) + tgate[:, None] * ft.astype(F32)).astype(dt)
        return vid, txt


class CogHead(nnx.Module):
    """``norm_final``, the AdaLayerNorm output modulation (shift, then scale), projection."""

    def __init__(self, cfg: CogVideoXConfig, *, rngs: nnx.Rngs, param_dtype=F32):
        d = cfg.dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.norm_final = nn.LayerNorm(d, eps=cfg.norm_eps, affine=cfg.norm_elementwise_affine, axis="embed", **kw)
        self.mod = nn.Linear(cfg.time_embed_dim, 2 * d, **kw)
        self.norm_out = nn.LayerNorm(d, eps=cfg.norm_eps, affine=cfg.norm_elementwise_affine, axis="embed", **kw)
        self.proj = nn.Linear(d, cfg.out_channels * cfg.pt * cfg.patch_size**2, axes=("embed", None), **kw)

    def __call__(self, carry, c, par: vsh.ParallelContext = vsh.LOCAL):
        vid = carry["vid"]
        dt = vid.dtype
        h = self.norm_final(vid.astype(F32)).astype(dt)
        m = self.mod(jax.nn.silu(c["temb"]).astype(dt)).astype(F32)
        shift, scale = jnp.split(m, 2, axis=-1)
        h = (self.norm_out(h.astype(F32)) * (1 + scale[:, None]) + shift[:, None]).astype(dt)
        return {"y": self.proj(h)}


class CogVideoXTransformer(nn.StackedDiT):
    """The CogVideoX DiT: ``embed`` -> stacked ``blocks`` -> ``head``, with the hooks of
    :class:`vidax.core.runner.DiTRunner`. The video tokens are split over sp (joint attention,
    :func:`joint_attention`); the text tokens and the timestep embedding stay whole."""

    EMBED, BLOCK, HEAD = CogEmbed, CogBlock, CogHead

    @staticmethod
    def step(blk, carry, c, par):
        vid, txt = blk(carry["vid"], carry["txt"], c["temb"], c.get("cos"), c.get("sin"), par)
        return {"vid": vid, "txt": txt}

    @staticmethod
    def act_spec(name: str, shape: tuple) -> tuple:
        """Logical axes of an activation (see ``vidax.core.sharding.activation_axes``)."""
        return vsh.activation_axes(name, shape, tokens=("tokens", "vid", "y"), tables=("cos", "sin", "pos"),
                                   replicated=("ofs",))

    @staticmethod
    def pack(x, t, ctx, ofs=None, rope=None) -> dict:
        """The call signature: ``x`` [B, F, H, W, C], ``t`` [B], ``ctx`` [B, Lt, text_dim], ``ofs``
        (1.5 I2V), ``rope``: ``(cos, sin)`` to use instead of :func:`rope_tables`."""
        cos, sin = (None, None) if rope is None else rope
        return {"x": x, "t": jnp.asarray(t, F32), "ctx": ctx,
                "ofs": None if ofs is None else jnp.reshape(jnp.asarray(ofs, F32), (-1,)),
                "cos": None if cos is None else jnp.asarray(cos, F32), "sin": None if sin is None else jnp.asarray(sin, F32)}

    def prepare(self, a: dict, dtype) -> dict:
        return {"tokens": patchify(self.cfg, a["x"].astype(dtype))[0], "t": a["t"], "ctx": a["ctx"].astype(dtype),
                **{k: a[k] for k in ("ofs", "cos", "sin", "pos") if k in a}}

    def finish(self, out: dict, shapes: dict):
        return unpatchify(self.cfg, out["y"], token_grid(self.cfg, shapes["x"]))

    def check(self, shapes: dict, mesh) -> None:
        g = token_grid(self.cfg, shapes["x"])
        if "ctx" in shapes:
            check_text(self.cfg, shapes["ctx"][1], g)
        vmesh.check_divisible(parallel_constraints(self.cfg, tokens=math.prod(g), batch=shapes["x"][0]), mesh)

    def table_key(self, shapes: dict):
        return token_grid(self.cfg, shapes["x"]), "cos" in shapes

    def tables(self, key) -> dict:
        """The video positional tables of a grid: rotary ``cos`` / ``sin`` (unless given) and the
        sin-cos ``pos`` (the learned table is the embedding's own parameter)."""
        grid, given = key
        out = {}
        if self.cfg.use_rotary_positional_embeddings and not given:
            out["cos"], out["sin"] = (np.asarray(a, np.float32) for a in rope_tables(self.cfg, grid))
        if pos_mode(self.cfg, grid) == "sincos":
            out["pos"] = sincos_table(self.cfg, grid)
        return out

    def __call__(self, x, t, ctx, ofs=None, cos=None, sin=None, pos=None, *, par: vsh.ParallelContext = vsh.LOCAL):
        """Velocity (v-prediction). ``x``: [B, F, H, W, C] latents; ``t``: [B]; ``ctx``: [B, Lt,
        text_dim]; ``ofs``: [B] / [1] (1.5 I2V); ``cos``/``sin``: [Lv, head_dim] rotary tables;
        ``pos``: the sin-cos table [Lv, D] (optional: computed when needed). Returns [B, F, H, W, Cout]."""
        inputs = self.pack(x, t, ctx, ofs, None if cos is None else (cos, sin))
        inputs = {k: v for k, v in inputs.items() if v is not None}
        grid = token_grid(self.cfg, jnp.shape(x))
        check_text(self.cfg, jnp.shape(ctx)[1], grid)
        tables = {}
        if pos_mode(self.cfg, grid) == "sincos":
            tables["pos"] = jnp.asarray(sincos_table(self.cfg, grid)) if pos is None else pos
        return run_local(self, inputs, tables, self.embed.text.kernel[...].dtype, par)


def check_text(cfg: CogVideoXConfig, lt: int, grid) -> None:
    if pos_mode(cfg, grid) != "none" and lt != cfg.max_text_seq_length:
        raise ValueError(f"this CogVideoX model adds a positional embedding over the joint sequence: the text must "
                         f"have max_text_seq_length={cfg.max_text_seq_length} tokens, got {lt}")


# ----------------------------------------------------------------------------------- patchify
def token_grid(cfg: CogVideoXConfig, x_shape) -> tuple:
    return geometry.token_grid(x_shape[1:4], (cfg.pt, cfg.patch_size, cfg.patch_size))


def patchify(cfg: CogVideoXConfig, x):
    """[B, F, H, W, C] -> tokens [B, f*h*w, feat] (1.0: features (ph, pw, c); 1.5: (c, pt, ph, pw))
    and the token grid (f, h, w)."""
    return geometry.patchify(x, (cfg.pt, cfg.patch_size, cfg.patch_size), "thwc" if cfg.patch_size_t is None else "cthw")


def unpatchify(cfg: CogVideoXConfig, y, grid):
    """[B, f*h*w, Cout*pt*p*p] (features (c, pt, ph, pw)) -> [B, F, H, W, Cout]."""
    return geometry.unpatchify(y, grid, (cfg.pt, cfg.patch_size, cfg.patch_size), "cthw")


# ----------------------------------------------------------------------------------- state
KIT = nn.ModelKit(CogVideoXTransformer, units=("embed", "blocks", "head"), dtype_leaf=("embed", "text", "kernel"))
#: seeded random modules for presets and tests, the abstract state a checkpoint fills, its shapes
#: (the key maps' target), the graphdefs the runner merges unit by unit, the state's dtype, and
#: the module back from a state inside a traced function (the unit of ``jit``): see ``nn.ModelKit``
_build, init_model, init_state, abstract_state = KIT.build, KIT.init_model, KIT.init_state, KIT.abstract_state
param_shapes, graphdefs, state_dtype, merge = KIT.param_shapes, KIT.graphdefs, KIT.state_dtype, KIT.merge


def forward(state, cfg: CogVideoXConfig, x, t, ctx, ofs=None, rope=None, pos=None, *, attn_impl=None):
    """Velocity from a state (pure: ``jax.jit(forward, static_argnums=1)``). ``x`` [B, F, H, W, C];
    ``t`` [B]; ``ctx`` [B, Lt, text_dim]; ``ofs``: 1.5 I2V; ``rope``: ``(cos, sin)`` from
    :func:`rope_tables` (models with rotary embeddings); ``pos``: sin-cos table (optional)."""
    cos, sin = (None, None) if rope is None else rope
    return merge(state, cfg)(x, t, ctx, ofs, cos, sin, pos, par=vsh.ParallelContext(attn_impl=attn_impl))


# ----------------------------------------------------------------------------------- sharding
def video_tokens(cfg: CogVideoXConfig, latent_frames: int, h: int, w: int) -> int:
    return (latent_frames // cfg.pt) * (h // cfg.patch_size) * (w // cfg.patch_size)


def parallel_constraints(cfg: CogVideoXConfig, *, tokens: int | None = None, batch: int | None = None):
    """Divisibility rules on a (dp, tp, sp) mesh. The text length has none: its tokens stay whole
    on every device (sliced by heads inside the joint attention)."""
    r = [vmesh.UlyssesHeads("num_heads", cfg.num_heads),
         vmesh.Divisible("ffn_dim", cfg.ffn_dim, ("tp",), "FFN up/down are split over tp")]
    return r + vmesh.input_rules(tokens, batch, what="video tokens")


def runner(state, cfg: CogVideoXConfig, mesh=None, parallelism=None, **kw) -> DiTRunner:
    """The CogVideoX DiT on a ``(dp, tp, sp)`` mesh through ``vidax.core.runner.DiTRunner``, blocks
    resident or offloaded: ``runner(x, t, ctx, ofs, rope)`` (:func:`forward`'s contract)."""
    return KIT.runner(state, cfg, mesh, parallelism, constraints=parallel_constraints(cfg), **kw)


# ----------------------------------------------------------------------------------- key maps
def _linear(ref: str, dst: str, bias: bool = True) -> list[tuple[str, str, str]]:
    return [(f"{ref}.weight", f"{dst}.kernel", "linear")] + ([(f"{ref}.bias", f"{dst}.bias", "none")] if bias else [])


def _norm(ref: str, dst: str, affine: bool = True) -> list[tuple[str, str, str]]:
    return [(f"{ref}.weight", f"{dst}.scale", "none"), (f"{ref}.bias", f"{dst}.bias", "none")] if affine else []


def diffusers_keymap(cfg: CogVideoXConfig) -> KeyMap:
    aff = cfg.norm_elementwise_affine
    top = [("patch_embed.proj.weight", "embed.patch.kernel", "conv2d" if cfg.patch_size_t is None else "linear"),
           *([("patch_embed.proj.bias", "embed.patch.bias", "none")] if cfg.patch_has_bias else []),
           *_linear("patch_embed.text_proj", "embed.text"),
           *_linear("time_embedding.linear_1", "embed.time.l1"), *_linear("time_embedding.linear_2", "embed.time.l2"),
           *_norm("norm_final", "head.norm_final", aff), *_linear("norm_out.linear", "head.mod"),
           *_norm("norm_out.norm", "head.norm_out", aff), *_linear("proj_out", "head.proj")]
    if cfg.ofs_embed_dim:
        top += _linear("ofs_embedding.linear_1", "embed.ofs.l1") + _linear("ofs_embedding.linear_2", "embed.ofs.l2")
    if cfg.use_learned_positional_embeddings:
        top.append(("patch_embed.pos_embedding", "embed.pos", "none"))
    b = cfg.attention_bias
    block = [*_linear("norm1.linear", "mod1"), *_norm("norm1.norm", "norm1", aff),
             *_linear("attn1.to_q", "q", b), *_linear("attn1.to_k", "k", b), *_linear("attn1.to_v", "v", b),
             *_norm("attn1.norm_q", "norm_q"), *_norm("attn1.norm_k", "norm_k"), *_linear("attn1.to_out.0", "o"),
             *_linear("norm2.linear", "mod2"), *_norm("norm2.norm", "norm2", aff),
             *_linear("ff.net.0.proj", "up"), *_linear("ff.net.2", "down")]
    rules = [Rule(s, d, k) for s, d, k in top]
    rules += [Rule(f"transformer_blocks.{{i}}.{s}", f"blocks.{d}", k) for s, d, k in block]
    return KeyMap(rules)


def load_dit(path, cfg: CogVideoXConfig | None = None, dtype=np.float32):
    """DiT weights from a diffusers folder (config.json + safetensors) or an original (SAT) release
    checkpoint. Returns ``(state, cfg)``: the abstract state filled tensor by tensor with host
    numpy, cast on the host; no random init is ever materialised."""
    from vidax.models.cogvideox import convert  # (it imports this module's config)

    return KIT.load(path, cfg, dtype, from_config=CogVideoXConfig.from_diffusers, is_original=convert.is_original,
                    config_from_original=convert.config_from_original, keymap=lambda c, original: diffusers_keymap(c),
                    view=lambda ckpt, c, original: convert.sat_view(ckpt, c) if original else ckpt,
                    what="CogVideoXTransformer3DModel")


# ----------------------------------------------------------------------------------- compat
def _rope_arg(image_rotary_emb):
    if image_rotary_emb is None:
        return None
    cos, sin = image_rotary_emb
    return jnp.asarray(np.asarray(cos, np.float32)), jnp.asarray(np.asarray(sin, np.float32))


class _CogCompat(compat.CompatModel):
    """``forward(hidden_states [B, F, C, H, W], encoder_hidden_states, timestep, ofs=None,
    image_rotary_emb=None)`` -> ``[B, F, Cout, H, W]``, the reference's calling convention."""

    def __init__(self, config, state, cfg, runner: DiTRunner | None = None):
        super().__init__("CogVideoXTransformer3DModel", config, state, cfg)
        self.runner = runner
        if runner is None:
            self._fwd = jax.jit(partial(forward, cfg=cfg))

    def forward(self, hidden_states, encoder_hidden_states, timestep, timestep_cond=None, ofs=None,
                image_rotary_emb=None, **_):
        if timestep_cond is not None:
            raise ValueError("CogVideoXTransformer3DModel: timestep_cond is not used by any CogVideoX checkpoint")
        x = jnp.asarray(np.asarray(hidden_states, np.float32)).transpose(0, 1, 3, 4, 2)
        t = jnp.asarray(np.asarray(timestep), F32)
        if t.ndim == 0:
            t = jnp.broadcast_to(t, (x.shape[0],))
        ctx = jnp.asarray(encoder_hidden_states, F32)
        o = None if ofs is None else jnp.reshape(jnp.asarray(np.asarray(ofs), F32), (-1,))
        rope = _rope_arg(image_rotary_emb)
        if self.runner is not None:
            y = self.runner(x, t, ctx, o, rope)
        else:
            y = self._fwd(self.params, x=x, t=t, ctx=ctx, ofs=o, rope=rope)
        return np.asarray(y).transpose(0, 1, 4, 2, 3)


compat.register_dit("CogVideoXTransformer3DModel", CogVideoXConfig.from_diffusers, _CogCompat, load_dit, runner,
                    constraints=parallel_constraints)


__all__ = ["CogVideoXConfig", "CogVideoXTransformer", "PRESETS", "abstract_state",
           "diffusers_keymap", "forward", "init_model", "init_state", "joint_attention", "load_dit", "patchify",
           "pos_mode", "rope_3d", "rope_tables", "runner", "sincos_table", "unpatchify"]
