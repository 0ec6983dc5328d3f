"""Step caching: fewer DiT evaluations per video, decided on the host between jitted units.

The shared block loop (:class:`vidax.core.runner.DiTRunner`) runs a cached forward as a few
programs -- embed (+ the first block), the remaining blocks, the cached-residual shortcut, the
head -- and asks a :class:`StepCache` between them whether the remaining blocks run:

- ``fbcache`` (First Block Cache, diffusers' ``FirstBlockCacheConfig``): the first block always
  runs; its residual (output - input of the hidden states) is compared with the one of the last
  computed step, ``mean|r - r_prev| / mean|r_prev|``; at or below the threshold the remaining
  blocks are skipped and their cached residual is added to the first block's output.
- ``magcache`` (MagCache, diffusers' ``MagCacheConfig``): from precalibrated per-step magnitude
  ratios of the residual, the accumulated ratio and error since the last computed step decide,
  before any block runs, whether the whole block stack is replaced by the input plus the last
  residual; at most ``max_skips`` steps in a row, and the first ``retention`` fraction of the
  steps always computed.
- ``taylorseer`` (TaylorSeer, diffusers' ``TaylorSeerCacheConfig`` with every block hooked): a
  fixed schedule -- every step before ``warmup``, then every ``interval``-th step -- runs the
  blocks; the steps between skip them and take the features after the last block from a Taylor
  series (order ``order``, divided differences over the computed steps, float32) around the last
  computed step; the head runs every step.
- ``teacache`` (TeaCache, Liu et al., arXiv:2411.19108): the relative L1 change of the model's
  timestep-modulated input (``TEACACHE_INPUT``, e.g. Wan's ``temb6``; or the model's
  ``teacache_input(first_block, carry, consts, par)``, e.g. HunyuanVideo's first double block's
  normalised, modulated video tokens) since the previous call,
  rescaled by the model's published polynomial and accumulated; while the sum stays below the
  threshold the whole block stack is replaced by the input plus the last residual (the first
  ``warmup`` steps always computed: the authors' Wan2.1 "retention" mode).

State is per CFG branch (the rows of a ``[cond; uncond]`` batch, ``branches`` groups) and per
expert (a new expert starts empty), and is saved with every sampling step checkpoint
(:meth:`StepCache.arrays` / :meth:`StepCache.load`), so a resumed run takes the same decisions.
Decisions come from values every process computes alike (replicated scalars), so every device and
host of a mesh takes the same one.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

METHODS = ("none", "fbcache", "taylorseer", "magcache", "teacache")
IMPLEMENTED = ("fbcache", "magcache", "taylorseer", "teacache")
#: defaults per method (diffusers' config defaults)
DEFAULT_THRESHOLD = {"fbcache": 0.05, "magcache": 0.06, "teacache": 0.1, "taylorseer": 0.0}


class CacheError(ValueError):
    """Bad cache settings. ``field`` names the request field."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


@dataclass(frozen=True)
class CacheSettings:
    """A request's step-cache settings, validated (see :func:`settings`)."""
    method: str
    threshold: float
    max_skips: int = 3            # magcache: at most this many skipped steps in a row (K)
    retention: float = 0.2        # magcache: this fraction of the first steps is always computed
    ratios: tuple = field(default=())  # magcache: per-step magnitude ratios, a tuple per CFG branch (or one for all)
    interval: int = 5             # taylorseer: a computed step every this many steps (diffusers' cache_interval)
    warmup: int = 3               # taylorseer: steps always computed first (disable_cache_before_step); teacache: 5
    order: int = 1                # taylorseer: the Taylor series' order (max_order)
    coefficients: tuple = field(default=())  # teacache: the rescaling polynomial, highest power first
    final: bool = False           # teacache: the last step always computed too (the authors' HunyuanVideo rule)

    def key(self) -> dict:
        """What enters the sample stage's key."""
        d = {"method": self.method, "threshold": self.threshold}
        if self.method == "magcache":
            d.update(max_skips=self.max_skips, retention=self.retention, ratios=[list(r) for r in self.ratios])
        elif self.method == "taylorseer":
            d = {"method": self.method, "interval": self.interval, "warmup": self.warmup, "order": self.order}
        elif self.method == "teacache":
            d.update(warmup=self.warmup, coefficients=list(self.coefficients))
            if self.final:
                d["final"] = True
        return d


def _number(name, v, lo=None, hi=None, integer=False):
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or (not integer and not math.isfinite(v)):
        raise CacheError(name, f"{v!r}: must be {'an integer' if integer else 'a finite number'}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise CacheError(name, f"{v!r}: must be {rng}")
    return int(v) if integer else float(v)


def read_ratios(value) -> tuple:
    """MagCache ratios as a tuple per CFG branch: a list of numbers (every branch), a list of lists
    (one per branch: conditional, unconditional), or the path / URL of a JSON file holding either
    (or an object with ``"per_branch"`` / ``"ratios"``, as ``vidax calibrate`` writes)."""
    if isinstance(value, str):
        import fsspec

        try:
            with fsspec.open(value, "rt") as f:
                value = json.load(f)
        except FileNotFoundError:
            raise CacheError("cache_ratios", f"{value}: no such file") from None
        except (OSError, ValueError) as e:
            raise CacheError("cache_ratios", f"{value}: not a JSON list of ratios ({type(e).__name__}: {e})") from None
        if isinstance(value, dict):
            value = value.get("per_branch") or value.get("ratios")
    lists = value if isinstance(value, (list, tuple)) and value and all(
        isinstance(v, (list, tuple)) for v in value) else [value]

    def ok(v):
        return (isinstance(v, (list, tuple)) and len(v) >= 2 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v))

    if not all(ok(v) for v in lists) or len(lists) > 2:
        raise CacheError("cache_ratios", "must be a list of at least 2 positive numbers, or one such list per CFG "
                                         "branch (or a JSON file of either)")
    return tuple(tuple(float(x) for x in v) for v in lists)


def settings(method, threshold=None, *, max_skips=None, retention=None, ratios=None, model: str = "",
             published=None, interval=None, warmup=None, order=None, coefficients=None) -> CacheSettings | None:
    """Validated settings (None for no cache). ``published``: the model's published MagCache ratios
    (used when ``ratios`` is not given); ``coefficients``: its published TeaCache polynomial (a list,
    or ``{"coefficients": [...], "warmup": N, "final": bool}``: the authors' schedule for that model)."""
    if method in (None, "none"):
        for name, v in (("cache_threshold", threshold), ("cache_max_skips", max_skips),
                        ("cache_retention", retention), ("cache_ratios", ratios), ("cache_interval", interval),
                        ("cache_warmup", warmup), ("cache_order", order)):
            if v is not None:
                raise CacheError(name, "needs a cache method (--cache fbcache|magcache|...)")
        return None
    if method not in METHODS:
        raise CacheError("cache", f"{method!r}: choose one of {', '.join(METHODS)}")
    if method not in IMPLEMENTED:
        raise CacheError("cache", f"{method!r} is not implemented yet; available: none, {', '.join(IMPLEMENTED)}")
    if method == "taylorseer" and threshold is not None:
        raise CacheError("cache_threshold", "taylorseer runs a fixed schedule: give --cache-interval / "
                                            "--cache-warmup / --cache-order, not a threshold")
    thr = DEFAULT_THRESHOLD[method] if threshold is None else _number("cache_threshold", threshold, 0.0)
    if method != "magcache":
        for name, v in (("cache_max_skips", max_skips), ("cache_retention", retention), ("cache_ratios", ratios)):
            if v is not None:
                raise CacheError(name, f"is a magcache setting; not one of --cache {method}")
    if method not in ("taylorseer", "teacache"):
        for name, v in (("cache_interval", interval), ("cache_warmup", warmup), ("cache_order", order)):
            if v is not None:
                raise CacheError(name, f"is a taylorseer{'' if name != 'cache_warmup' else ' / teacache'} setting; "
                                       f"not one of --cache {method}")
    if method == "fbcache":
        return CacheSettings(method, thr)
    if method == "taylorseer":
        return CacheSettings(method, 0.0,
                             interval=5 if interval is None else _number("cache_interval", interval, 1, integer=True),
                             warmup=3 if warmup is None else _number("cache_warmup", warmup, 0, integer=True),
                             order=1 if order is None else _number("cache_order", order, 0, 4, integer=True))
    if method == "teacache":
        for name, v in (("cache_interval", interval), ("cache_order", order)):
            if v is not None:
                raise CacheError(name, "is a taylorseer setting; not one of --cache teacache")
        spec = coefficients if isinstance(coefficients, dict) else {"coefficients": coefficients}
        if not spec.get("coefficients"):
            raise CacheError("cache", f"{model or 'this model'} has no published TeaCache coefficients "
                                      f"(teacache runs on: Wan2.1 T2V 1.3B / 14B, I2V 480p / 720p, HunyuanVideo T2V)")
        w = spec.get("warmup", 5) if warmup is None else _number("cache_warmup", warmup, 0, integer=True)
        return CacheSettings(method, thr, warmup=w, coefficients=tuple(float(c) for c in spec["coefficients"]),
                             final=bool(spec.get("final", False)))
    k = 3 if max_skips is None else _number("cache_max_skips", max_skips, 0, integer=True)
    ret = 0.2 if retention is None else _number("cache_retention", retention, 0.0, 1.0)
    if ratios is None:
        if not published:
            raise CacheError("cache_ratios", f"{model or 'this model'} has no published MagCache ratios: give "
                                             f"--cache-ratios FILE (measure them with vidax calibrate)")
        r = read_ratios(list(published))
    else:
        r = read_ratios(ratios)
    return CacheSettings(method, thr, k, ret, r)


def interp_ratios(ratios, steps: int) -> np.ndarray:
    """Nearest-neighbour resampling of calibrated ratios to ``steps`` (diffusers' ``nearest_interp``)."""
    r = np.asarray(ratios, np.float32)
    if len(r) == steps:
        return r
    if steps == 1:
        return r[-1:]
    scale = np.float32((len(r) - 1) / (steps - 1))
    idx = np.round(np.arange(steps, dtype=np.float32) * scale).astype(np.int64)
    return r[idx]


# ------------------------------------------------------------------ device helpers (tiny programs)
@partial(jax.jit, static_argnums=2)
def _rel_change(r, prev, groups: int):
    """Per group of batch rows: ``mean|r - prev| / mean|prev|`` in float32."""
    d = jnp.abs(r.astype(jnp.float32) - prev.astype(jnp.float32)).reshape(groups, -1).mean(axis=1)
    p = jnp.abs(prev.astype(jnp.float32)).reshape(groups, -1).mean(axis=1)
    return d / p


@partial(jax.jit, static_argnums=2)
def _norm_ratio(cur, prev, groups: int):
    """Per group: ``mean(|cur|_token / (|prev|_token + 1e-8))`` (MagCache's calibration ratio)."""
    c = jnp.linalg.norm(cur.astype(jnp.float32), axis=-1).reshape(groups, -1)
    p = jnp.linalg.norm(prev.astype(jnp.float32), axis=-1).reshape(groups, -1)
    return (c / (p + 1e-8)).mean(axis=1)


class StepCache:
    """Host-side cache state and decisions for one sample stage (see the module docstring).
    ``steps``: the schedule's length (MagCache's step index runs per branch). ``calibrate``: a
    MagCache run that never skips and records the ratios (:attr:`ratios_measured`)."""

    def __init__(self, cfg: CacheSettings, steps: int, calibrate: bool = False):
        self.cfg, self.steps, self.calibrate = cfg, int(steps), calibrate
        self.method = "magcache" if calibrate else cfg.method
        self.computed = self.skipped = 0
        self.expert = None
        self.branches = 1
        self.changes: list = []  # fbcache: per DiT call with a cache, the relative change per branch
        self.decisions: list = []  # per DiT call: which branches were computed (this process's calls)
        self._mag = ([interp_ratios(r, self.steps) for r in cfg.ratios]
                     if self.method == "magcache" and not calibrate else None)
        self._reset()

    # ---------------------------------------------------------------- state
    def _reset(self):
        g = self.branches
        self.calls = np.zeros(g, np.int64)
        self.has = np.zeros(g, bool)
        self.acc_ratio = np.ones(g, np.float64)
        self.acc_err = np.zeros(g, np.float64)
        self.acc_steps = np.zeros(g, np.int64)
        self.prev = None   # fbcache: the first block's residual of the last computed step (hidden states)
        self.tail = None   # the blocks' residual (a carry tree) of the last computed step
        self.mod_prev = None  # teacache: the modulated input of the previous call
        self.taylor = ()   # taylorseer: the Taylor factors (carry trees, float32), order 0 first
        self.ts_last = np.full(g, -1, np.int64)  # taylorseer: the step of the last update (-1: none)
        self.calib = [[] for _ in range(g)]
        self.cal_prev = None

    def begin(self, expert: int = 1, branches: int = 1, start: int = 0) -> None:
        """Before an expert's steps ``start..``: a new expert (or CFG layout) starts from an empty
        cache, its step counter at ``start`` (MagCache's ratios are indexed by the schedule's step)."""
        if expert != self.expert or branches != self.branches:
            self.expert, self.branches = expert, int(branches)
            self._reset()
            self.calls[:] = start

    @property
    def ratios_measured(self) -> list:
        """Calibration: the ratios measured per step (the first branch, the conditional one)."""
        return list(self.calib[0]) if self.calib else []

    @property
    def evaluations(self) -> dict:
        """DiT evaluations so far, per CFG branch: ``{"computed": N, "skipped": M}``."""
        return {"computed": int(self.computed), "skipped": int(self.skipped)}

    def arrays(self) -> dict:
        """The state as host arrays (for a sampling step checkpoint)."""
        out = {"stepcache.meta": np.asarray([-1 if self.expert is None else self.expert, self.branches,
                                              self.computed, self.skipped], np.int64),
               "stepcache.calls": self.calls, "stepcache.has": self.has.astype(np.int64),
               "stepcache.acc_ratio": self.acc_ratio, "stepcache.acc_err": self.acc_err,
               "stepcache.acc_steps": self.acc_steps}
        if self.prev is not None:
            out["stepcache.prev"] = np.asarray(self.prev)
        if self.tail is not None:
            for k, v in self.tail.items():
                out[f"stepcache.tail.{k}"] = np.asarray(v)
        if self.mod_prev is not None:
            out["stepcache.mod_prev"] = np.asarray(self.mod_prev)
        out["stepcache.ts_last"] = self.ts_last
        for j, tree in enumerate(self.taylor):
            for k, v in tree.items():
                out[f"stepcache.taylor.{j}.{k}"] = np.asarray(v)
        return out

    def load(self, arrays: dict) -> dict:
        """Restore from :meth:`arrays`' output; returns ``arrays`` without the cache's entries."""
        mine = {k: v for k, v in arrays.items() if k.startswith("stepcache.")}
        rest = {k: v for k, v in arrays.items() if not k.startswith("stepcache.")}
        if not mine:
            return rest
        e, b, c, s = (int(x) for x in np.asarray(mine["stepcache.meta"]).reshape(-1))
        self.expert, self.branches = (None if e < 0 else e), b
        self._reset()
        self.computed, self.skipped = c, s
        self.calls = np.asarray(mine["stepcache.calls"]).astype(np.int64)
        self.has = np.asarray(mine["stepcache.has"]).astype(bool)
        self.acc_ratio = np.asarray(mine["stepcache.acc_ratio"]).astype(np.float64)
        self.acc_err = np.asarray(mine["stepcache.acc_err"]).astype(np.float64)
        self.acc_steps = np.asarray(mine["stepcache.acc_steps"]).astype(np.int64)
        self.prev = mine.get("stepcache.prev")
        tail = {k[len("stepcache.tail."):]: v for k, v in mine.items() if k.startswith("stepcache.tail.")}
        self.tail = tail or None
        self.mod_prev = mine.get("stepcache.mod_prev")
        if "stepcache.ts_last" in mine:
            self.ts_last = np.asarray(mine["stepcache.ts_last"]).astype(np.int64)
        taylor: dict = {}
        for k, v in mine.items():
            if k.startswith("stepcache.taylor."):
                j, name = k[len("stepcache.taylor."):].split(".", 1)
                taylor.setdefault(int(j), {})[name] = v
        self.taylor = tuple(taylor[j] for j in sorted(taylor))
        return rest

    # ---------------------------------------------------------------- decisions
    def decide_first_block(self, r) -> np.ndarray:
        """fbcache: per branch, whether the remaining blocks run, from the first block's residual ``r``
        (computed when ``mean|r - r_prev| / mean|r_prev| > threshold``, or nothing is cached yet)."""
        if self.prev is None:
            return np.ones(self.branches, bool)
        diff = np.asarray(_rel_change(r, self.prev, self.branches), np.float64)
        self.changes.append(diff)
        return ~self.has | (diff > self.cfg.threshold)

    def decide_magnitude(self) -> np.ndarray:
        """magcache: per branch, whether the blocks run this step (before any block runs);
        advances the accumulators as diffusers' ``MagCacheHeadHook`` does."""
        g = self.branches
        compute = np.ones(g, bool)
        if self.calibrate:
            return compute
        keep = int(self.cfg.retention * self.steps + 0.5)
        for j in range(g):
            i = int(self.calls[j])
            if i < keep:
                continue
            mag = self._mag[min(j, len(self._mag) - 1)]  # this branch's ratios (or the shared ones)
            scale = float(mag[i]) if i < len(mag) else 1.0
            self.acc_ratio[j] *= scale
            self.acc_steps[j] += 1
            self.acc_err[j] += abs(1.0 - self.acc_ratio[j])
            if self.has[j] and self.acc_err[j] <= self.cfg.threshold and self.acc_steps[j] <= self.cfg.max_skips:
                compute[j] = False
            else:
                self.acc_ratio[j], self.acc_steps[j], self.acc_err[j] = 1.0, 0, 0.0
        return compute

    def decide_schedule(self) -> np.ndarray:
        """taylorseer: per branch, whether the blocks run this step (diffusers' ``TaylorSeerCacheHook``
        schedule: every step before ``warmup``, then every ``interval``-th one from ``warmup + 1``)."""
        c = self.cfg
        i = self.calls
        return (i < c.warmup) | ((i - c.warmup - 1) % c.interval == 0) | (self.ts_last < 0)

    def taylor_update(self, feats: dict) -> None:
        """taylorseer, after a computed step: the new Taylor factors from the features ``feats``."""
        step = int(self.calls[0])
        delta = step - int(self.ts_last[0]) if self.ts_last[0] >= 0 else 0
        self.taylor = _taylor_update(feats, self.taylor if delta else (), np.float32(max(delta, 1)), self.cfg.order)
        self.ts_last[:] = self.calls

    def taylor_predict(self) -> dict:
        """taylorseer, a skipped step: the features extrapolated from the last computed step."""
        off = int(self.calls[0] - self.ts_last[0])
        coeffs = tuple(np.float32(off ** j / math.factorial(j)) for j in range(len(self.taylor)))
        return _taylor_predict(self.taylor, coeffs)

    def decide_modulated(self, m) -> np.ndarray:
        """teacache: per branch, whether the blocks run, from the modulated input ``m`` of this call
        (its relative L1 change since the previous call, rescaled by the polynomial, accumulated;
        computed at or over the threshold, in the first ``warmup`` steps, and with ``final`` at the last)."""
        g = self.branches
        rel = None if self.mod_prev is None else np.asarray(_rel_change(m, self.mod_prev, g), np.float64)
        self.mod_prev = m
        if rel is not None:
            self.changes.append(rel)
        poly = np.poly1d(self.cfg.coefficients)
        compute = np.ones(g, bool)
        for j in range(g):
            last = self.cfg.final and self.calls[j] >= self.steps - 1
            if self.calls[j] < self.cfg.warmup or last or rel is None or not self.has[j]:
                self.acc_err[j] = 0.0
                continue
            self.acc_err[j] += float(poly(rel[j]))
            if self.acc_err[j] < self.cfg.threshold:
                compute[j] = False
            else:
                self.acc_err[j] = 0.0
        return compute

    def record(self, compute: np.ndarray, prev=None, tail=None, residual=None) -> None:
        """After a forward: count it, keep the new residuals of the computed branches (``prev``,
        ``tail``: already merged per row by the runner), advance the per-branch step counters."""
        compute = np.asarray(compute, bool)
        self.decisions.append(compute.copy())
        self.computed += int(compute.sum())
        self.skipped += int((~compute).sum())
        if self.calibrate and residual is not None:  # MagCache's calibration formula, per branch
            if self.cal_prev is None:
                ratios = np.ones(self.branches)
            else:
                ratios = np.asarray(_norm_ratio(residual, self.cal_prev, self.branches), np.float64)
            for j in range(self.branches):
                self.calib[j].append(float(ratios[j]))
            self.cal_prev = residual
        if prev is not None:
            self.prev = prev
        if tail is not None:
            self.tail = tail
        self.has |= compute
        self.calls += 1
        if self.method == "magcache":  # diffusers resets a context after its last step
            done = self.calls >= self.steps
            if done.any():
                self.calls[done] = 0
                self.acc_ratio[done], self.acc_steps[done], self.acc_err[done] = 1.0, 0, 0.0
                self.has[done] = False
                if done.all():
                    self.tail = None



@partial(jax.jit, static_argnums=3)
def _taylor_update(feats: dict, prev: tuple, delta, order: int) -> tuple:
    """Factors ``(f, df, d2f, ...)``: ``feats`` (float32) and the divided differences against the
    previous factors over ``delta`` steps, up to ``order`` (as many as the previous factors allow)."""
    new = [{k: v.astype(jnp.float32) for k, v in feats.items()}]
    for j in range(min(order, len(prev))):
        new.append({k: (new[j][k] - prev[j][k]) / delta for k in feats})
    return tuple(new)


@jax.jit
def _taylor_predict(factors: tuple, coeffs: tuple) -> dict:
    """``sum_j factors[j] * coeffs[j]`` (``coeffs[j] = offset^j / j!``), in float32."""
    out = {}
    for k, f0 in factors[0].items():
        acc = jnp.zeros_like(f0)
        for f, c in zip(factors, coeffs):
            acc = acc + f[k] * c
        out[k] = acc
    return out


def rows_mask(compute: np.ndarray, batch: int) -> np.ndarray:
    """Per batch row (``branches`` equal groups of rows), whether it is computed."""
    g = len(compute)
    if batch % g:
        raise ValueError(f"step cache: a batch of {batch} rows is not {g} equal CFG branches")
    return np.repeat(np.asarray(compute, bool), batch // g)


__all__ = ["CacheSettings", "CacheError", "StepCache", "METHODS", "IMPLEMENTED", "settings", "interp_ratios",
           "read_ratios", "rows_mask"]
