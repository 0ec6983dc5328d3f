"""Wan text-to-video generation: prompt encode (fp32) -> DiT sampling -> VAE decode.

Each phase loads only its own weights and drops them when it returns, so the phases can also run
as separate stages (see ``stages/``). Sources:

- ``"tiny"`` (or any name in :data:`PRESET_SOURCES`): seeded random weights, byte tokenizer —
  runs anywhere in seconds, nothing downloaded;
- a diffusers pipeline folder (``model_index.json``; ``text_encoder/ tokenizer/ transformer/ vae/
  scheduler/``);
- an original Wan2.1 release folder (``config.json`` with ``"_class_name": "WanModel"``,
  ``diffusion_pytorch_model*.safetensors``, ``models_t5_umt5-xxl-enc-bf16.pth``,
  ``Wan2.1_VAE.pth``, ``google/umt5-xxl/`` tokenizer).
"""
from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core.sampling import StepInfo, denoise
from vidax.models.wan import dit as wdit
from vidax.models.wan import vae as wvae
from vidax.schedulers import from_diffusers_config, make_scheduler
from vidax.text import t5 as t5mod
from vidax.text.tokenizer import ByteTokenizer, load_tokenizer

# Defaults of the original Wan2.1 T2V release (generate.py / configs).
WAN21_NEGATIVE = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
    "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，"
    "杂乱的背景，三条腿，背景人很多，倒着走"
)


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
    max_text_len: int = 64
    seed: int = 0


PRESET_SOURCES = {"tiny": TinyPreset()}


def prompt_clean(text: str) -> str:
    """The reference pipeline's prompt clean-up: ftfy (if installed), HTML unescape, whitespace."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class WanT2V:
    """Wan text-to-video. ``source``: a preset name or a checkpoint folder."""

    def __init__(self, source: str | Path = "tiny", *, dtype=np.float32, mesh=None, parallelism: str | None = None,
                 offload_chunk_size=None, prefetch: bool = True):
        """``mesh``: None (one device), a spec like ``"dp=2,tp=2,sp=2"`` or a Mesh; ``parallelism``:
        "tp" | "sp" | "tp+sp" (default: what the mesh implies); ``offload_chunk_size``: stream the
        DiT blocks from host memory in chunks of this many blocks ("all": one chunk)."""
        self.dtype = np.dtype(dtype)
        self.mesh, self.parallelism = mesh, parallelism
        self.offload_chunk_size, self.prefetch = offload_chunk_size, prefetch
        self.preset = PRESET_SOURCES.get(str(source)) if not Path(str(source)).exists() else None
        self.preset_name = str(source) if self.preset is not None else None
        if self.preset is None:
            self.folder = Path(source)
            if not self.folder.is_dir():
                raise ValueError(f"model source {source!r} is neither a preset ({sorted(PRESET_SOURCES)}) nor a folder")
            self.layout = "diffusers" if (self.folder / "model_index.json").exists() else "original"
        else:
            self.folder, self.layout = None, "preset"
        self.max_text_len = self.preset.max_text_len if self.preset else 512

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
            return t5mod.T5Encoder(jax.device_put(t5mod.init_params(cfg, seed=self.preset.seed + 1)), cfg)
        if self.layout == "diffusers":
            return t5mod.load_t5(self.folder / "text_encoder", dtype=np.float32)
        pth = sorted(self.folder.glob("models_t5_*.pth"))
        if not pth:
            raise FileNotFoundError(f"{self.folder}: no models_t5_*.pth text encoder")
        return t5mod.load_t5(pth[0], dtype=np.float32)

    def dit_config(self) -> wdit.WanDiTConfig:
        if self.preset:
            return self.preset.dit
        if self.layout == "diffusers":
            return wdit.WanDiTConfig.from_diffusers(json.loads((self.folder / "transformer" / "config.json").read_text()))
        return original_dit_config(json.loads((self.folder / "config.json").read_text()))

    @property
    def scaled(self) -> bool:
        return self.mesh is not None or self.offload_chunk_size is not None

    def load_dit(self):
        """DiT params + config: on one device, or (``mesh`` / ``offload_chunk_size`` set) a
        :class:`~vidax.models.wan.dit.WanDiTRunner` that places or streams them itself."""
        params, cfg = self._load_dit_host()
        if not self.scaled:
            return jax.device_put(params), cfg
        runner = wdit.WanDiTRunner(params, cfg, self.mesh, self.parallelism,
                                   offload_chunk_size=self.offload_chunk_size, prefetch=self.prefetch)
        return runner, cfg

    def _load_dit_host(self):
        cfg = self.dit_config()
        if self.preset:
            params = wdit.init_params(cfg, seed=self.preset.seed + 2, dtype=self.dtype)
        elif self.layout == "diffusers":
            params, cfg = wdit.load_dit(self.folder / "transformer", cfg, dtype=self.dtype)
        else:
            params, cfg = wdit.load_dit(self.folder, cfg, dtype=self.dtype)
        return params, cfg

    def load_vae(self):
        if self.preset:
            cfg = self.preset.vae
            return jax.device_put(wvae.init_params(cfg, seed=self.preset.seed + 3)), cfg
        if self.layout == "diffusers":
            params, cfg = wvae.load_vae(self.folder / "vae")
        else:
            params, cfg = wvae.load_vae(self.folder / "Wan2.1_VAE.pth")
        return jax.device_put(params), cfg

    def scheduler(self, steps: int, name: str | None = None, shift: float | None = None):
        if name is None and self.layout == "diffusers":
            cfg = json.loads((self.folder / "scheduler" / "scheduler_config.json").read_text())
            if shift is not None:
                cfg["flow_shift" if "flow_shift" in cfg else "shift"] = shift
            return from_diffusers_config(cfg, steps)
        name = name or "unipc"
        shift = 5.0 if shift is None else shift
        if name == "unipc":
            return make_scheduler("unipc", steps, prediction_type="flow_prediction", use_flow_sigmas=True,
                                  num_train_timesteps=1000, flow_shift=shift)
        return make_scheduler(name, steps, shift=shift)

    # ------------------------------------------------------------------ phases
    def encode_prompts(self, prompts: list[str], tokenizer=None, encoder=None) -> np.ndarray:
        """Prompt embeddings [B, max_text_len, D] in float32; positions past each prompt's tokens are
        zero, as the reference pipeline leaves them."""
        tok = tokenizer or self.load_tokenizer()
        enc = encoder or self.load_text_encoder()
        ids, mask = tok([prompt_clean(p) for p in prompts], self.max_text_len)
        h = np.asarray(jax.jit(t5mod.encode, static_argnums=1)(enc.params, enc.cfg, jnp.asarray(ids), jnp.asarray(mask)))
        return (h * (np.asarray(mask)[..., None] > 0)).astype(np.float32)

    def latent_shape(self, batch: int, height: int, width: int, num_frames: int, cfg: wdit.WanDiTConfig | None = None,
                     vae_cfg=None):
        cfg = cfg or self.dit_config()
        sf, tf = 8, 4
        return (batch, (num_frames - 1) // tf + 1, height // sf, width // sf, cfg.in_channels)

    def initial_noise(self, shape, seed: int) -> jnp.ndarray:
        return jax.random.normal(jax.random.fold_in(jax.random.key(seed), 0x7FFFFFFF), shape, jnp.float32)

    def sample(self, cond: np.ndarray, uncond: np.ndarray | None = None, *, latents=None, seed: int = 0,
               height: int = 480, width: int = 832, num_frames: int = 81, steps: int = 50, guidance: float = 5.0,
               scheduler=None, dit=None, start: int = 0, state=None,
               on_step: Callable[[StepInfo, object, object], None] | None = None):
        """Denoise. ``latents``: the sample to start from in the reference layout [B, C, F, H, W]
        (initial noise when ``start == 0``; drawn from ``seed`` when omitted). To resume at step
        ``start``, pass the latents and scheduler ``state`` saved after step ``start - 1``.
        ``on_step(info, x, state)`` sees channels-last latents after each step.
        Returns the final latents in the reference layout (numpy float32)."""
        params, cfg = dit or self.load_dit()
        sched = scheduler or self.scheduler(steps)
        if latents is None:
            if start:
                raise ValueError("resuming (start > 0) needs the latents saved at that step")
            x = self.initial_noise(self.latent_shape(cond.shape[0], height, width, num_frames, cfg), seed)
        else:
            x = jnp.asarray(np.asarray(latents, np.float32).transpose(0, 2, 3, 4, 1))
        if state is not None:
            state = jax.tree.map(jnp.asarray, state)
        call = None
        if isinstance(params, wdit.WanDiTRunner):
            runner = params
            runner.check_inputs((2 * x.shape[0] if uncond is not None and guidance != 1.0 else x.shape[0], *x.shape[1:]))
            dt = runner.dtype
            if runner.offload is None:
                model, params = runner.apply, runner.params
            else:
                model, params, call = None, None, runner
        else:
            model, dt = partial(_dit_apply, cfg=cfg), params["patch"]["w"].dtype
        x, _ = denoise(model, params, sched, x, jnp.asarray(cond, dt), None if uncond is None else jnp.asarray(uncond, dt),
                       guidance=guidance, seed=seed, start=start, state=state, on_step=on_step, model_call=call)
        return np.asarray(x).transpose(0, 4, 1, 2, 3)

    def decode(self, latents: np.ndarray, vae=None) -> np.ndarray:
        """Latents [B, C, F, H, W] (as sampled, normalised) -> video in [0, 1], [B, F, H, W, 3]."""
        params, cfg = vae or self.load_vae()
        z = wvae.denormalize_latents(cfg, np.asarray(latents, np.float32))
        return to_unit_range(wvae.decode(params, cfg, z))

    def decode_frames(self, latents: np.ndarray, start: int, stop: int, cache=None, vae=None):
        """Decode latent frames ``start..stop-1`` given the cache left by frame ``start - 1``.
        Returns ``(uint8 frames [B, T, H, W, 3], cache)``; chunked decodes concatenate bitwise to
        the whole decode."""
        params, cfg = vae or self.load_vae()
        z = wvae.denormalize_latents(cfg, np.asarray(latents, np.float32))
        if cache is not None:
            cache = {k: jnp.asarray(v) for k, v in cache.items()}
        px, cache = wvae.decode(params, cfg, z, start=start, stop=stop, cache=cache, return_cache=True)
        return to_uint8(to_unit_range(px)), wvae.cache_to_numpy(cache)

    def fingerprint(self, component: str) -> str:
        """Identity of a component's weights (part of every stage key)."""
        if self.preset is not None:
            return f"preset:{self.preset_name}:{component}:{self.dtype.name}"
        files = {
            "text": ["text_encoder", "tokenizer"] if self.layout == "diffusers" else ["models_t5_*.pth", "google"],
            "dit": ["transformer"] if self.layout == "diffusers" else ["config.json", "diffusion_pytorch_model*"],
            "vae": ["vae"] if self.layout == "diffusers" else ["Wan2.1_VAE.pth"],
        }[component]
        return f"{component}:{self.dtype.name}:" + files_fingerprint(self.folder, files)

    def generate(self, prompt: str | list[str], negative_prompt: str | list[str] | None = None, *, seed: int = 0,
                 height: int = 480, width: int = 832, num_frames: int = 81, steps: int = 50,
                 guidance: float = 5.0, shift: float | None = None, scheduler: str | None = None,
                 on_step=None) -> np.ndarray:
        """Prompt(s) -> uint8 frames [B, F, H, W, 3]."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        check_size(height, width, num_frames)
        cond = self.encode_prompts(prompts)
        uncond = None
        if guidance > 1.0:
            neg = negative_prompt if negative_prompt is not None else ""
            negs = [neg] * len(prompts) if isinstance(neg, str) else list(neg)
            uncond = self.encode_prompts(negs)
        lat = self.sample(cond, uncond, seed=seed, height=height, width=width, num_frames=num_frames, steps=steps,
                          guidance=guidance, scheduler=self.scheduler(steps, scheduler, shift), on_step=on_step)
        return to_uint8(self.decode(lat))


def to_unit_range(pixels: np.ndarray) -> np.ndarray:
    """VAE output [B, 3, T, H, W] in [-1, 1] -> [B, T, H, W, 3] in [0, 1] (the reference's postprocess)."""
    return np.clip(np.asarray(pixels).transpose(0, 2, 3, 4, 1) / 2 + 0.5, 0.0, 1.0)


def to_uint8(video01: np.ndarray) -> np.ndarray:
    return np.round(video01 * 255).astype(np.uint8)


def files_fingerprint(folder: Path, patterns) -> str:
    """Cheap content identity of checkpoint files: names, sizes and modification times."""
    import hashlib

    h = hashlib.sha256()
    for pat in patterns:
        for p in sorted(folder.glob(pat)):
            for f in sorted([p] if p.is_file() else p.rglob("*")):
                if f.is_file():
                    st = f.stat()
                    h.update(f"{f.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def _dit_apply(params, x, t, ctx, *, cfg):
    return wdit.forward(params, cfg, x, t, ctx)


def check_size(height: int, width: int, num_frames: int, spatial: int = 16, temporal: int = 4):
    if height % spatial or width % spatial or height <= 0 or width <= 0:
        raise ValueError(f"size {width}x{height}: width and height must be positive multiples of {spatial}")
    if num_frames < 1 or (num_frames - 1) % temporal:
        raise ValueError(f"num_frames={num_frames}: must be {temporal}k+1 (e.g. 17, 33, 81)")


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
