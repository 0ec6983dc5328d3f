"""Sharding as metadata: logical axis names on every parameter and activation, ONE table mapping
them to mesh axes; Megatron tensor parallelism and USP sequence parallelism (DeepSpeed-Ulysses x
ring attention, :func:`usp_attention`) as a small context object the model's layers call into
inside ``shard_map``.

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

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from vidax.core.attention import attention, attention_lse, merge_lse
from vidax.core.mesh import AXES, ShardingConfigError, axis_sizes, usp_split

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
                    raise ShardingConfigError(f"parameter {path} dim {d} (size {leaf.shape[d]}) is not divisible by "
                                              f"{a}={sizes[a]}")


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


def activation_axes(name: str, shape: tuple, *, tokens=(), tables=(), kv=(), per_token=(), replicated=(),
                    kv_axis: str = "heads") -> tuple:
    """A DiT's ``act_spec``: the logical axes of activation ``name`` by the role its model lists it
    under. ``tokens`` ([B, L, ...]: batch and tokens split), ``tables`` (RoPE / position tables
    [L, ...]: tokens split), ``kv`` (once-computed cross-attention keys / values [B, L, H, Dh]:
    the heads split as the weights, on ``kv_axis``), ``per_token`` ([B], [B, 1, ...] or per token
    [B, L, ...]), ``replicated`` (whole on every device); any other name is per sample (batch
    split only)."""
    rest = lambda n: (None,) * (len(shape) - n)  # noqa: E731
    if name in tokens:
        return ("batch", "tokens", *rest(2))
    if name in tables:
        return ("tokens", *rest(1))
    if name in kv:
        return ("batch", None, kv_axis, None)
    if name in per_token:
        return ("batch", "tokens" if len(shape) >= 2 and shape[1] > 1 else None, *rest(2))[:len(shape)]
    if name in replicated:
        return rest(0)
    return ("batch", *rest(1))


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


_COMM = contextvars.ContextVar("vidax_sp_comm", default=None)


@contextlib.contextmanager
def count_comm():
    """Bytes one device sends for sequence-parallel attention in the programs traced inside this
    block (``{"all_to_all": ..., "ring": ..., "gather": ...}``, per call of the traced program):
    recorded by :func:`usp_attention` from its local shapes at trace time, times the layers of the
    stack a scan runs it over (:func:`comm_repeat`). What ``vidax plan`` reports as the sampling
    step's communication; an estimate of what the interconnect carries, not a measurement."""
    rec = {"all_to_all": 0, "ring": 0, "gather": 0, "_scale": 1}
    token = _COMM.set(rec)
    try:
        yield rec
    finally:
        _COMM.reset(token)
        rec.pop("_scale", None)


@contextlib.contextmanager
def comm_repeat(n: int):
    """What is traced inside runs ``n`` times per call (a ``lax.scan`` over ``n`` layers)."""
    rec = _COMM.get()
    if rec is None:
        yield
        return
    rec["_scale"] *= int(n)
    try:
        yield
    finally:
        rec["_scale"] //= int(n)


def _record(kind: str, nbytes: float) -> None:
    rec = _COMM.get()
    if rec is not None:
        rec[kind] += int(nbytes) * rec["_scale"]


def _nbytes(*arrays) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays if a is not None)


def ulysses_attention(q, k, v, *, axis: str = "sp", axis_size: int, impl: str | None = None):
    """DeepSpeed-Ulysses self-attention inside ``shard_map`` (``sp`` must divide the heads).

    In: ``[B, L/sp, H, D]`` (this device's tokens, all of its heads). all_to_all -> ``[B, L, H/sp, D]``
    (every token, a slice of the heads), ordinary attention, all_to_all back. :func:`usp_attention`
    is the general form (any head count, padded tokens, joint text tokens)."""
    if axis_size == 1:
        return attention(q, k, v, impl=impl)
    if q.shape[2] % axis_size:
        raise ShardingConfigError(f"Ulysses: {q.shape[2]} local heads are not divisible by {axis}={axis_size}")
    return usp_attention(q, k, v, axis=axis, axis_size=axis_size, ring=1, impl=impl)[0]


def usp_attention(q, k, v, *, axis: str = "sp", axis_size: int, ring: int | None = None, valid=None,
                  impl: str | None = None, extra_q=None, extra_k=None, extra_v=None, extra_mask=None,
                  extra_first: bool = False, bound: bool = True):
    """USP self-attention inside ``shard_map``: Ulysses (heads) x ring (key/value blocks).

    ``q``/``k``/``v``: ``[B, Ll, H, D]``, this device's ``Ll`` tokens of a sequence split over
    ``axis`` (``axis_size`` devices, ``Ll * axis_size`` tokens of which the first ``valid`` are
    real: the rest is padding, masked as keys; None = all real). Optional joint tokens whole on
    every device (a prompt's): ``extra_k``/``extra_v`` ``[B, Le, H, D]`` are keys of every query,
    ``extra_mask`` ``[B, Le]`` their key mask, ``extra_q`` their queries (``extra_first``: the
    reference's order, text before video; it only fixes the order of a single attention call).

    ``sp = ulysses * ring`` (:func:`vidax.core.mesh.usp_split`, ``ring`` None = chosen from the
    heads). Devices ``g*ulysses .. g*ulysses + ulysses-1`` form Ulysses group ``g``: an all_to_all
    inside it gives each the group's contiguous chunk of ``Ll * ulysses`` tokens and ``H /
    ulysses`` heads (the joint tokens are cut to the same heads). With ``ring == 1`` one attention
    call (the backend's fused kernel) runs over every key; else the chunks' keys/values travel the
    ring (``ppermute`` between the groups' same-rank devices) and each step's attention (with its
    log-sum-exp) is merged by the online softmax, the joint keys as one more block. The outputs go
    back by the inverse all_to_all; the joint queries' output is assembled from every head slice
    (ring member 0's, a psum of disjoint slices: exactly the same on every device).

    Returns ``(out [B, Ll, H, D], extra_out [B, Leq, H, D] or None)``."""
    sp = axis_size
    h = q.shape[2]
    u, r = usp_split(sp, h, ring) if sp > 1 else (1, 1)
    groups = None if r == 1 else [[g * u + j for j in range(u)] for g in range(r)]

    def a2a(t, split_axis, concat_axis):
        return jax.lax.all_to_all(t, axis, split_axis=split_axis, concat_axis=concat_axis, tiled=True,
                                  axis_index_groups=groups)

    if u > 1:
        _record("all_to_all", (_nbytes(q, k, v) + _nbytes(q)) * (u - 1) / u)  # q, k, v there, the output (~ q) back
        q, k, v = a2a(q, 2, 1), a2a(k, 2, 1), a2a(v, 2, 1)
    if r > 1:
        _record("ring", (r - 1) * _nbytes(k, v))  # this device's chunk of k and v (its heads), r - 1 hops
    idx = jax.lax.axis_index(axis) if sp > 1 else 0
    ui, ri = idx % u, idx // u
    hu = h // u
    if u > 1 and extra_k is not None:
        def cut(t):
            return None if t is None else jax.lax.dynamic_slice_in_dim(t, ui * hu, hu, axis=2)
        extra_q, extra_k, extra_v = cut(extra_q), cut(extra_k), cut(extra_v)
    b, lc = q.shape[0], q.shape[1]
    lq = 0 if extra_q is None else extra_q.shape[1]
    em = None if extra_mask is None else jnp.asarray(extra_mask, bool)

    def seq_mask(chunk):  # [1, Lc]: the real tokens of ring chunk ``chunk``
        return None if valid is None else ((chunk * lc + jnp.arange(lc)) < valid)[None]

    def cat(seq, extra):
        return seq if extra is None else jnp.concatenate([extra, seq] if extra_first else [seq, extra], axis=1)

    qc = cat(q, extra_q)
    if r == 1:
        kc, vc = cat(k, extra_k), cat(v, extra_v)
        mask = None
        sm = seq_mask(ri)
        if sm is not None or em is not None:
            sm = jnp.ones((b, lc), bool) if sm is None else jnp.broadcast_to(sm, (b, lc))
            if extra_k is not None:
                ek = jnp.ones((b, extra_k.shape[1]), bool) if em is None else jnp.broadcast_to(em, (b, extra_k.shape[1]))
                sm = cat(sm, ek)
            mask = sm[:, None, None, :]
        o = attention(qc, kc, vc, mask=mask, impl=impl)
    else:
        perm = [(g * u + j, ((g + 1) % r) * u + j) for g in range(r) for j in range(u)]
        kb, vb, acc = k, v, None
        for step in range(r):
            part = attention_lse(qc, kb, vb, kmask=seq_mask((ri - step) % r), impl=impl)
            acc = part if acc is None else merge_lse(acc, part)
            if step < r - 1:
                kb, vb = jax.lax.ppermute((kb, vb), axis, perm)
        if extra_k is not None:
            acc = merge_lse(acc, attention_lse(qc, extra_k, extra_v, kmask=em, impl=impl))
        o = acc[0].astype(v.dtype)
    if extra_q is None:
        o_seq, o_extra = o, None
    elif extra_first:
        o_extra, o_seq = o[:, :lq], o[:, lq:]
    else:
        o_seq, o_extra = o[:, :lc], o[:, lc:]
    if u > 1:
        o_seq = a2a(o_seq, 1, 2)
    if o_extra is not None and sp > 1:
        _record("gather", 2 * _nbytes(o_extra) * u * (sp - 1) / sp)  # an all-reduce of the whole joint output
        # this device's heads of the joint queries' output, placed among zeros (ring member 0's
        # only) and summed over the axis: whole and identical on every device
        full = jnp.zeros((*o_extra.shape[:2], h, o_extra.shape[3]), o_extra.dtype)
        mine = jnp.where(ri == 0, o_extra, jnp.zeros_like(o_extra))
        o_extra = jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(full, mine, ui * hu, axis=2), axis)
    elif o_extra is not None and bound:
        o_extra = jax.lax.psum(o_extra, axis)  # typed replicated over the (size-1) axis
    return o_seq, o_extra


@dataclass(frozen=True)
class ParallelContext:
    """What a layer needs to run on its shard inside ``shard_map``; ``ParallelContext()`` (also
    :data:`LOCAL`) is the plain single-device behaviour.

    Decisions come from each parameter's logical axes (its ``out_sharding`` metadata, read from
    the end so a block's slice of a stacked parameter reads the same) mapped through ``mapping``:
    a linear layer whose kernel's input axis is sharded is row-parallel (psum, bias once); one
    whose output axis is sharded is column-parallel (local, no communication); a norm whose
    weight is sharded reduces its statistics across the axis. Self-attention goes through USP
    (Ulysses x ring, :func:`usp_attention`) over ``sp``; cross-attention stays local (its keys are
    replicated over sp). ``ring``: the ring degree asked for (None: chosen per call from the
    heads); ``valid``: the real token count when the runner padded the tokens to a multiple of
    ``sp`` (a Python int, or a traced scalar in an offloaded chunk; None: no padding)."""

    mapping: tuple = ()  # ((logical, mesh_axis), ...)
    sizes: tuple = ()  # ((axis, size), ...)
    attn_impl: str | None = None
    ring: int | None = None
    valid: object = None

    @classmethod
    def create(cls, mapping: Mapping[str, str], mesh, *, attn_impl=None, ring: int | None = None) -> "ParallelContext":
        return cls(tuple(sorted(mapping.items())), tuple(sorted(axis_sizes(mesh).items())), attn_impl, ring)

    def with_valid(self, valid) -> "ParallelContext":
        """This context for a call whose tokens were padded (``valid`` real ones; None: none padded)."""
        return self if valid is None and self.valid is None else replace(self, valid=valid)

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

    def lookup(self, embed: nnx.Embed, ids):
        """Rows ``ids`` of an embedding table that may be split over its vocabulary (Megatron's
        vocab-parallel lookup: each device reads the ids in its own rows, zeros elsewhere, one psum)."""
        ax = self.mesh_axis(embed.embedding, -2)
        if ax is None:
            return embed(ids)
        table = embed.embedding[...]
        n = table.shape[0]
        local = ids - jax.lax.axis_index(ax) * n
        hit = (local >= 0) & (local < n)
        rows = jnp.take(table, jnp.clip(local, 0, n - 1), axis=0)
        return jax.lax.psum(jnp.where(hit[..., None], rows, jnp.zeros((), rows.dtype)), ax)

    def feature_sum(self, var: nnx.Variable, s, n: int):
        """``(s, n)`` -> the sum ``s`` over a feature dim and its length ``n``, completed across the
        devices that hold the other features when ``var``'s last axis is split."""
        ax = self.mesh_axis(var, -1)
        if ax is None:
            return s, n
        return jax.lax.psum(s, ax), n * self.size(ax)

    def token_slice(self, table, n: int, axis: int = 0):
        """This shard's ``n`` rows (along ``axis``) of a per-token ``table`` that is whole on every
        device, when the tokens are split over ``sp`` (the whole table otherwise); a table shorter
        than the padded tokens is padded with zeros first."""
        sp = self.size("sp")
        if sp == 1:
            return table
        if table.shape[axis] < n * sp:
            pad = [(0, 0)] * table.ndim
            pad[axis] = (0, n * sp - table.shape[axis])
            table = jnp.pad(table, pad)
        return jax.lax.dynamic_slice_in_dim(table, jax.lax.axis_index("sp") * n, n, axis)

    def usp(self, heads: int) -> tuple[int, int]:
        """``(ulysses, ring)`` degrees of an attention over ``heads`` local heads."""
        sp = self.size("sp")
        return usp_split(sp, heads, self.ring) if sp > 1 else (1, 1)

    def self_attention(self, q, k, v):
        return self.joint_attention(q, k, v)[0]

    def joint_attention(self, q, k, v, extra_q=None, extra_k=None, extra_v=None, extra_mask=None,
                        extra_first: bool = False):
        """Self-attention over this device's (sp-split) tokens joined with tokens whole on every
        device (a prompt's): :func:`usp_attention`. Returns ``(out, extra_out)``."""
        return usp_attention(q, k, v, axis="sp", axis_size=self.size("sp"), ring=self.ring, valid=self.valid,
                             impl=self.attn_impl, extra_q=extra_q, extra_k=extra_k, extra_v=extra_v,
                             extra_mask=extra_mask, extra_first=extra_first, bound=bool(self.sizes))

    def gather_tokens(self, x):
        """``x`` [B, Ll, ...] split over sp -> ``(every token [B, Ll*sp, ...], key mask [1, Ll*sp]
        or None)``, typed replicated over sp (a psum of each device's slice placed among zeros);
        the mask marks the real tokens when the runner padded them."""
        sp = self.size("sp")
        if sp == 1:
            return x, None
        n = x.shape[1]
        full = jnp.zeros((x.shape[0], n * sp, *x.shape[2:]), x.dtype)
        full = jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(full, x, jax.lax.axis_index("sp") * n, axis=1), "sp")
        return full, None if self.valid is None else (jnp.arange(n * sp) < self.valid)[None]

    def cross_attention(self, q, k, v):
        return attention(q, k, v, impl=self.attn_impl)


#: the single-device context (no mesh axes)
LOCAL = ParallelContext()


def with_constraint(x, mesh: Mesh, spec: P):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def is_spec(x) -> bool:
    """``x`` is a ``PartitionSpec`` (the leaf test of a tree of specs)."""
    return isinstance(x, P)


#: the layout of an array kept whole on every device of a mesh
REPLICATED = P()


def replicated(mesh: Mesh) -> NamedSharding:
    """Whole on every device of ``mesh`` (weights of a per-device program, loop scalars)."""
    return NamedSharding(mesh, REPLICATED)


def leading_split(mesh: Mesh, axis: str) -> NamedSharding:
    """The leading dimension split over mesh axis ``axis``, the rest whole (one slice per device)."""
    return NamedSharding(mesh, P(axis))


__all__ = ["AXES", "LOCAL", "REPLICATED", "is_spec", "leading_split", "replicated", "LOGICAL_AXES", "PARALLELISMS", "axis_rules",
           "logical_spec", "ParallelContext", "check_param_divisibility",
           "named_shardings", "param_specs", "per_device_bytes", "place", "resolve_parallelism",
           "row_parallel_linear", "shard_bytes", "tree_bytes", "tree_paths", "ulysses_attention", "usp_attention",
           "with_constraint", "count_comm", "comm_repeat"]
