"""Checkpoint views: a checkpoint's tensors under other names (the conversions of original releases),
with tensors derived on the host when read (a split fused projection, a reordered modulation)."""
from __future__ import annotations

import numpy as np

from .io import LazyTensor, _box


class Derived:
    """A tensor computed on the host from other checkpoint tensors when it is read (a split of a
    fused projection, a reordered modulation): ``shape`` known up front, data on ``__array__``."""

    def __init__(self, name: str, shape, fn, *sources):
        self.name, self.shape, self.fn, self.sources = name, tuple(shape), fn, sources

    def __array__(self, dtype=None, copy=None):
        arrs = [s.read() if isinstance(s, LazyTensor) else np.asarray(s) for s in self.sources]
        a = np.asarray(self.fn(*arrs))
        if tuple(a.shape) != self.shape:
            raise ValueError(f"{self.name}: derived shape {a.shape}, expected {self.shape}")
        return a if dtype is None else a.astype(dtype)


class Window:
    """A box of another checkpoint tensor (one part of a fused projection), read lazily: a read of
    ``index`` reads only the matching box of the source (a safetensors slice), so a device that
    holds a shard of the part never reads the whole fused tensor. ``starts``: the box's offset in
    the source per dimension; ``shape``: its size."""

    def __init__(self, name: str, source, starts, shape):
        self.name, self.source = name, source
        self.starts, self.shape = tuple(int(s) for s in starts), tuple(int(d) for d in shape)
        self.dtype = getattr(source, "dtype", None)

    def read(self, index=None) -> np.ndarray:
        plan = _box(index if index is not None else (), self.shape)
        if plan is None:
            return self.read()[index]
        box, rest = plan
        src = tuple(slice(o + b.start, o + b.stop) for o, b in zip(self.starts, box))
        src += (slice(None),) * (len(getattr(self.source, "shape", ())) - len(src))
        part = self.source.read(index=src) if callable(getattr(self.source, "read", None)) else np.asarray(self.source)[src]
        return np.asarray(part[rest])

    def __array__(self, dtype=None, copy=None):
        a = self.read()
        return a if dtype is None else a.astype(dtype)


def window(name: str, source, axis: int, start: int, stop: int) -> Window:
    """Rows (``axis=0``) or columns (``axis=1``) ``[start, stop)`` of ``source`` as a :class:`Window`."""
    shape = list(source.shape)
    starts = [0] * len(shape)
    starts[axis], shape[axis] = start, stop - start
    return Window(name, source, starts, shape)


class View(dict):
    """A checkpoint (name -> tensor) view; ``source`` names it in errors."""

    def __init__(self, items, source):
        super().__init__(items)
        self.source = source


def view_of(items, ckpt) -> View:
    """``items`` as a view named after the checkpoint ``ckpt`` it was made from."""
    return View(items, getattr(ckpt, "source", "checkpoint"))
