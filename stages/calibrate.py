"""``vidax calibrate``: measure MagCache's per-step magnitude ratios for a checkpoint.

One sampling run with every step computed (as diffusers' ``MagCacheConfig(calibrate=True)``):
after each step the ratio ``mean_tokens(|r_t| / |r_{t-1}|)`` of the block stack's residual
(output - input of the hidden states) to the previous step's, per CFG branch. The ratios are
written as JSON (``{"ratios": [...], ...}``) to ``--out`` or beside the run store
(``<store>/calibrations/<model>-<steps>steps.json``); ``--cache magcache --cache-ratios FILE``
reads them (they are resampled to another step count by nearest neighbour)."""
from __future__ import annotations

import json

from stages.request import Request, RequestError, build_pipeline, validate


def add_parser(sub, model: str | None = None) -> None:
    from vidax import registry

    c = sub.add_parser("calibrate", help="measure MagCache ratios for a checkpoint (one fully computed sampling run)")
    c.add_argument("--model", default=registry.default_model())
    c.add_argument("--preset", default="tiny")
    c.add_argument("--checkpoint", help="checkpoint folder (path or URL)")
    c.add_argument("--prompt", default="a busy city street at dusk, people walking, cars passing, neon signs")
    c.add_argument("--image", help="first frame (image-to-video models)")
    c.add_argument("--steps", type=int)
    c.add_argument("--height", type=int)
    c.add_argument("--width", type=int)
    c.add_argument("--frames", type=int)
    c.add_argument("--guidance", type=float)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--dtype", choices=["float32", "bfloat16"])
    c.add_argument("--mesh")
    c.add_argument("--out", help="JSON file to write (default: <store>/calibrations/<model>-<steps>steps.json)")
    c.add_argument("--store", default="vidax-runs", help="run store URL the default output goes beside")


def calibrate(req: Request, image=None) -> dict:
    """The ratios of one fully computed sampling run of ``req`` (validated)."""
    from vidax.core.stepcache import CacheSettings, StepCache

    pipe = build_pipeline(req)
    if not getattr(pipe, "STEP_CACHE", False):
        raise RequestError("model", f"{req.model} does not run a step cache yet")
    cond = {k: v.array for k, v in pipe.encode(req, image).items()}
    cache = StepCache(CacheSettings("magcache", 0.0, ratios=((1.0, 1.0),)), req.steps, calibrate=True)
    pipe.step_cache = cache
    try:
        pipe.sample(cond, req)
    finally:
        pipe.step_cache = None
    return {"model": req.model, "checkpoint": req.checkpoint or f"preset:{req.preset}", "steps": req.steps,
            "guidance": req.guidance, "height": req.height, "width": req.width, "frames": req.num_frames,
            "ratios": [round(r, 6) for r in cache.ratios_measured],
            "per_branch": [[round(r, 6) for r in b] for b in cache.calib]}


def cmd_calibrate(a) -> int:
    import fsspec

    req = validate(Request(model=a.model, preset=a.preset, checkpoint=a.checkpoint, prompt=a.prompt, image=a.image,
                           steps=a.steps, height=a.height, width=a.width, num_frames=a.frames, guidance=a.guidance,
                           seed=a.seed, dtype=a.dtype, mesh=a.mesh))
    out = a.out or f"{a.store.rstrip('/')}/calibrations/{req.model}-{req.steps}steps.json"
    image = None
    if req.image is not None:
        from stages.images import load_image

        image = load_image(req.image)
    doc = calibrate(req, image)
    fs, path = fsspec.core.url_to_fs(out)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    print(f"MagCache ratios of {req.model} ({doc['checkpoint']}, {req.steps} steps): {doc['ratios']}")
    print(f"written to {out}; use: vidax generate --cache magcache --cache-ratios {out}")
    return 0
