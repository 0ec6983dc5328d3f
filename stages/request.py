"""A generation request: the user's settings, validated before anything runs."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from vidax import registry

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RequestError(ValueError):
    """A request field is invalid. ``field`` names it; the message says what is allowed."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


@dataclass
class Request:
    model: str = "wan2.1-t2v-1.3b"
    prompt: str | list[str] = ""
    negative_prompt: str | None = None
    preset: str | None = "tiny"
    checkpoint: str | None = None
    seed: int = 0
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    steps: int | None = None
    guidance: float | None = None
    shift: float | None = None
    scheduler: str | None = None
    fps: float | None = None
    decode_stages: int | None = None  # None: one stage per group of latent frames (see plan)
    checkpoint_every: int = 5  # sampling step checkpoint interval
    dtype: str = "float32"
    image: str | None = None  # conditioning image (path or fsspec URL) for image-to-video models
    guidance_2: float | None = None  # low-noise expert's guidance (two-expert models)
    mesh: str | None = None  # e.g. "dp=2,tp=2,sp=2", "auto" (the recipe's default for the devices), None: one device
    offload_chunk_size: str | int | None = None  # stream the DiT blocks in chunks of N blocks ("all": one chunk)

    # ---------------------------------------------------------------- derived
    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def resolved(self) -> "Request":
        """A copy with the model's (and preset's) defaults filled in."""
        recipe = registry.get(self.model)
        s = recipe.settings(None if self.checkpoint else self.preset,
                            height=self.height, width=self.width, num_frames=self.num_frames, steps=self.steps,
                            guidance=self.guidance, shift=self.shift, scheduler=self.scheduler, fps=self.fps)
        from_image = self.image is not None and self.height is None and self.width is None
        return dataclasses.replace(
            self, height=None if from_image else s.get("height"), width=None if from_image else s.get("width"),
            num_frames=s["num_frames"], steps=s["steps"], guidance=s["guidance"], shift=s.get("shift"),
            scheduler=s.get("scheduler", "unipc"), fps=s["fps"], guidance_2=s.get("guidance_2"),
            preset=None if self.checkpoint else self.preset,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Request":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise RequestError(unknown[0], f"unknown request field; known fields: {', '.join(sorted(names))}")
        return cls(**d)

    def default_run_id(self) -> str:
        """Deterministic: the same request names the same run (so repeating it resumes/skips)."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.prompts[0].lower()).strip("-")[:32].strip("-") or "run"
        h = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:10]
        return f"{slug}-{h}"


def validate(req: Request) -> Request:
    """Check every field; return the resolved request or raise :class:`RequestError`."""
    try:
        recipe = registry.get(req.model)
    except ValueError:
        raise RequestError("model", f"unknown model {req.model!r}; available: {', '.join(sorted(registry.MODELS))}") from None
    if req.checkpoint:
        if not Path(req.checkpoint).is_dir():
            raise RequestError("checkpoint", f"{req.checkpoint!r} is not a folder")
    elif req.preset not in recipe.presets:
        raise RequestError("preset", f"{req.preset!r} is not a preset of {req.model}; presets: {', '.join(recipe.presets)}")
    prompts = req.prompts
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        raise RequestError("prompt", "must be a non-empty string")
    if req.negative_prompt is not None and not isinstance(req.negative_prompt, str):
        raise RequestError("negative_prompt", "must be a string")
    if recipe.image == "required" and not req.image:
        raise RequestError("image", f"{req.model} is an image-to-video model: give the first frame (--image PATH|URL)")
    if recipe.image == "none" and req.image:
        i2v = sorted(m for m, r in registry.MODELS.items() if r.image != "none")
        raise RequestError("image", f"{req.model} takes no image; image-to-video models: {', '.join(i2v)}")
    r = req.resolved()
    sf, tf = recipe.spatial_factor, recipe.temporal_factor
    if r.image:
        from stages.images import image_size

        try:
            ih, iw = image_size(r.image)
        except Exception as e:  # noqa: BLE001 - unreadable / not an image
            raise RequestError("image", f"cannot read {r.image!r} as an image ({type(e).__name__}: {e})") from None
        if r.height is None or r.width is None:
            from stages.images import fit_size_for

            area = recipe.settings(None if r.checkpoint else r.preset).get("area", 480 * 832)
            h, w = fit_size_for(ih, iw, area, sf, sp=_sp_degree(r.mesh))
            r = dataclasses.replace(r, height=h, width=w)
    for name in ("height", "width"):
        v = getattr(r, name)
        if not isinstance(v, int) or v <= 0 or v % sf:
            raise RequestError(name, f"{v!r} is not a positive multiple of {sf} (the model's spatial factor); "
                                     f"nearest: {max(sf, round((v or 0) / sf) * sf) if isinstance(v, int) else sf}")
    n = r.num_frames
    if not isinstance(n, int) or n < 1 or (n - 1) % tf:
        near = max(1, round(((n or 1) - 1) / tf) * tf + 1) if isinstance(n, int) else 1 + tf
        raise RequestError("num_frames", f"{n!r} frames cannot be decoded by this VAE: use {tf}k+1 (e.g. {near})")
    if not isinstance(r.steps, int) or r.steps < 1:
        raise RequestError("steps", f"{r.steps!r}: must be an integer >= 1")
    if not isinstance(r.guidance, (int, float)) or r.guidance < 0:
        raise RequestError("guidance", f"{r.guidance!r}: must be a number >= 0")
    if not isinstance(r.seed, int) or r.seed < 0:
        raise RequestError("seed", f"{r.seed!r}: must be an integer >= 0")
    if r.scheduler not in ("unipc", "flow_euler", "flow_euler_sde"):
        raise RequestError("scheduler", f"{r.scheduler!r}: choose unipc, flow_euler or flow_euler_sde")
    if r.fps is None or r.fps <= 0:
        raise RequestError("fps", f"{r.fps!r}: must be > 0")
    lat = (n - 1) // tf + 1
    if r.decode_stages is not None and not (1 <= r.decode_stages <= lat):
        raise RequestError("decode_stages", f"{r.decode_stages!r}: must be between 1 and {lat} (the latent frame count)")
    if not isinstance(r.checkpoint_every, int) or r.checkpoint_every < 1:
        raise RequestError("checkpoint_every", f"{r.checkpoint_every!r}: must be an integer >= 1")
    if r.dtype not in ("float32", "bfloat16"):
        raise RequestError("dtype", f"{r.dtype!r}: choose float32 or bfloat16")
    if r.mesh not in (None, "auto"):
        from vidax.core.mesh import parse_mesh_spec

        try:
            parse_mesh_spec(r.mesh)
        except ValueError as e:
            raise RequestError("mesh", f"{r.mesh!r}: {e}; e.g. dp=1,tp=4,sp=2 or auto") from None
    if r.offload_chunk_size is not None:
        v = r.offload_chunk_size
        if not (v == "all" or (str(v).isdigit() and int(v) >= 1)):
            raise RequestError("offload_chunk_size", f"{v!r}: a number of blocks >= 1, or all")
        if v != "all":
            r = dataclasses.replace(r, offload_chunk_size=int(v))
    return r


def _sp_degree(mesh: str | None) -> int:
    if not mesh or mesh == "auto":
        return 1
    from vidax.core.mesh import parse_mesh_spec

    try:
        return int(parse_mesh_spec(mesh).get("sp", 1))
    except ValueError:
        return 1


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id) or ".." in run_id:
        raise RequestError("run_id", f"{run_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return run_id
