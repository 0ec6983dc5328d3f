"""LTX-2 text conditioning between Gemma 3 and the DiT (diffusers ``LTX2TextConnectors``).

The feature extractor packs Gemma's hidden states of every layer ([B, T, D, L+1], the token
embedding included) into one vector per token and projects it:

- LTX-2.0 (``per_modality_projections=False``): per sample and per layer, the valid (unpadded)
  tokens are centred on their masked mean and divided by their range (max - min), times
  ``scale_factor`` (8); one ``text_proj_in`` serves both streams;
- LTX-2.3+ (``per_modality_projections=True``): every token and layer RMS-normalised, padding
  zeroed, rescaled by ``sqrt(hidden_dim / D)`` per stream, then a projection per stream.

Each stream then runs its 1D connector transformer: the padded positions are replaced by learned
registers (valid tokens moved to the front, registers tiled by absolute position), 1D rotary
positions, a few pre-norm self-attention + feed-forward blocks, a final RMS norm. The scale of
this path is what the DiT's cross-attention reads: a wrong rescale feeds a weak signal that still
produces plausible, prompt-ignoring video (see the tests' scale checks).
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
from vidax.core.attention import attention
from vidax.models.ltx import layers as L
from vidax.weights import KeyMap, Rule, open_checkpoint
from vidax.weights.keymap import load_params

F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class ConnectorsConfig:
    caption_channels: int = 3840
    text_proj_in_factor: int = 49
    video_connector_num_attention_heads: int = 30
    video_connector_attention_head_dim: int = 128
    video_connector_num_layers: int = 2
    video_connector_num_learnable_registers: int | None = 128
    video_gated_attn: bool = False
    audio_connector_num_attention_heads: int = 30
    audio_connector_attention_head_dim: int = 128
    audio_connector_num_layers: int = 2
    audio_connector_num_learnable_registers: int | None = 128
    audio_gated_attn: bool = False
    connector_rope_base_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_double_precision: bool = True
    causal_temporal_positioning: bool = False
    rope_type: str = "interleaved"
    per_modality_projections: bool = False
    video_hidden_dim: int = 4096
    audio_hidden_dim: int = 2048
    proj_bias: bool = False

    @classmethod
    def from_diffusers(cls, cfg: dict) -> "ConnectorsConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})

    def stream(self, which: str):
        p = f"{which}_connector_"
        return (getattr(self, p + "num_attention_heads"), getattr(self, p + "attention_head_dim"),
                getattr(self, p + "num_layers"), getattr(self, p + "num_learnable_registers"),
                getattr(self, f"{which}_gated_attn"))


class ConnectorBlock(nnx.Module):
    def __init__(self, dim, heads, head_dim, gated, *, rngs, param_dtype=F32):
        self.attn = L.Attention(dim, heads, head_dim, gated=gated, rngs=rngs, param_dtype=param_dtype, eps=1e-6)
        self.ff = L.FeedForward(dim, rngs=rngs, param_dtype=param_dtype)

    def __call__(self, x, bias, rope):
        q, k, v = self.attn.project(L.rms(x, 1e-6), L.rms(x, 1e-6), rope, None, _LOCAL)
        x = x + self.attn.finish(L.rms(x, 1e-6), attention(q, k, v, bias=bias, impl="xla"), _LOCAL)
        return x + self.ff(L.rms(x, 1e-6))


from vidax.core.sharding import LOCAL as _LOCAL  # noqa: E402


class Connector(nnx.Module):
    """``LTX2ConnectorTransformer1d``."""

    def __init__(self, cfg: ConnectorsConfig, which: str, *, rngs, param_dtype=F32):
        heads, hd, layers, regs, gated = cfg.stream(which)
        self.cfg, self.heads, self.dim = cfg, heads, heads * hd
        self.registers = (nn.param(rngs, nnx.initializers.uniform(2.0), (regs, self.dim), None, None, dtype=param_dtype)
                          if regs is not None else None)
        self.blocks = nn.stack(lambda r: ConnectorBlock(self.dim, heads, hd, gated, rngs=r, param_dtype=param_dtype),
                               layers, rngs)

    def __call__(self, x, add_mask):
        """x [B, T, dim]; add_mask [B, 1, 1, T] additive (0 valid, -max padded) -> (x, mask)."""
        b, t, _ = x.shape
        if self.registers is not None:
            r = self.registers[...]
            n = r.shape[0]
            if t % n:
                raise ValueError(f"the text length {t} must be a multiple of the connector's {n} learnable registers")
            regs = jnp.tile(r, (t // n, 1)).astype(x.dtype)
            valid = (add_mask.reshape(b, t) >= -9000.0).astype(jnp.int32)
            order = jnp.argsort(1 - valid, axis=1, stable=True)
            front = jnp.take_along_axis(x, order[..., None], axis=1)
            keep = (jnp.arange(t)[None] < valid.sum(axis=1, keepdims=True))[..., None]
            x = jnp.where(keep, front, regs[None])
            add_mask = jnp.zeros_like(add_mask)
        from vidax.models.ltx.dit2 import rope_from_coords

        pos = np.arange(t, dtype=np.float32)[None, None]  # [1, 1, T]
        cos, sin = rope_from_coords(pos, self.dim, (self.cfg.connector_rope_base_seq_len,), self.cfg, self.heads)
        rope = (self.cfg.rope_type, jnp.asarray(cos), jnp.asarray(sin))
        x = nn.scan(self.blocks, x, lambda blk, h: blk(h, add_mask, rope))
        return L.rms(x, 1e-6), add_mask


class TextConnectors(nnx.Module):
    def __init__(self, cfg: ConnectorsConfig, *, rngs, param_dtype=F32):
        kw = dict(rngs=rngs, param_dtype=param_dtype)
        self.cfg = cfg
        din = cfg.caption_channels * cfg.text_proj_in_factor
        if cfg.per_modality_projections:
            self.video_proj = nn.Linear(din, cfg.video_hidden_dim, bias=cfg.proj_bias, precision=_HI, **kw)
            self.audio_proj = nn.Linear(din, cfg.audio_hidden_dim, bias=cfg.proj_bias, precision=_HI, **kw)
            self.proj = None
        else:
            self.proj = nn.Linear(din, cfg.caption_channels, bias=cfg.proj_bias, precision=_HI, **kw)
            self.video_proj = self.audio_proj = None
        self.video = Connector(cfg, "video", **kw)
        self.audio = Connector(cfg, "audio", **kw)

    def features(self, hidden, mask, padding_side: str = "left", scale_factor: float = 8.0):
        """The feature extractor: per-layer hidden states [B, T, D, L] (or [B, T, D*L]) + mask [B, T]
        -> (video features, audio features) [B, T, width], float32."""
        cfg = self.cfg
        x = jnp.asarray(hidden, F32)
        if x.ndim == 3:
            x = x.reshape(*x.shape[:2], cfg.caption_channels, -1)
        b, t, d, nl = x.shape
        m = jnp.asarray(mask)
        if cfg.per_modality_projections:
            xn = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=2, keepdims=True) + 1e-6)
            xn = xn.reshape(b, t, d * nl)
            xn = jnp.where(m.astype(bool)[..., None], xn, 0.0)
            v = self.video_proj(xn * math.sqrt(cfg.video_hidden_dim / cfg.caption_channels))
            a = self.audio_proj(xn * math.sqrt(cfg.audio_hidden_dim / cfg.caption_channels))
            return v, a
        lengths = m.astype(jnp.int32).sum(axis=-1)
        idx = jnp.arange(t)[None]
        if padding_side == "left":
            valid = idx >= (t - lengths)[:, None]
        elif padding_side == "right":
            valid = idx < lengths[:, None]
        else:
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        vm = valid[:, :, None, None]
        n = (lengths * d).astype(F32).reshape(b, 1, 1, 1)
        mean = jnp.sum(jnp.where(vm, x, 0.0), axis=(1, 2), keepdims=True) / (n + 1e-6)
        lo = jnp.min(jnp.where(vm, x, jnp.inf), axis=(1, 2), keepdims=True)
        hi = jnp.max(jnp.where(vm, x, -jnp.inf), axis=(1, 2), keepdims=True)
        xn = (x - mean) / (hi - lo + 1e-6) * scale_factor
        xn = jnp.where(valid[..., None], xn.reshape(b, t, d * nl), 0.0)
        p = self.proj(xn)
        return p, p

    def __call__(self, hidden, mask, padding_side: str = "left", scale_factor: float = 8.0):
        """``LTX2TextConnectors.forward``: (video embeddings, audio embeddings, mask [B, T])."""
        v, a = self.features(hidden, mask, padding_side, scale_factor)
        m = jnp.asarray(mask)
        add = ((m.astype(jnp.int32) - 1).astype(F32) * jnp.finfo(F32).max).reshape(m.shape[0], 1, 1, -1)
        v, vmask = self.video(v, add)
        binary = (vmask < 1e-6).astype(jnp.int32).reshape(v.shape[0], v.shape[1], 1)
        v = v * binary
        a, _ = self.audio(a, add)
        return v, a, binary[..., 0]


# ----------------------------------------------------------------------------------- state / loading
def _build(cfg, dtype=np.float32):
    return TextConnectors(cfg, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(dtype))


def init(cfg: ConnectorsConfig, seed: int = 0) -> nn.Split:
    g, st = L.seeded_split(lambda: _build(cfg), seed, {"registers": lambda s, r: r.uniform(-1, 1, s)})
    return nn.Split(g, jax.device_put(st), cfg)


def keymap(cfg: ConnectorsConfig) -> KeyMap:
    k = []
    if cfg.per_modality_projections:
        k += L.lin("video_text_proj_in", "video_proj", cfg.proj_bias) + L.lin("audio_text_proj_in", "audio_proj", cfg.proj_bias)
    else:
        k += L.lin("text_proj_in", "proj", cfg.proj_bias)
    rules = [Rule(*r) for r in k]
    for which in ("video", "audio"):
        gated = cfg.stream(which)[4]
        if cfg.stream(which)[3] is not None:
            rules.append(Rule(f"{which}_connector.learnable_registers", f"{which}.registers"))
        for s, d, kind in L.attn_keys("attn1", "attn", gated) + L.ff_keys("ff", "ff"):
            rules.append(Rule(f"{which}_connector.transformer_blocks.{{i}}.{s}", f"{which}.blocks.{d}", kind))
    return KeyMap(rules)


def load(folder, cfg: ConnectorsConfig | None = None) -> nn.Split:
    """A diffusers ``connectors/`` folder -> the module split once (float32 on the device)."""
    folder = Path(folder)
    cfg = cfg or ConnectorsConfig.from_diffusers(compat.read_config(folder))
    pure = load_params(open_checkpoint(folder), keymap(cfg), nn.shapes(lambda: _build(cfg)), dtype=np.float32,
                       what="LTX2TextConnectors")
    g, st = nn.abstract_state(lambda: _build(cfg))
    return nn.Split(g, jax.device_put(nn.fill(st, L.intkeys(pure))), cfg)


class _Compat(compat.CompatModel):
    def __init__(self, config, split):
        super().__init__("LTX2TextConnectors", config, split.state, split.cfg)
        self.split = split

    def forward(self, text_encoder_hidden_states, attention_mask, padding_side="left", scale_factor=8, **_):
        v, a, m = self.split(jnp.asarray(np.asarray(text_encoder_hidden_states, np.float32)),
                             jnp.asarray(np.asarray(attention_mask)), padding_side=padding_side,
                             scale_factor=float(scale_factor))
        return np.asarray(v), np.asarray(a), np.asarray(m)


@compat.register("LTX2TextConnectors")
def _load_compat(config: dict, folder: Path, **_):
    return _Compat(config, load(folder, ConnectorsConfig.from_diffusers(config)))
