"""Flow-matching Euler sampler (deterministic and stochastic), plus the shared scheduler base.

Matches diffusers' ``FlowMatchEulerDiscreteScheduler`` (``set_timesteps`` schedule and ``step``)
for flow-prediction models: the model predicts the velocity ``v = noise - x0`` and the sample at
noise level ``sigma`` is ``x = (1 - sigma) * x0 + sigma * noise``.

Every scheduler here is built on the host from a config and a step count, exposes the host arrays
``timesteps`` [N] (what the model receives) and ``sigmas`` [N + 1], and has a *pure* ``step`` that
takes the step index as a (traceable) int32 scalar, so one jitted step serves every step.
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

# Keys diffusers writes into every saved config; never meaningful for sampling.
_META_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "_use_default_values"}


class Scheduler:
    """Common surface of the vidax schedulers.

    Attributes: ``name``, ``config`` (resolved, diffusers key names), ``num_inference_steps``,
    ``timesteps`` (np.float32 [N]), ``sigmas`` (np.float32 [N + 1]), ``begin_index``, ``order``
    (always 1: one model call per step, as diffusers' ``scheduler.order``), ``needs_noise``.
    """

    name = "scheduler"
    order = 1
    needs_noise = False
    # diffusers key -> default value (the keys this class understands)
    _DEFAULTS: dict[str, Any] = {}
    # known diffusers keys that play no part in flow-prediction sampling
    _IGNORED: set[str] = set()

    timesteps: np.ndarray
    sigmas: np.ndarray
    num_inference_steps: int
    begin_index: int = 0

    # ------------------------------------------------------------------ config handling
    @classmethod
    def _resolve_config(cls, config: dict) -> dict:
        resolved = dict(cls._DEFAULTS)
        unknown = []
        for k, v in config.items():
            if k in _META_KEYS or k in cls._IGNORED:
                continue
            if k in cls._DEFAULTS:
                resolved[k] = v
            else:
                unknown.append(k)
        if unknown:
            warnings.warn(
                f"{cls.__name__}: ignoring config keys it does not know: {sorted(unknown)}",
                stacklevel=3,
            )
        return resolved

    # ------------------------------------------------------------------ per-step lookups
    def sigma_at(self, step_index):
        """sigma of step ``step_index`` (traceable)."""
        return jnp.asarray(self.sigmas)[step_index]

    def timestep_at(self, step_index):
        """The model's timestep input at step ``step_index`` (traceable), float32."""
        return jnp.asarray(self.timesteps)[step_index]

    # ------------------------------------------------------------------ noising
    def add_noise(self, original_samples, noise, step_index):
        """Forward process at step ``step_index``: ``(1 - sigma) * x0 + sigma * noise``.

        Same as diffusers' flow-match ``scale_noise`` / flow-sigma UniPC ``add_noise`` with the
        sigma of the given step (``step_index`` may be traced). Computed in float32, returned in
        the dtype of ``original_samples``."""
        sigma = self.sigma_at(step_index).astype(jnp.float32)
        x0 = jnp.asarray(original_samples)
        out = (1.0 - sigma) * x0.astype(jnp.float32) + sigma * jnp.asarray(noise).astype(jnp.float32)
        return out.astype(x0.dtype)

    def scale_noise(self, sample, noise, step_index):
        """Alias of :meth:`add_noise` (diffusers' flow-match naming; note the argument order here)."""
        return self.add_noise(sample, noise, step_index)

    # ------------------------------------------------------------------ stepping
    def init_state(self, sample) -> dict:
        return {}

    def step(self, state, model_output, step_index, sample, noise=None):
        raise NotImplementedError

    def __repr__(self):
        return f"<vidax {type(self).__name__} {self.name} steps={self.num_inference_steps}>"


# ---------------------------------------------------------------------- schedule helpers
def _check_choice(key: str, value, choices):
    if value not in choices:
        raise ValueError(f"unsupported {key}={value!r}; expected one of {sorted(map(repr, choices))}")


def time_shift(kind: str, mu: float, t: np.ndarray) -> np.ndarray:
    """Resolution-dependent shift of a sigma schedule (diffusers' ``time_shift`` with sigma=1)."""
    t = np.asarray(t)
    with np.errstate(divide="ignore"):
        r = 1.0 / t - 1.0
    if kind == "exponential":
        e = math.exp(mu)
        return e / (e + r)
    if kind == "linear":
        return mu / (mu + r)
    raise ValueError(f"unsupported time_shift_type={kind!r}; expected 'exponential' or 'linear'")


def static_shift(shift: float, s):
    """sigma -> shift * sigma / (1 + (shift - 1) * sigma)."""
    return shift * s / (1 + (shift - 1) * s)


def stretch_to_terminal(s: np.ndarray, terminal: float) -> np.ndarray:
    """Rescale ``1 - s`` so that the last sigma lands exactly on ``terminal``."""
    one_minus = 1 - s
    scale = one_minus[-1] / (1 - terminal)
    return 1 - one_minus / scale


def karras_sigmas(smax: float, smin: float, n: int, rho: float = 7.0) -> np.ndarray:
    ramp = np.linspace(0, 1, n)
    hi, lo = smax ** (1 / rho), smin ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


def exponential_sigmas(smax: float, smin: float, n: int) -> np.ndarray:
    return np.exp(np.linspace(math.log(smax), math.log(smin), n))


def beta_sigmas(smax: float, smin: float, n: int, a: float = 0.6, b: float = 0.6) -> np.ndarray:
    try:
        from scipy.stats import beta as _beta
    except ImportError as e:  # pragma: no cover - scipy is present in the test env
        raise ValueError("use_beta_sigmas=True needs scipy installed") from e
    q = 1 - np.linspace(0, 1, n)
    return np.array([smin + float(_beta.ppf(x, a, b)) * (smax - smin) for x in q])


# ---------------------------------------------------------------------- flow-match Euler
class FlowMatchEuler(Scheduler):
    """diffusers ``FlowMatchEulerDiscreteScheduler`` (per-token timesteps and s_churn excluded).

    Deterministic: ``x_next = x + (sigma_next - sigma) * v``.
    Stochastic (``stochastic_sampling=True``): ``x0 = x - sigma * v``,
    ``x_next = (1 - sigma_next) * x0 + sigma_next * noise`` with ``noise`` supplied by the caller
    (diffusers draws it with ``randn_tensor(sample.shape, generator)``)."""

    name = "flow_euler"
    _DEFAULTS = {
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": False,
        "invert_sigmas": False,
        "shift_terminal": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "time_shift_type": "exponential",
        "stochastic_sampling": False,
    }
    # used by pipelines to compute ``mu``; the scheduler itself never reads them
    _IGNORED = {"base_shift", "max_shift", "base_image_seq_len", "max_image_seq_len"}

    def __init__(
        self,
        num_inference_steps: int,
        *,
        mu: float | None = None,
        sigmas=None,
        begin_index: int = 0,
        **config,
    ):
        cfg = self._resolve_config(config)
        self.config = cfg
        _check_choice("time_shift_type", cfg["time_shift_type"], {"exponential", "linear"})
        n_alt = sum(bool(cfg[k]) for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas"))
        if n_alt > 1:
            raise ValueError(
                "use_karras_sigmas / use_exponential_sigmas / use_beta_sigmas: at most one may be set"
            )
        if cfg["use_dynamic_shifting"] and mu is None:
            raise ValueError("use_dynamic_shifting=True needs `mu` (pass mu=... to make_scheduler)")
        T = int(cfg["num_train_timesteps"])
        if T <= 0:
            raise ValueError(f"unsupported num_train_timesteps={T}")
        shift = float(cfg["shift"])
        self.stochastic = bool(cfg["stochastic_sampling"])
        self.needs_noise = self.stochastic
        if self.stochastic:
            self.name = "flow_euler_sde"

        # Training schedule (float32, like diffusers' constructor): sigma_max / sigma_min are read
        # from it, *after* the static shift when dynamic shifting is off. set_timesteps then
        # spaces between them and shifts again (diffusers' behaviour, reproduced as is).
        train_t = np.linspace(1, T, T, dtype=np.float32)[::-1]
        train_s = train_t / np.float32(T)
        if not cfg["use_dynamic_shifting"]:
            f = np.float32
            train_s = f(shift) * train_s / (f(1) + f(shift - 1) * train_s)
        smax, smin = float(train_s[0]), float(train_s[-1])

        if sigmas is not None:
            s = np.asarray(sigmas).astype(np.float32)
            if num_inference_steps is not None and len(s) != num_inference_steps:
                raise ValueError("`sigmas` must have num_inference_steps entries")
            num_inference_steps = len(s)
        else:
            if num_inference_steps is None or int(num_inference_steps) < 1:
                raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
            num_inference_steps = int(num_inference_steps)
            s = np.linspace(smax * T, smin * T, num_inference_steps) / T
        n = num_inference_steps

        if cfg["use_dynamic_shifting"]:
            s = time_shift(cfg["time_shift_type"], float(mu), s)
        else:
            s = static_shift(shift, s)  # python-float shift: float32 stays float32 (NEP 50), as diffusers
        if cfg["shift_terminal"]:
            s = stretch_to_terminal(s, float(cfg["shift_terminal"]))
        if cfg["use_karras_sigmas"]:
            s = karras_sigmas(float(s[0]), float(s[-1]), n)
        elif cfg["use_exponential_sigmas"]:
            s = exponential_sigmas(float(s[0]), float(s[-1]), n)
        elif cfg["use_beta_sigmas"]:
            s = beta_sigmas(float(s[0]), float(s[-1]), n)

        s32 = np.asarray(s, dtype=np.float32)
        if cfg["invert_sigmas"]:
            s32 = (np.float32(1) - s32).astype(np.float32)
            last = np.float32(1)
        else:
            last = np.float32(0)
        self.timesteps = (s32 * np.float32(T)).astype(np.float32)
        self.sigmas = np.concatenate([s32, [last]]).astype(np.float32)
        self.num_inference_steps = n
        if not 0 <= int(begin_index) < n:
            raise ValueError(f"begin_index={begin_index} outside [0, {n})")
        self.begin_index = int(begin_index)

        # per-step tables (float32, as diffusers computes them)
        self._sig = self.sigmas[:-1].copy()
        self._sig_next = self.sigmas[1:].copy()
        self._dt = (self._sig_next - self._sig).astype(np.float32)

    def step(self, state, model_output, step_index, sample, noise=None):
        """One Euler step from ``sigmas[step_index]`` to ``sigmas[step_index + 1]``.

        Returns ``(x_next, state)``; ``x_next`` has ``model_output``'s dtype (as in diffusers)."""
        i = jnp.asarray(step_index, jnp.int32)
        out_dtype = jnp.asarray(model_output).dtype
        x = jnp.asarray(sample).astype(jnp.float32)
        v = jnp.asarray(model_output).astype(jnp.float32)
        if self.stochastic:
            if noise is None:
                raise ValueError("flow_euler_sde.step needs `noise` (a standard normal array shaped like sample)")
            sig = jnp.asarray(self._sig)[i]
            nxt = jnp.asarray(self._sig_next)[i]
            x0 = x - sig * v
            x_next = (1.0 - nxt) * x0 + nxt * jnp.asarray(noise).astype(jnp.float32)
        else:
            x_next = x + jnp.asarray(self._dt)[i] * v
        return x_next.astype(out_dtype), state


__all__ = ["Scheduler", "FlowMatchEuler", "time_shift", "static_shift", "stretch_to_terminal"]
