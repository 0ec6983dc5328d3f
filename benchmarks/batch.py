"""Wall time of a ``vidax batch`` of the tiny preset (16 prompts by default), side by side with
another checkout of vidax (the commit before a change), as interleaved pairs.

    python -m benchmarks.batch [--prompts 16] [--pairs 3] [--against DIR] [--model M]
    python -m benchmarks.batch --phases [--prompts 8] [--blocks 2] [--steps 2] [--frames 9] [--size 64]

Each batch runs as its own ``python -m stages.cli batch FILE`` process, from this checkout or from
``DIR`` (a ``git worktree`` of another commit; its code is imported first), into a fresh store,
so every line computes every stage. Prints each pair and the median ratio with quartiles. Without
``--against`` it times this checkout alone.

``--phases``: line-major against phase-major batches (issue 28) on a checkpoint folder with
Wan2.1-1.3B's DiT widths: wall time, bytes of weights read and weight-file opens (see
:func:`phases_main`).
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
    ap.add_argument("--prompts", type=int, help="default 16 (8 with --phases)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--model", default="wan2.1-t2v-1.3b")
    ap.add_argument("--against", type=Path, help="another checkout (e.g. a git worktree of the base commit)")
    ap.add_argument("--phases", action="store_true", help="line-major vs phase-major on a folder with Wan2.1-1.3B's "
                    "DiT widths: wall time and bytes of weights read")
    ap.add_argument("--blocks", type=int, default=2, help="--phases: DiT blocks")
    ap.add_argument("--steps", type=int, default=2, help="--phases: sampling steps")
    ap.add_argument("--frames", type=int, default=9, help="--phases: frames")
    ap.add_argument("--size", type=int, default=64, help="--phases: height and width")
    ap.add_argument("--phases-child", nargs=4, metavar=("MODE", "FILE", "STORE", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.phases_child:
        mode, file, store, out = a.phases_child
        phases_child(mode, Path(file), Path(store), Path(out))
        return 0
    if a.phases:
        a.prompts = a.prompts or 8
        return phases_main(a)
    a.prompts = a.prompts or 16
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


# ------------------------------------------------------------------ --phases: line-major vs phase-major
# Issue 28's figures. A diffusers-layout Wan2.1 folder with the 1.3B release's DiT widths (dim 1536 =
# 12 heads x 128, ffn 8960, freq 256; ``--blocks`` blocks, random weights) and a tiny UMT5 text
# encoder and VAE; a prompt file of ``--prompts`` lines run two ways, each in a fresh process (no
# persistent compilation cache, so neither inherits the other's programs):
#   before: line-major, every line on its own as ``vidax generate`` (a loop in one process, as
#           ``vidax batch`` was before phase-major batches);
#   after:  phase-major, ``vidax batch FILE`` (stages.run.generate_many).
# Bytes of weights read are counted where they are read: every tensor taken out of a .safetensors file
# goes through ``vidax.weights.io._safetensors_read`` (safetensors maps the file, so /proc/self/io
# cannot see these reads): the nbytes it returns are summed per component folder, and its opens
# (``_safe_open``, header reads included) are counted; the content fingerprints' reads of the same
# files (header + first and last MiB, ``vidax.weights.fingerprint``) are counted through that
# module's ``open``.

def build_folder(folder: Path, blocks: int) -> None:
    """The checkpoint folder: Wan2.1-1.3B's DiT widths with ``blocks`` blocks (random weights), a
    tiny UMT5 text encoder (d_model 32, so the DiT's text_dim is 32) and a tiny VAE, written by
    diffusers' ``save_pretrained``."""
    import torch
    import transformers
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator([f"{s} at dusk, take" for s in SUBJECTS] * 10,
                            trainers.UnigramTrainer(vocab_size=60, special_tokens=["<pad>", "</s>", "<unk>"],
                                                    unk_token="<unk>"))
    torch.manual_seed(0)
    text = transformers.UMT5EncoderModel(transformers.UMT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=32,
        feed_forward_proj="gated-gelu"))
    dit = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                                out_channels=16, text_dim=32, freq_dim=256, ffn_dim=8960, num_layers=blocks,
                                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                                rope_max_seq_len=1024)
    vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    with torch.no_grad():  # non-zero biases and norm weights everywhere (the defaults are 0 / 1)
        g = torch.Generator().manual_seed(1)
        for m in (dit, vae):
            for name, p in m.named_parameters():
                if name.endswith("bias") or p.dim() == 1:
                    p.add_(0.02 * torch.randn(p.shape, generator=g))
    sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                    num_train_timesteps=1000, flow_shift=3.0)
    WanPipeline(tokenizer=transformers.T5Tokenizer(tokenizer_object=tok, extra_ids=0), text_encoder=text,
                transformer=dit, vae=vae, scheduler=sched).save_pretrained(folder)


def phases_file(folder: Path, ckpt: Path, n: int, size: int, frames: int, steps: int) -> Path:
    p = folder / "prompts.jsonl"
    lines = [{"prompt": f"{SUBJECTS[i % len(SUBJECTS)]} at dusk, take {i}", "model": "wan2.1-t2v-1.3b",
              "checkpoint": str(ckpt), "seed": i, "frames": frames, "steps": steps, "height": size, "width": size}
             for i in range(n)]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def _count_weight_reads() -> dict:
    """Wrap the readers of weight files (see above); returns the live counters."""
    import builtins

    from vidax.weights import fingerprint, io

    c = {"tensor_bytes": {}, "opens": {}, "fingerprint_bytes": 0}
    read, opener = io._safetensors_read, io._safe_open

    def counting_read(path, name, box=None):
        arr = read(path, name, box)
        comp = Path(path).parent.name
        c["tensor_bytes"][comp] = c["tensor_bytes"].get(comp, 0) + int(arr.nbytes)
        return arr

    def counting_open(path):
        comp = Path(path).parent.name
        c["opens"][comp] = c["opens"].get(comp, 0) + 1
        return opener(path)

    class Counted:
        def __init__(self, f):
            self._f = f

        def read(self, *a):
            b = self._f.read(*a)
            c["fingerprint_bytes"] += len(b)
            return b

        def __getattr__(self, k):
            return getattr(self._f, k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    io._safetensors_read, io._safe_open = counting_read, counting_open
    fingerprint.open = lambda *a, **k: Counted(builtins.open(*a, **k))  # the module's own ``open``
    return c


def phases_child(mode: str, file: Path, store: Path, out: Path) -> None:
    """One measurement, in this (fresh) process: ``before`` or ``after`` on ``file``."""
    import contextlib

    from stages import cli
    from stages.prompts import parse_prompt_file

    counts = _count_weight_reads()
    lines = parse_prompt_file(str(file))
    sink = open(os.devnull, "w")
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        if mode == "before":  # every line on its own: ``vidax generate`` with the line's flags
            for b in lines:
                r = b.request
                rc = cli.main(["generate", "--model", r.model, "--checkpoint", r.checkpoint, "--prompt", r.prompts[0],
                               "--seed", str(r.seed), "--frames", str(r.num_frames), "--steps", str(r.steps),
                               "--height", str(r.height), "--width", str(r.width), "--store", str(store)])
                if rc != 0:
                    raise SystemExit(f"generate of line {b.line} exited {rc}")
        else:
            rc = cli.main(["batch", str(file), "--store", str(store)])
            if rc != 0:
                raise SystemExit(f"batch exited {rc}")
    seconds = time.perf_counter() - t0
    out.write_text(json.dumps({"seconds": seconds, **counts}))


def _outputs(store: Path) -> dict:
    """Every run's sampled latents and decoded frames, by run id."""
    import numpy as np

    from stages import run as R
    from stages.store import RunStore, read_array

    rs = RunStore(f"file://{store}")
    out = {}
    for d in sorted(p.name for p in (store / "runs").iterdir()):
        run = rs.run(d)
        req = R.load_request(run)
        names = [n for n in R.stage_names(req) if n.startswith("decode/")]
        out[d] = (read_array(run.group("sample.zarr"), "latents"),
                  np.concatenate([read_array(run.group(f"{n}.zarr"), "frames") for n in names], 1))
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def phases_main(a) -> int:
    import numpy as np

    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ckpt = d / "Wan2.1-1.3B-widths"
        t0 = time.perf_counter()
        build_folder(ckpt, a.blocks)
        dit_bytes = sum(f.stat().st_size for f in (ckpt / "transformer").glob("*.safetensors"))
        print(f"checkpoint folder: DiT dim 1536, ffn 8960, {a.blocks} blocks, {_gib(dit_bytes)} of "
              f"transformer weights (float32); tiny UMT5 and VAE ({time.perf_counter() - t0:.0f} s to build)",
              flush=True)
        file = phases_file(d, ckpt, a.prompts, a.size, a.frames, a.steps)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "VIDAX_COMPILE_CACHE": "off"}
        res = {}
        for mode in ("before", "after"):
            out = d / f"{mode}.json"
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "benchmarks.batch", "--phases-child", mode, str(file),
                                str(d / f"store-{mode}"), str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"{mode} failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
            res[mode] = {**json.loads(out.read_text()), "process": time.perf_counter() - t0}
            r = res[mode]
            print(f"{mode:6s} ({'line-major: vidax generate per line' if mode == 'before' else 'phase-major: vidax batch'}): "
                  f"{r['seconds']:.1f} s ({r['process']:.1f} s with the process start), tensor bytes read "
                  f"{_gib(sum(r['tensor_bytes'].values()))} "
                  f"({', '.join(f'{k} {_gib(v)}' for k, v in sorted(r['tensor_bytes'].items()))}), "
                  f"file opens {dict(sorted(r['opens'].items()))}, fingerprint reads {_gib(r['fingerprint_bytes'])}",
                  flush=True)
        before, after = _outputs(d / "store-before"), _outputs(d / "store-after")
        assert before.keys() == after.keys() and len(before) == a.prompts, (before.keys(), after.keys())
        for k in before:
            for x, y in zip(before[k], after[k]):
                np.testing.assert_array_equal(x, y)
        print(f"every run's latents and frames bitwise equal before and after ({len(before)} runs)")
        b, f = res["before"], res["after"]
        tb, ta = sum(b["tensor_bytes"].values()), sum(f["tensor_bytes"].values())
        print(f"{a.prompts} prompts, {a.size}x{a.size}, {a.frames} frames, {a.steps} steps: wall {b['seconds']:.1f} s -> "
              f"{f['seconds']:.1f} s ({f['seconds'] / b['seconds']:.2f}x); weights read {_gib(tb)} -> {_gib(ta)} "
              f"({tb / ta:.1f}x less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
