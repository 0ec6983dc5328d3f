"""Device meshes for vidax: one 3-axis mesh ``(dp, tp, sp)`` for every model.

- ``dp``: data parallel -- the batch (classifier-free guidance's 2B batch: conditional and
  unconditional passes on different devices);
- ``tp``: Megatron tensor parallel -- weights split by heads / FFN width;
- ``sp``: DeepSpeed-Ulysses sequence parallel -- tokens split, all_to_all around self-attention.

Axes of size 1 cost nothing, so every model always sees all three names::

    mesh = make_mesh("dp=1,tp=4,sp=2")          # or make_mesh(tp=4, sp=2), or a dict
    check_divisible(constraints, mesh)          # before any compute; names the rule on failure

Multi-host: call :func:`init_distributed` first in every process; ``jax.devices()`` is then the
global device list and :func:`make_mesh` spans all hosts (the same call on every process).
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
def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, local_device_ids: Sequence[int] | None = None) -> tuple[int, int]:
    """Join a multi-process (multi-host) JAX job; returns ``(process_index, process_count)``.

    Arguments default to ``VIDAX_COORDINATOR`` / ``VIDAX_NUM_PROCESSES`` / ``VIDAX_PROCESS_ID``.
    With nothing given and a single process it does nothing (single host). On Cloud TPU pods and
    SLURM, set ``VIDAX_DISTRIBUTED=auto`` to let ``jax.distributed.initialize()`` detect everything.
    Safe to call twice."""
    env = os.environ
    coordinator_address = coordinator_address or env.get("VIDAX_COORDINATOR")
    if num_processes is None and env.get("VIDAX_NUM_PROCESSES"):
        num_processes = int(env["VIDAX_NUM_PROCESSES"])
    if process_id is None and env.get("VIDAX_PROCESS_ID"):
        process_id = int(env["VIDAX_PROCESS_ID"])
    auto = env.get("VIDAX_DISTRIBUTED", "").lower() == "auto"
    wanted = auto or coordinator_address is not None or (num_processes or 1) > 1
    if wanted and not _distributed_initialized():
        if auto and coordinator_address is None:
            jax.distributed.initialize()
        else:
            jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                       process_id=process_id, local_device_ids=local_device_ids)
    return jax.process_index(), jax.process_count()


def _distributed_initialized() -> bool:
    probe = getattr(jax.distributed, "is_initialized", None)
    return bool(probe()) if probe is not None else False


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
    unknown = sorted(set(items) - set(AXES))
    if unknown:
        raise ShardingConfigError(f"mesh spec {spec!r}: unknown axes {unknown}; axes are {', '.join(AXES)}")
    sizes = {a: int(items.get(a, 1)) for a in AXES}
    bad = [a for a, v in sizes.items() if v == 0 or v < -1]
    if bad:
        raise ShardingConfigError(f"mesh spec {spec!r}: axis sizes must be >= 1 (or -1 = fill), got {sizes}")
    if sum(v == -1 for v in sizes.values()) > 1:
        raise ShardingConfigError(f"mesh spec {spec!r}: at most one axis may be -1")
    return sizes


def format_mesh_spec(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={int(sizes.get(a, 1))}" for a in AXES)


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
    devices = list(jax.devices() if devices is None else devices)
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
    return make_mesh({}, devices=[device or jax.devices()[0]])


# ----------------------------------------------------------------------------------- divisibility
@dataclass(frozen=True)
class Divisible:
    """Rule: ``value`` (named ``what``) must be divisible by the product of the sizes of ``axes``."""

    what: str
    value: int
    axes: tuple[str, ...]
    why: str = ""


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


def check_divisible(rules: Sequence[Divisible], mesh: Mesh | Mapping[str, int] | None, max_devices: int | None = None) -> None:
    """Raise :class:`ShardingConfigError` for the first rule the mesh breaks, naming the rule and
    the valid choices, e.g. ``tp=3 does not divide num_heads=8 (attention heads are split over
    tp*sp); valid tp (with sp=1): 1, 2, 4, 8``."""
    sizes = axis_sizes(mesh)
    if max_devices is None:
        max_devices = len(mesh.devices.flat) if isinstance(mesh, Mesh) else None
        max_devices = max(max_devices or 0, len(jax.devices()))
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


__all__ = ["AXES", "Divisible", "ShardingConfigError", "axis_sizes", "check_divisible", "ensure_axes",
           "format_mesh_spec", "init_distributed", "make_mesh", "parse_mesh_spec", "single_device_mesh",
           "valid_sizes"]
