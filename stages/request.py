"""A generation request: the user's settings, validated before anything runs.

The fields here are the ones every family shares; a family's own settings (a flow shift, a second
expert's guidance, an audio switch...) are its declared options (:class:`vidax.pipeline.Option`),
kept in ``Request.options`` and validated from their declarations. In JSON (request files,
prompt-file lines, flow parameters) an option may be given flat, beside the common fields.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field

from vidax import registry
from vidax.pipeline import OptionError

CACHE_FIELDS = ("cache", "cache_threshold", "cache_max_skips", "cache_retention", "cache_ratios", "cache_interval",
                "cache_warmup", "cache_order")
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_SEED = 2**32 - 1  # JAX's PRNG keys take 32-bit seeds without x64: larger ones would alias
MAX_GUIDANCE = 100.0
MAX_STEPS = 1000
MAX_FPS = 240.0
MAX_PROMPT_CHARS = 20_000
MIN_IMAGE_SIDE = 16  # pixels (or the VAE's spatial factor, if larger)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class RequestError(ValueError):
    """A request field is invalid. ``field`` names it; the message says what is allowed."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


@dataclass
class Request:
    model: str = field(default_factory=registry.default_model)
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
    fps: float | None = None
    decode_stages: int | None = None  # None: the family's default decode plan
    checkpoint_every: int = 5  # sampling step checkpoint interval
    dtype: str | None = None  # the DiT's weights/activations; None: the recipe's (bfloat16 for large releases)
    image: str | None = None  # conditioning image (path or fsspec URL) for image-to-video models
    mesh: str | None = None  # e.g. "dp=2,tp=2,sp=2", "auto" (the recipe's default for the devices), None: one device
    offload_chunk_size: str | int | None = None  # stream the DiT blocks in chunks of N blocks ("all": one chunk)
    lora: str | list[str] | None = None  # LoRA adapters: "[high=|low=]FILE[:SCALE]", one or a list
    options: dict = field(default_factory=dict)  # the model family's declared options (see the recipe)
    # step caching (vidax.core.stepcache): fewer DiT evaluations; None / "none": every step computed
    cache: str | None = None  # fbcache | magcache (| taylorseer | teacache: not implemented yet)
    cache_threshold: float | None = None  # None: the method's default
    cache_max_skips: int | None = None  # magcache: most steps skipped in a row (default 3)
    cache_retention: float | None = None  # magcache: fraction of the first steps always computed (default 0.2)
    cache_ratios: str | list | None = None  # magcache: calibrated ratios (a list, or a JSON file from vidax calibrate)
    cache_interval: int | None = None  # taylorseer: a computed step every N steps (default 5)
    cache_warmup: int | None = None  # taylorseer / teacache: first steps always computed (default 3 / 5)
    cache_order: int | None = None  # taylorseer: Taylor series order (default 1)

    # ---------------------------------------------------------------- derived
    @property
    def prompts(self) -> list[str]:
        return list(self.prompt) if isinstance(self.prompt, (list, tuple)) else [self.prompt]

    def resolved(self) -> "Request":
        """A copy with the model's (and preset's) defaults filled in, options included."""
        recipe = registry.get(self.model)
        preset = None if self.checkpoint else self.preset
        s = recipe.settings(preset, height=self.height, width=self.width, num_frames=self.num_frames,
                            steps=self.steps, guidance=self.guidance, fps=self.fps,
                            **{k: v for k, v in self.options.items()})
        from_image = self.image is not None and self.height is None and self.width is None
        return dataclasses.replace(
            self, height=None if from_image else s.get("height"), width=None if from_image else s.get("width"),
            num_frames=s["num_frames"], steps=s["steps"], guidance=s["guidance"], fps=s["fps"], preset=preset,
            dtype=self.dtype or s.get("dtype", "float32"),
            options={o.name: s.get(o.name) for o in recipe.options},
        )

    def to_json(self) -> dict:
        """The request's fields; cache fields only when set (a request without a cache keeps the
        JSON, run id and stage keys it had before caching existed)."""
        d = dataclasses.asdict(self)
        for k in CACHE_FIELDS:
            if d.get(k) is None:
                d.pop(k, None)
        return d

    def cache_settings(self):
        """The validated :class:`vidax.core.stepcache.CacheSettings` (None: no cache)."""
        from vidax.core import stepcache

        recipe = registry.MODELS.get(self.model)
        published = getattr(recipe.pipeline_class(), "MAG_RATIOS", {}).get(self.model) if recipe is not None else None
        tea = getattr(recipe.pipeline_class(), "TEA_COEFFS", {}).get(self.model) if recipe is not None else None
        return stepcache.settings(self.cache, self.cache_threshold, max_skips=self.cache_max_skips,
                                  retention=self.cache_retention, ratios=self.cache_ratios, model=self.model,
                                  published=published, interval=self.cache_interval, warmup=self.cache_warmup,
                                  order=self.cache_order, coefficients=tea)

    @classmethod
    def from_json(cls, d: dict) -> "Request":
        """A request from JSON; the model's options may sit flat beside the common fields."""
        if not isinstance(d, dict):
            raise RequestError("request", f"must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        d = dict(d)
        options = d.pop("options", None) or {}
        if not isinstance(options, dict):
            raise RequestError("options", f"must be an object, got {type(options).__name__}")
        options = dict(options)
        model = d.get("model", registry.default_model())
        recipe = registry.MODELS.get(model) if isinstance(model, str) else None
        declared = {o.name for o in recipe.options} if recipe is not None else set()
        for k in [k for k in d if k not in names]:
            if k in declared:
                options[k] = d.pop(k)
            else:
                extra = f"; options of {model}: {', '.join(sorted(declared)) or 'none'}" if recipe is not None else ""
                raise RequestError(k, f"unknown request field; known fields: {', '.join(sorted(names - {'options'}))}"
                                      + extra)
        return cls(**d, options=options)

    def default_run_id(self) -> str:
        """Deterministic: the same request names the same run (so repeating it resumes/skips)."""
        slug = re.sub(r"[^a-z0-9]+", "-", self.prompts[0].lower()).strip("-")[:32].strip("-") or "run"
        h = hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:10]
        return f"{slug}-{h}"


def validate(req: Request, pipeline=None, *, plan: bool = False) -> Request:
    """Check every field; return the resolved request or raise :class:`RequestError`.
    ``pipeline``: the request's pipeline if already built (it is built from configs otherwise).
    ``plan``: for ``vidax plan`` (configs only): no image needed (an image-to-video size without one
    is the release's area at 480:832), the checkpoint's weights are not looked for."""
    try:
        recipe = registry.get(req.model)
    except ValueError:
        raise RequestError("model", f"unknown model {req.model!r}; available: {', '.join(sorted(registry.MODELS))}") from None
    if req.checkpoint is not None:
        if not isinstance(req.checkpoint, str) or not req.checkpoint.strip():
            raise RequestError("checkpoint", f"{req.checkpoint!r}: give a checkpoint folder")
        from vidax.weights import check_source

        try:
            kind = check_source(req.checkpoint)  # a URL is listed, not downloaded
        except FileNotFoundError:
            raise RequestError("checkpoint", f"{req.checkpoint!r}: no such folder") from None
        except Exception as e:  # noqa: BLE001 - unreachable store, bad URL, missing fsspec backend
            raise RequestError("checkpoint", f"cannot list {req.checkpoint!r} ({type(e).__name__}: {e})") from None
        if kind != "folder":
            raise RequestError("checkpoint", f"{req.checkpoint!r} is not a folder")
    elif req.preset not in recipe.presets:
        raise RequestError("preset", f"{req.preset!r} is not a preset of {req.model}; presets: {', '.join(recipe.presets)}")
    if not isinstance(req.options, dict):
        raise RequestError("options", f"must be a mapping of option names to values, got {type(req.options).__name__}")
    declared = {o.name: o for o in recipe.options}
    for name in req.options:
        if name not in declared:
            raise RequestError(name, f"{req.model} has no option {name!r}; its options: "
                                     f"{', '.join(sorted(declared)) or 'none'}")
    from vidax.weights.lora import LoraError, parse_specs

    try:
        parse_specs(req.lora)
    except LoraError as e:
        raise RequestError("lora", str(e)) from None
    prompts = req.prompts
    if not prompts or any(not isinstance(p, str) or not p.strip() for p in prompts):
        got = next((p for p in prompts if not isinstance(p, str)), None) if prompts else None
        raise RequestError("prompt",
                           "must be a non-empty string" + (f", got {type(got).__name__} {got!r}" if got is not None else ""))
    if req.negative_prompt is not None and not isinstance(req.negative_prompt, str):
        raise RequestError("negative_prompt", "must be a string")
    for name, texts in (("prompt", prompts), ("negative_prompt", [req.negative_prompt or ""])):
        for t in texts:
            if len(t) > MAX_PROMPT_CHARS:
                raise RequestError(name, f"{len(t)} characters; at most {MAX_PROMPT_CHARS}")
            m = _CONTROL.search(t)
            if m:
                raise RequestError(name, f"contains the control character {m.group()!r} at position {m.start()}")
    if recipe.image == "required" and not req.image and not plan:
        raise RequestError("image", f"{req.model} is an image-to-video model: give the first frame (--image PATH|URL)")
    if recipe.image == "none" and req.image:
        i2v = sorted(m for m, r in registry.MODELS.items() if r.image != "none")
        raise RequestError("image", f"{req.model} takes no image; image-to-video models: {', '.join(i2v)}")
    r = req.resolved()
    try:
        r = dataclasses.replace(r, options={n: declared[n].check(v) for n, v in r.options.items()})
    except OptionError as e:
        raise RequestError(e.field, str(e).split(": ", 1)[1]) from None
    if r.mesh not in (None, "auto"):
        from vidax.core.mesh import parse_mesh_spec

        if not isinstance(r.mesh, str):
            raise RequestError("mesh", f"{r.mesh!r}: a spec like dp=1,tp=4,sp=2, or auto")
        try:
            parse_mesh_spec(r.mesh)
        except ValueError as e:
            raise RequestError("mesh", f"{r.mesh!r}: {e}; e.g. dp=1,tp=4,sp=2 or auto") from None
    try:
        pipe = pipeline or build_pipeline(r, mesh=None)
        geo = pipe.geometry()
    except (OSError, ValueError, KeyError, TypeError) as e:
        if not r.checkpoint:
            raise
        msg = str(e).replace(str(r.checkpoint), "").strip(" :") or type(e).__name__
        raise RequestError("checkpoint", f"{r.checkpoint}: not a usable {r.model} checkpoint ({msg})") from None
    if plan and not r.image and (r.height is None or r.width is None):
        area = recipe.settings(r.preset).get("area", 480 * 832)
        h, w = geo.fit_size(480, 832, area, sp=_sp_degree(r.mesh))
        r = dataclasses.replace(r, height=r.height or h, width=r.width or w)
    if r.image:
        from stages.images import ImageError, image_size

        try:
            ih, iw = image_size(r.image)  # decodes the whole image: a truncated file fails here
        except ImageError as e:
            raise RequestError("image", str(e)) from None
        except Exception as e:  # noqa: BLE001 - anything else unreadable
            raise RequestError("image", f"cannot read {r.image!r} as an image ({type(e).__name__}: {e})") from None
        least = max(MIN_IMAGE_SIDE, int(geo.spatial))
        if min(ih, iw) < least:
            raise RequestError("image", f"{r.image} is {iw}x{ih} pixels; a first frame needs at least {least} "
                                        f"pixels on each side")
        if r.height is None or r.width is None:
            area = recipe.settings(r.preset).get("area", 480 * 832)
            try:
                h, w = geo.fit_size(ih, iw, area, sp=_sp_degree(r.mesh))
            except OptionError as e:
                raise RequestError(e.field, str(e).split(": ", 1)[1]) from None
            r = dataclasses.replace(r, height=h, width=w)
    try:
        geo.check(r.height, r.width, r.num_frames)
    except OptionError as e:
        raise RequestError(e.field, str(e).split(": ", 1)[1]) from None
    if not isinstance(r.steps, int) or isinstance(r.steps, bool) or not 1 <= r.steps <= MAX_STEPS:
        raise RequestError("steps", f"{r.steps!r}: must be an integer between 1 and {MAX_STEPS}")
    if (not isinstance(r.guidance, (int, float)) or isinstance(r.guidance, bool) or not math.isfinite(r.guidance)
            or not 0 <= r.guidance <= MAX_GUIDANCE):
        raise RequestError("guidance", f"{r.guidance!r}: must be a finite number between 0 and {MAX_GUIDANCE:g}")
    if not isinstance(r.seed, int) or isinstance(r.seed, bool) or not 0 <= r.seed <= MAX_SEED:
        raise RequestError("seed", f"{r.seed!r}: must be an integer between 0 and {MAX_SEED}")
    if (not isinstance(r.fps, (int, float)) or isinstance(r.fps, bool) or not math.isfinite(r.fps)
            or not 0 < r.fps <= MAX_FPS):
        raise RequestError("fps", f"{r.fps!r}: must be a finite number in (0, {MAX_FPS:g}]")
    lat = geo.latent_frames(r.num_frames)
    if r.decode_stages is not None and not (1 <= r.decode_stages <= lat):
        raise RequestError("decode_stages", f"{r.decode_stages!r}: must be between 1 and {lat} (the latent frame count)")
    if not isinstance(r.checkpoint_every, int) or r.checkpoint_every < 1:
        raise RequestError("checkpoint_every", f"{r.checkpoint_every!r}: must be an integer >= 1")
    if r.dtype not in ("float32", "bfloat16"):
        raise RequestError("dtype", f"{r.dtype!r}: choose float32 or bfloat16")
    _check_mesh(r.mesh, geo)
    r = _check_loras(r, pipe, plan)
    try:
        if not plan:
            pipe.check(r)
            pipe.check_weights(r)  # headers only: every file the run loads, against the key maps
    except OptionError as e:
        raise RequestError(e.field, str(e).split(": ", 1)[1]) from None
    r = _check_cache(r)
    if r.offload_chunk_size is not None:
        v = r.offload_chunk_size
        # per block stack (models with several stacks of different shapes): "double=4,single=all"
        per_stack = isinstance(v, str) and re.fullmatch(r"[A-Za-z_]\w*=([1-9]\d*|all)(,[A-Za-z_]\w*=([1-9]\d*|all))*", v)
        if not (v == "all" or (str(v).isdigit() and int(v) >= 1) or per_stack):
            raise RequestError("offload_chunk_size", f"{v!r}: a number of blocks >= 1, or all "
                                                     f"(or per block stack, e.g. double=4,single=8)")
        if v != "all" and not per_stack:
            r = dataclasses.replace(r, offload_chunk_size=int(v))
    return r


def _check_cache(r: Request) -> Request:
    """The step-cache settings (one line naming the field); ``cache none`` is no cache at all."""
    from vidax.core.stepcache import CacheError

    if r.cache is not None and not isinstance(r.cache, str):
        raise RequestError("cache", f"{r.cache!r}: a method name (none, fbcache, taylorseer, magcache, teacache)")
    try:
        cs = r.cache_settings()
    except CacheError as e:
        raise RequestError(e.field, str(e).split(": ", 1)[1]) from None
    if cs is None:
        return dataclasses.replace(r, **{k: None for k in CACHE_FIELDS})
    if not getattr(registry.get(r.model).pipeline_class(), "STEP_CACHE", False):
        raise RequestError("cache", f"{r.model} does not run a step cache yet")
    if r.offload_chunk_size is not None:
        raise RequestError("cache", "step caching does not run with --offload-chunk-size yet")
    ts = cs.method == "taylorseer"
    return dataclasses.replace(r, cache=cs.method, cache_threshold=None if ts else cs.threshold,
                               cache_max_skips=cs.max_skips if cs.method == "magcache" else None,
                               cache_retention=cs.retention if cs.method == "magcache" else None,
                               cache_ratios=[list(r) for r in cs.ratios] if cs.method == "magcache" else None,
                               cache_interval=cs.interval if ts else None, cache_order=cs.order if ts else None,
                               cache_warmup=cs.warmup if cs.method in ("taylorseer", "teacache") else None)


def _check_loras(r: Request, pipe, plan: bool) -> Request:
    """Every LoRA parsed, readable (safetensors only), matching modules of this model with fitting
    shapes -- checked on the tensor headers before anything runs; the request keeps the canonical
    ``[TARGET=]FILE:SCALE`` strings."""
    from vidax.weights import lora as vlora

    try:
        specs = vlora.parse_specs(r.lora)
    except vlora.LoraError as e:
        raise RequestError("lora", str(e)) from None
    if not specs:
        return dataclasses.replace(r, lora=None)
    if not r.checkpoint:
        raise RequestError("lora", "LoRAs adapt real weights: give --checkpoint (a preset's weights are random)")
    from vidax.pipeline import Pipeline

    if type(pipe).lora_targets is Pipeline.lora_targets:
        raise RequestError("lora", f"{r.model}: LoRAs are not supported for this model family yet")
    remote = pipe.preset is None and pipe._folder is None  # a remote checkpoint not fetched yet
    targets = {} if remote else pipe.lora_targets()
    try:
        if remote:  # the files themselves now; their keys against the weights' headers when fetched
            for s in specs:
                vlora.modules(vlora.read_file(vlora.local_file(s), s.path), s.path)
        elif not plan:
            vlora.check(specs, targets)
    except vlora.LoraError as e:
        raise RequestError("lora", str(e)) from None
    except FileNotFoundError as e:
        raise RequestError("lora", f"{e}") from None
    except Exception as e:  # noqa: BLE001 - an unreachable URL, a damaged checkpoint header
        raise RequestError("lora", f"cannot read {', '.join(s.path for s in specs)} ({type(e).__name__}: {e})") from None
    from vidax.weights.source import is_url, local_path

    # a local file by its absolute path: a stage run later from another folder finds it
    specs = [s if is_url(s.path) else dataclasses.replace(s, path=str(local_path(s.path).resolve())) for s in specs]
    pipe.loras = tuple(specs)
    return dataclasses.replace(r, lora=[str(s) for s in specs])


def _check_mesh(mesh, geo) -> None:
    """The mesh against the visible devices and the model's divisibility rules."""
    if mesh in (None, "auto"):
        return
    import jax

    from vidax.core.mesh import parse_mesh_spec

    sizes = parse_mesh_spec(mesh)
    n = 1
    for v in sizes.values():
        n *= max(1, int(v))  # -1 fills the remaining devices
    have = jax.device_count()
    if n > have:
        raise RequestError("mesh", f"{mesh!r} needs {n} devices; {have} visible ({jax.default_backend()})")
    tp, sp = max(1, int(sizes.get("tp", 1))), max(1, int(sizes.get("sp", 1)))
    if geo.num_heads % tp:
        ok = [d for d in range(1, geo.num_heads + 1) if geo.num_heads % d == 0]
        raise RequestError("mesh", f"{mesh!r}: tp={tp} does not divide the model's {geo.num_heads} attention heads; "
                                   f"tp can be {', '.join(map(str, ok))}")
    # sp: Ulysses x ring (any sp; a ring given in the spec must leave a Ulysses degree dividing the heads)
    from vidax.core.mesh import ShardingConfigError, ring_degree, usp_split

    try:
        usp_split(sp, geo.num_heads // tp, ring_degree(mesh))
    except ShardingConfigError as e:
        raise RequestError("mesh", f"{mesh!r}: {e}") from None


def build_pipeline(req: Request, mesh="request"):
    """The request's family pipeline (configs only: weights load inside each phase).
    ``mesh="request"``: the request's mesh (``auto`` resolved for the visible devices)."""
    recipe = registry.get(req.model)
    has_image = req.image is not None
    kw = dict(dtype=req.dtype)
    if mesh == "request":
        kw.update(offload_chunk_size=req.offload_chunk_size)
        mesh = req.mesh
        if mesh == "auto":
            import jax

            geo = recipe.build(req.preset, req.checkpoint, has_image, dtype=req.dtype).geometry()
            cfg_parallel = recipe.pipeline_class().GUIDANCE == "cfg" and req.guidance > 1.0
            mesh = recipe.default_mesh(jax.device_count(), geo.num_heads,
                                       geo.tokens(req.height, req.width, req.num_frames), cfg_parallel)
        kw["mesh"] = mesh
    pipe = recipe.build(req.preset, req.checkpoint, has_image, **kw)
    if req.lora:
        from vidax.weights.lora import parse_specs

        pipe.loras = tuple(parse_specs(req.lora))
    return pipe


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
