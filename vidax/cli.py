"""``vidax`` command line."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _progress(info, *_):
    n = info.total
    bar = "#" * int(20 * (info.index + 1) / n)
    print(f"\r  sampling [{bar:<20}] step {info.index + 1}/{n}  t={info.timestep:7.2f}  {info.seconds:.2f}s/step",
          end="" if info.index + 1 < n else "\n", flush=True)


def cmd_generate(a) -> int:
    from vidax import registry
    from vidax.video import write_mp4

    recipe = registry.get(a.model)
    source = a.checkpoint or a.preset
    if not a.checkpoint and a.preset not in recipe.presets:
        raise ValueError(f"--preset {a.preset!r}: {a.model} has presets {', '.join(recipe.presets)}")
    s = recipe.settings(a.preset if not a.checkpoint else None, height=a.height, width=a.width,
                        num_frames=a.frames, steps=a.steps, guidance=a.guidance, shift=a.shift, fps=a.fps)
    if not a.prompt.strip():
        raise ValueError("--prompt: must not be empty")
    pipe = recipe.pipeline_class()(source)
    t0 = time.perf_counter()
    print(f"vidax: {recipe.model_id} ({source}), {s['width']}x{s['height']}, {s['num_frames']} frames, "
          f"{s['steps']} steps, guidance {s['guidance']}, seed {a.seed}", flush=True)
    frames = pipe.generate(a.prompt, a.negative_prompt, seed=a.seed, height=s["height"], width=s["width"],
                           num_frames=s["num_frames"], steps=s["steps"], guidance=s["guidance"],
                           shift=s.get("shift"), on_step=_progress)[0]
    out = write_mp4(frames, a.out, fps=s["fps"])
    print(f"done in {time.perf_counter() - t0:.1f}s -> {out.resolve()}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="vidax", description="Video generation with JAX.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate one video")
    g.add_argument("--model", default="wan2.1-t2v-1.3b")
    g.add_argument("--preset", default="tiny", help="shape preset with seeded random weights (e.g. tiny)")
    g.add_argument("--checkpoint", help="folder with real weights (diffusers layout or the original release)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--negative-prompt", default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--height", type=int)
    g.add_argument("--width", type=int)
    g.add_argument("--frames", type=int)
    g.add_argument("--steps", type=int)
    g.add_argument("--guidance", type=float)
    g.add_argument("--shift", type=float)
    g.add_argument("--fps", type=float)
    g.add_argument("--out", default="vidax-runs/video.mp4")
    a = ap.parse_args(argv)
    try:
        return {"generate": cmd_generate}[a.cmd](a)
    except (ValueError, FileNotFoundError) as e:
        print(f"vidax: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
