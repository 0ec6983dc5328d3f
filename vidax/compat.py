"""Load diffusers- / transformers-format folders into vidax ports.

``load_pretrained(folder)`` reads ``config.json`` (+ safetensors, sharded or not), picks the port
from ``_class_name`` (diffusers) or ``architectures`` (transformers) and returns a
:class:`CompatModel` whose ``forward`` / ``encode`` / ``decode`` take the reference module's keyword
arguments as numpy arrays in the reference's layouts and return numpy.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Callable

import numpy as np

from vidax.weights.source import resolve_source

_ADAPTERS: dict[str, Callable] = {}
# Ports whose adapter accepts mesh= / parallelism= / offload_chunk_size= (see vidax.core.sharding).
_SCALABLE: set[str] = set()


def ports() -> dict[str, str]:
    """Reference class -> the vidax module that registers its adapter (imported on first use),
    gathered from ``PORTS`` of :mod:`vidax.text` and of every family package ``vidax.models.<f>``."""
    import pkgutil

    import vidax.models
    import vidax.text

    out = dict(getattr(vidax.text, "PORTS", {}))
    for m in sorted(pkgutil.iter_modules(vidax.models.__path__), key=lambda m: m.name):
        if m.ispkg:
            out.update(getattr(importlib.import_module(f"vidax.models.{m.name}"), "PORTS", {}))
    return out


def register(*class_names: str, scalable: bool = False):
    """Decorator: ``@register("WanTransformer3DModel", scalable=True)`` on ``fn(config: dict,
    folder: Path, **kw) -> CompatModel``; ``scalable`` adapters accept mesh / parallelism /
    offload_chunk_size."""

    def deco(fn):
        for n in class_names:
            _ADAPTERS[n] = fn
            if scalable:
                _SCALABLE.add(n)
        return fn

    return deco


class CompatModel:
    """A vidax port behind the reference module's calling convention."""

    def __init__(self, name: str, config: dict, params, model_config=None):
        self.name, self.config, self.params, self.model_config = name, config, params, model_config

    def forward(self, **kwargs) -> np.ndarray:
        raise NotImplementedError(f"{self.name} has no forward()")

    def encode(self, x) -> np.ndarray:
        raise NotImplementedError(f"{self.name} has no encode()")

    def decode(self, z) -> np.ndarray:
        raise NotImplementedError(f"{self.name} has no decode()")

    def __repr__(self):
        return f"<vidax {self.name}>"


def load_dit(wrap: Callable, load: Callable, runner: Callable, constraints, check_chunks: Callable, *, mesh=None,
             parallelism: str | None = None, offload_chunk_size=None, prefetch: bool = True, attn_impl=None,
             **_) -> CompatModel:
    """The part of a DiT's adapter every family shares: ``load() -> (host state, cfg)``, ``wrap(state,
    cfg, runner) -> CompatModel``. On one device the state is placed whole (``runner`` None); with a
    mesh or offloading, an impossible layout fails before a tensor is read (``constraints``, the
    family's ``parallel_constraints``; ``check_chunks(offload_chunk_size)``), each host reads only its
    devices' shards, and ``runner(state, cfg, mesh, parallelism, ...)`` runs it."""
    import jax

    from vidax.core import mesh as vmesh
    from vidax.core import sharding as vsh
    from vidax.weights.keymap import lazy_params

    if mesh is None and parallelism in (None, "none") and offload_chunk_size is None:
        state, cfg = load()
        return wrap(jax.device_put(state), cfg, None)
    m = vmesh.make_mesh(mesh) if mesh is not None else vmesh.single_device_mesh()
    vsh.resolve_parallelism(parallelism, m)
    vmesh.check_divisible(list(constraints), m, ring=vmesh.ring_degree(mesh))
    if offload_chunk_size is not None:
        check_chunks(offload_chunk_size)
    with lazy_params(offload_chunk_size is None):  # resident: each host reads only its devices' shards
        state, cfg = load()
    return wrap(None, cfg, runner(state, cfg, m, parallelism, offload_chunk_size=offload_chunk_size, prefetch=prefetch,
                                  attn_impl=attn_impl, ring=vmesh.ring_degree(mesh)))


def register_dit(name: str, from_config: Callable, wrap: Callable, load: Callable, runner: Callable, *,
                 constraints: Callable, check_chunks: Callable | None = None) -> None:
    """Register DiT ``name``'s scalable adapter (:func:`load_dit`): ``from_config(config.json) -> cfg``,
    ``wrap(config, state, cfg, runner) -> CompatModel``, ``load(folder, cfg, dtype=) -> (host state,
    cfg)``, ``runner(state, cfg, mesh, parallelism, **kw)``, ``constraints(cfg)`` (the family's
    ``parallel_constraints``), ``check_chunks(offload_chunk_size, cfg)`` (default: one stack of
    ``cfg.num_layers``)."""
    def adapter(config: dict, folder: Path, dtype=np.float32, **kw) -> CompatModel:
        from vidax.core.offload import resolve_chunk_size

        cfg = from_config(config)
        check = check_chunks or (lambda c, cfg: resolve_chunk_size(c, cfg.num_layers))
        return load_dit(lambda state, c, r: wrap(config, state, c, r), lambda: load(folder, cfg, dtype=dtype), runner,
                        constraints(cfg), lambda c: check(c, cfg), **kw)

    register(name, scalable=True)(adapter)


def read_config(folder: str | Path) -> dict:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{folder}: no config.json (expected a diffusers or transformers model folder)")
    return json.loads(cfg_path.read_text())


def class_name(cfg: dict) -> str | None:
    if "_class_name" in cfg:
        return cfg["_class_name"]
    arch = cfg.get("architectures") or []
    return arch[0] if arch else None


def load_pretrained(folder: str | Path, *, mesh=None, parallelism: str | None = None, offload_chunk_size=None,
                    lora=None, **kwargs) -> CompatModel:
    """Load a reference folder. For ``WanTransformer3DModel``: ``mesh`` (a ``Mesh`` with axes
    dp/tp/sp or a spec like ``"tp=2,sp=2"``), ``parallelism`` ("tp" | "sp" | "tp+sp"; default: what
    the mesh implies) and ``offload_chunk_size`` (blocks streamed from host memory per chunk, or
    "all"; ``prefetch=False`` turns the transfer/compute overlap off). ``lora``: ``"FILE[:SCALE]"``
    or a list of them, merged into the weights on the host at load (the model's family names the
    LoRA layouts it reads: ``vidax.models.<family>.lora``). Outputs stay numpy."""
    folder = resolve_source(folder)  # a local folder, or any fsspec URL fetched into the cache
    cfg = read_config(folder)
    name = class_name(cfg)
    table = ports()
    if name not in table:
        raise ValueError(f"{folder}: model class {name!r} has no vidax port; supported: {sorted(table)}")
    scale = {k: v for k, v in (("mesh", mesh), ("parallelism", parallelism), ("offload_chunk_size", offload_chunk_size))
             if v is not None}
    importlib.import_module(table[name])
    if scale and name not in _SCALABLE:
        raise ValueError(f"{name}: {sorted(scale)} not supported (mesh / parallelism / offloading: {sorted(_SCALABLE)})")
    if not lora:
        return _ADAPTERS[name](cfg, folder, **scale, **kwargs)
    from vidax.weights import lora as vlora

    specs = vlora.parse_specs(lora)
    fam = table[name].rsplit(".", 1)[0]  # vidax.models.<family>
    try:
        aliases = importlib.import_module(f"{fam}.lora").compat_aliases(name, cfg)
    except (ImportError, AttributeError, KeyError):
        raise ValueError(f"{name}: LoRAs are not supported for this model") from None
    target = vlora.Target("dit", Path(folder), aliases, f"{name} ({folder})")
    vlora.check(specs, {"dit": target})
    with vlora.merging(target, specs):
        return _ADAPTERS[name](cfg, folder, **scale, **kwargs)
