"""Small layers the DiTs share: the patch embedding as one matmul, a two-layer MLP, head splitting."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from vidax.core import nn

F32 = jnp.float32


def split_heads(x, head_dim: int):
    """``[..., H * head_dim]`` -> ``[..., H, head_dim]`` (H may be a shard's local head count)."""
    return x.reshape(*x.shape[:-1], -1, head_dim)


class PatchEmbed(nnx.Module):
    """The reference's Conv3d with stride = kernel = patch, applied to patchified tokens
    (:func:`vidax.core.geometry.patchify`, order ``"thwc"``) as one matmul: per token, so it runs
    unchanged on a token shard. ``kernel``: ``[pt, ph, pw, Cin, D]``."""

    def __init__(self, patch, cin: int, dim: int, *, rngs: nnx.Rngs, param_dtype=F32):
        self.kernel = nn.param(rngs, nnx.initializers.lecun_normal(), (*patch, cin, dim), None, None, None, None, "embed",
                               dtype=param_dtype)
        self.bias = nn.param(rngs, nnx.initializers.zeros_init(), (dim,), "embed", dtype=param_dtype)

    def __call__(self, tokens):
        k = self.kernel[...]
        y = jnp.matmul(tokens, k.reshape(-1, k.shape[-1]).astype(tokens.dtype), precision=jax.lax.Precision.HIGHEST)
        return y + self.bias[...].astype(y.dtype)


class MLP(nnx.Module):
    """``l2(act(l1(x)))`` (timestep and text embedders); the output is the model width (``embed``)."""

    def __init__(self, din: int, dhidden: int, dout: int, act: str, *, rngs: nnx.Rngs, param_dtype=F32):
        self.l1 = nn.Linear(din, dhidden, rngs=rngs, param_dtype=param_dtype)
        self.l2 = nn.Linear(dhidden, dout, rngs=rngs, axes=(None, "embed"), param_dtype=param_dtype)
        self.act = act

    def __call__(self, x):
        return self.l2(nn.activation(self.act)(self.l1(x)))


__all__ = ["MLP", "PatchEmbed", "split_heads"]
