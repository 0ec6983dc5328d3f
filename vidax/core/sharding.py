"""Sharding as data: parameter-path rules -> ``PartitionSpec``; Megatron tensor parallelism and
DeepSpeed-Ulysses sequence parallelism as a small context object the model's block calls into.

A family declares its rules once, as regular expressions on dotted parameter paths mapped to one
*logical* axis name per array dimension (``None`` = not sharded)::

    RULES = (
        (r"blocks\\.attn1\\.[qkv]\\.w", ("layers", "embed", "heads")),   # column-parallel
        (r"blocks\\.attn1\\.o\\.w",     ("layers", "heads", "embed")),   # row-parallel
        ...
    )                                                                # unmatched: replicated

and a parallelism maps logical names to mesh axes (``TP_LOGICAL = {"heads": "tp", "ffn": "tp"}``).
Nothing in a model file mentions devices. The same rules tell :class:`ParallelContext` which
dense layers are row-parallel (their *input* dim is sharded: partial sums, one ``psum``, the bias
added exactly once after it) and which norms see a sharded feature dim (sum of squares reduced
across the axis).

Everything that has to know about shards runs inside ``jax.shard_map`` (attention kernels the
compiler cannot partition, all_to_all, psum); placement uses ``NamedSharding`` and never
materialises a full array on one device.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from vidax.core import nn
from vidax.core.attention import attention
from vidax.core.mesh import AXES, ShardingConfigError, axis_sizes

Rules = Sequence[tuple[str, tuple | None]]

PARALLELISMS = ("none", "tp", "sp", "tp+sp")


# ----------------------------------------------------------------------------------- rules
def tree_paths(tree) -> list[str]:
    """Dotted paths of a nested-dict pytree's leaves, in ``jax.tree`` leaf order."""
    out = []
    for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out.append(".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp))
    return out


def logical_axes(path: str, rules: Rules) -> tuple | None:
    """The logical axes the first matching rule gives ``path`` (``None``: replicated)."""
    for pat, axes in rules:
        if re.fullmatch(pat, path):
            return axes
    return None


def spec_for(path: str, ndim: int, rules: Rules, logical_to_mesh: Mapping[str, str | None]) -> P:
    axes = logical_axes(path, rules)
    if axes is None:
        return P()
    if len(axes) != ndim:
        raise ShardingConfigError(f"sharding rule for {path!r} names {len(axes)} axes {axes} but the array has {ndim} dims")
    mesh_axes = [logical_to_mesh.get(a) if a is not None else None for a in axes]
    used = [m for m in mesh_axes if m is not None]
    if len(used) != len(set(used)):
        raise ShardingConfigError(f"sharding rule for {path!r}: mesh axis used twice {mesh_axes}")
    while mesh_axes and mesh_axes[-1] is None:
        mesh_axes.pop()
    return P(*mesh_axes)


def param_specs(tree, rules: Rules, logical_to_mesh: Mapping[str, str | None]):
    """Tree of ``PartitionSpec`` (same structure as ``tree``; leaves may be arrays or ShapeDtypeStructs)."""
    leaves, treedef = jax.tree.flatten(tree)
    paths = tree_paths(tree)
    return jax.tree.unflatten(treedef, [spec_for(p, np.ndim(l) if not hasattr(l, "ndim") else l.ndim, rules, logical_to_mesh)
                                        for p, l in zip(paths, leaves)])


def named_shardings(mesh: Mesh, specs, memory_kind: str | None = None):
    return jax.tree.map(lambda s: NamedSharding(mesh, s, memory_kind=memory_kind), specs,
                        is_leaf=lambda x: isinstance(x, P))


def check_param_divisibility(tree, specs, mesh: Mesh) -> None:
    """Every sharded dim must divide by its mesh axis size (error names the parameter)."""
    sizes = axis_sizes(mesh)
    for path, leaf, spec in zip(tree_paths(tree), jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
        for d, ax in enumerate(spec):
            for a in (ax,) if isinstance(ax, str) else (ax or ()):
                if leaf.shape[d] % sizes[a]:
                    raise ShardingConfigError(f"parameter {path} dim {d} (size {leaf.shape[d]}) is not divisible by {a}={sizes[a]}")


def place(tree, shardings):
    """Put a host (numpy) tree onto devices with ``shardings``; each device receives only its own
    slice (``make_array_from_callback``), so a large array is never whole on one device. Works
    multi-host when every process holds (or can read) the host tree. A leaf may also be a lazy
    checkpoint tensor (``vidax.weights.LazyTensor``: ``shape`` + ``read(index=...)``): then each
    device's slice is read from the file alone, and the whole tensor is never in host memory."""

    def one(x, s):
        if isinstance(x, jax.Array):
            return jax.device_put(x, s)
        if callable(getattr(x, "read", None)) and hasattr(x, "shape"):
            return jax.make_array_from_callback(tuple(x.shape), s, lambda idx: x.read(index=idx))
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)


def shard_bytes(shape, dtype, spec: P, mesh: Mesh | Mapping[str, int]) -> int:
    """Bytes one device holds of an array of ``shape`` laid out with ``spec``."""
    sizes = axis_sizes(mesh)
    local = list(shape)
    for d, ax in enumerate(spec):
        for a in (ax,) if isinstance(ax, str) else (ax or ()):
            local[d] //= sizes[a]
    return int(np.prod(local)) * np.dtype(dtype).itemsize


def per_device_bytes(tree, specs, mesh) -> int:
    """Bytes of ``tree`` on one device under ``specs``."""
    return sum(shard_bytes(l.shape, l.dtype, s, mesh)
               for l, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))))


def tree_bytes(tree) -> int:
    return sum(int(np.prod(l.shape)) * np.dtype(l.dtype).itemsize for l in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------------- parallelism
def resolve_parallelism(parallelism: str | None, mesh: Mesh | Mapping[str, int] | None) -> str:
    """Normalise ``parallelism`` ("tp", "sp", "tp+sp", "none"; None = what the mesh implies) and
    check it against the mesh: an axis of size > 1 that the parallelism does not use is an error."""
    sizes = axis_sizes(mesh)
    if parallelism is None:
        used = [a for a in ("tp", "sp") if sizes[a] > 1]
        return "+".join(used) if used else "none"
    p = str(parallelism).lower().replace(" ", "").replace(",", "+")
    if p in ("sp+tp",):
        p = "tp+sp"
    if p in ("", "dp", "cfg"):
        p = "none"
    if p not in PARALLELISMS:
        raise ShardingConfigError(f"parallelism={parallelism!r}; expected one of {PARALLELISMS}")
    for a in ("tp", "sp"):
        if sizes[a] > 1 and a not in p.split("+"):
            raise ShardingConfigError(f"parallelism={parallelism!r} does not use mesh axis {a}={sizes[a]}; "
                                      f"use parallelism='{'tp+sp' if p != 'none' else a}' or a mesh with {a}=1")
    return p


def logical_mapping(parallelism: str, tp_logical: Mapping[str, str]) -> dict[str, str]:
    """Logical -> mesh axes for a parallelism: TP maps the family's ``tp_logical`` table, SP keeps
    the weights replicated."""
    return dict(tp_logical) if "tp" in parallelism.split("+") else {}


# ----------------------------------------------------------------------------------- collectives
def column_parallel_dense(p, x):
    """``x @ w[:, shard] + b[shard]``: each device computes its slice of the output; no communication."""
    return nn.dense(p, x)


def row_parallel_dense(p, x, axis: str, *, naive_bias: bool = False):
    """``sum_shards(x[..., shard] @ w[shard, :]) + b`` with the bias added exactly once.

    Each device's matmul is a partial sum; ``psum`` over ``axis`` completes it. The bias is
    replicated, so adding it before the sum would add it ``axis_size`` times -- ``naive_bias=True``
    does exactly that (kept only so a test can show it breaks parity)."""
    y = jnp.matmul(x, p["w"].astype(x.dtype))
    if naive_bias and "b" in p:
        return jax.lax.psum(y + p["b"].astype(y.dtype), axis)
    y = jax.lax.psum(y, axis)
    if "b" in p:
        y = y + p["b"].astype(y.dtype)
    return y


def sharded_rms_norm(x, weight, eps, axis: str, axis_size: int):
    """RMS norm over a feature dim that is split across ``axis`` (Wan's q/k norm spans all heads):
    the sum of squares is reduced across devices; ``weight`` is this device's slice."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    ss = jax.lax.psum(jnp.sum(jnp.square(xf), axis=-1, keepdims=True), axis)
    y = xf * jax.lax.rsqrt(ss / (x.shape[-1] * axis_size) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(dtype)


def ulysses_attention(q, k, v, *, axis: str = "sp", axis_size: int, impl: str | None = None):
    """DeepSpeed-Ulysses self-attention inside ``shard_map``.

    In: ``[B, L/sp, H, D]`` (this device's tokens, all of its heads). all_to_all -> ``[B, L, H/sp, D]``
    (every token, a slice of the heads), ordinary attention, all_to_all back."""
    if axis_size == 1:
        return attention(q, k, v, impl=impl)
    if q.shape[2] % axis_size:
        raise ShardingConfigError(f"Ulysses: {q.shape[2]} local heads are not divisible by {axis}={axis_size}")

    def to_heads(t):
        return jax.lax.all_to_all(t, axis, split_axis=2, concat_axis=1, tiled=True)

    o = attention(to_heads(q), to_heads(k), to_heads(v), impl=impl)
    return jax.lax.all_to_all(o, axis, split_axis=1, concat_axis=2, tiled=True)


@dataclass(frozen=True)
class ParallelContext:
    """What a block needs to run on its shard inside ``shard_map``.

    ``rules`` + ``mapping`` (logical -> mesh axis) decide per layer path: a dense whose weight's
    input dim is sharded is row-parallel (psum + bias once), one whose output dim is sharded is
    column-parallel (local), a norm whose weight is sharded reduces across the axis. Self-attention
    goes through Ulysses over ``sp``; cross-attention stays local (its keys are replicated over sp).

    ``naive_row_bias`` / ``local_norm`` reproduce two classic TP bugs (for tests only)."""

    rules: tuple
    mapping: tuple  # ((logical, mesh_axis), ...)
    sizes: tuple  # ((axis, size), ...)
    attn_impl: str | None = None
    naive_row_bias: bool = False
    local_norm: bool = False
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def create(cls, rules: Rules, mapping: Mapping[str, str], mesh, *, attn_impl=None, naive_row_bias=False, local_norm=False):
        return cls(tuple(rules), tuple(sorted(mapping.items())), tuple(sorted(axis_sizes(mesh).items())),
                   attn_impl, naive_row_bias, local_norm)

    def size(self, axis: str) -> int:
        return dict(self.sizes)[axis]

    def mesh_axis(self, path: str, dim: int) -> str | None:
        """Mesh axis of dimension ``dim`` (negative: from the end) of parameter ``path``."""
        key = (path, dim)
        if key not in self._cache:
            axes = logical_axes(path, self.rules)
            m = dict(self.mapping)
            ax = None if axes is None or -dim > len(axes) else axes[dim]
            mesh_ax = m.get(ax) if ax is not None else None
            self._cache[key] = mesh_ax if mesh_ax is not None and self.size(mesh_ax) > 1 else None
        return self._cache[key]

    def dense(self, path: str, p, x):
        row = self.mesh_axis(f"{path}.w", -2)
        if row is not None:
            return row_parallel_dense(p, x, row, naive_bias=self.naive_row_bias)
        return nn.dense(p, x)

    def rms_norm(self, path: str, x, weight, eps):
        ax = self.mesh_axis(path, -1)
        if ax is None or self.local_norm:
            return nn.rms_norm(x, weight, eps)
        return sharded_rms_norm(x, weight, eps, ax, self.size(ax))

    def self_attention(self, q, k, v):
        return ulysses_attention(q, k, v, axis="sp", axis_size=self.size("sp"), impl=self.attn_impl)

    def cross_attention(self, q, k, v):
        return attention(q, k, v, impl=self.attn_impl)


def with_constraint(x, mesh: Mesh, spec: P):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


__all__ = ["AXES", "PARALLELISMS", "ParallelContext", "check_param_divisibility", "column_parallel_dense",
           "logical_axes", "logical_mapping", "named_shardings", "param_specs", "per_device_bytes", "place",
           "resolve_parallelism", "row_parallel_dense", "shard_bytes", "sharded_rms_norm", "spec_for",
           "tree_bytes", "tree_paths", "ulysses_attention", "with_constraint"]
