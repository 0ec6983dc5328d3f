"""Checkpoint views: a checkpoint's tensors under other names (the conversions of original releases),
with tensors derived on the host when read (a split fused projection, a reordered modulation)."""
from __future__ import annotations

import numpy as np

from .io import LazyTensor


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


class View(dict):
    """A checkpoint (name -> tensor) view; ``source`` names it in errors."""

    def __init__(self, items, source):
        super().__init__(items)
        self.source = source


def view_of(items, ckpt) -> View:
    """``items`` as a view named after the checkpoint ``ckpt`` it was made from."""
    return View(items, getattr(ckpt, "source", "checkpoint"))
