"""The LTX denoising loops: one jitted step (DiT + guidance + scheduler update) in a Python loop.

LTX-Video 0.9 (:func:`sample_video`): classifier-free guidance on velocities with the optional
``guidance_rescale``; image-to-video keeps the first latent frame (per-token timestep 0 there).

LTX-2 (:func:`sample_av`): video and audio latents stepped together; the reference's guidance in
x0 space -- CFG (``(g - 1) * (cond - uncond)``), spatio-temporal guidance (a pass with self-attention
skipped in chosen blocks) and modality-isolation guidance (a pass without the audio<->video
attention), then ``guidance_rescale``, then back to velocities for the Euler step.

Noise is never drawn here (flow-matching Euler is deterministic), so a run resumed at step k is
bitwise the run that never stopped.
"""
from __future__ import annotations

import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.sampling import StepInfo

F32 = jnp.float32


def rescale(guided, cond, phi: float):
    """``rescale_noise_cfg``: mix ``guided`` rescaled to ``cond``'s per-sample std (unbiased, as
    torch) with itself by ``phi``."""
    ax = tuple(range(1, guided.ndim))
    n = np.prod([guided.shape[a] for a in ax])
    std = lambda a: jnp.sqrt(jnp.sum(jnp.square(a - a.mean(axis=ax, keepdims=True)), axis=ax, keepdims=True) / (n - 1))  # noqa: E731
    return phi * (guided * (std(cond) / std(guided))) + (1 - phi) * guided


def sample_video(model: Callable, sched, x, cond: dict, uncond: dict | None, *, guidance: float,
                 guidance_rescale: float = 0.0, keep_first: jnp.ndarray | None = None, start: int = 0,
                 stop: int | None = None, on_step=None, params=None, jit_model: bool = True):
    """LTX-Video 0.9 sampling. ``x``: latents [B, F, H, W, C] (float32); ``cond`` / ``uncond``:
    ``{"ctx": [B, L, D], "mask": [B, L]}``; ``model(params, x, t, ctx, mask) -> v`` with ``t`` [B] or
    per-token [B, S]. ``keep_first``: image-to-video mask [1, F, H, W, 1] (1 on the known first
    frame): its tokens get timestep 0 and the scheduler leaves them. With ``jit_model`` the model
    is traced into the one jitted step; otherwise it is called from Python (an offloading runner)
    and only guidance + update are jitted."""
    use_cfg = uncond is not None and guidance != 1.0
    ts = jnp.asarray(np.asarray(sched.timesteps, np.float32))
    if use_cfg:
        ctx = jnp.concatenate([cond["ctx"], uncond["ctx"]], axis=0)
        mask = jnp.concatenate([cond["mask"], uncond["mask"]], axis=0)
    else:
        ctx, mask = cond["ctx"], cond["mask"]

    def inputs(x, i):
        b = x.shape[0]
        t = ts[i]
        if keep_first is None:
            tt = jnp.full((b,), t, F32)
        else:
            tt = jnp.broadcast_to((t * (1.0 - keep_first[..., 0])).reshape(1, -1), (b, x.shape[1] * x.shape[2] * x.shape[3]))
        if use_cfg:
            return jnp.concatenate([x, x], 0), jnp.concatenate([tt, tt], 0)
        return x, tt

    def update(x, state, v, i, g):
        b = x.shape[0]
        v = v.astype(F32)
        if use_cfg:
            vc, vu = v[:b], v[b:]
            v = vu + g * (vc - vu)
            if guidance_rescale > 0:
                v = rescale(v, vc, guidance_rescale)
        xn, state = sched.step(state, v, i, x)
        if keep_first is not None:
            xn = keep_first * x + (1.0 - keep_first) * xn
        return xn, state

    if jit_model:
        @jax.jit
        def step(params, x, state, i, g, ctx, mask):
            xin, tt = inputs(x, i)
            return update(x, state, model(params, xin, tt, ctx, mask), i, g)
    else:
        prep = jax.jit(inputs)
        upd = jax.jit(update)

        def step(params, x, state, i, g, ctx, mask):
            xin, tt = prep(x, i)
            return upd(x, state, model(params, xin, tt, ctx, mask), i, g)

    state = sched.init_state(x)
    n = len(sched.timesteps)
    stop = n if stop is None else stop
    g = jnp.float32(guidance)
    for i in range(start, stop):
        t0 = time.perf_counter()
        x, state = step(params, x, state, jnp.int32(i), g, ctx, mask)
        if on_step is not None:
            x.block_until_ready()
            on_step(StepInfo(i, n, float(sched.timesteps[i]), time.perf_counter() - t0), x, state)
    return x, state
