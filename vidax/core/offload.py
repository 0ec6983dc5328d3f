"""Weight offloading: stream a stacked block pytree from host memory, one chunk at a time.

A DiT's blocks are stacked on a leading layer axis (an ``nnx.State`` of the stacked blocks, or
any pytree whose leaves share that axis); the runner cuts that stack into chunks of
``chunk_size`` blocks, keeps every chunk in host memory (``pinned_host`` where the backend has
it, already laid out with the chunk's target sharding, so a transfer is a plain host->device copy
of each device's own shard), and runs them through ONE compiled chunk function::

    runner = OffloadRunner(prefetch=True)
    runner.add_stack("blocks", host_blocks, chunk_fn, chunk_size=2, shardings=chunk_shardings)
    h = runner.run("blocks", h, *consts)          # chunk_fn(chunk_params, h, *consts) -> h

- **jit the unit**: ``chunk_fn`` is jitted once per stack (every chunk has the same signature),
  with the chunk's parameters and the carry donated;
- **prefetch**: chunk ``i+1``'s transfer is issued before chunk ``i``'s compute is dispatched, so
  the two overlap; the loop then waits for chunk ``i`` before issuing ``i+2`` -- at most two
  chunks are ever on a device (one without prefetch, where transfer and compute serialise);
- **pools**: several stacks (e.g. different block types, or MoE experts) each get their own pool
  and compiled chunk function;
- composes with tensor / sequence parallelism: ``shardings`` is the chunk's ``NamedSharding``
  tree (from the parameters' logical axes, :func:`vidax.core.sharding.param_specs`) and
  ``chunk_fn`` may be a ``shard_map``.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from vidax.core.mesh import ShardingConfigError
from vidax.core.runtime import collect_own_garbage


class OffloadConfigError(ShardingConfigError):
    """An offload chunk size that does not fit the stack."""


def valid_chunk_sizes(num_layers: int) -> list[int]:
    return [d for d in range(1, num_layers + 1) if num_layers % d == 0]


def resolve_chunk_size(chunk_size, num_layers: int) -> int:
    """``"all"`` / ``-1`` -> ``num_layers``; any other value must divide ``num_layers`` (so one compiled
    chunk function serves every chunk)."""
    if chunk_size in ("all", -1, None):
        return num_layers
    c = int(chunk_size)
    if c < 1 or num_layers % c:
        valid = ", ".join(map(str, valid_chunk_sizes(num_layers)))
        raise OffloadConfigError(f"offload_chunk_size={chunk_size} does not divide num_layers={num_layers} "
                                 f"(every chunk must have the same shape); valid: {valid}")
    return c


def host_memory_kind(device=None) -> str | None:
    """``"pinned_host"`` where the backend exposes it (TPU, GPU, recent CPU), else None (numpy)."""
    device = device or jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # pragma: no cover - old runtimes
        return None
    return "pinned_host" if "pinned_host" in kinds else None


def _with_memory_kind(s, kind):
    if isinstance(s, NamedSharding):
        return NamedSharding(s.mesh, s.spec, memory_kind=kind)
    if isinstance(s, SingleDeviceSharding):
        return SingleDeviceSharding(next(iter(s.device_set)), memory_kind=kind)
    return s.with_memory_kind(kind)


def array_device_bytes(a) -> dict:
    """Per-device bytes an array occupies in device memory (nothing for host memory kinds)."""
    s = a.sharding
    if getattr(s, "memory_kind", None) not in (None, "device"):
        return {}
    n = int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
    return {d: n for d in s.device_set}


def device_bytes_in_use() -> int:
    """Largest per-device total of live ``jax.Array`` bytes in device memory (portable: counts the
    Python-visible arrays; ``device.memory_stats()`` is used where available by callers)."""
    tot: dict = {}
    for a in jax.live_arrays():
        try:
            if a.is_deleted():
                continue
            for d, n in array_device_bytes(a).items():
                tot[d] = tot.get(d, 0) + n
        except Exception:  # pragma: no cover - arrays being deleted concurrently
            continue
    return max(tot.values(), default=0)


@dataclass
class Pool:
    name: str
    host_chunks: list
    shardings: object  # tree of device shardings for one chunk
    fn: Callable
    chunk_size: int
    num_layers: int
    chunk_bytes: int  # per device, one chunk in device memory
    transfers: int = 0
    runs: int = 0

    @property
    def num_chunks(self) -> int:
        return self.num_layers // self.chunk_size


@dataclass
class OffloadStats:
    """Of the last :meth:`OffloadRunner.run`."""

    peak_resident_chunks: int = 0  # chunk buffers alive at once (by construction)
    peak_device_bytes: int = 0  # measured (track_memory=True): largest per-device live bytes
    baseline_device_bytes: int = 0  # measured before the last run
    samples: list = field(default_factory=list)


class OffloadRunner:
    """Streams stacked parameters from host memory chunk by chunk; see the module docstring.

    ``prefetch``: overlap chunk ``i+1``'s transfer with chunk ``i``'s compute (default on).
    ``host_memory``: ``"auto"`` (pinned_host if available, else numpy), ``"pinned_host"``, ``"numpy"``.
    ``track_memory``: sample live device bytes after every chunk (tests; slows the loop)."""

    def __init__(self, *, prefetch: bool = True, host_memory: str = "auto", donate: bool = True, track_memory: bool = False):
        self.prefetch = prefetch
        self.host_memory = host_memory
        self.donate = donate
        self.track_memory = track_memory
        self.pools: dict[str, Pool] = {}
        self.stats = OffloadStats()

    # ------------------------------------------------------------------ setup
    def add_stack(self, name: str, stacked, chunk_fn: Callable, chunk_size, shardings=None) -> Pool:
        """Register a stack: ``stacked`` is a pytree whose leaves share a leading layer axis (host
        numpy preferred; device arrays are pulled to the host). ``shardings``: a tree (or one
        sharding) for ONE chunk on device, leading axis unsharded; default: the first device."""
        leaves = jax.tree.leaves(stacked)
        if not leaves:
            raise ValueError(f"offload stack {name!r} is empty")
        num_layers = int(leaves[0].shape[0])
        if any(int(l.shape[0]) != num_layers for l in leaves):
            raise ValueError(f"offload stack {name!r}: leaves disagree on the leading (layer) axis")
        c = resolve_chunk_size(chunk_size, num_layers)
        if shardings is None:
            shardings = SingleDeviceSharding(jax.devices()[0])
        if isinstance(shardings, jax.sharding.Sharding):
            shardings = jax.tree.map(lambda _: shardings, stacked)
        kind = self.host_memory
        if kind == "auto":
            dev = next(iter(jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))[0].device_set))
            kind = host_memory_kind(dev) or "numpy"
        host_np = jax.tree.map(np.asarray, stacked)
        chunks = []
        for i in range(num_layers // c):
            chunk = jax.tree.map(lambda a: a[i * c:(i + 1) * c], host_np)
            if kind == "numpy":
                chunks.append(chunk)
            else:
                hs = jax.tree.map(lambda s: _with_memory_kind(s, kind), shardings,
                                  is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
                chunks.append(jax.tree.map(lambda a, s: jax.make_array_from_callback(a.shape, s, lambda idx, a=a: a[idx]), chunk,
                                           hs))
        per_dev = 0
        one = jax.tree.map(lambda a: a[:c], host_np)
        for a, s in zip(jax.tree.leaves(one), jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))):
            per_dev += int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize
        fn = jax.jit(chunk_fn, donate_argnums=(0, 1) if self.donate else ())
        pool = Pool(name, chunks, shardings, fn, c, num_layers, per_dev)
        self.pools[name] = pool
        return pool

    def chunk_shapes(self, name: str):
        """ShapeDtypeStructs (with device shardings) of one chunk -- for ``lower``/``memory_analysis``."""
        p = self.pools[name]
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), p.host_chunks[0], p.shardings)

    def memory_analysis(self, name: str, carry, *consts):
        """Compiled memory analysis of the pool's chunk function (per device)."""
        return self.pools[name].fn.lower(self.chunk_shapes(name), carry, *consts).compile().memory_analysis()

    # ------------------------------------------------------------------ run
    def _put(self, pool: Pool, i: int):
        pool.transfers += 1
        return jax.device_put(pool.host_chunks[i], pool.shardings)

    def _sample(self, resident: int):
        st = self.stats
        st.peak_resident_chunks = max(st.peak_resident_chunks, resident)
        if self.track_memory:
            b = device_bytes_in_use()
            st.samples.append(b)
            st.peak_device_bytes = max(st.peak_device_bytes, b)

    def run(self, name: str, carry, *consts, per_chunk: list | None = None):
        """``carry = chunk_fn(chunk_i, carry, *consts)`` for every chunk of stack ``name``, in order
        (``chunk_fn(chunk_i, carry, *consts, per_chunk[i])`` when ``per_chunk`` is given: e.g. each
        chunk's precomputed text keys / values, from :meth:`map`).

        The caller's ``carry`` is copied once into a committed buffer (the chunk program donates
        its carry, and every call must see the same argument shardings); ``consts`` are shared."""
        pool = self.pools[name]
        extra = (lambda i: ()) if per_chunk is None else (lambda i: (per_chunk[i],))
        pool.runs += 1
        n = pool.num_chunks
        carry = jax.tree.map(lambda a: jax.device_put(a, a.sharding, may_alias=False) if isinstance(a, jax.Array) else a, carry)
        self.stats = OffloadStats()  # per run
        # measuring: earlier work's unreachable arrays are frozen with the rest of the heap (not freed
        # mid-run, which would blur peak - baseline), without a full collection per run
        scope = collect_own_garbage() if self.track_memory else contextlib.nullcontext()
        with scope, warnings.catch_warnings():
            if self.track_memory:
                jax.block_until_ready(carry)
                self.stats.baseline_device_bytes = self.stats.peak_device_bytes = device_bytes_in_use()
            # chunk parameters cannot alias the carry output; donating them still releases them early
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            if self.prefetch and n > 1:
                nxt = self._put(pool, 0)
                for i in range(n):
                    cur = nxt
                    nxt = self._put(pool, i + 1) if i + 1 < n else None  # overlaps compute i
                    carry = pool.fn(cur, carry, *consts, *extra(i))
                    self._sample(2 if nxt is not None else 1)  # cur and nxt both alive here
                    del cur
                    if nxt is not None:
                        # bound the pipeline to two chunks: wait for compute i before issuing i+2
                        jax.block_until_ready(carry)
            else:
                for i in range(n):
                    cur = jax.block_until_ready(self._put(pool, i))
                    carry = pool.fn(cur, carry, *consts, *extra(i))
                    self._sample(1)
                    del cur
                    if i + 1 < n:
                        jax.block_until_ready(carry)
        return carry

    def map(self, name: str, fn: Callable, *args, carry: bool = False) -> list:
        """``[fn(chunk_i, *args) for every chunk]`` of stack ``name``: the chunks streamed as in
        :meth:`run` (the next one's transfer overlapping this one's compute), ``fn`` jitted by the
        caller; what a sample stage computes once from every block (the text keys / values).
        ``carry``: ``fn(chunk_i, a) -> (a, out)`` with one argument ``a`` flowing from chunk to chunk
        (a sequential pass); the list holds the ``out`` s."""
        pool = self.pools[name]
        n, outs = pool.num_chunks, []
        nxt = self._put(pool, 0)
        for i in range(n):
            cur = nxt
            nxt = self._put(pool, i + 1) if i + 1 < n else None
            out = fn(cur, *args)
            if carry:
                args, out = (out[0],), out[1]
            outs.append(out)
            del cur
            if nxt is not None:
                jax.block_until_ready(outs[-1])
        return outs


__all__ = ["OffloadConfigError", "OffloadRunner", "OffloadStats", "Pool", "array_device_bytes", "device_bytes_in_use",
           "host_memory_kind", "resolve_chunk_size", "valid_chunk_sizes"]
