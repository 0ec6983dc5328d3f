"""UniPC multistep sampler in flow-prediction mode (how Wan runs it).

Matches diffusers' ``UniPCMultistepScheduler`` configured with ``prediction_type="flow_prediction"``
and ``use_flow_sigmas=True`` (data prediction, ``predict_x0=True``): alpha_t = 1 - sigma,
sigma_t = sigma, lambda = log(alpha_t / sigma_t), and the model's velocity ``v`` is turned into an
x0 estimate ``x - sigma * v``.

Everything that depends only on the schedule (the step order with warm-up and lower-order final
steps, which steps run the corrector, the B(h) / phi coefficients and the rho solves) is computed
on the host in float64 when the scheduler is built, and folded into per-step linear-combination
tables. ``step`` then only indexes those tables with the (traced) step index:

    corrected = c_x[i] * sample + c_last[i] * last + sum_j c_hist[i, j] * hist[j] + c_new[i] * x0_i
    hist      = hist[1:] + [x0_i]
    x_next    = p_x[i] * corrected + sum_j p_hist[i, j] * hist[j]

so no Python branching happens on the step index and the step compiles once.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from .flow_match import (
    Scheduler,
    _check_choice,
    static_shift,
    stretch_to_terminal,
    time_shift,
)


def _lam(sig: np.ndarray) -> np.ndarray:
    """log-SNR of a flow sigma: log(1 - sigma) - log(sigma) (float64; +inf at sigma = 0)."""
    s = np.asarray(sig, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.log(1.0 - s) - np.log(s)


class _Unsolvable(Exception):
    pass


def _bh_coeffs(lam_t, lam_s0, lam_prev, order, bh1, corrector):
    """Coefficients of one UniP (predictor) or UniC (corrector) B(h) update in data prediction.

    Returns (h_phi_1, B_h, weights, w_new): the update is
        x_t = (sigma_t / sigma_s0) * x - alpha_t * h_phi_1 * m0
              - alpha_t * B_h * (sum_k weights[k] * (m_k - m0) / r_k  [+ w_new * (m_t - m0)])
    where ``weights[k]`` are already divided by r_k.
    """
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        h = lam_t - lam_s0
        rks = [(lp - lam_s0) / h for lp in lam_prev]
        hh = -h  # data prediction
        h_phi_1 = np.expm1(hh)
        B_h = hh if bh1 else np.expm1(hh)

        def b_vec(n):
            # b_k = k! * phi_{k+1}(hh) * hh^... / B_h, via the recurrence phi_k -> phi_k / hh - 1 / k!
            out, phik, fact = [], h_phi_1 / hh - 1.0, 1.0
            for k in range(1, n + 1):
                out.append(phik * fact / B_h)
                fact *= k + 1
                phik = phik / hh - 1.0 / fact
            return np.array(out)

        def R_mat(n):
            r = np.array(list(rks) + [1.0])
            return np.stack([r ** (k - 1) for k in range(1, n + 1)])

        def solve(A, b):
            if not (np.isfinite(A).all() and np.isfinite(b).all()):
                raise _Unsolvable
            try:
                return np.linalg.solve(A, b)
            except np.linalg.LinAlgError as e:
                raise _Unsolvable from e

        if corrector:
            rhos = np.array([0.5]) if order == 1 else solve(R_mat(order), b_vec(order))
            w_prev, w_new = rhos[:-1], float(rhos[-1])
        else:
            if order == 1:
                w_prev = np.zeros(0)
            elif order == 2:
                w_prev = np.array([0.5])
            else:
                w_prev = solve(R_mat(order)[:-1, :-1], b_vec(order)[:-1])
            w_new = None
        weights = [w / r for w, r in zip(w_prev, rks)]
    return float(h_phi_1), float(B_h), weights, w_new


class UniPCMultistep(Scheduler):
    """diffusers ``UniPCMultistepScheduler`` with flow sigmas and flow prediction (no solver_p)."""

    name = "unipc"
    _DEFAULTS = {
        "num_train_timesteps": 1000,
        "solver_order": 2,
        "prediction_type": "flow_prediction",
        "thresholding": False,
        "dynamic_thresholding_ratio": 0.995,
        "sample_max_value": 1.0,
        "predict_x0": True,
        "solver_type": "bh2",
        "lower_order_final": True,
        "disable_corrector": [],
        "solver_p": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "use_flow_sigmas": True,
        "flow_shift": 1.0,
        "timestep_spacing": "linspace",
        "final_sigmas_type": "zero",
        "use_dynamic_shifting": False,
        "time_shift_type": "exponential",
        "shift_terminal": None,
    }
    # VP (beta) schedule keys and keys only read by the Karras/exponential/beta conversions or
    # the integer timestep spacing, all overwritten by the flow-sigma schedule.
    _IGNORED = {
        "beta_start",
        "beta_end",
        "beta_schedule",
        "trained_betas",
        "rescale_betas_zero_snr",
        "steps_offset",
        "sigma_min",
        "sigma_max",
    }

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
        # --- validate: only the flow-prediction / flow-sigma data-prediction path is implemented
        if cfg["prediction_type"] != "flow_prediction":
            raise ValueError(
                f"unsupported prediction_type={cfg['prediction_type']!r}; vidax UniPC implements 'flow_prediction'"
            )
        if not cfg["use_flow_sigmas"]:
            raise ValueError("unsupported use_flow_sigmas=False; vidax UniPC needs use_flow_sigmas=True")
        if not cfg["predict_x0"]:
            raise ValueError("unsupported predict_x0=False (diffusers rejects it with flow_prediction too)")
        if cfg["solver_p"] is not None:
            raise ValueError("unsupported solver_p (an external predictor scheduler); use solver_p=None")
        for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas"):
            if cfg[k]:
                raise ValueError(f"unsupported {k}=True with flow sigmas")
        st = cfg["solver_type"]
        if st in ("midpoint", "heun", "logrho"):  # diffusers maps these to bh2
            st = "bh2"
        _check_choice("solver_type", st, {"bh1", "bh2"})
        cfg["solver_type"] = st
        _check_choice("final_sigmas_type", cfg["final_sigmas_type"], {"zero", "sigma_min"})
        _check_choice("timestep_spacing", cfg["timestep_spacing"], {"linspace", "leading", "trailing"})
        _check_choice("time_shift_type", cfg["time_shift_type"], {"exponential", "linear"})
        K = cfg["solver_order"]
        if not isinstance(K, (int, np.integer)) or isinstance(K, bool) or K < 1:
            raise ValueError(f"unsupported solver_order={K!r}; expected a positive integer")
        K = int(K)
        if cfg["use_dynamic_shifting"] and mu is None:
            raise ValueError("use_dynamic_shifting=True needs `mu` (pass mu=... to make_scheduler)")
        disable = cfg["disable_corrector"] or []
        try:
            disable = {int(d) for d in disable}
        except (TypeError, ValueError) as e:
            raise ValueError(f"unsupported disable_corrector={cfg['disable_corrector']!r}; expected a list of ints") from e
        if cfg["thresholding"]:
            r = float(cfg["dynamic_thresholding_ratio"])
            if not 0.0 <= r <= 1.0:
                raise ValueError(f"unsupported dynamic_thresholding_ratio={r}")
        T = int(cfg["num_train_timesteps"])

        # --- schedule (diffusers' set_timesteps, flow-sigma branch)
        if sigmas is not None:
            s = np.array(sigmas, dtype=np.float64)
            num_inference_steps = len(s)
        else:
            if num_inference_steps is None or int(num_inference_steps) < 1:
                raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
            num_inference_steps = int(num_inference_steps)
            s = np.linspace(1, 1 / T, num_inference_steps + 1)[:-1]
        n = num_inference_steps
        if cfg["use_dynamic_shifting"]:
            s = time_shift(cfg["time_shift_type"], float(mu), s)
        else:
            s = static_shift(float(cfg["flow_shift"]), s)
        if cfg["shift_terminal"]:
            s = stretch_to_terminal(s, float(cfg["shift_terminal"]))
        s = np.array(s, dtype=np.float64)
        if abs(s[0] - 1) < 1e-6:  # keeps log(alpha) finite at the first step
            s[0] -= 1e-6
        # diffusers stores the timesteps as int64: sigma * T truncated toward zero, not rounded
        self.timesteps = (s * T).astype(np.int64).astype(np.float32)
        last = s[-1] if cfg["final_sigmas_type"] == "sigma_min" else 0.0
        self.sigmas = np.concatenate([s, [last]]).astype(np.float32)
        self.num_inference_steps = n
        if not 0 <= int(begin_index) < n:
            raise ValueError(f"begin_index={begin_index} outside [0, {n})")
        self.begin_index = b = int(begin_index)
        self.solver_order = K
        self.thresholding = bool(cfg["thresholding"])

        # --- per-step tables
        lam = _lam(self.sigmas)
        sig = self.sigmas.astype(np.float64)
        bh1 = st == "bh1"
        orders = np.ones(n, dtype=np.int32)  # predictor order per step
        use_corr = np.zeros(n, dtype=bool)
        c_x = np.ones(n)
        c_last = np.zeros(n)
        c_hist = np.zeros((n, K))
        c_new = np.zeros(n)
        p_x = np.zeros(n)
        p_hist = np.zeros((n, K))
        for i in range(b, n):
            lower_order_nums = min(i - b, K)
            cap = min(K, n - i) if cfg["lower_order_final"] else K
            orders[i] = min(cap, lower_order_nums + 1)
            try:
                # corrector (UniC) for the sample this step received: steps i-1 -> i
                if i > b and (i - 1) not in disable:
                    use_corr[i] = True
                    oc = int(orders[i - 1])
                    prev = [lam[i - 1 - k] for k in range(1, oc)]
                    hp1, B, w, w_new = _bh_coeffs(lam[i], lam[i - 1], prev, oc, bh1, corrector=True)
                    a_t = 1.0 - sig[i]
                    # history before the shift: hist[K-1] = m0 (step i-1), hist[K-1-k] = step i-1-k
                    c_x[i] = 0.0
                    c_last[i] = sig[i] / sig[i - 1]
                    m0 = -a_t * hp1 + a_t * B * (sum(w) + w_new)
                    c_hist[i, K - 1] = m0
                    for k, wk in enumerate(w, start=1):
                        c_hist[i, K - 1 - k] = -a_t * B * wk
                    c_new[i] = -a_t * B * w_new
                # predictor (UniP): steps i -> i+1, history after the shift (hist[K-1] = x0 of step i)
                op = int(orders[i])
                prev = [lam[i - k] for k in range(1, op)]
                hp1, B, w, _ = _bh_coeffs(lam[i + 1], lam[i], prev, op, bh1, corrector=False)
                a_t = 1.0 - sig[i + 1]
                with np.errstate(divide="ignore", invalid="ignore"):
                    p_x[i] = sig[i + 1] / sig[i]
                # (with no history terms the B(h) term is absent; diffusers multiplies B(h) by 0
                # there, which is nan for bh1 onto sigma = 0 where B(h) = -inf)
                p_hist[i, K - 1] = -a_t * hp1 + (a_t * B * sum(w) if w else 0.0)
                for k, wk in enumerate(w, start=1):
                    p_hist[i, K - 1 - k] = -a_t * B * wk
            except _Unsolvable:
                raise self._nonfinite_error(i) from None
        tables = (c_x, c_last, c_hist, c_new, p_x, p_hist)
        if not all(np.isfinite(t).all() for t in tables):
            bad = min(int(np.nonzero((~np.isfinite(t.reshape(n, -1))).any(1))[0][0]) for t in tables
                      if not np.isfinite(t).all())
            raise self._nonfinite_error(bad)
        self.orders = orders
        self.use_corrector = use_corr
        self._c_x, self._c_last, self._c_new, self._p_x = (t.astype(np.float32) for t in (c_x, c_last, c_new, p_x))
        self._c_hist = c_hist.astype(np.float32)
        self._p_hist = p_hist.astype(np.float32)

    def _nonfinite_error(self, i):
        cfg = self.config
        return ValueError(
            f"UniPC step {i} of {self.num_inference_steps} has no finite update with "
            f"lower_order_final={cfg['lower_order_final']}, solver_order={cfg['solver_order']}, "
            f"final_sigmas_type={cfg['final_sigmas_type']!r}: a multistep (order > 1) step onto the final "
            "sigma divides by an infinite/zero log-SNR step (diffusers returns inf/nan or fails here). "
            "Use lower_order_final=True (the default)."
        )

    # ------------------------------------------------------------------ stepping
    def init_state(self, sample) -> dict:
        """History of x0 estimates [solver_order, *shape] and the previous step's input sample."""
        shape = jnp.shape(sample)
        return {
            "hist": jnp.zeros((self.solver_order, *shape), jnp.float32),
            "last": jnp.zeros(shape, jnp.float32),
        }

    def _threshold(self, x0):
        b = x0.shape[0]
        flat = x0.reshape(b, -1)
        s = jnp.quantile(jnp.abs(flat), float(self.config["dynamic_thresholding_ratio"]), axis=1, method="linear")
        s = jnp.clip(s, 1.0, float(self.config["sample_max_value"]))[:, None]
        return (jnp.clip(flat, -s, s) / s).reshape(x0.shape)

    def step(self, state, model_output, step_index, sample, noise=None):
        """One UniPC step (corrector on ``sample`` if scheduled, then predictor to the next sigma).

        ``step_index`` may be a traced int32 scalar. Returns ``(x_next, state)``; ``x_next`` has
        ``sample``'s dtype. ``noise`` is ignored."""
        i = jnp.asarray(step_index, jnp.int32)
        out_dtype = jnp.asarray(sample).dtype
        x = jnp.asarray(sample).astype(jnp.float32)
        v = jnp.asarray(model_output).astype(jnp.float32)
        hist, last = state["hist"], state["last"]
        K = self.solver_order

        # x0 estimate from the model's velocity at the (uncorrected) sample it was evaluated on
        x0 = x - jnp.asarray(self.sigmas)[i] * v
        if self.thresholding:
            x0 = self._threshold(x0)

        c_hist = jnp.asarray(self._c_hist)[i]
        corrected = jnp.asarray(self._c_x)[i] * x + jnp.asarray(self._c_last)[i] * last
        for j in range(K):
            corrected = corrected + c_hist[j] * hist[j]
        corrected = corrected + jnp.asarray(self._c_new)[i] * x0

        hist = jnp.concatenate([hist[1:], x0[None]], axis=0)
        p_hist = jnp.asarray(self._p_hist)[i]
        x_next = jnp.asarray(self._p_x)[i] * corrected
        for j in range(K):
            x_next = x_next + p_hist[j] * hist[j]
        return x_next.astype(out_dtype), {"hist": hist, "last": corrected}


__all__ = ["UniPCMultistep"]
