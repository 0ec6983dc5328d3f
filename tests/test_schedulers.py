"""Parity of vidax schedulers with diffusers' FlowMatchEulerDiscreteScheduler / UniPCMultistepScheduler."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.refutil import assert_parity
from vidax.core.jit import CompileCounter
from vidax.schedulers import from_diffusers_config, make_scheduler

diffusers = pytest.importorskip("diffusers")
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler  # noqa: E402

SHAPE = (1, 4, 3, 5, 6)  # [B, C, F, H, W]
FLOW = dict(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000)


def _fake_model(x: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A fixed velocity field that depends on the sample and the timestep (so history matters)."""
    return w * x + 0.3 * torch.sin(3 * x) + (t.float() / 1000.0 - 0.5)


def _ref_unipc(n, mu=None, sigmas=None, **kw):
    ref = UniPCMultistepScheduler(**{**FLOW, **kw})
    if sigmas is not None:
        ref.set_timesteps(sigmas=np.asarray(sigmas, dtype=np.float64), mu=mu)
    else:
        ref.set_timesteps(n, mu=mu)
    return ref


def _ref_euler(n, mu=None, sigmas=None, **kw):
    ref = FlowMatchEulerDiscreteScheduler(**kw)
    ref.set_timesteps(n, mu=mu, sigmas=sigmas)
    return ref


def _check_schedule(sched, ref):
    np.testing.assert_array_equal(sched.timesteps, ref.timesteps.numpy().astype(np.float32))
    assert sched.timesteps.dtype == np.float32 and sched.sigmas.dtype == np.float32
    np.testing.assert_array_equal(sched.sigmas, ref.sigmas.numpy().astype(np.float32))


def _run_pair(sched, ref, seed=0, sde=False, begin=0, label=""):
    """Run both samplers from the same start with the same model outputs (computed on the reference
    trajectory); each sampler continues from its own previous output. Compare every step."""
    g = torch.Generator().manual_seed(seed)
    x_ref = torch.randn(SHAPE, generator=g)
    w = 0.5 * torch.randn(SHAPE, generator=g)
    x = jnp.asarray(x_ref.numpy())
    state = sched.init_state(x)
    g_ref = torch.Generator().manual_seed(seed + 1000)  # diffusers' own noise draws
    g_me = torch.Generator().manual_seed(seed + 1000)  # the same stream, drawn here and passed in
    worst = 0.0
    for i in range(begin, len(ref.timesteps)):
        t = ref.timesteps[i]
        v = _fake_model(x_ref, t, w)
        if sde:
            x_ref = ref.step(v, t, x_ref, generator=g_ref).prev_sample
            noise = jnp.asarray(torch.randn(SHAPE, generator=g_me, dtype=torch.float32).numpy())
        else:
            x_ref = ref.step(v, t, x_ref).prev_sample
            noise = None
        x, state = sched.step(state, jnp.asarray(v.numpy()), jnp.asarray(i, jnp.int32), x, noise=noise)
        err = assert_parity(np.asarray(x), x_ref.numpy(), what=f"{label} step {i}")
        worst = max(worst, err / max(1.0, float(np.abs(x_ref.numpy()).max())))
    return worst


# ----------------------------------------------------------------------------- flow-match Euler
@pytest.mark.parametrize("steps", [1, 4, 10, 20])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_flow_euler_parity(steps, shift):
    sched = make_scheduler("flow_euler", steps, shift=shift)
    ref = _ref_euler(steps, shift=shift)
    _check_schedule(sched, ref)
    _run_pair(sched, ref, label=f"euler n={steps} shift={shift}")


@pytest.mark.parametrize("steps,shift", [(1, 1.0), (4, 3.0), (10, 5.0), (20, 3.0)])
def test_flow_euler_sde_parity(steps, shift):
    sched = make_scheduler("flow_euler_sde", steps, shift=shift)
    ref = _ref_euler(steps, shift=shift, stochastic_sampling=True)
    _check_schedule(sched, ref)
    _run_pair(sched, ref, sde=True, seed=3, label=f"euler-sde n={steps} shift={shift}")


@pytest.mark.parametrize(
    "kw,mu,sigmas",
    [
        (dict(shift=7.3), None, None),  # a shift that is not exact in float32
        (dict(use_dynamic_shifting=True), 0.8, None),
        (dict(use_dynamic_shifting=True, time_shift_type="linear"), 1.7, None),
        (dict(shift=3.0, shift_terminal=0.1), None, None),
        (dict(shift=3.0, use_karras_sigmas=True), None, None),
        (dict(shift=3.0, use_exponential_sigmas=True), None, None),
        (dict(shift=3.0, use_beta_sigmas=True), None, None),
        (dict(invert_sigmas=True), None, None),
        (dict(shift=3.0), None, [1.0, 0.8, 0.55, 0.3, 0.1, 0.02]),
        (dict(use_dynamic_shifting=True), 1.1, [1.0, 0.75, 0.5, 0.25, 0.05]),
    ],
)
def test_flow_euler_options(kw, mu, sigmas):
    n = None if sigmas is not None else 8
    sched = make_scheduler("flow_euler", n, mu=mu, sigmas=sigmas, **kw)
    ref = _ref_euler(n, mu=mu, sigmas=sigmas, **kw)
    _check_schedule(sched, ref)
    _run_pair(sched, ref, seed=5, label=f"euler {kw}")


# ----------------------------------------------------------------------------- UniPC
@pytest.mark.parametrize("steps", [1, 4, 10, 20])
@pytest.mark.parametrize("flow_shift", [1.0, 3.0, 5.0])
def test_unipc_wan_parity(steps, flow_shift):
    """Wan2.1's configuration: order 2, bh2, lower_order_final, final sigma zero."""
    sched = make_scheduler("unipc", steps, **FLOW, flow_shift=flow_shift)
    ref = _ref_unipc(steps, flow_shift=flow_shift)
    _check_schedule(sched, ref)
    # diffusers truncates sigma * 1000 to int64 for the timesteps
    assert np.all(sched.timesteps == np.floor(sched.timesteps))
    _run_pair(sched, ref, seed=steps, label=f"unipc n={steps} shift={flow_shift}")


def _diffusers_fails(ref):
    """Run diffusers on the fake model; True if it raises or produces non-finite values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE, generator=g)
    w = 0.5 * torch.randn(SHAPE, generator=g)
    try:
        for t in ref.timesteps:
            x = ref.step(_fake_model(x, t, w), t, x).prev_sample
    except Exception:  # torch.linalg.solve on a singular system
        return True
    return not bool(torch.isfinite(x).all())


@pytest.mark.parametrize("order", [1, 2, 3])
@pytest.mark.parametrize("lower_order_final", [True, False])
@pytest.mark.parametrize("final_sigmas_type", ["zero", "sigma_min"])
def test_unipc_orders(order, lower_order_final, final_sigmas_type):
    kw = dict(solver_order=order, lower_order_final=lower_order_final, final_sigmas_type=final_sigmas_type, flow_shift=3.0)
    ref = _ref_unipc(10, **kw)
    try:
        sched = make_scheduler("unipc", 10, **kw)
    except ValueError as e:
        # only where diffusers itself cannot produce a finite sample (order > 1 onto the final sigma)
        assert "lower_order_final" in str(e)
        assert not lower_order_final and order > 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert _diffusers_fails(ref)
        return
    _check_schedule(sched, ref)
    _run_pair(sched, ref, seed=11, label=f"unipc {kw}")


@pytest.mark.parametrize(
    "kw,mu,sigmas,begin",
    [
        (dict(solver_type="bh1", flow_shift=3.0, final_sigmas_type="sigma_min"), None, None, 0),
        (dict(solver_type="bh1", solver_order=3, flow_shift=5.0, final_sigmas_type="sigma_min"), None, None, 0),
        (dict(disable_corrector=[0, 1, 5], flow_shift=3.0), None, None, 0),
        (dict(use_dynamic_shifting=True), 0.9, None, 0),
        (dict(use_dynamic_shifting=True, time_shift_type="linear"), 1.5, None, 0),
        (dict(flow_shift=3.0, shift_terminal=0.1), None, None, 0),
        (dict(flow_shift=3.0, thresholding=True, sample_max_value=1.5), None, None, 0),
        (dict(flow_shift=3.0), None, [1.0, 0.85, 0.7, 0.5, 0.3, 0.15, 0.05], 0),
        (dict(flow_shift=3.0), None, None, 4),  # video-to-video style start mid-schedule
        (dict(flow_shift=3.0, solver_order=3), None, None, 3),
    ],
)
def test_unipc_options(kw, mu, sigmas, begin):
    n = None if sigmas is not None else 12
    sched = make_scheduler("unipc", n, mu=mu, sigmas=sigmas, begin_index=begin, **kw)
    ref = _ref_unipc(n, mu=mu, sigmas=sigmas, **kw)
    _check_schedule(sched, ref)
    _run_pair(sched, ref, seed=21, begin=begin, label=f"unipc {kw} begin={begin}")


def test_unipc_bh1_final_zero():
    """diffusers' bh1 step onto sigma = 0 is nan (it multiplies B(h) = -inf by a zero residual);
    vidax drops the absent term, so the last step returns the x0 estimate, as bh2 does."""
    kw = dict(solver_type="bh1", flow_shift=3.0)
    n = 8
    sched = make_scheduler("unipc", n, **kw)
    ref = _ref_unipc(n, **kw)
    _check_schedule(sched, ref)
    g = torch.Generator().manual_seed(2)
    x_ref = torch.randn(SHAPE, generator=g)
    w = 0.5 * torch.randn(SHAPE, generator=g)
    x = jnp.asarray(x_ref.numpy())
    state = sched.init_state(x)
    for i, t in enumerate(ref.timesteps):
        v = _fake_model(x_ref, t, w)
        x_in = x
        x, state = sched.step(state, jnp.asarray(v.numpy()), jnp.asarray(i, jnp.int32), x, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            x_ref = ref.step(v, t, x_ref).prev_sample
        if i < n - 1:
            assert_parity(np.asarray(x), x_ref.numpy(), what=f"unipc bh1 step {i}")
        else:
            assert not bool(torch.isfinite(x_ref).all())  # the reference's nan
            x0 = np.asarray(x_in) - float(sched.sigmas[i]) * v.numpy()
            assert_parity(np.asarray(x), x0, what="unipc bh1 final step = x0 estimate")


def test_from_diffusers_config():
    ref = UniPCMultistepScheduler(**FLOW, flow_shift=3.0)  # Wan2.1's scheduler
    cfg = {"_class_name": "UniPCMultistepScheduler", "_diffusers_version": "0.42.1", **dict(ref.config)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of a saved config is known
        sched = from_diffusers_config(cfg, 10, flow_shift=5.0)
    assert type(sched).__name__ == "UniPCMultistep"
    ref = UniPCMultistepScheduler.from_config(ref.config, flow_shift=5.0)
    ref.set_timesteps(10)
    _check_schedule(sched, ref)

    fref = FlowMatchEulerDiscreteScheduler(shift=5.0, stochastic_sampling=True)
    fcfg = {"_class_name": "FlowMatchEulerDiscreteScheduler", **dict(fref.config)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fs = from_diffusers_config(fcfg, 6)
    assert fs.name == "flow_euler_sde" and fs.needs_noise
    fref.set_timesteps(6)
    _check_schedule(fs, fref)

    with pytest.raises(ValueError, match="_class_name"):
        from_diffusers_config({"_class_name": "DDIMScheduler"}, 10)


def test_unsupported_values_raise():
    for key, val in [
        ("prediction_type", "epsilon"),
        ("use_flow_sigmas", False),
        ("predict_x0", False),
        ("solver_type", "rk4"),
        ("final_sigmas_type", "one"),
        ("use_karras_sigmas", True),
        ("solver_order", 0),
    ]:
        with pytest.raises(ValueError, match=key):
            make_scheduler("unipc", 10, **{key: val})
    with pytest.raises(ValueError, match="time_shift_type"):
        make_scheduler("flow_euler", 10, time_shift_type="cubic")
    with pytest.raises(ValueError, match="mu"):
        make_scheduler("flow_euler", 10, use_dynamic_shifting=True)
    with pytest.raises(ValueError, match="stochastic_sampling"):
        make_scheduler("flow_euler_sde", 10, stochastic_sampling=False)
    with pytest.raises(ValueError, match="unknown scheduler"):
        make_scheduler("ddim", 10)
    sde = make_scheduler("flow_euler_sde", 4)
    x = jnp.zeros(SHAPE)
    with pytest.raises(ValueError, match="noise"):
        sde.step(sde.init_state(x), x, 0, x)
    with pytest.warns(UserWarning, match="not_a_key"):
        make_scheduler("unipc", 4, not_a_key=1)


@pytest.mark.parametrize("name", ["flow_euler", "unipc"])
def test_add_noise(name):
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(SHAPE, generator=g)
    noise = torch.randn(SHAPE, generator=g)
    if name == "unipc":
        sched = make_scheduler("unipc", 10, flow_shift=3.0)
        ref = _ref_unipc(10, flow_shift=3.0)
    else:
        sched = make_scheduler("flow_euler", 10, shift=3.0)
        ref = _ref_euler(10, shift=3.0)
    for i in (0, 3, 9):
        t = ref.timesteps[i : i + 1]
        if name == "unipc":
            want = ref.add_noise(x0, noise, t)
        else:
            want = ref.scale_noise(x0, t, noise)
        got = sched.add_noise(jnp.asarray(x0.numpy()), jnp.asarray(noise.numpy()), jnp.asarray(i, jnp.int32))
        assert_parity(np.asarray(got), want.numpy(), what=f"{name} add_noise step {i}")


@pytest.mark.parametrize("name", ["flow_euler", "flow_euler_sde", "unipc"])
def test_step_compiles_once(name):
    sched = make_scheduler(name, 10, **({"flow_shift": 3.0} if name == "unipc" else {"shift": 3.0}))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(SHAPE, dtype=np.float32))
    vs = [jnp.asarray(rng.standard_normal(SHAPE, dtype=np.float32)) for _ in range(10)]
    noises = [jnp.asarray(rng.standard_normal(SHAPE, dtype=np.float32)) for _ in range(10)]
    idx = [jnp.asarray(i, jnp.int32) for i in range(10)]
    state = sched.init_state(x)
    step = jax.jit(sched.step)
    with CompileCounter() as cc:
        for i in range(10):
            x, state = step(state, vs[i], idx[i], x, noises[i] if sched.needs_noise else None)
        x.block_until_ready()
    assert cc.count == 1, f"{name}: step compiled {cc.count} times over 10 steps"
    assert np.isfinite(np.asarray(x)).all()
    # and the jitted loop gives what the eager loop gives
    x2 = jnp.asarray(rng.standard_normal(SHAPE, dtype=np.float32))
    s_j, s_e = sched.init_state(x2), sched.init_state(x2)
    xj = xe = x2
    for i in range(10):
        nz = noises[i] if sched.needs_noise else None
        xj, s_j = step(s_j, vs[i], idx[i], xj, nz)
        xe, s_e = sched.step(s_e, vs[i], i, xe, nz)
    assert_parity(np.asarray(xj), np.asarray(xe), tol=1e-5, what=f"{name} jit vs eager")
