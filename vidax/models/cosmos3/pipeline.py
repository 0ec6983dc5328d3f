"""Cosmos3 generation (diffusers ``Cosmos3OmniPipeline``, vision modes): tokenize -> MoT sampling -> Wan2.2 VAE.

There is no separate text encoder: the encode stage only tokenizes (the chat template with the
mode's system prompt, the duration / resolution sentences appended to the prompt and their
inverses to the negative prompt, then ``eos`` + ``<|vision_start|>``) and, for image- or
video-to-video, VAE-encodes the conditioning frames. The sample stage runs the model's text
pathway once per prompt (its keys/values never change across steps) and then, every step, the
vision pathway for the conditional and the unconditional prompt as one batch (text padded to the
longer one, masked), CFG ``u + g (c - u)`` (off at g = 1), the velocity zeroed on conditioning
frames, UniPC (flow sigmas) on the latents.

Modes: text-to-video (and text-to-image with one frame), image-to-video (``--image``: the image,
resized to cover the frame and centre-cropped, is latent frame 0) and video-to-video (``--video``:
the clip's first -- or last -- ``4 (cond_frames - 1) + 1`` frames fix ``cond_frames`` latent
frames). Sound and action generation are not ported.

Sources: ``"tiny"`` / ``"tiny-edge"`` (seeded random weights, byte tokenizer) or a diffusers folder
(``model_index.json`` with ``Cosmos3OmniPipeline``: ``transformer/``, ``text_tokenizer/``, ``vae/``,
``scheduler/``), local or at an fsspec URL.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.runtime import collect_own_garbage
from vidax.core.runner import DiTRunner
from vidax.core.sampling import StepInfo
from vidax.models.cosmos import chat
from vidax.models.cosmos import vae as cvae
from vidax.models.cosmos.pipeline import CosmosVAEStages, read_video, video_pixels, video_read_error
from vidax.models.cosmos3 import mot
from vidax.models.cosmos3.prompt import ShortPromptWarning, short_prompt_warning
from vidax.pipeline import (Geometry, Named, Option, OptionError, Pipeline, pack_state, to_uint8,
                            to_unit_range, unpack_state)
from vidax.schedulers import from_diffusers_config
from vidax.text.tokenizer import load_tokenizer
from vidax.weights.fingerprint import files_fingerprint
from vidax.models.wan.tiles import TileStages, tiling_option
from vidax.weights.keymap import lazy_params

log = logging.getLogger(__name__)

_CONFIG_FILES = ("model_index.json", "*/config.json", "scheduler/scheduler_config.json", "text_tokenizer/*.json",
                 "text_tokenizer/*.jinja")
SYSTEM_PROMPT_IMAGE = "You are a helpful assistant who will generate images from a give prompt."
SYSTEM_PROMPT_VIDEO = "You are a helpful assistant who will generate videos from a give prompt."
#: the presets' scheduler: UniPC on flow sigmas with the shift the release documents for video
SCHEDULER = dict(_class_name="UniPCMultistepScheduler", use_flow_sigmas=True, prediction_type="flow_prediction",
                 flow_shift=10.0, use_karras_sigmas=False, num_train_timesteps=1000)
_LATENT = ("batch", "channel", "frame", "height", "width")


@dataclass(frozen=True)
class TinyPreset:
    model: mot.Cosmos3Config = mot.PRESETS["tiny"]
    vae: cvae.Config = cvae.TINY_22
    eos_id: int = 2  # <|im_end|> and <|vision_start|> of the presets' chat.WordTokenizer
    vision_start_id: int = 3
    use_system_prompt: bool = True
    seed: int = 0


PRESET_SOURCES = {"tiny": TinyPreset(), "tiny-edge": TinyPreset(model=mot.PRESETS["tiny-edge"])}


@dataclass(frozen=True)
class PaddedGeometry(Geometry):
    """Cosmos3 pads odd latent sizes to its 2x2 patches: frame sizes are multiples of the VAE factor
    (16) and the vision token count rounds the latent grid up."""

    @property
    def size_multiple(self) -> int:
        return self.spatial

    def tokens(self, height: int, width: int, num_frames: int) -> int:
        p = max(int(self.patch[1]), int(self.patch[2]))
        return (self.latent_frames(num_frames) * -(-(height // self.spatial) // p)
                * -(-(width // self.spatial) // p))


# ------------------------------------------------------------------ preprocessing
def _aa_weights(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] bilinear resampling weights with antialiasing (the triangle filter widened by
    the downscale factor; what ``interpolate(mode="bilinear", antialias=True, align_corners=False)``
    computes)."""
    scale = n_in / n_out
    support = max(scale, 1.0)
    inv = 1.0 / scale if scale > 1.0 else 1.0
    w = np.zeros((n_out, n_in), np.float64)
    for i in range(n_out):
        center = scale * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        x = (np.arange(lo, hi) - center + 0.5) * inv
        k = np.clip(1.0 - np.abs(x), 0.0, None)
        s = k.sum()
        if s > 0:
            w[i, lo:hi] = k / s
    return w.astype(np.float32)


def image_pixels(image, height: int, width: int) -> np.ndarray:
    """The reference's conditioning-image preprocessing: resize (antialiased bilinear) to cover
    (height, width) keeping the aspect ratio, centre-crop, round to integer levels, to [-1, 1].
    uint8 [H, W, 3] (or PIL) -> [3, height, width]."""
    if hasattr(image, "convert"):
        image = np.asarray(image.convert("RGB"))
    a = np.asarray(image, np.float32)
    h0, w0 = a.shape[:2]
    scale = max(width / w0, height / h0)
    rh, rw = math.ceil(scale * h0), math.ceil(scale * w0)
    wy, wx = _aa_weights(h0, rh), _aa_weights(w0, rw)
    r = np.einsum("yh,hwc->ywc", wy, a, optimize=True)
    r = np.einsum("xw,ywc->yxc", wx, r, optimize=True)
    top, left = round((rh - height) / 2), round((rw - width) / 2)
    r = r[top:top + height, left:left + width]
    return (np.clip(np.round(r), 0, 255) / 127.5 - 1.0).astype(np.float32).transpose(2, 0, 1)


def _append(base: str, addition: str) -> str:
    base = base.rstrip(".")
    return f"{base}. {addition}" if base else addition


def prompt_texts(prompt: str, negative: str | None, *, num_frames: int, height: int, width: int, fps: float,
                 resolution: bool = True, duration: bool = True) -> tuple[str, str]:
    """The prompt and negative prompt with the reference's metadata sentences (inverted for the negative)."""
    image = num_frames == 1

    def apply(text, neg):
        if not image and duration:
            tpl = ("The video is not {d:.1f} seconds long and is not of {f:.0f} FPS." if neg
                   else "The video is {d:.1f} seconds long and is of {f:.0f} FPS.")
            text = _append(text, tpl.format(d=num_frames / fps, f=fps))
        if resolution:
            kind = "image" if image else "video"
            tpl = f"This {kind} is not of {{h}}x{{w}} resolution." if neg else f"This {kind} is of {{h}}x{{w}} resolution."
            text = _append(text, tpl.format(h=height, w=width))
        return text

    return apply(prompt, False), apply(negative or "", True)


def _sched_key(sched) -> tuple:
    key = (type(sched).__name__, sched.num_inference_steps, int(sched.begin_index),
           json.dumps(sched.config, sort_keys=True, default=str))
    _SCHEDS.setdefault(key, sched)
    return key


_SCHEDS: dict = {}


def _step_update(sched, use_cfg, cfg, thw, x, state, pred, i, keep, g):
    """Predictions of the 2B (or B) rows -> masked velocity, CFG, scheduler step."""
    v = mot.unpatchify(cfg, pred.astype(jnp.float32), thw) * keep
    if use_cfg:
        b = x.shape[0]
        v = v[b:] + g * (v[:b] - v[b:])
    return sched.step(state, v, i, x)


@functools.lru_cache(maxsize=16)
def _single_device_step(cfg: mot.Cosmos3Config, sched_key: tuple, use_cfg: bool, thw: tuple):
    sched = _SCHEDS[sched_key]
    timesteps = jnp.asarray(sched.timesteps)

    @jax.jit
    def step(state_m, x, st, i, noisy, keep, cos, sin, cache, tmask, g):
        xin = jnp.concatenate([x, x], axis=0) if use_cfg else x
        patches = mot.patchify(cfg, xin).astype(mot.state_dtype(state_m))
        t = jnp.broadcast_to(timesteps[i], noisy.shape) * noisy
        pred = mot.vision_forward(state_m, cfg, patches, t, noisy, cos, sin, cache, tmask)
        return _step_update(sched, use_cfg, cfg, thw, x, st, pred, i, keep, g)

    return step


class Cosmos3Omni(CosmosVAEStages, TileStages, Pipeline):
    """Cosmos3 (Nano / Edge) text-, image- and video-to-video on the pipeline protocol."""

    FAMILY = "cosmos3"
    OPTIONS = (
        Option("video", str, None, "video-to-video: a conditioning clip (path or URL)", stages=("encode",)),
        Option("cond_frames", int, 2, "video-to-video: leading latent frames the clip fixes (4(n-1)+1 pixel frames)",
               minimum=1, maximum=16, stages=("encode", "sample")),
        Option("video_keep", str, "first", "video-to-video: take the conditioning frames from the clip's start or end",
               choices=("first", "last"), stages=("encode",)),
        Option("shift", float, None, "flow shift of the UniPC schedule (default: the checkpoint's)", minimum=0.0,
               maximum=100.0),
        Option("system_prompt", bool, None, "prepend the mode's system prompt (default: the checkpoint's)",
               stages=("encode",)),
        Option("metadata", bool, True, "append the duration and resolution sentences to the prompts",
               stages=("encode",)),
        tiling_option(),
    )
    COMPONENTS = {"encode": ("text",), "image": ("vae",), "sample": ("dit",), "decode": ("vae",)}
    CODE_DEPS = ("vidax.models.wan.vae", "vidax.models.cosmos.vae", "vidax.models.cosmos.chat",
                 "vidax.models.cosmos.pipeline")
    #: the vision pathway's calls go through the runner's cached units (the text K/V as their context)
    STEP_CACHE = True

    def __init__(self, source: str | Path = "tiny", *, dtype=np.float32, mesh=None, parallelism: str | None = None,
                 offload_chunk_size=None, prefetch: bool = True, warn_short_prompts: bool | None = None):
        """``warn_short_prompts``: warn when a short unstructured prompt is given (default: for the
        Nemotron-backbone model, i.e. Edge)."""
        self.dtype = np.dtype(dtype)
        self.mesh, self.parallelism = mesh, parallelism
        self.offload_chunk_size, self.prefetch = offload_chunk_size, prefetch
        self.index = self.open_source(source, PRESET_SOURCES, _CONFIG_FILES, "Cosmos3OmniPipeline")
        if self.index.get("_class_name") not in (None, "Cosmos3OmniPipeline"):
            raise ValueError(f"{source}: a {self.index.get('_class_name')} folder, not Cosmos3OmniPipeline")
        cfg = self.model_config()
        self.warn_short_prompts = (cfg.hidden_act == "relu2") if warn_short_prompts is None else warn_short_prompts

    # ------------------------------------------------------------------ configs
    def model_config(self) -> mot.Cosmos3Config:
        if self.preset:
            return self.preset.model
        return mot.Cosmos3Config.from_diffusers(json.loads((self.config_folder / "transformer" / "config.json").read_text()))

    @property
    def use_system_prompt(self) -> bool:
        return self.preset.use_system_prompt if self.preset else bool(self.index.get("default_use_system_prompt", True))

    @property
    def native_schedule(self) -> bool:
        return bool(self.index.get("use_native_flow_schedule", False))

    def geometry(self) -> Geometry:
        c = self.model_config()
        sf, tf = cvae.factors(self.vae_config())
        p = c.latent_patch_size
        return PaddedGeometry(spatial=sf, temporal=tf, latent_channels=c.latent_channel, patch=(1, p, p),
                              num_heads=c.num_attention_heads)

    def scheduler(self, steps: int, shift: float | None = None):
        cfg = dict(SCHEDULER) if self.preset else json.loads((self.config_folder / "scheduler" /
                                                                "scheduler_config.json").read_text())
        if shift is not None:
            cfg["flow_shift"] = shift
        sigmas = None
        if self.native_schedule:  # linear sigmas from 1 - 1/T (the reference's use_native_flow_schedule)
            sigmas = np.linspace(1.0 - 1.0 / cfg.get("num_train_timesteps", 1000), 0.0, steps + 1)[:-1]
        return from_diffusers_config(cfg, steps, **({"sigmas": sigmas} if sigmas is not None else {}))

    # ------------------------------------------------------------------ loaders
    def load_tokenizer(self):
        """``(tokenizer, template, specials, eos id, <|vision_start|> id)``."""
        if self.preset:
            return (chat.WordTokenizer(self.preset.model.vocab_size), None, {}, self.preset.eos_id,
                    self.preset.vision_start_id)
        folder = self.folder / "text_tokenizer"
        tok = load_tokenizer(folder)
        specials = chat.special_tokens(folder)
        eos = chat.token_id(tok, specials.get("eos_token", "<|im_end|>"))
        vs = chat.token_id(tok, "<|vision_start|>")
        if eos is None or vs is None:
            raise ValueError(f"{folder}: the tokenizer lacks its eos token or <|vision_start|>")
        return tok, chat.load_template(folder), specials, eos, vs

    @property
    def scaled(self) -> bool:
        return self.mesh is not None or self.offload_chunk_size is not None or self.step_cache is not None

    def _load_host(self):
        cfg = self.model_config()
        if self.preset:
            return mot.init_state(cfg, seed=self.preset.seed + 2, dtype=self.dtype), cfg
        return mot.load_model(self.folder / "transformer", cfg, dtype=self.dtype)

    def load_model(self):
        """The MoT state on one device, or its :class:`~vidax.core.runner.DiTRunner` (:func:`mot.runner`)."""
        with lazy_params(self.scaled and self.offload_chunk_size is None):  # placed: a host reads its shards only
            state, cfg = self._load_host()
        if not self.scaled:
            return jax.device_put(state), cfg
        return mot.runner(state, cfg, self.mesh, self.parallelism, offload_chunk_size=self.offload_chunk_size,
                          prefetch=self.prefetch), cfg

    # ------------------------------------------------------------------ checks
    def weight_loaders(self, request) -> list:
        return [("transformer", self._load_host), ("VAE", self.load_vae)]

    def check(self, request) -> None:
        o = request.options
        self._check_mesh(getattr(request, "mesh", None))
        if o.get("video") is not None and getattr(request, "image", None) is not None:
            raise OptionError("video", "give either --image (image-to-video) or --video (video-to-video), not both")
        if o.get("video") is not None and request.num_frames == 1:
            raise OptionError("video", "video-to-video needs more than one frame")
        n_lat = self.geometry().latent_frames(request.num_frames)
        if o.get("video") is not None and int(o.get("cond_frames") or 2) > n_lat:
            raise OptionError("cond_frames", f"{o.get('cond_frames')} conditioning latent frames do not fit "
                                             f"{request.num_frames} frames ({n_lat} latent frames)")
        self.warn_prompts(request.prompts)
        if self.preset is None and self._folder is None:
            return
        if self.folder is not None:
            missing = [d for d in ("transformer", "text_tokenizer", "vae", "scheduler") if not (self.folder / d).is_dir()]
            if missing:
                raise OptionError("checkpoint", f"{self.folder}: missing {', '.join(d + '/' for d in missing)}")
        if o.get("video") is not None:
            try:
                n = len(read_video(o["video"]))
            except Exception as e:  # noqa: BLE001
                raise OptionError("video", video_read_error(o["video"], e)) from None
            need = 4 * (int(o.get("cond_frames") or 2) - 1) + 1
            if n < need:
                raise OptionError("video", f"{o['video']} has {n} frames; {need} are needed for cond_frames="
                                           f"{o.get('cond_frames')}")

    def _check_mesh(self, mesh) -> None:
        """The MoT's divisibility rules (key/value heads, MLP width, vocabulary over tp...) at
        validation, not only when the sample stage builds its runner."""
        if not isinstance(mesh, str) or mesh == "auto":
            return
        from vidax.core import mesh as vmesh

        try:
            sizes = vmesh.parse_mesh_spec(mesh)
        except ValueError:
            return  # the request's own mesh check names it
        n = jax.device_count()
        known = int(np.prod([max(1, int(v)) for v in sizes.values()]))
        sizes = {a: (n // known if int(v) == -1 else int(v)) for a, v in sizes.items()}
        try:
            vmesh.check_divisible(mot.parallel_constraints(self.model_config()), sizes, max_devices=n,
                                  ring=vmesh.ring_degree(mesh))
        except vmesh.ShardingConfigError as e:
            raise OptionError("mesh", f"{mesh!r}: {e}") from None

    def warn_prompts(self, prompts) -> list[str]:
        """Warn (``ShortPromptWarning`` + the log) about short unstructured prompts when this model
        needs the structured format (Edge). Returns the warnings."""
        if not self.warn_short_prompts:
            return []
        out = [w for w in (short_prompt_warning(p) for p in prompts) if w]
        for w in out:
            log.warning(w)
            warnings.warn(w, ShortPromptWarning, stacklevel=3)
        return out

    # ------------------------------------------------------------------ phases
    def tokenize(self, prompts, negative: str | None, *, num_frames: int, height: int, width: int, fps: float,
                 system_prompt: bool | None = None, metadata: bool = True, tokenizer=None):
        """Token ids of the prompts and of the negative prompt (one per prompt), as lists."""
        tok, template, specials, eos, vs = tokenizer or self.load_tokenizer()
        use_sys = self.use_system_prompt if system_prompt is None else system_prompt
        image = num_frames == 1

        def ids(text):
            msgs = ([{"role": "system", "content": SYSTEM_PROMPT_IMAGE if image else SYSTEM_PROMPT_VIDEO}]
                    if use_sys else []) + [{"role": "user", "content": text}]
            rendered = chat.render(msgs, template, add_generation_prompt=True, specials=specials, add_vision_id=False)
            return chat.encode(tok, rendered) + [eos, vs]

        cond, uncond = [], []
        for p in prompts:
            c, u = prompt_texts(p, negative, num_frames=num_frames, height=height, width=width, fps=fps,
                                resolution=metadata, duration=metadata)
            cond.append(ids(c))
            uncond.append(ids(u))
        return cond, uncond

    def encode_conditioning(self, *, image=None, video=None, height: int, width: int, num_frames: int,
                            cond_frames: int = 2, keep: str = "first", vae=None):
        """The fixed leading latent frames [1, C, n, h, w] (normalised): n = 1 for an image, ``cond_frames``
        for a clip; None for text-to-video (and for one-frame generation, where the reference ignores
        the image)."""
        if num_frames == 1 or (image is None and video is None):
            return None
        if image is not None and video is not None:
            raise ValueError("give either an image or a video, not both")
        if image is not None:
            px = image_pixels(image, height, width)[:, None]
        else:
            need = 4 * (int(cond_frames) - 1) + 1
            frames = np.asarray(video)
            clip = frames[:need] if keep == "first" else frames[-need:]
            px = video_pixels(clip, height, width)
            if px.shape[1] < need:  # a short clip: repeat its last frame (as the reference pads)
                px = np.concatenate([px, np.repeat(px[:, -1:], need - px.shape[1], axis=1)], axis=1)
        return cvae.encode(vae or self.load_vae(), px[None])

    def latent_shape(self, batch: int, height: int, width: int, num_frames: int):
        sf, tf = cvae.factors(self.vae_config())
        return (batch, (num_frames - 1) // tf + 1, height // sf, width // sf, self.model_config().latent_channel)

    def _tables(self, cfg, lens: list[int], lu: int, grid, fps):
        """Per-row rotary tables: text [R, Lu, hd] (the same for every row), vision [R, Lg, hd]."""
        cu, su = mot.rope_tables(cfg, mot.text_positions(lu, cfg.enable_fps_modulation))
        cg, sg = [], []
        for n in lens:
            c, s = mot.rope_tables(cfg, mot.vision_positions(cfg, grid, mot.vision_offset(cfg, n), fps=fps,
                                                             temporal_compression=cvae.factors(self.vae_config())[1]))
            cg.append(c), sg.append(s)
        r = len(lens)
        return (np.broadcast_to(cu, (r, *cu.shape)).copy(), np.broadcast_to(su, (r, *su.shape)).copy(),
                np.stack(cg), np.stack(sg))

    @collect_own_garbage()  # frees what it loaded when it returns, without walking the caller's heap
    def sample_latents(self, cond_ids, uncond_ids=None, *, cond_latents=None, latents=None, seed: int = 0,
                       height: int = 720, width: int = 1280, num_frames: int = 189, steps: int = 35,
                       guidance: float = 6.0, fps: float = 24.0, shift: float | None = None, scheduler=None,
                       model=None, start: int = 0, state=None, on_step=None) -> np.ndarray:
        """Denoise; returns latents [B, C, F, H, W] (normalised). ``cond_ids`` / ``uncond_ids``: token-id
        lists (one per prompt; ``uncond_ids`` used when ``guidance != 1``); ``cond_latents`` from
        :meth:`encode_conditioning`; ``latents``: the initial noise [B, C, F, H, W] (default: from
        ``seed``) or, to resume at ``start``, the sample after step ``start - 1`` with its ``state``."""
        sched = scheduler or self.scheduler(steps, shift)
        b = len(cond_ids)
        shape = self.latent_shape(b, height, width, num_frames)
        _, f, h, w, c = shape
        mask = np.zeros((1, f, 1, 1, 1), np.float32)
        fixed = np.zeros((1, f, h, w, c), np.float32)
        if cond_latents is not None:
            z = np.asarray(cond_latents, np.float32).transpose(0, 2, 3, 4, 1)
            n = z.shape[1]
            fixed[:, :n], mask[:, :n] = z, 1.0
        if latents is None:
            if start:
                raise ValueError("resuming (start > 0) needs the latents saved at that step")
            noise = self.initial_noise(shape, seed)
            x = jnp.asarray(mask) * jnp.asarray(fixed) + (1.0 - jnp.asarray(mask)) * noise
        else:
            x = jnp.asarray(np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1))
        use_cfg = uncond_ids is not None and guidance != 1.0
        rows = list(cond_ids) + (list(uncond_ids) if use_cfg else [])
        lens = [len(r) for r in rows]
        lu = max(lens)
        ids = chat.pad(rows, lu, 0)
        tmask = np.arange(lu)[None] < np.asarray(lens)[:, None]
        cfg = self.model_config()
        grid = mot.patch_grid(cfg, (f, h, w))
        cu, su, cg, sg = self._tables(cfg, lens, lu, grid, fps)
        per_frame = grid[1] * grid[2]
        noisy = np.broadcast_to(np.repeat(1.0 - mask[0, :, 0, 0, 0], per_frame), (len(rows), f * per_frame)).copy()
        keep = jnp.asarray(1.0 - mask)
        model = model or self.load_model()
        state_m, cfg = model
        runner = state_m if isinstance(state_m, DiTRunner) else None
        cache = mot.text_cache(state_m, cfg, ids, cu, su)
        consts = dict(noisy=jnp.asarray(noisy), keep=keep, cos=jnp.asarray(cg), sin=jnp.asarray(sg), cache=cache,
                      tmask=jnp.asarray(tmask), g=jnp.float32(guidance))
        thw = (f, h, w)
        if runner is None:
            step = _single_device_step(cfg, _sched_key(sched), use_cfg, thw)

            def call(x, st, i):
                return step(state_m, x, st, i, consts["noisy"], keep, consts["cos"], consts["sin"], cache,
                            consts["tmask"], consts["g"])
        else:
            timesteps = jnp.asarray(sched.timesteps)
            pre = jax.jit(lambda x, i: (mot.patchify(cfg, jnp.concatenate([x, x]) if use_cfg else x),
                                        jnp.broadcast_to(timesteps[i], noisy.shape) * consts["noisy"]))
            post = jax.jit(partial(_step_update, sched, use_cfg, cfg, thw))
            if self.step_cache is not None:  # per CFG branch: the [cond; uncond] rows of the one batch
                self.step_cache.begin(1, 2 if use_cfg else 1, start)
                runner.use_cache(self.step_cache)

            def call(x, st, i):
                patches, t = pre(x, i)
                pred = mot.vision(runner, cfg, patches, t, consts["noisy"], consts["cos"], consts["sin"], cache,
                                  consts["tmask"])
                return post(x, st, pred, i, keep, consts["g"])

        state = sched.init_state(x) if state is None else jax.tree.map(jnp.asarray, state)
        n_steps = len(sched.timesteps)
        for i in range(start, n_steps):
            t0 = time.perf_counter()
            x, state = call(x, state, jnp.int32(i))
            if on_step is not None:
                x.block_until_ready()
                on_step(StepInfo(i, n_steps, float(sched.timesteps[i]), time.perf_counter() - t0), x, state)
        model = cache = None  # (the step closures read cache: released, not deleted)
        return np.asarray(x).transpose(0, 4, 1, 2, 3)

    def decode_video(self, latents: np.ndarray, vae=None) -> np.ndarray:
        return to_unit_range(cvae.decode(vae or self.load_vae(), latents))

    #: the prompt length a plan assumes (the structured JSON prompts run to several hundred tokens)
    PLAN_TEXT_TOKENS = 1024

    def plan_units(self, request) -> list:
        """No text encoder runs in encode (it tokenizes): with an image, the VAE encode of the fixed
        frame. Sample: the text pathway's key/value cache (once per run) and one vision step on the
        guidance batch, both on this pipeline's mesh with every weight resident (text and vision
        pathways), text at :attr:`PLAN_TEXT_TOKENS`; decode: the Wan2.2 VAE's one-latent-frame
        program with its causal cache."""
        from vidax.core import plan as vplan

        b, lu = len(request.prompts), self.PLAN_TEXT_TOKENS
        vcfg = self.vae_config()
        units = []
        if getattr(request, "image", None) is not None and request.num_frames > 1:
            units.append(cvae.plan_encode_unit(vcfg, request.height, request.width))
        cfg = self.model_config()
        runner = mot.runner(mot.abstract_state(cfg, self.dtype), cfg, self.mesh, self.parallelism)
        nb = 2 * b if request.guidance != 1.0 else b
        _, f, h, w, _ = self.latent_shape(nb, request.height, request.width, request.num_frames)
        grid = mot.patch_grid(cfg, (f, h, w))
        lg = grid[0] * grid[1] * grid[2]
        params = runner.params
        tab = lambda n: vplan.abstract((nb, n, cfg.head_dim), np.float32)  # noqa: E731
        text_in = {"ids": vplan.abstract((nb, lu), np.int32), "cos_u": tab(lu), "sin_u": tab(lu)}
        text = jax.jit(runner.context_apply, keep_unused=True)
        units.append(vplan.Unit("sample", "text pathway (K/V cache, once per run)", text, (params, text_in),
                                weights=params, note=f"batch {nb} x {lu} text tokens"))
        shape = (cfg.num_hidden_layers, nb, lu, cfg.num_key_value_heads, cfg.head_dim)
        kv = {"gen": {"k": np.empty(shape, np.dtype(self.dtype)), "v": np.empty(shape, np.dtype(self.dtype))}}
        kv = jax.tree.map(lambda a, s: vplan.abstract(a.shape, a.dtype, s), kv, runner.context_shardings(kv))
        vision = jax.jit(lambda p, a, c: runner.apply(p, **a, context=c), keep_unused=True)
        t = vplan.abstract((nb, lg), np.float32)
        vis_in = {"patches": vplan.abstract((nb, lg, cfg.patch_latent_dim), self.dtype), "t": t, "noisy": t,
                  "cos": tab(lg), "sin": tab(lg), "text_mask": vplan.abstract((nb, lu), bool)}
        units.append(vplan.Unit("sample", "vision step", vision, (params, vis_in, kv), weights=params,
                                note=f"batch {nb} x {lg:,} vision tokens against the text cache"))
        tiled = bool(request.options.get("vae_tiling"))  # tiles spread over the decode pool's chips
        units.append(cvae.plan_decode_unit(vcfg, b, h, w, tiled=tiled,
                                           devices=self.pool_devices(request, "decode")))
        return units

    def fingerprint(self, component: str) -> str:
        if self.preset is not None:
            return f"preset:{self.preset_name}:{component}:{self.dtype.name}"
        files = {"text": ["text_tokenizer", "model_index.json"], "dit": ["transformer", "scheduler", "model_index.json"],
                 "vae": ["vae"]}[component]
        return f"{component}:{self.dtype.name}:" + files_fingerprint(self.folder, files)

    # ------------------------------------------------------------------ the stage protocol
    def encode(self, request, image: np.ndarray | None = None) -> dict[str, Named]:
        """Token ids of the prompts and negative prompts (padded, with lengths), and the fixed latent
        frames of an image or a clip (``cond_latents``)."""
        o = request.options
        self.warn_prompts(request.prompts)
        cond, uncond = self.tokenize(request.prompts, request.negative_prompt, num_frames=request.num_frames,
                                     height=request.height, width=request.width, fps=request.fps,
                                     system_prompt=o.get("system_prompt"),
                                     metadata=True if o.get("metadata") is None else o.get("metadata"))
        out = {}
        for name, rows in (("prompt", cond), ("negative", uncond)):
            lu = max(len(r) for r in rows)
            out[f"{name}_ids"] = Named(chat.pad(rows, lu, 0), ("batch", "token"), {"role": "token ids, end-padded"})
            out[f"{name}_lengths"] = Named(np.asarray([len(r) for r in rows], np.int32), ("batch",))
        video = read_video(o["video"]) if o.get("video") is not None else None
        cl = self.encode_conditioning(image=image, video=video, height=request.height, width=request.width,
                                      num_frames=request.num_frames, cond_frames=int(o.get("cond_frames") or 2),
                                      keep=o.get("video_keep") or "first")
        if cl is not None:
            out["cond_latents"] = Named(cl, _LATENT, {"role": "image" if image is not None else "video",
                                                      "normalised": True})
        return out

    @staticmethod
    def _rows(ids, lengths):
        return [list(map(int, r[:int(n)])) for r, n in zip(np.asarray(ids), np.asarray(lengths))]

    def sample(self, conditioning: dict, request, *, resume: dict | None = None, on_step=None) -> dict[str, Named]:
        o = request.options
        sched = self.scheduler(request.steps, o.get("shift"))
        cond = self._rows(conditioning["prompt_ids"], conditioning["prompt_lengths"])
        uncond = self._rows(conditioning["negative_ids"], conditioning["negative_lengths"])
        start, latents, state = 0, None, None
        if resume is not None:
            start = int(resume["step"])
            shape = self.latent_shape(len(cond), request.height, request.width, request.num_frames)
            latents, state = unpack_state(resume["arrays"], sched.init_state(jnp.zeros(shape, jnp.float32)))

        def step_cb(info, x, st):
            on_step(info, lambda: pack_state(np.asarray(x).transpose(0, 4, 1, 2, 3), st))

        lat = self.sample_latents(cond, uncond, cond_latents=conditioning.get("cond_latents"), latents=latents,
                                  seed=request.seed, height=request.height, width=request.width,
                                  num_frames=request.num_frames, steps=request.steps, guidance=request.guidance,
                                  fps=request.fps, scheduler=sched, start=start, state=state,
                                  on_step=None if on_step is None else step_cb)
        return {"latents": Named(lat, _LATENT, {"model": request.model, "layout": "reference [B, C, F, H, W]",
                                                "normalised": True})}

    # ------------------------------------------------------------------ probe hooks
    def denoise_once(self, latents, sigmas, conditioning, request=None) -> np.ndarray:
        """The clean estimate ``x - sigma * v`` per row at the model timestep ``int(sigma * 1000)``
        (how the UniPC schedule hands it over), the first prompt, no guidance."""
        cond = self._rows(conditioning["prompt_ids"], conditioning["prompt_lengths"])[:1]
        x = np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1)
        model = self.load_model()
        state_m, cfg = model
        _, f, h, w, _ = x.shape
        grid = mot.patch_grid(cfg, (f, h, w))
        fps = float(getattr(request, "fps", None) or 24.0)
        cu, su, cg, sg = self._tables(cfg, [len(cond[0])], len(cond[0]), grid, fps)
        ids = jnp.asarray(chat.pad(cond, len(cond[0]), 0))
        runner = state_m if isinstance(state_m, DiTRunner) else None
        cache = mot.text_cache(state_m, cfg, ids, cu, su)
        fwd = partial(mot.vision, state_m, cfg)
        out = []
        for i, s in enumerate(np.asarray(sigmas, np.float32)):
            xi = jnp.asarray(x[i:i + 1])
            patches = mot.patchify(cfg, xi)
            lg = patches.shape[1]
            t = jnp.full((1, lg), float(int(s * 1000)), jnp.float32)
            pred = fwd(patches.astype(jnp.float32 if runner else mot.state_dtype(state_m)), t, jnp.ones((1, lg)),
                       jnp.asarray(cg), jnp.asarray(sg), cache, jnp.ones((1, len(cond[0])), bool))
            v = mot.unpatchify(cfg, jnp.asarray(pred, jnp.float32), (f, h, w))
            out.append(np.asarray(xi - s * v))
        del model
        return np.concatenate(out).transpose(0, 4, 1, 2, 3)

    # ------------------------------------------------------------------ one call
    def generate(self, prompt, negative_prompt=None, *, image=None, video=None, seed: int = 0, height: int = 720,
                 width: int = 1280, num_frames: int = 189, steps: int = 35, guidance: float = 6.0, fps: float = 24.0,
                 cond_frames: int = 2, video_keep: str = "first", shift: float | None = None, on_step=None):
        """Prompt(s) (+ an image or a clip) -> uint8 frames [B, F, H, W, 3]."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        self.geometry().check(height, width, num_frames)
        self.warn_prompts(prompts)
        cond, uncond = self.tokenize(prompts, negative_prompt, num_frames=num_frames, height=height, width=width,
                                     fps=fps)
        vae = self.load_vae()
        cl = self.encode_conditioning(image=image, video=video, height=height, width=width, num_frames=num_frames,
                                      cond_frames=cond_frames, keep=video_keep, vae=vae)
        lat = self.sample_latents(cond, uncond, cond_latents=cl, seed=seed, height=height, width=width,
                                  num_frames=num_frames, steps=steps, guidance=guidance, fps=fps, shift=shift,
                                  on_step=on_step)
        return to_uint8(self.decode_video(lat, vae=vae))
