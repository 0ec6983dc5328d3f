"""Exhaustive sweeps, sampled: ``make test`` runs a seeded random part of each sweep (every cut
point, every recipe killed, every mesh x variant), ``make test-all`` runs all of it.

- ``VIDAX_TEST_ALL=1`` (``make test-all``): every item of every sweep.
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
        return "sweeps: all items (VIDAX_TEST_ALL=1)"
    return (f"sweeps: a sample, VIDAX_TEST_SEED={SEED} (the same sample again: VIDAX_TEST_SEED={SEED} make test; "
            "every item: make test-all)")
