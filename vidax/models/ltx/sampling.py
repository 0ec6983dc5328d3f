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
                 stop: int | None = None, on_step=None, params=None, jit_model: bool = True, context=None):
    """LTX-Video 0.9 sampling. ``x``: latents [B, F, H, W, C] (float32); ``cond`` / ``uncond``:
    ``{"ctx": [B, L, D], "mask": [B, L]}``; ``model(params, x, t, ctx, mask) -> v`` with ``t`` [B] or
    per-token [B, S]. ``keep_first``: image-to-video mask [1, F, H, W, 1] (1 on the known first
    frame): its tokens get timestep 0 and the scheduler leaves them. With ``jit_model`` the model
    is traced into the one jitted step; otherwise it is called from Python (an offloading runner)
    and only guidance + update are jitted. ``context(params, ctx) -> tree``: the text keys / values,
    computed once here (then ``model`` gets that tree as its ``ctx``)."""
    use_cfg = uncond is not None and guidance != 1.0
    ts = jnp.asarray(np.asarray(sched.timesteps, np.float32))
    if use_cfg:
        ctx = jnp.concatenate([cond["ctx"], uncond["ctx"]], axis=0)
        mask = jnp.concatenate([cond["mask"], uncond["mask"]], axis=0)
    else:
        ctx, mask = cond["ctx"], cond["mask"]
    if context is not None:
        ctx = context(params, ctx)

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


def sample_av(model: Callable, sched, x, a, cond: dict, uncond: dict | None, *, guidance: float,
              audio_guidance: float, stg: float = 0.0, audio_stg: float = 0.0, modality: float = 1.0,
              audio_modality: float = 1.0, rescale_v: float = 0.0, rescale_a: float = 0.0, perturbed_attn: bool = False,
              keep_first=None, start: int = 0, stop: int | None = None, on_step=None, params=None, jit_model: bool = True,
              context=None, one_group: bool = False):
    """LTX-2 sampling of video ``x`` [B, F, H, W, C] and packed audio ``a`` [B, La, Ca] together.
    ``cond`` / ``uncond``: ``{"v", "a", "mask"}`` (connector outputs). ``model(params, x, a, t,
    ctx, actx, mask, perturb, xmod) -> (video v, audio v)``: ``perturb`` [n] 0 where
    spatio-temporal guidance skips self-attention (in the model's STG blocks), ``xmod`` [n] 0
    where the audio<->video attention is switched off (modality isolation); ``t`` is the scalar
    timestep. Guidance as ``LTX2Pipeline``: in x0 space, CFG + STG + modality deltas, then
    ``guidance_rescale``, back to velocities for the Euler step.

    The model passes of one step -- conditional, unconditional, perturbed, isolated -- are the
    same program on different inputs: they run as one ``lax.scan`` over pass groups (pairs
    with CFG, so a group is the usual 2B batch and CFG-parallel ``dp`` still splits it), traced
    once and holding one group's activations at a time.

    ``context(params, ctx, actx) -> tree``: the text keys / values of one pass group, computed once
    here per group (then ``model`` gets that tree as its ``ctx`` and None as its ``actx``).
    ``one_group``: every pass of a step in one batch (one DiT call per step: the step cache's unit)."""
    use_cfg = uncond is not None and (guidance > 1.0 or audio_guidance > 1.0)
    do_stg = (stg > 0.0 or audio_stg > 0.0) and perturbed_attn  # without perturbed attention the STG pass is the cond pass
    do_mod = modality > 1.0 or audio_modality > 1.0
    ts = jnp.asarray(np.asarray(sched.timesteps, np.float32))
    sig = jnp.asarray(np.asarray(sched.sigmas, np.float32))
    b = x.shape[0]
    one, zero = jnp.ones((b,), F32), jnp.zeros((b,), F32)
    # (name, context, perturb, xmod) per pass
    passes = [("cond", cond, one, one)] + ([("uncond", uncond, one, one)] if use_cfg else [])
    extra = ([("stg", cond, zero, one)] if do_stg else []) + ([("isolated", cond, one, zero)] if do_mod else [])
    if use_cfg and len(extra) == 1 and not one_group:
        extra.append(("spare", cond, one, one))  # keep groups of two (the spare pass is discarded)
    passes += extra
    per = len(passes) if one_group else 2 if use_cfg else 1
    groups = [passes[i:i + per] for i in range(0, len(passes), per)]
    names = [p[0] for p in passes]

    def stack(key):
        return jnp.stack([jnp.concatenate([jnp.asarray(p[1][key], F32) for p in g], 0) for g in groups])

    gin = {"ctx": stack("v"), "actx": stack("a"), "mask": stack("mask"),
           "perturb": jnp.stack([jnp.concatenate([p[2] for p in g]) for g in groups]),
           "xmod": jnp.stack([jnp.concatenate([p[3] for p in g]) for g in groups])}
    if context is not None:
        kvs = [context(params, gin["ctx"][k], gin["actx"][k]) for k in range(len(groups))]
        gin["ctx"], gin["actx"] = jax.tree.map(lambda *z: jnp.stack(z), *kvs), None

    def run(params, x, a, t, call, scan: bool, gin):
        xx, aa = jnp.concatenate([x] * per, 0), jnp.concatenate([a] * per, 0)

        def body(_, g):
            v, va = call(params, xx, aa, t, g["ctx"], g["actx"], g["mask"], g["perturb"], g["xmod"])
            return None, (v.astype(F32), va.astype(F32))

        if scan:
            _, (v, va) = jax.lax.scan(body, None, gin)
        else:
            outs = [body(None, jax.tree.map(lambda z: z[k], gin))[1] for k in range(len(groups))]
            v, va = jnp.stack([o[0] for o in outs]), jnp.stack([o[1] for o in outs])
        v = v.reshape(-1, *x.shape[1:])
        va = va.reshape(-1, *a.shape[1:])
        return {n: (v[k * b:(k + 1) * b], va[k * b:(k + 1) * b]) for k, n in enumerate(names)}

    def guide(x, a, outs, i):
        s = sig[i]
        x0 = lambda smp, v: smp - v * s  # noqa: E731
        xc, ac = x0(x, outs["cond"][0]), x0(a, outs["cond"][1])
        dv = da = 0.0
        if use_cfg:
            dv = (guidance - 1) * (xc - x0(x, outs["uncond"][0]))
            da = (audio_guidance - 1) * (ac - x0(a, outs["uncond"][1]))
        if do_stg:
            dv = dv + stg * (xc - x0(x, outs["stg"][0]))
            da = da + audio_stg * (ac - x0(a, outs["stg"][1]))
        if do_mod:
            dv = dv + (modality - 1) * (xc - x0(x, outs["isolated"][0]))
            da = da + (audio_modality - 1) * (ac - x0(a, outs["isolated"][1]))
        gv, ga = xc + dv, ac + da
        if rescale_v > 0:
            gv = rescale(gv, xc, rescale_v)
        if rescale_a > 0:
            ga = rescale(ga, ac, rescale_a)
        return (x - gv) / s, (a - ga) / s

    def update(x, a, state, vv, va, i):
        xn, state = sched.step(state, vv, i, x)
        an, _ = sched.step(state, va, i, a)
        if keep_first is not None:
            xn = keep_first * x + (1.0 - keep_first) * xn
        return xn, an, state

    if jit_model:
        @jax.jit
        def step(params, x, a, state, i, gin):  # (the pass inputs an argument: never compiled-in constants)
            outs = run(params, x, a, ts[i], model, True, gin)
            vv, va = guide(x, a, outs, i)
            return update(x, a, state, vv, va, i)
    else:
        g = jax.jit(guide)
        u = jax.jit(update)

        host_ts = np.asarray(sched.timesteps, np.float32)

        def step(params, x, a, state, i, gin):
            outs = run(params, x, a, jnp.float32(host_ts[int(i)]), model, False, gin)
            vv, va = g(x, a, outs, i)
            return u(x, a, state, vv, va, i)

    state = sched.init_state(x)
    n = len(sched.timesteps)
    stop = n if stop is None else stop
    for i in range(start, stop):
        t0 = time.perf_counter()
        x, a, state = step(params, x, a, state, jnp.int32(i), gin)
        if on_step is not None:
            x.block_until_ready()
            on_step(StepInfo(i, n, float(sched.timesteps[i]), time.perf_counter() - t0), x, a)
    return x, a
