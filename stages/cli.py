"""``vidax`` command line: generate, batch, run one stage, rerun, status, list runs.

Errors in the user's request print one line naming the field and exit with code 2. A model's own
options (declared by its family) appear as flags of ``generate`` once ``--model`` names it:
``vidax generate --model MODEL --help``.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Callable

from stages.request import Request, RequestError, validate, validate_run_id
from stages.store import RunStore, StoreError
from vidax import registry
from vidax.pipeline import OptionError

DEFAULT_STORE = "vidax-runs"


def _console(stderr: bool = False):
    from rich.console import Console

    con = Console(stderr=stderr, soft_wrap=True, highlight=False, markup=False, emoji=False)
    if not con.is_terminal:  # logs and pipes: wide tables, never truncated ids
        con.width = 240
    return con


def _store(url: str, write: bool) -> RunStore:
    try:
        s = RunStore(url)
        if write:
            s.check_writable()
        return s
    except StoreError as e:
        raise RequestError("store", str(e)) from None


def _table(rows: list[list[str]], header: list[str], title: str | None = None):
    from rich import box
    from rich.table import Table

    t = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for i, h in enumerate(header):
        t.add_column(h, no_wrap=i == 0)
    for r in rows:
        t.add_row(*[str(c) for c in r])
    return t


def _print_results(con, results, total):
    rows = [[r.stage, r.status, f"{r.seconds:.2f}s", r.hardware] for r in results]
    con.print(_table(rows, ["stage", "status", "time", "hardware"]))
    con.print(f"total {total:.1f}s")


class _Reporter:
    """Stage logs as lines, sampling as a progress bar (plain lines when not on a terminal)."""

    def __init__(self, con):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.con = con
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), console=con, transient=True)
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def log(self, msg: str) -> None:
        self.con.print(msg)

    def update(self, stage: str, frac: float) -> None:
        if stage not in self.tasks:
            self.tasks[stage] = self.progress.add_task(stage, total=100)
        self.progress.update(self.tasks[stage], completed=round(100 * frac))


# ------------------------------------------------------------------ generate
def _add_generate_args(g: argparse.ArgumentParser, model: str | None) -> None:
    g.add_argument("--model", default=registry.default_model(), help="model id (`vidax models` lists them)")
    g.add_argument("--preset", default="tiny", help="seeded random-weight preset (e.g. tiny)")
    g.add_argument("--checkpoint", help="folder with real weights (diffusers layout or the original release): a path or "
                   "any fsspec URL (gs://...), fetched once into $VIDAX_CACHE (default ~/.cache/vidax)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--negative-prompt", default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--height", type=int)
    g.add_argument("--width", type=int)
    g.add_argument("--frames", type=int)
    g.add_argument("--steps", type=int)
    g.add_argument("--guidance", type=float)
    g.add_argument("--image", help="first frame for image-to-video models (path or URL: gs://, https://, ...)")
    g.add_argument("--fps", type=float)
    g.add_argument("--decode-stages", type=int, help="number of persisted decode stages (default: the model's plan)")
    g.add_argument("--checkpoint-every", type=int, default=5, help="write a sampling checkpoint every K steps")
    g.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="the DiT's dtype (default: the model's: bfloat16 for the large releases, float32 for the "
                        "small ones and every tiny preset)")
    g.add_argument("--mesh", help="device mesh for the DiT, e.g. dp=1,tp=4,sp=2, or auto (default: one device)")
    g.add_argument("--offload-chunk-size", help="stream the DiT blocks from host memory, N blocks at a time (or all; "
                                                        "per block stack: double=4,single=8)")
    g.add_argument("--lora", action="append", metavar="[high=|low=]FILE[:SCALE]",
                   help="a LoRA merged into the DiT at load (safetensors: diffusers/PEFT, ComfyUI/kohya, musubi, "
                        "AI-Toolkit, LyCORIS diff); repeatable; Wan2.2 A14B: high= / low= for one expert")
    g.add_argument("--run-id", help="default: derived from the request, so repeating it resumes")
    c = g.add_argument_group("step caching (fewer DiT evaluations; part of the sample stage's key)")
    c.add_argument("--cache", help="none (default), fbcache (First Block Cache), taylorseer (TaylorSeer), magcache "
                   "(MagCache) or teacache (TeaCache)")
    c.add_argument("--cache-threshold", type=float, help="fbcache: relative change of the first block's residual "
                   "at or below which the other blocks are skipped (default 0.05); magcache: accumulated error "
                   "(default 0.06); teacache: accumulated rescaled change (default 0.1)")
    c.add_argument("--cache-max-skips", type=int, help="magcache: most steps skipped in a row (default 3)")
    c.add_argument("--cache-retention", type=float, help="magcache: fraction of the first steps always computed "
                   "(default 0.2)")
    c.add_argument("--cache-interval", type=int, help="taylorseer: a computed step every N steps (default 5)")
    c.add_argument("--cache-warmup", type=int, help="taylorseer / teacache: first steps always computed "
                   "(default 3 / 5)")
    c.add_argument("--cache-order", type=int, help="taylorseer: order of the Taylor series (default 1)")
    c.add_argument("--cache-ratios", help="magcache: calibrated ratios, a JSON file (vidax calibrate) or a "
                   "comma-separated list (default: the release's published ones)")
    recipe = registry.MODELS.get(model or registry.default_model())
    if recipe is not None and recipe.options:
        grp = g.add_argument_group(f"options of {recipe.model_id}")
        for o in recipe.options:
            extra = f" (choices: {', '.join(map(str, o.choices))})" if o.choices else ""
            default = recipe.settings(None).get(o.name)
            grp.add_argument(o.flag, dest=f"opt__{o.name}", metavar=o.type.__name__.upper(),
                             help=f"{o.help}{extra}; default {default}")


def _request_from_args(a) -> Request:
    recipe = registry.MODELS.get(a.model)
    options = {}
    for o in (recipe.options if recipe else ()):
        text = getattr(a, f"opt__{o.name}", None)
        if text is not None:
            try:
                options[o.name] = o.parse(text)
            except OptionError as e:
                raise RequestError(e.field, str(e).split(": ", 1)[1]) from None
    return Request(model=a.model, prompt=a.prompt, negative_prompt=a.negative_prompt, preset=a.preset,
                   checkpoint=a.checkpoint, seed=a.seed, height=a.height, width=a.width, num_frames=a.frames,
                   steps=a.steps, guidance=a.guidance, fps=a.fps, decode_stages=a.decode_stages,
                   checkpoint_every=a.checkpoint_every, dtype=a.dtype, mesh=a.mesh,
                   offload_chunk_size=a.offload_chunk_size, image=a.image, lora=a.lora, options=options,
                   cache=a.cache, cache_threshold=a.cache_threshold, cache_max_skips=a.cache_max_skips,
                   cache_retention=a.cache_retention, cache_ratios=_ratios_arg(a.cache_ratios),
                   cache_interval=a.cache_interval, cache_warmup=a.cache_warmup, cache_order=a.cache_order)


def _ratios_arg(text):
    """``--cache-ratios``: a file (path / URL) or ``1.0,0.98,...``."""
    if text is None or not re.fullmatch(r"\s*[-+0-9.eE]+(\s*,\s*[-+0-9.eE]+)+\s*", text):
        return text
    try:
        return [float(v) for v in text.split(",")]
    except ValueError:
        return text


def _describe(req: Request) -> str:
    opts = ", ".join(f"{k} {v}" for k, v in req.options.items() if v is not None)
    return (f"{req.model} ({req.checkpoint or req.preset}), {req.width}x{req.height}, {req.num_frames} frames, "
            f"{req.steps} steps, guidance {req.guidance}, seed {req.seed}" + (f", {opts}" if opts else ""))


def run_request(req: Request, store: RunStore, run_id: str, con) -> list:
    from stages import run as R

    run = store.run(run_id)
    con.print(f"vidax: run {run_id} in {store.url}\n  {_describe(req)}")
    t0 = time.perf_counter()
    with _Reporter(con) as rep:
        results = R.generate(run, req, log=rep.log, progress=rep.update)
    _print_results(con, results, time.perf_counter() - t0)
    for name in R.video_names(len(req.prompts)):
        con.print(f"video: {run.url(name)}")
    return results


def cmd_generate(a) -> int:
    req = validate(_request_from_args(a))
    run_id = validate_run_id(a.run_id) if a.run_id is not None else req.default_run_id()
    store = _store(a.store, write=True)
    run_request(req, store, run_id, _console())
    return 0


# ------------------------------------------------------------------ batch
def cmd_batch(a) -> int:
    """Run a prompt file locally (no Prefect server): every line validated first, each prompt a
    run; a failing prompt does not stop the others."""
    from stages.prompts import PromptFileError, parse_prompt_file

    con = _console()
    defaults = {"model": a.model} if a.model else {}
    try:
        lines = parse_prompt_file(a.file, defaults)
    except PromptFileError as e:
        raise RequestError("file", str(e)) from None
    store = _store(a.store, write=True)
    bad = [b for b in lines if b.error]
    good = [b for b in lines if b.request is not None]
    for b in bad:
        _console(stderr=True).print(f"vidax: rejected: {b.error}")
    con.print(f"vidax batch {a.file}: {len(good)} prompt(s) to run, {len(bad)} line(s) rejected")
    rows = [[b.line, "", "rejected", "", b.error] for b in bad]
    failed = 0
    from stages import run as R

    # phase by phase: every line's encode, then every line's sampling, then decoding, then mux;
    # each phase loads each component once per model, checkpoint, dtype and mesh
    items = [R.BatchItem(store.run(b.run_id or b.request.default_run_id()), b.request, label=f"line {b.line}")
             for b in good]
    for b, it in zip(good, items):
        con.print(f"line {b.line}: run {it.run.run_id}\n  {_describe(b.request)}")
    t0 = time.perf_counter()
    with _Reporter(con) as rep:
        R.generate_many(items, log=rep.log, progress=rep.update)
    for b, it in zip(good, items):
        req, rid = b.request, it.run.run_id
        if it.ok:
            rows.append([b.line, req.prompts[0][:48], "done", rid,
                         ", ".join(it.run.url(n) for n in R.video_names(len(req.prompts)))])
        else:
            failed += 1
            e = it.error
            _console(stderr=True).print(f"vidax: line {b.line} failed: {type(e).__name__}: {e}")
            rows.append([b.line, req.prompts[0][:48], "failed", rid, f"{type(e).__name__}: {e}"[:200]])
    con.print(f"batch: {time.perf_counter() - t0:.1f}s")
    rows.sort(key=lambda r: r[0])
    con.print(_table(rows, ["line", "prompt", "status", "run", "output / error"], title=f"batch {a.file}"))
    con.print(f"{len(good) - failed} done, {failed} failed, {len(bad)} rejected")
    return 1 if failed else (2 if not good else 0)


# ------------------------------------------------------------------ stage / rerun / status / ls
def cmd_stage(a, force: bool = False) -> int:
    from stages import run as R

    if a.run_id is None or a.stage is None:
        raise RequestError("run_id", "expected RUN_ID STAGE (e.g. `vidax stage RUN sample`)")
    validate_run_id(a.run_id)
    run = _store(a.store, write=True).run(a.run_id)
    req = R.load_request(run)
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    if a.stage not in keys:
        raise RequestError("stage", f"{a.stage!r} is not a stage of run {a.run_id}; stages: {', '.join(keys)}")
    con = _console()
    t0 = time.perf_counter()
    if not R.wanted(run, req, pipe, a.stage, keys, force):
        con.print(f"[{a.stage}] up to date, skipped (use `vidax rerun` to recompute)")
        return 0
    with _Reporter(con) as rep:
        res = R.run_stage(run, req, pipe, a.stage, keys, log=rep.log, progress=rep.update)
    R.write_manifest(run, req, keys)
    _print_results(con, [res], time.perf_counter() - t0)
    return 0


def cmd_rerun(a) -> int:
    return cmd_stage(a, force=True)


def cmd_status(a) -> int:
    from stages import run as R

    validate_run_id(a.run_id)
    run = _store(a.store, write=False).run(a.run_id)
    req = R.load_request(run)
    pipe = R.make_pipeline(req)
    keys = R.stage_keys(req, pipe)
    records = R.Records(run)
    rows = []
    for name, key in keys.items():
        status = R.stage_status(run, name, key, "full" if a.verify else "quick", req=req, pipe=pipe, records=records)
        rec = records.get(name)
        rec = rec if isinstance(rec, dict) else {}
        row = [name, status, key[:12], f"{rec['seconds']:.2f}s" if rec.get("seconds") is not None else "",
               rec.get("hardware", ""), rec.get("finished", "")]
        if a.io:
            io, d = rec.get("io") or {}, rec.get("details") or {}
            c = rec.get("compile") or {}
            row += [io.get("requests", ""), _mib(io.get("bytes_read")), _mib(io.get("bytes_written")),
                    _mib(d.get("frames_bytes")), _mib(d.get("carry_bytes")),
                    f"{c['compiled']} / {c['cache_hits']}" if c else ""]
        rows.append(row)
    con = _console()
    con.print(f"run {a.run_id} in {run.store.url}: {req.model}, prompt {req.prompts[0]!r}")
    header = ["stage", "status", "key", "time", "hardware", "finished"]
    if a.io:
        header += ["requests", "read MiB", "written MiB", "frames MiB", "carry MiB", "compiled / cached"]
    con.print(_table(rows, header))
    ev = ((records.get("sample") or {}).get("details") or {}).get("dit_evaluations") if isinstance(
        records.get("sample"), dict) else None
    if ev:
        cs = (records.get("sample").get("details") or {}).get("cache") or {}
        knob = (f"interval {cs.get('interval')}" if cs.get("method") == "taylorseer" else f"threshold {cs.get('threshold')}")
        con.print(f"DiT evaluations (sample, cache {cs.get('method')} {knob}): "
                  f"{ev['computed']} computed, {ev['skipped']} skipped")
    for n in R.video_names(len(req.prompts)):
        con.print(f"video: {run.url(n)}")
    return 0


def _mib(n) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def cmd_ls(a) -> int:
    store = _store(a.store, write=False)
    runs = store.list_runs()
    con = _console()
    if not runs:
        con.print(f"no runs in {store.url}")
        return 0
    rows = []
    for rid in runs:
        req = store.run(rid).read_json("request.json") or {}
        p = req.get("prompt")
        p = p if isinstance(p, str) else (p or [""])[0]
        rows.append([rid, req.get("model", "?"), (p[:48] + "...") if len(p) > 48 else p])
    con.print(_table(rows, ["run", "model", "prompt"]))
    return 0


def cmd_models(a) -> int:
    rows = []
    for mid, r in sorted(registry.MODELS.items()):
        opts = ", ".join(o.name for o in r.options)
        rows.append([mid, r.family, r.image, ", ".join(r.presets), opts, r.description])
    _console().print(_table(rows, ["model", "family", "image", "presets", "options", "description"]))
    return 0


# ------------------------------------------------------------------ parser
def build_parser(model: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vidax", description="Staged, resumable video generation with JAX.",
                                 epilog="--debug (anywhere on the line, or VIDAX_DEBUG=1): show the traceback of a "
                                        "failure, and the storage libraries' own logs")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def store_arg(p):
        p.add_argument("--store", default=DEFAULT_STORE, help="run store URL: a folder, file://, memory://, gs://bucket/prefix")

    g = sub.add_parser("generate", help="run (or resume) every stage of a request")
    _add_generate_args(g, model)
    store_arg(g)
    b = sub.add_parser("batch", help="run a prompt file (.txt, .jsonl, .csv) locally, one run per line")
    b.add_argument("file", help="prompt file URL (local path, gs://, ...)")
    b.add_argument("--model", help="default model for lines that name none")
    store_arg(b)
    s = sub.add_parser("stage", help="run one stage of an existing run (skips it if already committed)")
    s.add_argument("run_id", nargs="?")
    s.add_argument("stage", nargs="?", help="encode | sample | decode/<k> | mux")
    store_arg(s)
    r = sub.add_parser("rerun", help="recompute one stage of an existing run")
    r.add_argument("run_id")
    r.add_argument("--stage", required=True)
    store_arg(r)
    st = sub.add_parser("status", help="show a run's stages (checks each against one listing; no data read)")
    st.add_argument("run_id")
    st.add_argument("--verify", action="store_true", help="also re-read every output and check its content digest")
    st.add_argument("--io", action="store_true", help="requests and bytes each stage moved, frames vs carry sizes")
    store_arg(st)
    ls = sub.add_parser("ls", help="list runs in a store")
    store_arg(ls)
    sub.add_parser("models", help="list the models, their families and options")
    from stages import probe  # the low-noise reconstruction probe (stages/probe.py)

    probe.add_parser(sub, model)
    from stages import plan  # per-stage memory plans (stages/plan.py)

    plan.add_parser(sub, model)
    from stages import calibrate  # MagCache ratios of a checkpoint (stages/calibrate.py)

    calibrate.add_parser(sub, model)
    return ap


def cmd_calibrate(a) -> int:
    from stages.calibrate import cmd_calibrate as run

    return run(a)


def cmd_probe(a) -> int:
    from stages.probe import cmd_probe as run

    return run(a)


def cmd_plan(a) -> int:
    from stages.plan import cmd_plan as run

    return run(a)


COMMANDS: dict[str, Callable] = {"generate": cmd_generate, "batch": cmd_batch, "stage": cmd_stage,
                                 "rerun": cmd_rerun, "status": cmd_status, "ls": cmd_ls, "models": cmd_models,
                                 "probe": cmd_probe, "plan": cmd_plan, "calibrate": cmd_calibrate}


def _model_arg(argv: list[str]) -> str | None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model")
    known, _ = pre.parse_known_args(argv)
    return known.model


def _one_line_warnings() -> None:
    """vidax's own warnings (a model's advice on a prompt, an option without effect) as one line
    ``vidax: warning: ...`` on stderr; other warnings as Python prints them."""
    import warnings

    fmt = getattr(warnings.formatwarning, "__wrapped__", warnings.formatwarning)

    def one_line(message, category, filename, lineno, line=None):
        if category.__module__.split(".")[0] == "vidax":
            return f"vidax: warning: {message}\n"
        return fmt(message, category, filename, lineno, line)

    one_line.__wrapped__ = fmt
    warnings.formatwarning = one_line


def _one_line(e: Exception) -> str:
    """An error outside the request and the stages, in one line: a store that stops answering (the
    request and its attempts), anything else with its type and a pointer to ``--debug``."""
    from stages.run import describe_error
    from stages.store import StoreError, is_transient

    if isinstance(e, StoreError) or is_transient(e):
        return f"store: {describe_error(e)}"
    return f"{describe_error(e)} (run again with --debug for the traceback)"


def main(argv=None, extend: Callable[[argparse.ArgumentParser], dict] | None = None) -> int:
    """``extend(parser) -> {command: handler}`` adds commands from a higher layer (``vidax submit``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    import os

    debug = "--debug" in argv or os.environ.get("VIDAX_DEBUG", "").lower() in ("1", "true", "yes")
    argv = [x for x in argv if x != "--debug"]
    from stages.store import quiet_storage_loggers

    quiet_storage_loggers(not debug)
    _one_line_warnings()
    if argv[:1] == ["plan"]:
        from stages.plan import ensure_devices

        ensure_devices(argv[1:])  # as many (fake CPU) devices as the pools have, before JAX starts
    ap = build_parser(_model_arg(argv))
    commands = dict(COMMANDS)
    if extend is not None:
        commands.update(extend(ap))
    a = ap.parse_args(argv)
    from stages.run import StageError
    from vidax.core import runtime

    from vidax.core.mesh import RemoteError, process_count

    import traceback

    try:
        # (`vidax stage --flow-run`, the multi-host stage pods' command, joins the job itself, or execs process 0)
        if a.cmd in ("generate", "batch", "stage", "rerun", "calibrate") and not getattr(a, "flow_run", None):
            runtime.setup()  # join a multi-host job (before any device is touched); persistent compilation cache
        rc = commands[a.cmd](a)
    except (RequestError, runtime.SettingError) as e:
        if debug:
            traceback.print_exc()
        _console(stderr=True).print(f"vidax: error: {e}")
        rc = 2
    except (StageError, RemoteError) as e:
        if debug:
            traceback.print_exc()
        _console(stderr=True).print(f"vidax: error: {e}")
        rc = 1
    except Exception as e:  # noqa: BLE001 - one line; --debug shows the traceback
        if debug:
            if process_count() == 1:
                raise
            traceback.print_exc()
        _console(stderr=True).print(f"vidax: error: {_one_line(e)}")
        rc = 1
    except BaseException:
        if process_count() == 1:
            raise
        traceback.print_exc()
        rc = 1
    if rc and process_count() > 1:
        # a failed process of a multi-host job leaves at once: the others, maybe blocked in a
        # collective with it, are failed by the coordination service (process 0 gone: at once;
        # another: after VIDAX_DISTRIBUTED_TIMEOUT) rather than waiting at an orderly shutdown
        import os

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
