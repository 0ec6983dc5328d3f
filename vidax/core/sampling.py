"""The denoising loop: one jitted step (model + classifier-free guidance + scheduler update),
called from an ordinary Python loop. Shared by every family.

Noise for stochastic schedulers is drawn from ``fold_in(key, step)``, so a run resumed at step k
is bitwise identical to one that never stopped.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.mesh import replicate


@dataclass
class StepInfo:
    index: int
    total: int
    timestep: float
    seconds: float


def _model_inputs(x, t, b, prepare, aux, i):
    """``(model input, per-sample timesteps [b] or [b, L])`` for step ``i``."""
    if prepare is None:
        return x, jnp.full((b,), t, jnp.float32)
    xin, tin = prepare(x, t, aux)
    tin = jnp.asarray(tin, jnp.float32)
    tin = jnp.broadcast_to(tin, (b,) + tin.shape[1:]) if tin.ndim else jnp.full((b,), tin, jnp.float32)
    return xin, tin


def _call(model_fn, params, x, t, ctx, aux):
    return model_fn(params, x, t, ctx) if aux is None else model_fn(params, x, t, ctx, aux)


#: jitted steps kept across ``sample()`` calls (batch prompts, A14B experts, resumed segments)
_STEPS: OrderedDict = OrderedDict()
_STEPS_KEPT = 16


def schedule_key(sched) -> str:
    """A content key of a scheduler: its class and every table and number it holds (what a jitted
    step bakes in), so two schedulers with equal contents share one compiled step."""
    h = hashlib.sha256(f"{type(sched).__module__}.{type(sched).__qualname__}".encode())
    for k, v in sorted(vars(sched).items()):
        if isinstance(v, np.ndarray):
            h.update(f"{k}:{v.dtype}:{v.shape}".encode())
            h.update(np.ascontiguousarray(v).tobytes())
        elif isinstance(v, (int, float, str, bool, tuple, list, dict, type(None))):
            h.update(f"{k}={v!r}".encode())
    return h.hexdigest()


def _batched(cond, uncond, use_cfg: bool, ready: bool):
    """The model's context: ``cond`` as it is when computed once for the whole batch (``ready``),
    else the CFG batch ``[cond; uncond]``."""
    return cond if ready or not use_cfg else jnp.concatenate([cond, uncond], axis=0)


def make_step(model_fn: Callable, sched, use_cfg: bool, donate: bool = False, prepare: Callable | None = None,
              with_aux: bool = False, cache_key=None, ctx_ready: bool = False):
    """Build the jitted step ``(params, x, state, i, cond, uncond, guidance, key[, aux]) -> (x, state)``.

    ``cache_key``: a hashable identity of ``model_fn`` (the model's config, mesh and parallelism:
    never its weights, which are the ``params`` argument). With it, the step is built once and
    reused by every later call with the same key, scheduler contents and conditioning hooks (a
    ``prepare`` then needs a ``key`` attribute), so a second prompt, the second expert of a
    two-expert model or a resumed segment compiles nothing new. ``model_fn`` must not hold weights.

    ``model_fn(params, x, t, ctx) -> velocity``, ``x`` channels-last ``[B, F, H, W, C]``.
    With ``use_cfg`` the conditional and unconditional passes run as one batch of 2B.

    Conditioning hooks (all inside the one jitted step): ``prepare(x, t, aux) -> (model_input, t)``
    builds the model's input from the latents (e.g. channel-concatenated image conditions, or the
    known frames substituted in) and its timesteps (scalar, ``[B]`` or per-token ``[B, L]``); with
    ``with_aux`` the step takes a pytree ``aux`` (passed to ``prepare`` and as ``model_fn``'s last
    argument, ``model_fn(params, x, t, ctx, aux)``). The scheduler always updates ``x`` itself.
    ``ctx_ready``: ``cond`` is the model's context for the whole (CFG) batch, computed once
    (:func:`denoise`'s ``context``); ``uncond`` is then unused.
    """
    if cache_key is not None and (prepare is None or hasattr(prepare, "key")):
        k = (cache_key, schedule_key(sched), use_cfg, donate, with_aux, getattr(prepare, "key", None), ctx_ready)
        if k in _STEPS:
            _STEPS.move_to_end(k)
            return _STEPS[k]
        step = _STEPS[k] = make_step(model_fn, sched, use_cfg, donate, prepare, with_aux, ctx_ready=ctx_ready)
        while len(_STEPS) > _STEPS_KEPT:
            _STEPS.popitem(last=False)
        return step
    timesteps = jnp.asarray(np.asarray(sched.timesteps, np.float32))

    def step(params, x, state, i, cond, uncond, guidance, key, aux=None):
        t = timesteps[i]
        b = x.shape[0]
        xin, tin = _model_inputs(x, t, b, prepare, aux, i)
        if use_cfg:
            v = _call(model_fn, params, jnp.concatenate([xin, xin], axis=0), jnp.concatenate([tin, tin], axis=0),
                      _batched(cond, uncond, use_cfg, ctx_ready), aux)
            vc, vu = v[:b].astype(jnp.float32), v[b:].astype(jnp.float32)
            v = vu + guidance * (vc - vu)
        else:
            v = _call(model_fn, params, xin, tin, cond, aux).astype(jnp.float32)
        noise = jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32) if sched.needs_noise else None
        return sched.step(state, v, i, x, noise=noise)

    if not with_aux:
        def plain(params, x, state, i, cond, uncond, guidance, key):
            return step(params, x, state, i, cond, uncond, guidance, key)

        return jax.jit(plain, donate_argnums=(1, 2) if donate else ())
    return jax.jit(step, donate_argnums=(1, 2) if donate else ())


_UPDATES: OrderedDict = OrderedDict()


def make_update(sched, use_cfg: bool, donate: bool = False):
    """The jitted step *without* the model: ``(x, state, v, i, guidance, key) -> (x, state)``, for
    models that are themselves several programs (e.g. weight offloading streams chunks, a step
    cache decides between units); ``donate``: ``x`` and ``state`` are updated in place. Built once
    per scheduler contents (:func:`schedule_key`), so later runs compile nothing new."""
    k = (schedule_key(sched), use_cfg, donate)
    if k not in _UPDATES:
        while len(_UPDATES) >= _STEPS_KEPT:
            _UPDATES.popitem(last=False)
        _UPDATES[k] = _make_update(sched, use_cfg, donate)
    _UPDATES.move_to_end(k)
    return _UPDATES[k]


def _make_update(sched, use_cfg: bool, donate: bool = False):
    def update(x, state, v, i, guidance, key):
        b = x.shape[0]
        if use_cfg:
            vc, vu = v[:b].astype(jnp.float32), v[b:].astype(jnp.float32)
            v = vu + guidance * (vc - vu)
        noise = jax.random.normal(jax.random.fold_in(key, i), x.shape, jnp.float32) if sched.needs_noise else None
        return sched.step(state, v.astype(jnp.float32), i, x, noise=noise)

    return jax.jit(update, donate_argnums=(0, 1) if donate else ())


def _streamed_step(model_call: Callable, sched, use_cfg: bool, prepare: Callable | None = None,
                   with_aux: bool = False, ctx_ready: bool = False):
    """A step for a model that is called from Python (``model_call(x, t, ctx[, aux]) -> v``)."""
    update = make_update(sched, use_cfg, donate=True)  # denoise() hands it its own copies
    timesteps = np.asarray(sched.timesteps, np.float32)
    prep = None if prepare is None else jax.jit(lambda x, t, aux, b: _model_inputs(x, t, b, prepare, aux, None),
                                                static_argnums=3)

    def step(params, x, state, i, cond, uncond, guidance, key, aux=None):
        b = x.shape[0]
        t = float(timesteps[int(i)])
        xin, tin = (x, jnp.full((b,), t, jnp.float32)) if prep is None else prep(x, jnp.float32(t), aux, b)
        call = model_call if not with_aux else (lambda xx, tt, cc: model_call(xx, tt, cc, aux))
        if use_cfg:
            v = call(jnp.concatenate([xin, xin], axis=0), jnp.concatenate([tin, tin], axis=0),
                     _batched(cond, uncond, use_cfg, ctx_ready))
        else:
            v = call(xin, tin, cond)
        return update(x, state, v, i, guidance, key)

    return step


def denoise(model_fn, params, sched, x, cond, uncond=None, *, guidance: float = 1.0, seed: int = 0,
            start: int = 0, state=None, on_step: Callable[[StepInfo, jnp.ndarray, object], None] | None = None,
            model_call: Callable | None = None, stop: int | None = None, prepare: Callable | None = None,
            aux=None, cache_key=None, context: Callable | None = None):
    """Run steps ``start..stop-1`` (``stop`` defaults to N) from latents ``x`` (channels-last,
    float32; copied once, then donated step to step, as is the scheduler state). Returns ``(x,
    state)``; a run split into segments ``[0, k)`` and ``[k, N)`` (passing the returned state on)
    is the same run as one that never stopped.

    ``model_fn(params, x, t, ctx)`` is traced into one jitted step; alternatively ``model_call(x, t,
    ctx)`` is called from Python each step (models that stream their weights) and only the
    guidance + scheduler update is jitted. ``prepare`` / ``aux``: conditioning hooks, see
    :func:`make_step` (with ``aux`` given, the model also gets it as its last argument);
    ``cache_key``: see :func:`make_step`. ``context(params, ctx, aux) -> tree``: computed once here
    from the text conditioning as the steps batch it (``[cond; uncond]`` with CFG), and every
    step's model gets that tree in place of ``ctx`` (the text keys / values once per segment: a
    resumed run recomputes them, nothing of it is in a checkpoint)."""
    use_cfg = uncond is not None and guidance != 1.0
    with_aux = aux is not None
    ready = context is not None
    if ready:
        cond, uncond = context(params, _batched(cond, uncond, use_cfg, False), aux), None
    if model_call is not None:
        step = _streamed_step(model_call, sched, use_cfg, prepare, with_aux, ctx_ready=ready)
    else:  # the latents and the scheduler state are donated: each step updates them in place
        step = make_step(model_fn, sched, use_cfg, donate=True, prepare=prepare, with_aux=with_aux,
                         cache_key=cache_key, ctx_ready=ready)
    # our own copies, so the donation never consumes an array the caller still holds
    x = jnp.array(x, jnp.float32, copy=True)
    state = sched.init_state(x) if state is None else jax.tree.map(lambda a: jnp.array(a, copy=True), state)
    key = jax.random.key(seed)
    g = jnp.float32(guidance)
    n = len(sched.timesteps)
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise ValueError(f"denoise: need 0 <= start ({start}) <= stop ({stop}) <= steps ({n})")
    extra = (aux,) if with_aux else ()
    multihost = jax.process_count() > 1
    for i in range(start, stop):
        t0 = time.perf_counter()
        x, state = step(params, x, state, jnp.int32(i), cond, uncond if use_cfg or ready else cond, g, key, *extra)
        if multihost:  # latents sharded over other hosts' devices: gathered, so every process can read them
            x, state = replicate((x, state))
        if on_step is not None:
            x.block_until_ready()
            on_step(StepInfo(i, n, float(sched.timesteps[i]), time.perf_counter() - t0), x, state)
    return x, state


def expert_segments(sched, boundary_ratio: float | None, start: int = 0) -> list[tuple[int, int, int]]:
    """``[(expert, first step, stop step)]`` covering steps ``start..N-1`` of ``sched``. With a
    ``boundary_ratio`` (two-expert models such as Wan2.2 A14B) expert 1 takes the steps whose
    timestep is >= ``boundary_ratio * num_train_timesteps`` and expert 2 the rest (the reference's
    rule); without one, a single segment of expert 1."""
    n = len(sched.timesteps)
    if boundary_ratio is None:
        return [(1, start, n)] if start < n else []
    boundary = float(boundary_ratio) * float(getattr(sched, "config", {}).get("num_train_timesteps", 1000))
    ts = np.asarray(sched.timesteps, np.float64)
    k = next((i for i in range(n) if not ts[i] >= boundary), n)
    segs = [(1, start, k), (2, max(start, k), n)]
    return [sg for sg in segs if sg[1] < sg[2]]
