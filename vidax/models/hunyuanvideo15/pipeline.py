"""HunyuanVideo 1.5 text-to-video and image-to-video: prompt encode (Qwen2.5-VL + ByT5 glyphs,
SigLIP image; fp32) -> DiT sampling (flow-matching Euler, classifier-free guidance as a batch of
two) -> VAE decode in persisted stages: one per spatial tile (blended at mux as the reference's
tiled decode), or frame ranges without tiling; the VAE decodes a few latent frames per call,
carrying its causal state.

Sources: a preset (``tiny`` text-to-video, ``tiny-i2v``: seeded random weights, seconds on a CPU)
or a diffusers pipeline folder (``HunyuanVideo15Pipeline`` / ``HunyuanVideo15ImageToVideoPipeline``:
``text_encoder/`` Qwen2.5-VL, ``tokenizer/``, ``text_encoder_2/`` Glyph-ByT5, ``tokenizer_2/``,
``transformer/``, ``vae/``, ``scheduler/``; I2V also ``image_encoder/`` SigLIP and
``feature_extractor/``), local or at any fsspec URL.

Sampling follows the reference pipelines: ``sigmas = linspace(1, 0, steps + 1)[:-1]`` shifted by
the release's ``shift`` (480p: 5, 720p T2V: 9, 720p I2V: 7), the DiT input is ``[latents,
condition latents, mask]`` on channels (text-to-video: zeros; image-to-video: the image's latent
on frame 0 and a frame-0 mask), text-to-video passes all-zero image embeddings, guidance
``uncond + g * (cond - uncond)`` when ``g != 1``; meanflow checkpoints get ``timestep_r`` (the next
timestep, 0 at the end) as the image-to-video pipeline gives it.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.runtime import collect_own_garbage
from vidax.core.runner import DiTRunner
from vidax.core.sampling import StepInfo
from vidax.models.hunyuanvideo import dit as h10
from vidax.models.hunyuanvideo15 import dit as hdit
from vidax.models.hunyuanvideo15 import text as htext
from vidax.models.hunyuanvideo15 import vae as hvae
from vidax.pipeline import (DecodeSpan, Geometry, Named, Option, OptionError, Pipeline, pack_state,
                            to_uint8, to_unit_range, unpack_state)
from vidax.schedulers import make_scheduler
from vidax.weights.fingerprint import files_fingerprint
from vidax.weights.keymap import lazy_params

log = logging.getLogger(__name__)

_CONFIG_FILES = ("model_index.json", "*/config.json", "scheduler/scheduler_config.json", "guider/*.json",
                 "*/preprocessor_config.json")
_EMB_DIMS = ("batch", "token", "channel")
_LATENT_DIMS = ("batch", "channel", "frame", "height", "width")
_T2V, _I2V = "HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"
#: latent frames the VAE decodes per call (16 video frames), carrying its causal state: a 256-px
#: tile's decode at 121 frames then fits a v5e chip (`vidax plan`)
DECODE_CHUNK = 4


@dataclass(frozen=True)
class TinyPreset:
    """A complete seeded random-weight HunyuanVideo-1.5-shaped model that runs on a laptop CPU."""

    dit: hdit.HunyuanVideo15Config = field(default_factory=lambda: hdit.PRESETS["tiny"])
    vae: hvae.HunyuanVideo15VAEConfig = field(default_factory=lambda: hvae.PRESETS["tiny"])
    llm: object = None  # vidax.text.lm.LMConfig (the Qwen2.5-VL text tower's shape)
    byt5: object = None  # vidax.text.t5.T5Config
    siglip: object = None  # vidax.text.siglip.SiglipVisionConfig
    pipeline_class: str = _T2V
    max_text_tokens: int = 256  # a 20-word prompt fits (the byte tokenizer reads a token a byte)
    glyph_tokens: int = 16
    seed: int = 0
    tile_sample: int = 48  # the VAE's spatial tile in pixels (the release: 256): the stages' tiled decode runs
    decode_chunk: int = 2  # latent frames per VAE decode call (the release default: DECODE_CHUNK)


def _tiny_presets() -> dict:
    from vidax.text.lm import LMConfig
    from vidax.text.siglip import SiglipVisionConfig
    from vidax.text.t5 import T5Config

    llm = LMConfig(vocab_size=264, hidden_size=24, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=6, rms_norm_eps=1e-6, qkv_bias=True, model_type="qwen2")
    byt5 = T5Config(vocab_size=384, d_model=20, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                    feed_forward_proj="gated-gelu")
    siglip = SiglipVisionConfig(hidden_size=12, intermediate_size=24, num_layers=2, num_heads=2, image_size=32,
                                patch_size=8, use_head=False)
    base = TinyPreset(llm=llm, byt5=byt5, siglip=siglip)
    i2v = replace(base, dit=hdit.PRESETS["tiny-i2v"], pipeline_class=_I2V)
    return {"tiny": base, "tiny-i2v": i2v,
            # the step-distilled image-to-video release's shape: a meanflow DiT (``timestep_r``)
            "tiny-i2v-meanflow": replace(i2v, dit=replace(hdit.PRESETS["tiny-i2v"], use_meanflow=True))}


PRESET_SOURCES = _tiny_presets()


def bucket_size(image_height: int, image_width: int, target_size: int, multiple: int = 16) -> tuple[int, int]:
    """The image-to-video pipeline's size for an image (``calculate_default_height_width``): the
    ``(height, width)`` of the bucket list for ``target_size`` (``wp * hp <= (target/16)^2``
    patches, aspect at most 4) whose aspect ratio is closest to the image's, on the image's side
    of square."""
    n = round((target_size / multiple) ** 2)
    sizes, wp, hp = [], n, 1
    while wp > 0:
        if max(wp, hp) / min(wp, hp) <= 4.0:
            sizes.append((wp * multiple, hp * multiple))
        if (hp + 1) * wp <= n:
            hp += 1
        else:
            wp -= 1
    ratios = np.array([round(float(h) / float(w), 5) for h, w in sizes])
    ar = float(image_height) / float(image_width)
    diff = ratios - ar
    idx = [i for i, d in enumerate(diff) if (d <= 0 if ar >= 1 else d >= 0)]
    best = min(idx, key=lambda i: abs(diff[i]))
    return int(sizes[best][0]), int(sizes[best][1])


def resize_crop(image_uint8: np.ndarray, height: int, width: int) -> np.ndarray:
    """``VaeImageProcessor.resize(image, height, width, resize_mode="crop")``: Lanczos resize
    covering (height, width) with the aspect kept, centred, the excess cropped. uint8 [H, W, 3]."""
    import PIL.Image

    im = PIL.Image.fromarray(np.asarray(image_uint8, np.uint8)).convert("RGB")
    ratio, src_ratio = width / height, im.width / im.height
    src_w = width if ratio > src_ratio else im.width * height // im.height
    src_h = height if ratio <= src_ratio else im.height * width // im.width
    resized = im.resize((src_w, src_h), resample=PIL.Image.Resampling.LANCZOS)
    out = PIL.Image.new("RGB", (width, height))
    out.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    return np.asarray(out)


@dataclass(frozen=True)
class BucketGeometry(Geometry):
    """The geometry with the image-to-video pipeline's size rule: an image-conditioned request
    without a size gets the image's bucket at the model's ``target_size`` (:func:`bucket_size`;
    ``area`` is not used), or -- when sequence parallelism needs a token count the bucket does not
    give -- the generic rule at the bucket's area."""

    target_size: int | None = None

    def fit_size(self, image_height: int, image_width: int, area: int, sp: int = 1) -> tuple[int, int]:
        if self.target_size is None:
            return super().fit_size(image_height, image_width, area, sp)
        h, w = bucket_size(image_height, image_width, self.target_size, self.size_multiple)
        if sp <= 1 or ((h // self.size_multiple) * (w // self.size_multiple)) % sp == 0:
            return h, w
        return super().fit_size(image_height, image_width, h * w, sp)


class HunyuanVideo15T2V(Pipeline):
    """HunyuanVideo 1.5 text-to-video (and, from an image-to-video source, image-to-video; see
    :class:`HunyuanVideo15I2V`). ``source``: a preset name or a checkpoint folder / URL."""

    FAMILY = "hunyuanvideo15"
    STEP_CACHE = True
    GUIDANCE = "cfg"
    OPTIONS = (
        Option("shift", float, 5.0, "flow-matching timestep shift (the releases: 480p 5, 720p T2V 9, 720p I2V 7)",
               minimum=0.0, maximum=100.0),
        Option("vae_tiling", bool, True, "decode (and encode the image) in overlapping 256-px spatial tiles, as the "
                                         "reference examples enable; each tile is its own decode stage",
               stages=("encode", "decode")),
        Option("vae_chunk", int, None, f"latent frames the VAE decodes per call, carrying its causal state to the "
                                       f"next (default {DECODE_CHUNK}; 0: every frame at once, as the reference)",
               minimum=0, maximum=1024, stages=("decode",)),
    )
    COMPONENTS = {"encode": ("text",), "image": ("image",), "sample": ("dit",), "decode": ("vae",)}
    CODE_DEPS = ("vidax.models.hunyuanvideo",)

    def __init__(self, source: str | Path = "tiny", *, dtype=np.float32, mesh=None, parallelism: str | None = None,
                 offload_chunk_size=None, prefetch: bool = True):
        self.dtype = np.dtype(dtype)
        self.mesh, self.parallelism = mesh, parallelism
        self.offload_chunk_size, self.prefetch = offload_chunk_size, prefetch
        index = self.open_source(source, PRESET_SOURCES, _CONFIG_FILES, "HunyuanVideo 1.5 pipeline")
        self.pipeline_class = self.preset.pipeline_class if self.preset else index.get("_class_name", _T2V)
        if self.pipeline_class not in (_T2V, _I2V):
            raise ValueError(f"{source}: {self.pipeline_class} is not a HunyuanVideo 1.5 pipeline")
        self.image_to_video = self.pipeline_class == _I2V

    # ------------------------------------------------------------------ configs
    def _json(self, rel: str) -> dict:
        p = self.config_folder / rel
        return json.loads(p.read_text()) if p.exists() else {}

    def dit_config(self) -> hdit.HunyuanVideo15Config:
        return self.preset.dit if self.preset else hdit.HunyuanVideo15Config.from_diffusers(self._json("transformer/config.json"))

    def vae_config(self) -> hvae.HunyuanVideo15VAEConfig:
        return self.preset.vae if self.preset else hvae.HunyuanVideo15VAEConfig.from_diffusers(self._json("vae/config.json"))

    def latent_channels(self) -> int:
        return self.vae_config().latent_channels

    def geometry(self) -> Geometry:
        dc, vc = self.dit_config(), self.vae_config()
        return BucketGeometry(spatial=vc.spatial_compression_ratio, temporal=vc.temporal_compression_ratio,
                              latent_channels=vc.latent_channels, patch=dc.patch, num_heads=dc.num_heads,
                              target_size=dc.target_size if self.image_to_video else None)

    def size_for_image(self, image_height: int, image_width: int) -> tuple[int, int]:
        """The reference pipelines' output size: the image's bucket (:func:`bucket_size`) at the
        model's ``target_size``; text-to-video uses the 16:9 bucket."""
        return bucket_size(image_height, image_width, self.dit_config().target_size, self.geometry().size_multiple)

    @property
    def text_tokens(self) -> int:
        return self.preset.max_text_tokens if self.preset else htext.MAX_TEXT_TOKENS

    @property
    def glyph_tokens(self) -> int:
        return self.preset.glyph_tokens if self.preset else htext.GLYPH_TOKENS

    def crop_start(self, tok) -> int:
        return htext.template_prefix_tokens(tok) if self.preset else htext.CROP_START

    # ------------------------------------------------------------------ checks
    def _required_files(self) -> list[tuple[str, list[str]]]:
        req = [("the text encoder (text_encoder/*.safetensors)", ["text_encoder/*.safetensors"]),
               ("the tokenizer (tokenizer/tokenizer.json)", ["tokenizer/tokenizer.json"]),
               ("the ByT5 encoder (text_encoder_2/*.safetensors)", ["text_encoder_2/*.safetensors"]),
               ("the ByT5 tokenizer (tokenizer_2/)", ["tokenizer_2/tokenizer_config.json", "tokenizer_2/added_tokens.json"]),
               ("the DiT (transformer/*.safetensors)", ["transformer/*.safetensors"]),
               ("the VAE (vae/*.safetensors)", ["vae/*.safetensors"])]
        if self.image_to_video:
            req.append(("the SigLIP image encoder (image_encoder/*.safetensors)", ["image_encoder/*.safetensors"]))
        return req

    def _check_prompts(self, request) -> None:
        try:
            tok = self.load_tokenizers()[0]
        except (OSError, ValueError) as e:
            raise OptionError("checkpoint", f"{self.folder}: the tokenizer cannot be loaded ({e})") from None
        neg = request.negative_prompt or ""
        for name, texts in (("prompt", request.prompts), ("negative_prompt", [neg])):
            for i, n in enumerate(htext.prompt_tokens(tok, texts, self.crop_start(tok))):
                if n > self.text_tokens:
                    which = f" {i + 1}" if len(texts) > 1 else ""
                    raise OptionError(name, f"prompt{which} is {n} tokens long; the text encoder reads at most "
                                            f"{self.text_tokens}: shorten it")

    # ------------------------------------------------------------------ component loaders
    def load_tokenizers(self):
        """(Qwen tokenizer, ByT5 tokenizer)."""
        from vidax.text.byt5 import ByT5Tokenizer

        if self.preset:
            return htext.PresetQwenTokenizer(), ByT5Tokenizer()
        from vidax.text.tokenizer import load_tokenizer

        return load_tokenizer(self.folder / "tokenizer"), ByT5Tokenizer.from_folder(self.folder / "tokenizer_2")

    def load_text_encoders(self):
        """(the Qwen2.5-VL text tower, the ByT5 encoder), float32."""
        from vidax.text import lm, t5

        if self.preset:
            p = self.preset
            return lm.init(p.llm, seed=p.seed + 1), t5.init(p.byt5, seed=p.seed + 4)
        mesh = self.text_mesh()  # the 7B tower in float32 (30 GB) split over the encode slice (tp)
        return (lm.load_lm(self.folder / "text_encoder", dtype=np.float32, mesh=mesh),
                t5.load_t5(self.folder / "text_encoder_2", dtype=np.float32))

    def text_config(self):
        """(Qwen2.5-VL text tower's ``LMConfig``, ByT5's ``T5Config``, SigLIP's config or None for
        text-to-video), read without weights."""
        from vidax.text import lm, siglip, t5

        if self.preset:
            p = self.preset
            return p.llm, p.byt5, p.siglip if self.image_to_video else None
        vis = siglip.SiglipVisionConfig.from_hf(self._json("image_encoder/config.json")) if self.image_to_video else None
        return (lm.LMConfig.from_hf(self._json("text_encoder/config.json")),
                t5.T5Config.from_hf(self._json("text_encoder_2/config.json")), vis)

    def load_image_encoder(self):
        from vidax.text import siglip

        if self.preset:
            return siglip.init(self.preset.siglip, seed=self.preset.seed + 5)
        return siglip.load_siglip(self.folder / "image_encoder", dtype=np.float32)

    def load_dit(self):
        """DiT state + config on one device, or (mesh / offloading) a :class:`~vidax.core.runner.DiTRunner`."""
        cfg = self.dit_config()
        if self.preset:
            state = hdit.init_state(cfg, seed=self.preset.seed + 2, dtype=self.dtype)
        else:
            with lazy_params(self.mesh is not None and self.offload_chunk_size is None):  # a host reads its shards
                state, cfg = hdit.load_dit(self.folder / "transformer", cfg, dtype=self.dtype)
        if self.mesh is None and self.offload_chunk_size is None and self.step_cache is None:
            return jax.device_put(state), cfg
        return hdit.runner(state, cfg, self.mesh, self.parallelism,
                           offload_chunk_size=self.offload_chunk_size, prefetch=self.prefetch), cfg

    def weight_loaders(self, request) -> list:
        from vidax.text import lm, t5

        out = [("text encoder", lambda: lm.load_lm(self.folder / "text_encoder", dtype=np.float32)),
               ("ByT5 encoder (text_encoder_2)", lambda: t5.load_t5(self.folder / "text_encoder_2", dtype=np.float32))]
        if self.image_to_video:
            out.append(("image encoder", self.load_image_encoder))
        return out + [("DiT", lambda: hdit.load_dit(self.folder / "transformer", self.dit_config(), dtype=self.dtype)),
                      ("VAE", self.load_vae)]

    def check(self, request) -> None:
        v = getattr(request, "offload_chunk_size", None)
        if v is not None:
            try:
                hdit.parse_chunk_sizes(v, self.dit_config())
            except ValueError as e:
                raise OptionError("offload_chunk_size", str(e)) from None
        if self.preset is None and self.folder is not None:
            missing = [w for w, globs in self._required_files() if not any(any(self.folder.glob(g)) for g in globs)]
            if missing:
                raise OptionError("checkpoint", f"{self.folder}: missing {'; '.join(missing)}")
        self._check_prompts(request)

    def load_vae(self):
        if self.preset:
            return hvae.init(self.preset.vae, seed=self.preset.seed + 3)
        return hvae.load_vae(self.folder / "vae", self.vae_config())

    def tiling(self, enabled: bool = True) -> hvae.Tiling:
        """The reference's ``enable_tiling`` defaults (256-px tiles, overlap 0.25; presets: smaller tiles)."""
        return hvae.Tiling(spatial=bool(enabled), sample=self.preset.tile_sample if self.preset else 256)

    def decode_chunk(self, request=None) -> int | None:
        """Latent frames per VAE decode call (None: all at once): the request's ``vae_chunk``, or
        :data:`DECODE_CHUNK` (presets: theirs)."""
        v = None if request is None else request.options.get("vae_chunk")
        if v is None:
            v = self.preset.decode_chunk if self.preset else DECODE_CHUNK
        return int(v) or None

    # ------------------------------------------------------------------ conditioning
    def encode_prompts(self, prompts, encoders=None, tokenizers=None) -> dict:
        """``{"embeds", "mask", "embeds_2", "mask_2"}`` (float32 / int32 numpy)."""
        tok, tok2 = tokenizers or self.load_tokenizers()
        llm, byt5 = encoders or self.load_text_encoders()
        emb, mask = htext.qwen_embeds(tok, llm, list(prompts), self.crop_start(tok), self.text_tokens)
        emb2, mask2 = htext.glyph_embeds(tok2, byt5, list(prompts), byt5.cfg.d_model, self.glyph_tokens)
        return {"embeds": emb, "mask": mask, "embeds_2": emb2, "mask_2": mask2}

    def image_tokens(self) -> int:
        return self.preset.siglip.grid ** 2 if self.preset else htext.IMAGE_TOKENS

    def encode_image(self, image, height: int, width: int, vae=None, tiling: bool = True):
        """``(SigLIP tokens [1, N, D], image latent [1, C, 1, h, w] scaled)`` of the image resized
        and centre-cropped to (height, width) as the reference does."""
        from vidax.text import siglip
        from vidax.text.clip import to_rgb_uint8

        rgb = resize_crop(to_rgb_uint8(image), height, width)
        emb = np.asarray(self.load_image_encoder()(siglip.preprocess(rgb, **self._siglip_preprocess()))["last_hidden_state"],
                         np.float32)
        vae = vae or self.load_vae()
        px = ((rgb.astype(np.float32) / 255.0) * 2.0 - 1.0).transpose(2, 0, 1)[None, :, None]
        z = hvae.encode(vae, px, self.tiling(tiling))
        return emb, (z * vae.cfg.scaling_factor).astype(np.float32)

    def _siglip_preprocess(self) -> dict:
        """``SiglipImageProcessor`` settings from ``feature_extractor/`` (size, mean, std)."""
        if self.preset:
            return {"size": self.preset.siglip.image_size}
        c = self._json("feature_extractor/preprocessor_config.json")
        s = c.get("size", 384)
        out = {"size": int(s.get("height", s.get("shortest_edge", 384)) if isinstance(s, dict) else s)}
        if c.get("image_mean") is not None:
            out.update(mean=tuple(c["image_mean"]), std=tuple(c["image_std"]))
        return out

    # ------------------------------------------------------------------ sampling
    def scheduler(self, steps: int, shift: float = 5.0):
        """Flow-matching Euler on the pipelines' sigmas ``linspace(1, 0, steps + 1)[:-1]`` with ``shift``."""
        return make_scheduler("flow_euler", steps, sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1], shift=float(shift),
                              num_train_timesteps=1000)

    def latent_shape(self, batch: int, height: int, width: int, num_frames: int):
        """Channels-last [B, F, h, w, C]."""
        g = self.geometry()
        return (batch, g.latent_frames(num_frames), height // g.spatial, width // g.spatial, self.latent_channels())

    def initial_noise(self, shape, seed: int):
        return jax.random.normal(jax.random.fold_in(jax.random.key(seed), 0x7FFFFFFF), shape, jnp.float32)

    @collect_own_garbage()  # frees what it loaded when it returns, without walking the caller's heap
    def sample_latents(self, cond: dict, uncond: dict | None = None, *, latents=None, seed: int = 0, height: int = 480,
                       width: int = 848, num_frames: int = 121, steps: int = 50, guidance: float = 6.0,
                       shift: float = 5.0, image_embeds=None, image_latents=None, dit=None, start: int = 0,
                       state=None, on_step=None) -> np.ndarray:
        """Denoise. ``cond`` / ``uncond``: :meth:`encode_prompts` dicts (``uncond`` used when
        ``guidance != 1``); ``latents``: the starting noise [B, C, F, h, w] (drawn from ``seed``
        when omitted), or the latents saved after step ``start - 1`` with the scheduler ``state``.
        ``image_embeds`` [1, N, D] / ``image_latents`` [1, C, 1, h, w]: image-to-video. Returns the
        final latents [B, C, F, h, w] (float32 numpy)."""
        if self.image_to_video and (image_latents is None or image_embeds is None):
            raise ValueError("this is an image-to-video model: pass image_embeds and image_latents (encode_image)")
        sched = self.scheduler(steps, shift)
        n = len(sched.timesteps)
        if not 0 <= start < n:
            raise ValueError(f"start={start} outside [0, {n})")
        b = cond["embeds"].shape[0]
        if latents is None:
            if start:
                raise ValueError("resuming (start > 0) needs the latents saved at that step")
            x = self.initial_noise(self.latent_shape(b, height, width, num_frames), seed)
        else:
            x = jnp.asarray(np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1))
        state = sched.init_state(x) if state is None else jax.tree.map(jnp.asarray, state)
        params, cfg = dit if dit is not None else self.load_dit()
        runner = params if isinstance(params, DiTRunner) else None
        dt = runner.dtype if runner is not None else hdit.state_dtype(params)
        use_cfg = uncond is not None and float(guidance) != 1.0
        if self.step_cache is not None:  # per CFG branch (diffusers' cond / uncond contexts)
            self.step_cache.begin(1, 2 if use_cfg else 1, start)
            runner.use_cache(self.step_cache)
        # the DiT's extra input channels: [condition latents, mask] (zeros for text-to-video)
        cond_lat = jnp.zeros(x.shape, jnp.float32)
        mask = jnp.zeros(x.shape[:-1] + (1,), jnp.float32)
        if image_latents is not None:
            img = jnp.asarray(np.asarray(image_latents, np.float32).transpose(0, 2, 3, 4, 1))
            if img.shape[2:] != x.shape[2:]:
                raise ValueError(f"image latent {img.shape} does not match the latents {x.shape}")
            cond_lat = cond_lat.at[:, :1].set(jnp.broadcast_to(img, (b,) + img.shape[1:]))
            mask = mask.at[:, :1].set(1.0)
        if image_embeds is None:
            image_embeds = np.zeros((1, self.image_tokens(), cfg.image_embed_dim), np.float32)
        aux = {"extra": jnp.concatenate([cond_lat, mask], axis=-1),
               "image": jnp.broadcast_to(jnp.asarray(image_embeds, dt), (b,) + np.shape(image_embeds)[1:])}

        def pack(c):
            return {"ctx": jnp.asarray(c["embeds"], dt), "mask": jnp.asarray(c["mask"], jnp.float32),
                    "ctx2": jnp.asarray(c["embeds_2"], dt), "mask2": jnp.asarray(c["mask_2"], jnp.float32)}

        c, u = pack(cond), (pack(uncond) if use_cfg else None)
        step = _cached_step(cfg, sched, use_cfg, runner)
        # the step's arguments: the weights and the RoPE tables of this grid (never compiled-in constants)
        if runner is None:
            params = (params, h10.rope_tables(cfg, h10.grid_of(cfg, x.shape)))
        elif runner.offload is None and runner.cache is None:
            params = runner.step_params({"x": x.shape})
        for i in range(start, n):
            t0 = time.perf_counter()
            x, state = step(params, x, state, jnp.int32(i), c, u, jnp.float32(guidance), aux)
            if on_step is not None:
                x.block_until_ready()
                on_step(StepInfo(i, n, float(sched.timesteps[i]), time.perf_counter() - t0), x, state)
        del params
        return np.asarray(x).transpose(0, 4, 1, 2, 3)

    # ------------------------------------------------------------------ decode
    def decode_video(self, latents, vae=None, tiling: bool = True, chunk: int | None = None) -> np.ndarray:
        """Latents [B, C, F, h, w] (as sampled, scaled) -> video in [0, 1], [B, F, H, W, 3].
        ``chunk``: latent frames per decode call (None: all at once)."""
        vae = vae or self.load_vae()
        z = np.asarray(latents, np.float32) / vae.cfg.scaling_factor
        return to_unit_range(hvae.decode(vae, z, self.tiling(tiling), chunk))

    def decode_plan(self, request) -> list[DecodeSpan]:
        """With ``vae_tiling`` and a latent larger than one tile: one stage per spatial tile (the
        reference's tiles, its overlap included, raster order), every frame, persisting the tile's
        raw decode; :meth:`assemble_video` cross-fades them as the reference's ``tiled_decode``.
        Otherwise contiguous latent frame ranges (up to 4, or ``decode_stages``; on chunk
        boundaries): the decoder is causal, so a stage decodes the chunks up to its range's end
        with the whole sequence's programs and keeps its frames. No stage carries anything to the
        next: any one reruns alone."""
        g, s = self.geometry(), self.vae_config().spatial_compression_ratio
        f = g.latent_frames(request.num_frames)
        grid = hvae.tile_grid(request.height // s, request.width // s,
                              self.tiling(bool(request.options.get("vae_tiling", True))), s)
        boxes = [b for row in grid for b in row]
        if len(boxes) > 1:
            return [DecodeSpan(f"decode/{k}", "video", (0, f), box) for k, box in enumerate(boxes)]
        chunk = self.decode_chunk(request) or 1
        units = -(-f // chunk)
        k = min(getattr(request, "decode_stages", None) or 4, units)
        bounds = [min(f, round(i * units / k) * chunk) for i in range(k + 1)]
        return [DecodeSpan(f"decode/{i}", "video", (bounds[i], bounds[i + 1])) for i in range(k)]

    def assemble_video(self, parts) -> np.ndarray:
        """uint8 [B, F, H, W, 3]: frame-range stages concatenated; tile stages (raw decodes)
        cross-faded as the reference's ``tiled_decode`` (:func:`vae.assemble_tiles`), then
        post-processed as one decode."""
        if parts[0][0].tile is None:
            return np.concatenate([f for _, f in parts], axis=1)
        rows: dict = {}
        for span, px in parts:
            rows.setdefault(span.tile[0], []).append((span.tile[2], np.asarray(px, np.float32)))
        s = self.vae_config().spatial_compression_ratio
        h, w = max(sp.tile[1] for sp, _ in parts) * s, max(sp.tile[3] for sp, _ in parts) * s
        grid = [[px for _, px in sorted(r, key=lambda t: t[0])] for _, r in sorted(rows.items())]
        px = hvae.assemble_tiles(grid, self.tiling(True), h, w)
        return to_uint8(to_unit_range(px.transpose(0, 4, 1, 2, 3)))

    # ------------------------------------------------------------------ memory plan
    def plan_units(self, request) -> list:
        """Encode: the Qwen2.5-VL tower to ``hidden_states[-3]`` over the templated prompts (float32,
        tensor-parallel over the encode pool's chips as :meth:`load_text_encoders` splits it), the
        ByT5 glyph encoder, and for image-to-video SigLIP and the image's VAE encode (one 256-px
        tile with ``vae_tiling``). Sample: one DiT call on the CFG batch on this pipeline's mesh,
        inputs as the step passes them. Decode: one spatial tile (``vae_tiling``) or the whole
        frame, one unit per decoder level (each level is its own compiled call) of the program a
        decode stage repeats: a later temporal chunk of ``vae_chunk`` latent frames with the
        causal state it reads (all latent frames at once without chunks)."""
        from vidax.core import nn
        from vidax.core import plan as vplan
        from vidax.text import lm, siglip, t5

        b = len(request.prompts)
        llm_cfg, byt5_cfg, vis_cfg = self.text_config()
        tp = 1 if self.preset else self.pool_devices(request, "encode")  # as load_text_encoders splits it
        enc = lm.abstract(llm_cfg, np.float32)
        enc = lm.shard(enc, f"tp={tp}") if tp > 1 else enc
        crop = htext.template_prefix_tokens(htext.PresetQwenTokenizer()) if self.preset else htext.CROP_START
        t = self.text_tokens + crop  # the chat template's prefix is encoded, then cropped
        ids = vplan.abstract((b, t), np.int32)
        units = [vplan.split_unit("encode", "Qwen2.5-VL text encoder", enc, ids, ids, None, method="layer",
                                  index=htext.HIDDEN_INDEX, note=f"{b} prompt(s) x {t} tokens" + (f", tp={tp}" * (tp > 1))),
                 t5.plan_unit(byt5_cfg, 1, self.glyph_tokens, name="ByT5 glyph encoder")]  # glyphs: one prompt a call
        vcfg, tiling = self.vae_config(), bool(request.options.get("vae_tiling", True))
        vae = nn.Split(*nn.abstract_state(lambda: hvae._build(vcfg)), vcfg)
        s, til = vcfg.spatial_compression_ratio, self.tiling(tiling)

        def vae_unit(*a, **k):  # the whole VAE stays resident while one of its programs runs
            return vplan.split_unit(*a, resident=True, **k)

        if vis_cfg is not None:
            px = vplan.abstract((1, 3, vis_cfg.image_size, vis_cfg.image_size), np.float32)
            ih, iw = request.height, request.width
            ih, iw = (min(ih, til.sample), min(iw, til.sample)) if tiling else (ih, iw)  # encode_moments' tile
            units += [vplan.split_unit("encode", "SigLIP image encoder", siglip.abstract(vis_cfg), px),
                      vae_unit("encode", "VAE image encode", vae, vplan.abstract((1, 1, ih, iw, 3), np.float32),
                               method="encode_tile", note=f"1 frame of {ih}x{iw}")]
        cfg = self.dit_config()
        runner = hdit.runner(hdit.abstract_state(cfg, self.dtype), cfg, self.mesh, self.parallelism)
        nb = 2 * b if float(request.guidance) != 1.0 else b
        shape = self.latent_shape(nb, request.height, request.width, request.num_frames)
        f32, dt = (lambda *a: vplan.abstract(a, np.float32)), (lambda *a: vplan.abstract(a, self.dtype))  # noqa: E731
        args = (runner.step_params({"x": shape}), dt(*shape[:-1], cfg.in_channels), f32(nb), dt(nb, self.text_tokens,
                                                                                                cfg.text_embed_dim),
                f32(nb, self.text_tokens), dt(nb, self.glyph_tokens, cfg.text_embed_2_dim), f32(nb, self.glyph_tokens),
                dt(nb, self.image_tokens(), cfg.image_embed_dim), f32(nb) if cfg.use_meanflow else None)
        units.append(vplan.Unit("sample", "DiT step", jax.jit(runner.apply), args, weights=runner.params,
                                note=f"batch {nb} x {int(np.prod(shape[1:4])):,} video + {self.text_tokens} text + "
                                     f"{self.glyph_tokens} glyph + {self.image_tokens()} image tokens"))
        _, f, h, w, c = shape
        lt = til.latent_tile(s)
        if til.spatial and (h > lt or w > lt):
            h, w = min(h, lt), min(w, lt)
        what = " (one tile)" * ((h, w) != shape[2:4])
        levels, chunk = len(vcfg.block_out_channels) + 2, self.decode_chunk(request)
        if chunk is None or f <= chunk:  # every frame in one call per level
            x = vplan.abstract((b, f, h, w, c), np.float32)
            for i in range(levels):
                units.append(vae_unit("decode", f"VAE decode level {i}", vae, x, method="decode_level", level=i,
                                      note=f"{b} x {f} latent frames of {h}x{w}{what}"))
                x = jax.eval_shape(vae.method_fn("decode_level", level=i), vae.state, x)
            return units
        # a later chunk (the first reads no state and makes fewer frames): its input, the causal
        # state the previous chunk left (what the first one returns) and the chunk's offset
        kv, off = -(-f // chunk) * chunk, vplan.abstract((), np.int32)
        fn = lambda i: vae.method_fn("decode_level_chunk", kv_frames=kv, level=i)  # noqa: E731
        x = x0 = vplan.abstract((b, chunk, h, w, c), np.float32)
        for i in range(levels):
            x0, st = jax.eval_shape(fn(i), vae.state, x0, None, off)
            units.append(vae_unit("decode", f"VAE decode level {i}", vae, x, st, off, method="decode_level_chunk",
                                  level=i, kv_frames=kv,
                                  note=f"{b} x {chunk} of {f} latent frames of {h}x{w}{what}, + causal state"))
            x = jax.eval_shape(fn(i), vae.state, x, st, off)[0]
        return units

    # ------------------------------------------------------------------ the stage protocol
    def fingerprint(self, component: str) -> str:
        if self.preset is not None:
            return f"preset:{self.preset_name}:{component}:{self.dtype.name}"
        files = {"text": ["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"], "dit": ["transformer"],
                 "vae": ["vae"], "image": ["vae", "image_encoder", "feature_extractor"]}[component]
        return f"{component}:{self.dtype.name}:" + files_fingerprint(self.folder, files)

    def _dt(self, request):
        return np.dtype(np.float32) if request.dtype == "float32" else np.dtype(jnp.bfloat16)

    def encode(self, request, image: np.ndarray | None = None) -> dict[str, Named]:
        """Qwen embeddings + mask, ByT5 glyph embeddings + mask (computed in float32, stored in the
        request's dtype, masks int32), the negative prompt's when guidance != 1, and for
        image-to-video the SigLIP tokens and the image latent."""
        self._check_prompts(request)
        if self.image_to_video and image is None:
            raise OptionError("image", "this is an image-to-video model: give an image")
        toks, encs = self.load_tokenizers(), self.load_text_encoders()
        dt = self._dt(request)
        attrs = dict(model=request.model, computed_in="float32", stored_as=str(dt))
        out = {}

        def put(prefix, c):
            for k in ("embeds", "embeds_2"):
                out[f"{prefix}_{k}"] = Named(c[k].astype(dt), _EMB_DIMS, attrs)
            for k in ("mask", "mask_2"):
                out[f"{prefix}_{k}"] = Named(c[k].astype(np.int32), ("batch", "token"), {"role": "text mask"})

        put("prompt", self.encode_prompts(request.prompts, encs, toks))
        if float(request.guidance) != 1.0:
            neg = request.negative_prompt if request.negative_prompt is not None else ""
            put("negative", self.encode_prompts([neg] * len(request.prompts), encs, toks))
        del encs
        if image is not None and self.image_to_video:
            emb, lat = self.encode_image(image, request.height, request.width,
                                         tiling=bool(request.options.get("vae_tiling", True)))
            out["image_embeds"] = Named(emb.astype(dt), _EMB_DIMS, attrs)
            out["image_latents"] = Named(lat, _LATENT_DIMS, {"role": "image latent (scaled)"})
        return out

    def sample(self, conditioning: dict, request, *, resume: dict | None = None, on_step=None) -> dict[str, Named]:
        o = request.options
        keys = ("embeds", "mask", "embeds_2", "mask_2")
        cond = {k: np.asarray(conditioning[f"prompt_{k}"]) for k in keys}
        uncond = None
        if float(request.guidance) != 1.0:
            uncond = {k: np.asarray(conditioning[f"negative_{k}"]) for k in keys}
        shift = o.get("shift") or 5.0
        start, latents, state = 0, None, None
        sched = self.scheduler(request.steps, shift)
        if resume is not None:
            start = int(resume["step"])
            shape = self.latent_shape(cond["embeds"].shape[0], request.height, request.width, request.num_frames)
            latents, state = unpack_state(resume["arrays"], sched.init_state(jnp.zeros(shape, jnp.float32)))

        def step_cb(info, x, st):
            on_step(info, lambda: pack_state(np.asarray(x).transpose(0, 4, 1, 2, 3), st))

        img = conditioning.get("image_embeds")
        lat = self.sample_latents(cond, uncond, latents=latents, seed=request.seed, height=request.height,
                                  width=request.width, num_frames=request.num_frames, steps=request.steps,
                                  guidance=request.guidance, shift=shift,
                                  image_embeds=None if img is None else np.asarray(img, np.float32),
                                  image_latents=conditioning.get("image_latents"), start=start, state=state,
                                  on_step=None if on_step is None else step_cb)
        return {"latents": Named(lat, _LATENT_DIMS, {"model": request.model, "layout": "reference [B, C, F, H, W]",
                                                     "scaled": True})}

    def decode(self, latents: dict, span: DecodeSpan, carry: dict | None, request):
        """A tile stage: the tile's raw decode (float32 [B, F, h, w, 3], the reference's tile with
        its overlap, blended when muxed). A frame-range stage: uint8 frames of latent frames
        ``span.frames`` (the chunks up to its end, the whole sequence's programs)."""
        vae = self.load_vae()
        z = np.asarray(latents["latents"], np.float32) / vae.cfg.scaling_factor
        chunk = self.decode_chunk(request)
        dims = ("batch", "frame", "height", "width", "rgb")
        if span.tile is not None:
            y0, y1, x0, x1 = span.tile
            zt = np.ascontiguousarray(z[..., y0:y1, x0:x1].transpose(0, 2, 3, 4, 1))
            px = hvae.decode_tile(vae, zt, chunk)
            return {"frames": Named(px, dims, {"tile": list(span.tile), "latent_frames": list(span.frames),
                                               "units": "raw decoder output, float32 (nominally [-1, 1]); "
                                                        "cross-faded with its neighbours and quantised at mux"})}, None
        a, b = span.frames
        px = hvae.decode_frames(vae, z, a, b, self.tiling(bool(request.options.get("vae_tiling", True))),
                                prefix_only=chunk is not None, chunk=chunk)
        return {"frames": Named(to_uint8(to_unit_range(px)), dims, {"latent_frames": [a, b], "units": "uint8 RGB"})}, None

    # ------------------------------------------------------------------ probe hooks
    def vae_encode(self, video: np.ndarray) -> np.ndarray:
        """Pixels [B, 3, F, H, W] in [-1, 1] -> latents as the DiT sees them (posterior mode x
        scaling_factor), as the image-to-video pipeline encodes its image."""
        vae = self.load_vae()
        return (hvae.encode(vae, np.asarray(video, np.float32), self.tiling(True)) * vae.cfg.scaling_factor).astype(np.float32)

    def vae_decode(self, latents: np.ndarray) -> np.ndarray:
        return self.decode_video(latents, chunk=self.decode_chunk())

    def denoise_once(self, latents, sigmas, conditioning, request=None) -> np.ndarray:
        """The clean estimate ``x - sigma * v`` per row: one DiT call at timestep ``sigma * 1000``
        with the first prompt's Qwen and glyph conditioning, no guidance; the image tokens and the
        image latent's channels enter as in sampling (meanflow models: ``timestep_r`` 0, the
        average velocity to the end)."""
        params, cfg = self.load_dit()
        runner = params if isinstance(params, DiTRunner) else None
        dt = runner.dtype if runner is not None else hdit.state_dtype(params)
        c = {k: jnp.asarray(np.asarray(conditioning[f"prompt_{k}"])[:1]) for k in ("embeds", "mask", "embeds_2", "mask_2")}
        x = np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1)
        extra = np.zeros(x.shape[1:-1] + (x.shape[-1] + 1,), np.float32)[None]
        if conditioning.get("image_latents") is not None:
            extra[:, :1, ..., :-1] = np.asarray(conditioning["image_latents"], np.float32).transpose(0, 2, 3, 4, 1)
            extra[:, :1, ..., -1] = 1.0
        img = conditioning.get("image_embeds")
        img = np.zeros((1, self.image_tokens(), cfg.image_embed_dim), np.float32) if img is None else np.asarray(img)[:1]
        out = []
        for i, s in enumerate(np.asarray(sigmas, np.float32)):
            xin = jnp.asarray(np.concatenate([x[i:i + 1], extra], axis=-1), dt)
            args = (xin, jnp.full((1,), s * 1000.0, jnp.float32), jnp.asarray(c["embeds"], dt), jnp.asarray(c["mask"],
                                                                                                            jnp.float32),
                    jnp.asarray(c["embeds_2"], dt), jnp.asarray(c["mask_2"], jnp.float32), jnp.asarray(img, dt),
                    jnp.zeros((1,), jnp.float32) if cfg.use_meanflow else None)
            v = runner(*args) if runner is not None else _forward(params, cfg, *args)
            out.append(x[i:i + 1] - s * np.asarray(v, np.float32))
        del params
        return np.concatenate(out).transpose(0, 4, 1, 2, 3)

    # ------------------------------------------------------------------ one call
    def generate(self, prompt, negative_prompt=None, *, image=None, seed: int = 0, height: int | None = None,
                 width: int | None = None, num_frames: int = 121, steps: int = 50, guidance: float = 6.0,
                 shift: float = 5.0, vae_tiling: bool = True, vae_chunk: int | None = None, on_step=None) -> np.ndarray:
        """Prompt(s) (+ image) -> uint8 frames [B, F, H, W, 3]. The size defaults to the reference's
        (16:9 bucket for text-to-video, the image's bucket for image-to-video)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if height is None or width is None:
            if self.image_to_video:
                from vidax.text.clip import to_rgb_uint8

                ih, iw = to_rgb_uint8(image).shape[:2]
                height, width = self.size_for_image(ih, iw)
            else:
                height, width = self.size_for_image(9, 16)
        self.geometry().check(height, width, num_frames)
        toks, encs = self.load_tokenizers(), self.load_text_encoders()
        cond = self.encode_prompts(prompts, encs, toks)
        uncond = None
        if guidance != 1.0:
            neg = negative_prompt if negative_prompt is not None else ""
            uncond = self.encode_prompts([neg] * len(prompts), encs, toks)
        del encs
        vae = self.load_vae()
        emb = lat = None
        if self.image_to_video:
            emb, lat = self.encode_image(image, height, width, vae, vae_tiling)
        out = self.sample_latents(cond, uncond, seed=seed, height=height, width=width, num_frames=num_frames,
                                  steps=steps, guidance=guidance, shift=shift, image_embeds=emb, image_latents=lat,
                                  on_step=on_step)
        chunk = self.decode_chunk(SimpleNamespace(options={"vae_chunk": vae_chunk}))
        return to_uint8(self.decode_video(out, vae, vae_tiling, chunk))


class HunyuanVideo15I2V(HunyuanVideo15T2V):
    """HunyuanVideo 1.5 image-to-video (``HunyuanVideo15ImageToVideoPipeline`` folders, ``tiny-i2v``)."""

    def __init__(self, source: str | Path = "tiny-i2v", **kw):
        super().__init__(source, **kw)
        if not self.image_to_video:
            raise ValueError(f"{source}: not an image-to-video model ({self.pipeline_class}); use HunyuanVideo15T2V")


# ----------------------------------------------------------------------------------- the step
_STEPS: dict = {}
_forward = jax.jit(hdit.forward, static_argnums=1)


def _cached_step(cfg, sched, use_cfg, runner=None):
    """The step for this model config, schedule contents (:func:`vidax.core.sampling.schedule_key`)
    and guidance, built once per process (one-device DiT; it holds no weights) or per runner: a
    batch of runs with equal settings compiles it once."""
    from vidax.core.sampling import schedule_key

    cache = _STEPS if runner is None else runner.__dict__.setdefault("_hv15_steps", {})
    key = (cfg, schedule_key(sched), use_cfg, runner is not None and runner.cache is not None)
    if key not in cache:
        while len(cache) >= 8:
            cache.pop(next(iter(cache)))
        cache[key] = _make_step(cfg, sched, use_cfg, runner)
    return cache[key]


def _make_step(cfg: hdit.HunyuanVideo15Config, sched, use_cfg: bool, runner=None):
    """One sampling step ``(params, x, state, i, cond, uncond, guidance, aux) -> (x, state)``:
    model (a batch of two with CFG) + guidance + Euler update, jitted whole for a resident DiT
    (one device, or a runner's ``apply``); for a streaming (offloading) runner the model call runs
    between a jitted input and a jitted update. ``x`` channels-last."""
    timesteps = jnp.asarray(np.asarray(sched.timesteps, np.float32))
    n = len(sched.timesteps)
    k = 2 if use_cfg else 1

    def inputs(x, i, cond, uncond, aux, dt):
        cc = cond if not use_cfg else jax.tree.map(lambda a, u: jnp.concatenate([a, u], axis=0), cond, uncond)
        xin = jnp.concatenate([jnp.concatenate([x, aux["extra"]], axis=-1).astype(dt)] * k, axis=0)
        t = jnp.full((xin.shape[0],), timesteps[i], jnp.float32)
        t_r = None
        if cfg.use_meanflow:  # the next timestep, 0 after the last
            t_r = jnp.full(t.shape, jnp.where(i + 1 < n, timesteps[jnp.minimum(i + 1, n - 1)], 0.0), jnp.float32)
        img = jnp.concatenate([aux["image"]] * k, axis=0)
        return (xin, t, cc["ctx"], cc["mask"], cc["ctx2"], cc["mask2"], img, t_r)

    def update(x, state, v, i, guidance):
        b = x.shape[0]
        v = v.astype(jnp.float32)
        if use_cfg:
            v = v[b:] + guidance * (v[:b] - v[b:])
        return sched.step(state, v, i, x)

    if runner is None or (runner.offload is None and runner.cache is None):
        # p: (the DiT state, its RoPE tables) on one device; a runner's step_params otherwise
        model = (lambda p, *a: hdit.forward(p[0], cfg, *a, rope=p[1])) if runner is None else runner.apply  # noqa: E731
        dtype = (lambda p: hdit.state_dtype(p[0])) if runner is None else (lambda p: runner.dtype)  # noqa: E731

        @jax.jit
        def step(p, x, state, i, cond, uncond, guidance, aux):
            return update(x, state, model(p, *inputs(x, i, cond, uncond, aux, dtype(p))), i, guidance)

        return step

    pre = jax.jit(lambda x, i, cond, uncond, aux: inputs(x, i, cond, uncond, aux, runner.dtype))
    upd = jax.jit(update)

    def streamed(p, x, state, i, cond, uncond, guidance, aux):
        return upd(x, state, runner(*pre(x, i, cond, uncond, aux)), i, guidance)

    return streamed
