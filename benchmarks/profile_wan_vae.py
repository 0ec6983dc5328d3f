"""Where the Wan2.1 VAE decode spends its time, vidax vs diffusers, at the released widths.

    python -m benchmarks.profile_wan_vae [--runs 3] [--pairs 9] [--conv-impl fold] [--json PATH]
    python -m benchmarks.profile_wan_vae --case hunyuanvideo:vae_decode_real_width   # another VAE

The case is :func:`benchmarks.core.vae_decode_real_width` (base_dim 96, z 16; 2 latent frames at
16x16 -> 5 x 128 x 128 pixels, fp32, every weight perturbed). Both sides are profiled as they run
in the benchmark - the *whole* fused vidax programs (one per decode chunk), never an op compiled on
its own (isolated programs mislead: they lose the fusions, layouts and buffer reuse of the real one):

- vidax: ``jax.profiler`` trace of the decode; XLA:CPU records one event per thunk (``hlo_op``,
  ``run_id``); each thunk is classified from the optimized HLO of its program
  (``compiled.as_text()``): the convolution inside a fusion (kernel, channels, resolution, FLOPs),
  dots, reductions (the norms), data movement (copy / transpose / pad / concatenate / slice),
  other elementwise;
- diffusers: ``torch.profiler`` over ``AutoencoderKLWan.decode``, self CPU time per op, convs split
  by their input shape the same way.

Prints the two category tables (ms per decode, % of the op total, conv GFLOP/s), then the paired
ratio of the whole decode (``benchmarks.harness.paired``: interleaved pairs, median of per-pair
ratios with quartiles, the fp32 matmul roof sampled between pairs).
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

_SHAPE = re.compile(r"f32\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.*?) (\w[\w-]*)\((.*)$")


def _dims(s: str) -> list[int]:
    return [int(d) for d in s.split(",") if d]


def parse_hlo(text: str) -> dict[str, dict]:
    """Top-level instructions of an optimized HLO module: name -> {opcode, shape, body}, where
    ``body`` lists the opcodes (and convolution lines) of the computation a fusion calls."""
    comps: dict[str, list[str]] = {}
    cur = None
    entry = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and "{" in line and ("(" in line):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            cur = name.lstrip("%")
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
            continue
        if cur is not None and line.startswith("  "):
            comps[cur].append(line)
    out = {}
    for line in comps.get(entry, []):
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        called = re.search(r"calls=%([\w.\-]+)", rest)
        body = comps.get(called.group(1), []) if called else [line]
        out[name] = {"opcode": opcode, "shape": shape, "body": body}
    return out


def _conv_info(line: str, body: list[str]) -> dict | None:
    """kernel, channels, resolution and FLOPs of a ``convolution`` HLO line (b01f / 01io layouts);
    its operands' shapes are looked up in the fused computation ``body``."""
    shapes = {}
    for ln in body:
        m = _INSTR.match(ln)
        if m:
            sm = _SHAPE.search(m.group(2))
            if sm:
                shapes[m.group(1)] = _dims(sm.group(1))
    m = _INSTR.match(line)
    ops = re.findall(r"%([\w.\-]+)", m.group(4).split(")")[0]) if m else []
    out_m = _SHAPE.search(m.group(2)) if m else None
    if len(ops) < 2 or ops[1] not in shapes or out_m is None:
        return None
    out, rhs = _dims(out_m.group(1)), shapes[ops[1]]
    win = re.search(r"window=\{size=([0-9x]+)", line)
    k = win.group(1) if win else "1"
    dl = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line)
    rl = dl.group(2) if dl else "01io"
    cin, cout = rhs[rl.index("i")], rhs[rl.index("o")]
    taps = 1
    for d in k.split("x"):
        taps *= int(d)
    n_out = 1
    for d in out:
        n_out *= d
    return {"kernel": k, "cin": cin, "cout": cout, "res": out[-2], "frames": out[0],
            "flops": 2.0 * n_out * cin * taps}


def classify_thunk(instr: dict | None) -> tuple[str, float]:
    """(category, FLOPs) of one thunk of the vidax program."""
    if instr is None:
        return "other (runtime)", 0.0
    body = "\n".join(instr["body"])
    convs = [ln for ln in instr["body"] if " convolution(" in ln]
    if convs:
        infos = [_conv_info(ln, instr["body"]) for ln in convs]
        if any(i is None for i in infos):
            return "conv (unparsed)", 0.0
        # YNNPACK fuses the per-tap convs of one causal conv (and their sum, the bias and often the
        # next norm) into one fusion: count every conv's FLOPs, name it by the first
        c = dict(infos[0], flops=sum(i["flops"] for i in infos))
        if c["kernel"] == "2x2":  # one output phase of nearest-2x + 3x3 conv
            return f"upsample conv ->{c['cout']} @{2 * c['res']}px", c["flops"]
        if c["kernel"] == "3x3":
            return f"conv 3x3(x3) ->{c['cout']} @{c['res']}px", c["flops"]
        return f"conv {c['kernel']} ->{c['cout']} @{c['res']}px", c["flops"]
    if " dot(" in body:
        dots = [ln for ln in instr["body"] if " dot(" in ln]
        shapes = [_dims(s) for s in _SHAPE.findall(dots[0])[:3]]
        flops = 0.0
        if len(shapes) == 3:
            out, lhs, rhs = shapes
            contract = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", dots[0])
            k = 1
            for d in _dims(contract.group(1)) if contract else []:
                k *= lhs[d]
            n = 1
            for d in out:
                n *= d
            flops = 2.0 * n * k
        return "matmul (1x1 convs, attention)", flops
    if " reduce(" in body:
        return "norm / reductions (fused elementwise)", 0.0
    moves = ("copy", "transpose", "pad", "concatenate", "slice", "bitcast", "broadcast", "parameter",
             "dynamic-slice", "dynamic-update-slice", "reshape", "constant")
    ops = set()
    for ln in instr["body"]:
        m = _INSTR.match(ln)
        if m:
            ops.add(m.group(3))
    if ops and ops <= set(moves):
        return "data movement (copy/transpose/pad/concat/slice)", 0.0
    return "elementwise (SiLU, adds, ...)", 0.0


def _group(cat: str) -> str:
    """Coarse group of a category, for the summary lines."""
    if cat.startswith("conv "):
        return "conv 3x3(x3)"
    if cat.startswith("upsample"):
        return "upsample"
    return cat


def profile_vidax(case: dict, runs: int, tmp: Path) -> dict:
    module = case.get("hlo_module", "_decode_chunk_jit")  # the programs' HLO module name ends so
    """Run the decode under ``jax.profiler``; time (ms per decode) and FLOPs per category."""
    import jax

    case["vidax"]()  # compiled and warm
    progs = [parse_hlo(e.compile().as_text()) for e in case["vidax_lowered"]()]  # first chunk, later
    trace_dir = tmp / "jax_trace"
    jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
    for _ in range(runs):
        case["vidax"]()
    jax.profiler.stop_trace()
    path = sorted(glob.glob(str(trace_dir / "plugins/profile/*/perfetto_trace.json.gz")))[-1]
    events = json.load(gzip.open(path))["traceEvents"]
    # which program a run_id belongs to: match its thunk names against each program's instructions
    by_run: dict[str, list[dict]] = collections.defaultdict(list)
    walls: dict[str, float] = {}
    for e in events:
        a = e.get("args") or {}
        if e.get("ph") != "X":
            continue
        if "hlo_op" in a and a.get("hlo_module", "").endswith(module):
            by_run[a["run_id"]].append(e)
        elif e.get("name") == "ThunkExecutor::Execute (wait for completion)" and "run_id" in a:
            walls[a["run_id"]] = walls.get(a["run_id"], 0.0) + e["dur"]
    cats: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    thunks: dict[tuple, float] = {}
    wall = 0.0
    for rid, evs in by_run.items():
        names = {e["args"]["hlo_op"] for e in evs}
        prog = max(progs, key=lambda p: (len(names & p.keys()), -len(p)))  # all its thunks, fewest others
        wall += walls.get(rid, 0.0)
        for e in evs:
            ins = prog.get(e["args"]["hlo_op"])
            cat, flops = classify_thunk(ins)
            cats[cat][0] += e["dur"] / 1e3 / runs
            cats[cat][1] += flops / runs
            key = (e["args"]["hlo_op"], ins["shape"].split("{")[0] if ins else "", cat)
            thunks[key] = thunks.get(key, 0.0) + e["dur"] / 1e3 / runs
    top = sorted(thunks.items(), key=lambda kv: -kv[1])
    return {"categories": {k: {"ms": v[0], "flops": v[1]} for k, v in cats.items()}, "wall_ms": wall / 1e3 / runs,
            "top_thunks": [{"op": k[0], "shape": k[1], "category": k[2], "ms": v} for k, v in top[:400]],
            "top_data_movement": [{"op": k[0], "shape": k[1], "ms": v} for k, v in top
                                  if k[2].startswith("data movement")][:15]}


def profile_torch(case: dict, runs: int) -> dict:
    """Run ``AutoencoderKLWan.decode`` under ``torch.profiler``; self CPU ms per decode and category."""
    from torch.profiler import ProfilerActivity, profile

    case["reference"]()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(runs):
            case["reference"]()
    cats: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    total = 0.0
    for ev in prof.key_averages(group_by_input_shape=True):
        ms = ev.self_cpu_time_total / 1e3 / runs
        total += ms
        name = ev.key
        shapes = ev.input_shapes or []
        if name in ("aten::mkldnn_convolution", "aten::_convolution", "aten::convolution", "aten::conv3d",
                    "aten::conv2d", "aten::_slow_conv2d_forward", "aten::slow_conv3d_forward",
                    "aten::_nnpack_spatial_convolution", "aten::thnn_conv2d"):
            x = shapes[0] if shapes else []
            w = shapes[1] if len(shapes) > 1 else []
            flops = 0.0
            if len(w) in (4, 5) and all(k == 1 for k in w[2:]) and len(x) == len(w):
                cat = "matmul (1x1 convs, attention)"
                flops = 2.0 * w[0] * w[1]
                for d in (x[0], *x[2:]):
                    flops *= d
            elif len(x) == 5 and len(w) == 5:  # WanCausalConv3d: padded explicitly, then a VALID conv
                t, h, wd = (x[2] - w[2] + 1), (x[3] - w[3] + 1), (x[4] - w[4] + 1)
                flops = 2.0 * x[0] * w[0] * w[1] * w[2] * w[3] * w[4] * t * h * wd
                if w[3] == 1 and w[4] == 1:
                    cat = "matmul (1x1 convs, attention)"
                else:
                    cat = f"conv 3x3(x3) ->{w[0]} @{h}px"
            elif len(x) == 4 and len(w) == 4:  # the resample's 3x3 'same' conv after nearest 2x
                flops = 2.0 * x[0] * w[0] * w[1] * w[2] * w[3] * x[2] * x[3]
                cat = f"upsample conv ->{w[0]} @{x[2]}px"
            else:
                cat = f"conv (other) {name}"
            # every conv goes through aten::conv2d/conv3d -> ... -> the backend's kernel: count its
            # FLOPs once (at the entry), its time where it is spent (self time)
            flops = flops * ev.count / runs if name in ("aten::conv2d", "aten::conv3d") else 0.0
        elif name in ("aten::cat", "aten::pad", "aten::constant_pad_nd", "aten::copy_", "aten::clone",
                      "aten::contiguous", "aten::slice", "aten::select", "aten::permute", "aten::view",
                      "aten::reshape", "aten::empty", "aten::zeros", "aten::zero_", "aten::fill_",
                      "aten::stack", "aten::as_strided", "aten::transpose", "aten::expand"):
            cat, flops = "data movement (copy/transpose/pad/concat/slice)", 0.0
        elif name in ("aten::upsample_nearest2d", "aten::upsample_nearest_exact2d", "aten::upsample_nearest3d",
                      "aten::_upsample_nearest_exact3d", "aten::repeat_interleave", "aten::index"):
            cat, flops = "upsample: nearest 2x copy", 0.0
        elif name in ("aten::linalg_vector_norm", "aten::norm", "aten::clamp_min", "aten::div", "aten::div_",
                      "aten::normalize", "aten::sum"):
            cat, flops = "norm / reductions (fused elementwise)", 0.0
        elif name in ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear",
                      "aten::_scaled_dot_product_flash_attention_for_cpu",
                      "aten::scaled_dot_product_attention"):
            cat, flops = "matmul (1x1 convs, attention)", 0.0
        else:
            cat, flops = "elementwise (SiLU, adds, ...)", 0.0
        cats[cat][0] += ms
        cats[cat][1] += flops
    return {"categories": {k: {"ms": v[0], "flops": v[1]} for k, v in cats.items()}, "total_ms": total}


def category_table(prof: dict, title: str) -> str:
    cats = prof["categories"]
    total = sum(v["ms"] for v in cats.values())
    lines = [f"### {title}: {total:.0f} ms of op time per decode"
             + (f" (program wall {prof['wall_ms']:.0f} ms)" if "wall_ms" in prof else ""),
             "| category | ms | % | GFLOP | GFLOP/s |", "|---|---:|---:|---:|---:|"]
    if prof.get("wall_ms", 0) > 1.2 * total:
        # convs on XLA's own (Eigen) kernels (vidax.core.conv.compiler_options) record no thunk
        # events: the wall time no event covers is theirs (VIDAX_CPU_CONV=ynnpack profiles them)
        lines.insert(1, f"(the {prof['wall_ms'] - total:.0f} ms of program wall that no thunk event covers are the"
                        " convolutions on XLA's own kernels; VIDAX_CPU_CONV=ynnpack profiles them through YNNPACK)")
    for k, v in sorted(cats.items(), key=lambda kv: -kv[1]["ms"]):
        if v["ms"] < 0.05 * total / 100:
            continue
        gf = v["flops"] / 1e9
        rate = f"{gf / (v['ms'] / 1e3):.0f}" if gf and v["ms"] else ""
        lines.append(f"| {k} | {v['ms']:.1f} | {100 * v['ms'] / total:.1f} | {gf:.2f} | {rate} |" if gf else
                     f"| {k} | {v['ms']:.1f} | {100 * v['ms'] / total:.1f} | | |")
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for k, v in cats.items():
        groups[_group(k)][0] += v["ms"]
        groups[_group(k)][1] += v["flops"]
    lines.append("")
    lines.append("summary: " + "; ".join(f"{k} {v[0]:.0f} ms ({100 * v[0] / total:.0f}%"
                                          + (f", {v[1] / 1e9 / (v[0] / 1e3):.0f} GFLOP/s" if v[1] and v[0] else "") + ")"
                                          for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])))
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2, help="decodes per profile")
    ap.add_argument("--pairs", type=int, default=9, help="paired decodes (0: profile only)")
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--conv-impl", default=None, help="vidax conv_impl (default: the library's)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--case", default="", help="another family's VAE case, MODULE:FUNCTION under "
                    "benchmarks.families (e.g. hunyuanvideo:vae_decode_real_width); default: Wan's")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.core import vae_decode_real_width
    from benchmarks.harness import matmul_roof, paired, write_json

    if a.case:
        import importlib

        mod, fn = a.case.split(":")
        case = getattr(importlib.import_module(f"benchmarks.families.{mod}"), fn)()
    else:
        case = vae_decode_real_width(conv_impl=a.conv_impl)
    out: dict = {"conv_impl": a.conv_impl}
    if not a.no_profile:
        with tempfile.TemporaryDirectory() as tmp:
            pv = profile_vidax(case, a.runs, Path(tmp))
        pt = profile_torch(case, a.runs)
        print(category_table(pv, "vidax (XLA:CPU thunks, fused programs)"), "\n")
        print("vidax's largest data-movement thunks: " + "; ".join(
            f"{t['op']} {t['shape']} {t['ms']:.1f} ms" for t in pv["top_data_movement"][:8]), "\n")
        print(category_table(pt, "diffusers (torch.profiler, self CPU time)"), "\n")
        out.update(vidax=pv, diffusers=pt)
    if a.pairs <= 0:
        write_json(a.json, out)
        return out
    roof = matmul_roof()
    res = paired(case["vidax"], case["reference"], pairs=a.pairs, roof=roof, budget_s=a.budget)
    s = res.summary()
    print(f"paired decode: vidax {s['a_s']:.3f} s, diffusers {s['b_s']:.3f} s, ratio {s['ratio']:.2f}x "
          f"[q1 {s['ratio_q1']:.2f} - q3 {s['ratio_q3']:.2f}], {s['pairs']} pairs, "
          f"roof {s['roof_gflops']:.0f} GFLOP/s; per pair (ratio, roof GFLOP/s): "
          f"{[(round(r, 2), round(g)) for r, g in zip(res.ratios, res.roof)]}")
    out["paired"] = {**s, "ratios": res.ratios, "roofs": res.roof}
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
