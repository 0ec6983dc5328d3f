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


@pytest.mark.parametrize("mesh", [None, "dp=2,tp=2"])
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
