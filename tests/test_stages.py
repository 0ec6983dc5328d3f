"""Staged, resumable runs: store, keys, commit records, resume, rerun, validation, CLI."""
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from stages import cli
from stages import run as R
from stages.request import Request, validate
from stages.store import RunStore, read_array
from vidax.video import read_mp4
from tests.children import ENV

REQ = dict(model="wan2.1-t2v-1.3b", preset="tiny", prompt="a lighthouse in a storm", height=32, width=48,
           num_frames=9, steps=4, guidance=4.0, seed=7, checkpoint_every=1)


def _gen(store_url, run_id="r1", **over):
    req = validate(Request(**{**REQ, **over}))
    run = RunStore(store_url).run(run_id)
    logs = []
    res = R.generate(run, req, log=logs.append)
    return run, req, {r.stage: r.status for r in res}, logs


def _frames(run, req):
    names = [n for n in R.stage_names(req) if n.startswith("decode/")]
    return np.concatenate([read_array(run.group(f"{n}.zarr"), "frames") for n in names], 1)


def test_end_to_end_file_store(tmp_path):
    run, req, st, _ = _gen(f"file://{tmp_path}")
    assert list(st) == ["encode", "sample", "decode/0", "decode/1", "decode/2", "mux"]
    assert set(st.values()) == {"ran"}
    video = read_mp4(tmp_path / "runs/r1/video.mp4")
    assert video.shape == (9, 32, 48, 3)
    assert (tmp_path / "runs/r1/preview.png").stat().st_size > 0
    # stored arrays carry dimension names and attributes; records name every output with a checksum
    lat = run.group("sample.zarr")["latents"]
    assert lat.metadata.dimension_names == ("batch", "channel", "frame", "height", "width")
    assert lat.attrs["logical_dtype"] == "float32" and lat.shape == (1, 16, 3, 4, 6)
    rec = run.record("decode/1")
    assert rec["key"] and rec["hardware"] and "decode/1.zarr::carry" in rec["outputs"]
    assert set(rec["inputs"]) == {"sample", "decode/0"} and rec["objects"] and rec["io"]["requests"] > 0
    m = run.read_json("manifest.json")
    assert [s["status"] for s in m["stages"]] == ["done"] * 6
    # the mp4 holds the decoded frames in order (H.264 + 4:2:0 chroma is lossy: compare luma)
    luma = lambda a: a.astype(float) @ [0.299, 0.587, 0.114]
    y_video, y_frames = luma(video), luma(_frames(run, req)[0])
    assert np.abs(y_video - y_frames).mean() < 8
    assert np.corrcoef(y_video.ravel(), y_frames.ravel())[0, 1] > 0.95


def test_bfloat16_embeddings_stored_losslessly(tmp_path):
    import ml_dtypes

    run, req, st, _ = _gen(f"file://{tmp_path}", dtype="bfloat16", steps=1)
    g = run.group("encode.zarr")
    assert g["prompt_embeds"].dtype == np.uint16 and g["prompt_embeds"].attrs["logical_dtype"] == "bfloat16"
    e = read_array(g, "prompt_embeds")
    assert e.dtype == ml_dtypes.bfloat16
    pipe = R.make_pipeline(req)
    ref = pipe.encode_prompts(req.prompts).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(e.view(np.uint16), ref.view(np.uint16))


def test_repeat_skips_everything_and_steps_change_reruns_from_sample(tmp_path):
    url = f"file://{tmp_path}"
    run, req, _, _ = _gen(url)
    finished = {s: run.record(s)["finished"] for s in R.stage_names(req)}
    time.sleep(1.1)
    _, _, st, _ = _gen(url)
    assert set(st.values()) == {"skipped"}
    assert {s: run.record(s)["finished"] for s in R.stage_names(req)} == finished
    _, _, st, _ = _gen(url, steps=5)
    assert st["encode"] == "skipped"
    assert all(v == "ran" for k, v in st.items() if k != "encode")


def test_sigkill_during_sampling_resumes_bitwise(tmp_path):
    url = f"file://{tmp_path / 'killed'}"
    args = [sys.executable, "-m", "stages.cli", "generate", "--prompt", REQ["prompt"], "--height", "32", "--width", "48",
            "--frames", "9", "--steps", "6", "--guidance", "4", "--seed", "7", "--checkpoint-every", "2",
            "--scheduler", "flow_euler_sde", "--run-id", "k1", "--store", url]
    env = {**ENV, "VIDAX_FAULTS": "sample:kill_after_step=4"}
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    run = RunStore(url).run("k1")
    assert run.record("sample") is None  # sampling never committed
    assert R._checkpoint_markers(run) == [4]  # only the newest checkpoint is kept, with its marker
    # resume (another process, no fault) and compare with an uninterrupted run
    p = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming from the step checkpoint at step 4/6" in p.stdout
    assert run.record("sample")["details"]["resumed_from_step"] == 4
    assert run.record("encode")["finished"] < run.record("sample")["started"]
    clean_url = f"file://{tmp_path / 'clean'}"
    args_clean = [a if a != url else clean_url for a in args]
    p = subprocess.run(args_clean, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    a = read_array(run.group("sample.zarr"), "latents")
    b = read_array(RunStore(clean_url).run("k1").group("sample.zarr"), "latents")
    assert a.tobytes() == b.tobytes()


def test_corrupt_or_deleted_decode_stage_rerun_alone(tmp_path, capsys):
    url = f"file://{tmp_path}"
    run, req, _, _ = _gen(url)
    before = _frames(run, req)
    finished = {s: run.record(s)["finished"] for s in R.stage_names(req)}
    time.sleep(1.1)
    # corrupt decode/1's frames (record stays: the checksum catches it)
    g = run.group("decode/1.zarr", "a")
    g["frames"][0, 0, 0, 0, 0] = (int(g["frames"][0, 0, 0, 0, 0]) + 1) % 256
    assert cli.main(["status", "r1", "--store", url]) == 0
    out = capsys.readouterr().out
    assert re.search(r"decode/1\s+corrupt", out) and re.search(r"decode/0\s+done", out)
    assert cli.main(["rerun", "r1", "--stage", "decode/1", "--store", url]) == 0
    changed = [s for s in R.stage_names(req) if run.record(s)["finished"] != finished[s]]
    assert changed == ["decode/1"]
    np.testing.assert_array_equal(_frames(run, req), before)
    # delete decode/2 entirely: status says missing; generate recomputes only it
    run.delete("decode/2.zarr")
    cli.main(["status", "r1", "--store", url])
    assert re.search(r"decode/2\s+corrupt", capsys.readouterr().out)
    _, _, st, _ = _gen(url)
    assert [s for s, v in st.items() if v == "ran"] == ["decode/2"]
    np.testing.assert_array_equal(_frames(run, req), before)


def test_sharded_offloaded_sampling_through_the_cli(tmp_path):
    """--mesh / --offload-chunk-size reach the sampling stage; the result matches one device."""
    url = f"file://{tmp_path}"
    base = ["generate", "--prompt", REQ["prompt"], "--height", "32", "--width", "48", "--frames", "9", "--steps", "3",
            "--store", url]
    assert cli.main(base + ["--run-id", "one"]) == 0
    assert cli.main(base + ["--run-id", "auto", "--mesh", "auto"]) == 0
    assert cli.main(base + ["--run-id", "off", "--mesh", "sp=2", "--offload-chunk-size", "1"]) == 0
    store = RunStore(url)
    ref = read_array(store.run("one").group("sample.zarr"), "latents")
    for rid, mesh in (("auto", "dp=2,sp=2"), ("off", "sp=2")):
        rec = store.run(rid).record("sample")
        assert rec["details"]["mesh"] == mesh
        out = read_array(store.run(rid).group("sample.zarr"), "latents")
        assert np.max(np.abs(out - ref)) <= 1e-5 * max(1.0, float(np.max(np.abs(ref))))
    assert store.run("off").record("sample")["details"]["offload_chunk_size"] == 1


def test_stage_command_runs_one_stage_and_checks_inputs(tmp_path, capsys):
    url = f"file://{tmp_path}"
    run, req, _, _ = _gen(url)
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    finished = run.record("decode/1")["finished"]
    run.delete_record("decode/0")
    # decode/1 was computed from a decode/0 that is no longer committed: stale, and it cannot run
    assert R.stage_status(run, "decode/1", keys["decode/1"], req=req, pipe=pipe) == "stale"
    assert cli.main(["stage", "r1", "decode/1", "--store", url]) == 1
    assert "needs decode/0, which is not committed" in capsys.readouterr().err
    # recomputing decode/0 gives the same content, so decode/1 is valid again without a rerun
    assert cli.main(["stage", "r1", "decode/0", "--store", url]) == 0
    assert R.committed(run, "decode/0", keys["decode/0"], req=req, pipe=pipe)
    assert R.stage_status(run, "decode/1", keys["decode/1"], req=req, pipe=pipe) == "done"
    assert cli.main(["stage", "r1", "decode/1", "--store", url]) == 0
    assert "up to date" in capsys.readouterr().out and run.record("decode/1")["finished"] == finished


def test_a_stage_frees_its_garbage_without_walking_the_whole_heap(tmp_path):
    """No device array survives a stage, with no collection by the caller and none automatic: the
    stage itself frees what it dropped (its weights, even where cycles hold them), and every
    collection while it ran left the heap that existed before it frozen -- a long-lived worker does
    not pay a full heap walk per stage."""
    import gc

    import jax

    req = validate(Request(**REQ))
    run = RunStore(f"file://{tmp_path}").run("own")
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    R.generate(RunStore(f"file://{tmp_path}/warm").run("w"), req, log=lambda m: None)  # caches filled
    old_heap = [object() for _ in range(200_000)]  # a long-lived process's heap
    walks = []

    def seen(phase, info):
        if phase == "start":  # the objects this collection walks: the unfrozen ones of its generations
            gen = info["generation"]
            walks.append((gen, sum(len(gc.get_objects(generation=g)) for g in range(gen + 1))))

    baseline = {id(a) for a in jax.live_arrays()}
    gc.disable()
    gc.callbacks.append(seen)
    try:
        for stage in keys:
            walks.clear()
            R.run_stage(run, req, pipe, stage, keys, log=lambda m: None)
            assert walks, f"{stage}: nothing collected"
            # what existed before the stage (>= old_heap) is never walked; what the stage made is
            assert all(walked < len(old_heap) for _, walked in walks), f"{stage}: {walks}"
            alive = [a for a in jax.live_arrays() if id(a) not in baseline]
            assert not alive, f"after {stage}: {len(alive)} device arrays alive, e.g. {[a.shape for a in alive[:5]]}"
            assert gc.get_freeze_count() == 0
    finally:
        gc.callbacks.remove(seen)
        gc.enable()
    del old_heap


def test_sampling_outside_a_stage_frees_its_weights_without_walking_the_callers_heap():
    """A library caller (a notebook, a service calling ``pipe.sample_latents``) has no stage around
    the call: the DiT it loads is still freed when it returns, and no collection while it runs walks
    the caller's heap (a full ``gc.collect()`` per call cost an xdist worker seconds each)."""
    import gc

    import jax

    req = validate(Request(**REQ))
    pipe = R.make_pipeline(req)
    rng = np.random.default_rng(0)
    cond = rng.standard_normal((1, 8, pipe.dit_config().text_dim)).astype(np.float32)

    def sample():
        return pipe.sample_latents(cond, cond, seed=1, height=32, width=48, num_frames=5, steps=2)

    want = sample()  # programs compiled
    old_heap = [object() for _ in range(200_000)]
    walks = []

    def seen(phase, info):
        if phase == "start":
            gen = info["generation"]
            walks.append(sum(len(gc.get_objects(generation=g)) for g in range(gen + 1)))

    baseline = {id(a) for a in jax.live_arrays()}
    gc.disable()
    gc.callbacks.append(seen)
    try:
        np.testing.assert_array_equal(sample(), want)  # (the result, a view of the last latents, dropped)
        alive = [a for a in jax.live_arrays() if id(a) not in baseline]
    finally:
        gc.callbacks.remove(seen)
        gc.enable()
    assert walks and all(w < len(old_heap) for w in walks), walks
    assert not alive, f"{len(alive)} device arrays alive, e.g. {[a.shape for a in alive[:5]]}"
    assert gc.get_freeze_count() == 0
    del old_heap


# ------------------------------------------------------------------ validation
def _cli_fails(tmp_path, capsys, args, field, text):
    store = tmp_path / "store"
    rc = cli.main(["generate", "--store", str(store), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.count("\n") == 0, f"expected one line, got: {err}"
    assert err.startswith(f"vidax: error: {field}:"), err
    assert text in err, err
    assert not (store / "runs").exists(), "nothing may be committed for an invalid request"


@pytest.mark.parametrize("args,field,text", [
    (["--prompt", "x", "--model", "wan9"], "model", "wan2.1-t2v-1.3b, wan2.1-t2v-14b"),
    (["--prompt", "x", "--height", "40"], "height", "multiple of 16"),
    (["--prompt", "x", "--width", "0"], "width", "multiple of 16"),
    (["--prompt", "x", "--frames", "8"], "num_frames", "4k+1 (e.g. 9)"),
    (["--prompt", "   "], "prompt", "non-empty"),
    (["--prompt", "x", "--run-id", "../evil"], "run_id", "letters, digits"),
    (["--prompt", "x", "--run-id", "a/b"], "run_id", "letters, digits"),
    (["--prompt", "x", "--preset", "huge"], "preset", "presets: tiny"),
    (["--prompt", "x", "--decode-stages", "9"], "decode_stages", "between 1 and 3"),
    (["--prompt", "x", "--mesh", "tp=two"], "mesh", "dp=1,tp=4,sp=2"),
    (["--prompt", "x", "--offload-chunk-size", "0"], "offload_chunk_size", "or all"),
])
def test_validation_errors(tmp_path, capsys, args, field, text):
    _cli_fails(tmp_path, capsys, args, field, text)


def test_unwritable_store(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    blocker = tmp_path / "ro" / "file"
    blocker.write_text("not a folder")
    rc = cli.main(["generate", "--prompt", "x", "--store", str(blocker / "sub")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("vidax: error: store: cannot write to store"), err


def test_unreachable_gcs_store(tmp_path, capsys, monkeypatch):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    rc = cli.main(["generate", "--prompt", "x", "--store", "gs://bucket/prefix"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("vidax: error: store: cannot write to store gs://bucket/prefix"), err


# ------------------------------------------------------------------ GCS (emulator: the gcs_emulator fixture in conftest.py)
def test_end_to_end_gcs(gcs_emulator, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    url = "gs://vidax-test/team/runs-store"
    args = ["generate", "--prompt", REQ["prompt"], "--height", "32", "--width", "48", "--frames", "9", "--steps", "3",
            "--run-id", "g1", "--store", url]
    assert cli.main(args) == 0
    assert "video: gs://vidax-test/team/runs-store/runs/g1/video.mp4" in capsys.readouterr().out
    run = RunStore(url).run("g1")
    run.get_file("video.mp4", tmp_path / "v.mp4")
    assert read_mp4(tmp_path / "v.mp4").shape == (9, 32, 48, 3)
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("up to date, skipped") == 6
    assert cli.main(["ls", "--store", url]) == 0
    assert "g1" in capsys.readouterr().out


# ------------------------------------------------------------------ image-to-video and Wan2.2 recipes
def test_image_requirements_are_validated(tmp_path, capsys, cond_image):
    _cli_fails(tmp_path, capsys, ["--prompt", "x", "--model", "wan2.1-i2v-480p"], "image", "image-to-video model")
    _cli_fails(tmp_path, capsys, ["--prompt", "x", "--image", cond_image], "image", "takes no image")
    bad = tmp_path / "not-an-image.png"
    bad.write_text("hello")
    _cli_fails(tmp_path, capsys, ["--prompt", "x", "--model", "wan2.1-i2v-480p", "--image", str(bad)], "image",
               "cannot read")


def test_image_size_follows_aspect_and_sp_degree(cond_image):
    from vidax.pipeline import Geometry

    geo = Geometry(spatial=8, temporal=4, latent_channels=16, patch=(1, 2, 2))
    h, w = geo.fit_size(720, 1280, 480 * 832, sp=1)
    assert h % 16 == 0 and w % 16 == 0 and abs((w / h) - 16 / 9) < 0.05
    h, w = geo.fit_size(700, 1000, 480 * 832, sp=8)
    assert ((h // 16) * (w // 16)) % 8 == 0 and abs((w / h) - 1000 / 700) < 0.1
    r = validate(Request(model="wan2.1-i2v-480p", prompt="x", image=cond_image, mesh="sp=2"))
    assert ((r.height // 16) * (r.width // 16)) % 2 == 0 and r.width > r.height


# ------------------------------------------------------------------ family options
def test_guidance_2_reaches_the_low_noise_expert(tmp_path):
    """--guidance-2 is kept by the request, enters the sample key, and changes exactly the steps
    the low-noise expert runs."""
    from vidax.models.wan.pipeline import WanT2V

    url = f"file://{tmp_path}"
    base = ["generate", "--model", "wan2.2-t2v-a14b", "--prompt", "a fox", "--frames", "5", "--steps", "4",
            "--store", url]
    assert cli.main(base + ["--run-id", "default"]) == 0
    assert cli.main(base + ["--run-id", "g7", "--guidance-2", "7"]) == 0
    store = RunStore(url)
    rd, r7 = R.load_request(store.run("default")), R.load_request(store.run("g7"))
    assert rd.options["guidance_2"] == 3.0 and r7.options["guidance_2"] == 7.0
    kd, k7 = R.stage_keys(rd, R.make_pipeline(rd)), R.stage_keys(r7, R.make_pipeline(r7))
    assert kd["encode"] == k7["encode"] and kd["sample"] != k7["sample"]
    ld = read_array(store.run("default").group("sample.zarr"), "latents")
    l7 = read_array(store.run("g7").group("sample.zarr"), "latents")
    assert np.abs(ld - l7).max() > 1e-3
    # step by step: the high-noise expert's steps are identical, the low-noise expert's differ
    pipe = WanT2V("tiny-a14b")
    cond, uncond = pipe.encode_prompts(["a fox"]), pipe.encode_prompts([""])
    sched = pipe.scheduler(4, "unipc", 12.0)
    segs = pipe.expert_segments(sched)
    assert [s[0] for s in segs] == [1, 2]
    traces = {}
    for g2 in (3.0, 7.0):
        xs = []
        pipe.sample_latents(cond, uncond, height=64, width=64, num_frames=5, steps=4, guidance=5.0, guidance_2=g2,
                            scheduler=pipe.scheduler(4, "unipc", 12.0), on_step=lambda i, x, s: xs.append(np.asarray(x)))
        traces[g2] = xs
    k = segs[1][1]  # first low-noise step
    for i in range(k):
        np.testing.assert_array_equal(traces[3.0][i], traces[7.0][i])
    assert all(np.abs(traces[3.0][i] - traces[7.0][i]).max() > 0 for i in range(k, 4))


def test_prompt_files_set_family_options(tmp_path):
    from stages.prompts import parse_prompt_file

    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "a fox", "model": "wan2.2-t2v-a14b", "guidance_2": 7}\n'
                 '{"prompt": "a cat", "model": "wan2.1-t2v-1.3b", "guidance_2": 7}\n')
    a, b = parse_prompt_file(str(j))
    assert a.request.options["guidance_2"] == 7.0
    assert b.request is None and "guidance_2" in b.error and "line 2" in b.error
    c = tmp_path / "p.csv"
    c.write_text("prompt,model,guidance_2,steps\na fox,wan2.2-t2v-a14b,6.5,3\n")
    (line,) = parse_prompt_file(str(c))
    assert line.request.options["guidance_2"] == 6.5 and line.request.steps == 3


def test_vidax_batch_runs_a_prompt_file_locally(tmp_path, capsys):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "a red kite", "steps": 2, "num_frames": 5, "height": 32, "width": 32}\n'
                 '{"prompt": "a blue kite", "steps": 2.7}\n'
                 '{"prompt": "a green kite", "steps": 2, "num_frames": 5, "height": 32, "width": 32, "seed": 3}\n')
    url = f"file://{tmp_path / 'store'}"
    rc = cli.main(["batch", str(f), "--store", url])
    out, err = capsys.readouterr()
    assert rc == 0, out + err  # the valid lines all succeeded; the rejected one is reported
    assert "line 2" in err and "steps" in err
    assert re.search(r"2 done, 0 failed, 1 rejected", out)
    assert len(RunStore(url).list_runs()) == 2
