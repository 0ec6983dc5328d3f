"""Timestep embeddings and rotary position embeddings."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def sinusoidal_embedding(t, dim, *, flip_sin_to_cos=True, downscale_freq_shift=0.0, max_period=10000.0, scale=1.0):
    """Sinusoidal timestep embedding with diffusers' ``get_timestep_embedding`` semantics.

    ``t``: [...] float -> [..., dim] float32.
    """
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - downscale_freq_shift)
    freqs = jnp.exp(exponent)
    args = jnp.asarray(t, jnp.float32)[..., None] * freqs * scale
    sin, cos = jnp.sin(args), jnp.cos(args)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, [(0, 0)] * (emb.ndim - 1) + [(0, 1)])
    return emb


def rope_freqs_1d(dim: int, length: int, theta: float = 10000.0) -> np.ndarray:
    """Angles [length, dim // 2] for one axis (float64 on the host, like the references)."""
    inv = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64)[: dim // 2] / dim))
    return np.outer(np.arange(length, dtype=np.float64), inv)


def rope_3d_angles(head_dim: int, grid: tuple[int, int, int], theta: float = 10000.0) -> np.ndarray:
    """Wan-style 3D RoPE angles for a (frames, height, width) token grid.

    The head dim is split t: h: w = (d - 4*(d//6)) : 2*(d//6) : 2*(d//6). Returns [F*H*W, head_dim//2].
    """
    d_hw = 2 * (head_dim // 6)
    d_t = head_dim - 2 * d_hw
    f, h, w = grid
    at = rope_freqs_1d(d_t, f, theta)
    ah = rope_freqs_1d(d_hw, h, theta)
    aw = rope_freqs_1d(d_hw, w, theta)
    ang = np.concatenate(
        [
            np.broadcast_to(at[:, None, None, :], (f, h, w, at.shape[-1])),
            np.broadcast_to(ah[None, :, None, :], (f, h, w, ah.shape[-1])),
            np.broadcast_to(aw[None, None, :, :], (f, h, w, aw.shape[-1])),
        ],
        axis=-1,
    )
    return ang.reshape(f * h * w, -1)


def apply_rope_interleaved(x, cos, sin):
    """Rotate interleaved pairs (x[2i], x[2i+1]). ``x``: [B, L, H, D]; ``cos``/``sin``: [L, D//2]."""
    dtype = x.dtype
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    out = jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    return out.reshape(x.shape).astype(dtype)
