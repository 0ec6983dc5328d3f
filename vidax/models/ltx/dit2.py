"""LTX-2.x audio+video diffusion transformer (diffusers ``LTX2VideoTransformer3DModel``) as Flax NNX.

Two token streams run through every block: video ([B, S, D]) and audio ([B, La, Da]). A block is
self-attention per stream, cross-attention of each stream to its text context, then the
cross-modal pair -- audio-to-video (queries video, keys/values audio) and video-to-audio -- each
modulated by a global timestep-dependent scale/shift plus a per-block table, then a feed-forward
per stream. Rotary embeddings come from coordinates (video: (time in seconds, y, x) patch bounds
in pixels; audio: time bounds in seconds), taken precomputed as the reference takes them
(``video_coords`` / ``audio_coords``); cross-modal attention uses the time coordinate alone.

Configuration switches of the released checkpoints: ``rope_type`` ("interleaved" | "split"),
gated attention (a per-head ``2 * sigmoid`` gate), cross-attention AdaLN (``cross_attn_mod``:
queries modulated, context scale/shift from ``sigma`` through ``prompt_adaln`` or, with
``use_prompt_adaln_single=False``, a static table), ``use_prompt_embeddings`` (LTX-2.0's caption
projections; LTX-2.3+ project in the connectors), feed-forward biases, the keyframe position
embedding, and perturbed attention (spatio-temporal guidance skips self-attention in chosen
blocks). ``timestep`` is [B] or per video token [B, S] (image-to-video); ``sigma`` drives the
prompt modulation and, with ``use_cross_timestep``, the other modality's cross-attention
modulation. ``forward`` returns ``(video, audio)``.

Sequence parallelism splits the video tokens (Ulysses self-attention); the short audio stream is
replicated across ``sp`` and video-to-audio attention gathers the video keys/values.
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
from vidax.core.config import HEAD_NAMES, diffusers_kwargs
from vidax.core import mesh as vmesh
from vidax.core import nn
from vidax.core import sharding as vsh
from vidax.core.attention import attention
from vidax.models.ltx import layers as L
from vidax.core.runner import DiTRunner, context_local, run_local
from vidax.weights import KeyMap, Rule

F32 = jnp.float32


@dataclass(frozen=True)
class LTX2DiTConfig(L.LTXDiTFields, num_layers=48, cross_attention_dim=4096, caption_channels=3840):
    vae_scale_factors: tuple = (8, 32, 32)
    pos_embed_max_pos: int = 20
    gated_attn: bool = False
    cross_attn_mod: bool = False
    audio_in_channels: int = 128
    audio_out_channels: int = 128
    audio_patch_size: int = 1
    audio_patch_size_t: int = 1
    audio_num_heads: int = 32
    audio_head_dim: int = 64
    audio_cross_attention_dim: int = 2048
    audio_scale_factor: int = 4
    audio_pos_embed_max_pos: int = 20
    audio_sampling_rate: int = 16000
    audio_hop_length: int = 160
    audio_gated_attn: bool = False
    audio_cross_attn_mod: bool = False
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_offset: int = 1
    timestep_scale_multiplier: float = 1000
    cross_attn_timestep_scale_multiplier: float = 1000
    rope_type: str = "interleaved"
    use_prompt_embeddings: bool = True
    perturbed_attn: bool = False
    ff_bias: bool = True
    audio_ff_bias: bool = True
    use_prompt_adaln_single: bool = True
    use_keyframes_abs_pos_embedding: bool = False

    @property
    def audio_dim(self) -> int:
        return self.audio_num_heads * self.audio_head_dim

    @property
    def prompt_modulation(self) -> bool:
        return self.cross_attn_mod or self.audio_cross_attn_mod

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "LTX2DiTConfig":
        kw = diffusers_kwargs(cls, cfg, {**HEAD_NAMES, "audio_num_attention_heads": "audio_num_heads",
                                         "audio_attention_head_dim": "audio_head_dim"},
                              (("out_channels", "in_channels"), ("audio_out_channels", "audio_in_channels")))
        for key, want in (("qk_norm", "rms_norm_across_heads"), ("activation_fn", "gelu-approximate"),
                          ("norm_elementwise_affine", False)):
            if key in cfg and cfg[key] != want:
                raise ValueError(f"LTX2VideoTransformer3DModel config: {key}={cfg[key]!r} is not supported (expected {want!r})")
        out = cls(**kw)
        if out.rope_type not in ("interleaved", "split"):
            raise ValueError(f"LTX2VideoTransformer3DModel config: rope_type={out.rope_type!r}")
        return out


# ----------------------------------------------------------------------------------- modules
def _ctx_dims(cfg):
    """Text context widths the cross-attention keys/values read (the config's, whatever projects them)."""
    return cfg.cross_attention_dim, cfg.audio_cross_attention_dim


class LTX2Embed(nnx.Module):
    def __init__(self, cfg: LTX2DiTConfig, *, rngs, param_dtype=F32):
        d, da = cfg.dim, cfg.audio_dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        self.proj_in = nn.Linear(cfg.in_channels, d, axes=(None, "embed"), **kw)
        self.audio_proj_in = nn.Linear(cfg.audio_in_channels, da, axes=(None, "embed"), **kw)
        self.keyframes = (nn.param(rngs, nnx.initializers.zeros_init(), (1, d), None, "embed", dtype=param_dtype)
                          if cfg.use_keyframes_abs_pos_embedding else None)
        self.caption = L.TextProjection(cfg.caption_channels, d, **kw) if cfg.use_prompt_embeddings else None
        self.audio_caption = L.TextProjection(cfg.caption_channels, da, **kw) if cfg.use_prompt_embeddings else None
        self.time = L.AdaLNSingle(d, 9 if cfg.cross_attn_mod else 6, **kw)
        self.audio_time = L.AdaLNSingle(da, 9 if cfg.audio_cross_attn_mod else 6, **kw)
        self.ca_video = L.AdaLNSingle(d, 4, **kw)
        self.ca_audio = L.AdaLNSingle(da, 4, **kw)
        self.ca_video_gate = L.AdaLNSingle(d, 1, **kw)
        self.ca_audio_gate = L.AdaLNSingle(da, 1, **kw)
        pa = cfg.prompt_modulation and cfg.use_prompt_adaln_single
        self.prompt = L.AdaLNSingle(d, 2, **kw) if pa else None
        self.audio_prompt = L.AdaLNSingle(da, 2, **kw) if pa else None

    def __call__(self, a, par=vsh.LOCAL):
        cfg = self.cfg
        dt = self.proj_in.kernel[...].dtype
        h = self.proj_in(a["vtok"].astype(dt))
        au = self.audio_proj_in(a["atok"].astype(dt))
        if self.keyframes is not None and "keyframes" in a:
            h = h + (a["keyframes"] > 0).astype(dt) * self.keyframes[...].astype(dt)

        def per(t):
            return t[:, None] if t.ndim == 1 else t

        tv, ta = per(a["t"]), per(a["ta"])
        temb, ev = self.time(tv, dt)
        atemb, ea = self.audio_time(ta, dt)
        sig, sig_a = a["sigma"], a["sigma_a"]
        gate_scale = cfg.cross_attn_timestep_scale_multiplier / cfg.timestep_scale_multiplier
        vct = per(a["ca_t"])   # video cross-modal timestep (the audio sigma with use_cross_timestep)
        act = per(a["ca_ta"])
        cav, _ = self.ca_video(vct, dt)
        cgv, _ = self.ca_video_gate(vct * gate_scale, dt)
        caa, _ = self.ca_audio(act, dt)
        cga, _ = self.ca_audio_gate(act * gate_scale, dt)
        c = {"tv": temb.astype(F32), "ev": ev.astype(F32), "taa": atemb.astype(F32), "ea": ea.astype(F32),
             "cav": cav.astype(F32), "cgv": cgv.astype(F32), "caa": caa.astype(F32), "cga": cga.astype(F32)}
        if self.prompt is not None:
            c["pv"] = self.prompt(sig[:, None], dt)[0].astype(F32)
            c["pa"] = self.audio_prompt(sig_a[:, None], dt)[0].astype(F32)
        if "ctx" in a:  # (absent when the blocks' text keys / values were computed once)
            c.update(self.kv_context(a, par))
        c.update(bias=a["bias"], abias=a["abias"], perturb=a["perturb"], xmod=a["xmod"], stg=a["stg"])
        for k in ("vcos", "vsin", "acos", "asin", "cvcos", "cvsin", "cacos", "casin"):
            c[k] = a[k]
        return {"h": h, "a": au, "layer": jnp.zeros((), jnp.int32)}, c

    def kv_context(self, a, par=vsh.LOCAL) -> dict:
        """The (projected) video and audio text contexts the cross-attention keys / values read."""
        dt = self.proj_in.kernel[...].dtype
        ctx, actx = a["ctx"].astype(dt), a["actx"].astype(dt)
        if self.caption is not None:
            ctx, actx = self.caption(ctx), self.audio_caption(actx)
        return {"ctx": ctx, "actx": actx}


def _mod(table, temb, n):
    """``table`` [n, D] + ``temb`` [B, T, n*D] -> n arrays [B, T, D] (float32)."""
    t = temb.reshape(*temb.shape[:2], n, -1) + table.astype(F32)
    return [t[:, :, j] for j in range(n)]


def _gather_tokens(x, par):
    """Video keys/values complete over ``sp`` (the audio queries see every video token), with the
    key mask of the real tokens when the runner padded them (else None). Gathered with a psum, so
    the result is typed invariant over sp: every device computes the same, replicated audio stream."""
    return par.gather_tokens(x)


def _lerp(start, end, w):
    """``torch.lerp``: exact at w = 0 and w = 1."""
    return jnp.where(w < 0.5, start + w * (end - start), end - (end - start) * (1 - w))


class LTX2Block(nnx.Module):
    def __init__(self, cfg: LTX2DiTConfig, *, rngs, param_dtype=F32):
        d, da = cfg.dim, cfg.audio_dim
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        cd, cad = _ctx_dims(cfg)
        ab = dict(bias=cfg.attention_bias, out_bias=cfg.attention_out_bias, eps=1e-6, **kw)
        self.cfg = cfg
        self.attn1 = L.Attention(d, cfg.num_heads, cfg.head_dim, gated=cfg.gated_attn, **ab)
        self.audio_attn1 = L.Attention(da, cfg.audio_num_heads, cfg.audio_head_dim, gated=cfg.audio_gated_attn, **ab)
        self.attn2 = L.Attention(d, cfg.num_heads, cfg.head_dim, kvdim=cd, gated=cfg.gated_attn, **ab)
        self.audio_attn2 = L.Attention(da, cfg.audio_num_heads, cfg.audio_head_dim, kvdim=cad, gated=cfg.audio_gated_attn,
                                       **ab)
        self.a2v = L.Attention(d, cfg.audio_num_heads, cfg.audio_head_dim, kvdim=da, gated=cfg.gated_attn, **ab)
        self.v2a = L.Attention(da, cfg.audio_num_heads, cfg.audio_head_dim, kvdim=d, gated=cfg.audio_gated_attn, **ab)
        self.ff = L.FeedForward(d, bias=cfg.ff_bias, **kw)
        self.audio_ff = L.FeedForward(da, bias=cfg.audio_ff_bias, **kw)
        nv, na = (9 if cfg.cross_attn_mod else 6), (9 if cfg.audio_cross_attn_mod else 6)
        self.sst = nn.param(rngs, nnx.initializers.normal(d ** -0.5), (nv, d), None, "embed", dtype=param_dtype)
        self.audio_sst = nn.param(rngs, nnx.initializers.normal(da ** -0.5), (na, da), None, None, dtype=param_dtype)
        pm = cfg.prompt_modulation
        self.prompt_sst = nn.param(rngs, nnx.initializers.normal(1.0), (2, d), None, None, dtype=param_dtype) if pm else None
        self.audio_prompt_sst = (nn.param(rngs, nnx.initializers.normal(1.0), (2, da), None, None, dtype=param_dtype)
                                 if pm else None)
        self.a2v_sst = nn.param(rngs, nnx.initializers.normal(1.0), (5, d), None, "embed", dtype=param_dtype)
        self.audio_a2v_sst = nn.param(rngs, nnx.initializers.normal(1.0), (5, da), None, None, dtype=param_dtype)

    def _self(self, attn, x, rope, pm, par, sharded: bool):
        """Self-attention with optional perturbation: ``lerp(v, attention, pm)`` (pm [B] in {0, 1})."""
        q, k, v = attn.project(x, x, rope, None, par)
        o = par.self_attention(q, k, v) if sharded else attention(q, k, v, impl=par.attn_impl)
        if pm is not None:
            w = pm.astype(F32)[:, None, None, None]
            o = _lerp(v.astype(F32), o.astype(F32), w).astype(o.dtype)
        return attn.finish(x, o, par)

    def _cross(self, attn, x, ctx, bias, q_rope, k_rope, par, kv=None):
        if kv is None:
            q, k, v = attn.project(x, ctx, q_rope, k_rope, par)
        else:
            q, k, v = attn.query(x, q_rope, par), kv[0], kv[1]
        return attn.finish(x, attention(q, k, v, bias=bias, impl=par.attn_impl), par)

    def _text_contexts(self, c, dt):
        """The video and audio text contexts as the keys / values read them (prompt-modulated)."""
        cfg = self.cfg
        ctx, actx = c["ctx"], c["actx"]
        if cfg.prompt_modulation:
            if "pv" in c:
                sh, sc = _mod(self.prompt_sst[...], c["pv"], 2)
                ash, asc = _mod(self.audio_prompt_sst[...], c["pa"], 2)
            else:
                sh, sc = (self.prompt_sst[...].astype(F32)[j][None, None] for j in range(2))
                ash, asc = (self.audio_prompt_sst[...].astype(F32)[j][None, None] for j in range(2))
            ctx = (ctx.astype(F32) * (1 + sc) + sh).astype(dt)
            actx = (actx.astype(F32) * (1 + asc) + ash).astype(dt)
        return ctx, actx

    def text_kv(self, c, par) -> dict:
        """The text cross-attention keys / values of both streams (``k`` / ``v``, ``ak`` / ``av``):
        the same every step unless the prompt modulation follows sigma (``CONTEXT`` is then empty)."""
        ctx, actx = self._text_contexts(c, c["ctx"].dtype)
        kv, akv = self.attn2.context_kv(ctx, par), self.audio_attn2.context_kv(actx, par)
        return {"k": kv["k"], "v": kv["v"], "ak": akv["k"], "av": akv["v"]}

    def __call__(self, h, au, c, layer, par=vsh.LOCAL):
        cfg = self.cfg
        dt, eps = h.dtype, cfg.norm_eps
        rt = cfg.rope_type
        vm = _mod(self.sst[...], c["tv"], self.sst.shape[0])
        am = _mod(self.audio_sst[...], c["taa"], self.audio_sst.shape[0])
        pm = None
        if cfg.perturbed_attn:
            pm = jnp.where(c["stg"][layer] > 0, c["perturb"], jnp.ones_like(c["perturb"]))

        # 1. self-attention per stream
        x = (L.rms(h, eps).astype(F32) * (1 + vm[1]) + vm[0]).astype(dt)
        o = self._self(self.attn1, x, (rt, c["vcos"], c["vsin"]), pm, par, sharded=True)
        h = (h.astype(F32) + o.astype(F32) * vm[2]).astype(dt)
        x = (L.rms(au, eps).astype(F32) * (1 + am[1]) + am[0]).astype(dt)
        o = self._self(self.audio_attn1, x, (rt, c["acos"], c["asin"]), pm, par, sharded=False)
        au = (au.astype(F32) + o.astype(F32) * am[2]).astype(dt)

        # 2. text cross-attention per stream (keys / values computed once when ``c["kv"]`` holds them)
        kv = c.get("kv")
        ctx, actx = self._text_contexts(c, dt) if kv is None else (None, None)
        x = L.rms(h, eps)
        if cfg.cross_attn_mod:
            x = (x.astype(F32) * (1 + vm[7]) + vm[6]).astype(dt)
        o = self._cross(self.attn2, x, ctx, c["bias"], None, None, par, None if kv is None else (kv["k"], kv["v"]))
        if cfg.cross_attn_mod:
            o = (o.astype(F32) * vm[8]).astype(dt)
        h = h + o
        x = L.rms(au, eps)
        if cfg.audio_cross_attn_mod:
            x = (x.astype(F32) * (1 + am[7]) + am[6]).astype(dt)
        o = self._cross(self.audio_attn2, x, actx, c["abias"], None, None, par,
                        None if kv is None else (kv["ak"], kv["av"]))
        if cfg.audio_cross_attn_mod:
            o = (o.astype(F32) * am[8]).astype(dt)
        au = au + o

        # 3. audio <-> video cross-attention (xmod [B]: 0 isolates the modalities)
        nh, na_ = L.rms(h, eps).astype(F32), L.rms(au, eps).astype(F32)
        v_sc_a2v, v_sh_a2v, v_sc_v2a, v_sh_v2a = _mod(self.a2v_sst[...][:4], c["cav"], 4)
        (gv,) = _mod(self.a2v_sst[...][4:], c["cgv"], 1)
        a_sc_a2v, a_sh_a2v, a_sc_v2a, a_sh_v2a = _mod(self.audio_a2v_sst[...][:4], c["caa"], 4)
        (ga,) = _mod(self.audio_a2v_sst[...][4:], c["cga"], 1)
        xm = c["xmod"].astype(F32)[:, None, None]
        cv, ca_ = (rt, c["cvcos"], c["cvsin"]), (rt, c["cacos"], c["casin"])
        q_in = (nh * (1 + v_sc_a2v) + v_sh_a2v).astype(dt)
        kv_in = (na_ * (1 + a_sc_a2v) + a_sh_a2v).astype(dt)
        q, k, v = self.a2v.project(q_in, kv_in, cv, ca_, par)
        o = self.a2v.finish(q_in, attention(q, k, v, impl=par.attn_impl), par)
        h = (h.astype(F32) + xm * (gv * o.astype(F32))).astype(dt)
        q_in = (na_ * (1 + a_sc_v2a) + a_sh_v2a).astype(dt)
        kv_in = (nh * (1 + v_sc_v2a) + v_sh_v2a).astype(dt)
        q, k, v = self.v2a.project(q_in, kv_in, ca_, cv, par)
        (k, km), (v, _) = _gather_tokens(k, par), _gather_tokens(v, par)
        o = self.v2a.finish(q_in, attention(q, k, v, mask=None if km is None else km[:, None, None, :],
                                            impl=par.attn_impl), par)
        au = (au.astype(F32) + xm * (ga * o.astype(F32))).astype(dt)

        # 4. feed-forward per stream
        x = (L.rms(h, eps).astype(F32) * (1 + vm[4]) + vm[3]).astype(dt)
        h = (h.astype(F32) + self.ff(x, par).astype(F32) * vm[5]).astype(dt)
        x = (L.rms(au, eps).astype(F32) * (1 + am[4]) + am[3]).astype(dt)
        au = (au.astype(F32) + self.audio_ff(x, par).astype(F32) * am[5]).astype(dt)
        return h, au


class LTX2Head(nnx.Module):
    def __init__(self, cfg: LTX2DiTConfig, *, rngs, param_dtype=F32):
        d, da = cfg.dim, cfg.audio_dim
        self.sst = nn.param(rngs, nnx.initializers.normal(d ** -0.5), (2, d), None, "embed", dtype=param_dtype)
        self.audio_sst = nn.param(rngs, nnx.initializers.normal(da ** -0.5), (2, da), None, None, dtype=param_dtype)
        self.proj_out = nn.Linear(d, cfg.out_channels, rngs=rngs, axes=("embed", None), param_dtype=param_dtype)
        self.audio_proj_out = nn.Linear(da, cfg.audio_out_channels, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, carry, c, par=vsh.LOCAL):
        def out(x, sst, e, proj):
            m = sst[...].astype(F32)[None, None] + e[:, :, None]
            y = (L.layer_norm(x, 1e-6).astype(F32) * (1 + m[:, :, 1]) + m[:, :, 0]).astype(x.dtype)
            return proj(y)

        return {"y": out(carry["h"], self.sst, c["ev"], self.proj_out),
                "ya": out(carry["a"], self.audio_sst, c["ea"], self.audio_proj_out)}


class LTX2Transformer(nn.StackedDiT):
    """``embed`` -> stacked ``blocks`` -> ``head`` over named activations (see :func:`model_inputs`)."""

    EMBED, BLOCK, HEAD = LTX2Embed, LTX2Block, LTX2Head

    def __init__(self, cfg: LTX2DiTConfig, *, rngs, param_dtype=F32):
        super().__init__(cfg, rngs=rngs, param_dtype=param_dtype)
        #: the inputs only the text cross-attention keys / values read (computed once per sample
        #: stage); none when the prompt modulation follows sigma (LTX-2.3's ``prompt_adaln``): then
        #: the keys / values change every step
        self.CONTEXT = () if cfg.prompt_modulation and cfg.use_prompt_adaln_single else ("ctx", "actx")

    @staticmethod
    def step(blk, carry, consts, par):
        h, a = blk(carry["h"], carry["a"], consts, carry["layer"], par)
        return {"h": h, "a": a, "layer": carry["layer"] + 1}

    @staticmethod
    def kv(blk, c, par):
        """This block's text keys / values (both streams), from ``embed.kv_context``."""
        return blk.text_kv(c, par)

    @staticmethod
    def act_spec(name: str, shape: tuple) -> tuple:
        """Logical axes of an activation (see ``vidax.core.sharding.activation_axes``)."""
        bdim = None if shape and shape[0] == 1 else "batch"
        if name in ("layer", "stg"):
            return ()
        if name in ("vcos", "vsin", "cvcos", "cvsin"):
            return (bdim, "tokens", "heads", *(None,) * (len(shape) - 3))
        if name in ("acos", "asin", "cacos", "casin"):
            return (bdim, None, "heads", *(None,) * (len(shape) - 3))
        return vsh.activation_axes(name, shape, tokens=("vtok", "h", "y", "keyframes"), kv=("k", "v", "ak", "av"),
                                   per_token=("t", "tv", "ev", "cav", "cgv", "ca_t"))

    def __call__(self, inputs: dict, par=vsh.LOCAL, context: dict | None = None) -> dict:
        """``context``: the blocks' keys / values from :meth:`context` (the text inputs then unused)."""
        if context is not None:
            inputs = {k: v for k, v in inputs.items() if k not in ("ctx", "actx")}
        return run_local(self, inputs, {}, self.embed.proj_in.kernel[...].dtype, par, context)

    def context(self, ctx, actx, par=vsh.LOCAL) -> dict:
        """The blocks' text keys / values of both streams' contexts: once per sample stage."""
        return context_local(self, {"ctx": ctx, "actx": actx}, self.embed.proj_in.kernel[...].dtype, par)


# ----------------------------------------------------------------------------------- coordinates
def video_coords(num_frames: int, height: int, width: int, cfg: LTX2DiTConfig, fps: float = 24.0,
                 batch: int = 1) -> np.ndarray:
    """``prepare_video_coords``: per-patch [start, end) bounds in pixels (time in seconds),
    [B, 3, S, 2] float32, for ``num_frames x height x width`` latent cells."""
    f32 = np.float32
    pt, p = cfg.patch_size_t, cfg.patch_size
    g = np.stack(np.meshgrid(np.arange(0, num_frames, pt, dtype=f32), np.arange(0, height, p, dtype=f32),
                             np.arange(0, width, p, dtype=f32), indexing="ij"), axis=0)
    ends = g + np.asarray([pt, p, p], f32).reshape(3, 1, 1, 1)
    lat = np.stack([g, ends], axis=-1).reshape(3, -1, 2)
    px = lat * np.asarray(cfg.vae_scale_factors, f32).reshape(3, 1, 1)
    px[0] = np.maximum(px[0] + f32(cfg.causal_offset) - f32(cfg.vae_scale_factors[0]), f32(0))
    px[0] = px[0] / f32(fps)
    return np.broadcast_to(px[None], (batch, *px.shape)).astype(f32)


def audio_coords(num_frames: int, cfg: LTX2DiTConfig, shift: int = 0, batch: int = 1) -> np.ndarray:
    """``prepare_audio_coords``: per latent audio frame [start, end) in seconds, [B, 1, La, 2]."""
    f32 = np.float32
    g = np.arange(shift, num_frames + shift, cfg.audio_patch_size_t, dtype=f32)
    s = f32(cfg.audio_scale_factor)
    off = f32(cfg.causal_offset)
    start = np.maximum(g * s + off - s, f32(0)) * f32(cfg.audio_hop_length) / f32(cfg.audio_sampling_rate)
    end = np.maximum((g + f32(cfg.audio_patch_size_t)) * s + off - s, f32(0)) * f32(cfg.audio_hop_length) \
        / f32(cfg.audio_sampling_rate)
    c = np.stack([start, end], axis=-1)[None, None]
    return np.broadcast_to(c, (batch, 1, *c.shape[2:])).astype(f32)


def rope_from_coords(coords, dim: int, max_pos: tuple, cfg, num_heads: int):
    """``LTX2AudioVideoRotaryPosEmbed.forward`` (and the connectors' 1D rope): cos, sin from
    coordinates [B, P, N(, 2)]. Interleaved: [B, N, dim]; split: [B, N, num_heads, dim / (2 num_heads)].
    ``cfg``: anything with ``rope_theta``, ``rope_double_precision``, ``rope_type``."""
    f32 = np.float32
    c = np.asarray(coords, f32)
    if c.ndim == 4:
        c = ((c[..., 0] + c[..., 1]) / f32(2.0)).astype(f32)
    npos = c.shape[1]
    grid = np.stack([c[:, i] / f32(max_pos[i]) for i in range(npos)], axis=-1)  # [B, N, P]
    n = dim // (2 * npos)
    fd = np.float64 if cfg.rope_double_precision else np.float32
    pw = np.power(fd(cfg.rope_theta), np.linspace(0.0, 1.0, n, dtype=fd))
    freqs = (pw * fd(math.pi) / fd(2.0)).astype(f32)
    ang = (grid[..., None] * f32(2) - f32(1)) * freqs  # [B, N, P, n]
    ang = np.swapaxes(ang, -1, -2).reshape(*ang.shape[:2], n * npos)
    if cfg.rope_type == "interleaved":
        cos, sin = np.repeat(np.cos(ang), 2, axis=-1), np.repeat(np.sin(ang), 2, axis=-1)
        pad = dim % (2 * npos)
        if pad:
            cos = np.concatenate([np.ones((*cos.shape[:2], pad), f32), cos], axis=-1)
            sin = np.concatenate([np.zeros((*sin.shape[:2], pad), f32), sin], axis=-1)
        return cos.astype(f32), sin.astype(f32)
    cos, sin = np.cos(ang), np.sin(ang)
    pad = dim // 2 - ang.shape[-1]
    if pad:
        cos = np.concatenate([np.ones((*cos.shape[:2], pad), f32), cos], axis=-1)
        sin = np.concatenate([np.zeros((*sin.shape[:2], pad), f32), sin], axis=-1)
    b, t = cos.shape[:2]
    return cos.reshape(b, t, num_heads, -1).astype(f32), sin.reshape(b, t, num_heads, -1).astype(f32)


def rope_tables(cfg: LTX2DiTConfig, vcoords, acoords) -> dict:
    """Every rotary table a forward needs (self and cross-modal, video and audio)."""
    vmax = (cfg.pos_embed_max_pos, cfg.base_height, cfg.base_width)
    cmax = max(cfg.pos_embed_max_pos, cfg.audio_pos_embed_max_pos)
    vc, ac = np.asarray(vcoords, np.float32), np.asarray(acoords, np.float32)
    t = {}
    t["vcos"], t["vsin"] = rope_from_coords(vc, cfg.dim, vmax, cfg, cfg.num_heads)
    t["acos"], t["asin"] = rope_from_coords(ac, cfg.audio_dim, (cfg.audio_pos_embed_max_pos,), cfg, cfg.audio_num_heads)
    t["cvcos"], t["cvsin"] = rope_from_coords(vc[:, 0:1], cfg.audio_cross_attention_dim, (cmax,), cfg, cfg.num_heads)
    t["cacos"], t["casin"] = rope_from_coords(ac[:, 0:1], cfg.audio_cross_attention_dim, (cmax,), cfg,
                                              cfg.audio_num_heads)
    return t


def model_inputs(cfg: LTX2DiTConfig, vtok, atok, ctx, actx, t, ropes: dict, *, ta=None, sigma=None, sigma_a=None,
                 mask=None, amask=None, use_cross_timestep: bool = False, perturb=None, stg_blocks=(),
                 isolate=None, keyframes=None) -> dict:
    """The named inputs of one forward, as the reference's ``forward`` derives them from its
    arguments. ``t``: [B] or [B, S]; ``ta``: audio timestep (default ``t``); ``sigma``:
    [B] (prompt modulation; default None); ``perturb``: [B], 0 where spatio-temporal guidance
    perturbs (in ``stg_blocks``); ``isolate``: [B] bool, modality isolation (no a2v / v2a)."""
    b = vtok.shape[0]

    def vec(x, default):
        if x is None:
            return default
        x = jnp.asarray(x, F32)
        return jnp.broadcast_to(x, (b,)) if x.ndim == 0 else x

    t = vec(t, None)
    ta = vec(ta, t)
    sigma = vec(sigma, None)
    sigma_a = vec(sigma_a, sigma)
    if use_cross_timestep:
        ca_t, ca_ta = sigma_a, sigma
    else:
        ca_t, ca_ta = t, ta
    z = jnp.zeros((b,), F32)
    ones = jnp.ones((b,), F32)
    stg = np.zeros((cfg.num_layers,), np.int32)
    for i in stg_blocks or ():
        stg[i] = 1
    mask = jnp.ones(ctx.shape[:2], F32) if mask is None else jnp.asarray(mask, F32)
    amask = jnp.ones(actx.shape[:2], F32) if amask is None else jnp.asarray(amask, F32)
    a = {"vtok": jnp.asarray(vtok), "atok": jnp.asarray(atok), **({} if ctx is None else {"ctx": jnp.asarray(ctx)}),
         **({} if actx is None else {"actx": jnp.asarray(actx)}), "t": t, "ta": ta, "sigma": z if sigma is None else sigma,
         "sigma_a": z if sigma_a is None else sigma_a,
         "ca_t": ca_t, "ca_ta": ca_ta, "bias": L.mask_bias(mask), "abias": L.mask_bias(amask),
         "perturb": ones if perturb is None else vec(perturb, ones),
         "xmod": ones if isolate is None else 1.0 - jnp.asarray(isolate, F32), "stg": jnp.asarray(stg)}
    if keyframes is not None:
        a["keyframes"] = jnp.asarray(keyframes, F32)
    a.update({k: jnp.asarray(v) for k, v in ropes.items()})
    return a


# ----------------------------------------------------------------------------------- state
KIT = nn.ModelKit(LTX2Transformer, units=("embed", "blocks", "head"), dtype_leaf=("embed", "proj_in", "kernel"))
abstract_state, param_shapes, abstract_model, state_dtype = (KIT.abstract_state, KIT.param_shapes, KIT.abstract_model,
                                                             KIT.state_dtype)


def init_state(cfg: LTX2DiTConfig, seed: int = 0, dtype=np.float32):
    return L.seeded_state(lambda: KIT.build(cfg, 0, dtype), seed)


def forward(state, cfg: LTX2DiTConfig, inputs: dict, *, attn_impl=None, context=None) -> dict:
    """``{"y": video [B, S, Cout], "ya": audio [B, La, Ca]}`` (pure; jit with ``static_argnums=1``);
    ``context``: :func:`context`'s keys / values (``inputs`` then need no ``ctx`` / ``actx``)."""
    return KIT.merge(state, cfg)(inputs, vsh.ParallelContext(attn_impl=attn_impl),
                                                                     context)


def context(state, cfg: LTX2DiTConfig, ctx, actx, *, attn_impl=None) -> dict:
    """The blocks' text keys / values of both streams from a state (pure): once per sample stage."""
    return KIT.merge(state, cfg).context(ctx, actx,
                                                                           vsh.ParallelContext(attn_impl=attn_impl))


# ----------------------------------------------------------------------------------- sharding
def parallel_constraints(cfg: LTX2DiTConfig, *, tokens: int | None = None, batch: int | None = None):
    r = [vmesh.UlyssesHeads("num_heads", cfg.num_heads),
         vmesh.Divisible("audio_num_heads", cfg.audio_num_heads, ("tp",), "audio heads are split over tp"),
         vmesh.Divisible("ffn_dim", 4 * cfg.audio_dim, ("tp",), "FFN up/down are split over tp")]
    return r + vmesh.input_rules(tokens, batch, what="video tokens")


def runner(state, cfg: LTX2DiTConfig, mesh=None, parallelism=None, **kw) -> DiTRunner:
    return KIT.runner(state, cfg, mesh, parallelism, constraints=parallel_constraints(cfg), **kw)


# ----------------------------------------------------------------------------------- key maps
def diffusers_keymap(cfg: LTX2DiTConfig) -> KeyMap:
    ada = lambda ref, dst: (L.lin(f"{ref}.emb.timestep_embedder.linear_1", f"{dst}.emb.l1")  # noqa: E731
                            + L.lin(f"{ref}.emb.timestep_embedder.linear_2", f"{dst}.emb.l2")
                            + L.lin(f"{ref}.linear", f"{dst}.linear"))
    top = [*L.lin("proj_in", "embed.proj_in"), *L.lin("audio_proj_in", "embed.audio_proj_in"),
           *ada("time_embed", "embed.time"), *ada("audio_time_embed", "embed.audio_time"),
           *ada("av_cross_attn_video_scale_shift", "embed.ca_video"), *ada("av_cross_attn_audio_scale_shift", "embed.ca_audio"),
           *ada("av_cross_attn_video_a2v_gate", "embed.ca_video_gate"),
           *ada("av_cross_attn_audio_v2a_gate", "embed.ca_audio_gate"),
           ("scale_shift_table", "head.sst", "none"), ("audio_scale_shift_table", "head.audio_sst", "none"),
           *L.lin("proj_out", "head.proj_out"), *L.lin("audio_proj_out", "head.audio_proj_out")]
    if cfg.use_keyframes_abs_pos_embedding:
        top.append(("keyframes_abs_pos_embedding", "embed.keyframes", "none"))
    if cfg.use_prompt_embeddings:
        top += [*L.lin("caption_projection.linear_1", "embed.caption.l1"),
                *L.lin("caption_projection.linear_2", "embed.caption.l2"),
                *L.lin("audio_caption_projection.linear_1", "embed.audio_caption.l1"),
                *L.lin("audio_caption_projection.linear_2", "embed.audio_caption.l2")]
    if cfg.prompt_modulation and cfg.use_prompt_adaln_single:
        top += [*ada("prompt_adaln", "embed.prompt"), *ada("audio_prompt_adaln", "embed.audio_prompt")]
    ab = dict(bias=cfg.attention_bias, out_bias=cfg.attention_out_bias)
    block = [("scale_shift_table", "sst", "none"), ("audio_scale_shift_table", "audio_sst", "none"),
             ("video_a2v_cross_attn_scale_shift_table", "a2v_sst", "none"),
             ("audio_a2v_cross_attn_scale_shift_table", "audio_a2v_sst", "none"),
             *L.attn_keys("attn1", "attn1", cfg.gated_attn, **ab),
             *L.attn_keys("audio_attn1", "audio_attn1", cfg.audio_gated_attn, **ab),
             *L.attn_keys("attn2", "attn2", cfg.gated_attn, **ab),
             *L.attn_keys("audio_attn2", "audio_attn2", cfg.audio_gated_attn, **ab),
             *L.attn_keys("audio_to_video_attn", "a2v", cfg.gated_attn, **ab),
             *L.attn_keys("video_to_audio_attn", "v2a", cfg.audio_gated_attn, **ab),
             *L.ff_keys("ff", "ff", cfg.ff_bias), *L.ff_keys("audio_ff", "audio_ff", cfg.audio_ff_bias)]
    if cfg.prompt_modulation:
        block += [("prompt_scale_shift_table", "prompt_sst", "none"),
                  ("audio_prompt_scale_shift_table", "audio_prompt_sst", "none")]
    rules = [Rule(s, d, k) for s, d, k in top] + [Rule(f"transformer_blocks.{{i}}.{s}", f"blocks.{d}", k) for s, d, k in block]
    return KeyMap(rules)


#: diffusers name prefix / part -> the original LTX-2 release's (``ltx-2-*.safetensors``, the DiT under
#: ``model.diffusion_model.``), the inverse of diffusers' ``convert_ltx2_transformer_to_diffusers``
_ORIGINAL_TOP = (("audio_proj_in.", "audio_patchify_proj."), ("proj_in.", "patchify_proj."),
                 ("audio_time_embed.", "audio_adaln_single."), ("time_embed.", "adaln_single."),
                 ("av_cross_attn_video_scale_shift.", "av_ca_video_scale_shift_adaln_single."),
                 ("av_cross_attn_video_a2v_gate.", "av_ca_a2v_gate_adaln_single."),
                 ("av_cross_attn_audio_scale_shift.", "av_ca_audio_scale_shift_adaln_single."),
                 ("av_cross_attn_audio_v2a_gate.", "av_ca_v2a_gate_adaln_single."))
_ORIGINAL_PART = ((".video_a2v_cross_attn_scale_shift_table", ".scale_shift_table_a2v_ca_video"),
                  (".audio_a2v_cross_attn_scale_shift_table", ".scale_shift_table_a2v_ca_audio"),
                  (".norm_q.", ".q_norm."), (".norm_k.", ".k_norm."))


def original_keymap(cfg: LTX2DiTConfig) -> KeyMap:
    def orig(name):
        for a, b in _ORIGINAL_TOP:
            if name.startswith(a):
                name = b + name[len(a):]
                break
        for a, b in _ORIGINAL_PART:
            name = name.replace(a, b)
        return name

    return KeyMap([Rule(orig(r.src), r.dst, r.kind) for r in diffusers_keymap(cfg).rules],
                  ignore=[r"^(video|audio)_embeddings_connector\."])


def _is_original(names) -> bool:
    return any(n.startswith(("patchify_proj.", "adaln_single.")) for n in names)


def load_dit(path, cfg: LTX2DiTConfig | None = None, dtype=np.float32):
    """(host state, cfg) from a diffusers ``transformer/`` folder, or an original-release file
    (``model.diffusion_model.*`` names; the config must be given: the release ships none)."""
    return KIT.load(path, cfg, dtype, from_config=LTX2DiTConfig.from_diffusers, is_original=_is_original,
                    prefix="model.diffusion_model.", keymap=(diffusers_keymap, original_keymap),
                    what=lambda c: f"LTX2VideoTransformer3DModel (dim {c.dim}, audio {c.audio_dim}, {c.num_layers} layers)")


# ----------------------------------------------------------------------------------- compat
class _Compat(compat.CompatModel):
    def __init__(self, config, state, cfg, run=None):
        super().__init__("LTX2VideoTransformer3DModel", config, state, cfg)
        self.runner = run
        self._fwd = jax.jit(partial(forward, cfg=cfg)) if run is None else None

    def forward(self, hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states, timestep,
                audio_timestep=None, sigma=None, audio_sigma=None, encoder_attention_mask=None,
                audio_encoder_attention_mask=None, num_frames=None, height=None, width=None, fps=24.0,
                audio_num_frames=None, video_coords=None, audio_coords=None, isolate_modalities=False,
                spatio_temporal_guidance_blocks=None, perturbation_mask=None, use_cross_timestep=False,
                video_keyframes_mask=None, **_):
        """The reference's ``forward``; returns ``(video [B, S, C], audio [B, La, Ca])``."""
        cfg = self.model_config
        b = np.shape(hidden_states)[0]
        if video_coords is None:
            video_coords = video_coords_fn(num_frames, height, width, cfg, fps, b)
        if audio_coords is None:
            audio_coords = audio_coords_fn(audio_num_frames, cfg, 0, b)
        ropes = rope_tables(cfg, video_coords, audio_coords)
        stg = list(spatio_temporal_guidance_blocks or [])
        pm = perturbation_mask
        if stg and pm is None:
            pm = np.zeros((b,), np.float32)
        pm = None if pm is None else np.asarray(pm, np.float32).reshape(b)
        iso = np.full((b,), float(bool(isolate_modalities)), np.float32)
        f = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float32))  # noqa: E731
        inputs = model_inputs(cfg, f(hidden_states), f(audio_hidden_states), f(encoder_hidden_states),
                              f(audio_encoder_hidden_states), f(timestep), ropes, ta=f(audio_timestep), sigma=f(sigma),
                              sigma_a=f(audio_sigma), mask=f(encoder_attention_mask), amask=f(audio_encoder_attention_mask),
                              use_cross_timestep=use_cross_timestep, perturb=pm, stg_blocks=stg, isolate=iso,
                              keyframes=f(video_keyframes_mask))
        out = self._fwd(self.params, inputs=inputs) if self.runner is None else self.runner(inputs)
        return np.asarray(out["y"]), np.asarray(out["ya"])


video_coords_fn, audio_coords_fn = video_coords, audio_coords


compat.register_dit("LTX2VideoTransformer3DModel", LTX2DiTConfig.from_diffusers, _Compat, load_dit, runner,
                    constraints=parallel_constraints)
