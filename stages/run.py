"""The stages of a run and the plan that ties them together.

    encode -> sample -> decode/0 .. decode/N-1 [-> decode/audio] -> mux

Every stage drives the request's family pipeline through the protocol in :mod:`vidax.pipeline`:
the stored names come from the family (``encode.zarr`` holds whatever ``encode`` returned, with its
dimension names), the decode stages come from its decode plan, an audio decode stage and an audio
track appear when it declares audio.

Each stage reads its inputs from the run store, writes its outputs, and commits by writing its
completion record last. A stage's key hashes its inputs' keys, its parameters, the weights'
content fingerprint and the code it runs; a committed stage whose key matches (and whose checksums
verify) is skipped, anything else reruns.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from stages.request import Request, build_pipeline
from stages.store import (CorruptDocument, DigestMismatch, IOCounter, Run, is_transient, local_tmpdir, pack,
                          read_array, unpack)
from vidax.core.jit import CompileCounter
from vidax.core.mesh import agree, barrier, is_leader, process_count
from vidax.core.runtime import collect_own_garbage
from vidax.pipeline import DecodeSpan, Named, Pipeline

STAGE_KINDS = ("encode", "sample", "decode", "mux")


class StageError(RuntimeError):
    """A stage cannot run (missing inputs, bad stage name, injected fault...)."""


def describe_error(e: BaseException, limit: int = 600) -> str:
    """``Type: message`` on one line (a library's multi-line message collapsed), at most ``limit``
    characters; vidax's own errors (whose messages name what failed) without the type."""
    msg = " ".join(str(e).split())
    if not isinstance(e, StageError):
        msg = f"{type(e).__name__}: {msg}" if msg else type(e).__name__
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


class StageFailed(StageError):
    """A stage failed while it ran: its one-line message names the stage and what failed, says that
    nothing of the stage was committed (what was committed before it is kept) and how to resume.
    ``cause``: the original exception (its traceback is shown with ``--debug``)."""

    def __init__(self, stage: str, run: "Run", cause: BaseException):
        self.stage, self.cause = stage, cause
        store = run.store.url
        what = describe_error(cause)
        what = what[len(stage) + 2:] if what.startswith(f"{stage}: ") else what  # (a StageError naming it)
        super().__init__(
            f"{stage}: {what}; nothing of {stage} was committed (the stages committed before it "
            f"are kept); resume with `vidax stage {run.run_id} {stage} --store {store}` or by running the same "
            f"`vidax generate` command again")


# ------------------------------------------------------------------ identity
#: CPython 3.11's parser is not safe to run from several threads at once (a batch's prompts run
#: their stages in threads): "SystemError: AST constructor recursion depth mismatch"
_AST_LOCK = threading.Lock()


_DIGESTS: dict[str, str] = {}  # sha256 of a file's bytes -> its code digest, in this process


def _source_digest(path: Path) -> str:
    """Digest of a Python file's code: its syntax tree without docstrings, so comment and
    docstring edits do not invalidate stored runs. Parsing and dumping the tree costs ~25 ms a
    file (seconds for the stage keys of one request), so each digest is kept by the file's exact
    bytes: in this process, and in ``<cache>/code`` (``$VIDAX_CACHE``, default ``~/.cache/vidax``)
    for the next processes of the machine (a worker's flow runs, a batch's children)."""
    source = path.read_bytes()
    key = hashlib.sha256(b"ast-dump-v1:%d.%d:" % sys.version_info[:2] + source).hexdigest()
    if key in _DIGESTS:
        return _DIGESTS[key]
    from vidax.weights.source import cache_dir

    f = cache_dir() / "code" / key
    try:
        digest = f.read_text()
        if len(digest) == 64:
            _DIGESTS[key] = digest
            return digest
    except OSError:
        pass
    digest = _parse_digest(source)
    _DIGESTS[key] = digest
    try:  # atomic: a reader sees the whole digest or no file
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f"{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, f)
    except OSError:
        pass  # a read-only cache only costs the next process the parse
    return digest


def _parse_digest(source: bytes) -> str:
    with _AST_LOCK:
        tree = ast.parse(source)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
                node.body = body[1:] or [ast.Pass()]
        dump = ast.dump(tree, annotate_fields=False)
    return hashlib.sha256(dump.encode()).hexdigest()


_ROOT = Path(__file__).resolve().parent.parent
# the shared code each stage kind runs (besides the family's own folder and CODE_DEPS)
_KIND_CODE = {
    "encode": ("vidax/core", "vidax/text", "vidax/weights", "vidax/pipeline.py"),
    "sample": ("vidax/core", "vidax/schedulers", "vidax/weights", "vidax/pipeline.py"),
    "decode": ("vidax/core", "vidax/weights", "vidax/pipeline.py"),
    "mux": ("vidax/video.py",),
}
_STAGE_CODE = ("stages/run.py", "stages/store.py")


@lru_cache(maxsize=None)
def _code_digest(paths: tuple[str, ...]) -> str:
    """Digest of the Python code under ``paths`` (files or folders; relative to the repository
    or absolute), each file named relative to its root's parent."""
    h = hashlib.sha256()
    for p in paths:
        root = Path(p) if Path(p).is_absolute() else _ROOT / p
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for f in files:
            h.update(f.relative_to(root.parent).as_posix().encode())
            h.update(_source_digest(f).encode())
    return h.hexdigest()[:12]


def _module_code(module: str, folder: bool = False) -> str:
    """Where a module's code is: its file, or its folder (``folder`` or a package)."""
    import importlib

    f = Path(importlib.import_module(module).__file__).resolve()
    return str(f.parent if folder or f.name == "__init__.py" else f)


def code_version(kind: str | None = None, pipe: Pipeline | None = None) -> str:
    """Version of the code a stage kind runs: the stage modules, the shared vidax code it uses,
    and (except for mux) the family's folder with its declared dependencies. ``kind=None``: all
    of vidax (recorded for information)."""
    import vidax

    if kind is None:
        return f"{vidax.__version__}+{_code_digest(('vidax',) + _STAGE_CODE)}"
    paths = list(_STAGE_CODE) + list(_KIND_CODE[kind])
    if pipe is not None and kind != "mux":
        paths.append(_module_code(type(pipe).__module__, folder=True))  # the family's folder
        paths += [_module_code(d) for d in pipe.CODE_DEPS]
    return f"{vidax.__version__}+{_code_digest(tuple(paths))}"


def _key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def hardware() -> str:
    import jax

    devs = jax.devices()
    hosts = f", {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return f"{jax.default_backend()} x{len(devs)} ({devs[0].device_kind}) on {socket.gethostname()}{hosts}"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------ plan
def make_pipeline(req: Request) -> Pipeline:
    """The model pipeline for a request (configs only: weights load inside each stage)."""
    return build_pipeline(req)


def decode_plan(req: Request, pipe: Pipeline) -> list[DecodeSpan]:
    plan = pipe.decode_plan(req)
    names = [s.name for s in plan]
    if len(set(names)) != len(names) or not all(n.startswith("decode/") for n in names):
        raise StageError(f"{type(pipe).__name__}.decode_plan: stage names must be unique 'decode/...' ({names})")
    return plan


def stage_names(req: Request, pipe: Pipeline | None = None) -> list[str]:
    pipe = pipe or make_pipeline(req)
    return ["encode", "sample"] + [s.name for s in decode_plan(req, pipe)] + ["mux"]


def _fingerprints(pipe: Pipeline, kind: str, req: Request) -> dict:
    comps = list(pipe.COMPONENTS.get(kind, ()))
    if kind == "encode" and req.image is not None:
        comps += list(pipe.COMPONENTS.get("image", ()))
    out = {c: pipe.fingerprint(c) for c in comps}
    if req.lora and kind in ("encode", "sample"):  # a LoRA's content and scale enter the key of each
        from vidax.weights import lora                # stage whose weights it changes (DiT: sample)

        targets = pipe.lora_targets()
        specs = [s for s in lora.parse_specs(req.lora)
                 if kind in (lora.stages_touched(s, targets) if targets else {"sample"})]
        if specs:
            out["lora"] = [lora.fingerprint(s) for s in specs]
    return out


def _cache_key(req: Request) -> dict:
    """The step-cache settings in the sample key (absent without a cache: the keys stay as they were)."""
    cs = req.cache_settings()
    return {} if cs is None else {"cache": cs.key()}


def stage_keys(req: Request, pipe: Pipeline) -> dict[str, str]:
    keys = {}
    image = None
    if req.image is not None:
        from stages.images import image_digest

        image = dict(digest=image_digest(req.image), height=req.height, width=req.width, frames=req.num_frames)
    keys["encode"] = _key(stage="encode", model=req.model, prompts=req.prompts, negative=req.negative_prompt,
                          dtype=req.dtype, image=image, params=pipe.stage_params("encode", req),
                          weights=_fingerprints(pipe, "encode", req), code=code_version("encode", pipe))
    keys["sample"] = _key(stage="sample", inputs=[keys["encode"]], seed=req.seed, height=req.height, width=req.width,
                          frames=req.num_frames, steps=req.steps, guidance=req.guidance,
                          params=pipe.stage_params("sample", req), weights=_fingerprints(pipe, "sample", req),
                          code=code_version("sample", pipe), **_cache_key(req))
    dweights, dcode = _fingerprints(pipe, "decode", req), code_version("decode", pipe)
    for span in decode_plan(req, pipe):
        keys[span.name] = _key(stage=span.name, inputs=[keys["sample"], keys[span.carry_from] if span.carry_from else None],
                               span=[span.kind, span.frames, span.tile, span.inputs],
                               params=pipe.stage_params("decode", req, span), weights=dweights, code=dcode)
    keys["mux"] = _key(stage="mux", inputs=[keys[n] for n in keys if n.startswith("decode/")], fps=req.fps,
                       params=pipe.stage_params("mux", req), code=code_version("mux"))
    return keys


# ------------------------------------------------------------------ dependencies
def inputs_of(stage: str, keys: dict[str, str], plan: dict[str, DecodeSpan]) -> list[str]:
    """The stages whose committed outputs ``stage`` reads."""
    if stage == "encode":
        return []
    if stage == "sample":
        return ["encode"]
    if stage in plan:
        span = plan[stage]
        return ["sample"] + ([span.carry_from] if span.carry_from else [])
    return [n for n in keys if n.startswith("decode/")]


def _plan(req: Request, pipe: Pipeline) -> dict[str, DecodeSpan]:
    return {s.name: s for s in decode_plan(req, pipe)}


class Records:
    """The run's completion records, each read once per instance (fresh from the store)."""

    def __init__(self, run: Run):
        self.run, self._cache, self.statuses = run, {}, {}

    def get(self, stage: str):
        """The record, None if absent, or the CorruptDocument it raised."""
        if stage not in self._cache:
            try:
                self._cache[stage] = self.run.record(stage)
            except CorruptDocument as e:
                self._cache[stage] = e
        return self._cache[stage]

    def digest(self, stage: str) -> str | None:
        rec = self.get(stage)
        return rec.get("digest") if isinstance(rec, dict) else None

    def forget(self, stage: str) -> None:
        self._cache.pop(stage, None)
        self.statuses.clear()  # anything downstream may change with it


# ------------------------------------------------------------------ commit / verify
def committed(run: Run, stage: str, key: str, verify: bool = True, req: Request | None = None, pipe=None) -> bool:
    return stage_status(run, stage, key, verify="quick" if verify else "none", req=req, pipe=pipe) == "done"


def stage_status(run: Run, stage: str, key: str | None, verify: str | bool = "quick", *, req: Request | None = None,
                 pipe: Pipeline | None = None, records: Records | None = None) -> str:
    """done | stale (another key, or an input changed since) | corrupt (a record or output that
    cannot be trusted) | missing.

    ``verify``: "quick" compares the record's object signatures with one listing (no data read);
    "full" also re-reads every output and checks its content digest; "none" trusts the record.
    With ``req``/``pipe`` given, the digests of the inputs the stage was computed from must equal
    its upstream stages' current ones (content-addressed: recompute upstream into different
    content and everything after it is stale)."""
    if verify is True:
        verify = "quick"
    elif verify is False:
        verify = "none"
    records = records or Records(run)
    memo = (stage, key, verify, req is not None)
    if memo not in records.statuses:
        records.statuses[memo] = _status(run, stage, key, verify, req, pipe, records)
    return records.statuses[memo]


def _status(run, stage, key, verify, req, pipe, records) -> str:
    rec = records.get(stage)
    if isinstance(rec, CorruptDocument):
        return "corrupt"
    if rec is None:
        return "missing"
    if not isinstance(rec, dict) or not isinstance(rec.get("outputs"), dict):
        return "corrupt"
    if key is not None and rec.get("key") != key:
        return "stale"
    if req is not None and pipe is not None:
        keys = stage_keys_cached(req, pipe)
        deps = inputs_of(stage, keys, _plan(req, pipe))
        if rec.get("inputs") != {d: records.digest(d) for d in deps}:
            return "stale"
        # everything after a stage that is not done is stale too (it will be recomputed from it)
        if any(stage_status(run, d, keys[d], verify, req=req, pipe=pipe, records=records) != "done" for d in deps):
            return "stale"
    if verify in ("quick", "full"):
        objects = rec.get("objects")
        if not isinstance(objects, dict) or run.objects(*_locations(rec)) != objects:
            return "corrupt"
    if verify == "full" and not _verify_content(run, rec):
        return "corrupt"
    return "done"


def _locations(rec: dict) -> list[str]:
    """Where a record's outputs live (groups and files), for one listing each."""
    return sorted({ref.split("::", 1)[0] for ref in rec.get("outputs", {})})


def _verify_content(run: Run, rec: dict) -> bool:
    """Re-read every output and check its content digest (``vidax status --verify``)."""
    groups = {}
    for ref, digest in rec.get("outputs", {}).items():
        try:
            if "::" in ref:
                gname, aname = ref.split("::", 1)
                g = groups.get(gname) or groups.setdefault(gname, run.group(gname))
                read_array(g, aname, digest)
            else:
                data = run.read_bytes(ref)
                if data is None or hashlib.sha256(data).hexdigest() != digest:
                    return False
        except (DigestMismatch, KeyError, FileNotFoundError, ValueError):
            return False
    return True


_KEYS_CACHE: dict = {}


def stage_keys_cached(req: Request, pipe: Pipeline) -> dict[str, str]:
    k = (id(pipe), json.dumps(req.to_json(), sort_keys=True, default=str))
    if k not in _KEYS_CACHE:
        if len(_KEYS_CACHE) > 64:
            _KEYS_CACHE.clear()
        _KEYS_CACHE[k] = stage_keys(req, pipe)
    return _KEYS_CACHE[k]


@dataclass
class StageResult:
    stage: str
    key: str
    status: str  # ran | skipped
    seconds: float
    hardware: str = ""
    details: dict | None = None


Log = Callable[[str], None]
Progress = Callable[[str, float], None]  # (stage, fraction done)


class CorruptInput(StageError):
    """A stage's committed input does not match its record (detected when read)."""

    def __init__(self, stage: str, message: str):
        self.stage = stage
        super().__init__(message)


def _fault(stage: str, what: str, run_id: str) -> str | None:
    """Fault injection for tests and drills: ``VIDAX_FAULTS="sample:kill_after_step=3,decode/1:fail"``
    (``fail``: raise; ``kill``: SIGKILL the process; ``kill_after_step=N``: SIGKILL after the
    sampling checkpoint of step N); ``RUN@stage:...`` (``b2@decode/1:fail``) only in run ``RUN``."""
    for item in filter(None, os.environ.get("VIDAX_FAULTS", "").split(",")):
        s, _, f = item.partition(":")
        only, _, s = s.rpartition("@")
        if s == stage and f.split("=")[0] == what and only in ("", run_id):
            return f.partition("=")[2] or "1"
    return None


class _Inputs:
    """Reads a stage's inputs, each checked against the content digest its record committed."""

    def __init__(self, run: Run, records: Records):
        self.run, self.records = run, records

    def arrays(self, stage: str, group: str, names=None) -> dict[str, np.ndarray]:
        rec = self.records.get(stage)
        if not isinstance(rec, dict):
            raise CorruptInput(stage, f"{stage} has no readable record")
        outs = rec["outputs"]
        prefix = f"{group}::"
        wanted = sorted(r[len(prefix):] for r in outs if r.startswith(prefix) and "/" not in r[len(prefix):])
        if names is not None:
            missing = [n for n in names if n not in wanted]
            if missing:
                raise CorruptInput(stage, f"{stage} committed no {', '.join(missing)} (it has {', '.join(wanted)})")
            wanted = list(names)
        try:
            g = self.run.group(group)
            return {n: read_array(g, n, outs[prefix + n]) for n in wanted}
        except Exception as e:  # noqa: BLE001 - anything but a transient error means damaged data
            if is_transient(e):
                raise
            raise CorruptInput(stage, f"{stage}'s output in {group} is damaged ({type(e).__name__}: {e})") from None


def _write_named(w, outputs: dict[str, Named], prefix: str, out: dict) -> None:
    for name, t in outputs.items():
        out[f"{prefix}::{name}"] = w.array(name, t.array, tuple(t.dims), **t.attrs)


# ------------------------------------------------------------------ stages
def run_encode(run: Run, req: Request, pipe: Pipeline, key: str, log: Log, inputs: _Inputs) -> dict:
    image = None
    if req.image is not None:
        from stages.images import load_image

        image = load_image(req.image)
    outputs = pipe.encode(req, image)
    w = run.writer("encode.zarr")
    out: dict = {}
    _write_named(w, outputs, "encode.zarr", out)
    w.flush()
    log("  " + ", ".join(f"{n} {list(t.array.shape)} {t.attrs.get('stored_as', t.array.dtype)}"
                         for n, t in outputs.items()))
    if image is not None:
        log(f"  image {image.shape[1]}x{image.shape[0]} -> {req.width}x{req.height}")
    return out


# sampling checkpoints: checkpoints/<step>.zarr (arrays) + checkpoints/<step>.json (the marker,
# written last, holding the key and every array's content digest). Deleting removes the marker first.
def _ckpt_name(step: int) -> str:
    return f"checkpoints/{step:05d}"


def _checkpoint_markers(run: Run) -> list[int]:
    if run.store.local:
        from pathlib import Path as _P

        d = _P(run.path("checkpoints"))
        names = [p.name for p in d.glob("*.json")] if d.is_dir() else []
    else:
        try:
            names = [p.rsplit("/", 1)[-1] for p in run.fs.find(run.path("checkpoints"), maxdepth=1)]
        except FileNotFoundError:
            names = []
        run.counter.add()
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _delete_checkpoint(run: Run, step: int) -> None:
    run.delete(_ckpt_name(step) + ".json")  # the marker first: what is left never looks whole
    run.delete(_ckpt_name(step) + ".zarr")


def _load_checkpoint(run: Run, key: str, log: Log, only: int | None = None) -> dict | None:
    """The newest checkpoint of this key that verifies; damaged ones are skipped with a warning.
    ``only``: that step's checkpoint (the one process 0 chose), or an error."""
    for step in [only] if only is not None else reversed(_checkpoint_markers(run)):
        name = _ckpt_name(step)
        try:
            m = run.read_json(name + ".json")
        except CorruptDocument:
            log(f"  warning: checkpoint marker {name}.json is unreadable; skipped")
            continue
        if not isinstance(m, dict) or m.get("key") != key:
            continue
        try:
            g = run.group(name + ".zarr")
            state = read_array(g, "state", m["digest"])
            return {"step": int(m["step"]), "arrays": unpack(state, m["index"])}
        except (DigestMismatch, KeyError, FileNotFoundError, ValueError, TypeError) as e:
            log(f"  warning: checkpoint {name} fails verification ({type(e).__name__}: {e}); not resumed from")
    if only is not None:
        raise StageError(f"sample: the step checkpoint {_ckpt_name(only)} that process 0 resumes from does not "
                         "verify on this process")
    return None


def run_sample(run: Run, req: Request, pipe: Pipeline, key: str, log: Log, inputs: _Inputs,
               progress: Progress | None = None) -> dict:
    cond = inputs.arrays("encode", "encode.zarr")
    if process_count() == 1:
        resume = _load_checkpoint(run, key, log)
    else:  # every process resumes from the checkpoint process 0 chose
        found = {}

        def choose():
            found["r"] = _load_checkpoint(run, key, log)
            return None if found["r"] is None else found["r"]["step"]

        step = agree("sample-resume", choose)
        resume = found.get("r") if is_leader() else (None if step is None else _load_checkpoint(run, key, log, step))
    if resume is not None:
        log(f"  resuming from the step checkpoint at step {resume['step']}/{req.steps}")
    kill_after = _fault("sample", "kill_after_step", run.run_id)
    every = req.checkpoint_every
    cache = _step_cache(req, pipe)
    if cache is not None and resume is not None:  # the cache's state is part of the checkpoint
        resume = {**resume, "arrays": cache.load(resume["arrays"])}

    def on_step(info, snapshot):
        if cache is not None:
            ev = cache.evaluations
            log(f"  step {info.index + 1}/{info.total}  t={info.timestep:.1f}  {info.seconds:.3f}s  "
                f"DiT {ev['computed']} computed, {ev['skipped']} skipped")
            snapshot = (lambda snap=snapshot: {**snap(), **cache.arrays()})
        else:
            log(f"  step {info.index + 1}/{info.total}  t={info.timestep:.1f}  {info.seconds:.3f}s")
        done = info.index + 1
        if progress is not None:
            progress("sample", done / info.total)
        if done % every == 0 and done < info.total:
            if is_leader():  # process 0 writes the checkpoint (the latents are whole on every process)
                name = _ckpt_name(done)
                flat, index = pack({m: np.asarray(a) for m, a in snapshot().items()})
                c = run.writer(name + ".zarr")
                digest = c.array("state", flat, ("element",), role="sampling checkpoint (latents + scheduler state)")
                c.flush()
                run.write_json(name + ".json", {"key": key, "step": done, "digest": digest, "index": index})
                for old in _checkpoint_markers(run):
                    if old != done:
                        _delete_checkpoint(run, old)
            if kill_after is not None and done >= int(kill_after):
                os.kill(os.getpid(), signal.SIGKILL)

    try:
        outputs = pipe.sample(cond, req, resume=resume, on_step=on_step)
    finally:
        pipe.step_cache = None
    w = run.writer("sample.zarr")
    out: dict = {}
    _write_named(w, outputs, "sample.zarr", out)
    w.flush()
    details = {f"_{k}": v for k, v in pipe.describe().items()}
    if cache is not None:
        details["_dit_evaluations"] = cache.evaluations
        details["_cache"] = cache.cfg.key()
        log(f"  step cache {cache.cfg.method}: {cache.evaluations['computed']} DiT evaluations computed, "
            f"{cache.evaluations['skipped']} skipped")
    return {**out, "_resumed_from_step": resume["step"] if resume else 0, **details}


def _step_cache(req: Request, pipe: Pipeline):
    """The request's step cache, handed to the pipeline for its sample phase (None: no cache)."""
    cs = req.cache_settings()
    if cs is None:
        return None
    from vidax.core.stepcache import StepCache

    if not getattr(pipe, "STEP_CACHE", False):
        raise StageError(f"sample: {req.model} does not run a step cache yet (--cache {cs.method})")
    pipe.step_cache = StepCache(cs, req.steps)
    return pipe.step_cache


def _cleanup_checkpoints(run: Run) -> None:
    for step in _checkpoint_markers(run):
        _delete_checkpoint(run, step)


def run_decode(run: Run, req: Request, pipe: Pipeline, key: str, log: Log, inputs: _Inputs, span: DecodeSpan) -> dict:
    if _fault(span.name, "fail", run.run_id):
        raise StageError(f"{span.name}: injected fault (VIDAX_FAULTS)")
    if _fault(span.name, "kill", run.run_id):
        os.kill(os.getpid(), signal.SIGKILL)
    latents = inputs.arrays("sample", "sample.zarr", span.inputs)
    carry = None
    if span.carry_from is not None:
        prev = inputs.arrays(span.carry_from, f"{span.carry_from}.zarr", ["carry"])["carry"]
        index = inputs.records.get(span.carry_from)["details"]["carry_index"]
        carry = unpack(prev, index)
    outputs, carry = pipe.decode(latents, span, carry, req)
    w = run.writer(f"{span.name}.zarr")
    out: dict = {}
    _write_named(w, outputs, f"{span.name}.zarr", out)
    if carry:
        flat, index = pack({n: np.asarray(v) for n, v in carry.items()})
        out[f"{span.name}.zarr::carry"] = w.array("carry", flat, ("element",),
                                                  role="state handed to the next decode stage, packed")
        out["_carry_index"] = index
        out["_carry_bytes"] = int(flat.nbytes)
    w.flush()
    if span.kind == "video":
        f = outputs["frames"].array
        out["_frames_bytes"] = int(f.nbytes)
        log(f"  latent frames {span.frames[0]}..{span.frames[1] - 1} -> {f.shape[1]} video frames"
            + (f" (carry {flat.nbytes / 2**20:.1f} MiB)" if carry else ""))
    else:
        w = outputs["waveform"]
        log(f"  audio: {w.array.shape[-1]} samples at {w.attrs.get('sample_rate')} Hz")
    return out


def video_names(batch: int) -> list[str]:
    return ["video.mp4"] if batch == 1 else [f"video-{i}.mp4" for i in range(batch)]


def run_mux(run: Run, req: Request, pipe: Pipeline, key: str, log: Log, inputs: _Inputs) -> dict:
    import shutil

    from vidax.video import write_mp4, write_png

    plan = decode_plan(req, pipe)
    parts = [(s, inputs.arrays(s.name, f"{s.name}.zarr", ["frames"])["frames"]) for s in plan if s.kind == "video"]
    frames = pipe.assemble_video(parts)
    audio, rate = None, None
    audio_spans = [s for s in plan if s.kind == "audio"]
    if audio_spans:
        name = audio_spans[0].name
        audio = inputs.arrays(name, f"{name}.zarr", ["waveform"])["waveform"]
        rate = int(run.group(f"{name}.zarr")["waveform"].attrs["sample_rate"])
    tmp = Path(local_tmpdir())
    out = {}
    try:
        for i, name in enumerate(video_names(frames.shape[0])):
            f = frames[i]
            local = write_mp4(f, tmp / name, fps=req.fps, audio=None if audio is None else audio[i], sample_rate=rate)
            strip = np.concatenate([f[0], f[len(f) // 2], f[-1]], axis=1)
            prev = name.replace("video", "preview").replace(".mp4", ".png")
            write_png(strip, tmp / prev)
            run.put_file(tmp / prev, prev)
            run.put_file(local, name)
            out[name] = hashlib.sha256(local.read_bytes()).hexdigest()
            out[prev] = hashlib.sha256((tmp / prev).read_bytes()).hexdigest()
            sound = f", audio {audio.shape[1]} ch @ {rate} Hz" if audio is not None else ""
            log(f"  {frames.shape[1]} frames {f.shape[2]}x{f.shape[1]} @ {req.fps} fps{sound} -> {run.url(name)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------ running a stage
LEASE_SECONDS = float(os.environ.get("VIDAX_LEASE_SECONDS", "120"))


class _Heartbeat:
    """Renews a stage's lease while it computes."""

    def __init__(self, run: Run, stage: str, owner: str, seconds: float):
        self.run, self.stage, self.owner, self.seconds = run, stage, owner, seconds
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self):
        self._t.start()
        return self

    def _loop(self):
        while not self._stop.wait(self.seconds / 3):
            try:
                self.run.renew_lease(self.stage, self.owner, self.seconds)
            except Exception:  # noqa: BLE001 - a missed renewal only shortens the lease
                pass

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=5)
        return False


def _wait_for_other(run: Run, stage: str, key: str, log: Log, req: Request, pipe: Pipeline) -> str:
    """Another worker holds the stage's lease: wait until it commits (-> "done") or its lease
    expires (-> "expired")."""
    log(f"[{stage}] another worker is computing it; waiting for its commit")
    while True:
        lease = run.lease(stage)
        if stage_status(run, stage, key, req=req, pipe=pipe) == "done":
            return "done"
        if lease is None or not lease.live():
            return "expired"
        time.sleep(min(2.0, max(0.2, lease.expires - time.time())))


def run_stage(run: Run, req: Request, pipe: Pipeline, stage: str, keys: dict[str, str], log: Log,
              progress: Progress | None = None, records: Records | None = None, force: bool = True) -> StageResult:
    """Run one stage (inputs must be committed) and commit it. One worker at a time: the stage's
    lease is taken first; if another live worker holds it, this waits for its commit (and reports
    the stage as skipped) or for the lease to expire. ``force=False``: a stage another worker
    committed while this one waited for the lease is not recomputed. A failure while the stage
    runs (a damaged checkpoint, a store that stops answering, an injected fault...) is raised as
    :class:`StageFailed` (one line; the original exception is its ``cause``)."""
    if stage not in keys:
        raise StageError(f"unknown stage {stage!r}; this run has: {', '.join(keys)}")
    records = records or Records(run)
    kind = stage.split("/")[0]
    if kind in ("encode", "sample", "decode"):
        check_memory(req, pipe, (kind,), log)  # before the lease: a stage that cannot fit takes nothing
        # the checkpoint's headers, before the lease too: in distributed mode the parent never fetched
        # a remote checkpoint (the stage's machine does, here), so a damaged one is refused before this
        # stage writes anything (once per process and folder: after generate()'s own check, free)
        check_weights(req, pipe)
    try:
        return _run_stage(run, req, pipe, stage, keys, log, progress, records, force)
    except (CorruptInput, StageFailed):
        raise  # (a damaged input: generate() recomputes it)
    except StageError as e:
        if getattr(e, "_computing", False):
            raise StageFailed(stage, run, e) from e
        raise
    except Exception as e:  # noqa: BLE001 - reported in one line; the cause keeps the traceback
        raise StageFailed(stage, run, e) from e


def _run_stage(run, req, pipe, stage, keys, log, progress, records, force) -> StageResult:
    plan = _plan(req, pipe)
    deps = inputs_of(stage, keys, plan)
    t0 = time.perf_counter()
    if process_count() > 1:
        return _run_stage_multihost(run, req, pipe, stage, keys, log, progress, records, force, plan, deps, t0)
    _check_inputs_committed(run, req, pipe, stage, keys, records, deps)
    owner = uuid.uuid4().hex
    while not run.acquire_lease(stage, owner, LEASE_SECONDS):
        if _wait_for_other(run, stage, keys[stage], log, req, pipe) == "done":
            return _skipped_by_other(run, stage, keys, log, records, t0)
    ok = False
    try:
        # another worker may have committed it between our check and our lease
        records.forget(stage)
        if stage_status(run, stage, keys[stage], req=req, pipe=pipe, records=records) == "done" and not force:
            res = _skipped_by_other(run, stage, keys, log, records, t0)
        else:
            with _Heartbeat(run, stage, owner, LEASE_SECONDS):
                res = _compute(run, req, pipe, stage, keys, log, progress, records, plan, deps)
        ok = True
        return res
    finally:
        try:
            run.release_lease(stage, owner)
        except Exception:  # noqa: BLE001 - after a failure, that failure is the one to report (the lease expires)
            if ok:
                raise


def _check_inputs_committed(run, req, pipe, stage, keys, records, deps) -> None:
    for d in deps:
        if stage_status(run, d, keys[d], req=req, pipe=pipe, records=records) != "done":
            raise StageError(f"stage {stage} needs {d}, which is not committed for this request; run it first")


def _skipped_by_other(run, stage, keys, log, records, t0) -> StageResult:
    records.forget(stage)
    rec = records.get(stage)
    log(f"[{stage}] committed by another worker")
    return StageResult(stage, keys[stage], "skipped", time.perf_counter() - t0,
                       rec.get("hardware", "") if isinstance(rec, dict) else "")


def _run_stage_multihost(run, req, pipe, stage, keys, log, progress, records, force, plan, deps, t0) -> StageResult:
    """``run_stage`` on a multi-host slice: every process computes the stage as one JAX program;
    process 0 alone checks the inputs, holds the lease, writes the outputs and, once every process
    has finished its part, the record. The other processes follow its decisions."""
    owner = uuid.uuid4().hex
    held = {"lease": False}

    def decide() -> str:
        _check_inputs_committed(run, req, pipe, stage, keys, records, deps)
        while not run.acquire_lease(stage, owner, LEASE_SECONDS):
            if _wait_for_other(run, stage, keys[stage], log, req, pipe) == "done":
                return "skip"
        held["lease"] = True
        records.forget(stage)
        if stage_status(run, stage, keys[stage], req=req, pipe=pipe, records=records) == "done" and not force:
            return "skip"
        return "compute"

    try:
        action = agree(f"{stage}:start", decide)
        if action == "skip":
            return _skipped_by_other(run, stage, keys, log, records, t0)
        if is_leader():
            with _Heartbeat(run, stage, owner, LEASE_SECONDS):
                return _compute(run, req, pipe, stage, keys, log, progress, records, plan, deps)
        return _compute(run, req, pipe, stage, keys, log, progress, records, plan, deps)
    finally:
        if held["lease"]:
            run.release_lease(stage, owner)


def _compute(run, req, pipe, stage, keys, log, progress, records, plan, deps) -> StageResult:
    log(f"[{stage}] running")
    try:
        return _compute_and_commit(run, req, pipe, stage, keys, log, progress, records, plan, deps)
    except StageError as e:
        if not isinstance(e, CorruptInput):
            e._computing = True  # (an injected fault, a bad checkpoint marker...): the stage failed
        raise


def _compute_and_commit(run, req, pipe, stage, keys, log, progress, records, plan, deps) -> StageResult:
    if is_leader():
        run.delete_record(stage)  # from here on, whatever is there is uncommitted
    records.forget(stage)
    before = run.counter.snapshot()
    t0, started = time.perf_counter(), now()
    kind = stage.split("/")[0]
    inputs = _Inputs(run, records)
    # compiles: programs compiled vs read from the persistent cache; the stage's garbage (its
    # weights) is freed when it returns, without a walk of the whole process's heap
    with CompileCounter() as compiles, collect_own_garbage():
        if kind == "decode":
            outputs = run_decode(run, req, pipe, keys[stage], log, inputs, plan[stage])
        elif kind == "sample":
            outputs = run_sample(run, req, pipe, keys[stage], log, inputs, progress)
        elif kind == "mux" and not is_leader():
            outputs = {}  # no devices involved: process 0 alone encodes and uploads the video
        else:
            outputs = {"encode": run_encode, "mux": run_mux}[kind](run, req, pipe, keys[stage], log, inputs)
    details = {k[1:]: outputs.pop(k) for k in list(outputs) if k.startswith("_")}
    seconds = time.perf_counter() - t0
    hw = hardware()
    if process_count() > 1:
        barrier(f"{stage}:computed")  # every process has finished its part (and process 0 has written)
        agree(f"{stage}:commit", lambda: _commit(run, stage, keys, kind, pipe, records, deps, outputs, details,
                                                  started, seconds, hw, before, compiles))
        records.forget(stage)
    else:
        _commit(run, stage, keys, kind, pipe, records, deps, outputs, details, started, seconds, hw, before, compiles)
    log(f"[{stage}] committed in {seconds:.2f}s")
    return StageResult(stage, keys[stage], "ran", seconds, hw, details)


def _commit(run, stage, keys, kind, pipe, records, deps, outputs, details, started, seconds, hw, before, compiles):
    """Write the stage's record (last: it is the commit) and drop the sampling checkpoints."""
    rec = {"stage": stage, "key": keys[stage], "status": "done", "started": started, "finished": now(),
           "seconds": round(seconds, 3), "hardware": hw, "outputs": outputs, "code": code_version(kind, pipe),
           "details": details, "inputs": {d: records.digest(d) for d in deps},
           "digest": hashlib.sha256(json.dumps(outputs, sort_keys=True).encode()).hexdigest()}
    rec["objects"] = run.objects(*_locations(rec))
    rec["io"] = IOCounter.delta(before, run.counter.snapshot())
    rec["compile"] = compiles.to_json()
    run.write_record(stage, rec)
    records.forget(stage)
    if kind == "sample":
        _cleanup_checkpoints(run)
    return True


def wanted(run: Run, req: Request, pipe: Pipeline, stage: str, keys: dict[str, str], force: bool = False) -> bool:
    """Whether ``vidax stage`` / the stage task should compute ``stage`` (``force``, or it is not
    committed with its key): one answer, process 0's, for every process of a multi-host job, so
    followers started as ``vidax stage RUN STAGE`` act exactly as process 0 does."""
    return bool(agree(f"{stage}:wanted", lambda: force or not committed(run, stage, keys[stage], req=req, pipe=pipe)))


def check_memory(req: Request, pipe: Pipeline, kinds=("encode", "sample", "decode"), log: Log = print) -> dict | None:
    """The memory plan of ``kinds`` on this process's devices (``stages.plan.check_fits``), once
    per pipeline and kind; raises ``stages.plan.PlanError`` naming a stage that cannot fit. None
    when the devices' memory is unknown (CPU without ``VIDAX_DEVICE_MEMORY``)."""
    from stages.plan import check_fits

    done = pipe.__dict__.setdefault("_memory_checked", {})
    todo = tuple(k for k in kinds if k not in done)
    if todo:
        res = check_fits(req, pipe, todo, log=lambda m: log(m))
        for k in todo:
            done[k] = None if res is None else next(s for s in res["stages"] if s["stage"] == k)
        if res is not None:
            pipe.__dict__["_memory_plan"] = {"devices": res["devices"], "device_memory": res["device_memory"]}
    if not any(done.get(k) for k in done):
        return None
    return {**pipe.__dict__.get("_memory_plan", {}), "stages": [done[k] for k in done if done[k]]}


def check_weights(req: Request, pipe: Pipeline) -> None:
    """The checkpoint's headers against the family's key maps before anything is written
    (:meth:`Pipeline.check_weights`); a remote checkpoint, whose configs alone were read at
    validation, is fetched for it here (its first stage would fetch it next). Raises
    :class:`~stages.request.RequestError` naming the checkpoint."""
    from stages.request import RequestError
    from vidax.pipeline import OptionError

    try:
        pipe.check_weights(req, fetch=True)
    except OptionError as e:
        raise RequestError(e.field, str(e).split(": ", 1)[1]) from None


def write_manifest(run: Run, req: Request, keys: dict[str, str], records: Records | None = None,
                   memory: dict | None = None) -> dict:
    records = records or Records(run)
    stages = []
    for name in keys:
        rec = records.get(name)
        rec = rec if isinstance(rec, dict) else {}
        status = "missing" if not rec else ("done" if rec.get("key") == keys[name] else "stale")
        stages.append({"stage": name, "key": keys[name], "status": status, "seconds": rec.get("seconds"),
                       "hardware": rec.get("hardware"), "finished": rec.get("finished"), "io": rec.get("io")})
    m = {"run_id": run.run_id, "model": req.model, "updated": now(), "code": code_version(), "stages": stages,
         "outputs": [run.url(n) for n in video_names(len(req.prompts))]}
    if memory is not None:
        m["memory_plan"] = memory
    if is_leader():  # process 0 of a multi-host job
        run.write_json("manifest.json", m)
    return m


def generate(run: Run, req: Request, log: Log = print, pipe=None, progress: Progress | None = None) -> list[StageResult]:
    """Run every stage that is not already committed (with a matching key and inputs), in order.
    A committed input found damaged when read is recomputed, and the plan re-checked from the
    start (later stages computed from it may be stale now)."""
    pipe = pipe or make_pipeline(req)
    keys = stage_keys(req, pipe)
    memory = check_memory(req, pipe, log=log)  # refuses, before anything is written, a request that cannot fit
    check_weights(req, pipe)
    if is_leader():
        run.write_json("request.json", req.to_json())
    records = Records(run)
    results: dict[str, StageResult] = {}
    for _ in range(len(keys) + 3):
        try:
            for stage in keys:
                t0 = time.perf_counter()
                # one decision for every process of a multi-host job: process 0's
                status = agree(f"{stage}:status",
                               lambda: stage_status(run, stage, keys[stage], req=req, pipe=pipe, records=records))
                if status == "done":
                    if stage not in results:
                        rec = records.get(stage)
                        results[stage] = StageResult(stage, keys[stage], "skipped", time.perf_counter() - t0,
                                                     rec.get("hardware", "") if isinstance(rec, dict) else "")
                        log(f"[{stage}] up to date, skipped")
                    continue
                if status in ("stale", "corrupt"):
                    log(f"[{stage}] {status}: recomputing")
                results[stage] = run_stage(run, req, pipe, stage, keys, log, progress, records, force=False)
            break
        except CorruptInput as e:
            log(f"[{e.stage}] damaged ({e}); recomputing it")
            if is_leader():
                run.delete_record(e.stage)
            records.forget(e.stage)
    else:
        raise StageError(f"run {run.run_id}: stages kept failing verification; see the log above")
    if not is_leader():
        return [results[s] for s in keys]
    write_manifest(run, req, keys, records, memory or {
        "checked": False, "why": "the devices' memory is not known (CPU); VIDAX_DEVICE_MEMORY=16GiB checks against a size"})
    return [results[s] for s in keys]


# ------------------------------------------------------------------ many runs, phase by phase
PHASES = ("encode", "sample", "decode", "mux")


@dataclass
class BatchItem:
    """One run of :func:`generate_many`: its own run, request, stages, records and keys. After the
    call: ``results`` (stage -> :class:`StageResult`) when it completed, else ``error`` (the
    exception that stopped it; its later stages were not run)."""

    run: Run
    req: Request
    label: str = ""
    pipe: Pipeline | None = None
    keys: dict | None = None
    results: dict | None = None
    error: BaseException | None = None
    memory: dict | None = None
    records: Records | None = None
    damaged: bool = False  # an input found damaged when read: finished alone by generate()

    @property
    def ok(self) -> bool:
        return self.error is None and self.results is not None


def weights_group(req: Request) -> tuple:
    """The runs whose phases share loaded weights: same model, checkpoint (or preset), dtype, mesh,
    offloading and LoRAs."""
    lora = tuple(req.lora) if isinstance(req.lora, (list, tuple)) else req.lora
    return (req.model, req.checkpoint or "", req.preset or "", req.dtype or "", req.mesh or "",
            str(req.offload_chunk_size), lora, req.image is not None)


def generate_many(items: list[BatchItem], log: Log = print, progress: Progress | None = None,
                  phases: tuple[str, ...] = PHASES) -> list[BatchItem]:
    """Run many runs phase by phase: every run's encode stage, then every run's sampling, then
    their decode stages, then their mux. Within a phase the runs are grouped by
    :func:`weights_group` and each group runs inside :class:`vidax.pipeline.phase_weights`, so each
    component is loaded once per group and phase and freed before the next. Every run stays its own
    run (stages, records and keys as :func:`generate` makes them, so its outputs are the same);
    committed stages are skipped (a rerun resumes); a run that fails stops alone (``item.error``).

    ``phases`` a part of :data:`PHASES` (one phase of a distributed batch: ``("decode",)``) runs only
    those phases of runs that already exist (their request written, their manifest left to the
    flow that made them); ``item.results`` then holds those phases' stages."""
    from vidax.pipeline import phase_weights

    whole = tuple(phases) == PHASES
    for it in items:
        it.label = it.label or it.run.run_id
        try:
            it.pipe = it.pipe or make_pipeline(it.req)
            it.keys = stage_keys(it.req, it.pipe)
            it.memory = check_memory(it.req, it.pipe, log=log)
            check_weights(it.req, it.pipe)
            if is_leader() and whole:
                it.run.write_json("request.json", it.req.to_json())
            it.records, it.results = Records(it.run), {}
        except Exception as e:  # noqa: BLE001 - this run fails alone
            it.error = e
            log(f"{it.label}: {describe_error(e)}")
    groups: dict[tuple, list[BatchItem]] = {}
    for it in items:
        if it.error is None:
            groups.setdefault(weights_group(it.req), []).append(it)
    for phase in [p for p in PHASES if p in phases]:
        todo = [(it, s) for g in groups.values() for it in g for s in it.keys if s.split("/")[0] == phase]
        done = 0
        if todo:
            log(f"[{phase}] {len(todo)} stage(s) of {len({id(it) for it, _ in todo})} run(s)")
        for group in groups.values():
            with phase_weights():  # each component once for the group's runs; freed at the end of the phase
                for it in group:
                    for stage in [s for s in it.keys if s.split("/")[0] == phase]:
                        if it.error is not None or it.damaged:
                            break
                        log(f"[{phase} {done + 1}/{len(todo)}] {it.label}: {stage}")
                        try:
                            _batch_stage(it, stage, log, progress)
                        except CorruptInput as e:
                            log(f"{it.label} [{e.stage}] damaged ({e}); the run is finished alone")
                            if is_leader():
                                it.run.delete_record(e.stage)
                            it.damaged = True
                        except Exception as e:  # noqa: BLE001 - this run fails alone
                            it.error = e
                            log(f"{it.label} failed: {describe_error(e)}")
                        else:
                            done += 1
        if todo:
            log(f"[{phase}] {done}/{len(todo)} done")
    for it in items:
        if it.error is not None:
            it.results = None
            continue
        if it.damaged:
            try:
                res = generate(it.run, it.req, log=lambda m, it=it: log(f"{it.label} {m}"), pipe=it.pipe,
                               progress=progress)
                it.results = {r.stage: r for r in res}
            except Exception as e:  # noqa: BLE001
                it.error, it.results = e, None
            continue
        if is_leader() and whole:
            write_manifest(it.run, it.req, it.keys, it.records, it.memory or {
                "checked": False, "why": "the devices' memory is not known (CPU); VIDAX_DEVICE_MEMORY=16GiB checks "
                                         "against a size"})
    return items


def _batch_stage(it: BatchItem, stage: str, log: Log, progress: Progress | None) -> None:
    """One stage of one run of a batch, as :func:`generate` runs it (skipped when committed)."""
    run, req, pipe, keys, records = it.run, it.req, it.pipe, it.keys, it.records
    t0 = time.perf_counter()
    status = agree(f"{stage}:status", lambda: stage_status(run, stage, keys[stage], req=req, pipe=pipe, records=records))
    if status == "done":
        rec = records.get(stage)
        it.results[stage] = StageResult(stage, keys[stage], "skipped", time.perf_counter() - t0,
                                        rec.get("hardware", "") if isinstance(rec, dict) else "")
        log(f"{it.label} [{stage}] up to date, skipped")
        return
    if status in ("stale", "corrupt"):
        log(f"{it.label} [{stage}] {status}: recomputing")
    prog = (lambda which, frac: progress(f"{it.label} {which}", frac)) if progress is not None else None
    it.results[stage] = run_stage(run, req, pipe, stage, keys, lambda m: log(f"{it.label} {m}"), prog, records,
                                  force=False)


def load_request(run: Run) -> Request:
    try:
        d = run.read_json("request.json")
    except CorruptDocument as e:
        raise StageError(f"run {run.run_id!r}: its request.json is unreadable ({e}); start it again with "
                         f"`vidax generate ... --run-id {run.run_id}`") from None
    if d is None:
        raise StageError(f"run {run.run_id!r} not found in {run.store.url}")
    try:
        return Request.from_json(d)
    except (TypeError, ValueError) as e:
        raise StageError(f"run {run.run_id!r}: its request.json does not hold a valid request ({e})") from None
