"""Multi-host stages on one machine: two processes joined by ``jax.distributed`` on 127.0.0.1 (gloo
CPU collectives, 2 fake CPU devices each) run ``vidax generate --mesh dp=2,tp=2`` as one JAX
program; one process with 4 fake devices runs the same request. Real subprocesses, a real
coordinator, a real SIGKILL, a real Zarr store.

One module-scoped scenario (each step is a few tens of seconds of compilation on CPU):
1. two processes start the run; process 1 is SIGKILLed after sampling step 1 (``VIDAX_FAULTS``
   in its environment only) -> both exit non-zero within the timeout, ``sample`` is not committed,
   the step-1 checkpoint is there;
2. the same two-process command again -> resumes from that checkpoint and completes;
3. one process with 4 devices runs the request into another run -> latents and frames are
   bitwise equal to the two-process run's.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zarr

from tests.sweep import xla_flags

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 10  # VIDAX_DISTRIBUTED_TIMEOUT of the two-process job
ARGS = ["--prompt", "a red fox in fresh snow", "--mesh", "dp=2,tp=2", "--steps", "2", "--frames", "1",
        "--height", "32", "--width", "32", "--decode-stages", "1", "--checkpoint-every", "1", "--seed", "7"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIDAX_") or k == "VIDAX_FAMILIES"}
    env.update(XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
               VIDAX_COMPILE_CACHE="off", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _generate(store: Path, run_id: str, log: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "stages.cli", "generate", *ARGS, "--store", str(store), "--run-id", run_id]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _two_processes(store: Path, run_id: str, logs: Path, tag: str, faults_1: str = "") -> dict:
    """Run the two-process job; returns each process's exit code and exit time."""
    port = _free_port()
    common = dict(VIDAX_COORDINATOR=f"127.0.0.1:{port}", VIDAX_NUM_PROCESSES="2",
                  VIDAX_DISTRIBUTED_TIMEOUT=str(TIMEOUT))
    procs = [_generate(store, run_id, logs / f"{tag}-{i}.log",
                       _env(2, VIDAX_PROCESS_ID=str(i), **common, **({"VIDAX_FAULTS": faults_1} if i and faults_1 else {})))
             for i in range(2)]
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 600
    while len(ended) < 2 and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.05)
    for p in procs:  # a hang is a failure of the test, never of the machine
        if p.poll() is None:
            p.kill()
            p.wait()
    return {"rc": [p.returncode for p in procs], "ended": ended,
            "logs": [(logs / f"{tag}-{i}.log").read_text() for i in range(2)]}


def _read(run: Path, group: str, name: str) -> np.ndarray:
    return zarr.open_group(str(run / group), mode="r")[name][...]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    store, logs = tmp / "store", tmp / "logs"
    logs.mkdir()
    out = {"store": store}
    out["killed"] = _two_processes(store, "two", logs, "killed", faults_1="sample:kill_after_step=1")
    run = store / "runs" / "two"
    out["after_kill"] = {"records": sorted(p.name for p in (run / "records").glob("*.json")),
                         "checkpoints": sorted(p.name for p in (run / "checkpoints").glob("*.json")),
                         "leases": sorted(p.name for p in (run / "leases").glob("*.json"))}
    out["rerun"] = _two_processes(store, "two", logs, "rerun")
    p = _generate(store, "one", logs / "one.log", _env(4))
    out["one"] = {"rc": p.wait(timeout=600), "log": (logs / "one.log").read_text()}
    return out


def test_killing_one_process_fails_both_and_commits_nothing(scenario):
    k = scenario["killed"]
    assert k["rc"][1] == -9, k["logs"][1][-2000:]  # SIGKILLed after sampling step 1
    assert k["rc"][0] not in (0, None), k["logs"][0][-2000:]
    assert k["ended"][0] - k["ended"][1] < TIMEOUT + 20, "process 0 outlived its dead peer past the timeout"
    assert "step 1/2" in k["logs"][0]  # it died during sampling
    after = scenario["after_kill"]
    assert after["records"] == ["encode.json"]  # nothing committed for sample
    assert after["checkpoints"] == ["00001.json"]  # written whole by process 0 before the kill
    assert after["leases"] == []  # process 0 released the stage's lease on its way out


def test_rerun_resumes_and_completes(scenario):
    r = scenario["rerun"]
    assert r["rc"] == [0, 0], r["logs"][0][-3000:] + r["logs"][1][-3000:]
    assert "resuming from the step checkpoint at step 1/2" in r["logs"][0]
    assert "resuming from the step checkpoint at step 1/2" in r["logs"][1]  # the same checkpoint on both
    run = scenario["store"] / "runs" / "two"
    rec = json.loads((run / "records" / "sample.json").read_text())
    assert rec["details"]["resumed_from_step"] == 1
    assert rec["hardware"].endswith("2 processes")
    assert not list((run / "checkpoints").glob("*.json"))  # cleaned up after the commit
    assert (run / "video.mp4").stat().st_size > 0
    m = json.loads((run / "manifest.json").read_text())
    assert [s["status"] for s in m["stages"]] == ["done"] * len(m["stages"])


def test_two_processes_bitwise_equal_one_process(scenario):
    assert scenario["one"]["rc"] == 0, scenario["one"]["log"][-3000:]
    two, one = scenario["store"] / "runs" / "two", scenario["store"] / "runs" / "one"
    for group, name in [("encode.zarr", "prompt_embeds"), ("sample.zarr", "latents"), ("decode/0.zarr", "frames")]:
        a, b = _read(two, group, name), _read(one, group, name)
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.array_equal(a, b), f"{group}::{name} differs (max {np.abs(a.astype(float) - b.astype(float)).max()})"
    assert _read(one, "decode/0.zarr", "frames").shape == (1, 1, 32, 32, 3)
    assert json.loads((one / "records" / "sample.json").read_text())["hardware"].startswith("cpu x4")


def test_followers_never_write(tmp_path, monkeypatch):
    """A process other than 0 cannot change the store; its group writer uploads nothing."""
    from stages.store import FollowerWrite, RunStore
    from vidax.core import mesh

    run = RunStore(str(tmp_path)).run("r")
    monkeypatch.setattr(mesh, "is_leader", lambda: False)
    w = run.writer("x.zarr")
    w.array("a", np.ones(3, np.float32), ("n",))
    w.flush()
    assert not (tmp_path / "runs" / "r" / "x.zarr").exists()
    for write in (lambda: run.write_json("records/sample.json", {}), lambda: run.delete("records"),
                  lambda: run.acquire_lease("sample", "me", 10)):
        with pytest.raises(FollowerWrite, match="only process 0 writes"):
            write()
    assert not (tmp_path / "runs" / "r").exists()


_PLACE = r'''
import json, os, sys
from vidax.core import runtime
runtime.setup()
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from vidax.core.mesh import make_mesh
from vidax.core.sharding import place
from vidax.weights.io import open_checkpoint

t = open_checkpoint(sys.argv[1])["w"]
reads = []
read = t.read
t.read = lambda index=None: (reads.append([[s.start, s.stop] for s in index]), read(index=index))[1]
mesh = make_mesh("tp=4")
x = place({"w": t}, {"w": NamedSharding(mesh, P("tp", None))})["w"]
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
print("RESULT", json.dumps({"reads": sorted(reads), "total": float(total)}), flush=True)
'''


def test_each_process_reads_only_its_shards(tmp_path):
    """``place`` with lazy checkpoint tensors: a process reads from the safetensors file only the
    rows its own devices hold (``get_slice``), and the placed array is the whole tensor."""
    from vidax.weights.io import save_safetensors

    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    save_safetensors({"w": w}, tmp_path / "w.safetensors")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _PLACE, str(tmp_path / "w.safetensors")], cwd=ROOT,
                              env=_env(2, VIDAX_COORDINATOR=f"127.0.0.1:{port}", VIDAX_NUM_PROCESSES="2",
                                       VIDAX_PROCESS_ID=str(i), VIDAX_DISTRIBUTED_TIMEOUT=str(TIMEOUT)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    res = [json.loads(next(line for line in o.splitlines() if line.startswith("RESULT"))[len("RESULT "):]) for o in outs]
    # rows 0-1, 2-3 on process 0's two devices; 4-5, 6-7 on process 1's
    assert res[0]["reads"] == [[[0, 2], [None, None]], [[2, 4], [None, None]]]
    assert res[1]["reads"] == [[[4, 6], [None, None]], [[6, 8], [None, None]]]
    assert res[0]["total"] == res[1]["total"] == float(w.sum())


def test_one_process_job_needs_no_coordinator(monkeypatch):
    """``VIDAX_NUM_PROCESSES=1`` (the TPU template's pods on a one-host slice, which also name a
    coordinator) joins nothing; a coordinator without a process count is still refused by name."""
    from vidax.core import mesh

    for k in ("VIDAX_DISTRIBUTED", "VIDAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("VIDAX_COORDINATOR", "job-0.vidax-tpu:8476")
    monkeypatch.setenv("VIDAX_NUM_PROCESSES", "1")
    assert mesh.init_distributed() == (0, 1) and not mesh._distributed_initialized()
    monkeypatch.delenv("VIDAX_NUM_PROCESSES")
    with pytest.raises(mesh.ShardingConfigError, match="VIDAX_NUM_PROCESSES, VIDAX_PROCESS_ID not set"):
        mesh.init_distributed()
