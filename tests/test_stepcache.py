"""Step caching (issue #29): request options, fbcache / magcache in the shared block loop, against
diffusers' FirstBlockCache / MagCache hooks, staged (keys, checkpoints, SIGKILL resume) and compiled once."""
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest

from stages import cli
from stages import run as R
from stages.request import Request, RequestError, validate
from stages.store import RunStore, read_array
from tests import sweep
from tests.test_wan_pipeline import ref_pipeline  # noqa: F401 - the fixture wan_ref reuses
from tests import test_ltx2_pipeline, test_ltx_pipeline
from tests.children import ENV

REQ = dict(model="wan2.1-t2v-1.3b", preset="tiny", prompt="a lighthouse in a storm", height=32, width=48,
           num_frames=9, steps=6, guidance=4.0, seed=7, checkpoint_every=2)


def _gen(url, run_id, **over):
    req = validate(Request(**{**REQ, **over}))
    run = RunStore(url).run(run_id)
    logs = []
    R.generate(run, req, log=logs.append)
    return run, req, logs


def _latents(run):
    return read_array(run.group("sample.zarr"), "latents")


# ------------------------------------------------------------------ options
@pytest.mark.parametrize("over,field,msg", [
    (dict(cache="fastcache"), "cache", "choose one of none, fbcache"),
    (dict(cache="fbcache", cache_threshold=-0.1), "cache_threshold", "must be >= 0"),
    (dict(cache="fbcache", cache_threshold=float("nan")), "cache_threshold", "finite number"),
    (dict(cache_threshold=0.1), "cache_threshold", "needs a cache method"),
    (dict(cache="fbcache", cache_max_skips=2), "cache_max_skips", "is a magcache setting"),
    (dict(model="cogvideox-2b", height=None, width=None, cache="magcache"), "cache_ratios",
     "cogvideox-2b has no published MagCache ratios"),
    (dict(cache="magcache", cache_ratios=[1.0, -2.0]), "cache_ratios", "positive numbers"),
    (dict(cache="magcache", cache_ratios=[1.0, 1.0], cache_retention=1.5), "cache_retention", "between 0.0 and 1.0"),
    (dict(model="cogvideox-2b", height=None, width=None, cache="teacache"), "cache",
     "cogvideox-2b has no published TeaCache coefficients"),
    (dict(cache="taylorseer", cache_threshold=0.1), "cache_threshold", "fixed schedule"),
    (dict(cache="taylorseer", cache_interval=0), "cache_interval", "must be >= 1"),
    (dict(cache="fbcache", cache_order=2), "cache_order", "is a taylorseer setting"),
    (dict(cache="fbcache", offload_chunk_size=1), "cache", "offload-chunk-size"),
])
def test_bad_cache_options_are_one_line_errors(over, field, msg):
    with pytest.raises(RequestError) as e:
        validate(Request(**{**REQ, **over}))
    assert e.value.field == field and msg in str(e.value)


@pytest.mark.parametrize("over", [dict(cache="fbcache", cache_threshold=0.1), dict(cache="taylorseer"),
                                  dict(cache="magcache", cache_ratios=[1.0, 0.95, 0.9])])
def test_cosmos3_takes_the_step_caches(over):
    """Cosmos3's MoT runs through the shared runner's cached units: fbcache, taylorseer and magcache
    (given ratios) validate; teacache stays refused (no published coefficients)."""
    cos3 = dict(REQ, model="cosmos3-nano", height=None, width=None, num_frames=5)
    assert validate(Request(**{**cos3, **over})).cache == over["cache"]
    with pytest.raises(RequestError) as e:
        validate(Request(**{**cos3, "cache": "teacache"}))
    assert e.value.field == "cache" and "no published TeaCache coefficients" in str(e.value)


def test_cli_refuses_a_bad_cache_before_writing(tmp_path, capsys):
    url = f"file://{tmp_path}"
    rc = cli.main(["generate", "--prompt", "x", "--cache", "fbcache", "--cache-threshold", "-1", "--store", url])
    err = capsys.readouterr().err
    assert rc == 2 and "cache_threshold" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_cache_none_keeps_json_run_id_and_keys_and_settings_enter_the_sample_key():
    plain = validate(Request(**REQ))
    none = validate(Request(**REQ, cache="none"))
    assert "cache" not in plain.to_json() and none.to_json() == plain.to_json()
    assert none.default_run_id() == plain.default_run_id()
    pipe = R.make_pipeline(plain)
    k0 = R.stage_keys(plain, pipe)
    assert R.stage_keys(none, pipe) == k0
    ka = R.stage_keys(validate(Request(**REQ, cache="fbcache", cache_threshold=0.1)), pipe)
    kb = R.stage_keys(validate(Request(**REQ, cache="fbcache", cache_threshold=0.2)), pipe)
    kc = R.stage_keys(validate(Request(**REQ, cache="magcache", cache_threshold=0.1, cache_ratios=[1.0, 0.9])), pipe)
    assert ka["encode"] == kb["encode"] == k0["encode"]
    assert len({k0["sample"], ka["sample"], kb["sample"], kc["sample"]}) == 4
    assert ka["mux"] != k0["mux"]  # downstream stages follow the sample key


def test_prompt_file_takes_the_cache_keys(tmp_path):
    from stages.prompts import parse_prompt_file

    p = tmp_path / "p.csv"
    p.write_text("prompt,cache,cache_threshold\na cat,fbcache,0.2\na dog,,\na cow,fbcache,x\n")
    lines = parse_prompt_file(str(p), {"preset": "tiny"})
    assert lines[0].request.cache == "fbcache" and lines[0].request.cache_threshold == 0.2
    assert lines[1].request.cache is None
    assert lines[2].error and "cache_threshold" in lines[2].error
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "a", "cache": "magcache", "cache_ratios": [1.0, 0.95, 0.9]}\n{"prompt": "b", "cache": 3}\n')
    lines = parse_prompt_file(str(j))
    assert lines[0].request.cache_ratios == [[1.0, 0.95, 0.9]] and lines[0].request.cache_max_skips == 3
    assert lines[1].error and "cache" in lines[1].error


# ------------------------------------------------------------------ staged runs
def test_threshold_zero_is_bitwise_uncached_and_a_huge_one_skips(tmp_path, capsys):
    url = f"file://{tmp_path}"
    plain, _, _ = _gen(url, "plain")
    zero, _, _ = _gen(url, "zero", cache="fbcache", cache_threshold=0.0)
    huge, _, logs = _gen(url, "huge", cache="fbcache", cache_threshold=1e9)
    if sweep.EMITTERS_OFF:
        # make test's programs (XLA:CPU fusion emitters off, tests/sweep.py) round the split units
        # and the whole step differently; at XLA's defaults, as users' programs are built
        # (make test-all), threshold 0 is bitwise the uncached run
        np.testing.assert_allclose(_latents(zero), _latents(plain), rtol=0,
                                   atol=1e-4 * max(1.0, float(np.abs(_latents(plain)).max())))
    else:
        assert _latents(zero).tobytes() == _latents(plain).tobytes()
    assert zero.record("sample")["details"]["dit_evaluations"] == {"computed": 12, "skipped": 0}  # 6 steps x 2 branches
    # only the first step computes (both CFG branches); the rest reuse the cached residual
    assert huge.record("sample")["details"]["dit_evaluations"] == {"computed": 2, "skipped": 10}
    assert not np.allclose(_latents(huge), _latents(plain), atol=1e-3)
    assert "step 6/6" in next(m for m in logs if "step 6/6" in m) and "DiT 2 computed, 10 skipped" in " ".join(logs)
    assert "dit_evaluations" not in plain.record("sample")["details"]
    assert cli.main(["status", "huge", "--store", url]) == 0
    assert "DiT evaluations (sample, cache fbcache threshold 1000000000.0): 2 computed, 10 skipped" in \
        " ".join(capsys.readouterr().out.split())


# fbcache always; the other methods' state (Taylor factors restored for a predicted step 5;
# TeaCache's modulated input and accumulator) in make test-all
@pytest.mark.parametrize("cache", [["fbcache", "--cache-threshold", "1.2"]] + sweep.sample(
    [["taylorseer", "--cache-interval", "2", "--cache-warmup", "2"], ["teacache", "--cache-warmup", "3"]], 0,
    "cache-sigkill"), ids=lambda c: c[0])
def test_sigkill_during_cached_sampling_resumes_bitwise(tmp_path, cache):
    url = f"file://{tmp_path / 'killed'}"
    args = [sys.executable, "-m", "stages.cli", "generate", "--prompt", REQ["prompt"], "--height", "32", "--width", "48",
            "--frames", "9", "--steps", "8", "--guidance", "4", "--seed", "7", "--checkpoint-every", "2",
            "--scheduler", "flow_euler_sde", "--cache", *cache, "--run-id", "k1", "--store", url]
    p = subprocess.run(args, env={**ENV, "VIDAX_FAULTS": "sample:kill_after_step=4"}, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    run = RunStore(url).run("k1")
    assert run.record("sample") is None and R._checkpoint_markers(run) == [4]
    p = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming from the step checkpoint at step 4/8" in p.stdout
    clean = f"file://{tmp_path / 'clean'}"
    p = subprocess.run([a if a != url else clean for a in args], env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    ref = RunStore(clean).run("k1")
    ev = ref.record("sample")["details"]["dit_evaluations"]
    assert ev["skipped"] > 0 and ev["computed"] > 2  # the threshold takes decisions both ways
    assert run.record("sample")["details"]["dit_evaluations"] == ev
    assert _latents(run).tobytes() == _latents(ref).tobytes()


def test_two_experts_each_start_their_own_cache():
    from vidax.core.stepcache import CacheSettings, StepCache
    from vidax.models.wan.pipeline import WanT2V

    vx = WanT2V("tiny-a14b")
    sched = vx.scheduler(6)
    segs = vx.expert_segments(sched)
    assert [s[0] for s in segs] == [1, 2]
    cond = np.random.default_rng(0).standard_normal((1, 16, vx.dit_config().text_dim)).astype(np.float32)
    vx.step_cache = StepCache(CacheSettings("fbcache", 1e9), 6)
    vx.sample_latents(cond, cond[:, ::-1].copy(), height=32, width=32, num_frames=5, steps=6, guidance=4.0,
                      scheduler=sched)
    # both branches computed at each expert's first step, every other call skipped
    assert vx.step_cache.evaluations == {"computed": 4, "skipped": 8}
    first2 = segs[1][1]
    assert [bool(d.all()) for d in vx.step_cache.decisions] == [i in (0, first2) for i in range(6)]


def test_cached_units_compile_once():
    from vidax.core.stepcache import CacheSettings, StepCache
    from vidax.models.wan.pipeline import WanT2V

    from vidax.core import runner as vrunner

    vrunner._CACHE_UNITS.clear()  # units other tests of this process built (other shapes) do not count
    vx = WanT2V("tiny")
    cond = np.random.default_rng(0).standard_normal((1, 16, vx.dit_config().text_dim)).astype(np.float32)
    vx.step_cache = StepCache(CacheSettings("fbcache", 0.0), 8)
    runner, cfg = vx.load_dit()
    kw = dict(height=32, width=32, num_frames=5, steps=8, guidance=4.0, dit=(runner, cfg))

    def sizes():  # programs per unit, whatever other tests of this process compiled before
        return {n: f._cache_size() for n, f in runner._cunits.items()}

    contexts = []  # the text keys / values: computed once per sample stage, cached units or not
    runner.context = lambda inputs, f=runner.context: contexts.append(1) or f(inputs)
    vx.sample_latents(cond, cond * 0.5, **kw)
    assert contexts == [1]
    first = sizes()
    # again with a threshold in the middle of the changes seen: some steps skipped, nothing new
    # compiled for the units the first run built (8 steps: a per-step compile would show)
    vx.step_cache = StepCache(CacheSettings("fbcache", float(np.median(vx.step_cache.changes))), 8)
    vx.sample_latents(cond, cond * 0.5, **kw)
    ev = vx.step_cache.evaluations
    assert ev["computed"] > 2 and ev["skipped"] > 0
    second = sizes()
    assert {n: second[n] for n in first if first[n]} == {n: v for n, v in first.items() if v}
    assert set(second.values()) == {1}
    # a second runner of the same model (the next prompt of a batch) builds nothing new
    vx.step_cache = StepCache(CacheSettings("fbcache", vx.step_cache.cfg.threshold), 8)
    vx.sample_latents(cond, cond * 0.25, **{**kw, "dit": vx.load_dit()})
    assert sizes() == second


# ------------------------------------------------------------------ parity: diffusers' hooks
@pytest.fixture(scope="module")
def wan_ref(ref_pipeline):  # noqa: F811 - the imported fixture, by name
    """diffusers' WanPipeline (tiny, perturbed weights) saved as a folder vidax loads (test_wan_pipeline's)."""
    return ref_pipeline


def _pipe_latents(pipe, cond, uncond, lat, steps):
    """The diffusers Wan pipeline's final latents from given embeddings and noise (CFG 5, 32x32, 9 frames)."""
    import torch

    with torch.no_grad():
        return pipe(prompt_embeds=torch.from_numpy(cond), negative_prompt_embeds=torch.from_numpy(uncond),
                    latents=torch.from_numpy(lat), num_inference_steps=steps, guidance_scale=5.0,
                    height=32, width=32, num_frames=9, output_type="latent").frames.numpy()


def _ref_run(pipe, config, cond, uncond, lat, steps):
    """diffusers' pipeline with ``config`` enabled: final latents and, per transformer call, whether
    its blocks after the first ran (the last block's feed-forward was called)."""

    tr = pipe.transformer
    calls, tail = [], []
    h0 = tr.blocks[0].register_forward_pre_hook(lambda m, a, k=None: calls.append(len(tail)))
    h1 = tr.blocks[-1].ffn.register_forward_pre_hook(lambda m, a: tail.append(1))
    tr.enable_cache(config)
    try:
        z = _pipe_latents(pipe, cond, uncond, lat, steps)
    finally:
        tr.disable_cache()
        h0.remove()
        h1.remove()
    computed = [calls[i + 1] > calls[i] if i + 1 < len(calls) else len(tail) > calls[i] for i in range(len(calls))]
    return z, computed


@pytest.mark.parametrize("threshold", sweep.sample([0.0, 0.1, 0.12, 0.15], 2, "fbcache-diffusers"))
def test_fbcache_matches_diffusers_first_block_cache(wan_ref, threshold):
    from diffusers import FirstBlockCacheConfig

    from tests.test_wan_pipeline import _inputs
    from vidax.core.stepcache import CacheSettings, StepCache
    from vidax.models.wan.pipeline import WanT2V

    pipe, folder = wan_ref
    cond, uncond, lat = _inputs()
    steps = 10
    ref, ref_computed = _ref_run(pipe, FirstBlockCacheConfig(threshold=threshold), cond, uncond, lat, steps)
    vx = WanT2V(folder)
    vx.step_cache = StepCache(CacheSettings("fbcache", threshold), steps)
    z = vx.sample_latents(cond, uncond, latents=lat, steps=steps, guidance=5.0)
    # diffusers calls the transformer for cond then uncond each step; vidax runs both as one batch
    ours = [bool(b) for d in vx.step_cache.decisions for b in d]
    assert ours == ref_computed
    assert sum(ours) == vx.step_cache.evaluations["computed"]
    if threshold >= 0.1:
        assert 2 < sum(ours) < 2 * steps  # the threshold takes decisions both ways
    np.testing.assert_allclose(z, ref, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def ltx_ref(tmp_path_factory):
    """diffusers' tiny LTX-Video folder, transformer, VAE and scheduler (test_ltx_pipeline's fixture)."""
    return test_ltx_pipeline.folder.__wrapped__(tmp_path_factory)


# taylorseer (interval, warmup, order) against diffusers, teacache (threshold) against the reference and
# fbcache on LTX-Video (threshold) against diffusers: one of the seven in make test, all in make test-all
_PARITY = sweep.sample([("taylorseer", (3, 2, 1)), ("taylorseer", (2, 1, 2)), ("taylorseer", (4, 3, 1)),
                        ("teacache", 0.5), ("teacache", 0.8), ("fbcache-ltx", 0.1), ("fbcache-ltx", 0.2)], 1,
                       "taylorseer-teacache-ltx-parity")


@pytest.mark.parametrize("threshold", [p for m, p in _PARITY if m == "fbcache-ltx"])
def test_fbcache_matches_diffusers_on_ltx_video(ltx_ref, threshold):
    """Another family: LTX-Video's batched [cond; uncond] call (diffusers' "cond_uncond" context, one
    decision for the batch) against ``LTXPipeline`` with ``FirstBlockCacheConfig`` (``_ltx_case``)."""
    ours, ref, ref_computed, cache = _ltx_case(ltx_ref, "fbcache", threshold)
    assert [bool(d[0]) for d in cache.decisions] == ref_computed
    assert 1 < sum(ref_computed) < len(ref_computed), ref_computed  # the threshold takes decisions both ways
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


MAG_RATIOS = [1.0, 1.02, 0.99, 0.985, 0.98, 0.97, 0.99, 0.95, 0.9, 0.85, 0.8]  # 11: resampled to the steps


@pytest.mark.parametrize("threshold,max_skips,retention",
                         sweep.sample([(0.06, 3, 0.2), (0.2, 2, 0.1), (0.0, 3, 0.2)], 2, "magcache-diffusers"))
def test_magcache_matches_diffusers_mag_cache(wan_ref, threshold, max_skips, retention):
    from diffusers import MagCacheConfig

    from tests.test_wan_pipeline import _inputs
    from vidax.core.stepcache import CacheSettings, StepCache
    from vidax.models.wan.pipeline import WanT2V

    pipe, folder = wan_ref
    cond, uncond, lat = _inputs()
    steps = 10
    ref, ref_computed = _ref_run(pipe, MagCacheConfig(threshold=threshold, max_skip_steps=max_skips,
                                                      retention_ratio=retention, num_inference_steps=steps,
                                                      mag_ratios=MAG_RATIOS), cond, uncond, lat, steps)
    vx = WanT2V(folder)
    vx.step_cache = StepCache(CacheSettings("magcache", threshold, max_skips, retention, (tuple(MAG_RATIOS),)), steps)
    z = vx.sample_latents(cond, uncond, latents=lat, steps=steps, guidance=5.0)
    ours = [bool(b) for d in vx.step_cache.decisions for b in d]
    assert ours == ref_computed
    if threshold > 0:
        assert 2 < sum(ours) < 2 * steps
    else:
        assert all(ours)
    np.testing.assert_allclose(z, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("interval,warmup,order", [p for m, p in _PARITY if m == "taylorseer"])
def test_taylorseer_matches_diffusers_taylorseer_cache(wan_ref, interval, warmup, order):
    """diffusers' TaylorSeer with every block hooked (their outputs extrapolated between the computed
    steps: the last block's is what the head reads), factors in float32."""
    import torch
    from diffusers import TaylorSeerCacheConfig

    from tests.test_wan_pipeline import _inputs
    from vidax.core.stepcache import CacheSettings, StepCache
    from vidax.models.wan.pipeline import WanT2V

    pipe, folder = wan_ref
    cond, uncond, lat = _inputs()
    steps = 10
    config = TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=warmup, max_order=order,
                                   taylor_factors_dtype=torch.float32, cache_identifiers=[r"blocks\.\d+"])
    ref, ref_computed = _ref_run(pipe, config, cond, uncond, lat, steps)
    vx = WanT2V(folder)
    vx.step_cache = StepCache(CacheSettings("taylorseer", 0.0, interval=interval, warmup=warmup, order=order), steps)
    z = vx.sample_latents(cond, uncond, latents=lat, steps=steps, guidance=5.0)
    ours = [bool(b) for d in vx.step_cache.decisions for b in d]
    assert ours == ref_computed and 2 * warmup < sum(ours) < 2 * steps
    np.testing.assert_allclose(z, ref, atol=1e-4, rtol=0)


def _teacache_reference(pipe, coefficients, threshold, warmup, cond, uncond, lat, steps):
    """TeaCache as its authors publish it (Wan2.1, retention mode), written here over diffusers'
    Wan transformer with torch hooks: per CFG branch (diffusers calls cond, then uncond), the
    relative L1 change of the timestep projection since the branch's previous call, rescaled by
    the polynomial and accumulated; below the threshold the block stack's output is the input plus
    the branch's last residual; the first ``warmup`` steps always computed."""

    tr = pipe.transformer
    st = {"call": 0, "acc": [0.0, 0.0], "prev": [None, None], "res": [None, None], "x": None, "compute": True}
    computed = []

    def on_embed(m, args, out):
        e0 = out[1].detach().numpy().astype(np.float32)
        j, step = st["call"] % 2, st["call"] // 2
        prev, st["prev"][j] = st["prev"][j], e0
        if step < warmup or prev is None:
            st["acc"][j], st["compute"] = 0.0, True
        else:
            rel = float(np.abs(e0 - prev).mean() / np.abs(prev).mean())
            st["acc"][j] += float(np.polyval(coefficients, rel))
            st["compute"] = st["acc"][j] >= threshold
            if st["compute"]:
                st["acc"][j] = 0.0
        computed.append(st["compute"])

    def on_first(m, args):
        st["x"] = args[0].detach().clone()

    def on_last(m, args, out):
        j = st["call"] % 2
        st["call"] += 1
        if st["compute"]:
            st["res"][j] = out - st["x"]
            return out
        return st["x"] + st["res"][j]  # the blocks ran (a tiny model): their output is replaced

    hooks = [tr.condition_embedder.register_forward_hook(on_embed), tr.blocks[0].register_forward_pre_hook(on_first),
             tr.blocks[-1].register_forward_hook(on_last)]
    try:
        z = _pipe_latents(pipe, cond, uncond, lat, steps)
    finally:
        for h in hooks:
            h.remove()
    return z, computed


@pytest.mark.parametrize("threshold", [p for m, p in _PARITY if m == "teacache"])
def test_teacache_matches_the_published_algorithm(wan_ref, threshold):
    from tests.test_wan_pipeline import _inputs
    from vidax.core.stepcache import CacheSettings, StepCache
    from vidax.models.wan.magcache import TEA_COEFFS
    from vidax.models.wan.pipeline import WanT2V

    pipe, folder = wan_ref
    cond, uncond, lat = _inputs()
    steps, warmup = 10, 2
    # a polynomial in the range of the tiny model's changes (the releases' are fitted to theirs)
    coeffs = (1.0, 0.0)
    ref, ref_computed = _teacache_reference(pipe, coeffs, threshold, warmup, cond, uncond, lat, steps)
    vx = WanT2V(folder)
    vx.step_cache = StepCache(CacheSettings("teacache", threshold, warmup=warmup, coefficients=coeffs), steps)
    z = vx.sample_latents(cond, uncond, latents=lat, steps=steps, guidance=5.0)
    ours = [bool(b) for d in vx.step_cache.decisions for b in d]
    assert ours == ref_computed and 2 * warmup < sum(ours) < 2 * steps, (ours, vx.step_cache.changes)
    np.testing.assert_allclose(z, ref, atol=1e-4, rtol=0)
    # the releases' own polynomials are what --cache teacache takes for them
    r = validate(Request(**{**REQ, "cache": "teacache"}))
    assert r.cache_settings().coefficients == tuple(TEA_COEFFS["wan2.1-t2v-1.3b"]) and r.cache_warmup == 5


def test_magcache_through_the_stages(tmp_path):
    url = f"file://{tmp_path}"
    plain, _, _ = _gen(url, "plain")
    mag, req, _ = _gen(url, "mag", cache="magcache", cache_threshold=0.5, cache_ratios=[1.0, 0.9, 0.8, 0.7, 0.6, 0.5],
                       cache_retention=0.2)
    ev = mag.record("sample")["details"]["dit_evaluations"]
    assert ev["skipped"] > 0 and ev["computed"] + ev["skipped"] == 12
    assert mag.record("sample")["details"]["cache"]["ratios"] == [[1.0, 0.9, 0.8, 0.7, 0.6, 0.5]]
    assert not np.allclose(_latents(mag), _latents(plain), atol=1e-3)


def test_calibrate_measures_ratios_as_diffusers(wan_ref, tmp_path, capsys):
    """``vidax calibrate`` on a tiny checkpoint folder: the ratios diffusers' ``calibrate=True`` prints."""
    import ast
    import json

    from diffusers import MagCacheConfig

    from tests.test_wan_pipeline import _inputs
    from vidax.core.stepcache import CacheSettings, StepCache
    from vidax.models.wan.pipeline import WanT2V

    pipe, folder = wan_ref
    cond, uncond, lat = _inputs()
    capsys.readouterr()
    _ref_run(pipe, MagCacheConfig(calibrate=True, num_inference_steps=6), cond, uncond, lat, 6)
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[") and not ln.startswith("[MagCache")]
    ref = [ast.literal_eval(ln) for ln in printed]  # one list per context: cond, then uncond
    assert len(ref) == 2 and len(ref[0]) == 6
    vx = WanT2V(folder)
    vx.step_cache = StepCache(CacheSettings("magcache", 0.0, ratios=((1.0, 1.0),)), 6, calibrate=True)
    vx.sample_latents(cond, uncond, latents=lat, steps=6, guidance=5.0)
    assert vx.step_cache.evaluations == {"computed": 12, "skipped": 0}
    np.testing.assert_allclose(vx.step_cache.calib, ref, rtol=1e-4)
    # the command on the tiny preset writes a file that --cache-ratios takes
    out = tmp_path / "ratios.json"
    assert cli.main(["calibrate", "--model", "wan2.1-t2v-1.3b", "--steps", "5", "--height", "32", "--width", "48",
                     "--frames", "5", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["ratios"]) == 5 and doc["ratios"][0] == 1.0 and len(doc["per_branch"]) == 2
    r = validate(Request(**{**REQ, "cache": "magcache", "cache_ratios": str(out)}))
    assert r.cache_ratios == doc["per_branch"]


@pytest.mark.parametrize("model,branches,n", [("wan2.1-t2v-1.3b", 2, 50), ("wan2.1-t2v-14b", 2, 50),
                                               ("wan2.1-i2v-480p", 2, 40), ("wan2.1-i2v-720p", 2, 40),
                                               ("hunyuanvideo-t2v", 1, 50)])
def test_published_magcache_ratios_of_the_releases(model, branches, n, cond_image):
    """The release's published ratios are what --cache magcache takes: Wan2.1 per CFG branch (conditional,
    unconditional), HunyuanVideo (guidance distilled) one list for every branch."""
    from vidax.models.hunyuanvideo.magcache import MAG_RATIOS as HV
    from vidax.models.wan.magcache import MAG_RATIOS as WAN

    over = dict(model=model, cache="magcache", height=None, width=None)
    if "i2v" in model:
        over["image"] = cond_image
    r = validate(Request(**{**REQ, **over}))
    assert r.cache_ratios == {**WAN, **HV}[model] and len(r.cache_ratios) == branches
    assert r.cache_threshold == 0.06 and r.cache_max_skips == 3 and r.cache_retention == 0.2
    assert [len(b) for b in r.cache_ratios] == [n] * branches and all(b[0] == 1.0 for b in r.cache_ratios)
    if model.startswith("hunyuanvideo"):  # the 720p table: its first ratios and its last
        assert r.cache_ratios[0][1:3] == [1.0754, 1.27807] and r.cache_ratios[0][-1] == 0.75456
        assert r.cache_settings().ratios == (tuple(r.cache_ratios[0]),)
        # and its TeaCache polynomial, with the authors' schedule (first and last step computed)
        from vidax.models.hunyuanvideo.magcache import TEA_COEFFS

        t = validate(Request(**{**REQ, **over, "cache": "teacache"})).cache_settings()
        assert t.coefficients == tuple(TEA_COEFFS[model]["coefficients"]) and t.coefficients[0] == 733.226126
        assert t.warmup == 1 and t.final and t.key()["final"] is True
        assert "final" not in validate(Request(**{**REQ, "cache": "teacache"})).cache_settings().key()  # Wan's


@pytest.mark.parametrize("model", ["wan2.1-t2v-1.3b"] + sweep.sample(["hunyuanvideo-t2v"], 0, "magcache-published"))
def test_magcache_with_published_ratios_runs(tmp_path, model):
    over = {} if model.startswith("wan") else dict(model=model, height=None, width=None, num_frames=5)
    run, req, _ = _gen(f"file://{tmp_path}", "pub", cache="magcache", steps=10, cache_threshold=0.06, **over)
    ev = run.record("sample")["details"]["dit_evaluations"]
    branches = 2 if model.startswith("wan") else 1  # HunyuanVideo: embedded guidance, one branch
    # the ratios resampled to 10 steps
    assert ev["computed"] + ev["skipped"] == 10 * branches and ev["skipped"] > 0


@pytest.mark.parametrize("model", sweep.sample(["cogvideox-2b", "hunyuanvideo-t2v", "hunyuanvideo1.5-480p-t2v",
                                                "cosmos2.5-2b", "ltx-video-0.9", "ltx2-t2v", "cosmos3-nano"], 2,
                                               "fbcache-families"))
def test_fbcache_on_every_family_tiny_preset(tmp_path, model):
    """threshold 0: every step computed, the uncached latents (bitwise; Cosmos, LTX-2 within rounding); a
    huge threshold: only the first call computes (per branch)."""
    from vidax import registry

    geo = registry.get(model).build("tiny", None, False).geometry()
    url = f"file://{tmp_path}"
    base = ["generate", "--model", model, "--prompt", "a fox in snow", "--frames", str(geo.frames_multiple + 1),
            "--steps", "4", "--store", url]
    out = {}
    for rid, extra in (("plain", []), ("zero", ["--cache", "fbcache", "--cache-threshold", "0"]),
                       ("huge", ["--cache", "fbcache", "--cache-threshold", "1e9"])):
        assert cli.main(base + extra + ["--run-id", rid]) == 0
        run = RunStore(url).run(rid)
        out[rid] = (_latents(run), run.record("sample")["details"].get("dit_evaluations"))
    (plain, none), (zero, ev0), (huge, ev1) = out["plain"], out["zero"], out["huge"]
    branches = ev0["computed"] // 4
    assert none is None and ev0 == {"computed": 4 * branches, "skipped": 0} and branches in (1, 2)
    assert ev1 == {"computed": branches, "skipped": 3 * branches}
    if model.startswith(("cosmos", "ltx2")) or sweep.EMITTERS_OFF:
        # other programs (LTX-2: every guidance pass in one batch; make test's fusion emitters off:
        # split units and whole step round differently): the suite's parity bound (Cosmos3
        # measured 1.93e-5 at XLA's default level)
        np.testing.assert_allclose(zero, plain, atol=1e-4 * max(1.0, float(np.abs(plain).max())), rtol=0)
    else:
        assert zero.tobytes() == plain.tobytes()
    assert not np.allclose(huge, plain, atol=1e-3)


# ------------------------------------------------------------------ parity: diffusers' hooks on more families
def _hooked(tr, first, tail, config, call):
    """``call()`` with diffusers' cache ``config`` enabled on the transformer ``tr``: its result and,
    per transformer call, whether the blocks after the first ran (``tail``, a module inside the last
    block, was called)."""
    calls, ran = [], []
    h0 = first.register_forward_pre_hook(lambda m, a, k=None: calls.append(len(ran)))
    h1 = tail.register_forward_pre_hook(lambda m, a: ran.append(1))
    tr.enable_cache(config)
    try:
        out = call()
    finally:
        tr.disable_cache()
        h0.remove()
        h1.remove()
    return out, [calls[i + 1] > calls[i] if i + 1 < len(calls) else len(ran) > calls[i] for i in range(len(calls))]


def _diffusers_config(method, p, steps, blocks):
    """diffusers' config of ``method`` with the parameters ``p`` (TaylorSeer: every block of ``blocks`` hooked)."""
    import torch
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    if method == "fbcache":
        return FirstBlockCacheConfig(threshold=p)
    if method == "magcache":
        thr, k, ret = p
        return MagCacheConfig(threshold=thr, max_skip_steps=k, retention_ratio=ret, num_inference_steps=steps,
                              mag_ratios=MAG_RATIOS)
    interval, warmup, order = p
    return TaylorSeerCacheConfig(cache_interval=interval, disable_cache_before_step=warmup, max_order=order,
                                 taylor_factors_dtype=torch.float32,
                                 cache_identifiers=[rf"{b}\.\d+" for b in blocks])


def _vidax_settings(method, p):
    from vidax.core.stepcache import CacheSettings

    if method == "fbcache":
        return CacheSettings("fbcache", p)
    if method == "magcache":
        thr, k, ret = p
        return CacheSettings("magcache", thr, k, ret, (tuple(MAG_RATIOS),))
    interval, warmup, order = p
    return CacheSettings("taylorseer", 0.0, interval=interval, warmup=warmup, order=order)


@pytest.fixture(scope="module")
def cog_ref(tmp_path_factory):
    """test_cogvideox_pipeline's tiny CogVideoX-2b pipeline (DDIM), saved as a folder vidax loads."""
    from tests.test_cogvideox_pipeline import _ref_pipeline

    folder = tmp_path_factory.mktemp("cog_cache")
    return _ref_pipeline("2b-ddim", folder), folder


def _cog_case(cog_ref, method, p):
    """CogVideoX: one [uncond; cond] call per step (diffusers' "cond_uncond" context): one decision."""
    import torch

    from vidax.core.stepcache import StepCache
    from vidax.models.cogvideox.pipeline import CogVideoX

    pipe, folder = cog_ref
    h, w, frames, steps, g = 32, 48, 9, 8, 6.0
    vx = CogVideoX(folder)
    rng = np.random.default_rng(0)
    cond, uncond = (rng.standard_normal((1, 7, 20)).astype(np.float32) for _ in range(2))
    lat = rng.standard_normal(vx.latent_shape(1, h, w, frames)).astype(np.float32).transpose(0, 1, 4, 2, 3)
    tr = pipe.transformer

    def call():
        with torch.no_grad():
            return pipe(prompt_embeds=torch.from_numpy(cond), negative_prompt_embeds=torch.from_numpy(uncond),
                        latents=torch.from_numpy(lat), num_inference_steps=steps, guidance_scale=g, height=h,
                        width=w, num_frames=frames, output_type="latent", return_dict=False)[0].numpy()

    ref, computed = _hooked(tr, tr.transformer_blocks[0], tr.transformer_blocks[-1].ff,
                            _diffusers_config(method, p, steps, ["transformer_blocks"]), call)
    vx.step_cache = StepCache(_vidax_settings(method, p), steps)
    z = vx.sample_latents(cond, uncond, latents=lat, height=h, width=w, num_frames=frames, steps=steps, guidance=g)
    return z, ref.transpose(0, 2, 1, 3, 4), computed, vx.step_cache


@pytest.fixture(scope="module")
def hunyuan_ref(tmp_path_factory):
    """test_hunyuanvideo_pipeline's tiny HunyuanVideoPipeline (guidance-distilled), saved as a folder."""
    import torch
    from diffusers import (AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
                           HunyuanVideoTransformer3DModel)

    from tests.refutil import perturb
    from tests.test_hunyuanvideo_pipeline import DIT, VAE

    torch.manual_seed(0)
    tr = perturb(HunyuanVideoTransformer3DModel(**DIT), seed=1)
    vae = perturb(AutoencoderKLHunyuanVideo(**VAE), seed=2)
    pipe = HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=tr, vae=vae, text_encoder_2=None,
                                tokenizer_2=None, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    folder = tmp_path_factory.mktemp("hv_cache")
    pipe.save_pretrained(folder)
    return pipe, folder


def _teacache_hunyuan_reference(tr, coefficients, threshold, steps):
    """TeaCache as its authors publish it for HunyuanVideo (one branch), over diffusers' transformer with
    torch hooks: the modulated input is the first double block's normalised video tokens with its first
    shift / scale (its ``norm1``'s first output); the first and the last step always computed; else the
    relative L1 change since the previous call, rescaled by the polynomial and accumulated; below the
    threshold the block stack's video output is its input plus the last residual."""
    st = {"cnt": 0, "acc": 0.0, "prev": None, "res": None, "x": None, "compute": True}
    computed = []

    def on_first(m, args, kwargs):
        st["x"] = args[0] if args else kwargs["hidden_states"]

    def on_norm(m, args, out):
        mod = out[0].detach().clone()
        if st["cnt"] in (0, steps - 1):
            st["compute"], st["acc"] = True, 0.0
        else:
            rel = float((mod - st["prev"]).abs().mean() / st["prev"].abs().mean())
            st["acc"] += float(np.polyval(coefficients, rel))
            st["compute"] = st["acc"] >= threshold
            if st["compute"]:
                st["acc"] = 0.0
        st["prev"] = mod
        computed.append(st["compute"])

    def on_last(m, args, out):
        st["cnt"] = (st["cnt"] + 1) % steps
        if st["compute"]:
            st["res"] = out[0] - st["x"]
            return out
        return st["x"] + st["res"], out[1]  # the blocks ran (a tiny model): their video output is replaced

    b0 = tr.transformer_blocks[0]
    return [b0.register_forward_pre_hook(on_first, with_kwargs=True), b0.norm1.register_forward_hook(on_norm),
            tr.single_transformer_blocks[-1].register_forward_hook(on_last)], computed


def _hunyuan_case(hunyuan_ref, method, p):
    """HunyuanVideo: double-stream then single-stream blocks (the tail is the last single block)."""
    import torch

    from tests.test_hunyuanvideo_pipeline import _conditioning
    from vidax.core.stepcache import CacheSettings, StepCache
    from vidax.models.hunyuanvideo.pipeline import HunyuanVideoT2V

    pipe, folder = hunyuan_ref
    steps, g = 8, 6.0
    c = _conditioning()
    lat = np.random.default_rng(1).standard_normal((1, 4, 3, 4, 8)).astype(np.float32)
    tr = pipe.transformer

    def call():
        with torch.no_grad():
            return pipe(prompt_embeds=torch.from_numpy(c["embeds"]), prompt_attention_mask=torch.from_numpy(c["mask"]),
                        pooled_prompt_embeds=torch.from_numpy(c["pooled"]), latents=torch.from_numpy(lat),
                        num_inference_steps=steps, guidance_scale=g, height=16, width=32, num_frames=9,
                        output_type="latent", return_dict=False)[0].numpy()

    if method == "teacache":  # diffusers has no TeaCache hook: the authors' algorithm, written above
        coeffs = (1.0, 0.0)  # a polynomial in the range of the tiny model's changes
        hooks, computed = _teacache_hunyuan_reference(tr, coeffs, p, steps)
        try:
            ref = call()
        finally:
            for h in hooks:
                h.remove()
        settings = CacheSettings("teacache", p, warmup=1, coefficients=coeffs, final=True)
    else:
        ref, computed = _hooked(tr, tr.transformer_blocks[0], tr.single_transformer_blocks[-1].proj_out,
                                _diffusers_config(method, p, steps, ["transformer_blocks", "single_transformer_blocks"]),
                                call)
        settings = _vidax_settings(method, p)
    vx = HunyuanVideoT2V(folder)
    vx.step_cache = StepCache(settings, steps)
    z = vx.sample_latents(c, latents=lat, steps=steps, guidance=g, height=16, width=32, num_frames=9)
    return z, ref, computed, vx.step_cache


@pytest.fixture(scope="module")
def hunyuan15_ref(tmp_path_factory):
    """test_hunyuanvideo15_pipeline's tiny text-to-video DiT with two blocks (a first and a last one), its
    VAE, and vidax's load of the DiT."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel

    from tests.refutil import perturb
    from tests.test_hunyuanvideo15_pipeline import DIT, VAE
    from vidax.models.hunyuanvideo15 import dit as hdit

    torch.manual_seed(0)
    m = perturb(HunyuanVideo15Transformer3DModel(**{**DIT, "num_layers": 2}, task_type="t2v"), seed=1)
    f = tmp_path_factory.mktemp("hv15_cache")
    m.save_pretrained(f)
    return m, perturb(AutoencoderKLHunyuanVideo15(**VAE), seed=2), hdit.load_dit(f)


def _block_input(args, kwargs, name="hidden_states", pos=0):
    """A block's input stream ``name`` (given by position ``pos`` or by keyword, as LTX-2 calls its blocks)."""
    return args[pos] if len(args) > pos else kwargs[name]


def _diffusers_or_published(tr, method, p, steps, call):
    """``call()``'s output and computed decisions with ``method`` on a transformer whose blocks are
    ``tr.transformer_blocks``: taylorseer through diffusers' hook; fbcache / magcache, which
    diffusers' registry refuses for these blocks (asserted: why), through the published algorithms
    (the MagCache ratios resampled to the steps by nearest neighbour, as the authors' scripts do)."""
    if method == "taylorseer":
        return _hooked(tr, tr.transformer_blocks[0], tr.transformer_blocks[-1].ff,
                       _diffusers_config(method, p, steps, ["transformer_blocks"]), call)
    with pytest.raises(ValueError, match="not registered"):
        tr.enable_cache(_diffusers_config(method, p, steps, ["transformer_blocks"]))
    tr.disable_cache()
    nearest = [MAG_RATIOS[round(i * (len(MAG_RATIOS) - 1) / (steps - 1))] for i in range(steps)]
    hooks, computed = _fbcache_reference(tr, p) if method == "fbcache" else _magcache_reference(tr, *p, nearest, steps)
    try:
        return call(), computed
    finally:
        for h in hooks:
            h.remove()


def _fbcache_reference(tr, threshold, branches=2, blocks="transformer_blocks", hidden=("hidden_states", 0)):
    """First Block Cache as published (ParaAttention, Cheng 2025), over the transformer's blocks with torch
    hooks, per CFG branch (calls alternate cond, uncond; ``branches=1``: one batched call per step, one
    decision): the first block's residual of the hidden states against the one of the branch's last
    computed call, ``mean|r - r_prev| / mean|r_prev|``; at or below the threshold the last block's
    outputs are the first block's plus the residuals (hidden and text or audio streams) the remaining
    blocks added at the branch's last computed call. ``hidden``: the hidden stream's argument name and its
    position among the block's arguments and outputs (Cosmos3's MoT layer: ``gen_seq``, second). Returns the
    hooks and the per-call decisions."""
    import torch

    st = {"call": 0, "prev": {}, "res": {}, "head": None, "compute": True}
    computed = []
    one = lambda out: isinstance(out, torch.Tensor)  # noqa: E731 - a block of one stream (Cosmos) returns a tensor

    def on_first(m, args, kwargs, out):
        j = st["call"] % branches
        r = (out if one(out) else out[hidden[1]]) - _block_input(args, kwargs, *hidden)
        prev = st["prev"].get(j)
        st["compute"] = prev is None or float((r - prev).abs().mean() / prev.abs().mean()) > threshold
        if st["compute"]:
            st["prev"][j] = r
        st["head"] = out
        computed.append(st["compute"])

    def on_last(m, args, out):
        j, h = st["call"] % branches, st["head"]
        st["call"] += 1
        if one(out):
            if st["compute"]:
                st["res"][j] = out - h
                return out
            return h + st["res"][j]
        if st["compute"]:
            st["res"][j] = (out[0] - h[0], out[1] - h[1])
            return out
        return h[0] + st["res"][j][0], h[1] + st["res"][j][1]

    blocks = getattr(tr, blocks)
    return [blocks[0].register_forward_hook(on_first, with_kwargs=True),
            blocks[-1].register_forward_hook(on_last)], computed


def _magcache_reference(tr, threshold, max_skips, retention, ratios, steps, branches=2, second=None,
                        blocks="transformer_blocks", hidden=("hidden_states", 0)):
    """MagCache as published (Ma et al. 2025, the authors' HunyuanVideo script), per CFG branch (``branches=1``:
    one batched call per step): from the step's magnitude ratio the accumulated ratio, error and skip
    count; while the error stays within the threshold and the count within ``max_skips`` (after the
    first ``retention * steps`` steps) the block stack's hidden output is its input plus the branch's
    last residual (and, where the blocks carry a ``second`` stream the head reads, LTX-2's audio, that
    stream's too: its argument name and position); the counters restart at the last step. ``hidden``: as
    :func:`_fbcache_reference`'s."""
    import torch

    st = {"call": 0, "compute": True, "x": None, "x2": None}
    br = {j: dict(cnt=0, ratio=1.0, err=0.0, k=0, res=None, res2=None) for j in range(branches)}
    computed = []

    def on_first(m, args, kwargs):
        b = br[st["call"] % branches]
        st["x"], st["compute"] = _block_input(args, kwargs, *hidden), True
        if second:
            st["x2"] = _block_input(args, kwargs, *second)
        if b["cnt"] >= int(retention * steps):
            b["ratio"] *= ratios[b["cnt"]]
            b["err"] += abs(1 - b["ratio"])
            b["k"] += 1
            if b["res"] is not None and b["err"] <= threshold and b["k"] <= max_skips:
                st["compute"] = False
            else:
                b["ratio"], b["err"], b["k"] = 1.0, 0.0, 0
        computed.append(st["compute"])

    def on_last(m, args, out):
        b = br[st["call"] % branches]
        st["call"] += 1
        b["cnt"] += 1
        if b["cnt"] >= steps:
            b.update(cnt=0, ratio=1.0, err=0.0, k=0)
        one = isinstance(out, torch.Tensor)  # a block of one stream (Cosmos) returns a tensor
        if st["compute"]:
            b["res"] = (out if one else out[hidden[1]]) - st["x"]
            if second:
                b["res2"] = out[second[1]] - st["x2"]
            return out
        if one:
            return st["x"] + b["res"]
        new = list(out)  # the other stream as the blocks computed it, unless it is carried
        new[hidden[1]] = st["x"] + b["res"]
        if second:
            new[second[1]] = st["x2"] + b["res2"]
        return tuple(new)

    blocks = getattr(tr, blocks)
    return [blocks[0].register_forward_pre_hook(on_first, with_kwargs=True),
            blocks[-1].register_forward_hook(on_last)], computed


def _hunyuan15_case(hunyuan15_ref, method, p):
    """HunyuanVideo 1.5 (CFG through its guider: a cond then an uncond call per step): diffusers'
    TaylorSeerCacheConfig; its FirstBlockCache / MagCache hooks refuse the transformer
    (``HunyuanVideo15TransformerBlock`` is not in ``TransformerBlockRegistry``: "Model class ... not
    registered."), so those two run against the published algorithms written above."""
    import torch
    from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

    from tests.test_hunyuanvideo15_pipeline import _cond, _sched
    from vidax.core.stepcache import StepCache
    from vidax.models.hunyuanvideo15 import dit as hdit
    from vidax.models.hunyuanvideo15 import pipeline as hpipe

    tr, vae, (state, cfg) = hunyuan15_ref
    steps, shift, g = 8, 5.0, 6.0
    rng = np.random.default_rng(0)
    cond, uncond = _cond(rng, 1, (7,), (3,)), _cond(rng, 1, (2,), (0,))
    noise = rng.standard_normal((1, 4, 3, 4, 4)).astype(np.float32)
    pipe = HunyuanVideo15Pipeline(text_encoder=None, tokenizer=None, transformer=tr, vae=vae, scheduler=_sched(shift),
                                  text_encoder_2=None, tokenizer_2=None, guider=ClassifierFreeGuidance(guidance_scale=g))
    pipe.vision_num_semantic_tokens = 5
    t = lambda a: torch.from_numpy(np.asarray(a))  # noqa: E731

    def call():
        with torch.no_grad():
            return pipe(prompt_embeds=t(cond["embeds"]), prompt_embeds_mask=t(cond["mask"]),
                        prompt_embeds_2=t(cond["embeds_2"]), prompt_embeds_mask_2=t(cond["mask_2"]),
                        negative_prompt_embeds=t(uncond["embeds"]), negative_prompt_embeds_mask=t(uncond["mask"]),
                        negative_prompt_embeds_2=t(uncond["embeds_2"]),
                        negative_prompt_embeds_mask_2=t(uncond["mask_2"]), height=16, width=16, num_frames=9,
                        num_inference_steps=steps, latents=t(noise), output_type="latent").frames.numpy()

    ref, computed = _diffusers_or_published(tr, method, p, steps, call)
    vx = hpipe.HunyuanVideo15T2V("tiny")
    vx.step_cache = StepCache(_vidax_settings(method, p), steps)
    z = vx.sample_latents(cond, uncond, latents=noise, steps=steps, guidance=g, shift=shift,
                          dit=(hdit.runner(state, cfg), cfg))
    return z, ref, computed, vx.step_cache


def _ltx_case(ltx_ref, method, p):
    """LTX-Video: one [uncond; cond] call per step (diffusers' "cond_uncond" context): one decision."""
    import torch
    from diffusers import LTXPipeline

    from tests.refutil import to_numpy
    from tests.test_ltx_pipeline import _embeds
    from vidax.core.stepcache import StepCache
    from vidax.models.ltx.common import pack
    from vidax.models.ltx.ltxv import LTXVideo

    root, dit, vae, sched = ltx_ref
    h, w, frames, steps = 64, 96, 17, 8
    cond, cm = _embeds(1, 0)
    unc, um = _embeds(1, 1)
    pipe = LTXVideo(str(root))
    grid = pipe.latent_grid(h, w, frames)
    x0 = np.random.default_rng(3).standard_normal((1, *grid, 8)).astype(np.float32)
    pipe.step_cache = StepCache(_vidax_settings(method, p), steps)
    ours = pipe.sample_latents(cond, cm, unc, um, seed=0, height=h, width=w, num_frames=frames, steps=steps,
                               guidance=3.0, fps=24.0, guidance_rescale=0.0, latents=x0)
    ref = LTXPipeline(scheduler=sched, vae=vae, text_encoder=None, tokenizer=None, transformer=dit)

    def call():
        with torch.no_grad():
            return ref(prompt_embeds=torch.from_numpy(cond), prompt_attention_mask=torch.from_numpy(cm),
                       negative_prompt_embeds=torch.from_numpy(unc), negative_prompt_attention_mask=torch.from_numpy(um),
                       latents=torch.from_numpy(np.asarray(pack(x0))), height=h, width=w, num_frames=frames,
                       num_inference_steps=steps, guidance_scale=3.0, guidance_rescale=0.0, frame_rate=24,
                       output_type="latent", return_dict=False)[0]

    out, computed = _hooked(dit, dit.transformer_blocks[0], dit.transformer_blocks[-1].ff,
                            _diffusers_config(method, p, steps, ["transformer_blocks"]), call)
    return ours, to_numpy(out).reshape(1, *grid, 8).transpose(0, 4, 1, 2, 3), computed, pipe.step_cache


@pytest.fixture(scope="module")
def cosmos25_ref(tmp_path_factory):
    """test_cosmos_pipeline's tiny Cosmos2_5_PredictBasePipeline (two blocks), saved as a folder vidax loads;
    its transformer given diffusers' ``CacheMixin`` (``enable_cache``), which ``CosmosTransformer3DModel``
    does not take: diffusers' own hook code then runs on it."""
    from diffusers.models.cache_utils import CacheMixin

    from tests.cosmos_fixtures import predict25_folder

    folder = tmp_path_factory.mktemp("predict25_cache")
    ref = predict25_folder(folder)
    tr = ref.transformer
    assert not hasattr(tr, "enable_cache")
    tr.__class__ = type("CachedCosmosTransformer3DModel", (type(tr), CacheMixin), {})
    return ref, folder


def _cosmos25_case(cosmos25_ref, method, p):
    """Cosmos-Predict2.5 (a cond then an uncond call per step): diffusers' TaylorSeerCacheConfig, the
    calls given the "cond" / "uncond" cache contexts the other pipelines give theirs (this pipeline sets
    none, and diffusers' stateful hooks refuse a call without one); its FirstBlockCache / MagCache hooks
    refuse the transformer (``CosmosTransformerBlock`` is not in ``TransformerBlockRegistry``), so those
    two run against the published algorithms written above."""
    import torch
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    from tests.test_cosmos_pipeline import F, H, W, _noise
    from vidax.core.stepcache import StepCache
    from vidax.models.cosmos import text as ctext
    from vidax.models.cosmos.pipeline import CosmosPredict

    ref, folder = cosmos25_ref
    tr, steps, g = ref.transformer, 8, 3.0
    prompt, lat = ["a red panda paddles a canoe"], _noise(1, seed=2)

    def call():
        with torch.no_grad():
            return ref(prompt=prompt, negative_prompt=None, height=H, width=W, num_frames=F, num_inference_steps=steps,
                       guidance_scale=g, latents=torch.from_numpy(lat), output_type="latent").frames.numpy()

    n = [0]

    def context(m, args, kwargs):
        _set_cache_context(m, CacheContext(("cond", "uncond")[n[0] % 2]))
        n[0] += 1

    hc = tr.register_forward_pre_hook(context, with_kwargs=True)
    try:
        out, computed = _diffusers_or_published(tr, method, p, steps, call)
    finally:
        hc.remove()
    vx = CosmosPredict(folder)
    vx.step_cache = StepCache(_vidax_settings(method, p), steps)
    cond, uncond = vx.encode_prompts(prompt), vx.encode_prompts([ctext.DEFAULT_NEGATIVE_PROMPT])
    z = vx.sample_latents(cond, uncond, latents=lat, height=H, width=W, num_frames=F, steps=steps, guidance=g)
    return z, out, computed, vx.step_cache


@pytest.fixture(scope="module")
def ltx2_ref(tmp_path_factory):
    """diffusers' tiny LTX-2 folder and modules (test_ltx2_pipeline's fixture)."""
    return test_ltx2_pipeline.folder.__wrapped__(tmp_path_factory)


def _ltx2_case(ltx2_ref, method, p):
    """LTX-2 under CFG alone (no STG, no modality isolation: diffusers then makes one "cond_uncond" call
    per step, as vidax's one batch of passes): one decision per step, video and audio latents compared.
    Its FirstBlockCache / MagCache hooks refuse the transformer (``LTX2VideoTransformerBlock`` is not in
    ``TransformerBlockRegistry``), so those two run against the published algorithms written above (the
    audio stream's residual cached with the video's)."""
    import jax.numpy as jnp
    import torch
    from diffusers import LTX2Pipeline

    from tests.refutil import to_numpy
    from tests.test_ltx2_pipeline import GUIDE, _hidden
    from vidax.core.stepcache import StepCache
    from vidax.models.ltx.common import pack
    from vidax.models.ltx.ltx2 import LTX2

    root, parts = ltx2_ref
    h_, w_, frames, steps, fps = 64, 96, 9, 8, 12.0
    pipe = LTX2(str(root))
    ch, cm = _hidden(1, 0)
    uh, um = _hidden(1, 1)
    conn = pipe.load_connectors()
    enc = lambda h, m: {k: np.asarray(v) for k, v in zip(("v", "a", "mask"), conn(jnp.asarray(h), jnp.asarray(m)))}  # noqa: E731
    grid, la = pipe.latent_grid(h_, w_, frames), pipe.audio_frames(frames, fps)
    rng = np.random.default_rng(3)
    x0 = rng.standard_normal((1, *grid, 8)).astype(np.float32)
    a0 = rng.standard_normal((1, la, 16)).astype(np.float32)
    guide = {**GUIDE, "stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0}
    opts = {k: guide[k] for k in ("audio_guidance_scale", "stg_scale", "audio_stg_scale", "modality_scale",
                                  "audio_modality_scale", "guidance_rescale", "audio_guidance_rescale")}
    opts["audio_guidance"] = opts.pop("audio_guidance_scale")
    pipe.step_cache = StepCache(_vidax_settings(method, p), steps)
    v, a = pipe.sample_latents(enc(ch, cm), enc(uh, um), seed=0, height=h_, width=w_, num_frames=frames, steps=steps,
                               guidance=guide["guidance_scale"], fps=fps, options={**opts, "use_cross_timestep": True},
                               latents=x0, audio_latents=a0)
    tr, av, vae = parts["transformer"], parts["audio_vae"], parts["vae"]
    ref = LTX2Pipeline(scheduler=parts["scheduler"], vae=vae, audio_vae=av, text_encoder=None, tokenizer=None,
                       connectors=parts["connectors"], transformer=tr, vocoder=parts["vocoder"])
    t = torch.from_numpy

    def call():
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            return ref(prompt_embeds=t(ch), prompt_attention_mask=t(cm), negative_prompt_embeds=t(uh),
                       negative_prompt_attention_mask=t(um), latents=t(np.ascontiguousarray(np.asarray(pack(x0)))),
                       audio_latents=t(a0 * av.latents_std.numpy() + av.latents_mean.numpy()), height=h_, width=w_,
                       num_frames=frames, frame_rate=fps, num_inference_steps=steps, output_type="latent",
                       return_dict=False, **guide)

    if method == "taylorseer":
        (rv, ra), computed = _hooked(tr, tr.transformer_blocks[0], tr.transformer_blocks[-1].ff,
                                     _diffusers_config(method, p, steps, ["transformer_blocks"]), call)
    else:
        with pytest.raises(ValueError, match="not registered"):  # why the published algorithm is the reference
            tr.enable_cache(_diffusers_config(method, p, steps, ["transformer_blocks"]))
        tr.disable_cache()
        nearest = [MAG_RATIOS[round(i * (len(MAG_RATIOS) - 1) / (steps - 1))] for i in range(steps)]
        hooks, computed = (_fbcache_reference(tr, p, branches=1) if method == "fbcache" else
                           _magcache_reference(tr, *p, nearest, steps, branches=1, second=("audio_hidden_states", 1)))
        try:
            rv, ra = call()
        finally:
            for hk in hooks:
                hk.remove()
    mean, std = vae.latents_mean.numpy().reshape(1, -1, 1, 1, 1), vae.latents_std.numpy().reshape(1, -1, 1, 1, 1)
    ours_v = v * std / vae.config.scaling_factor + mean
    ours_a = (a * av.latents_std.numpy() + av.latents_mean.numpy()).reshape(1, la, 4, 4).transpose(0, 2, 1, 3)
    ours = np.concatenate([ours_v.ravel(), ours_a.ravel()])
    return ours, np.concatenate([to_numpy(rv).ravel(), to_numpy(ra).ravel()]), computed, pipe.step_cache


@pytest.fixture(scope="module")
def cosmos3_ref(tmp_path_factory):
    """test_cosmos3_pipeline's tiny Cosmos3OmniPipeline (two MoT layers), saved as a folder vidax loads."""
    from tests.cosmos_fixtures import cosmos3_folder

    folder = tmp_path_factory.mktemp("cosmos3_cache")
    return cosmos3_folder(folder), folder


def _cosmos3_case(cosmos3_ref, method, p):
    """Cosmos3 (a "cond" then an "uncond" call per step): diffusers registers its MoT decoder layer (the
    generation stream ``gen_seq``, second, the hidden states) and its TaylorSeerCacheConfig runs on its
    ``layers``; its FirstBlockCache and MagCache hooks fail on that layer in diffusers 0.42 (they read the
    argument ``hidden_states`` / ``encoder_hidden_states`` by that name, not the registered ``gen_seq`` /
    ``und_seq``), so those two run against the published algorithms written above."""
    import torch

    from tests.test_cosmos3_pipeline import F, FPS, H, W, _noise
    from vidax.core.stepcache import StepCache
    from vidax.models.cosmos3.pipeline import Cosmos3Omni

    ref, folder = cosmos3_ref
    tr, steps, g = ref.transformer, 8, 4.0
    prompt, neg, lat = "a red panda paddles a canoe.", "blurry", _noise(1)

    def call():
        with torch.no_grad():
            return to_numpy(ref(prompt=prompt, negative_prompt=neg, num_frames=F, height=H, width=W, fps=FPS,
                                num_inference_steps=steps, guidance_scale=g, latents=torch.from_numpy(lat),
                                output_type="latent").video)

    from tests.refutil import to_numpy

    if method == "taylorseer":
        out, computed = _hooked(tr, tr.layers[0], tr.layers[-1].mlp_moe_gen,
                                _diffusers_config(method, p, steps, ["layers"]), call)
    else:
        # diffusers' hook fails at the first call (fbcache) or the first skip (magcache)
        with pytest.raises((ValueError, KeyError), match="hidden_states"):
            _hooked(tr, tr.layers[0], tr.layers[-1].mlp_moe_gen, _diffusers_config(method, p, steps, ["layers"]), call)
        nearest = [MAG_RATIOS[round(i * (len(MAG_RATIOS) - 1) / (steps - 1))] for i in range(steps)]
        where = dict(blocks="layers", hidden=("gen_seq", 1))
        hooks, computed = (_fbcache_reference(tr, p, **where) if method == "fbcache" else
                           _magcache_reference(tr, *p, nearest, steps, **where))
        try:
            out = call()
        finally:
            for hk in hooks:
                hk.remove()
    vx = Cosmos3Omni(folder)
    vx.step_cache = StepCache(_vidax_settings(method, p), steps)
    cond, uncond = vx.tokenize([prompt], neg, num_frames=F, height=H, width=W, fps=FPS)
    z = vx.sample_latents(cond, uncond, latents=lat, height=H, width=W, num_frames=F, steps=steps, guidance=g, fps=FPS)
    return z, out, computed, vx.step_cache


# per family, the method's parameters: fbcache threshold, magcache (threshold, max skips, retention),
# taylorseer (interval, warmup, order), teacache threshold; one of the ten in make test (each 4-26 s at its XLA level, most
# of it the cached units' compiles), all in make test-all
_FAMILY_CASES = [("cogvideox", "fbcache", 0.35), ("cogvideox", "magcache", (0.1, 2, 0.2)),
                 ("cogvideox", "taylorseer", (2, 2, 1)),
                 ("hunyuanvideo", "fbcache", 0.27), ("hunyuanvideo", "magcache", (0.1, 2, 0.2)),
                 ("hunyuanvideo", "taylorseer", (3, 2, 2)), ("hunyuanvideo", "teacache", 0.3),
                 ("hunyuanvideo1.5", "fbcache", 0.3), ("hunyuanvideo1.5", "magcache", (0.1, 2, 0.25)),
                 ("hunyuanvideo1.5", "taylorseer", (2, 2, 1))]


# the families added after (LTX-Video's magcache / taylorseer, ...): one of them in make test, all in make test-all
_MORE_CASES = [("ltx-video", "magcache", (0.1, 2, 0.2)), ("ltx-video", "taylorseer", (3, 2, 2)),
               ("cosmos2.5", "fbcache", 0.3), ("cosmos2.5", "magcache", (0.1, 2, 0.25)),
               ("cosmos2.5", "taylorseer", (2, 2, 1)), ("ltx2", "fbcache", 0.1), ("ltx2", "magcache", (0.1, 2, 0.25)),
               ("ltx2", "taylorseer", (2, 2, 1)), ("cosmos3", "fbcache", 0.2), ("cosmos3", "magcache", (0.1, 2, 0.25)),
               ("cosmos3", "taylorseer", (2, 2, 1))]


@pytest.mark.parametrize("family,method,p", sweep.sample(_FAMILY_CASES, 1, "stepcache-families")
                         + sweep.sample(_MORE_CASES, 1, "stepcache-more-families"),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_step_caches_match_diffusers_hooks_on_more_families(request, family, method, p):
    """CogVideoX, HunyuanVideo, HunyuanVideo 1.5: vidax's fbcache / magcache / taylorseer against diffusers'
    FirstBlockCacheConfig / MagCacheConfig / TaylorSeerCacheConfig on the same tiny pipeline, prompt
    embeddings, noise and settings (where diffusers' hook refuses the transformer, and for TeaCache,
    against the published algorithm written above): the same computed / skipped calls, the final
    latents within 1e-4."""
    case = {"cogvideox": (_cog_case, "cog_ref"), "hunyuanvideo": (_hunyuan_case, "hunyuan_ref"),
            "hunyuanvideo1.5": (_hunyuan15_case, "hunyuan15_ref"), "ltx-video": (_ltx_case, "ltx_ref"),
            "cosmos2.5": (_cosmos25_case, "cosmos25_ref"), "ltx2": (_ltx2_case, "ltx2_ref"),
            "cosmos3": (_cosmos3_case, "cosmos3_ref")}[family]
    ours, ref, ref_computed, cache = case[0](request.getfixturevalue(case[1]), method, p)
    got = [bool(b) for d in cache.decisions for b in d]
    assert got == ref_computed, (got, ref_computed, [c.tolist() for c in cache.changes])
    assert 1 < sum(got) < len(got), (got, [c.tolist() for c in cache.changes])  # the settings take decisions both ways
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
