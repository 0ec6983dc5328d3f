"""Whether two trees compile the same XLA programs for a benchmark case: the question a refactor
asks ("is any DiT slower than before?") answered without timing noise.

    python -m benchmarks.same_programs --old /path/to/old/checkout [--only hunyuanvideo.dit_forward,core.dit_1p3b]

Each case's vidax side (``benchmarks.run``'s cases, ``MODULE.FUNCTION``) runs once per tree in its
own process with XLA dumping its optimized programs (``--xla_dump_to``); the model-sized programs
(over 200 instructions: not the eager ops around them) are compared with their instruction names,
metadata and numbering left out. A row says ``identical`` (the same instructions, in the same
computations), ``parameter order`` (the same instructions, fused computations numbering their
parameters differently: the state's leaves in another order), or how many instructions each side
has that the other has not. The same compiled program on the same weights runs at the same speed,
so an ``identical`` row settles what a paired timing on a noisy host cannot.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DIT_CASES = ("core.dit_1p3b", "cogvideox.dit_forward", "cosmos.predict25_dit", "cosmos.cosmos3_mot",
             "hunyuanvideo.dit_forward", "hunyuanvideo15.dit_forward", "ltx.bench_ltx_dit", "ltx.bench_ltx2_dit")
_CHILD = """
import importlib, os, sys
root, case = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
os.chdir(root)
mod, fn = case.split(".")
m = importlib.import_module("benchmarks." + mod if mod == "core" else "benchmarks.families." + mod)
getattr(m, fn)()["vidax"]()
"""


def _instructions(path: str) -> list[str]:
    out = []
    for line in Path(path).read_text().splitlines():
        if " = " not in line:
            continue
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        line = re.sub(r"frontend_attributes=\{[^}]*\}", "", line)
        line = re.sub(r"%[A-Za-z_.0-9-]+", "%", line)
        out.append(" ".join(re.sub(r"[a-z_]+\.[0-9]+", "N", line).split()))
    return out


def programs(root: str, case: str) -> list[collections.Counter]:
    """The optimized model-sized programs the case's vidax side compiles in tree ``root``."""
    with tempfile.TemporaryDirectory(prefix="vidax-programs-") as d:
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={d} --xla_dump_hlo_as_text",
               "PYTHONPATH": root}
        subprocess.run([sys.executable, "-c", _CHILD, root, case], env=env, check=True, capture_output=True, text=True)
        progs = [_instructions(f) for f in sorted(glob.glob(os.path.join(d, "*after_optimizations.txt")))]
    return [collections.Counter(p) for p in progs if len(p) > 200]


def _without_parameters(c: collections.Counter) -> collections.Counter:
    return collections.Counter({k: v for k, v in c.items() if " parameter(" not in k})


def compare(old: list, new: list) -> str:
    if len(old) != len(new):
        return f"{len(old)} programs before, {len(new)} now"
    if sorted(map(sorted, (p.elements() for p in old))) == sorted(map(sorted, (p.elements() for p in new))):
        return "identical"
    rows = []
    for a, b in zip(sorted(old, key=lambda c: sum(c.values())), sorted(new, key=lambda c: sum(c.values()))):
        if a == b:
            continue
        if _without_parameters(a) == _without_parameters(b) and sum(a.values()) == sum(b.values()):
            rows.append("parameter order")
        else:
            rows.append(f"{sum((a - b).values())} instructions only before, {sum((b - a).values())} only now "
                        f"(of {sum(a.values())} / {sum(b.values())})")
    return "; ".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the other tree (a checkout or worktree of an earlier commit)")
    ap.add_argument("--new", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--only", default=",".join(DIT_CASES), help="comma-separated MODULE.FUNCTION cases")
    a = ap.parse_args(argv)
    print("| case | optimized programs, before -> now |\n|---|---|")
    for case in a.only.split(","):
        print(f"| `{case}` | {compare(programs(a.old, case), programs(a.new, case))} |", flush=True)


if __name__ == "__main__":
    main()
