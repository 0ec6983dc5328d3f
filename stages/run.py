"""The stages of a run and the plan that ties them together.

    encode -> sample -> decode/0 .. decode/N-1 -> mux

Each stage reads its inputs from the run store, writes its outputs, and commits by writing its
completion record last. A stage's key hashes its inputs' keys, its parameters, the weights'
fingerprint and the code version; a committed stage whose key matches (and whose checksums verify)
is skipped, anything else reruns.
"""
from __future__ import annotations

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

from stages.request import Request
from stages.store import Run, checksum, local_tmpdir, read_array, write_array

STAGE_KINDS = ("encode", "sample", "decode", "mux")


class StageError(RuntimeError):
    """A stage cannot run (missing inputs, bad stage name, injected fault...)."""


# ------------------------------------------------------------------ identity
@lru_cache(maxsize=1)
def code_version() -> str:
    import vidax

    h = hashlib.sha256()
    roots = [Path(vidax.__file__).parent, Path(__file__).parent]
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            h.update(f.relative_to(root.parent).as_posix().encode())
            h.update(f.read_bytes())
    return f"{vidax.__version__}+{h.hexdigest()[:12]}"


def _key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def hardware() -> str:
    import jax

    devs = jax.devices()
    return f"{jax.default_backend()} x{len(devs)} ({devs[0].device_kind}) on {socket.gethostname()}"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------ plan
def latent_frames(req: Request) -> int:
    return (req.num_frames - 1) // 4 + 1


def decode_ranges(req: Request) -> list[tuple[int, int]]:
    """Split the latent frames into contiguous decode stages (default: up to 4 stages)."""
    n = latent_frames(req)
    k = req.decode_stages or min(n, 4)
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


def stage_names(req: Request) -> list[str]:
    return ["encode", "sample"] + [f"decode/{k}" for k in range(len(decode_ranges(req)))] + ["mux"]


def make_pipeline(req: Request):
    """The model pipeline for a request (configs only: weights load inside each stage)."""
    from vidax import registry

    recipe = registry.get(req.model)
    has_image = req.image is not None
    cls = recipe.pipeline_class(has_image)
    source = recipe.source(req.preset, req.checkpoint, has_image)
    mesh = req.mesh
    if mesh == "auto":
        import jax

        probe = cls(source, dtype=req.dtype)
        dc = probe.dit_config()
        pt, ph, pw = dc.patch_size
        tokens = (latent_frames(req) // pt) * (req.height // 8 // ph) * (req.width // 8 // pw)
        mesh = recipe.default_mesh(jax.device_count(), dc.num_heads, tokens, req.guidance > 1.0)
    return cls(source, dtype=req.dtype, mesh=mesh, offload_chunk_size=req.offload_chunk_size)


def stage_keys(req: Request, pipe) -> dict[str, str]:
    code = code_version()
    keys = {}
    image = None
    if req.image is not None:
        from stages.images import image_digest

        image = dict(digest=image_digest(req.image), height=req.height, width=req.width, frames=req.num_frames,
                     weights=pipe.fingerprint("image"), vae=pipe.fingerprint("vae"))
    keys["encode"] = _key(stage="encode", model=req.model, prompts=req.prompts, negative=req.negative_prompt,
                          dtype=req.dtype, weights=pipe.fingerprint("text"), image=image, code=code)
    keys["sample"] = _key(stage="sample", inputs=[keys["encode"]], seed=req.seed, height=req.height, width=req.width,
                          frames=req.num_frames, steps=req.steps, guidance=req.guidance, guidance_2=req.guidance_2,
                          shift=req.shift, scheduler=req.scheduler, weights=pipe.fingerprint("dit"), code=code)
    prev = None
    for k, (a, b) in enumerate(decode_ranges(req)):
        name = f"decode/{k}"
        keys[name] = _key(stage=name, inputs=[keys["sample"], prev], frames=[a, b],
                          weights=pipe.fingerprint("vae"), code=code)
        prev = keys[name]
    keys["mux"] = _key(stage="mux", inputs=[keys[n] for n in keys if n.startswith("decode/")], fps=req.fps, code=code)
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


# ------------------------------------------------------------------ stages
def run_encode(run: Run, req: Request, pipe, key: str, log: Log) -> dict:
    tok = pipe.load_tokenizer()
    enc = pipe.load_text_encoder()
    cond = pipe.encode_prompts(req.prompts, tok, enc)
    neg = req.negative_prompt if req.negative_prompt is not None else ""
    uncond = pipe.encode_prompts([neg] * len(req.prompts), tok, enc)
    del enc
    dt = np.dtype(pipe.dtype) if req.dtype == "float32" else np.dtype("bfloat16")
    g = run.group("encode.zarr", "w")
    attrs = dict(model=req.model, computed_in="float32", stored_as=str(dt))
    dims = ("batch", "token", "channel")
    out = {
        "encode.zarr::prompt_embeds": write_array(g, "prompt_embeds", cond.astype(dt), dims, **attrs),
        "encode.zarr::negative_embeds": write_array(g, "negative_embeds", uncond.astype(dt), dims, **attrs),
    }
    log(f"  encoded {len(req.prompts)} prompt(s) -> {list(cond.shape)} {dt}")
    if req.image is not None:
        from stages.images import load_image

        img = load_image(req.image)
        cond_img = pipe.encode_image(img, req.height, req.width, req.num_frames)
        for name, arr in cond_img.items():
            dims = ("batch", "token", "channel") if arr.ndim == 3 else ("batch", "channel", "frame", "height", "width")
            out[f"encode.zarr::image_{name}"] = write_array(g, f"image_{name}", arr.astype(np.float32), dims,
                                                           source=req.image, role=f"image conditioning ({name})")
        log(f"  image {img.shape[1]}x{img.shape[0]} -> {req.width}x{req.height}: {', '.join(sorted(cond_img))}")
    return out


def _ckpt_groups(run: Run):
    try:
        g = run.group("sample.zarr", "a")
    except Exception:  # noqa: BLE001 - unreadable: treated as absent
        return None, []
    names = sorted((n for n in g.group_keys() if n.startswith("ckpt_")), key=lambda n: int(n[5:]))
    return g, names


def run_sample(run: Run, req: Request, pipe, key: str, log: Log, progress: Progress | None = None) -> dict:
    import jax

    enc = run.group("encode.zarr")
    cond = read_array(enc, "prompt_embeds")
    uncond = read_array(enc, "negative_embeds") if max(req.guidance, req.guidance_2 or 0.0) > 1.0 else None
    image_cond = {n[len("image_"):]: read_array(enc, n) for n in enc.array_keys() if n.startswith("image_")} or None
    # newest committed checkpoint of *this* key, if any
    start, latents, state_leaves = 0, None, None
    g, names = _ckpt_groups(run)
    for n in reversed(names):
        a = g[n].attrs
        if a.get("key") == key and a.get("committed"):
            c = g[n]
            start = int(a["next_step"])
            latents = read_array(c, "latents")
            state_leaves = [read_array(c, f"state_{i}") for i in range(int(a["state_leaves"]))]
            break
    if start == 0 or g is None:
        g = run.group("sample.zarr", "w")  # nothing reusable: start clean
    else:
        for n in names:  # drop checkpoints of other keys
            if g[n].attrs.get("key") != key:
                run.delete(f"sample.zarr/{n}")
    sched = pipe.scheduler(req.steps, req.scheduler, req.shift)
    state = None
    if state_leaves is not None:
        template = sched.init_state(jax.numpy.zeros(latents.transpose(0, 2, 3, 4, 1).shape, jax.numpy.float32))
        treedef = jax.tree.structure(template)
        state = jax.tree.unflatten(treedef, state_leaves)
        log(f"  resuming from the step checkpoint at step {start}/{req.steps}")
    kill_after = _fault("sample", "kill_after_step")
    every = req.checkpoint_every

    def on_step(info, x, st):
        log(f"  step {info.index + 1}/{info.total}  t={info.timestep:.1f}  {info.seconds:.2f}s")
        done = info.index + 1
        if progress is not None:
            progress("sample", done / info.total)
        if done % every == 0 and done < info.total:
            name = f"ckpt_{done:05d}"
            c = g.create_group(name, overwrite=True)
            write_array(c, "latents", np.asarray(x).transpose(0, 4, 1, 2, 3), ("batch", "channel", "frame", "height", "width"))
            leaves = jax.tree.leaves(st)
            for i, leaf in enumerate(leaves):
                arr = np.asarray(leaf)
                write_array(c, f"state_{i}", arr, tuple(f"d{j}" for j in range(arr.ndim)))
            c.attrs.update({"key": key, "next_step": done, "state_leaves": len(leaves), "committed": True})
            for old in [n for n in g.group_keys() if n.startswith("ckpt_") and n != name]:
                run.delete(f"sample.zarr/{old}")
            if kill_after is not None and done >= int(kill_after):
                os.kill(os.getpid(), signal.SIGKILL)

    lat = pipe.sample(cond, uncond, latents=latents, seed=req.seed, height=req.height, width=req.width,
                      num_frames=req.num_frames, steps=req.steps, guidance=req.guidance, scheduler=sched,
                      start=start, state=state, on_step=on_step, **_image_kwargs(image_cond, req))
    digest = write_array(g, "latents", lat, ("batch", "channel", "frame", "height", "width"),
                         model=req.model, layout="reference [B, C, F, H, W]", normalised=True)
    for n in [n for n in g.group_keys() if n.startswith("ckpt_")]:
        run.delete(f"sample.zarr/{n}")
    return {"sample.zarr::latents": digest, "_resumed_from_step": start, "_mesh": pipe.mesh,
            "_offload_chunk_size": pipe.offload_chunk_size}


def _image_kwargs(image_cond, req: Request) -> dict:
    kw = {}
    if image_cond is not None:
        kw["image_cond"] = image_cond
    if req.guidance_2 is not None:
        kw["guidance_2"] = req.guidance_2
    return kw


def run_decode(run: Run, req: Request, pipe, key: str, log: Log, k: int) -> dict:
    if _fault(f"decode/{k}", "fail"):
        raise StageError(f"decode/{k}: injected fault (VIDAX_FAULTS)")
    a, b = decode_ranges(req)[k]
    lat = read_array(run.group("sample.zarr"), "latents")
    cache = None
    if k > 0:
        prev = run.group(f"decode/{k - 1}.zarr")
        cache = {n: read_array(prev["cache"], n) for n in prev["cache"].array_keys()}
    vae = pipe.load_vae()
    frames, cache = pipe.decode_frames(lat, a, b, cache, vae=vae)
    del vae
    g = run.group(f"decode/{k}.zarr", "w")
    out = {f"decode/{k}.zarr::frames": write_array(g, "frames", frames, ("batch", "frame", "height", "width", "rgb"),
                                                  latent_frames=[a, b], units="uint8 RGB")}
    cg = g.create_group("cache")
    for n, v in cache.items():
        out[f"decode/{k}.zarr::cache/{n}"] = write_array(cg, n, v, tuple(f"d{j}" for j in range(v.ndim)),
                                                        role="causal-conv cache handed to the next decode stage")
    log(f"  latent frames {a}..{b - 1} -> {frames.shape[1]} video frames")
    return out


def video_names(batch: int) -> list[str]:
    return ["video.mp4"] if batch == 1 else [f"video-{i}.mp4" for i in range(batch)]


def run_mux(run: Run, req: Request, pipe, key: str, log: Log) -> dict:
    from vidax.video import write_mp4, write_png

    parts = [read_array(run.group(f"decode/{k}.zarr"), "frames") for k in range(len(decode_ranges(req)))]
    frames = np.concatenate(parts, axis=1)
    tmp = Path(local_tmpdir())
    out = {}
    for i, name in enumerate(video_names(frames.shape[0])):
        local = write_mp4(frames[i], tmp / name, fps=req.fps)
        f = frames[i]
        strip = np.concatenate([f[0], f[len(f) // 2], f[-1]], axis=1)
        prev = name.replace("video", "preview").replace(".mp4", ".png")
        write_png(strip, tmp / prev)
        run.put_file(tmp / prev, prev)
        run.put_file(local, name)
        out[name] = hashlib.sha256(local.read_bytes()).hexdigest()
        log(f"  {frames.shape[1]} frames {f.shape[2]}x{f.shape[1]} @ {req.fps} fps -> {run.url(name)}")
    return out


def run_stage(run: Run, req: Request, pipe, stage: str, keys: dict[str, str], log: Log,
              progress: Progress | None = None) -> StageResult:
    """Run one stage unconditionally (inputs must be committed) and commit it."""
    if stage not in keys:
        raise StageError(f"unknown stage {stage!r}; this run has: {', '.join(keys)}")
    deps = _inputs(stage, keys)
    for d in deps:
        if not committed(run, d, keys[d]):
            raise StageError(f"stage {stage} needs {d}, which is not committed for this request; run it first")
    log(f"[{stage}] running")
    run.delete_record(stage)  # from here on, whatever is there is uncommitted
    t0, started = time.perf_counter(), now()
    kind = stage.split("/")[0]
    if kind == "decode":
        outputs = run_decode(run, req, pipe, keys[stage], log, int(stage.split("/")[1]))
    elif kind == "sample":
        outputs = run_sample(run, req, pipe, keys[stage], log, progress)
    else:
        outputs = {"encode": run_encode, "mux": run_mux}[kind](run, req, pipe, keys[stage], log)
    details = {k[1:]: outputs.pop(k) for k in list(outputs) if k.startswith("_")}
    gc.collect()
    seconds = time.perf_counter() - t0
    hw = hardware()
    run.write_record(stage, {"stage": stage, "key": keys[stage], "status": "done", "started": started,
                             "finished": now(), "seconds": round(seconds, 3), "hardware": hw,
                             "outputs": outputs, "code": code_version(), "details": details})
    log(f"[{stage}] committed in {seconds:.2f}s")
    return StageResult(stage, keys[stage], "ran", seconds, hw, details)


def _inputs(stage: str, keys: dict[str, str]) -> list[str]:
    if stage == "encode":
        return []
    if stage == "sample":
        return ["encode"]
    if stage.startswith("decode/"):
        k = int(stage.split("/")[1])
        return ["sample"] + ([f"decode/{k - 1}"] if k > 0 else [])
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
