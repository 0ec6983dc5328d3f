"""HunyuanVideo 1.0 text-to-video and image-to-video: prompt encode (fp32) -> DiT sampling
(flow-matching Euler, embedded guidance) -> VAE decode in persisted temporal-tile stages.

Sources: a preset (``tiny``, ``tiny-i2v`` [token_replace], ``tiny-i2v-33ch`` [latent_concat]:
seeded random weights, runs on a CPU in seconds) or a diffusers pipeline folder
(``HunyuanVideoPipeline`` / ``HunyuanVideoImageToVideoPipeline``: ``text_encoder/`` Llama-3 (I2V:
LLaVA), ``tokenizer/``, ``text_encoder_2/`` CLIP-L, ``tokenizer_2/``, ``transformer/``, ``vae/``,
``scheduler/``; I2V also ``image_processor/``), local or at any fsspec URL.

Sampling follows the reference pipelines exactly: ``sigmas = linspace(1, 0, steps + 1)[:-1]``
shifted by the scheduler's ``shift`` (7.0), the DiT gets ``guidance * 1000`` (models with
``guidance_embeds``), no CFG batch -- unless ``true_cfg`` > 1, the pipelines' optional real
classifier-free guidance with the negative prompt (one batch of two). Image-to-video:
``latent_concat`` (the 33-channel release) feeds ``[latents, image latent on frame 0, frame-0
mask]`` and drops the first 4 decoded frames; ``token_replace`` puts the image latent on frame 0
before every call and after every step. Both start from ``0.999 * noise + 0.001 * image latent``.
"""
from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.runtime import collect_own_garbage
from vidax.core.runner import DiTRunner
from vidax.core.sampling import StepInfo
from vidax.models.hunyuanvideo import dit as hdit
from vidax.models.hunyuanvideo import magcache as hmag
from vidax.models.hunyuanvideo import text as htext
from vidax.models.hunyuanvideo import vae as hvae
from vidax.pipeline import (DecodeSpan, Geometry, Named, Option, OptionError, Pipeline, pack_state, to_uint8,
                            to_unit_range, unpack_state)
from vidax.schedulers import make_scheduler
from vidax.weights.fingerprint import files_fingerprint
from vidax.weights.keymap import lazy_params

log = logging.getLogger(__name__)

_CONFIG_FILES = ("model_index.json", "*/config.json", "scheduler/scheduler_config.json", "*/preprocessor_config.json")
_EMB_DIMS = ("batch", "token", "channel")
_LATENT_DIMS = ("batch", "channel", "frame", "height", "width")
IMAGE_START_MIX = 0.999  # the I2V pipelines start from 0.999 * noise + 0.001 * image latent


@dataclass(frozen=True)
class TinyPreset:
    """A complete seeded random-weight HunyuanVideo-shaped model that runs on a laptop CPU."""

    dit: hdit.HunyuanVideoConfig = field(default_factory=lambda: hdit.PRESETS["tiny"])
    vae: hvae.HunyuanVAEConfig = field(default_factory=lambda: hvae.HunyuanVAEConfig(
        latent_channels=16, block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=4))
    llm: object = None  # vidax.text.lm.LMConfig
    clip: object = None  # vidax.text.clip_text.CLIPTextConfig
    vision: object = None  # vidax.text.clip.CLIPVisionConfig (LLaVA's tower, image-to-video)
    pipeline_class: str = "HunyuanVideoPipeline"
    seed: int = 0


def _tiny_presets() -> dict:
    from vidax.text.clip import CLIPVisionConfig
    from vidax.text.lm import LMConfig

    llm = LMConfig(vocab_size=264, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=8, rms_norm_eps=1e-5)
    clip = _clip_text_config(vocab_size=259, hidden_size=24, intermediate_size=48, num_layers=2, num_heads=4,
                             max_position_embeddings=77, hidden_act="quick_gelu", eos_token_id=1)
    base = TinyPreset(dit=replace(hdit.PRESETS["tiny"], text_embed_dim=32, pooled_projection_dim=24), llm=llm, clip=clip)
    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=16, intermediate_size=32, num_layers=3,
                              num_heads=2, hidden_act="quick_gelu")
    i2v = "HunyuanVideoImageToVideoPipeline"
    return {
        "tiny": base,
        "tiny-i2v": replace(base, dit=replace(base.dit, image_condition_type="token_replace"), vision=vision,
                            pipeline_class=i2v),
        "tiny-i2v-33ch": replace(base, dit=replace(base.dit, in_channels=33, guidance_embeds=False,
                                                   image_condition_type="latent_concat"), vision=vision,
                                 pipeline_class=i2v),
    }


def _clip_text_config(**kw):
    from vidax.text.clip_text import CLIPTextConfig

    return CLIPTextConfig(**kw)


try:
    PRESET_SOURCES = _tiny_presets()
except ImportError:  # pragma: no cover - vidax.text.clip_text not merged yet
    PRESET_SOURCES = {}


def resize_for_vae(image_uint8: np.ndarray, height: int, width: int) -> np.ndarray:
    """The reference's ``VideoProcessor.preprocess(image, height, width)`` for one RGB image: PIL
    Lanczos resize to exactly (height, width), /255, to [-1, 1]. Returns float32 [3, H, W]."""
    import PIL.Image

    im = PIL.Image.fromarray(np.asarray(image_uint8, np.uint8)).resize((width, height), resample=PIL.Image.Resampling.LANCZOS)
    a = np.asarray(im.convert("RGB")).astype(np.float32) / 255.0
    return (2.0 * a - 1.0).transpose(2, 0, 1).astype(np.float32)


class TrueCfgWarning(UserWarning):
    """``true_cfg`` > 1 without a negative prompt: no true CFG (as ``HunyuanVideoPipeline``)."""


def effective_true_cfg(true_cfg, negative_prompt) -> float:
    """The true-CFG scale a run uses: ``HunyuanVideoPipeline`` and
    ``HunyuanVideoImageToVideoPipeline`` run true classifier-free guidance only when
    ``true_cfg_scale > 1`` **and** a negative prompt is given (``""`` counts as given); otherwise
    the scale is ignored (1.0: embedded guidance alone)."""
    v = float(true_cfg or 1.0)
    return v if v > 1.0 and negative_prompt is not None else 1.0


class HunyuanVideoT2V(Pipeline):
    """HunyuanVideo text-to-video (and, from an image-to-video source, image-to-video; see
    :class:`HunyuanVideoI2V`). ``source``: a preset name or a checkpoint folder / URL."""

    FAMILY = "hunyuanvideo"
    STEP_CACHE = True
    MAG_RATIOS = hmag.MAG_RATIOS  # published MagCache calibration (vidax/models/hunyuanvideo/magcache.py)
    TEA_COEFFS = hmag.TEA_COEFFS  # published TeaCache polynomial (same file)
    GUIDANCE = "embedded"
    OPTIONS = (
        Option("shift", float, 7.0, "flow-matching timestep shift", minimum=0.0, maximum=100.0),
        Option("true_cfg", float, 1.0, "real classifier-free guidance with the negative prompt (> 1: a batch of two; "
                                       "without --negative-prompt it is off, as in HunyuanVideoPipeline)",
               minimum=1.0, maximum=100.0, stages=("encode", "sample")),
        Option("vae_tiling", bool, True, "decode (and encode) in overlapping 256-px spatial tiles, as the reference "
                                         "examples enable", stages=("encode", "decode")),
    )
    COMPONENTS = {"encode": ("text",), "image": ("image",), "sample": ("dit",), "decode": ("vae",)}

    def __init__(self, source: str | Path = "tiny", *, dtype=np.float32, mesh=None, parallelism: str | None = None,
                 offload_chunk_size=None, prefetch: bool = True):
        """``mesh``: None, ``"dp=1,tp=4,sp=2"`` or a Mesh; ``offload_chunk_size``: stream each block
        stack from host memory (an int dividing both stacks, "all", or ``"double=N,single=M"``)."""
        self.dtype = np.dtype(dtype)
        self.mesh, self.parallelism = mesh, parallelism
        self.offload_chunk_size, self.prefetch = offload_chunk_size, prefetch
        index = self.open_source(source, PRESET_SOURCES, _CONFIG_FILES, "HunyuanVideo pipeline")
        self.pipeline_class = self.preset.pipeline_class if self.preset else index.get("_class_name", "HunyuanVideoPipeline")
        if self.pipeline_class not in ("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline"):
            raise ValueError(f"{source}: {self.pipeline_class} is not a HunyuanVideo 1.0 pipeline")
        self.image_to_video = self.pipeline_class == "HunyuanVideoImageToVideoPipeline"

    # ------------------------------------------------------------------ configs
    def dit_config(self) -> hdit.HunyuanVideoConfig:
        if self.preset:
            return self.preset.dit
        path = self.config_folder / "transformer" / "config.json"
        return hdit.HunyuanVideoConfig.from_diffusers(json.loads(path.read_text()))

    def vae_config(self) -> hvae.HunyuanVAEConfig:
        if self.preset:
            return self.preset.vae
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return hvae.HunyuanVAEConfig.from_diffusers(json.loads((self.config_folder / "vae" / "config.json").read_text()))

    @property
    def condition_type(self) -> str | None:
        return self.dit_config().image_condition_type

    def latent_channels(self) -> int:
        cfg = self.dit_config()
        return (cfg.in_channels - 1) // 2 if cfg.image_condition_type == "latent_concat" else cfg.in_channels

    def geometry(self) -> Geometry:
        dc, vc = self.dit_config(), self.vae_config()
        return Geometry(spatial=vc.spatial_compression_ratio, temporal=vc.temporal_compression_ratio,
                        latent_channels=self.latent_channels(), patch=dc.patch, num_heads=dc.num_heads)

    def template(self) -> tuple[str, int]:
        """(prompt template, crop_start) for this pipeline and tokenizer."""
        t = htext.I2V_TEMPLATE if self.image_to_video else htext.T2V_TEMPLATE
        if self.preset:
            return t, htext.template_tokens(htext.PresetTokenizer(), t)
        return t, (htext.I2V_CROP_START if self.image_to_video else htext.T2V_CROP_START)

    # ------------------------------------------------------------------ checks
    def _required_files(self) -> list[tuple[str, list[str]]]:
        req = [("the text encoder (text_encoder/*.safetensors)", ["text_encoder/*.safetensors"]),
               ("the tokenizer (tokenizer/tokenizer.json)", ["tokenizer/tokenizer.json"]),
               ("the CLIP text encoder (text_encoder_2/*.safetensors)", ["text_encoder_2/*.safetensors"]),
               ("the CLIP tokenizer (tokenizer_2/)", ["tokenizer_2/tokenizer.json", "tokenizer_2/vocab.json"]),
               ("the DiT (transformer/*.safetensors)", ["transformer/*.safetensors"]),
               ("the VAE (vae/*.safetensors)", ["vae/*.safetensors"])]
        return req

    def weight_loaders(self, request) -> list:
        from vidax.text import clip_text, lm

        if self.image_to_video:
            from vidax.models.hunyuanvideo import llava

            te = self.folder / "text_encoder"  # the LLaVA tower's three parts, each checked on its own
            text = [("text encoder (LLaVA language model)", lambda: lm.load_lm(te, dtype=np.float32)),
                    ("text encoder (LLaVA vision tower)", lambda: llava.load_vision_tower(te)),
                    ("text encoder (LLaVA projector)", lambda: llava.load_projector(te))]
        else:
            text = [("text encoder", lambda: lm.load_lm(self.folder / "text_encoder", dtype=np.float32))]
        return [*text, ("CLIP text encoder (text_encoder_2)",
                       lambda: clip_text.load_clip_text(self.folder / "text_encoder_2", dtype=np.float32)),
                ("DiT", lambda: hdit.load_dit(self.folder / "transformer", self.dit_config(), dtype=self.dtype)),
                ("VAE", self.load_vae)]

    def check(self, request) -> None:
        v = getattr(request, "offload_chunk_size", None)
        if v is not None and (v == "all" or str(v).isdigit() or "=" in str(v)):
            try:
                hdit.parse_chunk_sizes(int(v) if str(v).isdigit() else v, self.dit_config())
            except ValueError as e:
                raise OptionError("offload_chunk_size", str(e)) from None
        if self.image_to_video and self.condition_type == "latent_concat" and request.num_frames < 5:
            raise OptionError("num_frames", f"{request.num_frames}: the 33-channel image-to-video model drops the first "
                                            f"4 decoded frames; use at least 5")
        tc = float(request.options.get("true_cfg") or 1.0)
        if tc > 1.0 and request.negative_prompt is None:
            warnings.warn(f"true_cfg {tc:g} has no effect without a negative prompt: true classifier-free guidance "
                          f"runs only with --negative-prompt (as in HunyuanVideoPipeline); give one, even \"\", "
                          f"to use it", TrueCfgWarning, stacklevel=2)
        if self.preset is None and self._folder is None:
            return
        if self.folder is not None:
            missing = [w for w, globs in self._required_files() if not any(any(self.folder.glob(g)) for g in globs)]
            if missing:
                raise OptionError("checkpoint", f"{self.folder}: missing {'; '.join(missing)}")
        self._check_prompts(request)

    def _check_prompts(self, request) -> None:
        try:
            tok = self.load_tokenizers()[0]
        except (OSError, ValueError) as e:
            raise OptionError("checkpoint", f"{self.folder}: the tokenizer cannot be loaded ({e})") from None
        template, crop = self.template()
        neg = request.negative_prompt or ""
        for name, texts in (("prompt", request.prompts), ("negative_prompt", [neg])):
            for i, n in enumerate(htext.prompt_tokens(tok, texts, template, crop)):
                if n > htext.MAX_TEXT_TOKENS:
                    which = f" {i + 1}" if len(texts) > 1 else ""
                    raise OptionError(name, f"prompt{which} is {n} tokens long; the text encoder reads at most "
                                            f"{htext.MAX_TEXT_TOKENS}: shorten it")

    # ------------------------------------------------------------------ component loaders
    def load_tokenizers(self):
        """(Llama tokenizer, CLIP tokenizer)."""
        if self.preset:
            from vidax.text.tokenizer import ByteTokenizer

            return htext.PresetTokenizer(), ByteTokenizer()
        from vidax.text.tokenizer import load_tokenizer

        return load_tokenizer(self.folder / "tokenizer"), load_tokenizer(self.folder / "tokenizer_2")

    def load_text_encoders(self):
        """(the Llama tower -- for image-to-video the LLaVA tower --, CLIP-L text), float32."""
        from vidax.text import clip_text, lm

        if self.preset:
            from flax import nnx

            p = self.preset

            def seeded(module_cls, cfg, seed):  # host-drawn weights: no initializer compiles
                return nnx.to_pure_dict(hdit.seeded_state(lambda: module_cls(cfg, rngs=nnx.Rngs(0)), seed)[1])

            llm = lm.from_params(p.llm, seeded(lm.DecoderLM, p.llm, p.seed + 1))
            if self.image_to_video:
                from vidax.models.hunyuanvideo import llava

                llm = llava.init(p.vision, llm, seed=p.seed + 5, image_token_id=htext.PresetTokenizer().token_id("<image>"),
                                 pad_id=htext.PresetTokenizer.pad_id)
            return llm, clip_text.from_params(p.clip, seeded(clip_text.CLIPText, p.clip, p.seed + 4))
        # the 8B tower in float32 (32 GB) is split over every visible device (Megatron rules of
        # vidax.text.lm: heads, MLP and vocabulary where they divide); CLIP-L stays on one device
        mesh = self.text_mesh()
        if self.image_to_video:
            from vidax.models.hunyuanvideo import llava

            llm = llava.load_llava(self.folder / "text_encoder", mesh=mesh)
        else:
            llm = lm.load_lm(self.folder / "text_encoder", dtype=np.float32, mesh=mesh)
        return llm, clip_text.load_clip_text(self.folder / "text_encoder_2", dtype=np.float32)

    @property
    def scaled(self) -> bool:
        """A runner (not the one-device forward): a mesh, offloading or a step cache."""
        return self.mesh is not None or self.offload_chunk_size is not None or self.step_cache is not None

    def lora_targets(self) -> dict:
        from vidax.models.hunyuanvideo import lora as hlora

        return self.transformer_lora_targets(hlora.aliases(), "this HunyuanVideo DiT (transformer)")

    def load_dit(self):
        """DiT state + config: on one device, or (mesh / offloading) a :class:`~vidax.core.runner.DiTRunner`."""
        cfg = self.dit_config()
        if self.preset:
            state = hdit.init_state(cfg, seed=self.preset.seed + 2, dtype=self.dtype)
        else:
            with self.lora_merging("dit"), lazy_params(self.scaled and self.offload_chunk_size is None):
                state, cfg = hdit.load_dit(self.folder / "transformer", cfg, dtype=self.dtype)
        if not self.scaled:
            return jax.device_put(state), cfg
        return hdit.runner(state, cfg, self.mesh, self.parallelism, offload_chunk_size=self.offload_chunk_size,
                           prefetch=self.prefetch), cfg

    def load_vae(self):
        if self.preset:
            return hvae.init(self.preset.vae, seed=self.preset.seed + 3)
        return hvae.load_vae(self.folder / "vae", self.vae_config())

    def tiling(self, enabled: bool = True) -> hvae.Tiling:
        return hvae.Tiling(spatial=bool(enabled))

    # ------------------------------------------------------------------ conditioning
    def encode_prompts(self, prompts, encoders=None, tokenizers=None, pixel_values=None) -> dict:
        """``{"embeds" [B, L, D], "mask" [B, L], "pooled" [B, 768]}`` (float32 numpy). Image-to-video:
        ``pixel_values`` is the LLaVA-preprocessed image (:meth:`llava_pixels`)."""
        tok, tok2 = tokenizers or self.load_tokenizers()
        llm, clip = encoders or self.load_text_encoders()
        template, crop = self.template()
        if self.image_to_video:
            if pixel_values is None:
                raise ValueError("image-to-video prompts are encoded with the image: pass pixel_values")
            ct = self.condition_type
            emb, mask = htext.llava_embeds(
                tok, llm, pixel_values, prompts, image_token_id=llm.image_token_id, pad_id=llm.pad_id,
                end_header_id=self._token_id(tok, "<|end_header_id|>"), template=template, crop_start=crop,
                image_embed_interleave=2 if ct == "latent_concat" else 4 if ct == "token_replace" else 1,
                image_len=llm.image_tokens, image_start=htext.IMAGE_EMB_START,
                image_end=htext.IMAGE_EMB_START + llm.image_tokens)
        else:
            emb, mask = htext.llama_embeds(tok, llm, prompts, template, crop)
        return {"embeds": emb, "mask": mask, "pooled": htext.clip_pooled(tok2, clip, prompts)}

    @staticmethod
    def _token_id(tok, token: str) -> int:
        if hasattr(tok, "token_id"):
            return tok.token_id(token)
        i = tok.tok.token_to_id(token)
        if i is None:
            raise ValueError(f"the tokenizer has no {token!r} token")
        return int(i)

    def llava_pixels(self, image) -> np.ndarray:
        """The image as LLaVA's CLIP image processor prepares it, [1, 3, S, S]."""
        from vidax.text import clip as clipmod

        rgb = clipmod.to_rgb_uint8(image)
        pre = {}
        if self.preset:
            s = self.preset.vision.image_size
            pre = dict(size=s, crop_size=s)
        else:
            pp = self.folder / "image_processor" / "preprocessor_config.json"
            c = json.loads(pp.read_text()) if pp.exists() else {}
            size, crop = c.get("size", 336), c.get("crop_size", 336)
            size = size.get("shortest_edge", size.get("height")) if isinstance(size, dict) else size
            crop = crop.get("height") if isinstance(crop, dict) else crop
            pre = dict(size=int(size), crop_size=int(crop))
            if c.get("image_mean") is not None:
                pre["mean"], pre["std"] = tuple(c["image_mean"]), tuple(c["image_std"])
        return clipmod.preprocess(rgb, **pre)

    def encode_image(self, image, height: int, width: int, vae=None, tiling: bool = True) -> np.ndarray:
        """The image's latent, scaled as the DiT sees it: [1, C, 1, h, w] (posterior mode x scaling_factor)."""
        from vidax.text import clip as clipmod

        px = resize_for_vae(clipmod.to_rgb_uint8(image), height, width)[None, :, None]
        return self.encode_pixels(px, vae, tiling)

    def encode_pixels(self, video, vae=None, tiling: bool = True) -> np.ndarray:
        """Pixels [B, 3, F, H, W] in [-1, 1] -> latents as the DiT sees them (posterior mode x
        scaling_factor), [B, C, f, h, w]."""
        vae = vae or self.load_vae()
        z = hvae.encode(vae, np.asarray(video, np.float32), self.tiling(tiling))
        return (z * vae.cfg.scaling_factor).astype(np.float32)

    # ------------------------------------------------------------------ sampling
    def scheduler(self, steps: int, shift: float = 7.0):
        """Flow-matching Euler on the pipelines' sigmas ``linspace(1, 0, steps + 1)[:-1]`` with ``shift``."""
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        return make_scheduler("flow_euler", steps, sigmas=sigmas, shift=float(shift), num_train_timesteps=1000)

    def latent_shape(self, batch: int, height: int, width: int, num_frames: int):
        """Channels-last [B, F, h, w, C]."""
        g = self.geometry()
        return (batch, g.latent_frames(num_frames), height // g.spatial, width // g.spatial, self.latent_channels())

    def initial_noise(self, shape, seed: int):
        return jax.random.normal(jax.random.fold_in(jax.random.key(seed), 0x7FFFFFFF), shape, jnp.float32)

    def _model_input(self, ct):
        if ct == "latent_concat":
            def prep(x, aux):
                img = aux["image"]  # [1, 1, h, w, C]
                cond = jnp.zeros(x.shape, x.dtype).at[:, :1].set(jnp.broadcast_to(img, (x.shape[0],) + img.shape[1:]))
                m = jnp.zeros(x.shape[:-1] + (1,), x.dtype).at[:, :1].set(1.0)
                return jnp.concatenate([x, cond, m], axis=-1)
        elif ct == "token_replace":
            def prep(x, aux):
                img = aux["image"]
                return x.at[:, :1].set(jnp.broadcast_to(img, (x.shape[0],) + img.shape[1:]).astype(x.dtype))
        else:
            prep = None
        return prep

    @collect_own_garbage()  # frees what it loaded when it returns, without walking the caller's heap
    def sample_latents(self, cond: dict, uncond: dict | None = None, *, latents=None, seed: int = 0, height: int = 720,
                       width: int = 1280, num_frames: int = 129, steps: int = 50, guidance: float = 6.0,
                       true_cfg: float = 1.0, shift: float = 7.0, image_latents=None, dit=None, start: int = 0,
                       state=None, on_step: Callable[[StepInfo, object, object], None] | None = None) -> np.ndarray:
        """Denoise. ``cond`` / ``uncond``: :meth:`encode_prompts` dicts (``uncond`` is used when
        ``true_cfg`` > 1); ``latents``: the starting sample [B, C, F, h, w] (noise when ``start`` is
        0, the reference's ``latents`` argument; drawn from ``seed`` when omitted) -- for
        image-to-video the noise, before the 0.999/0.001 mix with the image latent, as the
        reference takes it. ``image_latents``: [1, C, 1, h, w] from :meth:`encode_image`. Resume
        at ``start`` with the latents and scheduler ``state`` saved after step ``start - 1``.
        Returns the final latents [B, C, F, h, w] (float32 numpy)."""
        ct = self.condition_type
        if self.image_to_video and image_latents is None:
            raise ValueError("this is an image-to-video model: pass image_latents=encode_image(...)")
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
        aux = None
        if image_latents is not None:
            img = jnp.asarray(np.asarray(image_latents, np.float32).transpose(0, 2, 3, 4, 1))  # [1, 1, h, w, C]
            if img.shape[2:] != x.shape[2:]:
                raise ValueError(f"image latent {img.shape} does not match the latents {x.shape}")
            aux = {"image": img}
            if start == 0:
                x = x * IMAGE_START_MIX + img * (1 - IMAGE_START_MIX)
        state = sched.init_state(x) if state is None else jax.tree.map(jnp.asarray, state)
        params, cfg = dit if dit is not None else self.load_dit()
        use_cfg = uncond is not None and true_cfg > 1.0
        if self.step_cache is not None:  # per CFG branch (diffusers' "cond" / "uncond" contexts)
            self.step_cache.begin(1, 2 if use_cfg else 1, start)
            params.use_cache(self.step_cache)
        dt = _dtype(params, params if isinstance(params, DiTRunner) else None)
        c = text_inputs(cond, cfg, dt, guidance)
        u = text_inputs(uncond, cfg, dt, guidance) if use_cfg else None
        prep = self._model_input(ct)
        step = _cached_step(params, cfg, sched, (steps, float(shift)), ct, prep, use_cfg)
        key = jax.random.key(seed)
        for i in range(start, n):
            import time

            t0 = time.perf_counter()
            x, state = step(x, state, jnp.int32(i), c, u, jnp.float32(true_cfg), aux, key)
            if on_step is not None:
                x.block_until_ready()
                on_step(StepInfo(i, n, float(sched.timesteps[i]), time.perf_counter() - t0), x, state)
        del params
        return np.asarray(x).transpose(0, 4, 1, 2, 3)

    # ------------------------------------------------------------------ decode
    def _tiles(self, latent_frames: int, tiling: bool):
        return hvae.temporal_tiles(latent_frames, self.tiling(tiling), self.vae_config().temporal_compression_ratio)

    def drop_frames(self) -> int:
        """Decoded frames the reference drops from the front (4 for latent_concat image-to-video)."""
        return self.vae_config().temporal_compression_ratio if self.condition_type == "latent_concat" else 0

    def decode_video(self, latents, vae=None, tiling: bool = True, drop: bool = True) -> np.ndarray:
        """Latents [B, C, F, h, w] (as sampled, scaled) -> video in [0, 1], [B, F, H, W, 3]
        (``drop``: without the frames the reference drops, :meth:`drop_frames`)."""
        vae = vae or self.load_vae()
        px = hvae.decode(vae, np.asarray(latents, np.float32) / vae.cfg.scaling_factor, self.tiling(tiling))
        return to_unit_range(px[:, :, self.drop_frames() if drop else 0:])

    def decode_frames(self, latents, first: int, stop: int, tail=None, vae=None, tiling: bool = True):
        """Temporal tiles ``first..stop-1`` -> ``(uint8 frames [B, T, H, W, 3], tail)``."""
        vae = vae or self.load_vae()
        z = np.asarray(latents, np.float32) / vae.cfg.scaling_factor
        tiles = self._tiles(z.shape[2], tiling)
        px, tail = hvae.decode_tiles(vae, z, first, stop, tail, self.tiling(tiling))
        drop = self.drop_frames()
        if drop:  # latent_concat: the reference drops the video's first frames; this span starts at frame `start`
            t = self.tiling(tiling)
            start = 0 if first == 0 or len(tiles) == 1 else (t.stride_t + 1) + (first - 1) * t.stride_t
            px = px[:, :, max(0, drop - start):]
        return to_uint8(to_unit_range(px)), tail

    def decode_plan(self, request) -> list[DecodeSpan]:
        tiles = self._tiles(self.geometry().latent_frames(request.num_frames), request.options.get("vae_tiling", True))
        k = min(len(tiles), getattr(request, "decode_stages", None) or 4)
        bounds = [round(i * len(tiles) / k) for i in range(k + 1)]
        return [DecodeSpan(f"decode/{i}", "video", (tiles[bounds[i]][0], tiles[bounds[i + 1] - 1][1]), None,
                           f"decode/{i - 1}" if i else None) for i in range(k)]

    def _span_tiles(self, request, span) -> tuple[int, int]:
        tiles = self._tiles(self.geometry().latent_frames(request.num_frames), request.options.get("vae_tiling", True))
        k = len(self.decode_plan(request))
        bounds = [round(i * len(tiles) / k) for i in range(k + 1)]
        i = int(span.name.split("/")[1])
        return bounds[i], bounds[i + 1]

    # ------------------------------------------------------------------ memory plan (``vidax plan``)
    def text_config(self):
        """(the Llama tower's LMConfig, CLIP-L text's CLIPTextConfig, LLaVA's CLIPVisionConfig or
        None for text-to-video), read without weights."""
        from vidax.text import clip as clipmod
        from vidax.text import clip_text, lm

        if self.preset:
            return self.preset.llm, self.preset.clip, self.preset.vision if self.image_to_video else None
        read = lambda rel: json.loads((self.config_folder / rel / "config.json").read_text())  # noqa: E731
        c = read("text_encoder")
        vision = clipmod.CLIPVisionConfig.from_hf(c["vision_config"]) if self.image_to_video else None
        return lm.LMConfig.from_hf(c), clip_text.CLIPTextConfig.from_hf(read("text_encoder_2")), vision

    def plan_units(self, request) -> list:
        """The Llama (I2V: LLaVA's vision tower, then its LM over the image-expanded tokens) and
        CLIP-L encodes in float32, the Llama tower split over every device as
        :meth:`load_text_encoders` does; one DiT call (embedded guidance: batch B, 2B with
        ``true_cfg``) on this pipeline's mesh, inputs as the step passes them; one VAE tile decode
        (the first temporal tile, 256-px spatial tiles with ``vae_tiling``)."""
        from vidax.core import nn
        from vidax.core import plan as vplan
        from vidax.text import clip as clipmod
        from vidax.text import clip_text, lm

        b = len(request.prompts)
        llm_cfg, clip_cfg, vis_cfg = self.text_config()
        _, crop = self.template()
        enc = lm.abstract(llm_cfg, np.float32)
        tp = 1 if self.preset else self.pool_devices(request, "encode")  # as load_text_encoders splits it
        enc = lm.shard(enc, f"tp={tp}") if tp > 1 else enc
        t = htext.MAX_TEXT_TOKENS + crop
        i32 = lambda *s: vplan.abstract(s, np.int32)  # noqa: E731
        if vis_cfg is None:
            units = [vplan.split_unit("encode", "Llama text encoder", enc, i32(b, t), i32(b, t), None, method="layer",
                                      index=htext.HIDDEN_INDEX, note=f"{b} prompt(s) x {t} tokens")]
            text_len = htext.MAX_TEXT_TOKENS
        else:
            n_img = vis_cfg.grid ** 2
            t += n_img - 1
            k = {"latent_concat": 2, "token_replace": 4}.get(self.condition_type, 1)
            text_len = -(-n_img // k) + htext.MAX_TEXT_TOKENS - 4
            px = vplan.abstract((1, 3, vis_cfg.image_size, vis_cfg.image_size), np.float32)
            units = [vplan.split_unit("encode", "LLaVA vision tower", clipmod.abstract(vis_cfg), px, method="penultimate"),
                     vplan.split_unit("encode", "LLaVA language model", enc,
                                      vplan.abstract((b, t, llm_cfg.hidden_size), np.float32), i32(b, t), i32(b, t),
                                      method="hidden_states_embeds", note=f"{b} prompt(s) x {t} tokens (image spliced)")]
        units.append(vplan.split_unit("encode", "CLIP-L text encoder", clip_text.abstract(clip_cfg), i32(b, htext.CLIP_TOKENS),
                                      None, None, output_hidden_states=False, note=f"{b} x {htext.CLIP_TOKENS} tokens"))
        cfg = self.dit_config()
        runner = hdit.runner(hdit.abstract_state(cfg, self.dtype), cfg, self.mesh, self.parallelism)
        nb = 2 * b if effective_true_cfg(request.options.get("true_cfg"), request.negative_prompt) > 1.0 else b
        shape = self.latent_shape(nb, request.height, request.width, request.num_frames)
        tokens = int(np.prod(hdit.grid_of(cfg, shape)))
        f32 = lambda *s: vplan.abstract(s, np.float32)  # noqa: E731
        args = (runner.step_params({"x": shape}), vplan.abstract((*shape[:-1], cfg.in_channels), self.dtype), f32(nb),
                vplan.abstract((nb, text_len, cfg.text_embed_dim), self.dtype), f32(nb, text_len),
                vplan.abstract((nb, cfg.pooled_projection_dim), self.dtype), f32(nb) if cfg.guidance_embeds else None)
        units.append(vplan.Unit("sample", "DiT step", jax.jit(runner.apply), args, weights=runner.params,
                                note=f"batch {nb} x {tokens:,} video + {text_len} text tokens"))
        vcfg = self.vae_config()
        vae = nn.Split(*nn.abstract_state(lambda: hvae._build(vcfg)), vcfg)
        tiling = bool(request.options.get("vae_tiling", True))
        a, e = self._tiles(shape[1], tiling)[0]
        h, w = shape[2], shape[3]
        til, s = self.tiling(tiling), vcfg.spatial_compression_ratio
        if til.spatial and (h > til.min_h // s or w > til.min_w // s):
            h, w = min(h, til.min_h // s), min(w, til.min_w // s)
        z = vplan.abstract((b, e - a, h, w, vcfg.latent_channels), np.float32)
        units.append(vplan.split_unit("decode", "VAE decode, one tile", vae, z, method="decode_tile",
                                      note=f"{b} x {e - a} latent frames of {h}x{w}"))
        return units

    # ------------------------------------------------------------------ the stage protocol
    def fingerprint(self, component: str) -> str:
        if self.preset is not None:
            return f"preset:{self.preset_name}:{component}:{self.dtype.name}"
        files = {"text": ["text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"],
                 "dit": ["transformer"], "vae": ["vae"], "image": ["vae", "image_processor"]}[component]
        if component == "text" and self.image_to_video:
            files = files + ["image_processor"]
        return f"{component}:{self.dtype.name}:" + files_fingerprint(self.folder, files)

    def _dt(self, request):
        return np.dtype(np.float32) if request.dtype == "float32" else np.dtype(jnp.bfloat16)

    def stage_params(self, kind, request, span=None):
        p = super().stage_params(kind, request, span)
        if "true_cfg" in p:  # the scale the run uses (ignored without a negative prompt)
            p["true_cfg"] = effective_true_cfg(p["true_cfg"], request.negative_prompt)
        return p

    def encode(self, request, image: np.ndarray | None = None) -> dict[str, Named]:
        """Prompt embeddings, mask and pooled CLIP vector (computed in float32, stored in the
        request's dtype; the mask as int32), the negative prompt's when ``true_cfg`` > 1, and for
        image-to-video the image's latent (``image_latents``)."""
        self._check_prompts(request)
        if self.image_to_video and image is None:
            raise OptionError("image", "this is an image-to-video model: give an image")
        toks, encs = self.load_tokenizers(), self.load_text_encoders()
        pix = self.llava_pixels(image) if self.image_to_video else None
        cond = self.encode_prompts(request.prompts, encs, toks, pix)
        dt = self._dt(request)
        attrs = dict(model=request.model, computed_in="float32", stored_as=str(dt))
        out = {}

        def put(prefix, c):
            out[f"{prefix}_embeds"] = Named(c["embeds"].astype(dt), _EMB_DIMS, attrs)
            out[f"{prefix}_mask"] = Named(c["mask"].astype(np.int32), ("batch", "token"), {"role": "text mask"})
            out[f"{prefix}_pooled"] = Named(c["pooled"].astype(dt), ("batch", "channel"), attrs)

        put("prompt", cond)
        if effective_true_cfg(request.options.get("true_cfg"), request.negative_prompt) > 1.0:
            neg = request.negative_prompt
            npix = None
            if self.image_to_video:  # the reference pairs the negative prompt with a black image
                npix = self.llava_pixels(np.zeros((request.height, request.width, 3), np.uint8))
            put("negative", self.encode_prompts([neg] * len(request.prompts), encs, toks, npix))
        del encs
        if image is not None and self.image_to_video:
            lat = self.encode_image(image, request.height, request.width,
                                    tiling=bool(request.options.get("vae_tiling", True)))
            out["image_latents"] = Named(lat, _LATENT_DIMS, {"role": "image latent (scaled)"})
        return out

    def sample(self, conditioning: dict, request, *, resume: dict | None = None, on_step=None) -> dict[str, Named]:
        o = request.options
        cond = {k: conditioning[f"prompt_{k}"] for k in ("embeds", "mask", "pooled")}
        true_cfg = effective_true_cfg(o.get("true_cfg"), request.negative_prompt)
        uncond = None
        if true_cfg > 1.0:
            uncond = {k: conditioning[f"negative_{k}"] for k in ("embeds", "mask", "pooled")}
        start, latents, state = 0, None, None
        sched = self.scheduler(request.steps, o.get("shift") or 7.0)
        if resume is not None:
            start = int(resume["step"])
            shape = self.latent_shape(cond["embeds"].shape[0], request.height, request.width, request.num_frames)
            latents, state = unpack_state(resume["arrays"], sched.init_state(jnp.zeros(shape, jnp.float32)))

        def step_cb(info, x, st):
            on_step(info, lambda: pack_state(np.asarray(x).transpose(0, 4, 1, 2, 3), st))

        lat = self.sample_latents(cond, uncond, latents=latents, seed=request.seed, height=request.height,
                                  width=request.width, num_frames=request.num_frames, steps=request.steps,
                                  guidance=request.guidance, true_cfg=true_cfg, shift=o.get("shift") or 7.0,
                                  image_latents=conditioning.get("image_latents"), start=start, state=state,
                                  on_step=None if on_step is None else step_cb)
        return {"latents": Named(lat, _LATENT_DIMS, {"model": request.model, "layout": "reference [B, C, F, H, W]",
                                                     "scaled": True})}

    def decode(self, latents: dict, span: DecodeSpan, carry: dict | None, request):
        a, b = self._span_tiles(request, span)
        tail = None if carry is None else carry["tail"]
        frames, tail = self.decode_frames(latents["latents"], a, b, tail, tiling=bool(request.options.get("vae_tiling", True)))
        return ({"frames": Named(frames, ("batch", "frame", "height", "width", "rgb"),
                                 {"latent_frames": list(span.frames), "temporal_tiles": [a, b], "units": "uint8 RGB"})},
                None if tail is None else {"tail": np.asarray(tail, np.float32)})

    def describe(self) -> dict:
        return {"mesh": self.mesh, "offload_chunk_size": self.offload_chunk_size}

    # ------------------------------------------------------------------ probe hooks (``vidax probe``)
    def vae_encode(self, video: np.ndarray) -> np.ndarray:
        return self.encode_pixels(video)

    def vae_decode(self, latents: np.ndarray) -> np.ndarray:
        """The whole clip, decoded as :meth:`decode` does (tiled VAE); latent_concat's dropped leading
        frames are kept so the reconstruction lines up with the probe's input frame for frame."""
        return self.decode_video(latents, drop=False)

    def denoise_once(self, latents, sigmas, conditioning, request=None) -> np.ndarray:
        """The clean estimate ``x - sigma * v`` per row: one DiT call at timestep ``sigma * 1000``
        (the Euler scheduler's units) with the first prompt's LLM embeddings, mask and pooled CLIP
        vector and, for guidance-distilled models, the embedded guidance ``request.guidance * 1000``
        as in sampling (no true CFG). Image-to-video: the image latent enters as in sampling
        (latent_concat: channel-concatenated with the frame-0 mask; token_replace: frame 0 of the
        input replaced, and of the estimate too, as every step does)."""
        params, cfg = self.load_dit()
        runner = params if isinstance(params, DiTRunner) else None
        cond = {k: np.asarray(conditioning[f"prompt_{k}"])[:1] for k in ("embeds", "mask", "pooled")}
        cc = text_inputs(cond, cfg, _dtype(params, runner), 6.0 if request is None else request.guidance)
        img = conditioning.get("image_latents")
        aux = None if img is None else {"image": jnp.asarray(np.asarray(img, np.float32).transpose(0, 2, 3, 4, 1))}
        prep = self._model_input(self.condition_type) if aux is not None else None
        x = np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1)
        out = []
        for i, s in enumerate(np.asarray(sigmas, np.float32)):
            xi = jnp.asarray(x[i:i + 1])
            xin = xi if prep is None else prep(xi, aux)
            v = _dit_once(params, cfg, xin.astype(_dtype(params, runner)), jnp.full((1,), s * 1000.0, jnp.float32), cc)
            x0 = xi - s * jnp.asarray(v, jnp.float32)
            if aux is not None and self.condition_type == "token_replace":
                x0 = x0.at[:, :1].set(aux["image"])
            out.append(np.asarray(x0))
        del params
        return np.concatenate(out).transpose(0, 4, 1, 2, 3)

    # ------------------------------------------------------------------ one call
    def generate(self, prompt, negative_prompt=None, *, image=None, seed: int = 0, height: int = 720, width: int = 1280,
                 num_frames: int = 129, steps: int = 50, guidance: float = 6.0, true_cfg: float = 1.0,
                 shift: float = 7.0, vae_tiling: bool = True, on_step=None) -> np.ndarray:
        """Prompt(s) (+ image) -> uint8 frames [B, F, H, W, 3]."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        self.geometry().check(height, width, num_frames)
        toks, encs = self.load_tokenizers(), self.load_text_encoders()
        pix = self.llava_pixels(image) if self.image_to_video else None
        cond = self.encode_prompts(prompts, encs, toks, pix)
        uncond = None
        if true_cfg > 1.0 and negative_prompt is None:
            warnings.warn(f"true_cfg {true_cfg:g} has no effect without a negative prompt (as in "
                          f"HunyuanVideoPipeline)", TrueCfgWarning, stacklevel=2)
        true_cfg = effective_true_cfg(true_cfg, negative_prompt)
        if true_cfg > 1.0:
            neg = negative_prompt
            npix = self.llava_pixels(np.zeros((height, width, 3), np.uint8)) if self.image_to_video else None
            uncond = self.encode_prompts([neg] * len(prompts), encs, toks, npix)
        del encs
        vae = self.load_vae()
        img = self.encode_image(image, height, width, vae, vae_tiling) if self.image_to_video else None
        lat = self.sample_latents(cond, uncond, seed=seed, height=height, width=width, num_frames=num_frames, steps=steps,
                                  guidance=guidance, true_cfg=true_cfg, shift=shift, image_latents=img, on_step=on_step)
        return to_uint8(self.decode_video(lat, vae, vae_tiling))


class HunyuanVideoI2V(HunyuanVideoT2V):
    """HunyuanVideo image-to-video (``HunyuanVideoImageToVideoPipeline`` folders, ``tiny-i2v`` /
    ``tiny-i2v-33ch``): ``token_replace`` (HunyuanVideo-I2V) or ``latent_concat`` (-33ch)."""

    def __init__(self, source: str | Path = "tiny-i2v", **kw):
        super().__init__(source, **kw)
        if not self.image_to_video:
            raise ValueError(f"{source}: not an image-to-video model ({self.pipeline_class}); use HunyuanVideoT2V")

    def _required_files(self):
        return super()._required_files() + [("the image processor (image_processor/)",
                                             ["image_processor/preprocessor_config.json"])]


# ----------------------------------------------------------------------------------- the step
_STEPS: dict = {}  # (cfg, schedule, condition type, true CFG) -> step, for one-device DiTs


def _cached_step(params, cfg, sched, schedule, ct, prep, use_cfg):
    """The step program for these settings, built once per process (one-device DiT) or per runner:
    a batch of runs with equal settings compiles it once."""
    runner = params if isinstance(params, DiTRunner) else None
    cache = _STEPS if runner is None else runner.__dict__.setdefault("_hv_steps", {})
    key = (cfg, schedule, ct, use_cfg, runner is not None and runner.cache is not None)
    if key not in cache:
        while len(cache) >= 8:  # a long-lived worker keeps the last few settings' programs
            cache.pop(next(iter(cache)))
        cache[key] = _make_step(params if runner is not None else None, cfg, sched, prep, use_cfg, ct == "token_replace")
    fn = cache[key]
    if runner is not None:
        return fn
    # one device: the state and the RoPE tables of the latents' grid are the step's arguments
    return lambda x, *a: fn((params, hdit.rope_tables(cfg, hdit.grid_of(cfg, x.shape))), x, *a)


def _make_step(params, cfg: hdit.HunyuanVideoConfig, sched, prep, use_cfg: bool, replace_first: bool):
    """One sampling step ``(x, state, i, cond, uncond, true_cfg, aux, key) -> (x, state)``: jitted
    whole (model + guidance + Euler update) for a resident DiT, or a jitted input / update around
    the runner's own programs for a streaming (offloading) one. ``x`` channels-last float32."""
    timesteps = jnp.asarray(np.asarray(sched.timesteps, np.float32))
    runner = params if isinstance(params, DiTRunner) else None

    def model_in(x, aux):
        xin = x if prep is None else prep(x, aux)
        return xin

    def combine(v, b, true_cfg):
        if use_cfg:
            vc, vu = v[:b].astype(jnp.float32), v[b:].astype(jnp.float32)
            return vu + true_cfg * (vc - vu)
        return v.astype(jnp.float32)

    def batch(c, u):
        return c if not use_cfg else jax.tree.map(lambda a, b_: jnp.concatenate([a, b_], axis=0), c, u)

    def update(x, state, v, i, aux):
        x, state = sched.step(state, v, i, x)
        if replace_first:
            img = aux["image"]
            x = x.at[:, :1].set(jnp.broadcast_to(img, (x.shape[0],) + img.shape[1:]))
        return x, state

    if runner is None or (runner.offload is None and runner.cache is None):
        if runner is None:  # p: (the DiT state, the grid's RoPE tables)
            model = lambda p, xin, t, cc: hdit.forward(p[0], cfg, xin, t, cc["ctx"], cc["mask"], cc["pooled"],  # noqa: E731
                                                      cc.get("guidance"), rope=p[1])
        else:  # p: the runner's weights and RoPE tables (step_params)
            model = lambda p, xin, t, cc: runner.apply(p, xin, t, cc["ctx"], cc["mask"], cc["pooled"],  # noqa: E731
                                                      cc.get("guidance"))

        @jax.jit
        def step(p, x, state, i, cond, uncond, true_cfg, aux):
            b = x.shape[0]
            xin = model_in(x, aux).astype(jnp.dtype(_dtype(p if runner is not None else p[0], runner)))
            k = 2 if use_cfg else 1
            t = jnp.full((k * b,), timesteps[i], jnp.float32)
            xx = jnp.concatenate([xin] * k, axis=0)
            v = combine(model(p, xx, t, batch(cond, uncond)), b, true_cfg)
            return update(x, state, v, i, aux)

        if runner is None:  # params stay an argument (the caller binds them per run)
            return lambda p, x, state, i, cond, uncond, true_cfg, aux, key: step(p, x, state, i, cond, uncond, true_cfg, aux)
        return lambda x, state, i, cond, uncond, true_cfg, aux, key: step(runner.step_params({"x": x.shape}), x, state, i, cond,
                                                                          uncond, true_cfg, aux)

    prep_j = jax.jit(lambda x, aux: model_in(x, aux).astype(runner.dtype))
    upd = jax.jit(lambda x, state, v, i, true_cfg, aux: update(x, state, combine(v, x.shape[0], true_cfg), i, aux))

    def streamed(x, state, i, cond, uncond, true_cfg, aux, key):
        b = x.shape[0]
        xin = prep_j(x, aux)
        k = 2 if use_cfg else 1
        cc = batch(cond, uncond)
        t = jnp.full((k * b,), float(timesteps[int(i)]), jnp.float32)
        v = runner(jnp.concatenate([xin] * k, axis=0), t, cc["ctx"], cc["mask"], cc["pooled"], cc.get("guidance"))
        return upd(x, state, v, i, true_cfg, aux)

    return streamed


def _dtype(p, runner):
    return runner.dtype if runner is not None else hdit.state_dtype(p)


def text_inputs(c: dict, cfg: hdit.HunyuanVideoConfig, dt, guidance: float) -> dict:
    """The DiT's text inputs from an :meth:`~HunyuanVideoT2V.encode_prompts` dict: embeddings and
    pooled CLIP vector in the DiT's dtype, the mask in float32 and (guidance-distilled models) the
    embedded guidance ``guidance * 1000`` per sample."""
    out = {"ctx": jnp.asarray(c["embeds"], dt), "mask": jnp.asarray(c["mask"], jnp.float32),
           "pooled": jnp.asarray(c["pooled"], dt)}
    if cfg.guidance_embeds:
        out["guidance"] = jnp.full((out["ctx"].shape[0],), float(guidance) * 1000.0, jnp.float32)
    return out


_forward = jax.jit(hdit.forward, static_argnums=1)


def _dit_once(params, cfg, x, t, cc):
    """One DiT evaluation (a state on one device or a runner) -> velocity."""
    args = (x, t, cc["ctx"], cc["mask"], cc["pooled"], cc.get("guidance"))
    return params(*args) if isinstance(params, DiTRunner) else _forward(params, cfg, *args)
