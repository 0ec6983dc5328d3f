"""Conditioning images: read from a path or any fsspec URL, and pick a generation size."""
from __future__ import annotations

import hashlib
import logging
import math
import posixpath
import warnings

import numpy as np

log = logging.getLogger("vidax.stages")


class ImageError(ValueError):
    """An image that cannot be read or decoded; the message names it."""


def read_bytes(url: str) -> bytes:
    from vidax.weights.source import filesystem  # the fsspec settings checkpoint sources use

    fs, path = filesystem(str(url))
    return fs.cat_file(path)


def decode_image(data: bytes, name: str = "image") -> np.ndarray:
    """uint8 RGB [H, W, 3] from the bytes of any image format imageio (Pillow and its other plugins)
    reads; the first frame of an animation. Fully decoded: a truncated or corrupt file is an
    :class:`ImageError` naming ``name``. As the reference's image loading does, alpha is composited
    on white; the EXIF orientation is applied as diffusers' ``load_image`` does."""
    import imageio.v3 as iio
    from imageio.plugins.pillow import PillowPlugin

    ext = posixpath.splitext(name.split("?", 1)[0])[1].lower() or None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # imageio's legacy plugins, tried on unknown data
            with iio.imopen(data, "r", extension=ext) as f:
                kw = {}
                if isinstance(f, PillowPlugin):
                    kw["rotate"] = True
                    meta = f.metadata(index=0, exclude_applied=False)
                    if meta.get("mode") == "P" and "transparency" in meta:
                        kw["mode"] = "RGBA"  # keep a palette's transparent entry (imageio would apply it as RGB)
                arr = np.asarray(f.read(index=0, **kw))
    except Exception as e:  # noqa: BLE001 - every decoder has its own errors
        raise ImageError(f"{name}: cannot read it as an image ({type(e).__name__}: {e})") from None
    try:
        return _to_rgb_uint8(arr)
    except ValueError as e:
        raise ImageError(f"{name}: {e}") from None


def _to_rgb_uint8(a: np.ndarray) -> np.ndarray:
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 2, 3, 4) or 0 in a.shape:
        raise ValueError(f"unsupported image layout {a.shape} (expected [H, W] or [H, W, 1-4 channels])")
    if a.dtype == np.bool_:
        a = a.astype(np.uint8) * 255
    elif np.issubdtype(a.dtype, np.integer) and a.dtype != np.uint8:
        a = np.round(np.clip(a.astype(np.float64), 0, None) * (255.0 / np.iinfo(a.dtype).max)).astype(np.uint8)
    elif np.issubdtype(a.dtype, np.floating):  # float formats (TIFF, EXR): [0, 1]
        a = np.round(np.clip(a.astype(np.float64), 0.0, 1.0) * 255.0).astype(np.uint8)
    c = a.shape[-1]
    color = a[..., :3] if c >= 3 else np.repeat(a[..., :1], 3, axis=-1)
    if c in (2, 4):  # alpha over white
        alpha = a[..., -1:].astype(np.uint32)
        color = ((color.astype(np.uint32) * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    return np.ascontiguousarray(color, dtype=np.uint8)


def load_image(url: str) -> np.ndarray:
    """uint8 RGB [H, W, 3] from a path or any fsspec URL (see :func:`decode_image`)."""
    try:
        data = read_bytes(url)
    except Exception as e:  # noqa: BLE001 - missing file, unreachable store
        raise ImageError(f"{url}: cannot read ({type(e).__name__}: {e})") from None
    return decode_image(data, url)


def image_size(url: str) -> tuple[int, int]:
    """(height, width) of the decoded image: the whole file is decoded, so a truncated or corrupt
    image fails here, at validation, naming the file."""
    h, w, _ = load_image(url).shape
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
