"""The schedulers the Cosmos pipelines configure, over whole schedules, against diffusers'
UniPCMultistepScheduler: Predict2.5's Karras-EDM noise levels on flow sigmas (sigma_max 200,
sigma_min 0.01) and Cosmos3's flow-shift and "native" (linear) sigma schedules."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity
from vidax.core.jit import CompileCounter
from vidax.schedulers import from_diffusers_config, make_scheduler
from vidax.schedulers.unipc_karras import UniPCKarrasFlow

PREDICT25 = dict(use_karras_sigmas=True, use_flow_sigmas=True, prediction_type="flow_prediction", sigma_max=200.0,
                 sigma_min=0.01)
SHAPE = (1, 4, 3, 4, 6)


def _ref(steps, sigmas=None, **cfg):
    from diffusers import UniPCMultistepScheduler

    ref = UniPCMultistepScheduler(**cfg)
    if sigmas is None:
        ref.set_timesteps(steps)
    else:
        ref.set_timesteps(sigmas=sigmas)
    return ref


def _run(sched, ref, seed=0):
    """Both samplers from the same start, fed the same velocity field (evaluated on the reference's
    trajectory); every step compared."""
    g = torch.Generator().manual_seed(seed)
    x_ref = torch.randn(SHAPE, generator=g)
    w = 0.5 * torch.randn(SHAPE, generator=g)
    x = jnp.asarray(x_ref.numpy())
    state = sched.init_state(x)
    step = jax.jit(sched.step)
    idx = [jnp.asarray(i, jnp.int32) for i in range(len(ref.timesteps))]
    with CompileCounter() as cc:
        for i, t in enumerate(ref.timesteps):
            v = w * x_ref + 0.3 * torch.sin(3 * x_ref) + (float(ref.sigmas[i]) - 0.5)
            x_ref = ref.step(v, t, x_ref).prev_sample
            x, state = step(state, jnp.asarray(v.numpy()), idx[i], x)
            assert_parity(np.asarray(x), x_ref.numpy(), what=f"step {i}")
    assert cc.count == 1, cc.count  # one compiled step for the whole schedule


@pytest.mark.parametrize("steps", [1, 2, 8, 35])
def test_predict25_karras_flow_unipc(steps):
    ref = _ref(steps, **PREDICT25)
    sched = from_diffusers_config({"_class_name": "UniPCMultistepScheduler", **PREDICT25}, steps)
    assert isinstance(sched, UniPCKarrasFlow)
    np.testing.assert_array_equal(sched.timesteps, ref.timesteps.numpy().astype(np.float32))
    np.testing.assert_array_equal(sched.sigmas, ref.sigmas.numpy().astype(np.float32))
    assert sched.sigmas[0] == pytest.approx(200 / 201) and sched.sigmas[-1] == 0.0
    _run(sched, ref, seed=steps)


def test_karras_ignores_flow_shift_as_diffusers_does():
    ref = _ref(6, flow_shift=7.0, **PREDICT25)
    sched = make_scheduler("unipc", 6, flow_shift=7.0, **PREDICT25)
    np.testing.assert_array_equal(sched.sigmas, ref.sigmas.numpy().astype(np.float32))


@pytest.mark.parametrize("native", [False, True])
def test_cosmos3_flow_schedules(native):
    cfg = dict(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=10.0, use_karras_sigmas=False)
    steps = 12
    if native:  # Cosmos3OmniPipeline(use_native_flow_schedule=True): linear sigmas, shifted
        sigmas = np.linspace(1.0 - 1.0 / 1000, 0.0, steps + 1)[:-1]
        ref = _ref(steps, sigmas=sigmas, **cfg)
        sched = make_scheduler("unipc", steps, sigmas=sigmas, **cfg)
    else:
        ref = _ref(steps, **cfg)
        sched = make_scheduler("unipc", steps, **cfg)
    np.testing.assert_array_equal(sched.sigmas, ref.sigmas.numpy().astype(np.float32))
    _run(sched, ref, seed=7)
