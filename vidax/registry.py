"""Model id -> recipe, discovered from the family folders (``vidax/models/<family>/recipes.py``).

Nothing here names a family: adding one is adding a folder whose ``recipes.py`` exports
``RECIPES`` (a list of :class:`vidax.pipeline.Recipe`).
"""
from __future__ import annotations

import importlib
import os
import pkgutil

from vidax.pipeline import PRESET_DEFAULTS, Recipe  # noqa: F401 - re-exported

# Which deployment (and so which work pool) runs each stage kind; prefect.yaml binds them to pools.
STAGE_DEPLOYMENTS = {"encode": "vidax-stage/encode", "sample": "vidax-stage/sample",
                     "decode": "vidax-stage/decode", "mux": "vidax-stage/mux"}
# Which deployment runs one phase (stage kind) of many runs of a distributed batch, on the same pools.
PHASE_DEPLOYMENTS = {"encode": "vidax-phase/batch-encode", "sample": "vidax-phase/batch-sample",
                     "decode": "vidax-phase/batch-decode", "mux": "vidax-phase/batch-mux"}


MODELS: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Add a recipe (families do this through ``recipes.py``; tests may add their own)."""
    if MODELS.get(recipe.model_id, recipe) != recipe:
        raise ValueError(f"model id {recipe.model_id!r} is registered twice")
    MODELS[recipe.model_id] = recipe
    return recipe


def unregister(model_id: str) -> None:
    MODELS.pop(model_id, None)


def _discover() -> None:
    """Import ``vidax.models.<family>.recipes`` for every family folder (configs only: recipes
    name their pipeline class as a string, so no model code is imported here), then the modules
    named in ``$VIDAX_FAMILIES`` (comma-separated; families kept outside vidax)."""
    import vidax.models as pkg

    names = [f"vidax.models.{m.name}.recipes" for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)
             if m.ispkg]
    extra = [n.strip() for n in os.environ.get("VIDAX_FAMILIES", "").split(",") if n.strip()]
    for name in names + extra:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if name in extra:
                raise ImportError(f"$VIDAX_FAMILIES names {name!r}, which cannot be imported: {e}") from None
            if e.name == name:
                continue
            raise
        for r in getattr(mod, "RECIPES", ()):
            register(r)


def default_model() -> str:
    """The model id a request without one gets (the recipe marked ``default``)."""
    marked = sorted(m for m, r in MODELS.items() if r.default)
    if len(marked) != 1:
        raise RuntimeError(f"exactly one recipe must be marked default=True, found {marked or 'none'}")
    return marked[0]


def get(model_id: str) -> Recipe:
    try:
        return MODELS[model_id]
    except KeyError:
        raise ValueError(f"unknown model {model_id!r}; available: {', '.join(sorted(MODELS))}") from None


_discover()
