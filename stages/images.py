"""Conditioning images: read from a path or any fsspec URL, and pick a generation size."""
from __future__ import annotations

import hashlib
import io
import logging
import math

import fsspec
import numpy as np

log = logging.getLogger("vidax.stages")


def read_bytes(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def load_image(url: str) -> np.ndarray:
    """uint8 RGB [H, W, 3] (alpha composited on white, as the reference's image loading does)."""
    import PIL.Image

    im = PIL.Image.open(io.BytesIO(read_bytes(url)))
    im.load()
    if im.mode in ("RGBA", "LA", "P"):
        im = im.convert("RGBA")
        bg = PIL.Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = PIL.Image.alpha_composite(bg, im)
    return np.asarray(im.convert("RGB"), np.uint8)


def image_size(url: str) -> tuple[int, int]:
    import PIL.Image

    with PIL.Image.open(io.BytesIO(read_bytes(url))) as im:
        w, h = im.size
    return h, w


def image_digest(url: str) -> str:
    return hashlib.sha256(read_bytes(url)).hexdigest()[:20]


def fit_size_for(ih: int, iw: int, area: int, multiple: int, sp: int = 1) -> tuple[int, int]:
    """(height, width): multiples of ``multiple`` (the VAE factor x the DiT patch), about ``area``
    pixels, the image's aspect ratio, and a per-frame token count ``(h/multiple) * (w/multiple)``
    divisible by the sequence-parallel degree ``sp``. Logged."""
    ar = ih / iw
    h0 = max(multiple, round(math.sqrt(area * ar)) // multiple * multiple)
    w0 = max(multiple, round(math.sqrt(area / ar)) // multiple * multiple)
    best = None
    for dh in range(-4, 5):
        for dw in range(-4, 5):
            h, w = h0 + dh * multiple, w0 + dw * multiple
            if h < multiple or w < multiple:
                continue
            tokens = (h // multiple) * (w // multiple)  # multiple = VAE factor x patch: one token per cell
            if sp > 1 and tokens % sp:
                continue
            err = abs(math.log((h / w) / ar)) + abs(math.log(h * w / area))
            if best is None or err < best[0]:
                best = (err, h, w)
    if best is None:
        raise ValueError(f"no size near {w0}x{h0} gives a token count divisible by sp={sp}")
    _, h, w = best
    log.info("image %dx%d -> generation size %dx%d (about %d px, multiple of %d, tokens divisible by sp=%d)",
             iw, ih, w, h, area, multiple, sp)
    return int(h), int(w)
