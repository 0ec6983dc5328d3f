"""The pre-LayerNorm transformer encoder layer CLIP text and SigLIP vision share (transformers'
``CLIPEncoderLayer`` / ``SiglipEncoderLayer``): ``x + o(attn(LN1(x)))``, then
``x + fc2(act(fc1(LN2(x))))``; every projection biased. Float32, ``Precision.HIGHEST``.

State of a stack of them (``nn.stack``)::

    {"norm1"/"norm2": {"scale": [N, D], "bias": [N, D]},
     "q"/"k"/"v"/"o": {"kernel": [N, D, D], "bias": [N, D]},
     "fc1": {"kernel": [N, D, F], "bias": [N, F]}, "fc2": {"kernel": [N, F, D], "bias": [N, D]}}
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from vidax.core import nn
from vidax.core.nn import ACTIVATIONS
from vidax.text.lm import gqa_attention
from vidax.weights import Rule

_HI = jax.lax.Precision.HIGHEST


class EncoderBlock(nnx.Module):
    def __init__(self, dim: int, ffn: int, heads: int, *, act: str, eps: float, rngs: nnx.Rngs,
                 param_dtype=jnp.float32):
        if dim % heads:
            raise ValueError(f"hidden size {dim} is not divisible by {heads} heads")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; known: {sorted(ACTIVATIONS)}")
        self.heads, self.act = heads, act
        lin = partial(nn.Linear, rngs=rngs, param_dtype=param_dtype, precision=_HI)
        norm = partial(nn.LayerNorm, dim, rngs=rngs, eps=eps, axis="embed", param_dtype=param_dtype)
        self.norm1 = norm()
        self.q, self.k, self.v = (lin(dim, dim, axes=("embed", "heads")) for _ in range(3))
        self.o = lin(dim, dim, axes=("heads", "embed"))
        self.norm2 = norm()
        self.fc1 = lin(dim, ffn, axes=("embed", "ffn"))
        self.fc2 = lin(ffn, dim, axes=("ffn", "embed"))

    def __call__(self, x, mask=None):
        """``x`` [B, T, D] float32; ``mask`` bool [B, T, T] (True = visible) or None (all visible).
        A query row without a visible key gets a zero attention output (torch sdpa)."""
        B, T, D = x.shape
        hd = D // self.heads
        h = self.norm1(x)
        q, k, v = (p(h).reshape(B, T, self.heads, hd) for p in (self.q, self.k, self.v))
        if mask is None:
            mask = jnp.ones((B, T, T), bool)
        x = x + self.o(gqa_attention(q, k, v, mask, hd**-0.5).reshape(B, T, D))
        return x + self.fc2(ACTIVATIONS[self.act](self.fc1(self.norm2(x))))


def run(blocks, x, mask=None, collect: bool = False):
    """All stacked blocks on ``x``: (output, per-layer outputs [N, B, T, D] or None)."""
    return nn.scan_range(blocks, x, lambda block, h: block(h, mask), collect=collect)


def block_rules(prefix: str) -> list[Rule]:
    """transformers names of a stack of encoder layers ``{prefix}layers.{i}.*`` -> ``blocks.*``."""
    b = prefix + "layers.{i}."
    rules = []
    for theirs, ours in (("layer_norm1", "norm1"), ("layer_norm2", "norm2")):
        rules += [Rule(b + f"{theirs}.weight", f"blocks.{ours}.scale"), Rule(b + f"{theirs}.bias", f"blocks.{ours}.bias")]
    for theirs, ours in (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v"),
                         ("self_attn.out_proj", "o"), ("mlp.fc1", "fc1"), ("mlp.fc2", "fc2")):
        rules += [Rule(b + f"{theirs}.weight", f"blocks.{ours}.kernel", "linear"), Rule(b + f"{theirs}.bias",
                                                                                        f"blocks.{ours}.bias")]
    return rules


__all__ = ["EncoderBlock", "run", "block_rules"]
