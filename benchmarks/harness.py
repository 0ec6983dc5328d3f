"""Paired, interleaved timing: how vidax and a reference compare on a noisy machine.

The machine this project is developed on swings between ~100 and ~220 GFLOP/s from one minute to
the next, so separate runs (best-of, medians of blocks) compare different machines. Here every
comparison is a sequence of *pairs* timed back to back, alternating which side goes first
(A B, B A, A B, ...); each pair gives one ratio, and the result is the median of the per-pair
ratios with its spread (quartiles). The fp32 matmul roof is measured the same way, between the
pairs, so "% of roof" uses the roof of the same minutes.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable


def _once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


@dataclass
class Paired:
    """Result of :func:`paired`: per-pair times and ratios (``a / b``)."""

    a: list[float] = field(default_factory=list)
    b: list[float] = field(default_factory=list)
    roof: list[float] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        return [x / y for x, y in zip(self.a, self.b)]

    def roof_fractions(self, flops: float) -> list[float]:
        """Per pair: ``a``'s achieved FLOP rate over the roof sampled right after that pair."""
        return [flops / t / 1e9 / r for t, r in zip(self.a, self.roof)]

    def summary(self, flops: float | None = None) -> dict:
        """Medians and quartiles; with ``flops`` (of one ``a`` call) also the median of the per-pair
        fractions of the roof, with its quartiles."""
        lo, med, hi = quartiles(self.ratios)
        out = {"pairs": len(self.a), "a_s": statistics.median(self.a), "b_s": statistics.median(self.b),
               "ratio": med, "ratio_q1": lo, "ratio_q3": hi,
               "roof_gflops": statistics.median(self.roof) if self.roof else None}
        if flops and self.roof:
            out["roof_frac_q1"], out["roof_frac"], out["roof_frac_q3"] = quartiles(self.roof_fractions(flops))
        return out


def matmul_roof(n: int = 2048, best_of: int = 3, dtype: str = "float32"):
    """A callable timing the n^3 matmul (``dtype``: fp32 on CPU; an accelerator profile samples
    its compute dtype) ``best_of`` times back to back; returns the best GFLOP/s.
    One call at n=1024 under-reads: its first calls after a pause run at half speed (clock ramp,
    thread pool wake-up) and the achievable rate of the big matmuls in the cases is not reached."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((n, n), jnp.dtype(dtype))
    f = jax.jit(lambda a, b: a @ b)
    f(x, x).block_until_ready()

    def measure() -> float:
        return 2 * n**3 / min(_once(lambda: f(x, x).block_until_ready()) for _ in range(best_of)) / 1e9

    return measure


def paired(a: Callable[[], object], b: Callable[[], object], pairs: int = 7, warmup: int = 1,
           roof: Callable[[], float] | None = None, budget_s: float | None = None) -> Paired:
    """Time ``a`` and ``b`` as ``pairs`` interleaved pairs (alternating order); both callables
    must block until their work is done. ``roof`` (e.g. :func:`matmul_roof`) is sampled once per
    pair. ``budget_s`` stops early (after at least 3 pairs) when the time is spent."""
    for _ in range(warmup):
        a()
        b()
    out = Paired()
    t_start = time.perf_counter()
    for i in range(pairs):
        if i % 2 == 0:
            ta, tb = _once(a), _once(b)
        else:
            tb, ta = _once(b), _once(a)
        out.a.append(ta)
        out.b.append(tb)
        if roof is not None:
            out.roof.append(roof())
        if budget_s is not None and i >= 2 and time.perf_counter() - t_start > budget_s:
            break
    return out


def write_json(path, data) -> None:
    """Write a benchmark's results (``--json``), creating the folder; nothing when ``path`` is empty."""
    import json
    from pathlib import Path

    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def shipped_config(release: str, component: str = "vae", family: str = "ltx") -> dict:
    """The ``config.json`` of ``component`` in a release's configs shipped with vidax
    (``vidax/models/<family>/configs/<release>/``): the released widths, without weights."""
    import json
    from importlib.resources import files

    return json.loads((files("vidax.models") / family / "configs" / release / component / "config.json").read_text())
