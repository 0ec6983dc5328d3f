"""vidax vs the PyTorch references, same machine, same run, as interleaved pairs.

    make bench                                   # everything (this, then benchmarks.scale, benchmarks.store)
    python -m benchmarks.run [--pairs 7] [--only dit,vae] [--families]

Every case (``benchmarks/core.py``, ``benchmarks/vae_encode.py`` and ``benchmarks/families/*.py``) gives a vidax callable and a
reference callable; :func:`benchmarks.harness.paired` times them as alternating pairs with the fp32
matmul roof sampled between pairs, and the table reports the median of the per-pair time ratios
(vidax / reference: below 1 is faster) with its quartiles, and for cases that count FLOPs the
achieved GFLOP/s against the roof measured in the same minutes. Results go to
``benchmarks/results/latest.json``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import platform
import sys
import time
import traceback
from datetime import date
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def cases(families: bool = True) -> list:
    from benchmarks import core, vae_encode

    out = list(core.CASES)
    if families:  # the families' own files, and every family's VAE encode
        out += list(vae_encode.CASES)
        import benchmarks.families as fam

        for m in sorted(pkgutil.iter_modules(fam.__path__), key=lambda m: m.name):
            out += list(getattr(importlib.import_module(f"benchmarks.families.{m.name}"), "CASES", []))
    return out


def environment() -> dict:
    import jax

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    dev = jax.devices()[0]
    return {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "backend": f"{jax.default_backend()} ({dev.device_kind})", "jax": jax.__version__, "torch": torch_version}


def table(rows: list[dict]) -> str:
    lines = ["| component | config | vidax (s) | reference (s) | vidax / reference [q1-q3] | pairs | "
             "vidax GFLOP/s | % of roof [q1-q3] | roof (GFLOP/s) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['component']} | {r.get('config', '')} | - | - | error: {r['error']} | | | | |")
            continue
        gf = r["flops"] / r["a_s"] / 1e9 if r.get("flops") else None
        pct = (f"{100 * r['roof_frac']:.0f}% [{100 * r['roof_frac_q1']:.0f}-{100 * r['roof_frac_q3']:.0f}]"
               if r.get("roof_frac") else "n/a")
        roof = f"{r['roof_gflops']:.0f}" if r.get("roof_gflops") else "n/a"  # the median sample between its pairs
        lines.append(f"| {r['component']} | {r['config']} | {r['a_s']:.3f} | {r['b_s']:.3f} | "
                     f"{r['ratio']:.2f}x [{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}] | {r['pairs']} | "
                     f"{f'{gf:.1f}' if gf else 'n/a'} | {pct} | {roof} |")
    return "\n".join(lines)


def run_case(case, roof, pairs: int, budget: float, **kw) -> dict:
    """One table row: ``case(**kw)`` built and timed as paired calls (an error becomes the row)."""
    from benchmarks.harness import paired

    t0 = time.perf_counter()
    try:
        c = case(**kw)
        res = paired(c["vidax"], c["reference"], pairs=pairs, roof=roof, budget_s=budget)
        row = {"case": case.__name__, "component": c["component"], "config": c["config"],
               "flops": c.get("flops"), **res.summary(c.get("flops")), "ratios": res.ratios}
    except Exception as e:  # noqa: BLE001 - one broken case does not hide the others
        traceback.print_exc()
        row = {"case": case.__name__, "component": case.__name__, "error": f"{type(e).__name__}: {e}"[:200]}
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--budget", type=float, default=90.0, help="seconds per case (at least 3 pairs)")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names (MODULE.FUNCTION, e.g. "
                    "core.vae_decode_real_width, hunyuanvideo15.vae_decode)")
    ap.add_argument("--no-families", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/latest.json")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.harness import matmul_roof
    from vidax.core.runtime import collect_own_garbage

    roof = matmul_roof()
    rows = []
    env = environment()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for case in cases(not a.no_families):
        name = f"{case.__module__.rsplit('.', 1)[-1]}.{case.__name__}"  # e.g. hunyuanvideo15.vae_decode_real_width
        if a.only and not any(s in name for s in a.only.split(",")):
            continue
        # the case's models freed when it ends (reference cycles: torch modules, nnx graphs), and their
        # pages (every VAE case in one process: OOM-killed at 24 GB without; 19.8 GB peak with)
        with collect_own_garbage():
            row = run_case(case, roof, a.pairs, a.budget)
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
        # after every row: a process that dies later (a long run, a native crash) keeps what it measured
        out.write_text(json.dumps({"environment": env, "rows": rows}, indent=2, default=str))
    print(f"\n{env['date']}: {env['machine']}, {env['backend']}, JAX {env['jax']}, torch {env['torch']}\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
