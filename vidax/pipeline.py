"""The pipeline protocol: what a model family gives the staged runner.

``stages/`` and ``flows/`` drive every family through this module and name none of them. A family
is one folder ``vidax/models/<family>/`` with the same files as every other:

    __init__.py   PORTS: reference class name -> module registering its ``vidax.compat`` adapter
    recipes.py    RECIPES: model ids, presets, defaults, size rules, pools (:class:`Recipe`)
    pipeline.py   the family's :class:`Pipeline` (configs at construction, weights per phase)
    dit.py, vae.py ...  the modules, their key maps and ``compat`` adapters

The registry (:mod:`vidax.registry`) and ``vidax.compat`` discover families by importing
``vidax.models.*``; nothing lists them centrally.

A :class:`Pipeline` is built from a source (a preset name or a checkpoint folder) and reads only
configs there; each phase loads its own weights and drops them before it returns:

- :meth:`Pipeline.geometry` -> :class:`Geometry`: compression factors, latent channels, patch,
  frame rule, token count for a size, attention heads (mesh checks);
- ``OPTIONS``: the family's own request options (:class:`Option`: type, default, range), validated
  generically, and the stages whose keys they enter;
- :meth:`Pipeline.encode` ``(request, image) -> {name: Named}``: every conditioning tensor
  (embeddings, masks, pooled vectors, image latents...), each with dimension names;
- :meth:`Pipeline.sample` ``(conditioning, request, resume, on_step) -> {name: Named}``: the
  latents (video, and audio for audio+video families); ``on_step`` receives a thunk returning the
  arrays a resume needs (latents + scheduler state), which the stage persists as a checkpoint and
  hands back as ``resume``;
- :meth:`Pipeline.decode_plan` ``(request) -> [DecodeSpan]`` and :meth:`Pipeline.decode`
  ``(latents, span, carry) -> (outputs, carry)``: the persisted decode stages and what each hands
  to the next (a causal-conv cache, a tile overlap);
- :meth:`Pipeline.weight_loaders` ``(request) -> [(component, loader)]``: the weight loads a run
  makes, which :meth:`Pipeline.check_weights` runs headers only at validation (files, pickles,
  key-map shapes; no tensor data read);
- :meth:`Pipeline.fingerprint` ``(component)``: a *content* fingerprint of a component's weights
  (safetensors headers + sizes, zip CRCs, configs), never modification times;
- ``GUIDANCE``: ``"cfg"`` (conditional + unconditional batch of two) or ``"embedded"``.

``request`` is anything with the attributes of :class:`RequestLike` (``stages.request.Request``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from vidax.core.sampling import StepInfo


class RequestLike(Protocol):
    model: str
    prompts: list[str]
    negative_prompt: str | None
    seed: int
    height: int
    width: int
    num_frames: int
    steps: int
    guidance: float
    dtype: str
    options: Mapping[str, Any]


# ------------------------------------------------------------------ declared options
class OptionError(ValueError):
    """A request option is invalid; ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


@dataclass(frozen=True)
class Option:
    """A family's own request option. ``type``: int | float | str | bool. ``stages``: the stage
    kinds whose keys include it (and which read it): ``encode``, ``sample``, ``decode`` (every
    decode stage), ``decode:audio`` / ``decode:video`` (the decode stages of that kind), ``mux``."""

    name: str
    type: type
    default: Any = None
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None
    stages: tuple[str, ...] = ("sample",)
    cli: str | None = None  # flag name, default --<name with dashes>

    @property
    def flag(self) -> str:
        return self.cli or "--" + self.name.replace("_", "-")

    def check(self, value):
        """The value, checked strictly (no float->int or bool->int coercion); None stays None."""
        if value is None:
            return None
        t = self.type
        if t is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                value = float(value)
                if not math.isfinite(value):
                    raise OptionError(self.name, f"{value!r} is not a finite number")
        elif t is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif t is bool:
            ok = isinstance(value, bool)
        else:
            ok = isinstance(value, t)
        if not ok:
            raise OptionError(self.name, f"{value!r} is not a{'n' if t.__name__[0] in 'aeiou' else ''} {t.__name__}")
        if self.choices is not None and value not in self.choices:
            raise OptionError(self.name, f"{value!r}: choose one of {', '.join(map(str, self.choices))}")
        if self.minimum is not None and value < self.minimum:
            raise OptionError(self.name, f"{value!r}: must be >= {self.minimum}")
        if self.maximum is not None and value > self.maximum:
            raise OptionError(self.name, f"{value!r}: must be <= {self.maximum}")
        return value

    def parse(self, text: str):
        """A value from command-line / CSV text, then :meth:`check`."""
        t = self.type
        try:
            if t is bool:
                low = text.strip().lower()
                if low not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError
                v = low in ("true", "1", "yes")
            elif t is int:
                v = int(text.strip(), 10)
            elif t is float:
                v = float(text)
            else:
                v = t(text)
        except ValueError:
            raise OptionError(self.name, f"{text!r} is not a{'n' if t.__name__[0] in 'aeiou' else ''} {t.__name__}") from None
        return self.check(v)


# ------------------------------------------------------------------ geometry
@dataclass(frozen=True)
class Geometry:
    """Pixel <-> latent <-> token geometry of a model (from its configs, no weights)."""

    spatial: int  # VAE spatial compression (pixels per latent cell)
    temporal: int  # VAE temporal compression: num_frames = temporal * k + 1
    latent_channels: int
    patch: tuple[int, int, int] = (1, 2, 2)  # DiT patch (frames, height, width) over the latents
    num_heads: int = 1  # attention heads (tp must divide them; sp runs as Ulysses x ring over them)
    max_grid: int | None = None  # the most tokens along any axis (positional tables), None: no limit
    frame_step: int | None = None  # num_frames = frame_step * k + 1 (None: the temporal compression)

    @property
    def size_multiple(self) -> int:
        """Height and width must be multiples of this (VAE factor x DiT patch)."""
        return self.spatial * max(int(self.patch[1]), int(self.patch[2]))

    @property
    def frames_multiple(self) -> int:
        """num_frames must be this times k, plus 1."""
        return self.frame_step or self.temporal

    @property
    def frame_rule(self) -> str:
        return f"{self.frames_multiple}k+1"

    def latent_frames(self, num_frames: int) -> int:
        return (num_frames - 1) // self.temporal + 1

    def tokens(self, height: int, width: int, num_frames: int) -> int:
        pt, ph, pw = self.patch
        return ((self.latent_frames(num_frames) // pt) * (height // self.spatial // ph)
                * (width // self.spatial // pw))

    def check(self, height, width, num_frames) -> None:
        """Raise :class:`OptionError` naming ``height`` / ``width`` / ``num_frames``."""
        m = self.size_multiple
        for name, v in (("height", height), ("width", width)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v % m:
                near = max(m, round(v / m) * m) if isinstance(v, int) and not isinstance(v, bool) else m
                raise OptionError(name, f"{v!r} is not a positive multiple of {m} (the model's spatial factor); "
                                        f"nearest: {near}")
        n, tf = num_frames, self.frames_multiple
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or (n - 1) % tf:
            near = max(1, round((n - 1) / tf) * tf + 1) if isinstance(n, int) and not isinstance(n, bool) else 1 + tf
            raise OptionError("num_frames", f"{n!r} frames cannot be decoded by this VAE: use {tf}k+1 (e.g. {near})")
        if self.max_grid is not None:
            pt, ph, pw = self.patch
            for name, v, cells, limit_px in (
                    ("num_frames", n, self.latent_frames(n) // pt, (self.max_grid * pt - 1) * self.temporal + 1),
                    ("height", height, height // self.spatial // ph, self.max_grid * self.spatial * ph),
                    ("width", width, width // self.spatial // pw, self.max_grid * self.spatial * pw)):
                if cells > self.max_grid:
                    raise OptionError(name, f"{v} gives {cells} tokens along this axis; the model's positional "
                                            f"tables hold {self.max_grid} (at most {limit_px})")

    def fit_size(self, image_height: int, image_width: int, area: int, sp: int = 1) -> tuple[int, int]:
        """(height, width) for an image-conditioned run: multiples of :attr:`size_multiple`, about
        ``area`` pixels, the image's aspect ratio, and a per-frame token count divisible by the
        sequence-parallel degree ``sp``. With ``sp == 1`` this is the reference examples' rule
        ``round(sqrt(area * aspect)) // multiple * multiple``."""
        m = self.size_multiple
        ar = image_height / image_width
        h0 = max(m, round(math.sqrt(area * ar)) // m * m)
        w0 = max(m, round(math.sqrt(area / ar)) // m * m)
        if sp <= 1 or ((h0 // m) * (w0 // m)) % sp == 0:
            return int(h0), int(w0)
        best = None
        for dh in range(-4, 5):
            for dw in range(-4, 5):
                h, w = h0 + dh * m, w0 + dw * m
                if h < m or w < m or ((h // m) * (w // m)) % sp:
                    continue
                err = abs(math.log((h / w) / ar)) + abs(math.log(h * w / area))
                if best is None or err < best[0]:
                    best = (err, h, w)
        if best is None:
            raise OptionError("image", f"no size near {w0}x{h0} gives a token count divisible by sp={sp}")
        return int(best[1]), int(best[2])


# ------------------------------------------------------------------ stored tensors and decode spans
@dataclass
class Named:
    """An array with its dimension names and attributes, as the run store keeps it."""

    array: np.ndarray
    dims: tuple[str, ...]
    attrs: dict = field(default_factory=dict)

    def __post_init__(self):
        self.array = np.asarray(self.array)
        if len(self.dims) != self.array.ndim:
            raise ValueError(f"{self.array.ndim}-d array with {len(self.dims)} dimension names {self.dims}")


@dataclass(frozen=True)
class DecodeSpan:
    """One persisted decode stage. ``kind``: "video" (outputs ``frames`` uint8 [B, F, H, W, 3])
    or "audio" (outputs ``waveform`` float32 [B, channels, samples] with a ``sample_rate``
    attribute). ``frames``: the latent frame range it decodes; ``tile``: an optional spatial tile
    (latent rows/cols ``(y0, y1, x0, x1)``); ``carry_from``: the span whose carry it starts from;
    ``inputs``: the sample outputs it reads."""

    name: str
    kind: str = "video"
    frames: tuple[int, int] | None = None
    tile: tuple[int, int, int, int] | None = None
    carry_from: str | None = None
    inputs: tuple[str, ...] = ("latents",)


def temporal_spans(latent_frames: int, stages: int | None = None, inputs=("latents",)) -> list[DecodeSpan]:
    """Contiguous latent-frame ranges ``decode/0..k-1`` (default: up to 4), each carrying from the
    previous one (causal decoders)."""
    n = latent_frames
    k = stages or min(n, 4)
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [DecodeSpan(f"decode/{i}", "video", (bounds[i], bounds[i + 1]), None,
                       f"decode/{i - 1}" if i else None, tuple(inputs)) for i in range(k)]


OnStep = Callable[[StepInfo, Callable[[], dict]], None]


# ------------------------------------------------------------------ the protocol
_WEIGHTS_CHECKED: set = set()


def _folder_signature(folder) -> tuple:
    """Every file under ``folder`` with its size and modification time (a local listing)."""
    import os

    out = []
    for root, _, files in os.walk(folder):
        for f in files:
            st = os.stat(os.path.join(root, f))
            out.append((os.path.relpath(os.path.join(root, f), folder), st.st_size, st.st_mtime_ns))
    return (str(folder), tuple(sorted(out)))


# ------------------------------------------------------------------ weights shared within a phase
#: the cache of loaded components while a batch's phase runs (None: no phase open, every call loads)
_PHASE_WEIGHTS: dict | None = None


class phase_weights:
    """Within this block, each component a pipeline's ``load_*`` methods return is loaded once per
    (pipeline class, source, dtype, mesh, offload, LoRAs, method, arguments) and handed to every
    later call, so the runs of one phase of a batch share one load; the cache is dropped (the
    weights freed) when the block ends. It holds one result per loader and pipeline settings: a
    call with other arguments (another DiT expert) replaces the one held. Not nested: an inner block uses the outer one's cache.
    Loads made to check headers (:func:`vidax.weights.headers_only`) never use it."""

    def __enter__(self):
        global _PHASE_WEIGHTS
        self._owner = _PHASE_WEIGHTS is None
        if self._owner:
            _PHASE_WEIGHTS = {}
        return self

    def __exit__(self, *exc):
        global _PHASE_WEIGHTS
        if self._owner:
            _PHASE_WEIGHTS = None
        return False


def _settings_key(pipe) -> tuple:
    """What a pipeline's loaders depend on: its class, its source and its plain settings (dtype,
    mesh, offload, layout, LoRAs...); configs and cached state are left out."""
    plain = (str, int, float, bool, type(None), np.dtype)
    items = []
    for k, v in sorted(vars(pipe).items()):
        if k.startswith("_"):
            continue
        if isinstance(v, plain) or (isinstance(v, tuple) and all(isinstance(x, plain) for x in v)):
            items.append((k, repr(v)))
    return (type(pipe).__module__, type(pipe).__qualname__, str(pipe.source), repr(pipe.mesh),
            repr(pipe.offload_chunk_size), repr(tuple(pipe.loras)), tuple(items))


def _shared_loader(name: str, load):
    import functools
    import inspect

    sig = inspect.signature(load)

    @functools.wraps(load)
    def wrapper(self, *args, **kwargs):
        cache = _PHASE_WEIGHTS
        if cache is None:
            return load(self, *args, **kwargs)
        from vidax.weights.io import reading_headers_only

        if reading_headers_only():
            return load(self, *args, **kwargs)
        try:
            bound = sig.bind(self, *args, **kwargs)
            bound.apply_defaults()  # load_dit() and load_dit(expert=1) are one call
            key, call = (_settings_key(self), name), repr(list(bound.arguments.items())[1:])
        except Exception:  # noqa: BLE001 - settings that cannot be keyed: load as usual
            return load(self, *args, **kwargs)
        held = cache.get(key)
        if held is None or held[0] != call:
            # one result per loader and pipeline: another call (Wan2.2 A14B's other expert) replaces
            # it, so a phase never holds more of a model than one run of it does
            cache.pop(key, None)
            cache[key] = (call, load(self, *args, **kwargs))
        return cache[key][1]

    wrapper._vidax_shared = True
    return wrapper


class Pipeline:
    """Base class of a family's pipeline (see the module docstring). Subclasses set ``FAMILY``,
    ``OPTIONS``, ``GUIDANCE``, ``OUTPUTS`` and implement the phase methods."""

    FAMILY: ClassVar[str] = ""
    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    GUIDANCE: ClassVar[str] = "cfg"  # "cfg" (batch of two) | "embedded"
    OUTPUTS: ClassVar[tuple[str, ...]] = ("video",)  # + "audio"
    #: components whose fingerprints enter each stage kind's key
    COMPONENTS: ClassVar[Mapping[str, tuple[str, ...]]] = {"encode": ("text",), "sample": ("dit",),
                                                           "decode": ("vae",)}
    #: other vidax packages this family's code runs (e.g. a VAE it reuses), for code-version keys
    CODE_DEPS: ClassVar[tuple[str, ...]] = ()
    #: whether ``sample`` runs a step cache (``step_cache``, a :class:`vidax.core.stepcache.StepCache`
    #: the sample stage sets: its DiT calls go through ``DiTRunner.use_cache``)
    STEP_CACHE: ClassVar[bool] = False
    step_cache = None

    def __init_subclass__(cls, **kw):
        """A family's component loaders (its public ``load_*`` methods) share their result within
        :class:`phase_weights`."""
        super().__init_subclass__(**kw)
        for name, fn in list(vars(cls).items()):
            if name.startswith("load_") and callable(fn) and not getattr(fn, "_vidax_shared", False):
                setattr(cls, name, _shared_loader(name, fn))

    # configuration
    mesh: Any = None
    offload_chunk_size: Any = None
    #: the model source: ``preset`` (its preset object) or ``config_folder`` (local; a remote
    #: checkpoint's configs are fetched alone, its weights on first use through :attr:`folder`)
    source: str = ""
    preset: Any = None
    preset_name: str | None = None
    config_folder: Any = None
    _folder: Any = None

    def open_source(self, source, presets: Mapping, include: Sequence[str], what: str | None = None) -> dict:
        """Resolve ``source`` -- a preset name of ``presets``, a local folder or a URL -- and set
        :attr:`source`, :attr:`preset`, :attr:`preset_name` and :attr:`config_folder` (only the
        files matching ``include`` are fetched for a remote source). Returns the folder's
        ``model_index.json`` ({} for a preset). ``what``: the diffusers pipeline the folder must be
        (its ``model_index.json`` required); None: any folder (the family reads other layouts)."""
        import json
        from pathlib import Path

        from vidax.weights.source import is_url, resolve_source

        remote = is_url(source)
        self.source = str(source)
        self.preset = presets.get(self.source) if not remote and not Path(self.source).exists() else None
        self.preset_name = self.source if self.preset is not None else None
        self._folder = self.config_folder = None
        if self.preset is not None:
            return {}
        self.config_folder = resolve_source(source, include=include)
        if not remote:
            self._folder = self.config_folder
        index = self.config_folder / "model_index.json"
        if index.exists():
            return json.loads(index.read_text())
        if what is not None:
            raise ValueError(f"model source {source!r} is neither a preset ({sorted(presets)}) nor a diffusers "
                             f"{what} folder (model_index.json)")
        if not self.config_folder.is_dir():
            raise ValueError(f"model source {source!r} is neither a preset ({sorted(presets)}) nor a folder")
        return {}

    #: LoRA adapters (:class:`vidax.weights.lora.LoraSpec`) merged into the DiT(s) at load
    loras: tuple = ()

    def lora_targets(self) -> dict:
        """``{name: vidax.weights.lora.Target}``: the checkpoints a LoRA adapts (a family with one
        DiT names it ``dit``); empty when this family or source takes no LoRA."""
        return {}

    def transformer_lora_targets(self, aliases, what: str) -> dict:
        """The usual ``lora_targets``: one DiT, ``transformer/`` of a diffusers folder; none for a
        preset. ``aliases``: the family's table (``vidax.models.<family>.lora``)."""
        if self.preset is not None:
            return {}
        from pathlib import Path

        from vidax.weights.lora import Target

        return {"dit": Target("dit", Path(self.folder) / "transformer", aliases, what)}

    def lora_merging(self, name: str):
        """A context in which loading DiT ``name`` merges the LoRAs that apply to it."""
        import contextlib

        if not self.loras:
            return contextlib.nullcontext()
        from vidax.weights import lora

        targets = self.lora_targets()
        specs = lora.for_target(self.loras, name, targets)
        return lora.merging(targets[name], specs, [targets[n] for n in targets])

    @property
    def folder(self):
        """The checkpoint folder on local disk (a remote source is fetched into the cache on first
        use); None for a preset."""
        if self._folder is None and self.preset is None:
            from vidax.weights.source import resolve_source

            self._folder = resolve_source(self.source)
        return self._folder

    def geometry(self) -> Geometry:
        raise NotImplementedError

    def check(self, request: RequestLike) -> None:
        """Family checks of a request before anything is written (prompt lengths against the
        tokenizer, the checkpoint folder's completeness...). Raise :class:`OptionError` naming the
        field (``prompt``, ``checkpoint``...)."""

    def weight_loaders(self, request: RequestLike) -> list[tuple[str, Callable[[], Any]]]:
        """``[(component, loader)]``: every weight load a run of ``request`` makes, each a thunk
        calling the family's own loader (the same code the stages run, so the same files and key
        maps). :meth:`check_weights` runs them with headers only. Default: none (presets)."""
        return []

    def check_weights(self, request: RequestLike, fetch: bool = False) -> None:
        """The checkpoint folder checked, headers only, before anything is written: every component
        :meth:`weight_loaders` names is opened through its own loader inside
        :func:`vidax.weights.headers_only` -- every safetensors header parsed with its data ranges
        within the file, every ``.pth`` pickle checked against the allow-list with its storages and
        views, every tensor the key map reads of the shape the config implies -- and stopped at the
        first byte of tensor data. Raises :class:`OptionError` (``checkpoint``) naming the component,
        the file and the tensor. A remote checkpoint whose weights are not fetched yet is checked
        only with ``fetch=True`` (then fetched: the run needs them next)."""
        from vidax.weights import CheckpointFormatError, CheckpointMismatchError, HeadersChecked, headers_only

        if self.preset is not None or (self._folder is None and not fetch):
            return
        loaders = self.weight_loaders(request)
        if not loaders:
            return
        # one check per process for the same files (validation, then the run, build two pipelines)
        memo = (type(self).__name__, tuple(w for w, _ in loaders), _folder_signature(self.folder))
        if memo in _WEIGHTS_CHECKED:
            return
        for what, load in loaders:
            try:
                with headers_only():
                    load()
            except HeadersChecked:
                continue
            except (CheckpointFormatError, CheckpointMismatchError, FileNotFoundError, OSError, ValueError, KeyError,
                    TypeError) as e:
                msg = " ".join(str(e).split()) or type(e).__name__
                if not isinstance(e, (CheckpointFormatError, CheckpointMismatchError)):
                    msg = f"{type(e).__name__}: {msg}"
                raise OptionError("checkpoint", f"{what}: {msg}") from None
        if len(_WEIGHTS_CHECKED) > 256:
            _WEIGHTS_CHECKED.clear()
        _WEIGHTS_CHECKED.add(memo)

    def encode(self, request: RequestLike, image: np.ndarray | None = None) -> dict[str, Named]:
        raise NotImplementedError

    def sample(self, conditioning: dict[str, np.ndarray], request: RequestLike, *, resume: dict | None = None,
               on_step: OnStep | None = None) -> dict[str, Named]:
        raise NotImplementedError

    def decode_plan(self, request: RequestLike) -> list[DecodeSpan]:
        return temporal_spans(self.geometry().latent_frames(request.num_frames), getattr(request, "decode_stages", None))

    def decode(self, latents: dict[str, np.ndarray], span: DecodeSpan, carry: dict[str, np.ndarray] | None,
               request: RequestLike) -> tuple[dict[str, Named], dict[str, np.ndarray] | None]:
        raise NotImplementedError

    def assemble_video(self, parts: Sequence[tuple[DecodeSpan, np.ndarray]]) -> np.ndarray:
        """The whole video [B, F, H, W, 3] from the video spans' frames (default: concatenated
        in plan order; tiled plans override)."""
        return np.concatenate([f for _, f in parts], axis=1)

    def fingerprint(self, component: str) -> str:
        raise NotImplementedError

    def stage_params(self, kind: str, request: RequestLike, span: DecodeSpan | None = None) -> dict:
        """Family parameters that enter a stage's key (default: the declared options read by that
        stage kind, or for a decode stage by its span kind)."""
        kinds = {kind} | ({f"{kind}:{span.kind}"} if span is not None else set())
        return {o.name: request.options.get(o.name) for o in self.OPTIONS if kinds & set(o.stages)}

    def describe(self) -> dict:
        """Details recorded with the sample stage (mesh, offloading...)."""
        return {"mesh": self.mesh, "offload_chunk_size": self.offload_chunk_size}

    def text_mesh(self) -> str | None:
        """The mesh a real checkpoint's text encoder is split over: tensor parallelism across this
        host's accelerators (the encode slice), so an encoder larger than one chip fits; None on one
        device or on CPU (host memory holds it whole; splitting over CPU devices only adds work)."""
        import jax

        n = jax.local_device_count() if jax.default_backend() != "cpu" else 1
        return f"tp={n}" if n > 1 else None

    def pool_devices(self, request: RequestLike, kind: str) -> int:
        """How many chips the recipe's pool gives stage ``kind`` (1 when it has none): what a plan
        of that stage shards over."""
        import jax

        from vidax import registry

        recipe = registry.MODELS.get(request.model)
        jobs = recipe.job_variables(kind, None if request.checkpoint else request.preset) if recipe else {}
        return max(1, min(int(jobs.get("tpu_chips") or 1), jax.device_count()))

    # -------------------------------------------------------------- memory plan (``vidax plan``)
    def plan_units(self, request: RequestLike) -> list:
        """The compiled unit of each stage at ``request``'s shapes, from abstract state (no weights
        read): a list of :class:`vidax.core.plan.Unit` with ``stage`` ``encode`` (the prompt
        encoder's forward), ``sample`` (one DiT call on the guidance batch, on this pipeline's mesh)
        and ``decode`` (the program one decode stage repeats). ``stages.plan`` compiles them on the
        pool's devices and reads the per-device bytes."""
        raise NotImplementedError(f"{type(self).__name__} has no memory plan yet (plan_units)")

    # -------------------------------------------------------------- probe hooks (``vidax probe``)
    # A low-noise reconstruction probe (``stages.probe``) encodes a real image or clip, noises it,
    # asks the model for one clean estimate and decodes it. Noise levels are flow-matching sigmas
    # in [0, 1] (``x = (1 - s) x0 + s noise``); a family with another parametrisation converts
    # inside ``add_noise`` / ``denoise_once``.
    def vae_encode(self, video: np.ndarray) -> np.ndarray:
        """Pixels [B, 3, F, H, W] in [-1, 1] -> latents as :meth:`sample` produces them (normalised,
        the family's stored layout)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement the probe hooks "
                                  "(vae_encode, vae_decode, denoise_once)")

    def vae_decode(self, latents: np.ndarray) -> np.ndarray:
        """Latents as :meth:`sample` returns them -> pixels [B, F, H, W, 3] in [0, 1] (whole clip)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement the probe hooks")

    def add_noise(self, latents: np.ndarray, noise: np.ndarray, sigmas: np.ndarray) -> np.ndarray:
        """Row ``b`` of ``latents`` at noise level ``sigmas[b]`` (default: flow matching)."""
        s = np.asarray(sigmas, np.float32).reshape(-1, *([1] * (np.ndim(latents) - 1)))
        return ((1.0 - s) * np.asarray(latents, np.float32) + s * np.asarray(noise, np.float32)).astype(np.float32)

    def denoise_once(self, latents: np.ndarray, sigmas: np.ndarray, conditioning: Mapping[str, np.ndarray],
                     request: RequestLike | None = None) -> np.ndarray:
        """One model evaluation per row of ``latents`` at noise level ``sigmas[b]``, conditioned on
        the first prompt of ``conditioning`` (the arrays :meth:`encode` returned), without guidance
        -> the model's estimate of the clean latents (same layout)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement the probe hooks")


# ------------------------------------------------------------------ recipes
def _tpu(accelerator: str, topology: str, chips: int) -> dict:
    return {"tpu_accelerator": accelerator, "tpu_topology": topology, "tpu_chips": chips}


tpu = _tpu

#: small sizes for the seeded random-weight presets, so a first run takes seconds
#: a preset's defaults over the recipe's; tiny presets run in float32 (the parity dtype), whatever the
#: release's default ``dtype`` (``bfloat16`` for the large releases, whose float32 DiT weights do not fit
#: their pools)
PRESET_DEFAULTS = {"tiny": dict(height=64, width=64, num_frames=9, steps=6, guidance=5.0, fps=8, area=64 * 64,
                                dtype="float32")}


@dataclass(frozen=True)
class Recipe:
    """A model id users ask for: the family pipeline, where its weights come from, its defaults,
    image requirements and the pools its stages are routed to."""

    model_id: str
    pipeline: str  # "module:Class" (a Pipeline subclass)
    presets: tuple[str, ...]
    defaults: dict = field(default_factory=dict)  # request fields (dtype too) and option defaults
    description: str = ""
    stage_jobs: dict = field(default_factory=dict)  # preset (None: real) -> stage kind -> job variables
    prefer_axis: str = "sp"  # what --mesh auto spreads the DiT over besides CFG's dp
    image: str = "none"  # "none" | "required" | "optional"
    preset_sources: dict = field(default_factory=dict)  # (preset, has_image) -> source name
    pipeline_kwargs: dict = field(default_factory=dict)
    option_names: tuple[str, ...] | None = None  # the family options this model takes (None: all)
    default: bool = False  # the model a request without one gets (one recipe sets it)

    @property
    def family(self) -> str:
        return self.pipeline_class().FAMILY

    def pipeline_class(self):
        import importlib

        mod, cls = self.pipeline.split(":")
        return getattr(importlib.import_module(mod), cls)

    @property
    def options(self) -> tuple[Option, ...]:
        opts = tuple(self.pipeline_class().OPTIONS)
        return opts if self.option_names is None else tuple(o for o in opts if o.name in self.option_names)

    def option(self, name: str) -> Option | None:
        return next((o for o in self.options if o.name == name), None)

    @property
    def config_folder(self):
        """The release's configs (``config.json`` files only, no weights) shipped beside the family
        in ``configs/<model id>/``, or None: what ``vidax plan`` reads for a real-size plan when no
        checkpoint is given."""
        import importlib
        from pathlib import Path

        pkg = self.pipeline.split(":")[0].rsplit(".", 1)[0]
        folder = Path(importlib.import_module(pkg).__file__).parent / "configs" / self.model_id
        return folder if (folder / "model_index.json").is_file() else None

    def source(self, preset: str | None, checkpoint: str | None, has_image: bool = False) -> str:
        if checkpoint:
            return checkpoint
        return self.preset_sources.get((preset, has_image), preset)

    def build(self, preset: str | None, checkpoint: str | None, has_image: bool = False, **kw) -> Pipeline:
        return self.pipeline_class()(self.source(preset, checkpoint, has_image), **{**self.pipeline_kwargs, **kw})

    def default_mesh(self, n_devices: int, num_heads: int, tokens: int, cfg_parallel: bool) -> str | None:
        """The mesh ``--mesh auto`` picks on ``n_devices``: the conditional/unconditional pair on
        ``dp`` when guidance runs as a batch of two, the rest on the recipe's preferred axis
        (``sp`` for models whose weights fit one chip, ``tp`` for the large ones), as large as the
        heads (and, for sp, the token count) allow."""
        if n_devices <= 1:
            return None
        dp = 2 if cfg_parallel and n_devices % 2 == 0 else 1
        rest = n_devices // dp
        ok = [d for d in range(1, rest + 1) if rest % d == 0 and num_heads % d == 0
              and (self.prefer_axis != "sp" or tokens % d == 0)]
        return f"dp={dp},{self.prefer_axis}={max(ok)}"

    def job_variables(self, stage_kind: str, preset: str | None) -> dict:
        return dict(self.stage_jobs.get(preset, {}).get(stage_kind, {}))

    def settings(self, preset: str | None, **overrides) -> dict:
        """Defaults for this model (and preset), with non-None overrides applied."""
        s = {o.name: o.default for o in self.options}
        s.update(self.defaults)
        s.update(PRESET_DEFAULTS.get(preset, {}))
        s.update({k: v for k, v in overrides.items() if v is not None})
        return s


# ------------------------------------------------------------------ shared helpers
def to_unit_range(pixels: np.ndarray) -> np.ndarray:
    """VAE output [B, 3, T, H, W] in [-1, 1] -> [B, T, H, W, 3] in [0, 1] (the reference's postprocess)."""
    return np.clip(np.asarray(pixels).transpose(0, 2, 3, 4, 1) / 2 + 0.5, 0.0, 1.0)


def to_uint8(video01: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(video01) * 255).astype(np.uint8)


def pack_state(latents: np.ndarray, state) -> dict[str, np.ndarray]:
    """A sampling checkpoint's arrays: the latents and the scheduler state's leaves."""
    import jax

    out = {"latents": np.asarray(latents)}
    for i, leaf in enumerate(jax.tree.leaves(state)):
        out[f"state_{i}"] = np.asarray(leaf)
    return out


def unpack_state(arrays: Mapping[str, np.ndarray], template):
    """Inverse of :func:`pack_state` given a state of the same structure (``sched.init_state(x)``)."""
    import jax

    treedef = jax.tree.structure(template)
    n = treedef.num_leaves
    missing = [f"state_{i}" for i in range(n) if f"state_{i}" not in arrays]
    if "latents" not in arrays or missing:
        gone = (["latents"] if "latents" not in arrays else []) + missing
        raise ValueError(f"sampling checkpoint is incomplete: missing {gone}")
    return arrays["latents"], jax.tree.unflatten(treedef, [arrays[f"state_{i}"] for i in range(n)])
