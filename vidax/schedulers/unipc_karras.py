"""UniPC with Karras (EDM) noise levels mapped to flow sigmas: how Cosmos-Predict2.5 configures it.

diffusers' ``UniPCMultistepScheduler(use_karras_sigmas=True, use_flow_sigmas=True,
prediction_type="flow_prediction", sigma_max=200, sigma_min=0.01)`` builds the EDM schedule
``(s_max^(1/rho) + ramp * (s_min^(1/rho) - s_max^(1/rho)))^rho`` (rho = 7) over the steps, maps
each EDM noise level to a flow sigma ``s / (s + 1)`` and samples with the ordinary flow-prediction
UniPC update on those sigmas. The model's timestep is ``int(sigma * num_train_timesteps)``; the
Cosmos-Predict2.5 pipeline gives the DiT the flow sigma itself.

``flow_shift`` plays no part in this branch (diffusers ignores it here too). Everything else -- the
multistep tables, warm-up, lower-order final steps, the corrector -- is
:class:`vidax.schedulers.unipc.UniPCMultistep` on the custom sigma schedule.
"""
from __future__ import annotations

import numpy as np

from .flow_match import karras_sigmas
from .unipc import UniPCMultistep


def karras_flow_sigmas(num_inference_steps: int, sigma_max: float, sigma_min: float, rho: float = 7.0) -> np.ndarray:
    """The flow sigmas [N] of the Karras branch (float64, before the final sigma is appended)."""
    s = karras_sigmas(float(sigma_max), float(sigma_min), int(num_inference_steps), rho)
    return s / (s + 1.0)


class UniPCKarrasFlow(UniPCMultistep):
    """diffusers ``UniPCMultistepScheduler`` with ``use_karras_sigmas=True`` and flow sigmas."""

    name = "unipc_karras"

    def __init__(self, num_inference_steps: int, *, mu: float | None = None, sigmas=None, begin_index: int = 0,
                 **config):
        cfg = dict(config)
        if not cfg.get("use_karras_sigmas", True):
            raise ValueError("UniPCKarrasFlow needs use_karras_sigmas=True")
        if cfg.get("use_dynamic_shifting"):
            raise ValueError("unsupported use_dynamic_shifting=True with use_karras_sigmas (diffusers ignores it)")
        if sigmas is not None:
            raise ValueError("custom sigmas replace the Karras schedule: use UniPCMultistep with sigmas= instead")
        if num_inference_steps is None or int(num_inference_steps) < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        smax, smin = cfg.get("sigma_max"), cfg.get("sigma_min")
        if smax is None or smin is None:
            # diffusers falls back to the VP (beta) schedule's extremes; Cosmos always sets both
            raise ValueError("unsupported use_karras_sigmas without sigma_max and sigma_min")
        s = karras_flow_sigmas(int(num_inference_steps), smax, smin)
        # the Karras branch keeps its first sigma (no 1 - 1e-6 nudge) and ignores flow_shift
        base = {k: v for k, v in cfg.items() if k not in ("use_karras_sigmas", "sigma_max", "sigma_min", "flow_shift")}
        super().__init__(len(s), mu=mu, sigmas=s, begin_index=begin_index, **base)
        self.config = {**self.config, "use_karras_sigmas": True, "sigma_max": float(smax), "sigma_min": float(smin),
                       "flow_shift": cfg.get("flow_shift", 1.0)}


__all__ = ["UniPCKarrasFlow", "karras_flow_sigmas"]
