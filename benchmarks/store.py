"""Run-store traffic on a GCS API: requests and bytes per stage, status and all-skipped costs, and
what 30 ms per request does to a tiny run's wall time.

    python -m benchmarks.store [--big]

Runs the real gcsfs against ``gcp-storage-emulator`` on loopback, through the logging proxy of
``tests/gcs_proxy.py`` (which can also add latency). ``--big`` adds the 256x256x33 run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def measure_run(proxy, req, url: str) -> dict:
    """Requests and bytes of one generate (per stage), of an all-skipped generate and of status."""
    from stages import run as R
    from stages.store import RunStore

    run = RunStore(url).run("bench")
    marks = []

    def log(m):
        if m.startswith("[") and m.endswith("running"):
            marks.append((m[1:].split("]")[0], len(proxy.log)))

    proxy.reset_log()
    t0 = time.perf_counter()
    R.generate(run, req, log=log)
    seconds = time.perf_counter() - t0
    log_all = list(proxy.log)
    marks.append(("end", len(log_all)))
    stages = {}
    for (name, a), (_, b) in zip(marks, marks[1:]):
        part = log_all[a:b]
        stages[name] = {"requests": len(part), "up_mb": sum(x[2] for x in part) / 1e6,
                        "down_mb": sum(x[3] for x in part) / 1e6}
    total = {"requests": len(log_all), "up_mb": sum(x[2] for x in log_all) / 1e6,
             "down_mb": sum(x[3] for x in log_all) / 1e6, "seconds": seconds}
    proxy.reset_log()
    R.generate(RunStore(url).run("bench"), req, log=lambda m: None)
    skipped = proxy.traffic()
    proxy.reset_log()
    r2 = RunStore(url).run("bench")
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    records = R.Records(r2)
    assert all(R.stage_status(r2, s, k, req=req, pipe=pipe, records=records) == "done" for s, k in keys.items())
    status = proxy.traffic()
    return {"stages": stages, "total": total,
            "all_skipped": {"requests": skipped["requests"], "down_mb": skipped["bytes_down"] / 1e6},
            "status": {"requests": status["requests"], "down_mb": status["bytes_down"] / 1e6}}


def latency_cost(proxy, req, rounds: int = 2, latency: float = 0.030) -> dict:
    """Wall time of a fresh tiny generate with and without ``latency`` per request, alternating."""
    from stages import run as R
    from stages.store import RunStore

    with_l, without = [], []
    for i in range(rounds * 2):
        slow = (i % 2 == 0) == (i // 2 % 2 == 0)
        proxy.latency = latency if slow else 0.0
        t0 = time.perf_counter()
        R.generate(RunStore(f"gs://bench/lat-{time.time_ns()}").run("r"), req, log=lambda m: None)
        (with_l if slow else without).append(time.perf_counter() - t0)
    proxy.latency = 0.0
    return {"with_s": statistics.median(with_l), "without_s": statistics.median(without),
            "added_s": statistics.median(with_l) - statistics.median(without)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also the 256x256x33 run")
    ap.add_argument("--out", default="benchmarks/results/store.json")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.gcs_proxy import FaultProxy, start_emulator

    proc, emu = start_emulator("bench")
    proxy = FaultProxy(emu)
    os.environ["STORAGE_EMULATOR_HOST"] = proxy.url
    try:
        from stages.request import Request, validate

        tiny = validate(Request(prompt="a kite over the dunes", height=32, width=32, num_frames=9, steps=4,
                                checkpoint_every=1))
        res = {"tiny": measure_run(proxy, tiny, f"gs://bench/tiny-{time.time_ns()}")}
        res["latency_30ms"] = latency_cost(proxy, tiny)
        if a.big:
            big = validate(Request(prompt="a kite over the dunes", height=256, width=256, num_frames=33, steps=4,
                                   checkpoint_every=2))
            res["256x256x33"] = measure_run(proxy, big, f"gs://bench/big-{time.time_ns()}")
    finally:
        proxy.close()
        proc.terminate()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=2))
    for name in ("tiny", "256x256x33"):
        if name not in res:
            continue
        r = res[name]
        print(f"\n{name}: {r['total']['requests']} requests, {r['total']['up_mb']:.2f} MB up, "
              f"{r['total']['down_mb']:.2f} MB down, {r['total']['seconds']:.1f} s")
        print("| stage | requests | MB up | MB down |\n|---|---:|---:|---:|")
        for s, v in r["stages"].items():
            print(f"| {s} | {v['requests']} | {v['up_mb']:.3f} | {v['down_mb']:.3f} |")
        print(f"all-skipped generate: {r['all_skipped']['requests']} requests, {r['all_skipped']['down_mb']:.3f} MB read; "
              f"status: {r['status']['requests']} requests, {r['status']['down_mb']:.3f} MB read")
    lat = res["latency_30ms"]
    print(f"\ntiny generate: {lat['without_s']:.1f} s, with 30 ms per request {lat['with_s']:.1f} s "
          f"(+{lat['added_s']:.1f} s)")
    return res


if __name__ == "__main__":
    main()
