"""Content fingerprints of checkpoint files: what enters every stage key.

Never modification times or paths: two copies of one checkpoint (two hosts, two folders) give the
same fingerprint, and a changed tensor gives another. Cheap on multi-GB files:

- ``.safetensors``: the header (every tensor's name, dtype, shape and byte range) + the file size
  + a sample of the data (first and last MiB);
- zip archives (``.pth``): every member's name, size and CRC-32 from the central directory;
- anything else (configs, tokenizers): the bytes themselves (files up to 64 MiB), else size +
  first and last MiB.
"""
from __future__ import annotations

import hashlib
import os
import struct
import zipfile
from pathlib import Path

_SMALL = 64 * 2**20
_EDGE = 2**20


def _edges(f, size: int, h) -> None:
    f.seek(0)
    h.update(f.read(min(size, _EDGE)))
    if size > _EDGE:
        f.seek(max(_EDGE, size - _EDGE))
        h.update(f.read(_EDGE))


def file_fingerprint(path: str | os.PathLike) -> str:
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(f"size={size};".encode())
    with open(p, "rb") as f:
        if p.suffix == ".safetensors" and size >= 8:
            (n,) = struct.unpack("<Q", f.read(8))
            if 0 < n <= size - 8:
                h.update(b"safetensors;")
                h.update(f.read(n))
                _edges(f, size, h)
                return h.hexdigest()
        if zipfile.is_zipfile(f) and size > _SMALL:
            with zipfile.ZipFile(f) as z:
                h.update(b"zip;")
                for info in z.infolist():
                    h.update(f"{info.filename}:{info.file_size}:{info.CRC};".encode())
            return h.hexdigest()
        f.seek(0)
        if size <= _SMALL:
            h.update(f.read())
        else:
            _edges(f, size, h)
    return h.hexdigest()


def files_fingerprint(folder: str | os.PathLike, patterns) -> str:
    """Content fingerprint of the files under ``folder`` matching ``patterns`` (globs; a matching
    folder contributes every file below it), by relative path."""
    folder = Path(folder)
    h = hashlib.sha256()
    seen = set()
    for pat in patterns:
        for p in sorted(folder.glob(pat)):
            for f in sorted([p] if p.is_file() else p.rglob("*")):
                if f.is_file() and f not in seen:
                    seen.add(f)
                    h.update(f"{f.relative_to(folder).as_posix()}={file_fingerprint(f)};".encode())
    return h.hexdigest()[:16]
