"""Memory plans: compile a stage's unit at abstract shapes, no weights loaded, and read the
compiler's own per-device memory analysis.

A family describes each stage's compiled unit as a :class:`Unit` (its jitted function and the
abstract arguments: ``jax.ShapeDtypeStruct`` leaves carrying their ``NamedSharding``): the prompt
encoder's forward, one sampling step's DiT call on the guidance batch, one decode stage.
Runners are built from an abstract state (:func:`vidax.core.sharding.place` places
``ShapeDtypeStruct`` leaves on paper), so the very code that runs a stage is what gets compiled.
:func:`measure` lowers and compiles a unit on the current devices (real ones, or fake CPU devices
standing in for a pool) and returns the bytes one device holds: arguments (weights and inputs),
outputs and temporaries. ``stages.plan`` turns those into a verdict per stage against the pool's
chips (:data:`CHIPS`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from vidax.core import conv as vconv

GiB = 1024 ** 3

#: accelerator (GKE / job-template name) -> (short name, HBM bytes per chip)
CHIPS = {
    "tpu-v5-lite-podslice": ("v5e", 16 * GiB),
    "tpu-v5-lite-device": ("v5e", 16 * GiB),
    "tpu-v5p-slice": ("v5p", 95 * GiB),
    "tpu-v6e-slice": ("v6e", 32 * GiB),
    "tpu-v4-podslice": ("v4", 32 * GiB),
    "nvidia-h100-80gb": ("H100", 80 * GiB),
    "nvidia-h200": ("H200", 141 * GiB),
    "nvidia-a100-80gb": ("A100", 80 * GiB),
}


def chip(accelerator: str | None) -> tuple[str, int | None]:
    """(short name, HBM bytes) of a pool's accelerator; unknown names keep their name and no limit."""
    if accelerator is None:
        return "local", None
    return CHIPS.get(accelerator, (accelerator, None))


@dataclass
class Unit:
    """One compiled program of a stage: ``fn(*args)`` with abstract ``args`` (a pytree of
    ``jax.ShapeDtypeStruct``, sharded ones carrying their sharding). ``repeat``: how many times
    the stage calls it (steps, tiles...), for the record only. ``note``: what it is, in the user's
    terms (``"DiT step, guidance batch 2 x 75,600 tokens"``)."""

    stage: str  # stage kind: encode | sample | decode
    name: str
    fn: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    note: str = ""
    static_argnums: tuple = ()
    weights: Any = None  # the abstract parameters among ``args`` (reported apart from the inputs)


@dataclass
class UnitMemory:
    stage: str
    name: str
    note: str
    devices: int
    arguments: int  # bytes per device
    outputs: int
    temporaries: int
    aliased: int
    weights: int  # of the arguments: the unit's parameters (leaves named ``params``)
    compile_seconds: float
    #: bytes one device sends per call for sequence-parallel attention (``vidax.core.sharding.count_comm``:
    #: Ulysses all_to_all, ring K/V hops, joint-token gathers), from the traced program's local shapes
    comm: dict = field(default_factory=dict)

    @property
    def comm_bytes(self) -> int:
        return int(sum(self.comm.values()))

    @property
    def peak(self) -> int:
        """Bytes one device needs while the unit runs (arguments + outputs + temporaries - aliased)."""
        return int(self.arguments + self.outputs + self.temporaries - self.aliased)

    def to_json(self) -> dict:
        return {"stage": self.stage, "name": self.name, "note": self.note, "devices": self.devices,
                "arguments": self.arguments, "outputs": self.outputs, "temporaries": self.temporaries,
                "aliased": self.aliased, "weights": self.weights, "peak": self.peak,
                "compile_seconds": round(self.compile_seconds, 2), "sp_comm": dict(self.comm)}


def abstract(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), np.dtype(dtype), sharding=sharding)


def like(tree, sharding=None):
    """Abstract leaves for a tree of arrays / shapes (``sharding``: one for every leaf, or None)."""
    return jax.tree.map(lambda a: abstract(np.shape(a), a.dtype, sharding if sharding is not None
                                           else getattr(a, "sharding", None)), tree)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of an abstract (or placed) tree: each leaf's shard shape under its
    sharding (unsharded leaves whole)."""
    total = 0
    for a in jax.tree.leaves(tree):
        s = getattr(a, "sharding", None)
        shape = s.shard_shape(tuple(a.shape)) if s is not None else tuple(a.shape)
        total += int(np.prod(shape)) * np.dtype(a.dtype).itemsize
    return total


def _cpu_options() -> dict:
    """On CPU, XLA upcasts bf16 matmuls to float32 and hoists the upcast of a scanned weight stack
    out of the loop: a float32 copy of every block's weights that a TPU/GPU program never holds
    (Wan 14B, tp=4: 19 GiB of temporaries instead of 5.9). The plan compiles without that hoisting,
    and without LLVM's expensive optimisations (the program never runs; buffer assignment is decided
    before code generation, so the figures are the same, and compiling takes half the time)."""
    if jax.default_backend() != "cpu":
        return {}
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion", "xla_backend_optimization_level": 0,
            "xla_llvm_disable_expensive_passes": True}


def measure(unit: Unit) -> UnitMemory:
    """Lower and compile ``unit`` on the current devices (nothing runs, nothing is allocated) and
    read the compiled program's memory analysis."""
    from vidax.core.sharding import count_comm

    t0 = time.perf_counter()
    jitted = unit.fn if hasattr(unit.fn, "lower") else jax.jit(unit.fn, static_argnums=unit.static_argnums)
    with vconv.default_impl("native"), count_comm() as comm:  # the accelerator's conv formulation
        compiled = jitted.lower(*unit.args, **unit.kwargs).compile(compiler_options=_cpu_options())
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    devices = 1
    for a in jax.tree.leaves(unit.args):
        s = getattr(a, "sharding", None)
        if s is not None:
            devices = max(devices, len(s.device_set))
    get = (lambda k: int(getattr(m, k, 0) or 0)) if m is not None else (lambda k: 0)
    args = get("argument_size_in_bytes") or per_device_bytes(unit.args)
    return UnitMemory(unit.stage, unit.name, unit.note, devices, args, get("output_size_in_bytes"),
                      get("temp_size_in_bytes"), get("alias_size_in_bytes"),
                      per_device_bytes(unit.weights) if unit.weights is not None else 0, seconds,
                      {k: v for k, v in comm.items() if v})


def split_unit(stage: str, name: str, split, *args, method: str = "__call__", note: str = "", resident: bool = False,
               **static) -> Unit:
    """The unit of an :class:`vidax.core.nn.Split` model (an encoder) called as
    ``split.<method>(*args, **static)``, its state abstract: the same jitted program a stage runs
    (``resident``: compiled with every weight an argument, used or not -- the whole model stays
    resident while one of its methods runs)."""
    from vidax.core import nn

    fn = jax.jit(nn._apply.__wrapped__, static_argnums=(0, 1, 2), keep_unused=True) if resident else nn._apply
    return Unit(stage, name, fn, (split._graph, method, tuple(sorted(static.items())), split.state, *args),
                note=note, weights=split.state)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
