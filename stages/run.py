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
import gc
import hashlib
import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from stages.request import Request, build_pipeline
from stages.store import Run, checksum, local_tmpdir, read_array, write_array
from vidax.pipeline import DecodeSpan, Named, Pipeline

STAGE_KINDS = ("encode", "sample", "decode", "mux")


class StageError(RuntimeError):
    """A stage cannot run (missing inputs, bad stage name, injected fault...)."""


# ------------------------------------------------------------------ identity
def _source_digest(path: Path) -> str:
    """Digest of a Python file's code: its syntax tree without docstrings, so comment and
    docstring edits do not invalidate stored runs."""
    tree = ast.parse(path.read_bytes())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()


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
    return f"{jax.default_backend()} x{len(devs)} ({devs[0].device_kind}) on {socket.gethostname()}"


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
    return {c: pipe.fingerprint(c) for c in comps}


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
                          code=code_version("sample", pipe))
    dweights, dcode = _fingerprints(pipe, "decode", req), code_version("decode", pipe)
    for span in decode_plan(req, pipe):
        keys[span.name] = _key(stage=span.name, inputs=[keys["sample"], keys[span.carry_from] if span.carry_from else None],
                               span=[span.kind, span.frames, span.tile, span.inputs],
                               params=pipe.stage_params("decode", req, span), weights=dweights, code=dcode)
    keys["mux"] = _key(stage="mux", inputs=[keys[n] for n in keys if n.startswith("decode/")], fps=req.fps,
                       params=pipe.stage_params("mux", req), code=code_version("mux"))
    return keys


# ------------------------------------------------------------------ commit / verify
def committed(run: Run, stage: str, key: str, verify: bool = True) -> bool:
    return stage_status(run, stage, key, verify) == "done"


def stage_status(run: Run, stage: str, key: str | None, verify: bool = True) -> str:
    """done | stale (other key) | corrupt (outputs missing or checksums differ) | missing."""
    rec = run.record(stage)
    if rec is None:
        return "missing"
    if key is not None and rec.get("key") != key:
        return "stale"
    if verify and not _verify_outputs(run, rec):
        return "corrupt"
    return "done"


def _verify_outputs(run: Run, rec: dict) -> bool:
    try:
        groups = {}
        for ref, digest in rec.get("outputs", {}).items():
            if "::" in ref:
                gname, aname = ref.split("::", 1)
                g = groups.get(gname) or groups.setdefault(gname, run.group(gname))
                if checksum(read_array(g, aname)) != digest:
                    return False
            else:
                with run.fs.open(run.path(ref), "rb") as f:
                    if hashlib.sha256(f.read()).hexdigest() != digest:
                        return False
        return True
    except Exception:  # noqa: BLE001 - unreadable output == corrupt
        return False


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


def _fault(stage: str, what: str) -> str | None:
    """Test-only fault switch: VIDAX_FAULTS="sample:kill_after_step=3,decode/1:fail"."""
    for item in filter(None, os.environ.get("VIDAX_FAULTS", "").split(",")):
        s, _, f = item.partition(":")
        if s == stage and f.split("=")[0] == what:
            return f.partition("=")[2] or "1"
    return None


def _write_named(g, outputs: dict[str, Named], prefix: str, out: dict) -> None:
    for name, t in outputs.items():
        out[f"{prefix}::{name}"] = write_array(g, name, t.array, tuple(t.dims), **t.attrs)


def _read_group(run: Run, name: str, arrays=None) -> dict[str, np.ndarray]:
    g = run.group(name)
    return {n: read_array(g, n) for n in (arrays if arrays is not None else sorted(g.array_keys()))}


# ------------------------------------------------------------------ stages
def run_encode(run: Run, req: Request, pipe: Pipeline, key: str, log: Log) -> dict:
    image = None
    if req.image is not None:
        from stages.images import load_image

        image = load_image(req.image)
    outputs = pipe.encode(req, image)
    g = run.group("encode.zarr", "w")
    out: dict = {}
    _write_named(g, outputs, "encode.zarr", out)
    log("  " + ", ".join(f"{n} {list(t.array.shape)} {t.attrs.get('stored_as', t.array.dtype)}"
                         for n, t in outputs.items()))
    if image is not None:
        log(f"  image {image.shape[1]}x{image.shape[0]} -> {req.width}x{req.height}")
    return out


def _ckpt_groups(run: Run):
    try:
        g = run.group("sample.zarr", "a")
    except Exception:  # noqa: BLE001 - unreadable: treated as absent
        return None, []
    names = sorted((n for n in g.group_keys() if n.startswith("ckpt_")), key=lambda n: int(n[5:]))
    return g, names


def run_sample(run: Run, req: Request, pipe: Pipeline, key: str, log: Log, progress: Progress | None = None) -> dict:
    cond = _read_group(run, "encode.zarr")
    # newest committed checkpoint of *this* key, if any
    resume = None
    g, names = _ckpt_groups(run)
    for n in reversed(names):
        a = g[n].attrs
        if a.get("key") == key and a.get("committed"):
            c = g[n]
            resume = {"step": int(a["next_step"]), "arrays": {m: read_array(c, m) for m in c.array_keys()}}
            break
    if resume is None or g is None:
        g = run.group("sample.zarr", "w")  # nothing reusable: start clean
    else:
        for n in names:  # drop checkpoints of other keys
            if g[n].attrs.get("key") != key:
                run.delete(f"sample.zarr/{n}")
        log(f"  resuming from the step checkpoint at step {resume['step']}/{req.steps}")
    kill_after = _fault("sample", "kill_after_step")
    every = req.checkpoint_every

    def on_step(info, snapshot):
        log(f"  step {info.index + 1}/{info.total}  t={info.timestep:.1f}  {info.seconds:.3f}s")
        done = info.index + 1
        if progress is not None:
            progress("sample", done / info.total)
        if done % every == 0 and done < info.total:
            name = f"ckpt_{done:05d}"
            c = g.create_group(name, overwrite=True)
            for m, arr in snapshot().items():
                arr = np.asarray(arr)
                write_array(c, m, arr, tuple(f"d{j}" for j in range(arr.ndim)))
            c.attrs.update({"key": key, "next_step": done, "committed": True})
            for old in [n for n in g.group_keys() if n.startswith("ckpt_") and n != name]:
                run.delete(f"sample.zarr/{old}")
            if kill_after is not None and done >= int(kill_after):
                os.kill(os.getpid(), signal.SIGKILL)

    outputs = pipe.sample(cond, req, resume=resume, on_step=on_step)
    out: dict = {}
    _write_named(g, outputs, "sample.zarr", out)
    for n in [n for n in g.group_keys() if n.startswith("ckpt_")]:
        run.delete(f"sample.zarr/{n}")
    details = {f"_{k}": v for k, v in pipe.describe().items()}
    return {**out, "_resumed_from_step": resume["step"] if resume else 0, **details}


def run_decode(run: Run, req: Request, pipe: Pipeline, key: str, log: Log, span: DecodeSpan) -> dict:
    if _fault(span.name, "fail"):
        raise StageError(f"{span.name}: injected fault (VIDAX_FAULTS)")
    latents = _read_group(run, "sample.zarr", span.inputs)
    carry = None
    if span.carry_from is not None:
        prev = run.group(f"{span.carry_from}.zarr")
        carry = {n: read_array(prev["cache"], n) for n in prev["cache"].array_keys()}
    outputs, carry = pipe.decode(latents, span, carry, req)
    g = run.group(f"{span.name}.zarr", "w")
    out: dict = {}
    _write_named(g, outputs, f"{span.name}.zarr", out)
    if carry:
        cg = g.create_group("cache")
        for n, v in carry.items():
            v = np.asarray(v)
            out[f"{span.name}.zarr::cache/{n}"] = write_array(cg, n, v, tuple(f"d{j}" for j in range(v.ndim)),
                                                              role="state handed to the next decode stage")
    if span.kind == "video":
        f = outputs["frames"].array
        log(f"  latent frames {span.frames[0]}..{span.frames[1] - 1} -> {f.shape[1]} video frames")
    else:
        w = outputs["waveform"]
        log(f"  audio: {w.array.shape[-1]} samples at {w.attrs.get('sample_rate')} Hz")
    return out


def video_names(batch: int) -> list[str]:
    return ["video.mp4"] if batch == 1 else [f"video-{i}.mp4" for i in range(batch)]


def run_mux(run: Run, req: Request, pipe: Pipeline, key: str, log: Log) -> dict:
    from vidax.video import write_mp4, write_png

    plan = decode_plan(req, pipe)
    parts = [(s, read_array(run.group(f"{s.name}.zarr"), "frames")) for s in plan if s.kind == "video"]
    frames = pipe.assemble_video(parts)
    audio, rate = None, None
    audio_spans = [s for s in plan if s.kind == "audio"]
    if audio_spans:
        g = run.group(f"{audio_spans[0].name}.zarr")
        audio, rate = read_array(g, "waveform"), int(g["waveform"].attrs["sample_rate"])
    tmp = Path(local_tmpdir())
    out = {}
    for i, name in enumerate(video_names(frames.shape[0])):
        f = frames[i]
        local = write_mp4(f, tmp / name, fps=req.fps, audio=None if audio is None else audio[i], sample_rate=rate)
        strip = np.concatenate([f[0], f[len(f) // 2], f[-1]], axis=1)
        prev = name.replace("video", "preview").replace(".mp4", ".png")
        write_png(strip, tmp / prev)
        run.put_file(tmp / prev, prev)
        run.put_file(local, name)
        out[name] = hashlib.sha256(local.read_bytes()).hexdigest()
        sound = f", audio {audio.shape[1]} ch @ {rate} Hz" if audio is not None else ""
        log(f"  {frames.shape[1]} frames {f.shape[2]}x{f.shape[1]} @ {req.fps} fps{sound} -> {run.url(name)}")
    return out


def run_stage(run: Run, req: Request, pipe: Pipeline, stage: str, keys: dict[str, str], log: Log,
              progress: Progress | None = None) -> StageResult:
    """Run one stage unconditionally (inputs must be committed) and commit it."""
    if stage not in keys:
        raise StageError(f"unknown stage {stage!r}; this run has: {', '.join(keys)}")
    plan = {s.name: s for s in decode_plan(req, pipe)}
    for d in _inputs(stage, keys, plan):
        if not committed(run, d, keys[d]):
            raise StageError(f"stage {stage} needs {d}, which is not committed for this request; run it first")
    log(f"[{stage}] running")
    run.delete_record(stage)  # from here on, whatever is there is uncommitted
    t0, started = time.perf_counter(), now()
    kind = stage.split("/")[0]
    if kind == "decode":
        outputs = run_decode(run, req, pipe, keys[stage], log, plan[stage])
    elif kind == "sample":
        outputs = run_sample(run, req, pipe, keys[stage], log, progress)
    else:
        outputs = {"encode": run_encode, "mux": run_mux}[kind](run, req, pipe, keys[stage], log)
    details = {k[1:]: outputs.pop(k) for k in list(outputs) if k.startswith("_")}
    gc.collect()
    seconds = time.perf_counter() - t0
    hw = hardware()
    kind_code = code_version(kind, pipe)
    run.write_record(stage, {"stage": stage, "key": keys[stage], "status": "done", "started": started,
                             "finished": now(), "seconds": round(seconds, 3), "hardware": hw,
                             "outputs": outputs, "code": kind_code, "details": details})
    log(f"[{stage}] committed in {seconds:.2f}s")
    return StageResult(stage, keys[stage], "ran", seconds, hw, details)


def _inputs(stage: str, keys: dict[str, str], plan: dict[str, DecodeSpan]) -> list[str]:
    if stage == "encode":
        return []
    if stage == "sample":
        return ["encode"]
    if stage in plan:
        span = plan[stage]
        return ["sample"] + ([span.carry_from] if span.carry_from else [])
    return [n for n in keys if n.startswith("decode/")]


def write_manifest(run: Run, req: Request, keys: dict[str, str]) -> dict:
    stages = []
    for name in keys:
        rec = run.record(name) or {}
        status = "missing" if not rec else ("done" if rec.get("key") == keys[name] else "stale")
        stages.append({"stage": name, "key": keys[name], "status": status, "seconds": rec.get("seconds"),
                       "hardware": rec.get("hardware"), "finished": rec.get("finished")})
    m = {"run_id": run.run_id, "model": req.model, "updated": now(), "code": code_version(), "stages": stages,
         "outputs": [run.url(n) for n in video_names(len(req.prompts))]}
    run.write_json("manifest.json", m)
    return m


def generate(run: Run, req: Request, log: Log = print, pipe=None, progress: Progress | None = None) -> list[StageResult]:
    """Run every stage that is not already committed with a matching key, in order."""
    pipe = pipe or make_pipeline(req)
    keys = stage_keys(req, pipe)
    run.write_json("request.json", req.to_json())
    results = []
    for stage in keys:
        t0 = time.perf_counter()
        if committed(run, stage, keys[stage]):
            results.append(StageResult(stage, keys[stage], "skipped", time.perf_counter() - t0,
                                       (run.record(stage) or {}).get("hardware", "")))
            log(f"[{stage}] up to date, skipped")
            continue
        results.append(run_stage(run, req, pipe, stage, keys, log, progress))
        write_manifest(run, req, keys)
    write_manifest(run, req, keys)
    return results


def load_request(run: Run) -> Request:
    d = run.read_json("request.json")
    if d is None:
        raise StageError(f"run {run.run_id!r} not found in {run.store.url}")
    return Request.from_json(d)
