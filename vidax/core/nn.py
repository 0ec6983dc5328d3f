"""Functional layers over plain-dict parameters.

Conventions (shared by every model in vidax):
- a linear layer is ``{"w": [in, out], "b": [out]}`` (``b`` optional);
- a conv is channels-last: ``{"w": [*kernel, in, out], "b": [out]}``;
- norms take their affine parameters explicitly; statistics are computed in float32.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def dense(p, x):
    y = jnp.matmul(x, p["w"].astype(x.dtype))
    if "b" in p:
        y = y + p["b"].astype(y.dtype)
    return y


def layer_norm(x, weight=None, bias=None, eps=1e-6):
    dtype = x.dtype
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


def rms_norm(x, weight=None, eps=1e-6):
    """T5/Llama-style RMS norm over the last axis (no mean subtraction)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(dtype)


def l2_channel_norm(x, gamma, bias=None, eps=1e-12):
    """Wan-VAE style norm: x / max(||x||_2, eps) * sqrt(C) * gamma (+ bias), over the last axis."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    n = jnp.sqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True))
    y = xf / jnp.maximum(n, eps) * math.sqrt(x.shape[-1]) * gamma.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(dtype)


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def gelu_exact(x):
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS = {
    "gelu": gelu_exact,
    "gelu_new": gelu_tanh,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu-approximate": gelu_tanh,
    "gelu_tanh": gelu_tanh,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}") from None


def conv(p, x, stride=1, padding="VALID"):
    """N-d channels-last convolution. ``x``: [B, *spatial, C]; ``p['w']``: [*kernel, Cin, Cout]."""
    nd = x.ndim - 2
    if isinstance(stride, int):
        stride = (stride,) * nd
    spatial = "DHW"[-nd:] if nd <= 3 else None
    dn = jax.lax.conv_dimension_numbers(
        x.shape, p["w"].shape, ("N" + spatial + "C", spatial + "IO", "N" + spatial + "C")
    )
    y = jax.lax.conv_general_dilated(
        x, p["w"].astype(x.dtype), window_strides=stride, padding=padding, dimension_numbers=dn,
        precision=jax.lax.Precision.HIGHEST,
    )
    if "b" in p:
        y = y + p["b"].astype(y.dtype)
    return y


# ---------------------------------------------------------------------------------------------
# random initialisation (tiny presets, tests): every parameter perturbed, nothing zero or one
# ---------------------------------------------------------------------------------------------
class Init:
    """Seeded numpy initialiser for parameter trees; host-side, deterministic."""

    def __init__(self, seed: int = 0, dtype=np.float32):
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype

    def normal(self, shape, std=0.02, mean=0.0):
        return (mean + std * self.rng.standard_normal(shape)).astype(self.dtype)

    def linear(self, din, dout, bias=True, lead=()):
        p = {"w": self.normal((*lead, din, dout), std=1.0 / math.sqrt(din))}
        if bias:
            p["b"] = self.normal((*lead, dout), std=0.02)
        return p

    def conv(self, kernel, cin, cout, bias=True, lead=()):
        fan_in = cin * int(np.prod(kernel))
        p = {"w": self.normal((*lead, *kernel, cin, cout), std=1.0 / math.sqrt(fan_in))}
        if bias:
            p["b"] = self.normal((*lead, cout), std=0.02)
        return p

    def norm_weight(self, shape):
        return self.normal(shape, std=0.05, mean=1.0)

    def bias(self, shape):
        return self.normal(shape, std=0.02)
