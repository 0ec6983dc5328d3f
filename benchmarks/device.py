"""The paired benchmarks on an accelerator: the same cases as ``benchmarks.run`` (``benchmarks/core.py``)
at sizes and dtypes of a *profile*, with the PyTorch reference on the same device.

    bash benchmarks/device.sh             # on a GPU / TPU machine: installs, then runs this
    bash benchmarks/device.sh --dry-run   # the same path on CPU, tiny sizes, no installs (make test)
    python -m benchmarks.device --profile gpu|tpu|dry [--pairs N] [--only dit,vae] [--out-dir DIR]

Profiles (``PROFILES``): ``gpu`` -- one GPU (sized for an H200 in well under 8 minutes): Wan2.1-1.3B's
DiT at its real widths, 8 blocks, 480p/81-frame token count (32760 video tokens), bfloat16 on both
sides (vidax's attention resolves to cuDNN for bf16 on GPU; diffusers uses torch SDPA); UMT5-XXL
layers at real width; the Wan VAE decode at real widths to 17x480x832 (float32 on both sides, as
the pipelines decode); a whole tiny run (CFG sampling loop + decode) vs diffusers' WanPipeline.
``tpu``: vidax on the TPU at the CPU figures' sizes, the reference on the host CPU (torch has no
TPU backend here), so its ratios are TPU-vs-host, labelled so. ``dry``: tiny widths on CPU.

Writes ``device.json`` (environment, profile, rows with per-pair ratios) and ``device.md`` (the
table) into ``--out-dir``; prints the table. Exit status 1 when any case errored.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_DIT_480P = dict(layers=8, latents=(21, 60, 104), text_tokens=512, dtype="bfloat16")

#: per profile: the roof's matmul, the reference's torch device, timing, and each case's kwargs
PROFILES = {
    "gpu": dict(roof=dict(n=8192, dtype="bfloat16"), device="cuda", pairs=5, budget=30.0, cases=dict(
        dit_1p3b=_DIT_480P,
        umt5_xxl=dict(layers=4, tokens=512),
        vae_decode_real_width=dict(latents=(5, 60, 104)),
        whole_run_tiny=dict(frames=33, height=256, width=256, steps=8))),
    "tpu": dict(roof=dict(n=8192, dtype="bfloat16"), device="cpu", pairs=3, budget=30.0, cases=dict(
        dit_1p3b=dict(dtype="bfloat16"),
        umt5_xxl=dict(),
        vae_decode_real_width=dict(),
        whole_run_tiny=dict())),
    "dry": dict(roof=dict(n=256, dtype="float32"), device="cpu", pairs=2, budget=2.0, cases=dict(
        dit_1p3b=dict(layers=1, latents=(2, 8, 8), text_tokens=16, heads=2, head_dim=32, ffn=64, text_dim=32),
        umt5_xxl=dict(layers=1, tokens=16, d_model=64, heads=2, d_ff=128),
        vae_decode_real_width=dict(latents=(2, 4, 4), base_dim=16),
        whole_run_tiny=dict(frames=5, height=16, width=16, steps=2))),
}


def environment(device: str) -> dict:
    from benchmarks.run import environment as base

    env = base()
    env["reference_device"] = device
    env["attention"] = os.environ.get("VIDAX_ATTENTION", "auto")
    if device.startswith("cuda"):
        import torch

        env["reference_device"] = f"{device} ({torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})"
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), required=True)
    ap.add_argument("--pairs", type=int, default=None, help="pairs per case (default: the profile's)")
    ap.add_argument("--budget", type=float, default=None, help="seconds of pairs per case (at least 3 pairs)")
    ap.add_argument("--only", default="", help="comma-separated substrings of case names")
    ap.add_argument("--out-dir", default=os.environ.get("OUT") or "benchmarks/results/device")
    a = ap.parse_args(argv)
    if a.pairs is not None and a.pairs < 1:
        print("error: --pairs must be at least 1", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    prof = PROFILES[a.profile]
    from benchmarks import core
    from benchmarks.harness import matmul_roof
    from benchmarks.run import run_case, table

    roof = matmul_roof(**prof["roof"])
    pairs, budget = a.pairs or prof["pairs"], prof["budget"] if a.budget is None else a.budget
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(prof["device"])
    env["profile"] = a.profile
    rows, t_start = [], time.perf_counter()

    def write() -> str:  # after every row: a run cut short still leaves the rows it measured
        env["seconds"] = round(time.perf_counter() - t_start, 1)
        head = (f"{env['date']}: {env['machine']}, {env['backend']}, JAX {env['jax']}, torch {env['torch']}, "
                f"reference on {env['reference_device']}, attention {env['attention']}, profile {a.profile}, "
                f"matmul roof {prof['roof']['n']}^3 {prof['roof']['dtype']}, {env['seconds']} s")
        text = f"{head}\n\n{table(rows)}\n"
        (out / "device.json").write_text(json.dumps({"environment": env, "profile": prof, "rows": rows}, indent=2,
                                                    default=str))
        (out / "device.md").write_text(text)
        return text

    for name, kw in prof["cases"].items():
        if a.only and not any(s in name for s in a.only.split(",")):
            continue
        kw = {**kw, "device": prof["device"]}
        row = run_case(getattr(core, name), roof, pairs, budget, **kw)
        row["kwargs"] = kw
        rows.append(row)
        print(table([row]).splitlines()[-1], flush=True)
        write()
    print("\n" + write(), flush=True)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
