"""The memory plan of every real recipe at its default size on its configured pools (``vidax plan``),
as the README's table: per-device peak of each stage (compiled at abstract shapes on as many fake
devices as the pool has; no weights), in float32 and bfloat16, and whether it fits the chips; and
the dtype a request without ``--dtype`` gets.

    python -m benchmarks.plan [--json benchmarks/results/plan.json] [--markdown]
"""
from __future__ import annotations

import argparse
import os
import sys

from benchmarks.harness import write_json

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16").strip()


def _cell(stage) -> str:
    from vidax.core.plan import GiB

    mark = "" if stage.fits is None else (" ok" if stage.fits else " **over**")
    return f"{stage.peak / GiB:.1f}{mark}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/plan.json")
    ap.add_argument("--models", nargs="*", help="default: every recipe that ships its release configs")
    a = ap.parse_args(argv)
    from stages.plan import plan
    from vidax import registry

    models = a.models or sorted(m for m, r in registry.MODELS.items() if r.config_folder is not None)
    rows, out = [], []
    head = ("| model | size | pools (encode / sample / decode) | sample mesh | default dtype | encode GiB f32 / bf16 | "
            "sample GiB f32 / bf16 | decode GiB f32 / bf16 |")
    rows += [head, "|" + "---|" * 8]
    for m in models:
        p32, p16 = plan(m, dtype="float32"), plan(m, dtype="bfloat16")
        out.append({"float32": p32.to_json(), "bfloat16": p16.to_json()})
        pools = " / ".join(f"{s.chip} x{s.chips}" for s in p32.stages)
        cells = [f"{_cell(a)} / {_cell(b)}" for a, b in zip(p32.stages, p16.stages)]
        dtype = registry.get(m).settings(None).get("dtype", "float32")  # what a request without --dtype gets
        rows.append(f"| {m} | {p32.width}x{p32.height}x{p32.num_frames} | {pools} | {p32.stages[1].mesh or '1'} | "
                    f"{dtype} | " + " | ".join(cells) + " |")
        print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
