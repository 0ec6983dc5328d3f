"""Nothing half-done: corrupt state repaired, transient errors retried (never read as data loss),
checkpoints whole or absent, content-addressed stages, racing workers, fresh object-store reads,
and a run store that verifies without reading data.

The GCS cases run through a fault-injecting proxy between gcsfs and the emulator
(``tests/gcs_proxy.py``): 503/429 answers, answers dropped after the request was applied, the
network cut after the N-th request, random faults."""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from stages import cli
from stages import run as R
from stages.request import Request, validate
from stages.store import RunStore, read_array
from tests import sweep
from tests.gcs_proxy import FaultProxy
from tests.children import ENV

SMALL = dict(prompt="a kite over the dunes", height=32, width=32, num_frames=9, steps=2, checkpoint_every=1, seed=5)


def _req(**over):
    return validate(Request(**{**SMALL, **over}))


def _gen(run, req, logs=None):
    return R.generate(run, req, log=(logs.append if logs is not None else lambda m: None))


def _results(run, req):
    """Everything a run produced, as bytes: sample outputs, decode frames, the mp4."""
    out = {"latents": read_array(run.group("sample.zarr"), "latents").tobytes()}
    for s in R.stage_names(req):
        if s.startswith("decode/"):
            out[s] = read_array(run.group(f"{s}.zarr"), "frames").tobytes()
    out["video.mp4"] = run.read_bytes("video.mp4")
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    req = _req()
    run = RunStore(tmp_path_factory.mktemp("ref")).run("ref")
    _gen(run, req)
    return req, _results(run, req)


# ------------------------------------------------------------------ content addressing
def test_status_reads_no_array_data_and_catches_replaced_objects(tmp_path, reference, capsys):
    req, want = reference
    url = str(tmp_path / "s")
    run = RunStore(url).run("r")
    _gen(run, req)
    fresh = RunStore(url)
    assert cli.main(["status", "r", "--store", url]) == 0
    assert capsys.readouterr().out.count(" done ") == len(R.stage_names(req))
    # the same check through a counting store: records and listings only
    rs = RunStore(url)
    r2 = rs.run("r")
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    before = rs.counter.snapshot()
    assert all(R.stage_status(r2, s, k, req=req, pipe=pipe) == "done" for s, k in keys.items())
    used = rs.counter.snapshot()
    assert used["bytes_read"] - before["bytes_read"] < 64 * 1024, used
    assert used["requests"] - before["requests"] <= 50, used
    del fresh
    # an object replaced behind the store (different bytes, new metadata) is corrupt
    chunk = next(p for p in (tmp_path / "s/runs/r/decode/1.zarr/frames").rglob("*") if p.is_file() and "c" in p.parts)
    chunk.write_bytes(chunk.read_bytes()[::-1])
    assert cli.main(["status", "r", "--store", url]) == 0
    assert re.search(r"decode/1\s+corrupt", capsys.readouterr().out)


def test_verify_catches_a_flipped_byte_with_identical_metadata(tmp_path, reference, capsys):
    req, _ = reference
    url = str(tmp_path / "s")
    run = RunStore(url).run("r")
    _gen(run, req)
    chunk = next(p for p in (tmp_path / "s/runs/r/sample.zarr/latents").rglob("*") if p.is_file() and "c" in p.parts)
    st = chunk.stat()
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x10
    chunk.write_bytes(bytes(data))
    os.utime(chunk, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cli.main(["status", "r", "--store", url]) == 0
    assert re.search(r"sample\s+done", capsys.readouterr().out)  # metadata alone cannot see it
    assert cli.main(["status", "r", "--store", url, "--verify"]) == 0
    assert re.search(r"sample\s+corrupt", capsys.readouterr().out)
    # a consumer reading it refuses it: rerunning decode/0 recomputes sample first (generate)
    run.delete_record("decode/0")
    logs = []
    _gen(run, req, logs)
    assert any("[sample] damaged" in m for m in logs), logs
    assert read_array(run.group("sample.zarr"), "latents").tobytes() == reference[1]["latents"]


def test_recomputed_upstream_with_different_content_makes_downstream_stale(tmp_path, reference, capsys):
    req, _ = reference
    url = str(tmp_path / "s")
    run = RunStore(url).run("r")
    _gen(run, req)
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    real = pipe.sample

    def shifted(*a, **kw):  # the same key, other content (a model change the key cannot see)
        out = real(*a, **kw)
        out["latents"].array = out["latents"].array + 1.0
        return out

    pipe.sample = shifted
    R.run_stage(run, req, pipe, "sample", keys, log=lambda m: None)
    pipe.sample = real
    statuses = {s: R.stage_status(run, s, k, req=req, pipe=pipe) for s, k in keys.items()}
    assert statuses["encode"] == statuses["sample"] == "done"
    assert all(v == "stale" for s, v in statuses.items() if s.startswith("decode/")), statuses
    assert statuses["mux"] == "stale"
    assert cli.main(["status", "r", "--store", url]) == 0
    assert re.search(r"decode/0\s+stale", capsys.readouterr().out)


def test_lost_logical_dtype_is_caught(tmp_path):
    req = _req(dtype="bfloat16", steps=1)
    url = str(tmp_path / "s")
    run = RunStore(url).run("r")
    _gen(run, req)
    meta = tmp_path / "s/runs/r/encode.zarr/prompt_embeds/zarr.json"
    doc = json.loads(meta.read_text())
    del doc["attributes"]["logical_dtype"]
    meta.write_text(json.dumps(doc))
    # the consolidated copy in the group document too
    gdoc = tmp_path / "s/runs/r/encode.zarr/zarr.json"
    g = json.loads(gdoc.read_text())
    g["consolidated_metadata"]["metadata"]["prompt_embeds"]["attributes"].pop("logical_dtype")
    gdoc.write_text(json.dumps(g))
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    assert R.stage_status(run, "encode", keys["encode"], req=req, pipe=pipe) == "corrupt"
    assert R.stage_status(run, "encode", keys["encode"], "full", req=req, pipe=pipe) == "corrupt"


# ------------------------------------------------------------------ corrupt documents repaired
@pytest.mark.parametrize("doc,garbage", sweep.sample_per_group(  # every document; all three garbages: test-all
    [(d, g) for d in ["records/sample.json", "records/decode-1.json", "sample.zarr/zarr.json",
                      "decode/0.zarr/frames/zarr.json", "request.json", "manifest.json"]
     for g in [b"", b"{not json", b"\x00\xff" * 10]], lambda c: c[0], 1, "corrupt-docs"))
def test_corrupt_documents_are_repaired(tmp_path, reference, capsys, doc, garbage):
    req, want = reference
    url = str(tmp_path / "s")
    run = RunStore(url).run("r")
    _gen(run, req)
    (tmp_path / "s/runs/r" / doc).write_bytes(garbage)
    rc = cli.main(["status", "r", "--store", url])
    out, err = capsys.readouterr()
    if doc == "request.json":
        assert rc == 1 and "request.json is unreadable" in err and err.count("\n") == 1, err
    else:
        assert rc == 0, err
        if doc != "manifest.json":
            stage = doc.replace("records/", "").replace(".json", "").replace("decode-", "decode/")
            stage = {"sample.zarr/zarr.json": "sample", "decode/0.zarr/frames/zarr.json": "decode/0"}.get(doc, stage)
            assert re.search(rf"{re.escape(stage)}\s+corrupt", out), out
    _gen(run, req)  # generate repairs whatever it finds
    assert _results(run, req) == want


# ------------------------------------------------------------------ checkpoints whole or absent
def _killed_run(url, extra_env=None, steps=4):
    args = [sys.executable, "-m", "stages.cli", "generate", "--prompt", SMALL["prompt"], "--height", "32",
            "--width", "32", "--frames", "9", "--steps", str(steps), "--checkpoint-every", "1", "--seed", "5",
            "--run-id", "k", "--store", url]
    p = subprocess.run(args, env={**ENV, "VIDAX_FAULTS": "sample:kill_after_step=2", **(extra_env or {})},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode < 0, p.stdout + p.stderr
    return args


@pytest.mark.parametrize("damage", sweep.sample(["chunk", "array-meta", "marker", "marker-garbage"], 1, "damage"))
def test_damaged_checkpoint_is_never_resumed_from(tmp_path, damage):
    url = str(tmp_path / "s")
    args = _killed_run(url)
    ck = tmp_path / "s/runs/k/checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["00002.json", "00002.zarr"]
    if damage == "chunk":
        next(p for p in (ck / "00002.zarr/state").rglob("*") if p.is_file() and "c" in p.parts).unlink()
    elif damage == "array-meta":
        (ck / "00002.zarr/state/zarr.json").unlink()
        (ck / "00002.zarr/zarr.json").unlink()
    elif damage == "marker":
        (ck / "00002.json").unlink()
    else:
        (ck / "00002.json").write_text("{")
    p = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming" not in p.stdout
    if damage in ("chunk", "array-meta", "marker-garbage"):
        assert "warning: checkpoint" in p.stdout and "00002" in p.stdout
    run = RunStore(url).run("k")
    clean = RunStore(str(tmp_path / "clean")).run("k")
    req = R.load_request(run)
    _gen(clean, req)
    assert _results(run, req) == _results(clean, req)
    assert not ck.exists() or not any(ck.iterdir())  # cleaned up after the commit


# ------------------------------------------------------------------ racing workers
def _race(url, tmp_path, env=None):
    args = [sys.executable, "-m", "stages.cli", "generate", "--prompt", SMALL["prompt"], "--height", "32",
            "--width", "32", "--frames", "9", "--steps", "2", "--seed", "5", "--run-id", "race", "--store", url]
    procs = [subprocess.Popen(args, env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, o + e
        assert "Traceback" not in e, e
    ran = [len(re.findall(r"^\[(\S+)\] running$", o, re.M)) for o, _ in outs]
    stages = {s for o, _ in outs for s in re.findall(r"^\[(\S+)\] running$", o, re.M)}
    return ran, stages, outs


def test_two_processes_race_on_one_run_file(tmp_path):
    ran, stages, outs = _race(str(tmp_path / "s"), tmp_path)
    assert sum(ran) == len(stages) == 6, outs  # every stage computed once, by one of them


def test_two_processes_race_on_one_run_gcs(gcs_emulator, tmp_path):
    ran, stages, outs = _race(f"gs://vidax-test/race-{time.time_ns()}", tmp_path,
                              {"STORAGE_EMULATOR_HOST": gcs_emulator})
    assert sum(ran) == len(stages) == 6, outs


# ------------------------------------------------------------------ GCS faults
@pytest.fixture
def proxy(gcs_emulator, monkeypatch):
    import stages.store as S

    p = FaultProxy(gcs_emulator)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.url)
    monkeypatch.setenv("VIDAX_GCS_RETRIES", "1")  # our own retries, quick ones, are the ones under test
    monkeypatch.setattr(S, "RETRY_BASE_S", 0.02)
    yield p
    p.close()


def _gs(tag):
    return f"gs://vidax-test/{tag}-{time.time_ns()}"


def test_transient_errors_are_retried_and_never_recompute(proxy, reference):
    req, want = reference
    run = RunStore(_gs("transient")).run("r")
    proxy.fail_next(503, 2)
    _gen(run, req)
    assert _results(run, req) == want
    finished = {s: run.record(s)["finished"] for s in R.stage_names(req)}
    time.sleep(1.1)
    for status in (503, 429):  # during verification: retried, nothing recomputed or deleted
        proxy.fail_next(status, 3)
        res = _gen(RunStore(run.store.url).run("r"), req)
        assert {r.status for r in res} == {"skipped"}
    proxy.drop_after_apply(2)  # answers lost after the change was applied
    res = _gen(RunStore(run.store.url).run("r"), req)
    assert {r.status for r in res} == {"skipped"}
    assert {s: run.record(s)["finished"] for s in R.stage_names(req)} == finished


def test_persistent_transient_errors_fail_clearly(proxy, reference):
    req, _ = reference
    run = RunStore(_gs("persistent")).run("r")
    _gen(run, req)
    proxy.fail_next(503, 1000)
    with pytest.raises(Exception) as e:
        _gen(RunStore(run.store.url).run("r"), req)
    proxy.heal()
    assert "kept failing" in str(e.value) or "503" in str(e.value)
    res = _gen(RunStore(run.store.url).run("r"), req)  # nothing was lost
    assert {r.status for r in res} == {"skipped"}


def test_network_cut_at_every_request_of_a_commit_is_repaired(proxy, monkeypatch):
    """Cut the network after the N-th request of the sample stage: for every N across its commit
    and the checkpoint clean-up, and at evenly spaced N over its checkpoint writes (``make test``:
    8 of them, a seeded sample); a fault-free generate then repairs the run bitwise."""
    import stages.store as S

    req = _req(num_frames=5, decode_stages=1)  # the smallest run: each repair is short
    ref = RunStore(_gs("cutref")).run("r")
    _gen(ref, req)
    want = _results(ref, req)
    monkeypatch.setattr(S, "RETRY_ATTEMPTS", 3)  # a cut network fails fast, so every N is affordable
    monkeypatch.setattr(S, "LEASE_CONFIRM_S", 0.0)  # one writer here: no lease race to settle
    # where the sample stage's requests are in a run: count them once
    probe = RunStore(_gs("probe")).run("r")
    marks = {}

    def mark(m):
        if m.startswith("[") and m.endswith("running"):
            marks[m.split("]")[0][1:]] = len(proxy.log)

    proxy.reset_log()
    R.generate(probe, req, log=mark)
    first, last = marks["sample"], marks["decode/0"]
    assert last - first >= 10
    # every N from the stage's commit (its first request on sample.zarr) through the checkpoint
    # clean-up and the lease release; evenly spaced ones over the steps' checkpoint writes before
    commit = next(i for i in range(first, last) if "sample.zarr" in proxy.log[i][1])
    cuts = sorted({*range(commit, last + 1), *np.linspace(first, commit, 6).round().astype(int).tolist()})
    cuts = sweep.sample(cuts, 8, "network-cut")  # every one under make test-all
    failures = 0
    for n in cuts:
        run = RunStore(_gs(f"cut{n}")).run("r")
        proxy.reset_log()
        proxy.cut_after(n)
        try:
            _gen(run, req)
        except Exception:  # noqa: BLE001 - the cut
            failures += 1
        proxy.heal()
        _gen(RunStore(run.store.url).run("r"), req)
        assert _results(run, req) == want, f"cut after request {n}"
    assert failures >= len(cuts) // 2


def test_random_faults_complete_bitwise(proxy, reference):
    req, want = reference
    run = RunStore(_gs("random")).run("r")
    proxy.random_faults(0.05, seed=3)
    _gen(run, req)
    proxy.heal()
    assert _results(run, req) == want


def test_long_lived_store_sees_other_writers(gcs_emulator, monkeypatch, reference):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    req, _ = reference
    url = _gs("longlived")
    watcher = RunStore(url)
    assert watcher.list_runs() == []
    code = ("from stages import run as R; from stages.request import Request, validate; from stages.store import RunStore;"
            f"r = RunStore({url!r}).run('other'); R.generate(r, validate(Request(**{SMALL!r})), log=lambda m: None);"
            "r.write_json('records/extra.json', {'x': 'y' * 5000})")
    p = subprocess.run([sys.executable, "-c", code], env={**ENV, "STORAGE_EMULATOR_HOST": gcs_emulator},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert watcher.list_runs() == ["other"]
    run = watcher.run("other")
    assert run.read_json("records/extra.json") == {"x": "y" * 5000}
    run.write_json("records/extra.json", {"x": "short"})
    p = subprocess.run([sys.executable, "-c", f"from stages.store import RunStore; "
                        f"RunStore({url!r}).run('other').write_json('records/extra.json', {{'x': 'z' * 9000}})"],
                       env={**ENV, "STORAGE_EMULATOR_HOST": gcs_emulator}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert run.read_json("records/extra.json") == {"x": "z" * 9000}  # the longer rewrite, whole


def test_mux_reads_frames_only(tmp_path, reference):
    req, _ = reference
    run = RunStore(str(tmp_path / "s")).run("r")
    _gen(run, req)
    frames = sum(p.stat().st_size for s in R.stage_names(req) if s.startswith("decode/")
                 for p in (tmp_path / f"s/runs/r/{s}.zarr/frames").rglob("*") if p.is_file())
    io = run.record("mux")["io"]
    assert io["bytes_read"] <= 1.2 * frames + 32 * 1024, (io, frames)
    carry = sum(p.stat().st_size for p in (tmp_path / "s/runs/r").rglob("carry/**/*") if p.is_file())
    assert carry > 0 and io["bytes_read"] < frames + carry  # the carries were not read


def test_gcs_request_attempts_follow_the_setting(proxy, monkeypatch):
    """gcsfs fixes its own retries at 6 (with 31 s of backoff); the store's gcsfs makes exactly
    ``VIDAX_GCS_RETRIES`` attempts per request, under our own retry."""
    import stages.store as S

    store = RunStore(_gs("attempts"))  # built under the fixture's VIDAX_GCS_RETRIES=1
    monkeypatch.setattr(S, "RETRY_ATTEMPTS", 1)
    proxy.reset_log()
    proxy.fail_next(503, 100)
    with pytest.raises(Exception):
        store.fs.pipe_file(store.path("x"), b"x")
    assert len(proxy.log) == 1
    proxy.heal()
    monkeypatch.setenv("VIDAX_GCS_RETRIES", "3")
    store = RunStore(_gs("attempts3"))
    proxy.reset_log()
    proxy.fail_next(503, 2)
    store.fs.pipe_file(store.path("x"), b"x")  # third attempt succeeds
    assert len(proxy.log) == 3


def test_a_lease_whose_release_failed_does_not_block_this_process(tmp_path):
    """A stage lease left behind by this process (its release failed, e.g. on a cut network) is
    not live for this process's next attempt; another process's unexpired lease is."""
    import stages.store as S

    run = RunStore(str(tmp_path / "s")).run("r")
    assert run.acquire_lease("sample", "first", 120)
    assert not run.acquire_lease("sample", "other", 120)  # held and computing: refused
    S._HELD.discard("first")  # what release_lease does before a delete that then fails
    assert run.lease("sample").owner == "first" and not run.lease("sample").live()
    assert run.acquire_lease("sample", "second", 120)
    doc = run.read_json("leases/sample.json")
    run.write_json("leases/sample.json", {**doc, "owner": "elsewhere", "pid": 1})  # another live process
    assert run.lease("sample").live() and not run.acquire_lease("sample", "third", 120)
