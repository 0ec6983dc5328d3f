"""Sharding as metadata: logical axis names on every parameter and activation, ONE table mapping
them to mesh axes; Megatron tensor parallelism and DeepSpeed-Ulysses sequence parallelism as a
small context object the model's layers call into inside ``shard_map``.

Every parameter of an NNX model carries its logical axes (``vidax.core.nn.logical`` /
``nn.Linear(axes=...)``; stacked blocks get a leading ``"layers"``)::

    self.q = nn.Linear(d, d, rngs=rngs, axes=("embed", "heads"))   # column-parallel under TP
    self.o = nn.Linear(d, d, rngs=rngs, axes=("heads", "embed"))   # row-parallel under TP

and :data:`LOGICAL_AXES` (``batch -> dp, tokens -> sp, heads -> tp, ffn -> tp``) maps them to
mesh axes, for parameters and for activations (a DiT's ``act_spec`` names its activations' axes
the same way: ``("batch", "tokens", None)``); a family lists only its deltas (HunyuanVideo's
``{"mod": "tp"}``), and :func:`axis_rules` restricts the table to the axes a parallelism uses::

    axis_rules("tp", {"mod": "tp"})   # {"batch": "dp", "heads": "tp", "ffn": "tp", "mod": "tp"}

:func:`param_specs` turns a state's logical specs (``nnx.get_partition_spec``) into mesh
``PartitionSpec`` s with that table. Nothing in a model file mentions devices. The same metadata
tells :class:`ParallelContext` which linear layers are row-parallel (their kernel's *input* axis
is sharded: partial sums, one ``psum``, the bias added exactly once after it) and which norms see
a sharded feature dim (sum of squares reduced across the axis).

Everything that has to know about shards runs inside ``jax.shard_map`` (attention kernels the
compiler cannot partition, all_to_all, psum); placement uses ``NamedSharding`` and never
materialises a full array on one device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from vidax.core.attention import attention
from vidax.core.mesh import AXES, ShardingConfigError, axis_sizes

PARALLELISMS = ("none", "tp", "sp", "tp+sp")


def _is_spec(x) -> bool:
    return isinstance(x, P)


# ----------------------------------------------------------------------------------- specs
def tree_paths(tree) -> list[str]:
    """Dotted paths of a pytree's leaves (nested dicts or an ``nnx.State``), in ``jax.tree`` leaf
    order; a Variable's value is named by its own path (``blocks.attn1.q.kernel``)."""
    out = []
    for kp, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)[0]:
        parts = []
        for k in kp:
            if isinstance(k, jax.tree_util.GetAttrKey):
                continue  # a Variable's ``.value``
            parts.append(str(getattr(k, "key", getattr(k, "idx", k))))
        out.append(".".join(parts))
    return out


def param_specs(state, mapping: Mapping[str, str | None]):
    """Mesh ``PartitionSpec`` s of a state's parameters: each Variable's logical axes
    (``nnx.get_partition_spec``) mapped through ``mapping`` (logical -> mesh axis; names not in
    it are replicated). Same tree as ``state`` (abstract or not), a ``PartitionSpec`` per leaf."""

    def one(path, spec):
        mesh_axes = [mapping.get(a) if isinstance(a, str) else None for a in spec]
        used = [m for m in mesh_axes if m is not None]
        if len(used) != len(set(used)):
            raise ShardingConfigError(f"parameter {path}: logical axes {tuple(spec)} use mesh axis twice {mesh_axes}")
        while mesh_axes and mesh_axes[-1] is None:
            mesh_axes.pop()
        return P(*mesh_axes)

    logical_specs = nnx.get_partition_spec(state)
    leaves, treedef = jax.tree.flatten(logical_specs, is_leaf=_is_spec)
    return jax.tree.unflatten(treedef, [one(p, s) for p, s in zip(tree_paths(logical_specs), leaves)])


def named_shardings(mesh: Mesh, specs, memory_kind: str | None = None):
    return jax.tree.map(lambda s: NamedSharding(mesh, s, memory_kind=memory_kind), specs, is_leaf=_is_spec)


def check_param_divisibility(tree, specs, mesh: Mesh) -> None:
    """Every sharded dim must divide by its mesh axis size (error names the parameter)."""
    sizes = axis_sizes(mesh)
    for path, leaf, spec in zip(tree_paths(tree), jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=_is_spec)):
        for d, ax in enumerate(spec):
            for a in (ax,) if isinstance(ax, str) else (ax or ()):
                if leaf.shape[d] % sizes[a]:
                    raise ShardingConfigError(f"parameter {path} dim {d} (size {leaf.shape[d]}) is not divisible by {a}={sizes[a]}")


def place(tree, shardings):
    """Put a host (numpy) tree onto devices with ``shardings``; each device receives only its own
    slice (``make_array_from_callback``), so a large array is never whole on one device. Works
    multi-host when every process holds (or can read) the host tree. A leaf may also be a lazy
    checkpoint tensor (``vidax.weights.LazyTensor``: ``shape`` + ``read(index=...)``): then each
    device's slice is read from the file alone, and the whole tensor is never in host memory. A
    ``jax.ShapeDtypeStruct`` leaf (an abstract state) comes back as one carrying its sharding, so
    a runner built from an abstract state can be lowered and compiled without any weights
    (:mod:`vidax.core.plan`)."""

    def one(x, s):
        if isinstance(x, jax.ShapeDtypeStruct):  # an abstract state (``vidax plan``): placed on paper
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        if isinstance(x, jax.Array):
            return jax.device_put(x, s)
        if callable(getattr(x, "read", None)) and hasattr(x, "shape"):
            return jax.make_array_from_callback(tuple(x.shape), s, lambda idx: x.read(index=idx))
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(one, tree, shardings)


def smap(fn, mesh: Mesh, in_specs, out_specs):
    """``jax.shard_map`` as every runner uses it. ``check_vma=False``: Pallas kernels inside (splash
    attention) produce outputs without varying-manual-axes annotations; the specs alone say how each
    value is laid out."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def shard_split(split, rules: Mapping[str, str | None], mesh):
    """An :class:`vidax.core.nn.Split` (an encoder) with its state placed on ``mesh`` (a Mesh or a
    spec like ``"tp=8"``) by logical-axis ``rules``; its calls then run partitioned by the compiler
    (GSPMD), each device holding only its shard. An abstract state is placed on paper."""
    from vidax.core.mesh import make_mesh

    mesh = make_mesh(mesh)
    specs = param_specs(split.state, rules)
    check_param_divisibility(split.state, specs, mesh)
    return split.replace(state=place(split.state, named_shardings(mesh, specs)))


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
               for l, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=_is_spec)))


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


#: THE logical-axis table, for parameters and activations alike: logical name -> mesh axis. A
#: parameter's axes come from its metadata (``nn.Linear(axes=("embed", "heads"))``), an
#: activation's from its model's ``act_spec(name, shape)`` (a tuple of logical names); names not
#: listed (``embed``, ``layers``, ``None``) stay replicated. A family that shards more (or less)
#: lists only its deltas (``{"mod": "tp"}``; ``None`` removes a name) -- see :func:`axis_rules`.
LOGICAL_AXES = {"batch": "dp", "tokens": "sp", "heads": "tp", "ffn": "tp"}


def axis_rules(parallelism: str = "tp+sp", deltas: Mapping[str, str | None] | None = None, *,
               dims: Mapping[str, int] | None = None, sizes: Mapping[str, int] | None = None) -> dict[str, str]:
    """Logical -> mesh axis under ``parallelism``: :data:`LOGICAL_AXES` with a family's ``deltas``,
    restricted to the mesh axes the parallelism uses (``dp`` always; ``tp`` / ``sp`` when named).
    With ``dims`` (logical name -> its size) and ``sizes`` (mesh axis -> devices): only those names,
    each where its mesh axis has more than one device and divides it (else replicated) -- what the
    text encoders use to shard whatever divides."""
    used = {"dp", *parallelism.split("+")}
    table = {**LOGICAL_AXES, **(deltas or {})}
    out = {k: v for k, v in table.items() if v is not None and v in used}
    if dims is not None:
        sizes = dict(sizes or {})
        out = {k: v for k, v in out.items() if k in dims and sizes.get(v, 1) > 1 and dims[k] % sizes[v] == 0}
    return out


def logical_spec(names, mapping: Mapping[str, str], mesh=None) -> P:
    """A ``PartitionSpec`` from logical names (``("batch", "tokens", None)``) through ``mapping``;
    with ``mesh``, mesh axes of size 1 are dropped (inside ``shard_map`` a named axis makes a value
    "varying" over it even when it has one device)."""
    sizes = axis_sizes(mesh) if mesh is not None else None
    out = []
    for n in names:
        a = mapping.get(n) if isinstance(n, str) else None
        out.append(a if a is not None and (sizes is None or sizes[a] > 1) else None)
    return P(*out)


# ----------------------------------------------------------------------------------- collectives
def row_parallel_linear(layer: nnx.Linear, x, axis: str):
    """``sum_shards(x[..., shard] @ kernel[shard, :]) + bias`` with the bias added exactly once.

    Each device's matmul is a partial sum; ``psum`` over ``axis`` completes it. The bias is
    replicated, so adding it before the sum would add it ``axis_size`` times (invisible while
    biases are zero, a real error with trained ones). Same numerics as ``nnx.Linear``."""
    kernel = layer.kernel[...]
    bias = layer.bias[...] if layer.bias is not None else None
    x, kernel, bias = layer.promote_dtype((x, kernel, bias), dtype=layer.dtype)
    y = layer.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=layer.precision)
    y = jax.lax.psum(y, axis)
    return y if bias is None else y + bias


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
    """What a layer needs to run on its shard inside ``shard_map``; ``ParallelContext()`` (also
    :data:`LOCAL`) is the plain single-device behaviour.

    Decisions come from each parameter's logical axes (its ``out_sharding`` metadata, read from
    the end so a block's slice of a stacked parameter reads the same) mapped through ``mapping``:
    a linear layer whose kernel's input axis is sharded is row-parallel (psum, bias once); one
    whose output axis is sharded is column-parallel (local, no communication); a norm whose
    weight is sharded reduces its statistics across the axis. Self-attention goes through Ulysses
    over ``sp``; cross-attention stays local (its keys are replicated over sp)."""

    mapping: tuple = ()  # ((logical, mesh_axis), ...)
    sizes: tuple = ()  # ((axis, size), ...)
    attn_impl: str | None = None

    @classmethod
    def create(cls, mapping: Mapping[str, str], mesh, *, attn_impl=None) -> "ParallelContext":
        return cls(tuple(sorted(mapping.items())), tuple(sorted(axis_sizes(mesh).items())), attn_impl)

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    def mesh_axis(self, var: nnx.Variable, dim: int) -> str | None:
        """Mesh axis (of size > 1) that dimension ``dim`` (negative: from the end) of ``var`` is
        split over, from its logical axis names."""
        names = var.get_metadata().get("out_sharding") or ()
        if -dim > len(names) or names[dim] is None:
            return None
        ax = dict(self.mapping).get(names[dim])
        return ax if ax is not None and self.size(ax) > 1 else None

    def linear(self, layer: nnx.Linear, x):
        row = self.mesh_axis(layer.kernel, -2)
        return layer(x) if row is None else row_parallel_linear(layer, x, row)

    def feature_sum(self, var: nnx.Variable, s, n: int):
        """``(s, n)`` -> the sum ``s`` over a feature dim and its length ``n``, completed across the
        devices that hold the other features when ``var``'s last axis is split."""
        ax = self.mesh_axis(var, -1)
        if ax is None:
            return s, n
        return jax.lax.psum(s, ax), n * self.size(ax)

    def token_slice(self, table, n: int, axis: int = 0):
        """This shard's ``n`` rows (along ``axis``) of a per-token ``table`` that is whole on every
        device, when the tokens are split over ``sp`` (the whole table otherwise)."""
        if self.size("sp") == 1:
            return table
        return jax.lax.dynamic_slice_in_dim(table, jax.lax.axis_index("sp") * n, n, axis)

    def self_attention(self, q, k, v):
        return ulysses_attention(q, k, v, axis="sp", axis_size=self.size("sp"), impl=self.attn_impl)

    def cross_attention(self, q, k, v):
        return attention(q, k, v, impl=self.attn_impl)


#: the single-device context (no mesh axes)
LOCAL = ParallelContext()


def with_constraint(x, mesh: Mesh, spec: P):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


__all__ = ["AXES", "LOCAL", "LOGICAL_AXES", "PARALLELISMS", "axis_rules", "logical_spec", "ParallelContext", "check_param_divisibility",
           "named_shardings", "param_specs", "per_device_bytes", "place", "resolve_parallelism",
           "row_parallel_linear", "shard_bytes", "tree_bytes", "tree_paths", "ulysses_attention", "with_constraint"]
