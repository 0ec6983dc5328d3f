"""Exhaustive sweeps, sampled: ``make test`` runs a seeded random part of each sweep (every cut
point, every recipe killed, every mesh x variant), ``make test-all`` runs all of it.

- ``VIDAX_TEST_ALL=1`` (``make test-all``): every item of every sweep, compiled at XLA's default
  optimisation level (``make test``: level 0, :data:`XLA_OPT`).
- ``VIDAX_TEST_SEED=N``: which part is sampled. Unset, a fresh seed is drawn once per test session
  (in the controlling process, before pytest-xdist starts its workers, so every worker collects
  the same tests); it is printed at the end of the session, and the same seed reproduces the sample.
  Successive CI runs draw different seeds, so over time they cover every item.
"""
from __future__ import annotations

import os
import random
from collections import defaultdict
from typing import Callable, Hashable, Sequence, TypeVar

T = TypeVar("T")

ALL = os.environ.get("VIDAX_TEST_ALL", "").strip() not in ("", "0", "false")
SEED = int(os.environ.setdefault("VIDAX_TEST_SEED", str(random.SystemRandom().randrange(1_000_000))))

#: ``make test`` compiles at XLA:CPU's backend optimisation level 0: the tiny test programs are
#: compile-bound, and level 0 takes about 40% less CPU time for the same tests (paired, 2026-12-02).
#: ``make test-all`` (``VIDAX_TEST_ALL=1``) keeps XLA's default level, the one users run, so every
#: program is also checked as it is built for them. ``VIDAX_TEST_XLA_OPT=N`` sets the level.
XLA_OPT = os.environ.get("VIDAX_TEST_XLA_OPT", "").strip() or ("" if ALL else "0")
#: ``make test`` also turns XLA:CPU's fusion emitters off (``--xla_cpu_use_fusion_emitters=false``:
#: fused loops are emitted element by element, as before the emitters): about 40% less CPU time for
#: the same tests again (420 s against 695 s of CPU for four test files, paired, 2026-12-02), half the
#: backend compile time of a tiled VAE decode test. ``make test-all`` keeps XLA's default, as users'
#: programs are built; ``VIDAX_TEST_XLA_EMITTERS=1`` keeps it in ``make test``.
EMITTERS = os.environ.get("VIDAX_TEST_XLA_EMITTERS", "").strip() or ("1" if ALL else "0")
EMITTERS_OFF = EMITTERS in ("0", "false")


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a test process with ``devices`` fake CPU devices, at the tier's level."""
    opt = f" --xla_backend_optimization_level={XLA_OPT}" if XLA_OPT else ""
    if EMITTERS_OFF:
        opt += " --xla_cpu_use_fusion_emitters=false"
    return f"--xla_force_host_platform_device_count={devices}{opt}"


def sample(items: Sequence[T], k: int, name: str) -> list[T]:
    """``k`` of ``items`` (all under ``make test-all``), in their order; ``name`` makes each sweep's
    draw its own."""
    items = list(items)
    if ALL or len(items) <= k:
        return items
    keep = set(random.Random(f"{SEED}:{name}").sample(range(len(items)), k))
    return [x for i, x in enumerate(items) if i in keep]


def sample_per_group(items: Sequence[T], group: Callable[[T], Hashable], k: int, name: str) -> list[T]:
    """``k`` items of every group (all under ``make test-all``), in their order."""
    items = list(items)
    groups: dict = defaultdict(list)
    for i, x in enumerate(items):
        groups[group(x)].append(i)
    keep = {i for g, idx in groups.items() for i in sample(idx, k, f"{name}:{g}")}
    return [x for i, x in enumerate(items) if i in keep]


def describe() -> str:
    if ALL:
        return f"sweeps: all items (VIDAX_TEST_ALL=1); {_level()}"
    return (f"sweeps: a sample, VIDAX_TEST_SEED={SEED} (the same sample again: VIDAX_TEST_SEED={SEED} make test; "
            f"every item: make test-all); {_level()}")


def _level() -> str:
    emit = "off" if EMITTERS_OFF else "on"
    return (f"XLA:CPU optimisation level {XLA_OPT or 'default'} (VIDAX_TEST_XLA_OPT), fusion emitters {emit} "
            "(VIDAX_TEST_XLA_EMITTERS)")
