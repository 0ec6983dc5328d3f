"""Compile once, measured: programs compiled and read from the persistent compilation cache per
stage, from the stage records (``record["compile"]``).

1. cold vs warm: the same request in two fresh processes sharing one empty cache folder
   (``VIDAX_COMPILE_CACHE``); the warm process should read every program back (goal: warm compile
   seconds <= 10% of cold);
2. a 2-prompt batch file in one process: the second prompt's sample stage should build no program;
3. Wan2.2 A14B (two experts): one step program for both experts.

    python -m benchmarks.compile [--model wan2.1-t2v-1.3b] [--preset tiny] [--json benchmarks/results/compile.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _records(store: Path, run_id: str) -> dict:
    recs = store / "runs" / run_id / "records"
    out = {}
    for f in sorted(recs.rglob("*.json")):
        r = json.loads(f.read_text())
        if r.get("compile"):
            out[r["stage"]] = r["compile"]
    return out


def _cli(args, env) -> None:
    p = subprocess.run([sys.executable, "-m", "stages.cli", *args], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(p.stdout + p.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wan2.1-t2v-1.3b")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--json", default="benchmarks/results/compile.json")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="vidax-compile-bench-"))
    env = {**os.environ, "VIDAX_COMPILE_CACHE": str(tmp / "cache"), "VIDAX_COMPILE_CACHE_MIN_SECONDS": "0"}
    store = tmp / "store"
    base = ["generate", "--model", a.model, "--preset", a.preset, "--store", str(store), "--prompt", "a heron at dawn"]
    _cli([*base, "--run-id", "cold"], env)
    _cli([*base, "--run-id", "warm"], env)
    cold, warm = _records(store, "cold"), _records(store, "warm")
    result = {"model": a.model, "preset": a.preset, "cold": cold, "warm": warm}
    print(f"## cold vs warm process ({a.model}, {a.preset}): programs compiled / read from the cache, seconds")
    print("| stage | cold: compiled, s | warm: compiled, cache hits, s | warm / cold |")
    print("|---|---|---|---|")
    tc = tw = 0.0
    for stage in cold:
        c, w = cold[stage], warm.get(stage, {})
        tc, tw = tc + c["compile_seconds"], tw + w.get("compile_seconds", 0.0)
        ratio = w.get("compile_seconds", 0.0) / c["compile_seconds"] if c["compile_seconds"] else float("nan")
        print(f"| {stage} | {c['compiled']}, {c['compile_seconds']:.2f} | {w.get('compiled')}, {w.get('cache_hits')}, "
              f"{w.get('compile_seconds', 0):.2f} | {ratio:.2f} |")
    print(f"| total | {tc:.2f} s | {tw:.2f} s | {tw / tc:.2f} |")
    result["warm_over_cold"] = tw / tc if tc else None
    # a 2-prompt batch in one process, no persistent cache: what does the second prompt build?
    env_off = {**os.environ, "VIDAX_COMPILE_CACHE": "off"}
    pf = tmp / "prompts.txt"
    pf.write_text("a heron at dawn\na fox in the snow\n")
    _cli(["batch", str(pf), "--model", a.model, "--store", str(tmp / "batch")], env_off)
    runs = sorted((tmp / "batch" / "runs").iterdir(), key=lambda p: p.stat().st_mtime)
    batch = [_records(tmp / "batch", r.name) for r in runs]
    result["batch"] = batch
    print("\n## a 2-prompt batch file in one process: programs built per stage (first prompt, second prompt)")
    print("| stage | first | second |\n|---|---|---|")
    for stage in batch[0]:
        print(f"| {stage} | {batch[0][stage]['programs']} | {batch[1].get(stage, {}).get('programs')} |")
    # A14B: both experts in one sample stage
    _cli(["generate", "--model", "wan2.2-t2v-a14b", "--preset", "tiny", "--store", str(tmp / "a14b"), "--run-id", "x",
          "--prompt", "a heron at dawn"], env_off)
    a14b = _records(tmp / "a14b", "x")
    result["a14b"] = a14b
    print(f"\n## Wan2.2 A14B (two experts), sample stage: {a14b['sample']['programs']} programs built "
          f"(a one-expert model of the same shapes: {batch[0]['sample']['programs']})")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
