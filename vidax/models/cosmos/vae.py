"""The Wan VAEs as the Cosmos families use them -- the one place that calls ``vidax.models.wan.vae``
and its tiled decode (the pipelines' tile stages are :class:`vidax.models.wan.tiles.TileStages`).

Cosmos-Predict2.5 decodes with the Wan2.1 VAE (16 channels, 8x spatial / 4x temporal), Cosmos3 with
the Wan2.2 VAE (48 channels, 16x spatial / 4x temporal). Both pipelines normalise latents as
``(z - latents_mean) / latents_std`` (the reference multiplies by ``1 / latents_std``) and encode
conditioning frames with the posterior mean (``sample_mode="argmax"``).

Everything here takes and returns host numpy in the reference layout ``[B, C, F, H, W]``.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from vidax.models.wan import tiles as wtiles
from vidax.models.wan import vae as wvae

Config = wvae.WanVAEConfig

#: seeded small VAEs for the tiny presets: Wan2.1-shaped (16 ch, 8x) and Wan2.2-shaped (48 -> 8 ch, 16x)
TINY_21 = wvae.WanVAEConfig(base_dim=16, z_dim=16, num_res_blocks=1)
TINY_22 = wvae.WanVAEConfig(base_dim=8, decoder_base_dim=16, z_dim=8, dim_mult=(1, 2, 4, 4), num_res_blocks=1,
                            temperal_downsample=(False, True, True), is_residual=True, patch_size=2, in_channels=12,
                            out_channels=12, scale_factor_spatial=16, latents_mean=tuple(0.05 * i for i in range(8)),
                            latents_std=tuple(0.8 + 0.05 * i for i in range(8)))


def config_from_folder(folder: Path) -> Config:
    """The VAE config of a diffusers ``vae/`` folder, without reading weights."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Config.from_diffusers(json.loads((Path(folder) / "config.json").read_text()))


def init(cfg: Config, seed: int):
    """Seeded random weights (presets), placed: ``(params, cfg)``."""
    return jax.device_put(wvae.init_params(cfg, seed=seed)), cfg


def load(path) -> tuple:
    """A diffusers ``vae/`` folder or an original ``Wan2.*_VAE.pth``: ``(params, cfg)`` placed."""
    params, cfg = wvae.load_vae(path)
    return jax.device_put(params), cfg


def factors(cfg: Config) -> tuple[int, int]:
    """(spatial, temporal) pixel -> latent factors."""
    return (cfg.scale_factor_spatial or cfg.spatial_ratio), (cfg.scale_factor_temporal or cfg.temporal_ratio)


def encode(vae, video: np.ndarray) -> np.ndarray:
    """Pixels [B, 3, F, H, W] in [-1, 1] -> normalised latents (posterior mean), float32."""
    params, cfg = vae
    z = wvae.encode(params, cfg, np.asarray(video, np.float32))
    return np.asarray(wvae.normalize_latents(cfg, np.asarray(z, np.float32)), np.float32)


def decode(vae, latents: np.ndarray) -> np.ndarray:
    """Normalised latents -> pixels [B, 3, T, H, W] in [-1, 1] (the whole clip)."""
    params, cfg = vae
    z = wvae.denormalize_latents(cfg, np.asarray(latents, np.float32))
    return np.asarray(wvae.decode(params, cfg, z), np.float32)


def decode_frames(vae, latents: np.ndarray, start: int, stop: int, cache=None, tiling: bool = False):
    """Latent frames ``start .. stop-1`` (normalised) -> (pixels [B, 3, T, H, W] in [-1, 1], the
    causal cache for the next span as numpy); ``tiling``: in overlapping spatial tiles."""
    params, cfg = vae
    z = wvae.denormalize_latents(cfg, np.asarray(latents, np.float32))
    if tiling:
        px, cache = wtiles.tiled_decode(params, cfg, z, start=start, stop=stop, cache=cache, return_cache=True)
        return np.asarray(px, np.float32), {k: np.asarray(v) for k, v in cache.items()}
    if cache is not None:
        cache = {k: jnp.asarray(v) for k, v in cache.items()}
    px, cache = wvae.decode(params, cfg, z, start=start, stop=stop, cache=cache, return_cache=True)
    return np.asarray(px, np.float32), wvae.cache_to_numpy(cache)


def plan_encode_unit(cfg: Config, height: int, width: int):
    """``vidax plan``'s encode program: the VAE encode of one ``height x width`` conditioning frame."""
    from functools import partial

    from vidax.core import plan as vplan

    state = wvae.state_from_pure(cfg, wvae.param_shapes(cfg))
    px = vplan.abstract((1, 3, 1, height, width), np.float32)
    enc = partial(wvae.encode_chunk_jit, cfg=cfg, first=True, attn_impl=None, conv_impl="native")
    return vplan.Unit("encode", "VAE encode, the image frame", enc, (state, px, None), weights=state,
                      note="1 conditioning frame")


#: ``vidax plan``'s decode program (one latent frame with its cache; ``tiled``: one tile per device)
plan_decode_unit = wvae.plan_decode_unit

__all__ = ["Config", "TINY_21", "TINY_22", "config_from_folder", "decode", "decode_frames", "encode", "factors", "init",
           "load", "plan_decode_unit", "plan_encode_unit"]
