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

    def pipeline_class(self):
        mod, cls = self.pipeline.split(":")
        return getattr(importlib.import_module(mod), cls)

    def settings(self, preset: str | None, **overrides) -> dict:
        """Defaults for this model (and preset), with non-None overrides applied."""
        s = dict(self.defaults)
        s.update(PRESET_DEFAULTS.get(preset, {}))
        s.update({k: v for k, v in overrides.items() if v is not None})
        return s


# Small sizes for the seeded random-weight presets, so a first run takes seconds.
PRESET_DEFAULTS = {"tiny": dict(height=64, width=64, num_frames=9, steps=6, guidance=5.0, fps=8)}

MODELS = {
    r.model_id: r
    for r in [
        Recipe(
            "wan2.1-t2v-1.3b", "vidax.models.wan.pipeline:WanT2V", ("tiny", "1.3b"),
            dict(height=480, width=832, num_frames=81, steps=50, guidance=5.0, shift=3.0, fps=16, scheduler="unipc"),
            description="Wan2.1 text-to-video, 1.3B (480p)",
        ),
        Recipe(
            "wan2.1-t2v-14b", "vidax.models.wan.pipeline:WanT2V", ("tiny", "14b"),
            dict(height=720, width=1280, num_frames=81, steps=50, guidance=5.0, shift=5.0, fps=16, scheduler="unipc"),
            description="Wan2.1 text-to-video, 14B (720p)",
        ),
    ]
}


def get(model_id: str) -> Recipe:
    try:
        return MODELS[model_id]
    except KeyError:
        raise ValueError(f"unknown model {model_id!r}; available: {', '.join(sorted(MODELS))}") from None
