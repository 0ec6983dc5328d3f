"""Cosmos-Predict2.5 world generation: Qwen2.5-VL text features (fp32) -> DiT sampling -> Wan2.1 VAE decode.

One model does text-, image- and video-to-world (diffusers ``Cosmos2_5_PredictBasePipeline``):

- **Text2World**: pure noise, every latent frame denoised, the timestep the scheduler's sigma;
- **Image2World** (``--image``): the image is the first pixel frame; its latent frame is fixed;
- **Video2World** (``--video PATH``): the last ``4 (cond_frames - 1) + 1`` frames of the clip are
  the first pixel frames; ``cond_frames`` (1 or 2) latent frames are fixed.

Conditioning is latent substitution, exactly as the reference does it at every step: the DiT's
input is ``m * cond + (1 - m) * x`` with the condition-mask channel ``m`` concatenated, the
conditioning frames get the timestep ``cond_timestep`` (1e-4) while the others get the sigma, and
the predicted velocity on conditioning frames is replaced by the ground-truth one
``(x_initial_noise - cond) * m``. Guidance is the reference's ``v_c + g (v_c - v_u)`` with the
default negative prompt. No other preconditioning: the DiT sees the flow sigma in [0, 1] the
scheduler (UniPC on Karras-EDM levels mapped to flow sigmas) gives.

Only the leading conditioning frames are VAE-encoded: the Wan VAE is causal, so latent frame ``k``
depends on pixel frames ``<= 4k`` only, and the reference's conditioning latents beyond the fixed
frames are multiplied by zero everywhere.

Sources: ``"tiny"`` (seeded random weights, byte tokenizer) or a diffusers folder (``model_index.json``
with ``Cosmos2_5_PredictBasePipeline``: ``text_encoder/`` (Qwen2.5-VL), ``tokenizer/``,
``transformer/``, ``vae/`` (``AutoencoderKLWan``), ``scheduler/``), local or at an fsspec URL.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.runtime import collect_own_garbage
from vidax.core import runner as vrunner
from vidax.core.runner import DiTRunner
from vidax.core.sampling import StepInfo
from vidax.models.cosmos import chat, text as ctext
from vidax.models.cosmos import dit as cdit
from vidax.models.cosmos import vae as cvae
from vidax.pipeline import (DecodeSpan, Geometry, Named, Option, OptionError, Pipeline, pack_state, to_uint8,
                            to_unit_range, unpack_state)
from vidax.schedulers import from_diffusers_config
from vidax.text import lm
from vidax.text.tokenizer import load_tokenizer
from vidax.weights.fingerprint import files_fingerprint
from vidax.weights.source import is_url
from vidax.models.wan.tiles import TileStages, tiling_option
from vidax.weights.keymap import lazy_params

log = logging.getLogger(__name__)

_CONFIG_FILES = ("model_index.json", "*/config.json", "scheduler/scheduler_config.json", "tokenizer/*.json",
                 "tokenizer/*.jinja")
#: the scheduler the diffusers conversion saves with Predict2.5 (used by the presets)
SCHEDULER = dict(_class_name="UniPCMultistepScheduler", use_karras_sigmas=True, use_flow_sigmas=True,
                 prediction_type="flow_prediction", sigma_max=200.0, sigma_min=0.01, num_train_timesteps=1000)
_LATENT = ("batch", "channel", "frame", "height", "width")
_EMB = ("batch", "token", "channel")


@dataclass(frozen=True)
class TinyPreset:
    """A complete, seeded random-weight Predict2.5-shaped model that runs on a laptop CPU (a hashed
    word tokenizer, :class:`vidax.models.cosmos.chat.WordTokenizer`)."""

    text: lm.LMConfig = field(default_factory=lambda: lm.LMConfig(
        vocab_size=384, hidden_size=24, intermediate_size=48, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=12,
        qkv_bias=True, rms_norm_eps=1e-6, model_type="qwen2_5_vl"))
    dit: cdit.CosmosDiTConfig = cdit.PRESETS["tiny"]
    vae: cvae.Config = cvae.TINY_21
    max_text_len: int = 256
    seed: int = 0


PRESET_SOURCES = {"tiny": TinyPreset()}


def _rgb_uint8(image) -> np.ndarray:
    if hasattr(image, "convert"):  # PIL
        image = np.asarray(image.convert("RGB"))
    a = np.asarray(image)
    if a.ndim != 3 or a.shape[-1] != 3 or a.dtype != np.uint8:
        raise ValueError(f"image must be uint8 [H, W, 3], got {a.dtype} {list(a.shape)}")
    return a


def image_pixels(image, height: int, width: int) -> np.ndarray:
    """The reference's Image2World preprocessing: ``to_tensor`` (/255), a *nearest* resize of the
    tensor to (height, width) (``torch.nn.functional.interpolate``'s default), to [-1, 1]. [3, H, W]."""
    a = _rgb_uint8(image).astype(np.float32).transpose(2, 0, 1) / np.float32(255.0)
    a = cdit.resize_nearest(a, height, width)
    return (a * 2.0 - 1.0).astype(np.float32)


def video_pixels(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """The reference's Video2World preprocessing of PIL frames: bilinear PIL resize, /255, to [-1, 1].
    ``frames`` uint8 [F, H, W, 3] -> [3, F, height, width]."""
    import PIL.Image

    out = []
    for f in np.asarray(frames):
        im = PIL.Image.fromarray(np.asarray(f, np.uint8)).resize((width, height), resample=PIL.Image.Resampling.BILINEAR)
        out.append(np.asarray(im.convert("RGB")).astype(np.float32) / np.float32(255.0))
    v = np.stack(out).transpose(3, 0, 1, 2)
    return (v * 2.0 - 1.0).astype(np.float32)


def read_video(url: str) -> np.ndarray:
    """uint8 frames [F, H, W, 3] of a video at a path or any fsspec URL (imageio / ffmpeg)."""
    import tempfile

    import imageio.v3 as iio

    from vidax.weights.source import filesystem

    p = Path(str(url))
    if not is_url(str(url)) and p.exists():
        return np.asarray(iio.imread(p, plugin="FFMPEG"))
    fs, path = filesystem(str(url))
    with tempfile.NamedTemporaryFile(suffix=Path(path).suffix or ".mp4") as f:
        f.write(fs.cat_file(path))
        f.flush()
        return np.asarray(iio.imread(f.name, plugin="FFMPEG"))


def video_read_error(url: str, e: BaseException) -> str:
    """One line saying why a conditioning clip cannot be read (never ffmpeg's whole stderr)."""
    if isinstance(e, FileNotFoundError):
        return f"{url}: no such file"
    return f"{url}: not a readable video ({type(e).__name__}); give an mp4/webm/... clip"


def video_digest(url: str) -> str:
    from vidax.weights.source import filesystem

    fs, path = filesystem(str(url))
    return hashlib.sha256(fs.cat_file(path)).hexdigest()[:20]


def _step_inputs(sigmas, use_cfg, x, i, aux):
    """The DiT's inputs at step ``i``: fixed frames substituted, per-frame timesteps (the
    conditioning timestep on fixed frames, the sigma elsewhere), the condition-mask channel."""
    t = aux["ind"] * aux["ct"] + (1.0 - aux["ind"]) * sigmas[i]  # [1, F]
    xin = aux["cm"] * aux["cl"] + (1.0 - aux["cm"]) * x
    t = jnp.broadcast_to(t, (x.shape[0], t.shape[1]))
    if use_cfg:
        xin, t = jnp.concatenate([xin, xin], axis=0), jnp.concatenate([t, t], axis=0)
    return xin, t, jnp.broadcast_to(aux["cm"], xin.shape[:-1] + (1,))


def _step_update(sched, use_cfg, x, state, v, i, aux, g):
    """Ground-truth velocity on fixed frames, the reference's guidance ``v_c + g (v_c - v_u)``, the
    scheduler step."""
    v = v.astype(jnp.float32)
    keep = 1.0 - aux["cm"]
    if use_cfg:
        b = x.shape[0]
        vc, vu = aux["gt"] + v[:b] * keep, aux["gt"] + v[b:] * keep
        v = vc + g * (vc - vu)
    else:
        v = aux["gt"] + v * keep
    return sched.step(state, v, i, x)


def _sched_key(sched) -> tuple:
    key = (type(sched).__name__, sched.num_inference_steps, int(sched.begin_index),
           json.dumps(sched.config, sort_keys=True, default=str))
    _SCHEDS.setdefault(key, sched)
    return key


_SCHEDS: dict = {}


@functools.lru_cache(maxsize=16)
def _single_device_step(cfg: cdit.CosmosDiTConfig, sched_key: tuple, use_cfg: bool, kv: bool = False):
    """The jitted sampling step (model + guidance + scheduler) for one device; ``kv``: ``ctx`` is the
    blocks' text keys / values computed once (:func:`_single_device_context`)."""
    sched = _SCHEDS[sched_key]
    inputs = partial(_step_inputs, jnp.asarray(sched.sigmas), use_cfg)

    @jax.jit
    def step(p, x, state, i, ctx, g, aux):  # p: (the DiT state, its RoPE tables)
        xin, t, cm = inputs(x, i, aux)
        if kv:
            v = cdit.forward(p[0], cfg, xin, t, None, cond_mask=cm, rope=p[1], context=ctx)
        else:
            v = cdit.forward(p[0], cfg, xin, t, ctx, cond_mask=cm, rope=p[1])
        return _step_update(sched, use_cfg, x, state, v, i, aux, g)

    return step


@functools.lru_cache(maxsize=8)
def _single_device_context(cfg: cdit.CosmosDiTConfig):
    """The jitted one-device program of the blocks' text keys / values (once per sample stage)."""
    return jax.jit(lambda state, ctx: cdit.context(state, cfg, ctx))


class CosmosVAEStages:
    """The Wan2.2-VAE side of a Cosmos pipeline (Predict2.5 and Cosmos3 share it): its config and
    weights, the decode stages (frame spans or, with :class:`TileStages`, tiles), the probe hooks,
    the initial noise and the encode stage's video digest. Mixed in before the pipeline base."""

    def vae_config(self) -> cvae.Config:
        return self.preset.vae if self.preset else cvae.config_from_folder(self.config_folder / "vae")

    def load_vae(self):
        if self.preset:
            return cvae.init(self.preset.vae, self.preset.seed + 3)
        return cvae.load(self.folder / "vae")

    def stage_params(self, kind, request, span=None):
        p = super().stage_params(kind, request, span)
        if kind == "encode" and request.options.get("video") is not None:
            p["video_digest"] = video_digest(request.options["video"])
            p["vae"] = self.fingerprint("vae")
        return p

    def initial_noise(self, shape, seed: int):
        return jax.random.normal(jax.random.fold_in(jax.random.key(seed), 0x7FFFFFFF), shape, jnp.float32)

    def decode_frames(self, latents: np.ndarray, start: int, stop: int, cache=None, vae=None, tiling: bool = False):
        px, cache = cvae.decode_frames(vae or self.load_vae(), latents, start, stop, cache, tiling)
        return to_uint8(to_unit_range(px)), cache

    def decode(self, latents: dict, span: DecodeSpan, carry: dict | None, request):
        if span.tile is not None:  # a tile stage of the tiled decode (TileStages)
            return self.decode_tile_span(latents, span, carry, request)
        a, b = span.frames
        frames, cache = self.decode_frames(latents["latents"], a, b, carry, tiling=bool(request.options.get("vae_tiling")))
        return ({"frames": Named(frames, ("batch", "frame", "height", "width", "rgb"),
                                 {"latent_frames": [a, b], "units": "uint8 RGB"})}, cache)

    def vae_encode(self, video: np.ndarray) -> np.ndarray:
        return cvae.encode(self.load_vae(), video)

    def vae_decode(self, latents: np.ndarray) -> np.ndarray:
        return self.decode_video(latents)


class CosmosPredict(CosmosVAEStages, TileStages, Pipeline):
    """Cosmos-Predict2.5 (2B / 14B) text-, image- and video-to-world on the pipeline protocol, over
    the library methods :meth:`encode_prompts`, :meth:`encode_conditioning`, :meth:`sample_latents`,
    :meth:`decode_frames`."""

    FAMILY = "cosmos"
    STEP_CACHE = True
    OPTIONS = (
        Option("video", str, None, "Video2World: a conditioning clip (path or URL); its last 4(cond_frames-1)+1 "
                                   "frames start the generated clip", stages=("encode",)),
        Option("cond_frames", int, 2, "Video2World: latent frames the clip fixes (1: one pixel frame, 2: five)",
               choices=(1, 2), stages=("encode", "sample")),
        Option("cond_timestep", float, 1e-4, "the timestep the DiT sees on conditioning frames", minimum=0.0,
               maximum=1.0, stages=("sample",)),
        tiling_option(),
    )
    COMPONENTS = {"encode": ("text",), "image": ("vae",), "sample": ("dit",), "decode": ("vae",)}
    CODE_DEPS = ("vidax.models.wan.vae",)

    def __init__(self, source: str | Path = "tiny", *, dtype=np.float32, mesh=None, parallelism: str | None = None,
                 offload_chunk_size=None, prefetch: bool = True):
        self.dtype = np.dtype(dtype)
        self.mesh, self.parallelism = mesh, parallelism
        self.offload_chunk_size, self.prefetch = offload_chunk_size, prefetch
        index = self.open_source(source, PRESET_SOURCES, _CONFIG_FILES, "Cosmos2_5_PredictBasePipeline")
        if index.get("_class_name") not in (None, "Cosmos2_5_PredictBasePipeline"):
            raise ValueError(f"{source}: a {index.get('_class_name')} folder, not Cosmos2_5_PredictBasePipeline")
        self.max_text_len = self.preset.max_text_len if self.preset else ctext.MAX_LENGTH

    # ------------------------------------------------------------------ configs
    def dit_config(self) -> cdit.CosmosDiTConfig:
        if self.preset:
            return self.preset.dit
        return cdit.CosmosDiTConfig.from_diffusers(json.loads((self.config_folder / "transformer" / "config.json").read_text()))

    def geometry(self) -> Geometry:
        dc = self.dit_config()
        sf, tf = cvae.factors(self.vae_config())
        return Geometry(spatial=sf, temporal=tf, latent_channels=dc.out_channels, patch=tuple(dc.patch_size),
                        num_heads=dc.num_heads, max_grid=min(dc.max_grid))

    def scheduler(self, steps: int):
        if self.preset:
            return from_diffusers_config(dict(SCHEDULER), steps)
        return from_diffusers_config(self.config_folder / "scheduler", steps)

    # ------------------------------------------------------------------ component loaders
    def load_tokenizer(self):
        """``(tokenizer, chat template, special tokens, padding side)``."""
        if self.preset:
            return chat.WordTokenizer(self.preset.text.vocab_size), None, {}, "right"
        folder = self.folder / "tokenizer"
        side = json.loads((folder / "tokenizer_config.json").read_text()).get("padding_side", "right") \
            if (folder / "tokenizer_config.json").exists() else "right"
        return load_tokenizer(folder), chat.load_template(folder), chat.special_tokens(folder), side

    def load_text_encoder(self) -> lm.LMEncoder:
        """The Qwen2.5-VL text model in float32 (7B: 28 GB), tensor-parallel over every local device
        when there are several accelerators (``lm.tp_rules``: what does not divide stays replicated)."""
        if self.preset:
            return lm.init(self.preset.text, seed=self.preset.seed + 1)
        return lm.load_lm(self.folder / "text_encoder", dtype=np.float32, mesh=self.text_mesh())

    @property
    def scaled(self) -> bool:
        """A runner (not the one-device forward): a mesh, offloading or a step cache."""
        return self.mesh is not None or self.offload_chunk_size is not None or self.step_cache is not None

    def _load_dit_host(self):
        cfg = self.dit_config()
        if self.preset:
            return cdit.init_state(cfg, seed=self.preset.seed + 2, dtype=self.dtype), cfg
        with self.lora_merging("dit"):  # LoRAs merged in float32 before the cast
            return cdit.load_dit(self.folder / "transformer", cfg, dtype=self.dtype)

    def lora_targets(self) -> dict:
        from vidax.models.cosmos import lora as clora

        return self.transformer_lora_targets(clora.aliases(self.dit_config()), "this Cosmos DiT (transformer)")

    def load_dit(self):
        """DiT state + config on one device, or (``mesh`` / ``offload_chunk_size``) a
        :class:`~vidax.core.runner.DiTRunner` that places or streams it."""
        with lazy_params(self.scaled and self.offload_chunk_size is None):  # placed: a host reads its shards only
            params, cfg = self._load_dit_host()
        if not self.scaled:
            return jax.device_put(params), cfg
        return cdit.runner(params, cfg, self.mesh, self.parallelism, offload_chunk_size=self.offload_chunk_size,
                           prefetch=self.prefetch), cfg

    # ------------------------------------------------------------------ checks
    def weight_loaders(self, request) -> list:
        return [("text encoder", self.load_text_encoder), ("DiT", self._load_dit_host), ("VAE", self.load_vae)]

    def check(self, request) -> None:
        """Prompts within the text length (the reference truncates silently), a readable
        conditioning clip with enough frames, not both an image and a clip."""
        o = request.options
        if o.get("video") is not None and getattr(request, "image", None) is not None:
            raise OptionError("video", "give either --image (Image2World) or --video (Video2World), not both")
        if self.preset is None and self._folder is None:
            return  # remote checkpoint not fetched yet: its configs were read; encode checks prompts
        if self.folder is not None:
            missing = [d for d in ("text_encoder", "tokenizer", "transformer", "vae", "scheduler")
                       if not (self.folder / d).is_dir()]
            if missing:
                raise OptionError("checkpoint", f"{self.folder}: missing {', '.join(d + '/' for d in missing)}")
        self._check_prompts(request)
        if o.get("video") is not None:
            try:
                n = len(read_video(o["video"]))
            except Exception as e:  # noqa: BLE001 - missing file, undecodable clip
                raise OptionError("video", video_read_error(o["video"], e)) from None
            need = 4 * (int(o.get("cond_frames") or 2) - 1) + 1
            if n < need:
                raise OptionError("video", f"{o['video']} has {n} frames; Video2World with cond_frames="
                                           f"{o.get('cond_frames')} needs at least {need}")

    def _check_prompts(self, request) -> None:
        tok, template, specials, _ = self.load_tokenizer()
        neg = request.negative_prompt if request.negative_prompt is not None else ctext.DEFAULT_NEGATIVE_PROMPT
        for name, texts in (("prompt", request.prompts), ("negative_prompt", [neg])):
            for i, n in enumerate(ctext.token_lengths(tok, texts, template, specials)):
                if n > self.max_text_len:
                    which = f" {i + 1}" if len(texts) > 1 else ""
                    raise OptionError(name, f"prompt{which} is {n} tokens long with its chat template; the text "
                                            f"encoder reads at most {self.max_text_len}: shorten it")

    # ------------------------------------------------------------------ phases
    def encode_prompts(self, prompts: list[str], tokenizer=None, encoder=None) -> np.ndarray:
        """Text features [B, max_text_len, L*D] float32 (the reference's normalised concatenation)."""
        tok, template, specials, side = tokenizer or self.load_tokenizer()
        enc = encoder or self.load_text_encoder()
        ids = ctext.token_ids(tok, prompts, self.max_text_len, template, specials, padding_side=side)
        return ctext.prompt_embeds(enc, ids)

    def encode_conditioning(self, *, image=None, video=None, height: int, width: int, cond_frames: int = 2,
                            vae=None) -> np.ndarray | None:
        """The fixed leading latent frames [1, C, n, h, w] (normalised): n = 1 for an image, ``cond_frames``
        for a clip (uint8 frames [F, H, W, 3]); None for Text2World."""
        if image is None and video is None:
            return None
        if image is not None and video is not None:
            raise ValueError("give either an image or a video, not both")
        if image is not None:
            px = image_pixels(image, height, width)[:, None]  # [3, 1, H, W]
        else:
            need = 4 * (int(cond_frames) - 1) + 1
            frames = np.asarray(video)
            if len(frames) < need:
                raise ValueError(f"the clip has {len(frames)} frames; {need} are needed for cond_frames={cond_frames}")
            px = video_pixels(frames[-need:], height, width)
        return cvae.encode(vae or self.load_vae(), px[None])

    def latent_shape(self, batch: int, height: int, width: int, num_frames: int):
        """Channels-last latents [B, f, h, w, C]."""
        sf, tf = cvae.factors(self.vae_config())
        return (batch, (num_frames - 1) // tf + 1, height // sf, width // sf, self.dit_config().out_channels)

    @collect_own_garbage()  # frees what it loaded when it returns, without walking the caller's heap
    def sample_latents(self, cond: np.ndarray, uncond: np.ndarray | None = None, *, cond_latents=None, latents=None,
                       seed: int = 0, height: int = 704, width: int = 1280, num_frames: int = 93, steps: int = 36,
                       guidance: float = 7.0, cond_timestep: float = 1e-4, scheduler=None, dit=None, start: int = 0,
                       state=None, on_step=None) -> np.ndarray:
        """Denoise; returns the final latents [B, C, F, H, W] (normalised, reference layout).

        ``cond`` / ``uncond``: text features (``uncond`` used when ``guidance > 1``); ``cond_latents``
        from :meth:`encode_conditioning`; ``latents``: the initial noise [B, C, F, H, W] (default: drawn
        from ``seed``), or to resume at ``start`` the sample saved after step ``start - 1`` with its
        scheduler ``state``. ``on_step(info, x, state)`` sees channels-last latents."""
        sched = scheduler or self.scheduler(steps)
        b = cond.shape[0]
        shape = self.latent_shape(b, height, width, num_frames)
        if latents is None:
            if start:
                raise ValueError("resuming (start > 0) needs the latents saved at that step")
            x = noise = self.initial_noise(shape, seed)
        else:
            x = jnp.asarray(np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1))
            # the ground-truth velocity of fixed frames is taken from the *initial* noise: given
            # latents at step 0 are that noise; a resumed run redraws it from the seed
            noise = x if start == 0 else self.initial_noise(shape, seed)
        aux = self._conditioning(cond_latents, shape, noise, cond_timestep)
        dit = dit or self.load_dit()
        x, state = self._denoise(dit, sched, x, cond, uncond if guidance > 1.0 else None, guidance, aux, start, state,
                                 on_step)
        del dit
        return np.asarray(x).transpose(0, 4, 1, 2, 3)

    def _conditioning(self, cond_latents, shape, noise, cond_timestep) -> dict:
        """Per-step constants: the conditioning latents ``cl`` and mask ``cm`` [1, F, h, w, 1|C], the
        per-frame conditioning indicator ``ind`` [1, F], the ground-truth velocity ``gt``."""
        b, f, h, w, c = shape
        cl = np.zeros((1, f, h, w, c), np.float32)
        ind = np.zeros((1, f), np.float32)
        if cond_latents is not None:
            z = np.asarray(cond_latents, np.float32).transpose(0, 2, 3, 4, 1)  # [1, n, h, w, C]
            n = z.shape[1]
            if z.shape[2:] != (h, w, c) or n > f:
                raise ValueError(f"conditioning latents {list(cond_latents.shape)} do not fit latents {list(shape)}")
            cl[:, :n] = z
            ind[:, :n] = 1.0
        cm = jnp.asarray(np.broadcast_to(ind[:, :, None, None, None], (1, f, h, w, 1)).copy())
        cl = jnp.asarray(cl)
        return {"cl": cl, "cm": cm, "ind": jnp.asarray(ind), "gt": (noise - cl) * cm,
                "ct": jnp.float32(cond_timestep)}

    def _denoise(self, dit, sched, x, cond, uncond, guidance, aux, start, state, on_step):
        params, cfg = dit
        runner = params if isinstance(params, DiTRunner) else None
        dt = runner.dtype if runner is not None else cdit.state_dtype(params)
        use_cfg = uncond is not None
        ctx = jnp.asarray(cond, dt)
        if use_cfg:
            ctx = jnp.concatenate([ctx, jnp.asarray(uncond, dt)], axis=0)
        if runner is not None:
            runner.check_shapes({"x": (ctx.shape[0], *x.shape[1:-1], cfg.in_channels - 1)})
        if self.step_cache is not None:  # per CFG branch
            self.step_cache.begin(1, 2 if use_cfg else 1, start)
            runner.use_cache(self.step_cache)
        inputs = partial(_step_inputs, jnp.asarray(sched.sigmas), use_cfg)
        update = partial(_step_update, sched, use_cfg)
        # the text keys / values (and the text projection) are computed once here, not every step
        kv = bool(vrunner.context_names(cdit.CosmosTransformer))
        if kv:
            ctx = _single_device_context(cfg)(params, ctx) if runner is None else runner.context({"ctx": ctx})
        ckw = {"context": ctx} if kv else {}

        g = jnp.float32(guidance)
        if runner is None:  # one compiled step per (config, schedule, guidance mode), reused across runs
            step = _single_device_step(cfg, _sched_key(sched), use_cfg, kv)
            pt, ph, pw = cfg.patch_size
            p = (params, cdit.rope_tables(cfg, (x.shape[1] // pt, x.shape[2] // ph, x.shape[3] // pw)))
            call = lambda x, state, i: step(p, x, state, i, ctx, g, aux)  # noqa: E731
        elif runner.offload is None and runner.cache is None:
            def model(p, xin, t, ctx, cm):
                if kv:
                    return runner.apply(p, xin, t, None, cond_mask=cm, context=ctx)
                return runner.apply(p, xin, t, ctx, cond_mask=cm)

            @jax.jit
            def step(p, x, state, i, ctx, g, aux):
                xin, t, cm = inputs(x, i, aux)
                return update(x, state, model(p, xin, t, ctx, cm), i, aux, g)

            p = runner.step_params({"x": x.shape})  # weights and RoPE tables: arguments of the step
            call = lambda x, state, i: step(p, x, state, i, ctx, g, aux)  # noqa: E731
        else:
            pre, post = jax.jit(inputs), jax.jit(update)

            def call(x, state, i):
                xin, t, cm = pre(x, i, aux)
                return post(x, state, runner(xin, t, None if kv else ctx, cond_mask=cm, **ckw), i, aux, g)

        state = sched.init_state(x) if state is None else jax.tree.map(jnp.asarray, state)
        n = len(sched.timesteps)
        for i in range(start, n):
            t0 = time.perf_counter()
            x, state = call(x, state, jnp.int32(i))
            if on_step is not None:
                x.block_until_ready()
                on_step(StepInfo(i, n, float(sched.sigmas[i]), time.perf_counter() - t0), x, state)
        return x, state

    def decode_video(self, latents: np.ndarray, vae=None) -> np.ndarray:
        """Latents [B, C, F, H, W] (normalised) -> video in [0, 1], [B, F, H, W, 3]."""
        return to_unit_range(cvae.decode(vae or self.load_vae(), latents))

    def text_config(self) -> lm.LMConfig:
        """The Qwen2.5-VL text model's config without its weights."""
        if self.preset:
            return self.preset.text
        return lm.LMConfig.from_hf(json.loads((self.config_folder / "text_encoder" / "config.json").read_text()))

    def plan_units(self, request) -> list:
        """Qwen2.5-VL's every-layer hidden states over the prompts (float32, tensor-parallel over the
        encode pool's chips as :meth:`load_text_encoder` shards it); one DiT call on the guidance
        batch on this pipeline's mesh; the Wan2.1 VAE's per-latent-frame decode with its causal cache."""
        from vidax.core import plan as vplan

        b = len(request.prompts)
        n = 1 if self.preset else self.pool_devices(request, "encode")  # as load_text_encoder splits it
        enc = lm.abstract(self.text_config(), np.float32)
        enc = lm.shard(enc, f"tp={n}") if n > 1 else enc
        ids = vplan.abstract((b, self.max_text_len), np.int32)
        units = [vplan.split_unit("encode", "Qwen2.5-VL text encoder (all layers)", enc, ids, None, None,
                                  method="hidden_states", note=f"{b} prompt(s) x {self.max_text_len} tokens"
                                  + (f", tp={n}" if n > 1 else ""))]
        cfg = self.dit_config()
        runner = cdit.runner(cdit.abstract_state(cfg, self.dtype), cfg, self.mesh, self.parallelism)
        nb = 2 * b if request.guidance > 1.0 else b
        _, f, h, w, c = self.latent_shape(nb, request.height, request.width, request.num_frames)
        pt, ph, pw = cfg.patch_size
        x = vplan.abstract((nb, f, h, w, c), np.float32)
        t = vplan.abstract((nb, f), np.float32)  # per-frame timesteps (conditioning frames at cond_timestep)
        ctx = vplan.abstract((nb, self.max_text_len, cfg.context_dim), self.dtype)
        cm = vplan.abstract((nb, f, h, w, 1), np.float32)
        units.append(vplan.Unit("sample", "DiT step", jax.jit(runner.apply), (runner.step_params({"x": x.shape}), x, t, ctx),
                                kwargs={"cond_mask": cm}, weights=runner.params,
                                note=f"batch {nb} x {(f // pt) * (h // ph) * (w // pw):,} tokens"))
        tiled = bool(request.options.get("vae_tiling"))  # tiles spread over the decode pool's chips
        units.append(cvae.plan_decode_unit(self.vae_config(), b, h, w, tiled=tiled,
                                           devices=self.pool_devices(request, "decode")))
        return units

    def fingerprint(self, component: str) -> str:
        if self.preset is not None:
            return f"preset:{self.preset_name}:{component}:{self.dtype.name}"
        files = {"text": ["text_encoder", "tokenizer"], "dit": ["transformer", "scheduler"], "vae": ["vae"]}[component]
        return f"{component}:{self.dtype.name}:" + files_fingerprint(self.folder, files)

    # ------------------------------------------------------------------ the stage protocol
    def encode(self, request, image: np.ndarray | None = None) -> dict[str, Named]:
        """Prompt (and negative prompt, default: the reference's) features computed in float32, stored
        in the request's dtype; with an image or a clip, the fixed latent frames ``cond_latents``."""
        self._check_prompts(request)
        tok, enc = self.load_tokenizer(), self.load_text_encoder()
        cond = self.encode_prompts(request.prompts, tok, enc)
        neg = request.negative_prompt if request.negative_prompt is not None else ctext.DEFAULT_NEGATIVE_PROMPT
        uncond = self.encode_prompts([neg] * len(request.prompts), tok, enc)
        del enc
        dt = np.dtype(np.float32) if request.dtype == "float32" else np.dtype(jnp.bfloat16)
        attrs = dict(model=request.model, computed_in="float32", stored_as=str(dt))
        out = {"prompt_embeds": Named(cond.astype(dt), _EMB, attrs), "negative_embeds": Named(uncond.astype(dt), _EMB, attrs)}
        o = request.options
        video = read_video(o["video"]) if o.get("video") is not None else None
        cl = self.encode_conditioning(image=image, video=video, height=request.height, width=request.width,
                                      cond_frames=int(o.get("cond_frames") or 2))
        if cl is not None:
            out["cond_latents"] = Named(cl, _LATENT, {"role": "image" if image is not None else "video",
                                                      "normalised": True})
        return out

    def sample(self, conditioning: dict, request, *, resume: dict | None = None, on_step=None) -> dict[str, Named]:
        sched = self.scheduler(request.steps)
        cond = conditioning["prompt_embeds"]
        uncond = conditioning.get("negative_embeds") if request.guidance > 1.0 else None
        start, latents, state = 0, None, None
        if resume is not None:
            start = int(resume["step"])
            shape = self.latent_shape(cond.shape[0], request.height, request.width, request.num_frames)
            latents, state = unpack_state(resume["arrays"], sched.init_state(jnp.zeros(shape, jnp.float32)))

        def step_cb(info, x, st):
            on_step(info, lambda: pack_state(np.asarray(x).transpose(0, 4, 1, 2, 3), st))

        ct = request.options.get("cond_timestep")
        lat = self.sample_latents(cond, uncond, cond_latents=conditioning.get("cond_latents"), latents=latents,
                                  seed=request.seed, height=request.height, width=request.width,
                                  num_frames=request.num_frames, steps=request.steps, guidance=request.guidance,
                                  cond_timestep=1e-4 if ct is None else ct, scheduler=sched, start=start, state=state,
                                  on_step=None if on_step is None else step_cb)
        return {"latents": Named(lat, _LATENT, {"model": request.model, "layout": "reference [B, C, F, H, W]",
                                                "normalised": True})}

    # ------------------------------------------------------------------ the probe hooks
    def denoise_once(self, latents, sigmas, conditioning, request=None) -> np.ndarray:
        """The DiT's clean-latent estimate ``x - sigma * v`` for each row at its flow sigma (no
        guidance, the text features of ``conditioning``'s first prompt; fixed frames from its
        ``cond_latents`` if any)."""
        params, cfg = dit = self.load_dit()
        x = np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1)
        ctx = np.asarray(conditioning["prompt_embeds"], np.float32)[:1]
        aux = self._conditioning(conditioning.get("cond_latents"), x.shape, jnp.zeros(x.shape, jnp.float32), 1e-4)
        out = []
        runner = params if isinstance(params, DiTRunner) else None
        dt = runner.dtype if runner is not None else cdit.state_dtype(params)
        fwd = None if runner is not None else jax.jit(cdit.forward, static_argnums=1)
        for i, s in enumerate(np.asarray(sigmas, np.float32)):
            xi = jnp.asarray(x[i:i + 1])
            t = aux["ind"] * 1e-4 + (1.0 - aux["ind"]) * s
            xin = aux["cm"] * aux["cl"] + (1.0 - aux["cm"]) * xi
            c = jnp.asarray(ctx, dt)
            v = runner(xin, t, c, cond_mask=aux["cm"]) if runner is not None else fwd(params, cfg, xin, t, c,
                                                                                        cond_mask=aux["cm"])
            x0 = xi - s * np.asarray(v, np.float32)
            x0 = aux["cm"] * aux["cl"] + (1.0 - aux["cm"]) * x0  # fixed frames are known exactly
            out.append(np.asarray(x0))
        del dit
        return np.concatenate(out).transpose(0, 4, 1, 2, 3)

    # ------------------------------------------------------------------ one call
    def generate(self, prompt, negative_prompt=None, *, image=None, video=None, seed: int = 0, height: int = 704,
                 width: int = 1280, num_frames: int = 93, steps: int = 36, guidance: float = 7.0,
                 cond_frames: int = 2, on_step=None) -> np.ndarray:
        """Prompt(s) (+ an image or a clip of uint8 frames [F, H, W, 3]) -> uint8 frames [B, F, H, W, 3]."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        self.geometry().check(height, width, num_frames)
        tok, enc = self.load_tokenizer(), self.load_text_encoder()
        cond = self.encode_prompts(prompts, tok, enc)
        uncond = None
        if guidance > 1.0:
            neg = negative_prompt if negative_prompt is not None else ctext.DEFAULT_NEGATIVE_PROMPT
            uncond = self.encode_prompts([neg] * len(prompts) if isinstance(neg, str) else list(neg), tok, enc)
        del enc
        vae = self.load_vae()
        cl = self.encode_conditioning(image=image, video=video, height=height, width=width, cond_frames=cond_frames,
                                      vae=vae)
        lat = self.sample_latents(cond, uncond, cond_latents=cl, seed=seed, height=height, width=width,
                                  num_frames=num_frames, steps=steps, guidance=guidance, on_step=on_step)
        return to_uint8(self.decode_video(lat, vae=vae))
