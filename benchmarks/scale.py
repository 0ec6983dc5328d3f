"""Scale-out and fit: per-step Wan DiT time under TP / SP vs one device, and weight offloading's
slowdown vs resident weights (chunk sizes 1, 2, 4, all; prefetch on / off).

    python -m benchmarks.scale [--repeat 5] [--json benchmarks/results/scale.json]

On a CPU host the "devices" are XLA's fake host devices (``--xla_force_host_platform_device_count``)
sharing the same cores, so a TP/SP ratio above 1 measures the partitioning and collective
overhead, not a speed-up; on a TPU/GPU slice the same script measures the real thing.
Also reachable as ``python -m benchmarks.run --only scale`` (runs this in a subprocess, since the
fake-device count must be fixed before JAX starts).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _paired(fn, base, repeat: int) -> tuple[float, float]:
    """Median times of ``fn`` and of the baseline ``base``, measured alternately (so load from other
    processes and clock drift hit both alike). Both are compiled and warmed up first."""
    fn(), base()
    a, b = [], []
    for _ in range(repeat):
        for f, out in ((base, b), (fn, a)):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def run(repeat: int = 3, layers: int = 8):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from vidax.models.wan import dit

    cfg = dit.WanDiTConfig(num_heads=8, head_dim=32, in_channels=16, out_channels=16, text_dim=64, freq_dim=64,
                           ffn_dim=1024, num_layers=layers, rope_max_seq_len=64)
    params = dit.init_state(cfg, seed=0)
    rng = np.random.default_rng(0)
    b, f, h, w, lt = 2, 4, 16, 16, 32  # 2 x 256 tokens (a CFG batch)
    x = jnp.asarray(rng.standard_normal((b, f, h, w, cfg.in_channels)), jnp.float32)
    t = jnp.asarray([700.0, 700.0], jnp.float32)
    ctx = jnp.asarray(rng.standard_normal((b, lt, cfg.text_dim)), jnp.float32)
    n_dev = len(jax.devices())
    shape = (f"{layers} blocks, dim {cfg.dim}, {cfg.num_heads} heads, ffn {cfg.ffn_dim}, batch {b} x {f * h * w // 4} tokens, "
             f"text {lt}")

    single = dit.runner(params, cfg, None)
    base_fn = lambda: single(x, t, ctx).block_until_ready()
    bases = []

    def timed(runner):
        s, b = _paired(lambda: runner(x, t, ctx).block_until_ready(), base_fn, repeat)
        bases.append(b)
        return s, s / b

    par_rows = []
    for spec in ["tp=2", "tp=4", "tp=8", "sp=2", "sp=4", "sp=8", "tp=2,sp=2", "tp=2,sp=4", "dp=2", "dp=2,tp=2,sp=2"]:
        need = 1
        for part in spec.split(","):
            need *= int(part.split("=")[1])
        if need > n_dev:
            continue
        s, ratio = timed(dit.runner(params, cfg, spec))
        par_rows.append(dict(config=spec.replace(",", " x "), mesh=spec, seconds=s, ratio=ratio))
        print(f"  {spec}: {s * 1e3:.1f} ms", file=sys.stderr, flush=True)

    off_rows = []
    for chunk in (1, 2, 4, "all"):
        for prefetch in (True, False):
            if chunk == "all" and not prefetch:
                continue  # one chunk: nothing to overlap
            r = dit.runner(params, cfg, None, offload_chunk_size=chunk, prefetch=prefetch)
            s, ratio = timed(r)
            c = layers if chunk == "all" else chunk
            off_rows.append(dict(chunk=f"{c}" + (" (all)" if chunk == "all" else ""), prefetch=prefetch, seconds=s,
                                 ratio=ratio, chunk_mb=r.offload.pools["blocks"].chunk_bytes / 2**20))
            print(f"  offload chunk={chunk} prefetch={prefetch}: {s * 1e3:.1f} ms", file=sys.stderr, flush=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, JAX {jax.__version__} ({jax.default_backend()}), "
               f"{n_dev} {'fake host ' if jax.default_backend() == 'cpu' else ''}devices")
    base = statistics.median(bases)
    par_rows.insert(0, dict(config="1 device (resident)", mesh="dp=1,tp=1,sp=1", seconds=base, ratio=1.0))
    return dict(machine=machine, shape=shape, single_device_s=base, parallel=par_rows, offload=off_rows)


def table(res) -> str:
    out = [f"Machine: {res['machine']}", f"DiT: {res['shape']}", "",
           "Ratios are paired: each configuration alternates with the 1-device run, ratio of medians.", "",
           "| parallelism (mesh) | step time (ms) | time / 1 device |", "|---|---:|---:|"]
    for r in res["parallel"]:
        out.append(f"| {r['config']} | {r['seconds'] * 1e3:.1f} | {r['ratio']:.2f}x |")
    out += ["", "| offload chunk (blocks) | chunk MB/device | prefetch | step time (ms) | slowdown vs resident |",
            "|---|---:|---|---:|---:|"]
    for r in res["offload"]:
        out.append(f"| {r['chunk']} | {r['chunk_mb']:.1f} | {'on' if r['prefetch'] else 'off'} | {r['seconds'] * 1e3:.1f} | "
                   f"{r['ratio']:.2f}x |")
    return "\n".join(out)


def bench_entry(repeat: int = 3) -> dict:
    """Entry for ``benchmarks.run``: runs this module in a fresh process (fake devices must be set
    before JAX starts), prints its tables to stderr, returns one summary row in run.py's format
    (vidax = tp=2 step, reference = the same DiT on one device)."""
    out = Path("benchmarks/results/scale.json")
    subprocess.run([sys.executable, "-m", "benchmarks.scale", "--repeat", str(repeat), "--json", str(out)], check=True,
                   stdout=sys.stderr)
    res = json.loads(out.read_text())
    tp2 = next((r for r in res["parallel"] if r["mesh"] == "tp=2"), res["parallel"][0])
    return dict(name="DiT step, TP=2 vs 1 device (see scale table)", shape=res["shape"], vidax_s=tp2["seconds"],
                ref_s=res["single_device_s"], flops=None, ref="vidax on 1 device")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = run(a.repeat, a.layers)
    print(table(res))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
