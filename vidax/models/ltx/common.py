"""What the LTX pipelines (:mod:`vidax.models.ltx.ltxv`: LTX-Video 0.9.x, :mod:`vidax.models.ltx.ltx2`:
LTX-2.x) share: scheduler set-up, noise streams, token packing, the checkpoint source, the tiled decode
plan and the probe's VAE hooks (sources and phases: this family's README.md, "Pipelines")."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from vidax.core import sharding as vsh
from vidax.models.ltx import vae as lvae
from vidax.pipeline import DecodeSpan, OptionError, to_uint8, to_unit_range
from vidax.schedulers import from_diffusers_config
from vidax.weights.fingerprint import files_fingerprint

_CONFIG_FILES = ("model_index.json", "*/config.json", "scheduler/scheduler_config.json")
EMB = ("batch", "token", "channel")
LATENT = ("batch", "channel", "frame", "height", "width")

#: the LTX checkpoints' scheduler (FlowMatchEulerDiscreteScheduler, resolution-dependent shift)
LTX_SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
                 "use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
                 "max_image_seq_len": 4096, "shift_terminal": 0.1, "time_shift_type": "exponential"}

# noise streams of a run (fold_in constants of the run's seed)
NOISE_LATENTS, NOISE_AUDIO, NOISE_IMAGE, NOISE_DECODE, NOISE_VAE = 0x7FFFFFFF, 0x7FFFFFFE, 0x11, 0x22, 0x33


def calculate_shift(seq_len, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    """The pipelines' resolution-dependent ``mu`` (linear in the token count)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return seq_len * m + (base_shift - m * base_seq_len)


def make_scheduler(config: dict, steps: int, seq_len: int, defaults=(256, 4096, 0.5, 1.15)):
    """The scheduler as the LTX pipelines set it: ``sigmas = linspace(1, 1/N, N)``, ``mu`` from the
    video token count and the config's (or the pipeline's default) shift bounds."""
    b0, b1, s0, s1 = defaults
    mu = calculate_shift(seq_len, config.get("base_image_seq_len", b0), config.get("max_image_seq_len", b1),
                         config.get("base_shift", s0), config.get("max_shift", s1))
    sigmas = np.linspace(1.0, 1.0 / steps, steps)
    return from_diffusers_config(dict(config), steps, sigmas=sigmas, mu=mu)


def key_for(seed: int, stream: int, *more: int):
    k = jax.random.fold_in(jax.random.key(seed), stream)
    for m in more:
        k = jax.random.fold_in(k, m)
    return k


def pack(x, p: int = 1, pt: int = 1):
    """Channels-last latents [B, F, H, W, C] -> tokens [B, S, C*pt*p*p] (the reference's _pack_latents)."""
    b, f, h, w, c = x.shape
    x = x.reshape(b, f // pt, pt, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 7, 2, 4, 6)
    return x.reshape(b, (f // pt) * (h // p) * (w // p), c * pt * p * p)


def unpack(y, grid, p: int = 1, pt: int = 1):
    b = y.shape[0]
    f, h, w = grid
    y = y.reshape(b, f, h, w, -1, pt, p, p).transpose(0, 1, 5, 2, 6, 3, 7, 4)
    return y.reshape(b, f * pt, h * p, w * p, -1)


def resize_image(image, height: int, width: int, resample: str = "lanczos") -> np.ndarray:
    """The reference ``VideoProcessor.preprocess`` for one RGB image: PIL resize to exactly
    (height, width), [0, 255] -> [-1, 1]. Returns float32 [3, H, W]."""
    import PIL.Image

    from vidax.text.clip import to_rgb_uint8

    im = PIL.Image.fromarray(to_rgb_uint8(image))
    mode = {"lanczos": PIL.Image.Resampling.LANCZOS, "bilinear": PIL.Image.Resampling.BILINEAR}[resample]
    a = np.asarray(im.resize((width, height), resample=mode).convert("RGB")).astype(np.float32) / 255.0
    return (2.0 * a - 1.0).transpose(2, 0, 1).astype(np.float32)


def first_frame_mask(grid) -> jnp.ndarray:
    """Image-to-video's known-frame mask [1, F, H, W, 1] for a latent grid: 1 on the first latent frame."""
    keep = np.zeros((1, *grid, 1), np.float32)
    keep[:, 0] = 1.0
    return jnp.asarray(keep)


def default_request(pipe, request=None):
    """What a probe hook reads of a request (seed, fps, options): the request's, or the defaults."""
    from types import SimpleNamespace

    opts = {o.name: o.default for o in pipe.OPTIONS}
    if request is not None:
        opts.update({k: v for k, v in dict(request.options).items() if v is not None})
    return SimpleNamespace(seed=getattr(request, "seed", 0), fps=getattr(request, "fps", None), options=opts)


def replicated(runner):
    """Place loop arrays replicated on a runner's mesh (what its programs return), so the first
    step and the later ones see the same argument shardings (one compile)."""
    if runner is None:
        return lambda a: a
    s = vsh.replicated(runner.mesh)
    return lambda a: jax.device_put(a, s)


def preset_stats(cfg, seed):
    rng = np.random.default_rng(seed)
    c = cfg.latent_channels
    return {"latents_mean": (0.1 * rng.standard_normal(c)).astype(np.float32),
            "latents_std": (1.0 + 0.1 * rng.uniform(-1, 1, c)).astype(np.float32)}


# ----------------------------------------------------------------------------------- base
class Source:
    """A preset name or a checkpoint folder (local or fsspec URL), configs read at construction."""

    def _init_source(self, source, presets: dict):
        self.index = self.open_source(source, presets, _CONFIG_FILES, "LTX pipeline")

    def _config(self, sub: str) -> dict:
        return json.loads((self.config_folder / sub / "config.json").read_text())

    def scheduler_config(self) -> dict:
        if self.preset is not None:
            return dict(LTX_SCHEDULER)
        return json.loads((self.config_folder / "scheduler" / "scheduler_config.json").read_text())

    def _fp(self, component: str, files: list[str]) -> str:
        if self.preset is not None:
            return f"preset:{self.preset_name}:{component}:{self.dtype.name}"
        return f"{component}:{self.dtype.name}:" + files_fingerprint(self.folder, files)


def check_prompt_lengths(tok, request, limit: int):
    neg = request.negative_prompt or ""
    for name, texts in (("prompt", request.prompts), ("negative_prompt", [neg])):
        for i, n in enumerate(tok.count([t.strip() for t in texts])):
            if n > limit:
                which = f" {i + 1}" if len(texts) > 1 else ""
                raise OptionError(name, f"prompt{which} is {n} tokens long; the text encoder reads at most {limit}: "
                                        "shorten it")


class Tiles:
    """Decode plans of whole-video or spatially tiled VAE decodes (one persisted stage per tile,
    raster order, each carrying the blended edge strips its right and lower neighbours need)."""

    def video_plan(self, request, lat_frames: int, lh: int, lw: int, vae_cfg) -> list[DecodeSpan]:
        tiling = self.tiling(request)
        if tiling is None:
            return [DecodeSpan("decode/0", "video", (0, lat_frames))]
        grid = tiling.grid(vae_cfg, lh, lw)
        boxes = [b for row in grid for b in row]
        if len(boxes) == 1:
            return [DecodeSpan("decode/0", "video", (0, lat_frames))]
        return [DecodeSpan(f"decode/{k}", "video", (0, lat_frames), box, f"decode/{k - 1}" if k else None)
                for k, box in enumerate(boxes)]

    def tiling(self, request):
        return lvae.Tiling() if request.options.get("vae_tiling") else None

    def finish_tile(self, pixels, span: DecodeSpan, carry, request, lh: int, lw: int, vae_cfg):
        """``pixels``: the raw decode of ``span``'s tile [B, 3, F, h, w] -> (uint8 frames, carry)."""
        if span.tile is None:
            return to_uint8(to_unit_range(pixels)), None
        tiling = self.tiling(request)
        grid = tiling.grid(vae_cfg, lh, lw)
        boxes = [(i, j, b) for i, row in enumerate(grid) for j, b in enumerate(row)]
        k = next(n for n, (_, _, b) in enumerate(boxes) if b == tuple(span.tile))
        i, j, _ = boxes[k]
        region, carry = lvae.blend_tile(pixels, i, j, carry, tiling, last=k == len(boxes) - 1)
        return to_uint8(to_unit_range(region)), carry

    def plan_vae_unit(self, request, b, grid):
        """``vidax plan``'s VAE decode program of ``b`` x ``grid`` latents (one spatial tile when tiled)."""
        from vidax.core import conv as vconv
        from vidax.core import nn
        from vidax.core import plan as vplan

        vcfg = self.vae_config()
        state = nn.abstract_state(lambda: lvae._build(vcfg, 0, np.float32, self.preset is not None))[1]
        state = vconv.split_taps(state, combos=True)  # held as load_vae holds it
        f, h, w = grid
        what = "whole clip"
        if self.tiling(request) is not None:
            y0, y1, x0, x1 = self.tiling(request).grid(vcfg, h, w)[0][0]
            h, w, what = y1 - y0, x1 - x0, "one spatial tile"
        z = vplan.abstract((b, f, h, w, vcfg.latent_channels), np.float32)
        temb = vplan.abstract((b,), np.float32) if vcfg.timestep_conditioning else None
        key = jax.eval_shape(lambda: jax.random.key(0)) if any(vcfg.decoder_inject_noise) else None
        return vplan.Unit("decode", f"VAE decode, {what}", lvae._decode,
                          (state, vcfg, lvae._has_encoder(state), z, temb, key), weights=state,
                          note=f"{b} x {f}x{h}x{w} latents")

    def assemble_video(self, parts):
        if len(parts) == 1 or parts[0][0].tile is None:
            return np.concatenate([f for _, f in parts], axis=1)
        rows: dict = {}
        for span, f in parts:
            rows.setdefault(span.tile[0], []).append((span.tile[2], f))
        return np.concatenate([np.concatenate([f for _, f in sorted(r, key=lambda t: t[0])], axis=3)
                               for _, r in sorted(rows.items())], axis=2)


class ProbeVAE:
    """The probe's VAE hooks, shared by LTX-Video 0.9 and LTX-2 (same VAE code, same latent layout)."""

    def vae_encode(self, video: np.ndarray) -> np.ndarray:
        """Pixels -> the posterior mean, normalised as the sampled latents are (the inverse of
        ``decode_latents``' denormalisation)."""
        state, cfg, stats = self.load_vae(encoder=True)
        return lvae.normalize(stats, cfg, np.asarray(lvae.encode(state, cfg, np.asarray(video, np.float32))))

    def vae_decode(self, latents: np.ndarray) -> np.ndarray:
        """As ``decode`` with the convolutional VAE at the default options (a timestep-conditioned
        decoder's decode timestep and noise, the decoder's injected noise from seed 0), the whole
        frame at once."""
        return to_unit_range(self.decode_latents(latents, default_request(self)))


def with_image(x, image_latents, keep):
    """``x`` [1, F, H, W, C] with its known frame (``keep``) set to the image's latent [1, C, 1, H, W]."""
    if keep is None:
        return x
    return jnp.asarray(np.asarray(image_latents, np.float32).transpose(0, 2, 3, 4, 1)) * keep + x * (1.0 - keep)
