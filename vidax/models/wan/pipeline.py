"""Wan text/image-to-video pipelines on the vidax protocol (``WanT2V``, ``WanI2V``): sources,
encode, sampling (one or two experts) and the decode plan; the design notes are in this family's README.md."""
from __future__ import annotations

import functools
import gc
import html
import json
import logging
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.runtime import collect_own_garbage
from vidax.core import runner as vrunner
from vidax.core.runner import DiTRunner
from vidax.models.wan import magcache as wmag
from vidax.core.sampling import StepInfo, denoise, expert_segments
from vidax.models.wan import dit as wdit
from vidax.models.wan import tiles as wtiles
from vidax.models.wan import vae as wvae
from vidax.pipeline import (DecodeSpan, Geometry, Named, Option, Pipeline, pack_state, to_uint8, to_unit_range,
                            unpack_state)
from vidax.schedulers import SCHEDULERS, load_scheduler
from vidax.text import t5 as t5mod
from vidax.text.tokenizer import ByteTokenizer, load_tokenizer
from vidax.weights.fingerprint import files_fingerprint
from vidax.weights.keymap import lazy_params

log = logging.getLogger(__name__)

# what the constructor, geometry() and the configs read: fetched alone for a remote checkpoint
_CONFIG_FILES = ("model_index.json", "config.json", "*/config.json")
#: the text encoder of every Wan release (google/umt5-xxl's encoder)
UMT5_XXL = dict(model_type="umt5", d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=256384,
                feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128)


@dataclass(frozen=True)
class TinyPreset:
    """A complete, seeded random-weight Wan2.1-shaped model that runs on a laptop CPU."""

    text: t5mod.T5Config = field(default_factory=lambda: t5mod.T5Config(
        vocab_size=384, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu", per_layer_rel_bias=True))
    dit: wdit.WanDiTConfig = wdit.PRESETS["tiny"]
    # Wan2.1-shaped VAE (16 latent channels, 8x spatial / 4x temporal) at a small width
    vae: wvae.WanVAEConfig = field(default_factory=lambda: wvae.WanVAEConfig(base_dim=16, z_dim=16, num_res_blocks=1))
    max_text_len: int = 256
    seed: int = 0
    clip: object = None  # a vidax.text.clip.CLIPVisionConfig (Wan2.1 I2V's image encoder)
    index: tuple = ()  # model_index.json-like ((key, value), ...): the recipe


def _tiny_presets() -> dict:
    from dataclasses import replace

    from vidax.text.clip import CLIPVisionConfig

    base = TinyPreset()
    i2v_dit = replace(base.dit, in_channels=36, out_channels=16)
    clip = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_layers=3,
                            num_heads=4, hidden_act="gelu")
    wan22_vae = wvae.WanVAEConfig(base_dim=8, decoder_base_dim=16, z_dim=8, dim_mult=(1, 2, 4, 4), num_res_blocks=1,
                                  temperal_downsample=(False, True, True), is_residual=True, patch_size=2,
                                  in_channels=12, out_channels=12, scale_factor_spatial=16,
                                  latents_mean=(0.0,) * 8, latents_std=(1.0,) * 8)
    ti2v_dit = replace(base.dit, in_channels=8, out_channels=8)
    two = (("boundary_ratio", 0.9), ("transformer_2", ("diffusers", "WanTransformer3DModel")))
    i2v = ("_class_name", "WanImageToVideoPipeline")
    return {
        "tiny": base,
        # Wan2.1 I2V: CLIP image tokens + [mask, first-frame latent] concatenated on channels
        "tiny-i2v": replace(base, dit=replace(i2v_dit, image_dim=clip.hidden_size, added_kv_proj_dim=i2v_dit.dim),
                            clip=clip, index=(i2v, ("image_encoder", ("transformers", "CLIPVisionModel")))),
        # Wan2.2 A14B: two experts split at boundary_ratio (text- and image-to-video)
        "tiny-a14b": replace(base, index=(("_class_name", "WanPipeline"),) + two),
        "tiny-a14b-i2v": replace(base, dit=i2v_dit, index=(i2v,) + two),
        # Wan2.2 TI2V-5B: Wan2.2 VAE, expand_timesteps (text- and image-to-video)
        "tiny-ti2v": replace(base, dit=ti2v_dit, vae=wan22_vae,
                             index=(("_class_name", "WanPipeline"), ("expand_timesteps", True))),
        "tiny-ti2v-i2v": replace(base, dit=ti2v_dit, vae=wan22_vae, index=(i2v, ("expand_timesteps", True))),
    }


PRESET_SOURCES = _tiny_presets()


def prompt_clean(text: str) -> str:
    """The reference pipeline's prompt clean-up: ftfy (if installed), HTML unescape, whitespace."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


_EMB_DIMS = ("batch", "token", "channel")
_LATENT_DIMS = ("batch", "channel", "frame", "height", "width")


class WanT2V(wtiles.TileStages, Pipeline):
    """Wan text-to-video (and, from an image-to-video source, image-to-video). ``source``: a
    preset name or a checkpoint folder. Implements the :class:`vidax.pipeline.Pipeline` protocol
    (``encode`` / ``sample`` / ``decode``) over the library methods (``encode_prompts``,
    ``encode_image``, ``sample_latents``, ``decode_frames``)."""

    FAMILY = "wan"
    STEP_CACHE = True
    MAG_RATIOS = wmag.MAG_RATIOS  # published MagCache calibrations (vidax/models/wan/magcache.py)
    TEA_COEFFS = wmag.TEA_COEFFS  # published TeaCache polynomials (same file)
    OPTIONS = (
        Option("shift", float, 5.0, "flow-matching timestep shift", minimum=0.0, maximum=100.0),
        Option("scheduler", str, "unipc", "sampler", choices=SCHEDULERS),
        Option("guidance_2", float, None, "the low-noise expert's guidance (two-expert models; default: --guidance)",
               minimum=0.0, maximum=100.0),
        wtiles.tiling_option(),
    )
    COMPONENTS = {"encode": ("text",), "image": ("image",), "sample": ("dit",), "decode": ("vae",)}

    def __init__(self, source: str | Path = "tiny", *, dtype=np.float32, mesh=None, parallelism: str | None = None,
                 offload_chunk_size=None, prefetch: bool = True):
        """``mesh``: None (one device), a spec like ``"dp=2,tp=2,sp=2"`` or a Mesh; ``parallelism``:
        "tp" | "sp" | "tp+sp" (default: what the mesh implies); ``offload_chunk_size``: stream the
        DiT blocks from host memory in chunks of this many blocks ("all": one chunk)."""
        self.dtype = np.dtype(dtype)
        self.mesh, self.parallelism = mesh, parallelism
        self.offload_chunk_size, self.prefetch = offload_chunk_size, prefetch
        # the configs alone decide the recipe and geometry (diffusers or the original release layout);
        # a remote checkpoint's weights are fetched (once, into the cache) when a phase first needs them
        index = self.open_source(source, PRESET_SOURCES, _CONFIG_FILES)
        if self.preset is not None:
            self.layout, index = "preset", dict(getattr(self.preset, "index", None) or {})
        else:
            self.layout = "diffusers" if (self.config_folder / "model_index.json").exists() else "original"
        self.max_text_len = self.preset.max_text_len if self.preset else 512

        def present(name):
            v = index.get(name)
            return isinstance(v, (list, tuple)) and len(v) == 2 and v[0] is not None and v[1] is not None

        self.pipeline_class = index.get("_class_name", "WanPipeline")
        #: image-to-video (``WanImageToVideoPipeline``): :meth:`encode_image` conditions the run
        self.image_to_video = self.pipeline_class == "WanImageToVideoPipeline"
        #: Wan2.2 TI2V: latent substitution of the known first frame + per-token timesteps
        self.expand_timesteps = bool(index.get("expand_timesteps") or False)
        #: Wan2.2 A14B: expert 1 (``transformer``) for t >= boundary_ratio * T, expert 2 below
        self.boundary_ratio = index.get("boundary_ratio")
        self.has_transformer_2 = present("transformer_2")
        self.has_image_encoder = present("image_encoder")
        if self.boundary_ratio is not None and not self.has_transformer_2:
            raise ValueError(f"{source}: boundary_ratio is set but there is no transformer_2")

    def _required_files(self) -> list[tuple[str, list[str]]]:
        """(what, [globs]) every run of this checkpoint reads."""
        if self.layout == "diffusers":
            req = [("the text encoder (text_encoder/*.safetensors)", ["text_encoder/*.safetensors"]),
                   ("the tokenizer (tokenizer/)", ["tokenizer/tokenizer.json", "tokenizer/spiece.model"]),
                   ("the DiT (transformer/*.safetensors)", ["transformer/*.safetensors"]),
                   ("the VAE (vae/*.safetensors)", ["vae/*.safetensors"]),
                   ("the scheduler config (scheduler/scheduler_config.json)", ["scheduler/scheduler_config.json"])]
            if self.has_transformer_2:
                req.append(("the low-noise expert (transformer_2/*.safetensors)", ["transformer_2/*.safetensors"]))
            if self.image_to_video and self.has_image_encoder:
                req.append(("the image encoder (image_encoder/*.safetensors)", ["image_encoder/*.safetensors"]))
            return req
        return [("the DiT (diffusion_pytorch_model*.safetensors)", ["diffusion_pytorch_model*.safetensors"]),
                ("the text encoder (models_t5_*.pth)", ["models_t5_*.pth"]),
                ("the tokenizer (google/umt5-xxl/)", ["google/umt5-xxl/tokenizer.json", "google/umt5-xxl/spiece.model",
                                                      "tokenizer/tokenizer.json", "tokenizer/spiece.model"]),
                ("the VAE (Wan2.1_VAE.pth)", ["Wan2.*_VAE.pth"])]

    # ------------------------------------------------------------------ component loaders
    def load_tokenizer(self):
        if self.preset:
            return ByteTokenizer()
        if self.layout == "diffusers":
            return load_tokenizer(self.folder / "tokenizer")
        for cand in (self.folder / "google" / "umt5-xxl", self.folder / "tokenizer", self.folder):
            if cand.is_dir() and any((cand / f).exists() for f in ("tokenizer.json", "spiece.model")):
                return load_tokenizer(cand)
        raise FileNotFoundError(f"{self.folder}: no tokenizer (expected google/umt5-xxl/ or tokenizer/)")

    def load_text_encoder(self) -> t5mod.T5Encoder:
        if self.preset:
            cfg = self.preset.text
            return t5mod.init(cfg, seed=self.preset.seed + 1)
        # UMT5-XXL in float32 (21 GiB) is split over every device of the encode slice (tp)
        if self.layout == "diffusers":
            return t5mod.load_t5(self.folder / "text_encoder", dtype=np.float32, mesh=self.text_mesh())
        pth = sorted(self.folder.glob("models_t5_*.pth"))
        if not pth:
            raise FileNotFoundError(f"{self.folder}: no models_t5_*.pth text encoder")
        return t5mod.load_t5(pth[0], dtype=np.float32, mesh=self.text_mesh())

    def _dit_folder(self, expert: int) -> str:
        if expert not in (1, 2) or (expert == 2 and not self.has_transformer_2):
            raise ValueError(f"no DiT expert {expert} in this model")
        return "transformer" if expert == 1 else "transformer_2"

    def dit_config(self, expert: int = 1) -> wdit.WanDiTConfig:
        self._dit_folder(expert)
        if self.preset:
            return self.preset.dit
        if self.layout == "diffusers":
            path = self.config_folder / self._dit_folder(expert) / "config.json"
            return wdit.WanDiTConfig.from_diffusers(json.loads(path.read_text()))
        return original_dit_config(json.loads((self.config_folder / "config.json").read_text()))

    @property
    def scaled(self) -> bool:
        """A runner (not the one-device forward): a mesh, offloading or a step cache."""
        return self.mesh is not None or self.offload_chunk_size is not None or self.step_cache is not None

    def load_dit(self, expert: int = 1):
        """DiT state (``nnx.State``) + config: on one device, or (``mesh`` / ``offload_chunk_size``
        set) a :class:`~vidax.core.runner.DiTRunner` that places or streams it itself.
        ``expert``: 2 loads ``transformer_2`` (Wan2.2 A14B's low-noise expert)."""
        with lazy_params(self.scaled and self.offload_chunk_size is None):  # placed: a host reads its shards only
            params, cfg = self._load_dit_host(expert)
        if not self.scaled:
            return jax.device_put(params), cfg
        runner = wdit.runner(params, cfg, self.mesh, self.parallelism,
                             offload_chunk_size=self.offload_chunk_size, prefetch=self.prefetch)
        return runner, cfg

    def _load_dit_host(self, expert: int = 1):
        cfg = self.dit_config(expert)
        if self.preset:
            params = wdit.init_state(cfg, seed=self.preset.seed + 2 + 10 * (expert - 1), dtype=self.dtype)
            return params, cfg
        with self.lora_merging(self._lora_name(expert)):  # LoRAs merged in float32 before the cast
            if self.layout == "diffusers":
                params, cfg = wdit.load_dit(self.folder / self._dit_folder(expert), cfg, dtype=self.dtype)
            else:
                params, cfg = wdit.load_dit(self.folder, cfg, dtype=self.dtype)
        return params, cfg

    def _lora_name(self, expert: int) -> str:
        return ("high" if expert == 1 else "low") if self.has_transformer_2 else "dit"

    def lora_targets(self) -> dict:
        """``dit`` (one DiT), or ``high`` / ``low`` (Wan2.2 A14B's experts, ``transformer`` /
        ``transformer_2``); none for a preset (random weights)."""
        from vidax.models.wan import lora as wlora

        if self.preset is not None:
            return {}
        experts = (1, 2) if self.has_transformer_2 else (1,)
        out = {}
        for e in experts:
            path = self.folder / self._dit_folder(e) if self.layout == "diffusers" else self.folder
            what = f"this Wan DiT ({self._dit_folder(e)})" if self.layout == "diffusers" else "this Wan DiT"
            out[self._lora_name(e)] = wlora.target(self._lora_name(e), path, self.dit_config(e), what)
        return out

    def load_vae(self):
        if self.preset:
            cfg = self.preset.vae
            return jax.device_put(wvae.init_params(cfg, seed=self.preset.seed + 3)), cfg
        if self.layout == "diffusers":
            params, cfg = wvae.load_vae(self.folder / "vae")
        else:
            params, cfg = wvae.load_vae(self.folder / "Wan2.1_VAE.pth")
        return jax.device_put(params), cfg

    def vae_config(self) -> wvae.WanVAEConfig:
        """The VAE's config without loading its weights (latent channels and scale factors)."""
        if self.preset:
            return self.preset.vae
        if self.layout == "diffusers":
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return wvae.WanVAEConfig.from_diffusers(json.loads((self.config_folder / "vae" / "config.json").read_text()))
        return wvae.WanVAEConfig()

    def scale_factors(self) -> tuple[int, int]:
        """(spatial, temporal) pixel -> latent factors, as the reference pipelines read them."""
        v = self.vae_config()
        return (v.scale_factor_spatial or v.spatial_ratio), (v.scale_factor_temporal or v.temporal_ratio)

    def geometry(self) -> Geometry:
        dc = self.dit_config()
        sf, tf = self.scale_factors()
        return Geometry(spatial=sf, temporal=tf, latent_channels=dc.out_channels, patch=tuple(dc.patch_size),
                        num_heads=dc.num_heads, max_grid=dc.rope_max_seq_len)

    def check(self, request) -> None:
        """A checkpoint folder with every component the run loads; prompts within the text
        encoder's length (the reference cuts them silently)."""
        from vidax.pipeline import OptionError

        if self.preset is None and self._folder is None:
            return  # a remote checkpoint not fetched yet: its configs were read; encode checks prompts
        if self.folder is not None:
            missing = [what for what, globs in self._required_files() if not any(any(self.folder.glob(g)) for g in globs)]
            if missing:
                raise OptionError("checkpoint", f"{self.folder}: missing {'; '.join(missing)} "
                                                f"({self.layout} layout)")
        self._check_prompts(request)

    def weight_loaders(self, request) -> list:
        out = [("text encoder", self.load_text_encoder)]
        if getattr(request, "image", None) is not None and self.uses_clip:
            out.append(("image encoder", self.load_image_encoder))
        out.append(("DiT", lambda: self._load_dit_host(1)))
        if self.has_transformer_2:
            out.append(("low-noise DiT expert", lambda: self._load_dit_host(2)))
        out.append(("VAE", self.load_vae))
        return out

    def _check_prompts(self, request) -> None:
        from vidax.pipeline import OptionError

        try:
            tok = self.load_tokenizer()
        except (OSError, ValueError) as e:
            raise OptionError("checkpoint", f"{self.folder}: the tokenizer cannot be loaded ({e})") from None
        neg = request.negative_prompt or ""
        for name, texts in (("prompt", request.prompts), ("negative_prompt", [neg])):
            for i, n in enumerate(tok.count([prompt_clean(t) for t in texts])):
                if n > self.max_text_len:
                    which = f" {i + 1}" if len(texts) > 1 else ""
                    raise OptionError(name, f"prompt{which} is {n} tokens long; the text encoder reads at most "
                                            f"{self.max_text_len}: shorten it")

    @property
    def uses_clip(self) -> bool:
        """Whether the DiT has an image branch (Wan2.1 I2V): then :meth:`encode_image` runs CLIP."""
        return self.dit_config().image_dim is not None

    def load_image_encoder(self):
        """CLIP vision tower (``image_encoder/``) + its preprocessing settings."""
        from vidax.text import clip as clipmod

        if self.preset:
            cfg = self.preset.clip
            enc = clipmod.init(cfg, seed=self.preset.seed + 4)
            return enc, dict(size=cfg.image_size, crop_size=cfg.image_size)
        if self.layout != "diffusers":
            cands = sorted(self.folder.glob("models_clip_*.pth"))
            if not cands:
                raise FileNotFoundError(f"{self.folder}: no models_clip_*.pth image encoder")
            return clipmod.load_clip(cands[0]), {}
        if not self.has_image_encoder:
            raise FileNotFoundError(f"{self.folder}: the pipeline has no image_encoder")
        enc = clipmod.load_clip(self.folder / "image_encoder")
        pre = {}
        pp = self.folder / "image_processor" / "preprocessor_config.json"
        if pp.exists():
            c = json.loads(pp.read_text())
            size, crop = c.get("size"), c.get("crop_size")
            if isinstance(size, dict):
                size = size.get("shortest_edge", size.get("height"))
            if isinstance(crop, dict):
                crop = crop.get("height")
            if size is not None:
                pre["size"] = int(size)
            if crop is not None:
                pre["crop_size"] = int(crop)
            if c.get("image_mean") is not None:
                pre["mean"] = tuple(c["image_mean"])
            if c.get("image_std") is not None:
                pre["std"] = tuple(c["image_std"])
        return enc, pre

    def scheduler(self, steps: int, name: str | None = None, shift: float | None = None):
        """``name`` None: the checkpoint's own scheduler config (diffusers folders), else UniPC."""
        folder = self.folder / "scheduler" if name is None and self.layout == "diffusers" else None
        return load_scheduler(steps, name, folder=folder, shift=shift, default_shift=5.0)

    # ------------------------------------------------------------------ phases
    def encode_prompts(self, prompts: list[str], tokenizer=None, encoder=None) -> np.ndarray:
        """Prompt embeddings [B, max_text_len, D] in float32; positions past each prompt's tokens are
        zero, as the reference pipeline leaves them."""
        tok = tokenizer or self.load_tokenizer()
        enc = encoder or self.load_text_encoder()
        ids, mask = tok([prompt_clean(p) for p in prompts], self.max_text_len)
        h = np.asarray(enc(jnp.asarray(ids), jnp.asarray(mask)))
        return (h * (np.asarray(mask)[..., None] > 0)).astype(np.float32)

    def latent_shape(self, batch: int, height: int, width: int, num_frames: int, cfg: wdit.WanDiTConfig | None = None,
                     vae_cfg=None):
        cfg = cfg or self.dit_config()
        if vae_cfg is not None:
            sf = vae_cfg.scale_factor_spatial or vae_cfg.spatial_ratio
            tf = vae_cfg.scale_factor_temporal or vae_cfg.temporal_ratio
        else:
            sf, tf = self.scale_factors()
        return (batch, (num_frames - 1) // tf + 1, height // sf, width // sf, cfg.out_channels)

    def initial_noise(self, shape, seed: int) -> jnp.ndarray:
        return jax.random.normal(jax.random.fold_in(jax.random.key(seed), 0x7FFFFFFF), shape, jnp.float32)

    def expert_segments(self, sched, start: int = 0) -> list[tuple[int, int, int]]:
        """``[(expert, first step, stop step)]``: see :func:`vidax.core.sampling.expert_segments`."""
        return expert_segments(sched, self.boundary_ratio, start)

    @collect_own_garbage()  # frees what it loaded when it returns, without walking the caller's heap
    def sample_latents(self, cond: np.ndarray, uncond: np.ndarray | None = None, *, latents=None, seed: int = 0,
               height: int = 480, width: int = 832, num_frames: int = 81, steps: int = 50, guidance: float = 5.0,
               scheduler=None, dit=None, start: int = 0, state=None,
               on_step: Callable[[StepInfo, object, object], None] | None = None,
               image_cond: dict | None = None, guidance_2: float | None = None, dit_2=None):
        """Denoise. ``latents``: the sample to start from in the reference layout [B, C, F, H, W]
        (initial noise when ``start == 0``; drawn from ``seed`` when omitted). To resume at step
        ``start``, pass the latents and scheduler ``state`` saved after step ``start - 1``.
        ``on_step(info, x, state)`` sees channels-last latents after each step.

        ``image_cond``: the dict from :meth:`encode_image` (image-to-video). Two experts
        (``boundary_ratio``): expert 1 (``dit``, else loaded) runs the high-noise steps with
        ``guidance``, is dropped, then expert 2 (``dit_2``, else loaded) runs the rest with
        ``guidance_2`` (default ``guidance``), the scheduler state carried across.
        Returns the final latents in the reference layout (numpy float32)."""
        if self.image_to_video and image_cond is None:
            raise ValueError("this is an image-to-video model: pass image_cond=encode_image(...)")
        sched = scheduler or self.scheduler(steps)
        n = len(sched.timesteps)
        segments = self.expert_segments(sched, start)
        if not segments:
            raise ValueError(f"start={start} is past the last step ({n})")
        cfg0 = dit[1] if dit is not None and segments[0][0] == 1 else self.dit_config(segments[0][0])
        if latents is None:
            if start:
                raise ValueError("resuming (start > 0) needs the latents saved at that step")
            x = self.initial_noise(self.latent_shape(cond.shape[0], height, width, num_frames, cfg0), seed)
        else:
            x = jnp.asarray(np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1))
        if state is not None:
            state = jax.tree.map(jnp.asarray, state)
        aux, prepare, known = self._conditioning(image_cond, x.shape, cfg0)
        g2 = guidance if guidance_2 is None else guidance_2
        for expert, s0, s1 in segments:
            given = dit if expert == 1 else dit_2
            loaded = given if given is not None else self.load_dit(expert)
            if self.step_cache is not None:  # per expert, per CFG branch (empty at an expert's first step)
                cfg_on = uncond is not None and (guidance if expert == 1 else g2) != 1.0
                self.step_cache.begin(expert, 2 if cfg_on else 1, s0)
            x, state = self._denoise(loaded, x, cond, uncond, sched, guidance if expert == 1 else g2, seed, s0, s1,
                                     state, on_step, aux, prepare)
            del loaded  # drop this expert's weights before the next one is loaded
            gc.collect()
        if known is not None and segments[-1][2] == n:  # the reference substitutes once more at the end
            m, kn = known
            x = (1.0 - m) * kn + m * x
        return np.asarray(x).transpose(0, 4, 1, 2, 3)

    def _conditioning(self, image_cond, x_shape, cfg):
        """``(aux, prepare, known)`` for :func:`~vidax.core.sampling.denoise` from ``image_cond``."""
        image_cond = dict(image_cond or {})
        aux = {}
        if image_cond.get("clip") is not None:
            aux["img"] = jnp.asarray(image_cond["clip"], jnp.float32)
        ph, pw = int(cfg.patch_size[1]), int(cfg.patch_size[2])
        pf = int(cfg.patch_size[0])
        known = None
        if image_cond.get("condition") is not None:  # Wan2.1 I2V / A14B I2V: channel concat
            c = np.asarray(image_cond["condition"], np.float32).transpose(0, 2, 3, 4, 1)
            if c.shape[1:4] != tuple(x_shape[1:4]):
                raise ValueError(f"image condition {c.shape} does not match the latents {x_shape}")
            aux["cond"] = jnp.asarray(c)

            def prepare(x, t, aux):
                cc = jnp.broadcast_to(aux["cond"], x.shape[:-1] + aux["cond"].shape[-1:]).astype(x.dtype)
                return jnp.concatenate([x, cc], axis=-1), t

            prepare.key = ("concat",)  # what it computes (the compiled step is shared on it)
        elif image_cond.get("known") is not None:  # TI2V: substitution + per-token timesteps
            kn = np.asarray(image_cond["known"], np.float32).transpose(0, 2, 3, 4, 1)  # [1, 1, h, w, z]
            m = np.asarray(image_cond["mask"], np.float32).transpose(0, 2, 3, 4, 1)  # [1, F, h, w, 1]
            if m.shape[1:4] != tuple(x_shape[1:4]):
                raise ValueError(f"image mask {m.shape} does not match the latents {x_shape}")
            aux["known"], aux["mask"] = jnp.asarray(kn), jnp.asarray(m)
            known = (aux["mask"], aux["known"])

            def prepare(x, t, aux):
                mm = aux["mask"]
                xin = (1.0 - mm) * aux["known"] + mm * x
                tt = (mm[0, ::pf, ::ph, ::pw, 0] * t).reshape(1, -1)
                return xin, tt

            prepare.key = ("known", pf, ph, pw)
        elif self.expand_timesteps:  # TI2V text-to-video: per-token timesteps, all equal
            L = (x_shape[1] // pf) * (x_shape[2] // ph) * (x_shape[3] // pw)

            def prepare(x, t, aux):
                return x, jnp.full((1, L), t, jnp.float32)

            prepare.key = ("expand", L)
        else:
            prepare = None
        return (aux or None), prepare, known

    def _denoise(self, dit, x, cond, uncond, sched, guidance, seed, start, stop, state, on_step, aux, prepare):
        params, cfg = dit
        call = context = None
        # the text (and image) cross-attention keys / values are computed once per segment (expert)
        # by ``context`` and every step reads them (``runner.TEXT_KV_ONCE`` off: per step, as before)
        # (the step cache's units take them too)
        kv = bool(vrunner.context_names(wdit.WanTransformer))
        # the compiled step is shared by every call with the same model shape, mesh and schedule
        # (later prompts, the other A14B expert, resumed segments): it holds no weights
        key = ("wan", cfg, aux is None, kv)
        if isinstance(params, DiTRunner):
            runner = params
            b = 2 * x.shape[0] if uncond is not None and guidance != 1.0 else x.shape[0]
            runner.check_shapes({"x": (b, *x.shape[1:-1], cfg.in_channels)})
            dt = runner.dtype
            if runner.offload is None and self.step_cache is None:
                spec = runner.program()
                params = runner.step_params({"x": x.shape})  # weights and RoPE tables: arguments of the step
                key = ("wan-runner", spec.signature, aux is None, kv)
                if kv:
                    model = partial(_runner_apply_kv, spec)
                    context = lambda p, ctx, aux: runner.context(_context_inputs(ctx, aux))  # noqa: E731
                else:
                    model = spec.apply if aux is None else partial(_runner_apply_aux, spec)
            else:  # called from Python: streamed blocks, or the step cache's units
                model, params = None, None
                runner.use_cache(self.step_cache)
                if kv:
                    call = partial(_runner_call_kv, runner)
                    context = lambda p, ctx, aux: runner.context(_context_inputs(ctx, aux))  # noqa: E731
                else:
                    call = runner if aux is None else partial(_runner_call_aux, runner)
        else:  # one device: the state and the RoPE tables are the step's arguments
            model, dt = partial(_dit_apply if aux is None else _dit_apply_aux, cfg=cfg), wdit.state_dtype(params)
            pt, ph, pw = cfg.patch_size
            params = (params, wdit.rope_tables(cfg, (x.shape[1] // pt, x.shape[2] // ph, x.shape[3] // pw)))
            if kv:
                model, program = partial(_dit_apply_kv, cfg=cfg), _dit_context(cfg)
                context = lambda p, ctx, aux: program(p[0], _context_inputs(ctx, aux))  # noqa: E731
        return denoise(model, params, sched, x, jnp.asarray(cond, dt),
                       None if uncond is None else jnp.asarray(uncond, dt), guidance=guidance, seed=seed, start=start,
                       stop=stop, state=state, on_step=on_step, model_call=call, prepare=prepare, aux=aux,
                       cache_key=key, context=context)

    # ------------------------------------------------------------------ image conditioning
    def size_for_image(self, image, area: int = 480 * 832) -> tuple[int, int]:
        """A valid (height, width) near ``area`` pixels with the image's aspect ratio."""
        if hasattr(image, "getbands"):  # PIL
            iw, ih = image.size
        else:
            ih, iw = np.asarray(image).shape[:2]
        return self.geometry().fit_size(ih, iw, area)

    def encode_image(self, image, height: int, width: int, num_frames: int, vae=None, image_encoder=None) -> dict:
        """The image conditioning of an image-to-video run (numpy arrays, reference layout, batch 1):

        - ``clip`` [1, L, D]: CLIP's penultimate hidden states of the image (models whose DiT has an
          image branch: Wan2.1 I2V);
        - ``condition`` [1, T + z, F, h, w]: the first-frame mask (T = temporal factor channels) and
          the normalised VAE latent of ``[image, zeros...]`` (Wan2.1 I2V, Wan2.2 A14B I2V); or
        - ``known`` [1, z, 1, h, w] + ``mask`` [1, 1, F, h, w] (Wan2.2 TI2V, ``expand_timesteps``):
          the first frame's normalised latent and where the latents stay free (0 on the known frame).

        ``image``: uint8 [H, W, 3] (or a PIL image), resized to (height, width) as the reference's
        ``VideoProcessor.preprocess`` does (PIL Lanczos, no aspect-ratio preservation: pick the size
        with :meth:`size_for_image`)."""
        self.geometry().check(height, width, num_frames)
        rgb = _rgb_uint8(image)
        out = {}
        if self.uses_clip:
            from vidax.text import clip as clipmod

            enc, pre = image_encoder or self.load_image_encoder()
            pix = clipmod.preprocess(rgb, **pre)
            out["clip"] = np.asarray(enc.penultimate(jnp.asarray(pix)), np.float32)
            del enc
        vparams, vcfg = vae or self.load_vae()
        px = resize_for_vae(rgb, height, width)  # [3, H, W] in [-1, 1]
        tf = vcfg.scale_factor_temporal or vcfg.temporal_ratio
        f_lat = (num_frames - 1) // tf + 1
        if self.expand_timesteps:
            video = px[None, :, None]
        else:
            video = np.zeros((1, 3, num_frames, height, width), np.float32)
            video[:, :, 0] = px
        lat = wvae.normalize_latents(vcfg, wvae.encode(vparams, vcfg, video).astype(np.float32))
        h, w = lat.shape[-2:]
        if self.expand_timesteps:
            mask = np.ones((1, 1, f_lat, h, w), np.float32)
            mask[:, :, 0] = 0
            out["known"], out["mask"] = lat, mask
        else:
            mask = np.zeros((1, tf, f_lat, h, w), np.float32)
            mask[:, :, 0] = 1
            out["condition"] = np.concatenate([mask, lat], axis=1)
        return out

    def decode_video(self, latents: np.ndarray, vae=None) -> np.ndarray:
        """Latents [B, C, F, H, W] (as sampled, normalised) -> video in [0, 1], [B, F, H, W, 3]."""
        params, cfg = vae or self.load_vae()
        z = wvae.denormalize_latents(cfg, np.asarray(latents, np.float32))
        return to_unit_range(wvae.decode(params, cfg, z))

    def decode_frames(self, latents: np.ndarray, start: int, stop: int, cache=None, vae=None, tiling: bool = False):
        """Decode latent frames ``start..stop-1`` given the cache left by frame ``start - 1``.
        Returns ``(uint8 frames [B, T, H, W, 3], cache)``; chunked decodes concatenate bitwise to
        the whole decode. ``tiling``: in overlapping spatial tiles (:func:`tiles.tiled_decode`)."""
        params, cfg = vae or self.load_vae()
        z = wvae.denormalize_latents(cfg, np.asarray(latents, np.float32))
        if tiling:
            px, cache = wtiles.tiled_decode(params, cfg, z, start=start, stop=stop, cache=cache, return_cache=True)
            return to_uint8(to_unit_range(px)), {k: np.asarray(v) for k, v in cache.items()}
        if cache is not None:
            cache = {k: jnp.asarray(v) for k, v in cache.items()}
        px, cache = wvae.decode(params, cfg, z, start=start, stop=stop, cache=cache, return_cache=True)
        return to_uint8(to_unit_range(px)), wvae.cache_to_numpy(cache)

    def fingerprint(self, component: str) -> str:
        """Content identity of a component's weights (part of every stage key): ``text``,
        ``image``, ``dit``, ``vae``."""
        if self.preset is not None:
            return f"preset:{self.preset_name}:{component}:{self.dtype.name}"
        files = {
            "text": ["text_encoder", "tokenizer"] if self.layout == "diffusers" else ["models_t5_*.pth", "google"],
            "dit": ["transformer"] if self.layout == "diffusers" else ["config.json", "diffusion_pytorch_model*"],
            "vae": ["vae"] if self.layout == "diffusers" else ["Wan2.1_VAE.pth"],
            "image": ["image_encoder", "image_processor", "vae"] if self.layout == "diffusers"
            else ["models_clip_*.pth", "Wan2.1_VAE.pth"],
        }[component]
        if component == "dit" and self.has_transformer_2:
            files = files + ["transformer_2"]
        return f"{component}:{self.dtype.name}:" + files_fingerprint(self.folder, files)

    # ------------------------------------------------------------------ the stage protocol
    def encode(self, request, image: np.ndarray | None = None) -> dict[str, Named]:
        """Prompt and negative-prompt embeddings (computed in float32, stored in the request's
        dtype) and, with an image, its conditioning (``image_clip`` / ``image_condition`` /
        ``image_known`` + ``image_mask``, see :meth:`encode_image`)."""
        self._check_prompts(request)  # never a silent cut
        tok, enc = self.load_tokenizer(), self.load_text_encoder()
        cond = self.encode_prompts(request.prompts, tok, enc)
        neg = request.negative_prompt if request.negative_prompt is not None else ""
        uncond = self.encode_prompts([neg] * len(request.prompts), tok, enc)
        del enc
        dt = np.dtype(np.float32) if request.dtype == "float32" else np.dtype(jnp.bfloat16)
        attrs = dict(model=request.model, computed_in="float32", stored_as=str(dt))
        out = {"prompt_embeds": Named(cond.astype(dt), _EMB_DIMS, attrs),
               "negative_embeds": Named(uncond.astype(dt), _EMB_DIMS, attrs)}
        if image is not None:
            for name, arr in self.encode_image(image, request.height, request.width, request.num_frames).items():
                dims = _EMB_DIMS if arr.ndim == 3 else _LATENT_DIMS
                out[f"image_{name}"] = Named(arr.astype(np.float32), dims, {"role": f"image conditioning ({name})"})
        return out

    def sample(self, conditioning: dict, request, *, resume: dict | None = None, on_step=None) -> dict[str, Named]:
        """Final latents ``[B, C, F, H, W]`` (normalised). ``resume``: ``{"step": k, "arrays":
        {...}}`` from a checkpoint that ``on_step``'s snapshot produced after step ``k - 1``."""
        o = request.options
        sched = self.scheduler(request.steps, o.get("scheduler"), o.get("shift"))
        g2 = o.get("guidance_2")
        cond = conditioning["prompt_embeds"]
        uncond = conditioning.get("negative_embeds") if max(request.guidance, g2 or 0.0) > 1.0 else None
        image_cond = {n[len("image_"):]: v for n, v in conditioning.items() if n.startswith("image_")} or None
        start, latents, state = 0, None, None
        if resume is not None:
            start = int(resume["step"])
            shape = self.latent_shape(cond.shape[0], request.height, request.width, request.num_frames)
            template = sched.init_state(jnp.zeros(shape, jnp.float32))
            latents, state = unpack_state(resume["arrays"], template)

        def step_cb(info, x, st):
            on_step(info, lambda: pack_state(np.asarray(x).transpose(0, 4, 1, 2, 3), st))

        lat = self.sample_latents(cond, uncond, latents=latents, seed=request.seed, height=request.height,
                                  width=request.width, num_frames=request.num_frames, steps=request.steps,
                                  guidance=request.guidance, scheduler=sched, start=start, state=state,
                                  on_step=None if on_step is None else step_cb, image_cond=image_cond, guidance_2=g2)
        return {"latents": Named(lat, _LATENT_DIMS, {"model": request.model, "layout": "reference [B, C, F, H, W]",
                                                     "normalised": True})}

    def decode(self, latents: dict, span: DecodeSpan, carry: dict | None, request):
        """Latent frames ``span.frames`` -> uint8 frames, from the causal-conv cache ``carry`` that
        the previous span left; returns the cache for the next span. A tile stage (``span.tile``,
        see the class docstring) returns its tiles' raw decoder output instead."""
        if span.tile is not None:
            return self.decode_tile_span(latents, span, carry, request)
        a, b = span.frames
        frames, cache = self.decode_frames(latents["latents"], a, b, carry,
                                           tiling=bool(request.options.get("vae_tiling")))
        return ({"frames": Named(frames, ("batch", "frame", "height", "width", "rgb"),
                                 {"latent_frames": [a, b], "units": "uint8 RGB"})}, cache)

    # ------------------------------------------------------------------ memory plan (``vidax plan``)
    def text_config(self) -> t5mod.T5Config:
        """The prompt encoder's config without its weights (UMT5-XXL for the original layout)."""
        if self.preset:
            return self.preset.text
        path = self.config_folder / "text_encoder" / "config.json"
        if self.layout == "diffusers" and path.is_file():
            return t5mod.T5Config.from_hf(json.loads(path.read_text()))
        return t5mod.T5Config.from_hf(UMT5_XXL)

    def plan_units(self, request) -> list:
        """UMT5 over the prompts (float32, as :meth:`encode_prompts` runs it); one DiT call on the
        guidance batch on this pipeline's mesh (one unit for both A14B experts: same shapes); the
        VAE's per-latent-frame decode program with its causal cache (what a decode stage repeats)."""
        from vidax.core import plan as vplan

        b = len(request.prompts)
        tp = 1 if self.preset else self.pool_devices(request, "encode")  # as load_text_encoder splits it
        units = [t5mod.plan_unit(self.text_config(), b, self.max_text_len, tp=tp, name="UMT5 text encoder")]
        cfg = self.dit_config(1)
        runner = wdit.runner(wdit.abstract_state(cfg, self.dtype), cfg, self.mesh, self.parallelism)
        nb = 2 * b if request.guidance > 1.0 else b
        _, f, h, w, _ = self.latent_shape(nb, request.height, request.width, request.num_frames, cfg)
        pt, ph, pw = cfg.patch_size
        tokens = (f // pt) * (h // ph) * (w // pw)
        x = vplan.abstract((nb, f, h, w, cfg.in_channels), self.dtype)
        t = vplan.abstract((nb, tokens) if self.expand_timesteps else (nb,), np.float32)
        ctx = vplan.abstract((nb, self.max_text_len, cfg.text_dim), self.dtype)
        img = vplan.abstract((nb, 257, cfg.image_dim), self.dtype) if cfg.image_dim else None
        units.append(vplan.Unit("sample", "DiT step" + (" (per expert)" if self.has_transformer_2 else ""),
                                jax.jit(runner.apply), (runner.step_params({"x": x.shape}), x, t, ctx, img),
                                weights=runner.params, note=f"batch {nb} x {tokens:,} tokens"))
        tiled = bool(request.options.get("vae_tiling"))  # tiles spread over the decode pool's chips
        return units + [wvae.plan_decode_unit(self.vae_config(), b, h, w, tiled=tiled,
                                              devices=self.pool_devices(request, "decode"))]

    # ------------------------------------------------------------------ probe hooks (``vidax probe``)
    def vae_encode(self, video: np.ndarray) -> np.ndarray:
        params, cfg = self.load_vae()
        return wvae.normalize_latents(cfg, wvae.encode(params, cfg, np.asarray(video, np.float32)).astype(np.float32))

    def vae_decode(self, latents: np.ndarray) -> np.ndarray:
        return self.decode_video(latents)

    def denoise_once(self, latents, sigmas, conditioning, request=None) -> np.ndarray:
        """The clean estimate ``x - sigma * v`` per row, the DiT at timestep ``sigma * 1000`` (the
        expert whose range holds it for A14B), with the image conditioning of ``conditioning``."""
        x = np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1)
        ctx = jnp.asarray(np.asarray(conditioning["prompt_embeds"], np.float32)[:1])
        image_cond = {n[len("image_"):]: v for n, v in conditioning.items() if n.startswith("image_")} or None
        experts, out = {}, []
        for i, s in enumerate(np.asarray(sigmas, np.float32)):
            t = float(s) * 1000.0
            e = 1 if self.boundary_ratio is None or t >= self.boundary_ratio * 1000.0 else 2
            if e not in experts:
                experts.clear()  # one expert on device at a time
                experts[e] = self.load_dit(e)
            params, cfg = experts[e]
            xi = jnp.asarray(x[i:i + 1])
            aux, prepare, _ = self._conditioning(image_cond, xi.shape, cfg)
            xin, tt = (xi, jnp.float32(t)) if prepare is None else prepare(xi, jnp.float32(t), aux)
            tt = jnp.asarray(tt, jnp.float32)
            tt = tt.reshape(1) if tt.ndim == 0 else tt  # [1] or per-token [1, L]
            img = None if aux is None else aux.get("img")
            dt = params.dtype if isinstance(params, DiTRunner) else wdit.state_dtype(params)
            args = (xin.astype(dt), tt, ctx.astype(dt),
                    None if img is None else img.astype(dt))
            v = params(*args) if isinstance(params, DiTRunner) else _probe_forward(params, cfg, *args)
            out.append(np.asarray(xi - s * np.asarray(v, np.float32)))
        experts.clear()
        return np.concatenate(out).transpose(0, 4, 1, 2, 3)

    def generate(self, prompt: str | list[str], negative_prompt: str | list[str] | None = None, *, seed: int = 0,
                 height: int = 480, width: int = 832, num_frames: int = 81, steps: int = 50,
                 guidance: float = 5.0, shift: float | None = None, scheduler: str | None = None,
                 on_step=None, guidance_2: float | None = None) -> np.ndarray:
        """Prompt(s) -> uint8 frames [B, F, H, W, 3]."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        self.geometry().check(height, width, num_frames)
        cond, uncond = self._prompt_pair(prompts, negative_prompt, guidance, guidance_2)
        lat = self.sample_latents(cond, uncond, seed=seed, height=height, width=width, num_frames=num_frames, steps=steps,
                          guidance=guidance, scheduler=self.scheduler(steps, scheduler, shift), on_step=on_step,
                          guidance_2=guidance_2)
        return to_uint8(self.decode_video(lat))

    def _prompt_pair(self, prompts, negative_prompt, guidance, guidance_2=None):
        tok, enc = self.load_tokenizer(), self.load_text_encoder()
        cond = self.encode_prompts(prompts, tok, enc)
        uncond = None
        if guidance > 1.0 or (guidance_2 is not None and guidance_2 > 1.0):
            neg = negative_prompt if negative_prompt is not None else ""
            negs = [neg] * len(prompts) if isinstance(neg, str) else list(neg)
            uncond = self.encode_prompts(negs, tok, enc)
        return cond, uncond


class WanI2V(WanT2V):
    """Wan image-to-video (a ``WanImageToVideoPipeline`` folder, or an image-to-video preset):
    Wan2.1 I2V, Wan2.2 A14B I2V (two experts) and Wan2.2 TI2V-5B (``expand_timesteps``)."""

    def __init__(self, source: str | Path = "tiny-i2v", **kw):
        super().__init__(source, **kw)
        if not self.image_to_video:
            raise ValueError(f"{source}: not an image-to-video model ({self.pipeline_class}); use WanT2V")

    def generate(self, image, prompt: str | list[str], negative_prompt: str | list[str] | None = None, *,
                 seed: int = 0, height: int | None = None, width: int | None = None, area: int = 480 * 832,
                 num_frames: int = 81, steps: int = 40, guidance: float = 5.0, guidance_2: float | None = None,
                 shift: float | None = None, scheduler: str | None = None, on_step=None) -> np.ndarray:
        """Image (uint8 [H, W, 3] or PIL) + prompt(s) -> uint8 frames [B, F, H, W, 3]. Without
        ``height``/``width`` the size follows the image's aspect ratio at about ``area`` pixels."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if height is None or width is None:
            height, width = self.size_for_image(image, area)
        self.geometry().check(height, width, num_frames)
        cond, uncond = self._prompt_pair(prompts, negative_prompt, guidance, guidance_2)
        vae = self.load_vae()
        image_cond = self.encode_image(image, height, width, num_frames, vae=vae)
        lat = self.sample_latents(cond, uncond, seed=seed, height=height, width=width, num_frames=num_frames,
                                  steps=steps, guidance=guidance, guidance_2=guidance_2,
                                  scheduler=self.scheduler(steps, scheduler, shift),
                          on_step=on_step, image_cond=image_cond)
        return to_uint8(self.decode_video(lat, vae=vae))


@partial(jax.jit, static_argnums=1)
def _probe_forward(params, cfg, x, t, ctx, img):
    return wdit.forward(params, cfg, x, t, ctx, img)


def _dit_apply(params, x, t, ctx, *, cfg):
    state, rope = params
    return wdit.forward(state, cfg, x, t, ctx, rope=rope)


def _batched_img(aux, b):
    img = aux.get("img") if aux else None
    if img is None or img.shape[0] == b:
        return img
    if img.shape[0] == 1:
        return jnp.broadcast_to(img, (b, *img.shape[1:]))
    return jnp.concatenate([img] * (b // img.shape[0]), axis=0)  # the CFG batch: [cond; uncond]


def _dit_apply_aux(params, x, t, ctx, aux, *, cfg):
    state, rope = params
    return wdit.forward(state, cfg, x, t, ctx, _batched_img(aux, x.shape[0]), rope=rope)


def _context_inputs(ctx, aux) -> dict:
    """The inputs of the once-computed keys / values: the CFG-batched text and, I2V, the image tokens."""
    return {"ctx": ctx, "img": _batched_img(aux, ctx.shape[0])}


@functools.lru_cache(maxsize=8)
def _dit_context(cfg):
    """The jitted one-device context program (keys / values of the text and image tokens), per config."""
    return jax.jit(lambda state, a: wdit.context(state, cfg, a["ctx"], a.get("img")))


def _dit_apply_kv(params, x, t, kv, aux=None, *, cfg):
    state, rope = params
    return wdit.forward(state, cfg, x, t, None, rope=rope, context=kv)


def _runner_apply_kv(runner, params, x, t, kv, aux=None):
    return runner.apply(params, x, t, None, context=kv)


def _runner_call_kv(runner, x, t, kv, aux=None):
    return runner(x, t, None, context=kv)


def _runner_apply_aux(runner, params, x, t, ctx, aux):
    return runner.apply(params, x, t, ctx, _batched_img(aux, x.shape[0]))


def _runner_call_aux(runner, x, t, ctx, aux):
    return runner(x, t, ctx, _batched_img(aux, x.shape[0]))


def _rgb_uint8(image) -> np.ndarray:
    from vidax.text import clip as clipmod

    return clipmod.to_rgb_uint8(image)


def resize_for_vae(image_uint8: np.ndarray, height: int, width: int) -> np.ndarray:
    """The reference's ``VideoProcessor.preprocess(image, height, width)`` for one RGB image: PIL
    Lanczos resize to exactly (height, width), /255, to [-1, 1]. Returns float32 [3, H, W]."""
    import PIL.Image

    im = PIL.Image.fromarray(np.asarray(image_uint8, np.uint8))
    im = im.resize((width, height), resample=PIL.Image.Resampling.LANCZOS)
    a = np.asarray(im.convert("RGB")).astype(np.float32) / 255.0
    return (2.0 * a - 1.0).transpose(2, 0, 1).astype(np.float32)


def original_dit_config(cfg: dict) -> wdit.WanDiTConfig:
    """DiT config from the original release's ``config.json`` (``"_class_name": "WanModel"``)."""
    dim, heads = cfg["dim"], cfg["num_heads"]
    img = cfg.get("model_type") in ("i2v", "flf2v")
    return wdit.WanDiTConfig(
        patch_size=tuple(cfg.get("patch_size", (1, 2, 2))), num_heads=heads, head_dim=dim // heads,
        in_channels=cfg.get("in_dim", 16), out_channels=cfg.get("out_dim", 16), text_dim=cfg.get("text_dim", 4096),
        freq_dim=cfg.get("freq_dim", 256), ffn_dim=cfg["ffn_dim"], num_layers=cfg["num_layers"],
        cross_attn_norm=cfg.get("cross_attn_norm", True), eps=cfg.get("eps", 1e-6),
        image_dim=1280 if img else None, added_kv_proj_dim=dim if img else None,
        pos_embed_seq_len=514 if cfg.get("model_type") == "flf2v" else None,
    )
