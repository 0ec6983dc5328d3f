"""Spatial tiling of video VAEs on the host: the references' linear cross-fade of overlapping tiles,
the blend of a grid of tiles, tiled application of a function, and the devices/mesh tiles spread over."""
from __future__ import annotations

from functools import lru_cache

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

#: the mesh axis the tiles of one tiled-decode step are spread over
TILE_AXIS = "tiles"
#: a batch of tiles split over the tile mesh (one tile per device); the weights whole on every device
TILE_SPEC, WHOLE_SPEC = P(TILE_AXIS), P()


def blend(a, b, extent: int, axis: int):
    """The references' ``blend_v`` / ``blend_h`` / ``blend_t``: the first ``extent`` entries of ``b``
    along ``axis`` cross-fade linearly from the last ``extent`` of ``a`` (numpy, on a copy of ``b``;
    the extent shrinks to fit both, weights too)."""
    n = min(a.shape[axis], b.shape[axis], extent)
    if n <= 0:
        return b
    w = (np.arange(n, dtype=np.float32) / n).reshape([-1 if d == axis % b.ndim else 1 for d in range(b.ndim)])
    b = b.copy()
    idx_b = [slice(None)] * b.ndim
    idx_a = [slice(None)] * a.ndim
    idx_b[axis], idx_a[axis] = slice(0, n), slice(a.shape[axis] - n, a.shape[axis])
    b[tuple(idx_b)] = a[tuple(idx_a)] * (1.0 - w) + b[tuple(idx_b)] * w
    return b


def blend_grid(rows: list[list], extent: int, keep: int, axes: tuple[int, int]):
    """Join a grid of overlapping tiles (``rows`` of tiles, row-major) as the references' tiled
    decode/encode do: each tile cross-fades from its upper neighbour over ``extent`` along
    ``axes[0]``, then from its left one along ``axes[1]`` (in place: a later tile reads its
    neighbours already blended, so ``rows`` is updated), is cropped to its first ``keep`` entries on
    both axes, and the crops are concatenated. Not cropped to the frame: the caller does that."""
    ay, ax = axes
    out_rows = []
    for i, row in enumerate(rows):
        parts = []
        for j, t in enumerate(row):
            t = np.asarray(t)
            if i > 0:
                t = blend(rows[i - 1][j], t, extent, ay)
            if j > 0:
                t = blend(row[j - 1], t, extent, ax)
            row[j] = t
            crop = [slice(None)] * t.ndim
            crop[ay] = crop[ax] = slice(0, keep)
            parts.append(t[tuple(crop)])
        out_rows.append(np.concatenate(parts, axis=ax))
    return np.concatenate(out_rows, axis=ay)


def spatial_tiled(fn, x, tile: int, stride: int, out_tile: int, out_stride: int, out_h: int, out_w: int):
    """``fn`` over overlapping spatial tiles of a channels-last video ``x`` [B, T, H, W, C]: tiles of
    ``tile`` every ``stride`` (input units) through ``fn``, joined by :func:`blend_grid` over
    ``out_tile - out_stride`` (output units), cropped to ``(out_h, out_w)``."""
    h, w = x.shape[2], x.shape[3]
    rows = [[np.asarray(fn(x[:, :, i:i + tile, j:j + tile])) for j in range(0, w, stride)] for i in range(0, h, stride)]
    return blend_grid(rows, out_tile - out_stride, out_stride, (2, 3))[:, :, :out_h, :out_w]


def split_even(seq: list, k: int) -> list[list]:
    """``seq`` cut into ``k`` consecutive runs of near-equal length."""
    bounds = [round(i * len(seq) / k) for i in range(k + 1)]
    return [seq[bounds[i]:bounds[i + 1]] for i in range(k)]


def tile_devices(devices=None) -> list:
    """The devices a tiled decode spreads its tiles over. ``None``: this process's devices (the
    decode slice's local chips; each host of a multi-host slice decodes the stage's tiles on its
    own); an int: the first that many of them; or a list of devices."""
    local = jax.local_devices()
    if devices is None:
        return list(local)
    if isinstance(devices, int):
        if not 1 <= devices <= len(local):
            raise ValueError(f"devices={devices}: between 1 and the {len(local)} local device(s)")
        return list(local[:devices])
    devices = list(devices)
    if not devices:
        raise ValueError("devices: an empty list")
    return devices


@lru_cache(maxsize=None)
def tile_mesh(devices: tuple):
    """A one-axis (:data:`TILE_AXIS`) mesh over ``devices``."""
    from jax.sharding import Mesh

    return Mesh(np.array(devices, dtype=object), (TILE_AXIS,))


def tile_shardings(mesh) -> tuple[NamedSharding, NamedSharding]:
    """``(spread, whole)`` on a :func:`tile_mesh`: a tile batch one tile per device, the weights everywhere."""
    return NamedSharding(mesh, TILE_SPEC), NamedSharding(mesh, WHOLE_SPEC)
