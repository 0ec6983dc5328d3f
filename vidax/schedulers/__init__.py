"""Noise schedulers for flow-matching video models.

    sched = make_scheduler("unipc", 50, flow_shift=3.0)        # or from_diffusers_config(cfg, 50)
    state = sched.init_state(latents)
    step = jax.jit(lambda st, v, i, x: sched.step(st, v, i, x))   # compiles once for all steps
    for i, t in enumerate(sched.timesteps):                    # t: what the model receives
        v = model(latents, t)
        latents, state = step(state, v, jnp.int32(i), latents)

Names: ``"flow_euler"`` (diffusers FlowMatchEulerDiscreteScheduler; honours
``stochastic_sampling``), ``"flow_euler_sde"`` (the same with ``stochastic_sampling=True``; pass
``noise=`` to ``step``) and ``"unipc"`` (UniPCMultistepScheduler, flow prediction, flow sigmas).
"""
from __future__ import annotations

import json
from pathlib import Path

from .flow_match import FlowMatchEuler, Scheduler
from .unipc import UniPCMultistep
from .unipc_karras import UniPCKarrasFlow

SCHEDULERS = ("flow_euler", "flow_euler_sde", "unipc")

_CLASS_NAMES = {
    "FlowMatchEulerDiscreteScheduler": "flow_euler",
    "UniPCMultistepScheduler": "unipc",
}

#: schedulers a model family adds in its own file: name -> (class, diffusers class name); one line each.
#: They are built by make_scheduler / from_diffusers_config like the ones above, but are not offered
#: as choices to other families (``SCHEDULERS``).
REGISTERED: dict = {}


def make_scheduler(
    name: str,
    num_inference_steps: int,
    *,
    mu: float | None = None,
    sigmas=None,
    begin_index: int = 0,
    **config,
) -> Scheduler:
    """Build a scheduler for ``num_inference_steps`` steps from diffusers-style config keys.

    ``mu``: the resolution-dependent shift (only with ``use_dynamic_shifting=True``).
    ``sigmas``: custom sigma schedule (diffusers' ``set_timesteps(sigmas=...)``).
    ``begin_index``: first step actually run (video-to-video strength); multistep warm-up starts
    there, as diffusers' does when the first ``step`` call is at that timestep.
    Unsupported values raise ``ValueError`` naming the key; unknown keys are ignored with a warning.
    """
    if name == "flow_euler":
        return FlowMatchEuler(num_inference_steps, mu=mu, sigmas=sigmas, begin_index=begin_index, **config)
    if name == "flow_euler_sde":
        if "stochastic_sampling" in config and not config["stochastic_sampling"]:
            raise ValueError("stochastic_sampling=False contradicts scheduler 'flow_euler_sde'")
        config["stochastic_sampling"] = True
        return FlowMatchEuler(num_inference_steps, mu=mu, sigmas=sigmas, begin_index=begin_index, **config)
    if name == "unipc":
        if config.get("use_karras_sigmas") and config.get("use_flow_sigmas", True):  # Cosmos-Predict2.5
            return UniPCKarrasFlow(num_inference_steps, mu=mu, sigmas=sigmas, begin_index=begin_index, **config)
        return UniPCMultistep(num_inference_steps, mu=mu, sigmas=sigmas, begin_index=begin_index, **config)
    if name in REGISTERED:
        return REGISTERED[name][0](num_inference_steps, mu=mu, sigmas=sigmas, begin_index=begin_index, **config)
    raise ValueError(f"unknown scheduler {name!r}; expected one of {SCHEDULERS + tuple(REGISTERED)}")


def from_diffusers_config(config, num_inference_steps: int, **kwargs) -> Scheduler:
    """Build from a diffusers scheduler config: a dict, a ``scheduler_config.json`` path, or a
    folder holding one. The class comes from ``_class_name``; ``kwargs`` override config keys
    (e.g. ``flow_shift=5.0``) or pass ``mu`` / ``sigmas`` / ``begin_index``."""
    if not isinstance(config, dict):
        p = Path(config)
        if p.is_dir():
            p = p / "scheduler_config.json"
        config = json.loads(p.read_text())
    cls = config.get("_class_name")
    names = {**_CLASS_NAMES, **{c: n for n, (_, c) in REGISTERED.items()}}
    if cls not in names:
        raise ValueError(f"unsupported scheduler _class_name={cls!r}; expected one of {sorted(names)}")
    cfg = {k: v for k, v in config.items() if not k.startswith("_")}
    cfg.update(kwargs)
    return make_scheduler(names[cls], num_inference_steps, **cfg)


def load_scheduler(num_inference_steps: int, name: str | None = None, *, folder=None, shift: float | None = None,
                   default_shift: float = 5.0) -> Scheduler:
    """The scheduler a pipeline samples with. ``folder`` (a diffusers ``scheduler/`` folder) is
    used when ``name`` is None, with ``shift`` overriding its flow shift; otherwise ``name``
    (default UniPC, flow prediction on flow sigmas, as the flow-matching video pipelines configure
    it) with ``shift`` (default ``default_shift``)."""
    if name is None and folder is not None:
        cfg = json.loads((Path(folder) / "scheduler_config.json").read_text())
        if shift is not None:
            cfg["flow_shift" if "flow_shift" in cfg else "shift"] = shift
        return from_diffusers_config(cfg, num_inference_steps)
    name = name or "unipc"
    shift = default_shift if shift is None else shift
    if name == "unipc":
        return make_scheduler("unipc", num_inference_steps, prediction_type="flow_prediction", use_flow_sigmas=True,
                              num_train_timesteps=1000, flow_shift=shift)
    return make_scheduler(name, num_inference_steps, shift=shift)


from .cogvideox import CogVideoXDDIM, CogVideoXDPM  # noqa: E402

REGISTERED["cogvideox_ddim"] = (CogVideoXDDIM, "CogVideoXDDIMScheduler")
REGISTERED["cogvideox_dpm"] = (CogVideoXDPM, "CogVideoXDPMScheduler")

__all__ = [
    "load_scheduler",
    "Scheduler",
    "FlowMatchEuler",
    "UniPCMultistep",
    "make_scheduler",
    "from_diffusers_config",
    "SCHEDULERS",
]
