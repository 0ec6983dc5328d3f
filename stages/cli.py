"""``vidax`` command line: generate, run one stage, status, rerun, list runs.

Errors in the user's request print one line naming the field and exit with code 2.
"""
from __future__ import annotations

import argparse
import sys
import time

from stages.request import Request, RequestError, validate, validate_run_id
from stages.store import RunStore, StoreError

DEFAULT_STORE = "vidax-runs"


def _store(url: str, write: bool) -> RunStore:
    try:
        s = RunStore(url)
        if write:
            s.check_writable()
        return s
    except StoreError as e:
        raise RequestError("store", str(e)) from None


def _table(rows: list[list[str]], header: list[str]) -> str:
    w = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w[i]) for i, c in enumerate(r))
    return "\n".join([fmt(header), fmt(["-" * x for x in w])] + [fmt(r) for r in rows])


def _print_results(results, total):
    rows = [[r.stage, r.status, f"{r.seconds:.2f}s", r.hardware] for r in results]
    print(_table(rows, ["stage", "status", "time", "hardware"]))
    print(f"total {total:.1f}s")


def _request_from_args(a) -> Request:
    return Request(model=a.model, prompt=a.prompt, negative_prompt=a.negative_prompt, preset=a.preset,
                   checkpoint=a.checkpoint, seed=a.seed, height=a.height, width=a.width, num_frames=a.frames,
                   steps=a.steps, guidance=a.guidance, shift=a.shift, scheduler=a.scheduler, fps=a.fps,
                   decode_stages=a.decode_stages, checkpoint_every=a.checkpoint_every, dtype=a.dtype,
                   mesh=a.mesh, offload_chunk_size=a.offload_chunk_size, image=a.image, guidance_2=a.guidance_2)


def cmd_generate(a) -> int:
    from stages import run as R

    req = validate(_request_from_args(a))
    run_id = validate_run_id(a.run_id) if a.run_id else req.default_run_id()
    store = _store(a.store, write=True)
    run = store.run(run_id)
    print(f"vidax: run {run_id} in {store.url}\n  {req.model} ({req.checkpoint or req.preset}), {req.width}x{req.height}, "
          f"{req.num_frames} frames, {req.steps} steps, guidance {req.guidance}, seed {req.seed}", flush=True)
    t0 = time.perf_counter()
    results = R.generate(run, req, log=lambda m: print(m, flush=True))
    _print_results(results, time.perf_counter() - t0)
    for name in R.video_names(len(req.prompts)):
        print(f"video: {run.url(name)}")
    return 0


def cmd_stage(a, force: bool = False) -> int:
    from stages import run as R

    validate_run_id(a.run_id)
    run = _store(a.store, write=True).run(a.run_id)
    req = R.load_request(run)
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    if a.stage not in keys:
        raise RequestError("stage", f"{a.stage!r} is not a stage of run {a.run_id}; stages: {', '.join(keys)}")
    t0 = time.perf_counter()
    if not force and R.committed(run, a.stage, keys[a.stage]):
        print(f"[{a.stage}] up to date, skipped (use `vidax rerun` to recompute)")
        return 0
    res = R.run_stage(run, req, pipe, a.stage, keys, log=lambda m: print(m, flush=True))
    R.write_manifest(run, req, keys)
    _print_results([res], time.perf_counter() - t0)
    return 0


def cmd_rerun(a) -> int:
    return cmd_stage(a, force=True)


def cmd_status(a) -> int:
    from stages import run as R

    validate_run_id(a.run_id)
    run = _store(a.store, write=False).run(a.run_id)
    req = R.load_request(run)
    keys = R.stage_keys(req, R.make_pipeline(req))
    rows = []
    for name, key in keys.items():
        rec = run.record(name) or {}
        rows.append([name, R.stage_status(run, name, key), key[:12], f"{rec['seconds']:.2f}s" if rec else "",
                     rec.get("hardware", ""), rec.get("finished", "")])
    print(f"run {a.run_id} in {run.store.url}: {req.model}, prompt {req.prompts[0]!r}")
    print(_table(rows, ["stage", "status", "key", "time", "hardware", "finished"]))
    return 0


def cmd_ls(a) -> int:
    store = _store(a.store, write=False)
    runs = store.list_runs()
    if not runs:
        print(f"no runs in {store.url}")
        return 0
    rows = []
    for rid in runs:
        req = store.run(rid).read_json("request.json") or {}
        p = req.get("prompt")
        p = p if isinstance(p, str) else (p or [""])[0]
        rows.append([rid, req.get("model", "?"), (p[:48] + "...") if len(p) > 48 else p])
    print(_table(rows, ["run", "model", "prompt"]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vidax", description="Staged, resumable video generation with JAX.")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def store_arg(p):
        p.add_argument("--store", default=DEFAULT_STORE, help="run store URL: a folder, file://, memory://, gs://bucket/prefix")

    g = sub.add_parser("generate", help="run (or resume) every stage of a request")
    g.add_argument("--model", default="wan2.1-t2v-1.3b")
    g.add_argument("--preset", default="tiny", help="seeded random-weight preset (e.g. tiny)")
    g.add_argument("--checkpoint", help="folder with real weights (diffusers layout or the original release)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--negative-prompt", default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--height", type=int)
    g.add_argument("--width", type=int)
    g.add_argument("--frames", type=int)
    g.add_argument("--steps", type=int)
    g.add_argument("--guidance", type=float)
    g.add_argument("--guidance-2", type=float, help="low-noise expert's guidance (two-expert models)")
    g.add_argument("--image", help="first frame for image-to-video models (path or URL: gs://, https://, ...)")
    g.add_argument("--shift", type=float)
    g.add_argument("--scheduler", choices=["unipc", "flow_euler", "flow_euler_sde"])
    g.add_argument("--fps", type=float)
    g.add_argument("--decode-stages", type=int, help="number of persisted decode stages (default: up to 4)")
    g.add_argument("--checkpoint-every", type=int, default=5, help="write a sampling checkpoint every K steps")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--mesh", help="device mesh for the DiT, e.g. dp=1,tp=4,sp=2, or auto (default: one device)")
    g.add_argument("--offload-chunk-size", help="stream the DiT blocks from host memory, N blocks at a time (or all)")
    g.add_argument("--run-id", help="default: derived from the request, so repeating it resumes")
    store_arg(g)
    s = sub.add_parser("stage", help="run one stage of an existing run (skips it if already committed)")
    s.add_argument("run_id")
    s.add_argument("stage", help="encode | sample | decode/<k> | mux")
    store_arg(s)
    r = sub.add_parser("rerun", help="recompute one stage of an existing run")
    r.add_argument("run_id")
    r.add_argument("--stage", required=True)
    store_arg(r)
    st = sub.add_parser("status", help="show a run's stages")
    st.add_argument("run_id")
    store_arg(st)
    ls = sub.add_parser("ls", help="list runs in a store")
    store_arg(ls)
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    from stages.run import StageError

    try:
        return {"generate": cmd_generate, "stage": cmd_stage, "rerun": cmd_rerun, "status": cmd_status,
                "ls": cmd_ls}[a.cmd](a)
    except RequestError as e:
        print(f"vidax: error: {e}", file=sys.stderr)
        return 2
    except StageError as e:
        print(f"vidax: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
