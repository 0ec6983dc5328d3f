"""Patch geometry shared by the DiTs: the token grid of a latent video, patchify / unpatchify
between channels-last latents ``[B, F, H, W, C]`` and patch tokens ``[B, f*h*w, D]``.

A family names the order of the features inside one patch token with ``order``, a permutation of
``"thwc"`` (patch time, height, width, channels): Wan and HunyuanVideo's patch embedding reads
``"thwc"``, Cosmos's and LTX's ``"cthw"``; the same order undoes it in :func:`unpatchify`.
"""
from __future__ import annotations

import math


def token_grid(fhw, patch) -> tuple:
    """``(F, H, W)`` latent frames/height/width -> the ``(f, h, w)`` token grid of a
    ``(pt, ph, pw)`` patch (a ValueError names a size the patch does not divide)."""
    f, h, w = (int(v) for v in fhw)
    pt, ph, pw = patch
    if f % pt or h % ph or w % pw:
        raise ValueError(f"latent shape (F={f}, H={h}, W={w}) is not divisible by the patch size {tuple(patch)}")
    return f // pt, h // ph, w // pw


def patchify(x, patch, order: str = "thwc"):
    """``[B, F, H, W, C]`` -> tokens ``[B, f*h*w, pt*ph*pw*C]`` (features in ``order``) and the grid."""
    b, c = x.shape[0], x.shape[-1]
    f, h, w = token_grid(x.shape[1:4], patch)
    pt, ph, pw = patch
    pos = {"t": 2, "h": 4, "w": 6, "c": 7}
    x = x.reshape(b, f, pt, h, ph, w, pw, c).transpose(0, 1, 3, 5, *(pos[k] for k in order))
    return x.reshape(b, f * h * w, pt * ph * pw * c), (f, h, w)


def unpatchify(y, grid, patch, order: str = "thwc"):
    """Tokens ``[B, f*h*w, pt*ph*pw*C]`` (features in ``order``) -> ``[B, F, H, W, C]``."""
    b = y.shape[0]
    f, h, w = grid
    size = dict(zip("thw", patch))
    size["c"] = y.shape[-1] // math.prod(patch)
    y = y.reshape(b, f, h, w, *(size[k] for k in order))
    at = {k: 4 + i for i, k in enumerate(order)}
    y = y.transpose(0, 1, at["t"], 2, at["h"], 3, at["w"], at["c"])
    return y.reshape(b, f * size["t"], h * size["h"], w * size["w"], size["c"])


__all__ = ["patchify", "token_grid", "unpatchify"]
