"""CogVideoX generation: prompt encode (T5-XXL, float32, no mask) -> DiT sampling -> VAE decode.

Sources:

- a preset name (:data:`PRESET_SOURCES`: ``tiny`` = 2B-shaped, ``tiny-5b``, ``tiny-5b-i2v``,
  ``tiny-1.5``, ``tiny-1.5-i2v``): seeded random weights, byte tokenizer, seconds on a CPU;
- a diffusers folder (``model_index.json`` with ``CogVideoXPipeline`` or
  ``CogVideoXImageToVideoPipeline``; ``text_encoder/ tokenizer/ transformer/ vae/ scheduler/``),
  local or at any fsspec URL (configs fetched first, weights when a phase needs them).

What the reference pipelines do, and this one does the same way:

- the prompt is tokenized to 226 tokens (padded, truncated — here a longer prompt is refused) and
  encoded **without an attention mask**; the embeddings of the padding are used as they come. The
  encode runs in float32 (a bf16 T5-XXL over 226 unmasked positions drifts by 16-37%) and only the
  embeddings are cast to the run's dtype;
- classifier-free guidance as a batch of two, optionally ``use_dynamic_cfg`` (the guidance scale
  follows ``1 + g (1 - cos(pi ((N - t) / N)^5)) / 2`` over the integer timesteps ``t``);
- the scheduler is the checkpoint's (``CogVideoXDDIMScheduler`` in the releases) unless the
  ``scheduler`` option picks ``ddim`` or ``dpm`` (the stochastic DPM-Solver++, noise from
  ``fold_in(key, step)``), both v-prediction with zero terminal SNR;
- 1.5 (temporal patch 2): an odd latent frame count gets extra leading noise frames
  (``additional_frames``), dropped after sampling; I2V's image latents are the image's VAE latent
  (a posterior sample, scaled by ``scaling_factor`` or divided by it for 1.5) followed by zero
  frames, channel-concatenated to the noisy latents; 1.5 I2V adds ``ofs = 2``;
- the DiT gets rotary tables built here ('linspace' grid cropped to the sample size for 1.0, a
  'slice' grid of ``max_size`` for 1.5), or the 2B's sin-cos table;
- decode: ``latents / scaling_factor`` through the VAE's frame batches; decode stages are whole
  batches, the causal-conv cache carried from one to the next (optionally spatially tiled).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.runtime import collect_own_garbage
from vidax.core.runner import DiTRunner
from vidax.core.sampling import StepInfo, make_step, make_update
from vidax.models.cogvideox import dit as cdit
from vidax.models.cogvideox import vae as cvae
from vidax.pipeline import (DecodeSpan, Geometry, Named, Option, OptionError, Pipeline, pack_state, to_uint8,
                            to_unit_range, unpack_state)
from vidax.schedulers import from_diffusers_config
from vidax.text import t5 as t5mod
from vidax.text.tokenizer import ByteTokenizer, load_tokenizer
from vidax.weights.fingerprint import files_fingerprint
from vidax.weights.keymap import lazy_params

_CONFIG_FILES = ("model_index.json", "*/config.json", "scheduler/scheduler_config.json")
_EMB_DIMS = ("batch", "token", "channel")
_LATENT_DIMS = ("batch", "channel", "frame", "height", "width")
T2V, I2V = "CogVideoXPipeline", "CogVideoXImageToVideoPipeline"
#: the released scheduler config (CogVideoX-5B / 1.5; the 2B's has snr_shift_scale 3.0)
RELEASED_SCHEDULER = dict(beta_end=0.012, beta_schedule="scaled_linear", beta_start=0.00085, clip_sample=False,
                          num_train_timesteps=1000, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                          set_alpha_to_one=True, snr_shift_scale=1.0, steps_offset=0, timestep_spacing="trailing")


@dataclass(frozen=True)
class TinyPreset:
    """A complete seeded random-weight CogVideoX-shaped model that runs on a laptop CPU."""

    dit: cdit.CogVideoXConfig
    pipeline_class: str = T2V
    text: t5mod.T5Config = field(default_factory=lambda: t5mod.T5Config(
        vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, feed_forward_proj="gated-gelu"))
    vae: cvae.CogVideoXVAEConfig = cvae.PRESETS["tiny"]
    scheduler: dict = field(default_factory=lambda: {"_class_name": "CogVideoXDDIMScheduler", **RELEASED_SCHEDULER})
    seed: int = 0


def _tiny_presets() -> dict:
    base = cdit.CogVideoXConfig(num_heads=4, head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
                                text_embed_dim=32, num_layers=2, sample_width=8, sample_height=8, sample_frames=5,
                                max_text_seq_length=226)  # the release's: a 20-word prompt fits (byte tokens)
    rot = replace(base, use_rotary_positional_embeddings=True)
    v15 = replace(rot, patch_size_t=2, patch_bias=False, sample_width=16, sample_height=16, sample_frames=9)
    sched2b = {"_class_name": "CogVideoXDDIMScheduler", **RELEASED_SCHEDULER, "snr_shift_scale": 3.0}
    dpm = {"_class_name": "CogVideoXDPMScheduler", **RELEASED_SCHEDULER}
    vae15 = replace(cvae.PRESETS["tiny"], invert_scale_latents=True)
    return {
        "tiny": TinyPreset(base, scheduler=sched2b),
        "tiny-5b": TinyPreset(rot, scheduler=dpm),
        "tiny-5b-i2v": TinyPreset(replace(rot, in_channels=8, use_learned_positional_embeddings=True), I2V),
        "tiny-1.5": TinyPreset(v15, vae=vae15),
        "tiny-1.5-i2v": TinyPreset(replace(v15, in_channels=8, ofs_embed_dim=32), I2V, vae=vae15, scheduler=dpm),
    }


PRESET_SOURCES = _tiny_presets()


class CogGeometry(Geometry):
    """CogVideoX's geometry: 1.5 pads the latent frames to whole temporal patches; the 5B-I2V's learned
    positions fix its size (an image is resized to it, as the reference does)."""

    native: tuple | None = None  # (height, width) in pixels when the size is fixed

    def __init__(self, *a, native=None, **kw):
        super().__init__(*a, **kw)
        object.__setattr__(self, "native", native)

    def padded_latent_frames(self, num_frames: int) -> int:
        lf = self.latent_frames(num_frames)
        pt = int(self.patch[0])
        return lf + (pt - lf % pt) % pt

    def tokens(self, height: int, width: int, num_frames: int) -> int:
        pt, ph, pw = self.patch
        return (self.padded_latent_frames(num_frames) // pt) * (height // self.spatial // ph) * (width // self.spatial // pw)

    def fit_size(self, image_height: int, image_width: int, area: int, sp: int = 1) -> tuple[int, int]:
        if self.native is not None:
            return self.native
        return super().fit_size(image_height, image_width, area, sp)

    def check(self, height, width, num_frames) -> None:
        super().check(height, width, num_frames)
        if self.native is not None and (height, width) != tuple(self.native):
            raise OptionError("height" if height != self.native[0] else "width",
                              f"{height}x{width}: this model's learned positional embeddings fix its size to "
                              f"{self.native[0]}x{self.native[1]}")


def _rgb_uint8(image) -> np.ndarray:
    if hasattr(image, "convert"):  # PIL
        image = image.convert("RGB")
    a = np.asarray(image)
    if a.ndim == 2:
        a = np.stack([a] * 3, axis=-1)
    if a.dtype != np.uint8:
        a = np.clip(np.round(a * 255.0 if a.max() <= 1.0 else a), 0, 255).astype(np.uint8)
    return a[..., :3]


def preprocess_image(image, height: int, width: int) -> np.ndarray:
    """The reference's ``VideoProcessor.preprocess(image, height, width)``: PIL Lanczos resize to
    exactly (height, width), to [-1, 1]. Returns float32 [3, H, W]."""
    import PIL.Image

    im = PIL.Image.fromarray(_rgb_uint8(image)).resize((width, height), resample=PIL.Image.Resampling.LANCZOS)
    a = np.asarray(im.convert("RGB")).astype(np.float32) / 255.0
    return (2.0 * a - 1.0).transpose(2, 0, 1).astype(np.float32)


def dynamic_guidance(guidance: float, timesteps, num_inference_steps: int) -> list[float]:
    """``use_dynamic_cfg``'s guidance per step (the reference's formula, over its integer timesteps)."""
    n = num_inference_steps
    return [1 + guidance * ((1 - math.cos(math.pi * ((n - float(t)) / n) ** 5.0)) / 2) for t in timesteps]


class CogVideoX(Pipeline):
    """CogVideoX text-to-video and image-to-video (from an I2V folder or preset). Implements the
    :class:`vidax.pipeline.Pipeline` protocol over ``encode_prompts`` / ``encode_image`` /
    ``sample_latents`` / ``decode_frames``."""

    FAMILY = "cogvideox"
    STEP_CACHE = True
    OPTIONS = (
        Option("scheduler", str, None, "sampler (default: the checkpoint's scheduler config)", choices=("ddim", "dpm")),
        Option("dynamic_cfg", bool, False, "use_dynamic_cfg: the guidance scale follows a cosine ramp over the steps"),
        Option("vae_tiling", bool, False, "decode in overlapping spatial tiles (the reference's enable_tiling)",
               stages=("decode",)),
    )
    COMPONENTS = {"encode": ("text",), "image": ("vae",), "sample": ("dit",), "decode": ("vae",)}

    def __init__(self, source: str | Path = "tiny", *, dtype=np.float32, mesh=None, parallelism: str | None = None,
                 offload_chunk_size=None, prefetch: bool = True):
        self.dtype = np.dtype(dtype)
        self.mesh, self.parallelism = mesh, parallelism
        self.offload_chunk_size, self.prefetch = offload_chunk_size, prefetch
        index = self.open_source(source, PRESET_SOURCES, _CONFIG_FILES, "CogVideoX pipeline")
        self.pipeline_class = self.preset.pipeline_class if self.preset else index.get("_class_name", T2V)
        if self.pipeline_class not in (T2V, I2V):
            raise ValueError(f"{source}: {self.pipeline_class} is not a CogVideoX text- or image-to-video pipeline")
        self.image_to_video = self.pipeline_class == I2V

    def _read(self, rel: str) -> dict:
        return json.loads((self.config_folder / rel).read_text())

    # ------------------------------------------------------------------ configs
    def dit_config(self) -> cdit.CogVideoXConfig:
        if self.preset:
            return self.preset.dit
        return cdit.CogVideoXConfig.from_diffusers(self._read("transformer/config.json"))

    def vae_config(self) -> cvae.CogVideoXVAEConfig:
        if self.preset:
            return self.preset.vae
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cvae.CogVideoXVAEConfig.from_diffusers(self._read("vae/config.json"))

    @property
    def max_text_len(self) -> int:
        return self.dit_config().max_text_seq_length

    def geometry(self) -> CogGeometry:
        dc, vc = self.dit_config(), self.vae_config()
        max_grid = None
        if dc.use_rotary_positional_embeddings and dc.patch_size_t is not None:  # 'slice' rotary grid
            max_grid = min(dc.sample_height, dc.sample_width) // dc.patch_size
        native = None
        if dc.use_learned_positional_embeddings:
            native = (dc.sample_height * vc.spatial_ratio, dc.sample_width * vc.spatial_ratio)
        # 8k+1 frames: an odd latent frame count, which the VAE's first frame batch decodes to
        # exactly num_frames (an even count would decode to 4 more frames than asked for)
        return CogGeometry(spatial=vc.spatial_ratio, temporal=vc.temporal_compression_ratio,
                           latent_channels=dc.out_channels, patch=dc.patch, num_heads=dc.num_heads, max_grid=max_grid,
                           native=native, frame_step=2 * vc.temporal_compression_ratio)

    def scheduler(self, steps: int, name: str | None = None):
        """``name`` None: the checkpoint's scheduler config; ``"ddim"`` / ``"dpm"``: that class with
        the checkpoint's settings (as ``Scheduler.from_config(pipe.scheduler.config)``)."""
        cfg = dict(self.preset.scheduler) if self.preset else self._read("scheduler/scheduler_config.json")
        if name is not None:
            cfg["_class_name"] = {"ddim": "CogVideoXDDIMScheduler", "dpm": "CogVideoXDPMScheduler"}[name]
        return from_diffusers_config(cfg, steps)

    # ------------------------------------------------------------------ loaders
    def load_tokenizer(self):
        return ByteTokenizer() if self.preset else load_tokenizer(self.folder / "tokenizer")

    def load_text_encoder(self) -> t5mod.T5Encoder:
        """The T5 encoder; it computes in float32 whatever the stored dtype (a bfloat16 checkpoint is
        kept in bfloat16 in memory, losslessly: half the bytes, the same float32 encode)."""
        if self.preset:
            return t5mod.init(self.preset.text, seed=self.preset.seed + 1)
        from vidax.weights import open_checkpoint

        folder = self.folder / "text_encoder"
        dts = {str(getattr(t, "dtype", "")) for _, t in zip(range(4), open_checkpoint(folder).values())}
        store = jnp.bfloat16 if dts == {"bfloat16"} else np.float32
        return t5mod.load_t5(folder, dtype=store, mesh=self.text_mesh())  # split over the encode slice (tp)

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
        from vidax.models.cogvideox import lora as clora

        return self.transformer_lora_targets(clora.aliases(), "this CogVideoX DiT (transformer)")

    def load_dit(self):
        """``(state on one device, cfg)``, or with a mesh / offloading ``(DiTRunner, cfg)``."""
        with lazy_params(self.scaled and self.offload_chunk_size is None):  # placed: a host reads its shards only
            state, cfg = self._load_dit_host()
        if not self.scaled:
            return jax.device_put(state), cfg
        return cdit.runner(state, cfg, self.mesh, self.parallelism, offload_chunk_size=self.offload_chunk_size,
                           prefetch=self.prefetch), cfg

    def load_vae(self) -> cvae.CogVAE:
        if self.preset:
            return cvae.init(self.preset.vae, seed=self.preset.seed + 3)
        return cvae.load_vae(self.folder / "vae", self.vae_config())

    # ------------------------------------------------------------------ checks
    def _required_files(self):
        req = [("the text encoder (text_encoder/*.safetensors)", ["text_encoder/*.safetensors"]),
               ("the tokenizer (tokenizer/)", ["tokenizer/tokenizer.json", "tokenizer/spiece.model"]),
               ("the DiT (transformer/*.safetensors)", ["transformer/*.safetensors"]),
               ("the VAE (vae/*.safetensors)", ["vae/*.safetensors"]),
               ("the scheduler config (scheduler/scheduler_config.json)", ["scheduler/scheduler_config.json"])]
        return req

    def weight_loaders(self, request) -> list:
        return [("text encoder", self.load_text_encoder), ("DiT", self._load_dit_host), ("VAE", self.load_vae)]

    def check(self, request) -> None:
        """A complete checkpoint folder; prompts within the 226 tokens the text encoder reads (the
        reference cuts them silently); the 5B-I2V's fixed size."""
        g = self.geometry()
        if g.native is not None:
            g.check(request.height, request.width, request.num_frames)
        if self.preset is None and self._folder is None:
            return
        if self.folder is not None:
            missing = [w for w, globs in self._required_files() if not any(any(self.folder.glob(p)) for p in globs)]
            if missing:
                raise OptionError("checkpoint", f"{self.folder}: missing {'; '.join(missing)} (diffusers layout)")
        self._check_prompts(request)

    def _check_prompts(self, request) -> None:
        try:
            tok = self.load_tokenizer()
        except (OSError, ValueError) as e:
            raise OptionError("checkpoint", f"{self.folder}: the tokenizer cannot be loaded ({e})") from None
        neg = request.negative_prompt or ""
        for name, texts in (("prompt", request.prompts), ("negative_prompt", [neg])):
            for i, n in enumerate(tok.count(texts)):
                if n > self.max_text_len:
                    which = f" {i + 1}" if len(texts) > 1 else ""
                    raise OptionError(name, f"prompt{which} is {n} tokens long; the text encoder reads at most "
                                            f"{self.max_text_len}: shorten it")

    # ------------------------------------------------------------------ phases
    def encode_prompts(self, prompts: list[str], tokenizer=None, encoder=None) -> np.ndarray:
        """Prompt embeddings [B, max_text_seq_length, D] in float32, computed without an attention
        mask over the padded tokens (the reference's ``text_encoder(input_ids)[0]``)."""
        tok = tokenizer or self.load_tokenizer()
        enc = encoder or self.load_text_encoder()
        ids, _ = tok(list(prompts), self.max_text_len)
        return np.asarray(enc(jnp.asarray(ids), None), np.float32)

    def encode_image(self, image, height: int, width: int, *, seed: int = 0, sample: bool = True, vae=None) -> np.ndarray:
        """The image's latent for image-to-video [1, z, 1, h, w], scaled as the DiT sees it: a
        posterior sample (the reference's ``latent_dist.sample``; noise from ``seed``) or, with
        ``sample=False``, the posterior mean."""
        vae = vae or self.load_vae()
        px = preprocess_image(image, height, width)[None, :, None]
        mean, logvar = cvae.encode(vae, px, return_logvar=True)
        z = mean
        if sample:
            noise = np.asarray(jax.random.normal(jax.random.fold_in(jax.random.key(seed), 0x7FFFFFFE), mean.shape))
            z = cvae.sample_posterior(mean, logvar, noise)
        return cvae.to_latents(vae.cfg, z)

    def latent_frames(self, num_frames: int) -> tuple[int, int]:
        """(latent frames of the video, the extra leading frames 1.5 samples and drops)."""
        g = self.geometry()
        lf = g.latent_frames(num_frames)
        return lf, g.padded_latent_frames(num_frames) - lf

    def latent_shape(self, batch: int, height: int, width: int, num_frames: int):
        """The sampled latents' shape, channels-last, extra frames included."""
        g = self.geometry()
        return (batch, g.padded_latent_frames(num_frames), height // g.spatial, width // g.spatial,
                self.dit_config().out_channels)

    def initial_noise(self, shape, seed: int):
        return jax.random.normal(jax.random.fold_in(jax.random.key(seed), 0x7FFFFFFF), shape, jnp.float32)

    def image_condition(self, image_latents, shape) -> np.ndarray:
        """The channel-concatenated image latents [1, F, h, w, z] for latents of ``shape``: the
        image's latent, zero frames, and (1.5) the reference's first-frame padding to whole patches."""
        pt = self.dit_config().pt
        z = np.asarray(image_latents, np.float32).transpose(0, 2, 3, 4, 1)[:, :1]  # [1, 1, h, w, C]
        cond = np.concatenate([z, np.zeros((1, shape[1] - 1, *z.shape[2:]), np.float32)], axis=1)
        extra = cond.shape[1] % pt  # zero after the 1.5 padding; the reference repeats leading frames
        if extra:
            cond = np.concatenate([cond[:, :extra], cond], axis=1)
        if cond.shape[1:4] != tuple(shape[1:4]):
            raise ValueError(f"image latents {image_latents.shape} do not fit the latents {shape}")
        return cond

    def _aux(self, dit, cfg, shape, image_cond):
        """Everything the model needs besides latents / timestep / text, as device arrays."""
        grid = (shape[1] // cfg.pt, shape[2] // cfg.patch_size, shape[3] // cfg.patch_size)
        aux = {}
        if isinstance(dit, DiTRunner):
            aux["tables"] = dit.tables({"x": shape})
        else:
            if cfg.use_rotary_positional_embeddings:
                aux["rope"] = tuple(jnp.asarray(a) for a in cdit.rope_tables(cfg, grid))
            if cdit.pos_mode(cfg, grid) == "sincos":
                aux["pos"] = jnp.asarray(cdit.sincos_table(cfg, grid))
        if cfg.ofs_embed_dim:
            aux["ofs"] = jnp.full((1,), 2.0, jnp.float32)
        if image_cond is not None:
            aux["img"] = jnp.asarray(image_cond)
        return aux

    @collect_own_garbage()  # frees what it loaded when it returns, without walking the caller's heap
    def sample_latents(self, cond, uncond=None, *, latents=None, seed: int = 0, height: int = 480, width: int = 720,
                       num_frames: int = 49, steps: int = 50, guidance: float = 6.0, scheduler=None,
                       dynamic_cfg: bool = False, image_latents=None, dit=None, start: int = 0, state=None,
                       on_step=None, return_padded: bool = False):
        """Denoise. ``cond`` / ``uncond``: prompt embeddings [B, L, D]; ``latents``: the start sample
        in the reference's DiT layout [B, F, C, h, w] (extra 1.5 frames included; drawn from ``seed``
        when omitted); resume at ``start`` with the ``state`` saved after step ``start - 1``;
        ``image_latents``: :meth:`encode_image` (image-to-video). Returns the latents [B, C, F, h, w]
        with the extra frames dropped (``return_padded``: kept)."""
        if self.image_to_video and image_latents is None:
            raise ValueError("this is an image-to-video model: pass image_latents=encode_image(...)")
        sched = scheduler or self.scheduler(steps)
        b = cond.shape[0]
        shape = self.latent_shape(b, height, width, num_frames)
        if latents is None:
            if start:
                raise ValueError("resuming (start > 0) needs the latents saved at that step")
            x = self.initial_noise(shape, seed)
        else:
            x = jnp.asarray(np.asarray(latents, np.float32).transpose(0, 1, 3, 4, 2))
            if tuple(x.shape) != tuple(shape):
                raise ValueError(f"latents {tuple(x.shape)} (channels-last) do not match {shape}")
        image_cond = None if image_latents is None else self.image_condition(image_latents, shape)
        use_cfg = guidance > 1.0 and uncond is not None
        n = len(sched.timesteps)
        gs = dynamic_guidance(guidance, sched.int_timesteps, n) if dynamic_cfg else [guidance] * n
        loaded = dit if dit is not None else self.load_dit()
        x, state = self._denoise(loaded, x, cond, uncond if use_cfg else None, sched, gs, seed, start, state,
                                 on_step, image_cond)
        del loaded
        out = np.asarray(x)
        if not return_padded:
            out = out[:, shape[1] - self.latent_frames(num_frames)[0]:]
        return out.transpose(0, 4, 1, 2, 3)

    def _denoise(self, dit, x, cond, uncond, sched, guidances, seed, start, state, on_step, image_cond):
        params, cfg = dit
        runner = params if isinstance(params, DiTRunner) else None
        use_cfg = uncond is not None
        dt = runner.dtype if runner is not None else cdit.state_dtype(params)
        aux = self._aux(params, cfg, x.shape, image_cond)
        prepare = _prepare_i2v if image_cond is not None else None
        cond = jnp.asarray(cond, dt)
        uncond = cond if uncond is None else jnp.asarray(uncond, dt)
        if runner is not None:
            b = (2 if use_cfg else 1) * x.shape[0]
            runner.check_shapes({"x": (b, *x.shape[1:-1], cfg.in_channels), "ctx": (b, *cond.shape[1:])})
        else:
            cdit.check_text(cfg, cond.shape[1], (x.shape[1] // cfg.pt, x.shape[2] // cfg.patch_size,
                                                 x.shape[3] // cfg.patch_size))
        skey = (type(sched).__name__, repr(sorted(sched.config.items())), len(sched.timesteps), use_cfg,
                prepare is not None)
        if runner is not None and (runner.offload is not None or self.step_cache is not None):
            if self.step_cache is not None:  # one cache state for the [cond; uncond] batch (diffusers' "cond_uncond")
                self.step_cache.begin(1, 1, start)
                runner.use_cache(self.step_cache)
            step = _cached_step(("stream", id(runner), *skey), lambda: _streamed_step(runner, sched, use_cfg, prepare))
            params = None
        elif runner is not None:
            step = _cached_step(("runner", id(runner), *skey), lambda: make_step(
                partial(_runner_apply, runner), sched, use_cfg, prepare=prepare, with_aux=True))
            params = runner.params
        else:
            step = _cached_step(("dit", cfg, *skey), lambda: make_step(
                partial(_dit_apply, cfg=cfg), sched, use_cfg, prepare=prepare, with_aux=True))
        x = jnp.asarray(x, jnp.float32)
        state = sched.init_state(x) if state is None else jax.tree.map(jnp.asarray, state)
        key = jax.random.key(seed)
        n = len(sched.timesteps)
        if not 0 <= start <= n:
            raise ValueError(f"start={start} outside [0, {n}]")
        for i in range(start, n):
            t0 = time.perf_counter()
            x, state = step(params, x, state, jnp.int32(i), cond, uncond, jnp.float32(guidances[i]), key, aux)
            if on_step is not None:
                x.block_until_ready()
                on_step(StepInfo(i, n, float(sched.timesteps[i]), time.perf_counter() - t0), x, state)
        return x, state

    def decode_frames(self, latents, start: int, stop: int, cache=None, vae=None, tiling: bool = False):
        """Decode latent frames ``start..stop-1`` (whole VAE batches, see :meth:`decode_plan`) of the
        sampled latents [B, C, F, h, w], from the cache the previous batch left. Returns ``(uint8
        frames [B, T, H, W, 3], cache)``."""
        vae = vae or self.load_vae()
        z = cvae.from_latents(vae.cfg, latents)
        if cache is not None:
            cache = {k: jnp.asarray(v) for k, v in cache.items()}
        t = cvae.Tiling.default(vae.cfg) if tiling else None
        if t is not None and t.applies(*z.shape[3:]):
            px, cache = cvae.tiled_decode(vae, z, t, start=start, stop=stop, cache=cache, return_cache=True)
        else:
            px, cache = cvae.decode(vae, z, start=start, stop=stop, cache=cache, return_cache=True)
        return to_uint8(to_unit_range(px)), cvae.cache_to_numpy(cache)

    def decode_video(self, latents, vae=None, tiling: bool = False) -> np.ndarray:
        """Latents [B, C, F, h, w] -> uint8 frames [B, T, H, W, 3] (one call)."""
        return self.decode_frames(latents, 0, np.shape(latents)[2], vae=vae, tiling=tiling)[0]

    # ------------------------------------------------------------------ memory plan (``vidax plan``)
    def text_config(self) -> tuple[t5mod.T5Config, np.dtype]:
        """The T5 encoder's config without its weights, and the dtype :meth:`load_text_encoder`
        keeps its weights in (bfloat16 for a bfloat16 checkpoint, by its config's ``torch_dtype``)."""
        if self.preset:
            return self.preset.text, np.dtype(np.float32)
        c = self._read("text_encoder/config.json")
        return t5mod.T5Config.from_hf(c), np.dtype(jnp.bfloat16 if c.get("torch_dtype") == "bfloat16" else np.float32)

    def plan_units(self, request) -> list:
        """T5 over the prompts (float32 compute, no mask, as :meth:`encode_prompts`); one DiT call
        on the CFG batch on this pipeline's mesh, inputs as the sampling step passes them (float32
        latents with the I2V image channels, rotary / sin-cos / learned tables, 1.5-I2V's ofs);
        the VAE's first frame batch and a following one with its causal-conv cache."""
        from vidax.core import nn
        from vidax.core import plan as vplan

        b, lt = len(request.prompts), self.max_text_len
        tcfg, tdt = self.text_config()
        tp = 1 if self.preset else self.pool_devices(request, "encode")  # as load_text_encoder splits it
        units = [t5mod.plan_unit(tcfg, b, lt, dtype=tdt, tp=tp, mask=False)]
        cfg = self.dit_config()
        runner = cdit.runner(cdit.abstract_state(cfg, self.dtype), cfg, self.mesh, self.parallelism)
        nb = 2 * b if request.guidance > 1.0 else b
        shape = self.latent_shape(nb, request.height, request.width, request.num_frames)
        grid = cdit.token_grid(cfg, shape)
        n = grid[0] * grid[1] * grid[2]
        tok = runner.act_sharding("pos", (n, cfg.dim))
        tables = {}
        if cfg.use_rotary_positional_embeddings:
            cos, _ = cdit.rope_tables(cfg, grid)
            tables["cos"] = tables["sin"] = vplan.abstract(np.shape(cos), np.float32, tok)
        mode = cdit.pos_mode(cfg, grid)
        if mode == "sincos":  # (a learned table is a parameter of the embedding)
            tables["pos"] = vplan.abstract((n, cfg.dim), np.float32, tok)
        x = vplan.abstract((*shape[:-1], cfg.in_channels), np.float32)
        t = vplan.abstract((nb,), np.float32)
        ctx = vplan.abstract((nb, lt, cfg.text_embed_dim), self.dtype)
        ofs = vplan.abstract((1,), np.float32) if cfg.ofs_embed_dim else None
        units.append(vplan.Unit("sample", "DiT step", jax.jit(runner.apply), ({**runner.params, "tables": tables}, x, t, ctx,
                                                                              ofs),
                                weights=runner.params, note=f"batch {nb} x {n:,} tokens"))
        vcfg = self.vae_config()
        vae = cvae.CogVAE(*nn.abstract_state(cvae._build(vcfg)), vcfg)
        batches = cvae.decode_batches(self.latent_frames(request.num_frames)[0])
        h, w = shape[2], shape[3]
        til = cvae.Tiling.default(vcfg) if request.options.get("vae_tiling") else None
        if til is not None and til.applies(h, w):
            h, w = til.latent_tile
        z0 = vplan.abstract((b, vcfg.latent_channels, batches[0][1] - batches[0][0], h, w), np.float32)
        units.append(vplan.split_unit("decode", "VAE decode, first frame batch", vae, z0, None, method="decode_batch",
                                      conv_impl="native", note=f"{b} x {z0.shape[2]} latent frames of {h}x{w}"))
        if len(batches) > 1:
            _, cache = jax.eval_shape(vae.method_fn("decode_batch", conv_impl="native"), vae.state, z0, None)
            z = vplan.abstract((b, vcfg.latent_channels, cvae.DECODE_BATCH, h, w), np.float32)
            units.append(vplan.split_unit("decode", "VAE decode, next batch + cache", vae, z, cache,
                                          method="decode_batch", conv_impl="native",
                                          note=f"{b} x {cvae.DECODE_BATCH} latent frames with the causal cache"))
        return units

    def fingerprint(self, component: str) -> str:
        if self.preset is not None:
            return f"preset:{self.preset_name}:{component}:{self.dtype.name}"
        files = {"text": ["text_encoder", "tokenizer"], "dit": ["transformer", "scheduler"], "vae": ["vae"]}[component]
        return f"{component}:{self.dtype.name}:" + files_fingerprint(self.folder, files)

    # ------------------------------------------------------------------ the stage protocol
    def encode(self, request, image: np.ndarray | None = None) -> dict[str, Named]:
        """Prompt and negative-prompt embeddings (float32 compute, stored in the request's dtype)
        and, for image-to-video, ``image_latents`` [1, z, 1, h, w]."""
        self._check_prompts(request)
        tok, enc = self.load_tokenizer(), self.load_text_encoder()
        cond = self.encode_prompts(request.prompts, tok, enc)
        neg = request.negative_prompt if request.negative_prompt is not None else ""
        uncond = self.encode_prompts([neg] * len(request.prompts), tok, enc)
        del enc
        dt = np.dtype(np.float32) if request.dtype == "float32" else np.dtype(jnp.bfloat16)
        attrs = dict(model=request.model, computed_in="float32", stored_as=str(dt), attention_mask="none")
        out = {"prompt_embeds": Named(cond.astype(dt), _EMB_DIMS, attrs),
               "negative_embeds": Named(uncond.astype(dt), _EMB_DIMS, attrs)}
        if self.image_to_video:
            if image is None:
                raise OptionError("image", "this is an image-to-video model: give the first frame")
            lat = self.encode_image(image, request.height, request.width, seed=request.seed)
            out["image_latents"] = Named(lat, _LATENT_DIMS, {"role": "image latents (scaled for the DiT)"})
        return out

    def sample(self, conditioning: dict, request, *, resume: dict | None = None, on_step=None) -> dict[str, Named]:
        o = request.options
        sched = self.scheduler(request.steps, o.get("scheduler"))
        cond = conditioning["prompt_embeds"]
        uncond = conditioning.get("negative_embeds") if request.guidance > 1.0 else None
        start, latents, state = 0, None, None
        shape = self.latent_shape(cond.shape[0], request.height, request.width, request.num_frames)
        if resume is not None:
            start = int(resume["step"])
            lat, state = unpack_state(resume["arrays"], sched.init_state(jnp.zeros(shape, jnp.float32)))
            latents = np.asarray(lat).transpose(0, 2, 1, 3, 4)  # stored [B, C, F, h, w] -> [B, F, C, h, w]

        def step_cb(info, x, st):
            on_step(info, lambda: pack_state(np.asarray(x).transpose(0, 4, 1, 2, 3), st))

        lat = self.sample_latents(cond, uncond, latents=latents, seed=request.seed, height=request.height,
                                  width=request.width, num_frames=request.num_frames, steps=request.steps,
                                  guidance=request.guidance, scheduler=sched, dynamic_cfg=bool(o.get("dynamic_cfg")),
                                  image_latents=conditioning.get("image_latents"), start=start, state=state,
                                  on_step=None if on_step is None else step_cb)
        return {"latents": Named(lat, _LATENT_DIMS, {"model": request.model, "layout": "reference [B, C, F, H, W]",
                                                     "scaled": "DiT latents (decode divides by scaling_factor)"})}

    def decode_plan(self, request) -> list[DecodeSpan]:
        """Decode stages of whole VAE frame batches (default: up to 4), each carrying the causal-conv
        cache of the previous one."""
        batches = cvae.decode_batches(self.geometry().latent_frames(request.num_frames))
        k = min(getattr(request, "decode_stages", None) or 4, len(batches))
        cuts = [round(i * len(batches) / k) for i in range(k + 1)]
        spans = []
        for i in range(k):
            a, b = batches[cuts[i]][0], batches[cuts[i + 1] - 1][1]
            spans.append(DecodeSpan(f"decode/{i}", "video", (a, b), None, f"decode/{i - 1}" if i else None))
        return spans

    def decode(self, latents: dict, span: DecodeSpan, carry: dict | None, request):
        a, b = span.frames
        frames, cache = self.decode_frames(latents["latents"], a, b, carry,
                                           tiling=bool(request.options.get("vae_tiling")))
        return ({"frames": Named(frames, ("batch", "frame", "height", "width", "rgb"),
                                 {"latent_frames": [a, b], "units": "uint8 RGB"})}, cache)

    def describe(self) -> dict:
        return {"mesh": self.mesh, "offload_chunk_size": self.offload_chunk_size, "pipeline": self.pipeline_class}

    # ------------------------------------------------------------------ probe hooks (``vidax probe``)
    # CogVideoX is a variance-preserving v-prediction model (alphas_cumprod over 1000 training
    # timesteps), not flow matching. A probe noise level ``s`` maps to the training timestep ``t``
    # whose signal-to-noise ratio matches ((1 - s)^2 / s^2 = a / (1 - a), see
    # ``timesteps_for_flow_sigmas``); the latents are noised as the scheduler does
    # (``sqrt(a_t) x0 + sqrt(1 - a_t) n``) and the DiT's output at ``t`` becomes the clean estimate
    # ``sqrt(a_t) x - sqrt(1 - a_t) v``. The schedule is the checkpoint's scheduler config (its
    # ``snr_shift_scale`` and zero-terminal-SNR rescale included; DDIM and DPM share it).
    def vae_encode(self, video: np.ndarray) -> np.ndarray:
        """Pixels -> the posterior mean as the DiT's latents (``z * scaling_factor``: the inverse of
        what :meth:`decode_frames` does, for 1.0 and 1.5 alike)."""
        vae = self.load_vae()
        return (cvae.encode(vae, np.asarray(video, np.float32)) * vae.cfg.scaling_factor).astype(np.float32)

    def vae_decode(self, latents: np.ndarray) -> np.ndarray:
        vae = self.load_vae()
        return to_unit_range(cvae.decode(vae, cvae.from_latents(vae.cfg, latents)))

    def add_noise(self, latents, noise, sigmas) -> np.ndarray:
        sched = self.scheduler(1)
        return sched.add_noise_at(latents, noise, sched.timesteps_for_flow_sigmas(sigmas))

    def denoise_once(self, latents, sigmas, conditioning, request=None) -> np.ndarray:
        """One DiT evaluation per row at the training timestep matching its sigma (see above), the
        first prompt's embeddings, no guidance -> ``sqrt(a) x - sqrt(1 - a) v``. Image-to-video: the
        image latents channel-concatenated (and 1.5's ``ofs``) as in sampling; 1.5 with an odd
        latent frame count: the leading frames are repeated to a whole temporal patch (sampling
        carries extra leading noise frames there) and dropped from the estimate."""
        sched = self.scheduler(1)
        ts = sched.timesteps_for_flow_sigmas(sigmas)
        params, cfg = self.load_dit()
        runner = params if isinstance(params, DiTRunner) else None
        dt = runner.dtype if runner is not None else cdit.state_dtype(params)
        x = np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1)  # [B, F, h, w, C]
        extra = (cfg.pt - x.shape[1] % cfg.pt) % cfg.pt
        shape = (1, x.shape[1] + extra, *x.shape[2:])
        img = conditioning.get("image_latents")
        image_cond = None if img is None else self.image_condition(img, shape)
        aux = self._aux(params, cfg, shape, image_cond)
        ctx = jnp.asarray(np.asarray(conditioning["prompt_embeds"], np.float32)[:1], dt)
        fwd = None if runner is not None else _probe_forward(cfg)
        out = []
        for i, t in enumerate(ts):
            xi = jnp.asarray(x[i:i + 1])
            if extra:
                xi = jnp.concatenate([xi[:, :extra], xi], axis=1)
            xin = xi if image_cond is None else _prepare_i2v(xi, None, aux)[0]
            tt = jnp.full((1,), float(t), jnp.float32)
            v = runner(xin, tt, ctx, aux.get("ofs")) if runner is not None else fwd(params, xin, tt, ctx, aux)
            out.append(np.asarray(sched.x0_at(v, xi, [t]))[:, extra:])
        del params
        return np.concatenate(out).transpose(0, 4, 1, 2, 3)

    def generate(self, prompt, negative_prompt=None, *, image=None, seed: int = 0, height: int | None = None,
                 width: int | None = None, num_frames: int | None = None, steps: int = 50, guidance: float = 6.0,
                 scheduler: str | None = None, dynamic_cfg: bool = False, on_step=None, vae_tiling: bool = False):
        """Prompt(s) (+ image) -> uint8 frames [B, F, H, W, 3]. Defaults: the config's sample size."""
        dc, vc = self.dit_config(), self.vae_config()
        height = height or dc.sample_height * vc.spatial_ratio
        width = width or dc.sample_width * vc.spatial_ratio
        num_frames = num_frames or dc.sample_frames
        self.geometry().check(height, width, num_frames)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        tok, enc = self.load_tokenizer(), self.load_text_encoder()
        cond = self.encode_prompts(prompts, tok, enc)
        uncond = None
        if guidance > 1.0:
            neg = negative_prompt if negative_prompt is not None else ""
            uncond = self.encode_prompts([neg] * len(prompts) if isinstance(neg, str) else list(neg), tok, enc)
        del enc
        vae = self.load_vae()
        img = None if image is None else self.encode_image(image, height, width, seed=seed, vae=vae)
        lat = self.sample_latents(cond, uncond, seed=seed, height=height, width=width, num_frames=num_frames,
                                  steps=steps, guidance=guidance, scheduler=self.scheduler(steps, scheduler),
                                  dynamic_cfg=dynamic_cfg, image_latents=img, on_step=on_step)
        return self.decode_video(lat, vae=vae, tiling=vae_tiling)


_STEPS: dict = {}


def _cached_step(key, build):
    """The jitted sampling step for a (model, schedule) pair, kept across runs in one process (a
    batch of prompts compiles its step once); the few most recent are kept."""
    if key not in _STEPS:
        if len(_STEPS) >= 8:
            _STEPS.pop(next(iter(_STEPS)))
        _STEPS[key] = build()
    return _STEPS[key]


def _prepare_i2v(x, t, aux):
    img = aux["img"]
    img = jnp.broadcast_to(img, (x.shape[0], *img.shape[1:])).astype(x.dtype)
    return jnp.concatenate([x, img], axis=-1), t


def _dit_apply(params, x, t, ctx, aux, *, cfg):
    return cdit.forward(params, cfg, x, t, ctx, aux.get("ofs"), aux.get("rope"), aux.get("pos"))


def _probe_forward(cfg):
    """One jitted DiT evaluation ``(params, x, t, ctx, aux) -> v`` for a one-device state (cached per config)."""
    return _cached_step(("probe", cfg), lambda: jax.jit(partial(_dit_apply, cfg=cfg)))


def _runner_apply(runner, params, x, t, ctx, aux):
    return runner.apply({**params, "tables": aux["tables"]}, x, t, ctx, aux.get("ofs"))


def _streamed_step(runner, sched, use_cfg: bool, prepare):
    """A step for an offloading runner (a model called from Python; guidance + update jitted)."""
    update = make_update(sched, use_cfg)
    timesteps = np.asarray(sched.timesteps, np.float32)
    prep = None if prepare is None else jax.jit(lambda x, aux: prepare(x, None, aux)[0])

    def step(params, x, state, i, cond, uncond, guidance, key, aux):
        b = x.shape[0]
        xin = x if prep is None else prep(x, aux)
        t = jnp.full((b,), timesteps[int(i)], jnp.float32)
        if use_cfg:
            v = runner(jnp.concatenate([xin, xin]), jnp.concatenate([t, t]), jnp.concatenate([cond, uncond]),
                       aux.get("ofs"))
        else:
            v = runner(xin, t, cond, aux.get("ofs"))
        return update(x, state, v, i, guidance, key)

    return step


__all__ = ["CogVideoX", "PRESET_SOURCES", "dynamic_guidance", "preprocess_image"]
