"""Model id -> recipe: which pipeline, which presets, size rules and default settings."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recipe:
    model_id: str
    pipeline: str  # "module:Class"
    presets: tuple[str, ...]
    defaults: dict = field(default_factory=dict)
    spatial_factor: int = 16  # VAE 8x * patch 2x
    temporal_factor: int = 4  # num_frames = 4k + 1
    description: str = ""
    # job variables per stage kind and preset, for routing stages to sized work pools
    # (preset None = real checkpoints); merged into run_deployment(..., job_variables=...)
    stage_jobs: dict = field(default_factory=dict)
    prefer_axis: str = "sp"  # what --mesh auto spreads the DiT over besides CFG's dp
    image: str = "none"  # "none" | "required" (image-to-video) | "optional" (TI2V: T2V or I2V)
    pipeline_i2v: str | None = None  # "module:Class" used when an image is given (image="optional")
    preset_sources: dict = field(default_factory=dict)  # (preset, has_image) -> pipeline source name

    def pipeline_class(self, has_image: bool = False):
        mod, cls = (self.pipeline_i2v if has_image and self.pipeline_i2v else self.pipeline).split(":")
        return getattr(importlib.import_module(mod), cls)

    def source(self, preset: str | None, checkpoint: str | None, has_image: bool = False) -> str:
        """What the pipeline class is built from: the checkpoint folder, or the preset's source."""
        if checkpoint:
            return checkpoint
        return self.preset_sources.get((preset, has_image), preset)

    def default_mesh(self, n_devices: int, num_heads: int, tokens: int, cfg_parallel: bool) -> str | None:
        """The mesh ``--mesh auto`` picks on ``n_devices``: the conditional/unconditional pair on
        ``dp`` when guidance is on, the rest on the recipe's preferred axis (``sp`` for models whose
        weights fit one chip, ``tp`` for the large ones), as large as the heads (and, for sp, the
        token count) allow."""
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
        s = dict(self.defaults)
        s.update(PRESET_DEFAULTS.get(preset, {}))
        s.update({k: v for k, v in overrides.items() if v is not None})
        return s


# Small sizes for the seeded random-weight presets, so a first run takes seconds.
# Which deployment (and so which work pool) runs each stage kind; prefect.yaml binds them to pools.
STAGE_DEPLOYMENTS = {"encode": "vidax-stage/encode", "sample": "vidax-stage/sample",
                     "decode": "vidax-stage/decode", "mux": "vidax-stage/mux"}


def _tpu(accelerator: str, topology: str, chips: int) -> dict:
    return {"tpu_accelerator": accelerator, "tpu_topology": topology, "tpu_chips": chips}


PRESET_DEFAULTS = {"tiny": dict(height=64, width=64, num_frames=9, steps=6, guidance=5.0, fps=8, area=64 * 64)}
_WAN = "vidax.models.wan.pipeline:WanT2V"
_WAN_I2V = "vidax.models.wan.pipeline:WanI2V"

MODELS = {
    r.model_id: r
    for r in [
        Recipe(
            "wan2.1-t2v-1.3b", "vidax.models.wan.pipeline:WanT2V", ("tiny", "1.3b"),
            dict(height=480, width=832, num_frames=81, steps=50, guidance=5.0, shift=3.0, fps=16, scheduler="unipc"),
            description="Wan2.1 text-to-video, 1.3B (480p)",
            stage_jobs={None: {"encode": _tpu("tpu-v5-lite-podslice", "2x2", 4),
                               "sample": _tpu("tpu-v5-lite-podslice", "2x4", 8),
                               "decode": _tpu("tpu-v5-lite-podslice", "2x2", 4)}},
        ),
        Recipe(
            "wan2.1-t2v-14b", "vidax.models.wan.pipeline:WanT2V", ("tiny", "14b"),
            dict(height=720, width=1280, num_frames=81, steps=50, guidance=5.0, shift=5.0, fps=16, scheduler="unipc"),
            description="Wan2.1 text-to-video, 14B (720p)", prefer_axis="tp",
            stage_jobs={None: {"encode": _tpu("tpu-v5-lite-podslice", "2x4", 8),
                               "sample": _tpu("tpu-v5-lite-podslice", "2x4", 8),
                               "decode": _tpu("tpu-v5-lite-podslice", "2x4", 8)}},
        ),
        Recipe(
            "wan2.1-i2v-480p", _WAN_I2V, ("tiny",),
            dict(area=480 * 832, num_frames=81, steps=40, guidance=5.0, shift=3.0, fps=16, scheduler="unipc"),
            description="Wan2.1 image-to-video 14B, 480p (CLIP image cross-attention)", prefer_axis="tp",
            image="required", preset_sources={("tiny", True): "tiny-i2v"},
        ),
        Recipe(
            "wan2.1-i2v-720p", _WAN_I2V, ("tiny",),
            dict(area=720 * 1280, num_frames=81, steps=40, guidance=5.0, shift=5.0, fps=16, scheduler="unipc"),
            description="Wan2.1 image-to-video 14B, 720p (CLIP image cross-attention)", prefer_axis="tp",
            image="required", preset_sources={("tiny", True): "tiny-i2v"},
        ),
        Recipe(
            "wan2.2-ti2v-5b", _WAN, ("tiny",),
            dict(height=704, width=1280, area=704 * 1280, num_frames=121, steps=50, guidance=5.0, shift=5.0, fps=24,
                 scheduler="unipc"),
            spatial_factor=32, description="Wan2.2 TI2V-5B: text- or image-to-video, 720p/24fps (latent substitution)",
            image="optional", pipeline_i2v=_WAN_I2V,
            preset_sources={("tiny", False): "tiny-ti2v", ("tiny", True): "tiny-ti2v-i2v"},
        ),
        Recipe(
            "wan2.2-t2v-a14b", _WAN, ("tiny",),
            dict(height=720, width=1280, num_frames=81, steps=40, guidance=4.0, guidance_2=3.0, shift=12.0, fps=16,
                 scheduler="unipc"),
            description="Wan2.2 text-to-video A14B: high- and low-noise experts", prefer_axis="tp",
            preset_sources={("tiny", False): "tiny-a14b"},
        ),
        Recipe(
            "wan2.2-i2v-a14b", _WAN_I2V, ("tiny",),
            dict(area=720 * 1280, num_frames=81, steps=40, guidance=3.5, guidance_2=3.5, shift=5.0, fps=16,
                 scheduler="unipc"),
            description="Wan2.2 image-to-video A14B: high- and low-noise experts", prefer_axis="tp",
            image="required", preset_sources={("tiny", True): "tiny-a14b-i2v"},
        ),
    ]
}


def get(model_id: str) -> Recipe:
    try:
        return MODELS[model_id]
    except KeyError:
        raise ValueError(f"unknown model {model_id!r}; available: {', '.join(sorted(MODELS))}") from None
