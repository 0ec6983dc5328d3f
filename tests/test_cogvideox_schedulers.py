"""CogVideoXDDIMScheduler / CogVideoXDPMScheduler: whole-schedule parity with diffusers (the
released configs and variations), one compiled step for every step, resumable state, fold_in noise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity
from vidax.core.jit import CompileCounter
from vidax.schedulers import from_diffusers_config, make_scheduler

# the released scheduler_config.json of CogVideoX (2B: snr_shift_scale 3.0; 5B and 1.5: 1.0)
RELEASED = dict(beta_end=0.012, beta_schedule="scaled_linear", beta_start=0.00085, clip_sample=False,
                clip_sample_range=1.0, num_train_timesteps=1000, prediction_type="v_prediction",
                rescale_betas_zero_snr=True, sample_max_value=1.0, set_alpha_to_one=True, snr_shift_scale=3.0,
                steps_offset=0, timestep_spacing="trailing", trained_betas=None)
CASES = [
    ("released-2b", RELEASED, 50),
    ("released-5b", {**RELEASED, "snr_shift_scale": 1.0}, 50),
    ("few-steps", {**RELEASED, "snr_shift_scale": 1.0}, 7),
    ("leading-eps", {**RELEASED, "timestep_spacing": "leading", "steps_offset": 1, "prediction_type": "epsilon",
                     "rescale_betas_zero_snr": False}, 12),
    ("linspace-linear", {**RELEASED, "timestep_spacing": "linspace", "beta_schedule": "linear", "beta_start": 1e-4,
                         "beta_end": 0.02, "set_alpha_to_one": False}, 10),
]
SHAPE = (1, 3, 4, 6, 5)  # [B, F, C, H, W]


def _model(x, i):
    """A deterministic stand-in for the DiT: a different smooth function of the sample per step."""
    return np.tanh(x * (0.7 + 0.05 * i)) + 0.1 * np.cos(3.0 * x + i)


def _run_vidax(sched, x0, noises=None, start=0, stop=None, x=None, state=None):
    step = jax.jit(lambda st, v, i, x, n: sched.step(st, v, i, x, noise=n))
    x = jnp.asarray(x0 if x is None else x)
    state = sched.init_state(x) if state is None else state
    stop = len(sched.timesteps) if stop is None else stop
    for i in range(start, stop):
        v = jnp.asarray(_model(np.asarray(x), i), jnp.float32)
        n = None if noises is None else jnp.asarray(noises[i])
        x, state = step(state, v, jnp.int32(i), x, n)
    return np.asarray(x), state


@pytest.mark.parametrize("name,cfg,n", CASES, ids=[c[0] for c in CASES])
def test_ddim_whole_schedule(name, cfg, n):
    from diffusers import CogVideoXDDIMScheduler

    ref = CogVideoXDDIMScheduler(**cfg)
    ref.set_timesteps(n)
    sched = from_diffusers_config({"_class_name": "CogVideoXDDIMScheduler", **cfg}, n)
    np.testing.assert_array_equal(sched.timesteps, ref.timesteps.numpy().astype(np.float32))
    x0 = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    x = torch.from_numpy(x0)
    for i, t in enumerate(ref.timesteps):
        x = ref.step(torch.from_numpy(_model(x.numpy(), i).astype(np.float32)), t, x, return_dict=False)[0]
    out, _ = _run_vidax(sched, x0)
    assert_parity(out, x.numpy(), what=f"CogVideoXDDIM {name} over {n} steps")


@pytest.mark.parametrize("name,cfg,n", CASES, ids=[c[0] for c in CASES])
def test_dpm_whole_schedule(name, cfg, n, monkeypatch):
    """The stochastic DPM-Solver++(2M) with the reference's noise replaced by ours: the reference
    draws once on first-order steps and twice (using the second) on second-order ones."""
    from diffusers import CogVideoXDPMScheduler
    from diffusers.schedulers import scheduling_dpm_cogvideox as mod

    ref = CogVideoXDPMScheduler(**cfg)
    ref.set_timesteps(n)
    sched = make_scheduler("cogvideox_dpm", n, **cfg)
    assert sched.needs_noise
    rng = np.random.default_rng(1)
    x0 = rng.standard_normal(SHAPE).astype(np.float32)
    noises = rng.standard_normal((n, *SHAPE)).astype(np.float32)
    draws = []
    monkeypatch.setattr(mod, "randn_tensor", lambda shape, **kw: draws.pop(0))
    x, old = torch.from_numpy(x0), None
    ts = ref.timesteps
    for i, t in enumerate(ts):
        second = old is not None and int(t) - 1000 // n >= 0
        draws.extend([torch.zeros(SHAPE)] * second + [torch.from_numpy(noises[i])])
        v = torch.from_numpy(_model(x.numpy(), i).astype(np.float32))
        x, old = ref.step(v, old, t, ts[i - 1] if i > 0 else None, x, return_dict=False)
        assert not draws
    out, _ = _run_vidax(sched, x0, noises)
    assert_parity(out, x.numpy(), what=f"CogVideoXDPM {name} over {n} steps")


def test_one_compile_resume_bitwise():
    """One compiled step for every step; a run split at step k with the state handed on (as a
    sampling checkpoint does) is bitwise the run that never stopped."""
    sched = make_scheduler("cogvideox_dpm", 9, **{**RELEASED, "snr_shift_scale": 1.0})
    rng = np.random.default_rng(2)
    x0 = rng.standard_normal(SHAPE).astype(np.float32)
    noises = rng.standard_normal((9, *SHAPE)).astype(np.float32)
    with CompileCounter() as cc:
        full, _ = _run_vidax(sched, x0, noises)
    assert cc.count <= 2  # the step (+ at most one host->device constant program)
    part, state = _run_vidax(sched, x0, noises, stop=4)
    state = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), state)  # through the host, as a checkpoint
    resumed, _ = _run_vidax(sched, x0, noises, start=4, x=part, state=state)
    assert resumed.tobytes() == full.tobytes()


def test_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="num_inference_steps"):
        make_scheduler("cogvideox_ddim", 1001)
    with pytest.raises(ValueError, match="beta_schedule"):
        make_scheduler("cogvideox_ddim", 10, beta_schedule="cubic")
    with pytest.raises(ValueError, match="needs `noise`"):
        s = make_scheduler("cogvideox_dpm", 4)
        s.step(s.init_state(jnp.zeros(3)), jnp.zeros(3), 0, jnp.zeros(3))
    with pytest.raises(ValueError, match="unknown scheduler"):
        make_scheduler("cogvideox", 4)
