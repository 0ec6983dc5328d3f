"""Wall time of a ``vidax batch`` of the tiny preset (16 prompts by default), side by side with
another checkout of vidax (the commit before a change), as interleaved pairs.

    python -m benchmarks.batch [--prompts 16] [--pairs 3] [--against DIR] [--model M]

Each batch runs as its own ``python -m stages.cli batch FILE`` process, from this checkout or from
``DIR`` (a ``git worktree`` of another commit; its code is imported first), into a fresh store,
so every line computes every stage. Prints each pair and the median ratio with quartiles. Without
``--against`` it times this checkout alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBJECTS = ["a red panda", "a lighthouse", "a paper boat", "a fox", "a tram", "a kite", "a glacier", "a violin"]


def prompt_file(folder: Path, n: int, model: str) -> Path:
    p = folder / "prompts.jsonl"
    lines = [{"prompt": f"{SUBJECTS[i % len(SUBJECTS)]} at dusk, take {i}", "model": model, "seed": i,
              "num_frames": 9, "steps": 4, "height": 32, "width": 32} for i in range(n)]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def time_batch(checkout: Path, file: Path, store: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(checkout), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "stages.cli", "batch", str(file), "--store", str(store)],
                       cwd=checkout, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"batch in {checkout} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--model", default="wan2.1-t2v-1.3b")
    ap.add_argument("--against", type=Path, help="another checkout (e.g. a git worktree of the base commit)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        file = prompt_file(d, a.prompts, a.model)
        rows = []
        for i in range(a.pairs):
            this = time_batch(ROOT, file, d / f"this{i}")
            other = time_batch(a.against, file, d / f"other{i}") if a.against else None
            rows.append((this, other))
            print(f"pair {i + 1}: this {this:.1f} s" + (f", {a.against} {other:.1f} s, ratio {this / other:.3f}"
                                                        if other else ""), flush=True)
    print(f"{a.prompts}-prompt batch of {a.model} tiny: this checkout median {statistics.median(r[0] for r in rows):.1f} s")
    if a.against:
        ratios = sorted(t / o for t, o in rows)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        print(f"  {a.against}: median {statistics.median(r[1] for r in rows):.1f} s; "
              f"ratio this/other {statistics.median(ratios):.3f} [{q[0]:.3f}-{q[2]:.3f}] ({len(rows)} pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
