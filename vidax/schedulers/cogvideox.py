"""CogVideoX's discrete-time samplers: diffusers' ``CogVideoXDDIMScheduler`` and
``CogVideoXDPMScheduler`` as pure, jittable steps.

Both share the training schedule: betas (``scaled_linear`` in float64 as the reference builds it;
``linear`` / ``squaredcos_cap_v2`` / ``trained_betas`` in float32), cumulative alphas shifted by
``snr_shift_scale`` (``a / (s + (1 - s) a)``), optionally rescaled to zero terminal SNR, and the
discrete timesteps of ``timestep_spacing`` ("trailing" in every CogVideoX release). The step goes
from timestep ``t`` to ``t - num_train_timesteps // N``, the last one to ``final_alpha_cumprod``.

- :class:`CogVideoXDDIM`: deterministic DDIM (``eta`` is not used by the reference either):
  ``x0 = sqrt(a) x - sqrt(1 - a) v`` (v-prediction), ``x' = A x + B x0``.
- :class:`CogVideoXDPM`: the stochastic DPM-Solver++(2M) of the CogVideoX release: a first-order
  step on the first and the last step, second order in between (``x0`` extrapolated with the
  previous step's, carried in the state), plus ``sqrt(1 - a') sqrt(1 - e^{-2h})`` of fresh noise
  every step. The noise is an argument (the sampling loop draws it from ``fold_in(key, step)``), so
  a resumed run is bitwise identical.

Every per-step coefficient is computed on the host in the reference's precision (float64 for the
released scaled-linear schedules) and stored as float32 tables indexed by the traced step index:
one compiled step serves the whole schedule. ``clip_sample`` / ``sample_max_value`` /
``clip_sample_range`` are accepted and, as in the reference's CogVideoX steps, have no effect.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from .flow_match import Scheduler, _check_choice


def _betas_for_alpha_bar(n: int, max_beta: float = 0.999) -> np.ndarray:
    f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    return np.array([min(1 - f((i + 1) / n) / f(i / n), max_beta) for i in range(n)], np.float32)


def _rescale_zero_terminal_snr(ac: np.ndarray) -> np.ndarray:
    s = np.sqrt(ac)
    s0, sT = s[0].copy(), s[-1].copy()
    s = (s - sT) * (s0 / (s0 - sT))
    return s**2


class _CogVideoXSchedule(Scheduler):
    _DEFAULTS = {
        "num_train_timesteps": 1000,
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "beta_schedule": "scaled_linear",
        "trained_betas": None,
        "clip_sample": True,
        "set_alpha_to_one": True,
        "steps_offset": 0,
        "prediction_type": "epsilon",
        "clip_sample_range": 1.0,
        "sample_max_value": 1.0,
        "timestep_spacing": "leading",
        "rescale_betas_zero_snr": False,
        "snr_shift_scale": 3.0,
    }
    _IGNORED = {"thresholding", "dynamic_thresholding_ratio", "variance_type"}

    def __init__(self, num_inference_steps: int, *, mu=None, sigmas=None, begin_index: int = 0, **config):
        if mu is not None or sigmas is not None:
            raise ValueError(f"{type(self).__name__}: mu / sigmas do not apply to a discrete DDPM schedule")
        cfg = self._resolve_config(config)
        self.config = cfg
        _check_choice("prediction_type", cfg["prediction_type"], {"epsilon", "sample", "v_prediction"})
        _check_choice("timestep_spacing", cfg["timestep_spacing"], {"linspace", "leading", "trailing"})
        T = int(cfg["num_train_timesteps"])
        n = int(num_inference_steps)
        if not 1 <= n <= T:
            raise ValueError(f"num_inference_steps must be in [1, num_train_timesteps={T}], got {num_inference_steps}")
        # the training schedule, in the dtype the reference computes it in
        if cfg["trained_betas"] is not None:
            betas = np.asarray(cfg["trained_betas"], np.float32)
        elif cfg["beta_schedule"] == "linear":
            betas = np.linspace(cfg["beta_start"], cfg["beta_end"], T, dtype=np.float32)
        elif cfg["beta_schedule"] == "scaled_linear":
            betas = np.linspace(cfg["beta_start"] ** 0.5, cfg["beta_end"] ** 0.5, T, dtype=np.float64) ** 2
        elif cfg["beta_schedule"] == "squaredcos_cap_v2":
            betas = _betas_for_alpha_bar(T)
        else:
            raise ValueError(f"unsupported beta_schedule={cfg['beta_schedule']!r}; expected 'linear', "
                             f"'scaled_linear' or 'squaredcos_cap_v2'")
        dt = betas.dtype.type
        ac = np.cumprod(dt(1.0) - betas, dtype=betas.dtype)
        s = dt(cfg["snr_shift_scale"])
        ac = ac / (s + (dt(1) - s) * ac)
        if cfg["rescale_betas_zero_snr"]:
            ac = _rescale_zero_terminal_snr(ac)
        self.alphas_cumprod = ac
        final = np.float64(1.0) if cfg["set_alpha_to_one"] else ac[0]

        spacing = cfg["timestep_spacing"]
        if spacing == "linspace":
            ts = np.linspace(0, T - 1, n).round()[::-1].copy().astype(np.int64)
        elif spacing == "leading":
            ts = (np.arange(0, n) * (T // n)).round()[::-1].copy().astype(np.int64) + int(cfg["steps_offset"])
        else:
            ts = np.round(np.arange(T, 0, -T / n)).astype(np.int64) - 1
        self.int_timesteps = ts
        self.timesteps = ts.astype(np.float32)
        self.num_inference_steps = n
        if not 0 <= int(begin_index) < n:
            raise ValueError(f"begin_index={begin_index} outside [0, {n})")
        self.begin_index = int(begin_index)

        prev = ts - T // n
        a_t = ac[ts]
        a_prev = np.array([ac[p] if p >= 0 else final for p in prev], np.float64 if ac.dtype == np.float64 else ac.dtype)
        self._a_t, self._a_prev, self._prev = a_t, a_prev, prev
        self.final_alpha_cumprod = final
        with np.errstate(divide="ignore", invalid="ignore"):
            self._x0 = self._x0_coefficients(a_t)
            self._tables()

    def _x0_coefficients(self, a_t):
        """(c_x, c_m) with x0 = c_x * x - c_m * model_output (epsilon: x0 = (x - c_m eps) / c_x)."""
        return np.sqrt(a_t).astype(np.float32), np.sqrt(1 - a_t).astype(np.float32)

    def _tables(self):
        raise NotImplementedError

    def _pred_x0(self, v, x, i):
        return self._x0_from(v, x, jnp.asarray(self._x0[0])[i], jnp.asarray(self._x0[1])[i])

    def _x0_from(self, v, x, cx, cm):
        p = self.config["prediction_type"]
        if p == "v_prediction":
            return cx * x - cm * v
        if p == "epsilon":
            return (x - cm * v) / cx
        return v

    # ------------------------------------------------------------------ arbitrary training timesteps
    def timesteps_for_flow_sigmas(self, sigmas) -> np.ndarray:
        """The training timesteps (int [n]) whose signal-to-noise ratio is closest to that of the
        flow-matching noise levels ``sigmas``: ``x = (1 - s) x0 + s n`` divided by
        ``sqrt((1 - s)^2 + s^2)`` is a variance-preserving sample ``sqrt(a) x0 + sqrt(1 - a) n`` with
        ``a = (1 - s)^2 / ((1 - s)^2 + s^2)``; the nearest ``alphas_cumprod[t]`` in log-SNR wins."""
        s = np.clip(np.asarray(sigmas, np.float64).reshape(-1), 1e-7, 1 - 1e-7)
        target = 2.0 * (np.log1p(-s) - np.log(s))
        ac = np.asarray(self.alphas_cumprod, np.float64)
        with np.errstate(divide="ignore"):
            snr = np.log(ac) - np.log1p(-ac)  # -inf at a zero-terminal-SNR timestep, +inf at a = 1
        return np.argmin(np.abs(snr[None, :] - target[:, None]), axis=1).astype(np.int64)

    def _alphas_at(self, timesteps, ndim: int):
        a = np.asarray(self.alphas_cumprod, np.float64)[np.asarray(timesteps, np.int64)]
        return a.reshape(a.shape + (1,) * (ndim - a.ndim))

    def add_noise_at(self, original_samples, noise, timesteps):
        """The forward process at training ``timesteps`` (one per row): ``sqrt(a) x0 + sqrt(1 - a) n``."""
        x0 = np.asarray(original_samples, np.float32)
        a = self._alphas_at(timesteps, x0.ndim)
        return (np.sqrt(a).astype(np.float32) * x0
                + np.sqrt(1 - a).astype(np.float32) * np.asarray(noise, np.float32)).astype(np.float32)

    def x0_at(self, model_output, sample, timesteps):
        """The clean estimate from a model output at training ``timesteps`` (one per row), by the
        config's ``prediction_type`` (v-prediction: ``sqrt(a) x - sqrt(1 - a) v``), as :meth:`step`."""
        x = jnp.asarray(sample, jnp.float32)
        a = self._alphas_at(timesteps, x.ndim)
        return self._x0_from(jnp.asarray(model_output, jnp.float32), x, jnp.asarray(np.sqrt(a), jnp.float32),
                             jnp.asarray(np.sqrt(1 - a), jnp.float32))

    # ------------------------------------------------------------------ noising
    def add_noise(self, original_samples, noise, step_index):
        """Forward process at the timestep of step ``step_index``: ``sqrt(a) x0 + sqrt(1 - a) noise``."""
        a = jnp.asarray(self.alphas_cumprod.astype(np.float32))[jnp.asarray(self.int_timesteps)[step_index]]
        x0 = jnp.asarray(original_samples)
        out = jnp.sqrt(a) * x0.astype(jnp.float32) + jnp.sqrt(1 - a) * jnp.asarray(noise, jnp.float32)
        return out.astype(x0.dtype)

    def scale_noise(self, sample, noise, step_index):
        return self.add_noise(sample, noise, step_index)


class CogVideoXDDIM(_CogVideoXSchedule):
    """diffusers ``CogVideoXDDIMScheduler`` (deterministic; ``eta`` unused, as in the reference)."""

    name = "cogvideox_ddim"

    def _tables(self):
        a_t, a_prev = self._a_t, self._a_prev
        at = np.sqrt((1 - a_prev) / (1 - a_t))
        bt = np.sqrt(a_prev) - np.sqrt(a_t) * at
        self._a, self._b = at.astype(np.float32), bt.astype(np.float32)

    def step(self, state, model_output, step_index, sample, noise=None):
        i = jnp.asarray(step_index, jnp.int32)
        x = jnp.asarray(sample).astype(jnp.float32)
        v = jnp.asarray(model_output).astype(jnp.float32)
        x0 = self._pred_x0(v, x, i)
        return jnp.asarray(self._a)[i] * x + jnp.asarray(self._b)[i] * x0, state


class CogVideoXDPM(_CogVideoXSchedule):
    """diffusers ``CogVideoXDPMScheduler``: stochastic DPM-Solver++(2M); ``noise`` (standard normal,
    shaped like the sample) is required every step; the state carries the previous ``x0``."""

    name = "cogvideox_dpm"
    needs_noise = True

    def _tables(self):
        a_t, a_prev = self._a_t, self._a_prev
        lam = np.log(np.sqrt(a_t / (1 - a_t)))
        lam_next = np.log(np.sqrt(a_prev / (1 - a_prev)))
        h = lam_next - lam
        m1 = np.sqrt((1 - a_prev) / (1 - a_t)) * np.exp(-h)
        m2 = np.expm1(-2 * h) * np.sqrt(a_prev)
        mn = np.sqrt(1 - a_prev) * np.sqrt(1 - np.exp(-2 * h))
        n = len(a_t)
        m3, m4 = np.ones(n, np.float64), np.zeros(n, np.float64)
        for i in range(1, n):
            if self._prev[i] < 0:  # the last step is first order (the reference's shortcut)
                continue
            a_back = self.alphas_cumprod[self.int_timesteps[i - 1]]
            r = (lam[i] - np.log(np.sqrt(a_back / (1 - a_back)))) / h[i]
            m3[i], m4[i] = 1 + 1 / (2 * r), 1 / (2 * r)
        tables = dict(m1=m1, m2=m2, m3=m3, m4=m4, mn=mn)
        for k, t in tables.items():
            if not np.all(np.isfinite(t.astype(np.float32))):
                raise ValueError(f"CogVideoXDPM: non-finite step coefficient {k} for this schedule")
        self._m = {k: t.astype(np.float32) for k, t in tables.items()}

    def init_state(self, sample) -> dict:
        """``old``: the previous step's predicted x0 (unused on the first step)."""
        return {"old": jnp.zeros(jnp.shape(sample), jnp.float32)}

    def step(self, state, model_output, step_index, sample, noise=None):
        if noise is None:
            raise ValueError("cogvideox_dpm.step needs `noise` (a standard normal array shaped like sample)")
        i = jnp.asarray(step_index, jnp.int32)
        m = {k: jnp.asarray(t)[i] for k, t in self._m.items()}
        x = jnp.asarray(sample).astype(jnp.float32)
        v = jnp.asarray(model_output).astype(jnp.float32)
        x0 = self._pred_x0(v, x, i)
        d = m["m3"] * x0 - m["m4"] * state["old"]  # first-order steps: m3 = 1, m4 = 0
        x_next = m["m1"] * x - m["m2"] * d + m["mn"] * jnp.asarray(noise, jnp.float32)
        return x_next, {"old": x0}


__all__ = ["CogVideoXDDIM", "CogVideoXDPM"]
