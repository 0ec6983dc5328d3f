"""Text K/V once (issue #29, item 5): the cross-attention keys and values of the text (and Wan I2V's
image tokens) are computed once per sample stage -- per Wan2.2 expert, per LTX-2 pass group -- and
every step reads them: the same latents as the per-step computation (``runner.TEXT_KV_ONCE`` off),
on one device, on meshes and with offloaded blocks; the K/V projection runs a number of times
that does not grow with the steps (a runtime count), and a resumed run recomputes them."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from vidax.core import runner as vrunner
from vidax.core import sampling

from tests import sweep

#: the contract: within 1e-6 of the per-step computation (bitwise at XLA's defaults, make test-all).
#: make test's programs (XLA:CPU fusion emitters off, tests/sweep.py) round the two paths' different
#: programs differently (LTX-2 measured 4.3e-6 on values of 4): there, the suite's parity bound.
TOL = 1e-6


def _clear_programs():
    """Forget every compiled step / context program, so the counting hooks below are traced in."""
    from vidax.models.cosmos import pipeline as cp
    from vidax.models.ltx import ltx2, ltxv
    from vidax.models.wan import pipeline as wp

    sampling._STEPS.clear()
    vrunner._CONTEXTS.clear()
    for f in (wp._dit_context, cp._single_device_step, cp._single_device_context, ltxv._context_program,
              ltx2._context_program):
        f.cache_clear()


@pytest.fixture
def count_kv(monkeypatch):
    """Counts, at run time (a host callback per executed call), the text K/V projections of every
    family: each cross-attention's ``context_kv``, which the per-step path calls inside the step."""
    from vidax.models.cosmos.dit import CosmosAttention
    from vidax.models.ltx.layers import Attention
    from vidax.models.wan.dit import WanAttention

    box = []
    for cls in (WanAttention, CosmosAttention, Attention):
        orig = cls.context_kv

        def wrapped(self, *a, _orig=orig, **k):
            out = _orig(self, *a, **k)
            jax.debug.callback(lambda: box.append(1))
            return out

        monkeypatch.setattr(cls, "context_kv", wrapped)
    _clear_programs()
    yield box
    _clear_programs()


def _equal(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        y = np.asarray(y)
        tol = 1e-4 * max(1.0, float(np.abs(y).max())) if sweep.EMITTERS_OFF else TOL
        np.testing.assert_allclose(np.asarray(x), y, rtol=0, atol=tol)


# ----------------------------------------------------------------------------------- the families
def _wan(source="tiny", **pipe_kw):
    from vidax.models.wan.pipeline import WanT2V

    pipe = WanT2V(source, **pipe_kw)
    rng = np.random.default_rng(0)
    c, u = (rng.standard_normal((1, 11, 32)).astype(np.float32) for _ in range(2))
    kw = dict(height=64, width=64, num_frames=5, guidance=5.0, seed=1)
    if pipe.boundary_ratio is not None:
        kw["guidance_2"] = 3.0
    if pipe.image_to_video:
        kw["image_cond"] = pipe.encode_image((rng.random((48, 80, 3)) * 255).astype(np.uint8), 64, 64, 5)
    layers = pipe.dit_config().num_layers * (2 if pipe.boundary_ratio is not None else 1)
    return (lambda steps: pipe.sample_latents(c, u, steps=steps, **kw)), layers


def _cosmos(**pipe_kw):
    from vidax.models.cosmos.pipeline import CosmosPredict

    pipe = CosmosPredict("tiny", **pipe_kw)
    rng = np.random.default_rng(0)
    c, u = (rng.standard_normal((1, 11, 72)).astype(np.float32) for _ in range(2))
    return (lambda steps: pipe.sample_latents(c, u, height=64, width=64, num_frames=5, steps=steps, guidance=5.0,
                                              seed=1)), pipe.dit_config().num_layers


def _ltxv(**pipe_kw):
    from vidax.models.ltx.ltxv import LTXVideo

    pipe = LTXVideo("tiny", **pipe_kw)
    cfg = pipe.dit_config()
    rng = np.random.default_rng(0)
    c, u = (rng.standard_normal((1, 11, cfg.caption_channels)).astype(np.float32) for _ in range(2))
    m = np.ones((1, 11), np.float32)
    m[:, 8:] = 0  # padded text: the mask stays a per-step input
    return (lambda steps: pipe.sample_latents(c, m, u, m, height=64, width=64, num_frames=9, steps=steps,
                                              guidance=3.0, seed=1)), cfg.num_layers


def _ltx2(**pipe_kw):
    from vidax.models.ltx.ltx2 import LTX2

    pipe = LTX2("tiny", **pipe_kw)
    cfg = pipe.dit_config()
    rng = np.random.default_rng(0)
    emb = lambda: rng.standard_normal((1, 11, cfg.caption_channels)).astype(np.float32)  # noqa: E731
    m = np.ones((1, 11), np.float32)
    m[:, 8:] = 0
    cond, unc = {"v": emb(), "a": emb(), "mask": m}, {"v": emb(), "a": emb(), "mask": m}
    # CFG + STG + modality isolation: two pass groups, each with its own K/V, two streams each
    o = {"stg_blocks": "1", "stg_scale": 1.0, "modality_scale": 2.0}
    return (lambda steps: pipe.sample_latents(cond, unc, height=64, width=64, num_frames=9, steps=steps,
                                              guidance=3.0, seed=1, options=o)), cfg.num_layers * 2 * 2


FAMILIES = {"wan": _wan, "wan-i2v": lambda **k: _wan("tiny-i2v", **k), "wan-a14b": lambda **k: _wan("tiny-a14b", **k),
            "cosmos": _cosmos, "ltxv": _ltxv, "ltx2": _ltx2}


# one of each family's variants in make test (all in make test-all)
@pytest.mark.parametrize("family", sweep.sample_per_group(list(FAMILIES), lambda f: f.split("-")[0], 1, "text-kv"))
def test_once_computed_kv_equals_per_step_and_runs_once(family, count_kv, monkeypatch):
    """One device: the sampled latents equal the per-step computation's (bitwise on this machine;
    the contract is 1e-6), and the K/V projections run once per layer per context (expert, pass
    group) whatever the number of steps; the per-step path's count grows with the steps."""
    run, once = FAMILIES[family]()
    counts, outs = {}, {}
    for flag in (True, False):
        monkeypatch.setattr(vrunner, "TEXT_KV_ONCE", flag)
        for steps in (2, 3):
            count_kv.clear()
            outs[flag, steps] = run(steps)
            jax.effects_barrier()
            counts[flag, steps] = len(count_kv)
    for steps in (2, 3):
        _equal(outs[True, steps], outs[False, steps])
    assert counts[True, 2] == counts[True, 3] == once, counts
    assert counts[False, 3] > counts[False, 2] > 0, counts  # (what the count sees when K/V run every step)


# meshes x variants: 3 of 8 in make test (all in make test-all)
@pytest.mark.parametrize("family,mesh,offload,contexts", sweep.sample([
    ("wan", "dp=2,tp=2", None, 1), ("wan-a14b", "tp=2", 1, 2), ("wan-i2v", "sp=2", 1, 1),
    ("cosmos", "tp=2", None, 1), ("cosmos", "dp=2,sp=2", 1, 1), ("ltxv", "tp=2", 1, 1), ("ltx2", "tp=2", None, 2),
    ("ltx2", "dp=2,sp=2", 1, 2)], 3, "text-kv-meshes"))
def test_meshes_and_offload(family, mesh, offload, contexts, monkeypatch):
    """On meshes (the K/V sharded by heads as the weights over tp, replicated over sp) and with
    offloaded blocks (streamed once for the K/V, then a slice per chunk): the same latents as the
    per-step computation, and the runner's context computed once per expert / pass group."""
    calls = []
    orig = vrunner.DiTRunner.context

    def spy(self, inputs):
        calls.append(sorted(inputs))
        return orig(self, inputs)

    monkeypatch.setattr(vrunner.DiTRunner, "context", spy)
    run, _ = FAMILIES[family](mesh=mesh, offload_chunk_size=offload)
    monkeypatch.setattr(vrunner, "TEXT_KV_ONCE", True)
    once = run(3)
    assert len(calls) == contexts
    monkeypatch.setattr(vrunner, "TEXT_KV_ONCE", False)
    _equal(once, run(3))
    assert len(calls) == contexts  # the per-step path never asks for it


def test_context_is_sharded_like_the_heads():
    """Under tp the once-computed K/V are split by heads over tp (as the k / v weights), over dp by
    the batch, and replicated over sp; offloaded, one tree per chunk."""
    from dataclasses import replace

    from vidax.models.wan import dit as wdit

    cfg = replace(wdit.PRESETS["tiny"], num_heads=4, head_dim=6)  # heads split by tp x sp
    state = wdit.init_state(cfg, seed=0)
    ctx = np.random.default_rng(0).standard_normal((2, 11, cfg.text_dim)).astype(np.float32)
    r = wdit.runner(state, cfg, "dp=2,tp=2,sp=2")
    kv = r.context({"ctx": ctx})["blocks"]
    assert set(kv) == {"k", "v"} and kv["k"].shape == (cfg.num_layers, 2, 11, cfg.num_heads, cfg.head_dim)
    assert tuple(kv["k"].sharding.spec) + (None,) * (5 - len(kv["k"].sharding.spec)) == (None, "dp", None, "tp", None)
    local = wdit.context(state, cfg, ctx)["blocks"]
    np.testing.assert_allclose(np.asarray(kv["k"]), np.asarray(local["k"]), rtol=0, atol=TOL)
    chunks = wdit.runner(state, cfg, "tp=2", offload_chunk_size=1).context({"ctx": ctx})["blocks"]
    assert len(chunks) == cfg.num_layers and chunks[0]["v"].shape[0] == 1
    np.testing.assert_allclose(np.concatenate([np.asarray(c["v"]) for c in chunks]), np.asarray(local["v"]),
                               rtol=0, atol=TOL)


def test_ltx2_prompt_modulation_by_sigma_keeps_per_step_kv():
    """LTX-2.3's prompt AdaLN (the text modulated by sigma) makes the K/V change every step: no
    once-computed context for it; with the static table they are constant and computed once."""
    from dataclasses import replace

    from vidax.models.ltx import dit2, ltx2

    cfg = ltx2.LTX2_PRESETS["tiny"].dit
    assert vrunner.context_names(dit2.abstract_model(cfg)) == ("ctx", "actx")
    assert vrunner.context_names(dit2.abstract_model(replace(cfg, cross_attn_mod=True))) == ()
    static = replace(cfg, cross_attn_mod=True, use_prompt_adaln_single=False)
    assert vrunner.context_names(dit2.abstract_model(static)) == ("ctx", "actx")


def test_resume_recomputes_the_kv(monkeypatch):
    """A run resumed from a step checkpoint recomputes the K/V (nothing of them is stored) and is
    bitwise the run that never stopped."""
    from vidax.models.wan.pipeline import WanT2V

    pipe = WanT2V("tiny", mesh="tp=2")
    rng = np.random.default_rng(0)
    c, u = (rng.standard_normal((1, 11, 32)).astype(np.float32) for _ in range(2))
    kw = dict(height=64, width=64, num_frames=5, guidance=5.0, seed=1, steps=4)
    calls = []
    orig = vrunner.DiTRunner.context
    monkeypatch.setattr(vrunner.DiTRunner, "context", lambda self, i: calls.append(1) or orig(self, i))
    saved = {}

    def on_step(info, x, state):
        if info.index == 1:
            saved["x"] = np.asarray(x).transpose(0, 4, 1, 2, 3)
            saved["state"] = jax.tree.map(np.asarray, state)

    full = pipe.sample_latents(c, u, on_step=on_step, **kw)
    resumed = pipe.sample_latents(c, u, latents=saved["x"], state=saved["state"], start=2, **kw)
    assert np.array_equal(full, resumed) and len(calls) == 2
