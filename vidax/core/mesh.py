"""Device meshes for vidax: one 3-axis mesh ``(dp, tp, sp)`` for every model.

- ``dp``: data parallel -- the batch (classifier-free guidance's 2B batch: conditional and
  unconditional passes on different devices);
- ``tp``: Megatron tensor parallel -- weights split by heads / FFN width;
- ``sp``: sequence parallel -- tokens split; self-attention runs as USP: Ulysses (all_to_all to a
  slice of the heads) inside groups of ``sp / ring`` devices x ring attention (key/value blocks
  passed around ``ring`` groups with an online-softmax merge). ``ring`` is not a mesh axis but a
  factor of ``sp`` (``"sp=8,ring=2"``; :func:`ring_degree`); by default it is chosen per attention
  call from the heads (:func:`usp_split`), so any ``sp`` works whatever the head count.

Axes of size 1 cost nothing, so every model always sees all three names::

    mesh = make_mesh("dp=1,tp=4,sp=2")          # or make_mesh(tp=4, sp=2), or a dict
    check_divisible(constraints, mesh)          # before any compute; names the rule on failure

Multi-host: call :func:`init_distributed` first in every process; ``jax.devices()`` is then the
global device list and :func:`make_mesh` spans all hosts (the same call on every process), except a
mesh small enough for one host's devices, which each process builds on its own devices (it computes
redundantly; no process may run a program on devices it cannot address). :func:`agree`,
:func:`barrier` and :func:`replicate` are what the stages use to act as one job.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("dp", "tp", "sp")


class ShardingConfigError(ValueError):
    """A mesh / parallelism choice that cannot work for this model or input (raised before compute)."""


# ----------------------------------------------------------------------------------- multi-host
def distributed_timeout() -> int:
    """Seconds after which a silent process counts as dead (``VIDAX_DISTRIBUTED_TIMEOUT``, default
    60): the coordination service then fails every process of the job, including those blocked in
    a collective with it."""
    try:
        v = int(float(os.environ.get("VIDAX_DISTRIBUTED_TIMEOUT", "60")))
    except ValueError:
        raise ShardingConfigError(f"VIDAX_DISTRIBUTED_TIMEOUT={os.environ['VIDAX_DISTRIBUTED_TIMEOUT']!r}: "
                                  "expected a number of seconds") from None
    if v < 1:
        raise ShardingConfigError(f"VIDAX_DISTRIBUTED_TIMEOUT={v}: expected at least 1 second")
    return v


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, local_device_ids: Sequence[int] | None = None) -> tuple[int, int]:
    """Join a multi-process (multi-host) JAX job; returns ``(process_index, process_count)``.

    Arguments default to ``VIDAX_COORDINATOR`` / ``VIDAX_NUM_PROCESSES`` / ``VIDAX_PROCESS_ID``.
    With nothing given, or ``VIDAX_NUM_PROCESSES=1``, it does nothing (single host). On Cloud TPU pods and
    SLURM, set ``VIDAX_DISTRIBUTED=auto`` to let ``jax.distributed.initialize()`` detect everything.
    Must run before anything touches a device. Safe to call twice.

    A process that stops answering for :func:`distributed_timeout` seconds fails the whole job
    (JAX's heartbeat); CPU collectives across processes go through gloo (``VIDAX_CPU_COLLECTIVES``
    overrides), so a CPU-only job (tests: ``--xla_force_host_platform_device_count=2`` in each
    process) runs the same sharded programs as a slice."""
    env = os.environ
    coordinator_address = coordinator_address or env.get("VIDAX_COORDINATOR") or None
    if num_processes is None and env.get("VIDAX_NUM_PROCESSES"):
        num_processes = int(env["VIDAX_NUM_PROCESSES"])
    if process_id is None and env.get("VIDAX_PROCESS_ID"):
        process_id = int(env["VIDAX_PROCESS_ID"])
    auto = env.get("VIDAX_DISTRIBUTED", "").lower() == "auto"
    # a job of one process needs no coordinator (a one-host slice under a multi-host job template)
    wanted = auto or (num_processes or 0) > 1 or (coordinator_address is not None and num_processes is None)
    if wanted and not _distributed_initialized():
        if not auto:
            missing = [n for n, v in (("VIDAX_COORDINATOR", coordinator_address), ("VIDAX_NUM_PROCESSES", num_processes),
                                      ("VIDAX_PROCESS_ID", process_id)) if v is None]
            if missing:
                raise ShardingConfigError(f"multi-host job: {', '.join(missing)} not set (give all three, "
                                          "or VIDAX_DISTRIBUTED=auto on a TPU pod / SLURM)")
        collectives = env.get("VIDAX_CPU_COLLECTIVES", "gloo")
        if jax.config.jax_cpu_collectives_implementation in (None, "", "none") or "VIDAX_CPU_COLLECTIVES" in env:
            jax.config.update("jax_cpu_collectives_implementation", collectives)
        timeout = distributed_timeout()
        knobs = dict(heartbeat_timeout_seconds=timeout, shutdown_timeout_seconds=timeout)
        if auto and coordinator_address is None:
            jax.distributed.initialize(**knobs)
        else:
            jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                       process_id=process_id, local_device_ids=local_device_ids, **knobs)
    return jax.process_index(), jax.process_count()


def _distributed_initialized() -> bool:
    probe = getattr(jax.distributed, "is_initialized", None)
    return bool(probe()) if probe is not None else False


def _client():
    from jax._src.distributed import global_state

    return global_state.client if _distributed_initialized() else None


def process_index() -> int:
    """This process's index in the job (0 when none was joined); unlike ``jax.process_index()`` it
    never starts a backend, so it is safe before :func:`init_distributed`."""
    if not _distributed_initialized():
        return 0
    from jax._src.distributed import global_state

    return int(global_state.process_id)


def process_count() -> int:
    """Processes in the job (1 when none was joined); never starts a backend."""
    if not _distributed_initialized():
        return 1
    from jax._src.distributed import global_state

    return int(global_state.num_processes)


def is_leader() -> bool:
    """Process 0: the one that writes stored data, records, manifests and leases."""
    return process_index() == 0


def _wait_ms() -> int:
    """How long a process waits at a barrier for the others (``VIDAX_BARRIER_TIMEOUT`` seconds,
    default 6 h: the leader may wait for another worker's lease). A dead process is caught sooner,
    by the heartbeat (:func:`distributed_timeout`)."""
    return int(float(os.environ.get("VIDAX_BARRIER_TIMEOUT", str(6 * 3600))) * 1000)


_SEQ = {"n": 0}


def _next_key(name: str) -> str:
    # every process makes the same sequence of calls (their decisions are agreed), so the n-th
    # barrier / broadcast has the same key everywhere
    _SEQ["n"] += 1
    return f"vidax/{_SEQ['n']}/{name}"


def barrier(name: str) -> None:
    """Wait until every process of the job reaches this point (no-op in a single process)."""
    client = _client()
    if client is None or process_count() == 1:
        return
    client.wait_at_barrier(_next_key(name).replace("/", "."), _wait_ms())


class RemoteError(RuntimeError):
    """The leader failed while computing a value the other processes were waiting for."""


def agree(name: str, compute):
    """The leader's ``compute()`` (a JSON-able value), handed to every process: one decision for
    all of them (which stage to run, which checkpoint to resume). When ``compute`` raises on the
    leader, every other process raises :class:`RemoteError` with its message."""
    import json

    client = _client()
    if client is None or process_count() == 1:
        return compute()
    key = _next_key(name)
    if is_leader():
        try:
            value = compute()
        except BaseException as e:
            client.key_value_set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        client.key_value_set(key, json.dumps({"value": value}))
        return value
    got = json.loads(client.blocking_key_value_get(key, _wait_ms()))
    if "error" in got:
        raise RemoteError(f"process 0 failed: {got['error']}")
    return got["value"]


def replicate(tree):
    """Every ``jax.Array`` leaf that this process cannot read whole (sharded over other hosts'
    devices) resharded to be fully replicated over its mesh, so ``np.asarray`` works on every
    process. Leaves already readable are returned as they are (a no-op in a single process).
    Every process must call it with the same tree (it runs a collective)."""
    from jax.sharding import NamedSharding, PartitionSpec

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
            return x
        s = x.sharding
        if not isinstance(s, NamedSharding):
            raise ShardingConfigError(f"cannot gather an array with sharding {s!r}; expected a NamedSharding")
        return jax.jit(lambda a: a, out_shardings=NamedSharding(s.mesh, PartitionSpec()))(x)

    return jax.tree.map(one, tree)


# ----------------------------------------------------------------------------------- specs
def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """``"dp=1,tp=4,sp=2"`` (or ``"tp=4"``, or a dict) -> ``{"dp": 1, "tp": 4, "sp": 2}``.

    Missing axes are 1. One axis may be ``-1``: it takes all remaining devices (see :func:`make_mesh`)."""
    if spec is None or spec == "":
        items: dict = {}
    elif isinstance(spec, Mapping):
        items = dict(spec)
    else:
        items = {}
        for part in str(spec).replace(" ", "").split(","):
            if not part:
                continue
            if "=" not in part:
                raise ShardingConfigError(f"mesh spec {spec!r}: expected items like 'tp=4', got {part!r}")
            k, v = part.split("=", 1)
            if k in items:
                raise ShardingConfigError(f"mesh spec {spec!r}: axis {k!r} is given twice")
            try:
                items[k] = int(v)
            except ValueError:
                raise ShardingConfigError(f"mesh spec {spec!r}: size of {k!r} must be an integer, got {v!r}") from None
    unknown = sorted(set(items) - set(AXES) - {"ring"})
    if unknown:
        raise ShardingConfigError(f"mesh spec {spec!r}: unknown axes {unknown}; axes are {', '.join(AXES)} (and ring, "
                                  "a factor of sp)")
    sizes = {a: int(items.get(a, 1)) for a in AXES}
    if "ring" in items:
        ring = int(items["ring"])
        if ring < 1:
            raise ShardingConfigError(f"mesh spec {spec!r}: ring must be >= 1, got {ring}")
        if sizes["sp"] != -1 and sizes["sp"] % ring:
            raise ShardingConfigError(f"mesh spec {spec!r}: ring={ring} does not divide sp={sizes['sp']} (the ring "
                                      f"degree is a factor of sp); valid ring: {_fmt(_divisors(sizes['sp']))}")
    bad = [a for a, v in sizes.items() if v == 0 or v < -1]
    if bad:
        raise ShardingConfigError(f"mesh spec {spec!r}: axis sizes must be >= 1 (or -1 = fill), got {sizes}")
    if sum(v == -1 for v in sizes.values()) > 1:
        raise ShardingConfigError(f"mesh spec {spec!r}: at most one axis may be -1")
    return sizes


def format_mesh_spec(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={int(sizes.get(a, 1))}" for a in AXES)


def ring_degree(spec) -> int | None:
    """The ring degree a mesh spec asks for (``"sp=8,ring=2"`` -> 2), or None (a Mesh, or a spec
    without ``ring``: chosen per attention call by :func:`usp_split`)."""
    if spec is None or isinstance(spec, Mesh):
        return None
    if isinstance(spec, Mapping):
        r = spec.get("ring")
    else:
        parse_mesh_spec(spec)  # validates
        r = next((p.split("=", 1)[1] for p in str(spec).replace(" ", "").split(",") if p.startswith("ring=")), None)
    return None if r is None else int(r)


def usp_split(sp: int, heads: int, ring: int | None = None) -> tuple[int, int]:
    """``(ulysses, ring)`` degrees of sequence parallelism ``sp`` for attention over ``heads`` heads
    (those of one tp shard): ``ring`` given -> ``(sp / ring, ring)``, checked; else the largest
    Ulysses degree dividing both ``sp`` and ``heads`` (all-to-all is cheaper than a ring), the rest
    as ring. ``sp`` of 1 is ``(1, 1)``."""
    if ring is None:
        u = max(d for d in _divisors(sp) if heads % d == 0)
        return u, sp // u
    if ring < 1 or sp % ring:
        raise ShardingConfigError(f"ring={ring} does not divide sp={sp}; valid ring: {_fmt(_divisors(sp))}")
    u = sp // ring
    if heads % u:
        ok = [r for r in _divisors(sp) if heads % (sp // r) == 0]
        raise ShardingConfigError(f"sp={sp},ring={ring}: the Ulysses degree sp/ring={u} does not divide the {heads} "
                                  f"attention heads per tp shard; valid ring: {_fmt(ok)}")
    return u, ring


def make_mesh(spec: str | Mapping[str, int] | Mesh | None = None, *, devices: Sequence | None = None, **sizes) -> Mesh:
    """A ``Mesh`` with axes ``("dp", "tp", "sp")`` over ``devices`` (default: all, every host).

    ``make_mesh("tp=4,sp=2")``, ``make_mesh(tp=4, sp=2)``, ``make_mesh({"dp": 2})``. When the axis
    product is smaller than the device count the first devices are used (handy for tests);
    larger raises :class:`ShardingConfigError` listing what fits."""
    if isinstance(spec, Mesh):
        return ensure_axes(spec)
    if spec is not None and sizes:
        raise TypeError("make_mesh: pass either a spec or axis keywords, not both")
    s = parse_mesh_spec(spec if spec is not None else sizes)
    if devices is None:
        devices = jax.devices()
        if jax.process_count() > 1:
            need = int(np.prod([v for v in s.values() if v != -1]))
            if -1 not in s.values() and need < len(devices) and need <= jax.local_device_count():
                devices = jax.local_devices()  # fits on this host: a per-process mesh
    devices = list(devices)
    n = len(devices)
    if -1 in s.values():
        fill = next(a for a, v in s.items() if v == -1)
        rest = int(np.prod([v for a, v in s.items() if a != fill]))
        if n % rest:
            raise ShardingConfigError(f"mesh {format_mesh_spec(s)}: {n} devices are not divisible by {rest}")
        s[fill] = n // rest
    need = int(np.prod(list(s.values())))
    if need > n:
        raise ShardingConfigError(
            f"mesh {format_mesh_spec(s)} needs {need} devices but {n} are available "
            f"(dp*tp*sp must be <= {n}; divisors of {n}: {_fmt(_divisors(n))})")
    shape = tuple(s[a] for a in AXES)
    if need == n and jax.process_count() > 1:
        # topology-aware device order across hosts
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(shape, devices=devices)
    else:
        arr = np.asarray(devices[:need], dtype=object).reshape(shape)
    return Mesh(arr, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def ensure_axes(mesh: Mesh) -> Mesh:
    """Check that a user-built mesh has exactly the vidax axis names (any order)."""
    if set(mesh.axis_names) != set(AXES):
        raise ShardingConfigError(f"mesh axes {mesh.axis_names} must be exactly {AXES} (sizes may be 1)")
    return mesh


def axis_sizes(mesh: Mesh | Mapping[str, int] | None) -> dict[str, int]:
    if mesh is None:
        return {a: 1 for a in AXES}
    if isinstance(mesh, Mesh):
        return {a: int(mesh.shape.get(a, 1)) for a in AXES}
    return {a: int(mesh.get(a, 1)) for a in AXES}


def single_device_mesh(device=None) -> Mesh:
    return make_mesh({}, devices=[device or jax.local_devices()[0]])


# ----------------------------------------------------------------------------------- divisibility
@dataclass(frozen=True)
class Divisible:
    """Rule: ``value`` (named ``what``) must be divisible by the product of the sizes of ``axes``."""

    what: str
    value: int
    axes: tuple[str, ...]
    why: str = ""


@dataclass(frozen=True)
class UlyssesHeads:
    """Rule: ``value`` heads (named ``what``) split over ``tp``, and the Ulysses part of ``sp``
    (``sp / ring``, when ``ring`` is given) dividing the heads of one tp shard. Without ``ring`` it
    always holds (:func:`usp_split` picks a degree that divides)."""

    what: str
    value: int


@dataclass(frozen=True)
class SpTokens:
    """Rule: ``sp`` at most ``value`` tokens (named ``what``): each sequence-parallel device holds at
    least one real token. Any count runs otherwise (padded to a multiple of ``sp``, masked)."""

    what: str
    value: int
    why: str = "sequence parallel splits them, padded to a multiple of sp"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fmt(xs: Iterable[int]) -> str:
    return ", ".join(str(x) for x in xs)


def valid_sizes(axis: str, rules: Sequence[Divisible], sizes: Mapping[str, int], max_devices: int | None = None) -> list[int]:
    """Sizes of ``axis`` that satisfy every rule with the other axes held at ``sizes``."""
    others = int(np.prod([sizes.get(a, 1) for a in AXES if a != axis]))
    limit = max_devices // others if max_devices else None
    cand = []
    top = limit or max([r.value for r in rules if axis in r.axes] + [1])
    for v in range(1, max(top, 1) + 1):
        trial = {**sizes, axis: v}
        if all(r.value % int(np.prod([trial.get(a, 1) for a in r.axes])) == 0 for r in rules if axis in r.axes):
            cand.append(v)
    return cand


def input_rules(tokens: int | None = None, batch: int | None = None, what: str = "tokens") -> list:
    """The rules of a DiT's inputs on a mesh: ``tokens`` (named ``what``) against sp, the batch
    (2B with CFG) against dp; an argument left None adds none."""
    r = [] if tokens is None else [SpTokens(what, tokens)]
    if batch is not None:
        r.append(Divisible("batch", batch, ("dp",), "the batch (2B with CFG) is split over dp"))
    return r


def check_divisible(rules: Sequence, mesh: Mesh | Mapping[str, int] | str | None, max_devices: int | None = None,
                    ring: int | None = None) -> None:
    """Raise :class:`ShardingConfigError` for the first rule the mesh breaks, naming the rule and
    the valid choices, e.g. ``tp=3 does not divide num_heads=8 (attention heads are split over
    tp); valid tp: 1, 2, 4, 8``. ``mesh`` may be a spec (``"sp=8,ring=2"``: its ring is used when
    ``ring`` is not given); :class:`UlyssesHeads` rules check the ring against the heads."""
    if ring is None:
        ring = ring_degree(mesh) if isinstance(mesh, (str, Mapping)) else None
    if isinstance(mesh, str):
        mesh = parse_mesh_spec(mesh)
    sizes = axis_sizes(mesh)
    if max_devices is None:
        max_devices = len(mesh.devices.flat) if isinstance(mesh, Mesh) else None
        max_devices = max(max_devices or 0, len(jax.devices()))
    heads_rules = [r for r in rules if isinstance(r, UlyssesHeads)]
    for r in rules:
        if isinstance(r, SpTokens) and sizes["sp"] > r.value:
            raise ShardingConfigError(f"sp={sizes['sp']} exceeds the {r.value} {r.what} ({r.why}): every sp device needs at "
                                      f"least one; valid sp: 1 to {r.value} [mesh {format_mesh_spec(sizes)}]")
    rules = [Divisible(r.what, r.value, ("tp",), "attention heads are split over tp") if isinstance(r, UlyssesHeads)
             else r for r in rules if not isinstance(r, SpTokens)]
    for r in rules:
        prod = int(np.prod([sizes[a] for a in r.axes]))
        if r.value % prod == 0:
            continue
        # blame the largest axis of the rule that is > 1 (the one most likely chosen by hand)
        blamed = max((a for a in r.axes if sizes[a] > 1), key=lambda a: sizes[a])
        others = {a: sizes[a] for a in r.axes if a != blamed and sizes[a] > 1}
        lhs = f"{blamed}={sizes[blamed]}" if not others else f"{'*'.join(r.axes)}={'*'.join(str(sizes[a]) for a in r.axes)}"
        valid = valid_sizes(blamed, rules, sizes, max_devices)
        ctx = f" (with {', '.join(f'{a}={v}' for a, v in others.items())})" if others else ""
        why = f" ({r.why})" if r.why else ""
        raise ShardingConfigError(
            f"{lhs} does not divide {r.what}={r.value}{why}; valid {blamed}{ctx}: {_fmt(valid) or 'none'}"
            f" [mesh {format_mesh_spec(sizes)}]")
    for r in heads_rules:
        try:
            usp_split(max(1, sizes["sp"]), r.value // max(1, sizes["tp"]), ring)
        except ShardingConfigError as e:
            raise ShardingConfigError(f"{r.what}={r.value}: {e} [mesh {format_mesh_spec(sizes)},ring={ring}]") from None


__all__ = ["AXES", "Divisible", "ShardingConfigError", "axis_sizes", "check_divisible", "ensure_axes",
           "agree", "barrier", "distributed_timeout", "format_mesh_spec", "init_distributed", "is_leader",
           "make_mesh", "parse_mesh_spec", "process_count", "process_index", "replicate", "ring_degree",
           "single_device_mesh", "SpTokens", "UlyssesHeads", "usp_split", "valid_sizes", "RemoteError"]
