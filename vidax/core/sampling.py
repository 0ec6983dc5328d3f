"""The denoising loop: one jitted step (model + classifier-free guidance + scheduler update),
called from an ordinary Python loop. Shared by every family.

Noise for stochastic schedulers is drawn from ``fold_in(key, step)``, so a run resumed at step k
is bitwise identical to one that never stopped.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclass
class StepInfo:
    index: int
    total: int
    timestep: float
    seconds: float


def make_step(model_fn: Callable, sched, use_cfg: bool, donate: bool = False):
    """Build the jitted step ``(params, x, state, i, cond, uncond, guidance, key) -> (x, state)``.

    ``model_fn(params, x, t, ctx) -> velocity``, ``x`` channels-last ``[B, F, H, W, C]``.
    With ``use_cfg`` the conditional and unconditional passes run as one batch of 2B.
    """
    timesteps = jnp.asarray(np.asarray(sched.timesteps, np.float32))

    def step(params, x, state, i, cond, uncond, guidance, key):
        t = timesteps[i]
        b = x.shape[0]
        if use_cfg:
            xx = jnp.concatenate([x, x], axis=0)
            v = model_fn(params, xx, jnp.full((2 * b,), t, jnp.float32), jnp.concatenate([cond, uncond], axis=0))
            vc, vu = v[:b].astype(jnp.float32), v[b:].astype(jnp.float32)
            v = vu + guidance * (vc - vu)
        else:
            v = model_fn(params, x, jnp.full((b,), t, jnp.float32), cond).astype(jnp.float32)
        noise = jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32) if sched.needs_noise else None
        return sched.step(state, v, i, x, noise=noise)

    return jax.jit(step, donate_argnums=(1, 2) if donate else ())


def make_update(sched, use_cfg: bool):
    """The jitted step *without* the model: ``(x, state, v, i, guidance, key) -> (x, state)``, for
    models that are themselves several programs (e.g. weight offloading streams chunks)."""

    def update(x, state, v, i, guidance, key):
        b = x.shape[0]
        if use_cfg:
            vc, vu = v[:b].astype(jnp.float32), v[b:].astype(jnp.float32)
            v = vu + guidance * (vc - vu)
        noise = jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32) if sched.needs_noise else None
        return sched.step(state, v.astype(jnp.float32), i, x, noise=noise)

    return jax.jit(update)


def _streamed_step(model_call: Callable, sched, use_cfg: bool):
    """A step for a model that is called from Python (``model_call(x, t, ctx) -> v``)."""
    update = make_update(sched, use_cfg)
    timesteps = np.asarray(sched.timesteps, np.float32)

    def step(params, x, state, i, cond, uncond, guidance, key):
        b = x.shape[0]
        t = float(timesteps[int(i)])
        if use_cfg:
            v = model_call(jnp.concatenate([x, x], axis=0), jnp.full((2 * b,), t, jnp.float32),
                           jnp.concatenate([cond, uncond], axis=0))
        else:
            v = model_call(x, jnp.full((b,), t, jnp.float32), cond)
        return update(x, state, v, i, guidance, key)

    return step


def denoise(model_fn, params, sched, x, cond, uncond=None, *, guidance: float = 1.0, seed: int = 0,
            start: int = 0, state=None, on_step: Callable[[StepInfo, jnp.ndarray, object], None] | None = None,
            model_call: Callable | None = None):
    """Run steps ``start..N-1`` from latents ``x`` (channels-last, float32). Returns ``(x, state)``.

    ``model_fn(params, x, t, ctx)`` is traced into one jitted step; alternatively ``model_call(x, t,
    ctx)`` is called from Python each step (models that stream their weights) and only the
    guidance + scheduler update is jitted."""
    use_cfg = uncond is not None and guidance != 1.0
    step = _streamed_step(model_call, sched, use_cfg) if model_call is not None else make_step(model_fn, sched, use_cfg)
    x = jnp.asarray(x, jnp.float32)
    state = sched.init_state(x) if state is None else state
    key = jax.random.key(seed)
    g = jnp.float32(guidance)
    n = len(sched.timesteps)
    for i in range(start, n):
        t0 = time.perf_counter()
        x, state = step(params, x, state, jnp.int32(i), cond, uncond if use_cfg else cond, g, key)
        if on_step is not None:
            x.block_until_ready()
            on_step(StepInfo(i, n, float(sched.timesteps[i]), time.perf_counter() - t0), x, state)
    return x, state
