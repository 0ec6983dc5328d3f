"""Compile once: the jitted sampling step is shared across sample() calls (later prompts, the two
experts of Wan2.2 A14B, resumed segments) and holds no weights; a second process running the same
stages reads every program back from the persistent compilation cache (the cache's own hit events,
recorded per stage)."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref

import numpy as np
import pytest

from vidax.core import sampling
from vidax.core.jit import CompileCounter
from vidax.models.wan.pipeline import WanT2V

from tests import sweep


# one device, and one of the two meshes in make test (both in make test-all); sp=4 on 2 heads: Ulysses 2 x ring 2
@pytest.mark.parametrize("mesh", [None] + sweep.sample(["dp=2,tp=2", "dp=2,sp=4"], 1, "one-step-mesh"))
def test_one_step_program_across_prompts_and_experts(mesh):
    pipe = WanT2V("tiny-a14b", mesh=mesh)
    rng = np.random.default_rng(0)
    cond = lambda: rng.standard_normal((1, 256, 32)).astype(np.float32)  # noqa: E731
    kw = dict(height=64, width=64, num_frames=9, guidance=5.0, guidance_2=3.0)
    sampling._STEPS.clear()
    a = pipe.sample_latents(cond(), cond(), seed=1, steps=4, **kw)
    assert len(sampling._STEPS) == 1  # both experts (same shapes) ran the one step program
    with CompileCounter() as again:  # another prompt, another seed: nothing new to compile
        b = pipe.sample_latents(cond(), cond(), seed=2, steps=4, **kw)
    assert again.count == 0 and not np.array_equal(a, b)
    with CompileCounter() as other:  # another schedule is another program
        pipe.sample_latents(cond(), cond(), seed=2, steps=5, **kw)
    assert other.count >= 1 and len(sampling._STEPS) == 2


def test_cached_step_holds_no_weights():
    pipe = WanT2V("tiny", mesh="tp=2")
    runner, cfg = pipe.load_dit()
    leaves = [weakref.ref(x) for x in __import__("jax").tree.leaves(runner.params)]
    cond = np.zeros((1, 256, 32), np.float32)
    sampling._STEPS.clear()
    pipe.sample_latents(cond, cond, seed=0, steps=2, height=64, width=64, num_frames=9, dit=(runner, cfg))
    assert len(sampling._STEPS) == 1
    del runner
    gc.collect()
    assert all(r() is None for r in leaves)  # the cache kept the program, not the weights


def test_warm_process_reads_every_program_from_the_persistent_cache(tmp_path):
    env = {**os.environ, "VIDAX_COMPILE_CACHE": str(tmp_path / "cache"), "VIDAX_COMPILE_CACHE_MIN_SECONDS": "0",
           "PYTHONUNBUFFERED": "1"}
    store = tmp_path / "store"

    def run(run_id):
        p = subprocess.run([sys.executable, "-m", "stages.cli", "generate", "--prompt", "a heron at dawn",
                            "--store", str(store), "--run-id", run_id], env=env, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        recs = store / "runs" / run_id / "records"
        return {f.stem.replace("%2F", "/"): json.loads(f.read_text()).get("compile") for f in recs.rglob("*.json")}

    cold = run("cold")
    assert any(os.scandir(tmp_path / "cache"))  # programs written
    warm = run("warm")  # another process, the same request shapes
    for stage in ("encode", "sample"):
        c = next(v for k, v in cold.items() if k.endswith(stage))
        w = next(v for k, v in warm.items() if k.endswith(stage))
        assert c["compiled"] >= 1 and c["cache_hits"] == 0, (stage, c)
        assert w["compiled"] == 0 and w["cache_hits"] == c["compiled"], (stage, w, c)


def test_latents_and_scheduler_state_are_donated_step_to_step():
    """``denoise`` copies the caller's latents and state once, then every step updates them in place
    (donated buffers), with results bitwise equal to a step that copies."""
    import jax
    import jax.numpy as jnp

    from vidax.schedulers import UniPCMultistep

    sched = UniPCMultistep(4, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    model = lambda params, x, t, ctx: x * params + ctx.mean() + t[:, None, None, None, None] / 1000  # noqa: E731
    rng = np.random.default_rng(0)
    x0 = jnp.asarray(rng.standard_normal((1, 2, 4, 4, 3)), jnp.float32)
    cond = jnp.asarray(rng.standard_normal((1, 5, 3)), jnp.float32)
    params = jnp.float32(0.5)
    donating = sampling.make_step(model, sched, False, donate=True)
    x, state = jnp.array(x0, copy=True), sched.init_state(x0)
    leaves = [x, *jax.tree.leaves(state)]
    x1, s1 = donating(params, x, state, jnp.int32(0), cond, cond, jnp.float32(1), jax.random.key(0))
    assert all(a.is_deleted() for a in leaves)  # the step took them over
    plain = sampling.make_step(model, sched, False)
    x2, s2 = plain(params, x0, sched.init_state(x0), jnp.int32(0), cond, cond, jnp.float32(1), jax.random.key(0))
    assert np.asarray(x1).tobytes() == np.asarray(x2).tobytes()
    # denoise: the caller's arrays survive, the run equals one that never donated
    out, _ = sampling.denoise(model, params, sched, x0, cond)
    assert not x0.is_deleted()
    ref, st = x0, sched.init_state(x0)
    for i in range(4):
        ref, st = plain(params, ref, st, jnp.int32(i), cond, cond, jnp.float32(1), jax.random.key(0))
    assert np.asarray(out).tobytes() == np.asarray(ref).tobytes()


def _constant_bytes(lowered) -> int:
    """Bytes of the array constants (not scalars) compiled into a lowered program."""
    import re

    total = 0
    for m in re.finditer(r"stablehlo\.constant dense<[^>]*>\s*:\s*tensor<([0-9x]+)x(f32|bf16|i32)>", lowered.as_text()):
        total += int(np.prod([int(d) for d in m.group(1).split("x")])) * (2 if m.group(2) == "bf16" else 4)
    return total


def _wan_step_model(mesh, x, t, ctx):
    """(fn, arguments with the tables, fn, arguments without) of Wan's step model."""
    from functools import partial

    import jax

    from vidax.models.wan import dit as wdit
    from vidax.models.wan import pipeline as wpipe

    dit, cfg = WanT2V("tiny", mesh=mesh).load_dit()
    if mesh is None:
        grid = (x.shape[1], x.shape[2] // 2, x.shape[3] // 2)
        return (jax.jit(partial(wpipe._dit_apply, cfg=cfg)), ((dit, wdit.rope_tables(cfg, grid)), x, t, ctx),
                jax.jit(lambda p, *a: wdit.forward(p, cfg, *a)), (dit, x, t, ctx))
    spec = dit.program()
    return jax.jit(spec.apply), (dit.step_params({"x": x.shape}), x, t, ctx), jax.jit(spec.apply), (dit.params, x, t, ctx)


def _cosmos_step_model(mesh, x, t, ctx):
    import jax
    import jax.numpy as jnp

    from vidax.models.cosmos import dit as cdit
    from vidax.models.cosmos.pipeline import CosmosPredict

    dit, cfg = CosmosPredict("tiny", mesh=mesh).load_dit()
    cm = jnp.zeros((*x.shape[:4], 1), jnp.float32)  # the conditioning mask: an argument too
    if mesh is None:
        grid = (x.shape[1], x.shape[2] // 2, x.shape[3] // 2)
        fn = jax.jit(lambda p, x, t, ctx, cm: cdit.forward(p[0], cfg, x, t, ctx, cond_mask=cm, rope=p[1]))
        return (fn, ((dit, cdit.rope_tables(cfg, grid)), x, t, ctx, cm),
                jax.jit(lambda p, x, t, ctx, cm: cdit.forward(p, cfg, x, t, ctx, cond_mask=cm)), (dit, x, t, ctx, cm))
    fn = jax.jit(lambda p, x, t, ctx, cm: dit.apply(p, x, t, ctx, cond_mask=cm))
    return fn, (dit.step_params({"x": x.shape}), x, t, ctx, cm), fn, (dit.params, x, t, ctx, cm)


def _hunyuanvideo_step_model(mesh, x, t, ctx):
    import jax
    import jax.numpy as jnp

    from vidax.models.hunyuanvideo import dit as hdit
    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoT2V

    dit, cfg = HunyuanVideoT2V("tiny", mesh=mesh).load_dit()
    rng = np.random.default_rng(1)
    rest = (jnp.ones(ctx.shape[:2], jnp.float32), jnp.asarray(rng.standard_normal((2, 24)), jnp.float32),
            jnp.full((2,), 6000.0, jnp.float32))  # mask, pooled CLIP vector, embedded guidance
    if mesh is None:
        fn = jax.jit(lambda p, *a: hdit.forward(p[0], cfg, *a, rope=p[1]))
        return (fn, ((dit, hdit.rope_tables(cfg, hdit.grid_of(cfg, x.shape))), x, t, ctx, *rest),
                jax.jit(lambda p, *a: hdit.forward(p, cfg, *a)), (dit, x, t, ctx, *rest))
    fn = jax.jit(dit.apply)
    return fn, (dit.step_params({"x": x.shape}), x, t, ctx, *rest), fn, (dit.params, x, t, ctx, *rest)


# every family, on one device or on the mesh (one each in make test; both in make test-all)
@pytest.mark.parametrize("family,mesh", sweep.sample_per_group(
    [(f, m) for f in ["wan", "cosmos", "hunyuanvideo"] for m in [None, "tp=2"]], lambda c: c[0], 1, "rope-args"))
def test_rope_tables_are_arguments_of_the_step_not_constants(family, mesh):
    """The sampling step gets the RoPE tables as arguments (~38 MB at 720p would otherwise be compiled
    into the executable), on one device and on a mesh, with the same result."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    channels, text = {"wan": (16, 32), "cosmos": (16, 72), "hunyuanvideo": (16, 32)}[family]
    x = jnp.asarray(rng.standard_normal((2, 3, 16, 16, channels)), jnp.float32)
    t, ctx = jnp.asarray([500.0, 500.0]), jnp.asarray(rng.standard_normal((2, 16, text)), jnp.float32)
    model = {"wan": _wan_step_model, "cosmos": _cosmos_step_model, "hunyuanvideo": _hunyuanvideo_step_model}[family]
    fn, args, baked, baked_args = model(mesh, x, t, ctx)
    table = 3 * 8 * 8 * 4  # one float32 table row per token, at least 4 bytes wide each
    assert _constant_bytes(baked.lower(*baked_args)) >= 2 * table
    assert _constant_bytes(fn.lower(*args)) < table  # (small index tables may remain)
    np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(baked(*baked_args)))


@pytest.mark.parametrize("mesh", [None, "tp=2"])
def test_ltx_step_model_takes_its_rope_tables_as_arguments(mesh):
    """LTX-Video's step model gets (weights, RoPE tables) as its argument: no table is compiled in."""
    import jax
    import jax.numpy as jnp

    from vidax.models.ltx.ltxv import LTXVideo

    pipe = LTXVideo("tiny", mesh=mesh)
    params, cfg = pipe.load_dit()
    grid = pipe.latent_grid(64, 64, 9)
    model, prm, jit_model, put = pipe.video_model(params, cfg, grid, 25.0)
    assert jit_model and len(prm) == 2
    rng = np.random.default_rng(0)
    x = put(jnp.asarray(rng.standard_normal((1, *grid, cfg.in_channels)), jnp.float32))
    t, mask = put(jnp.full((1,), 500.0, jnp.float32)), put(jnp.ones((1, 8), jnp.float32))
    ctx = put(jnp.asarray(rng.standard_normal((1, 8, cfg.caption_channels)), jnp.float32))
    cos = prm[1][0]
    tokens = int(np.prod(grid))  # patch size 1
    assert cos.shape[0] * cos.shape[-1] >= tokens  # (a table row per token)
    assert _constant_bytes(jax.jit(model).lower(prm, x, t, ctx, mask)) < cos.size * 4
    v = jax.jit(model)(prm, x, t, ctx, mask)
    assert v.shape == x.shape and bool(jnp.isfinite(v).all())
