"""Checkpoint sources: a local path, or any fsspec URL (``gs://bucket/Wan2.1-T2V-1.3B``, ``s3://``,
``https://``, ``memory://`` ...) fetched once into a local content-addressed cache.

A remote folder is listed; the key of its cache entry is a hash of every object's relative path,
size and content checksum (GCS md5 / crc32c, an S3 or HTTP ETag, else the filesystem's own
``ukey``) — never the URL alone: a changed object gives a new entry, and the same files under two
URLs share one. An entry is downloaded into a hidden folder beside it, each file checked against
its listed size (and md5 where the store gives one), and only then renamed into place, so a
partial download never looks complete; the rename is the commit.

    <cache>/checkpoints/<key>/...       the snapshot (a folder, or a folder holding the one file)
    <cache>/checkpoints/<key>.json      what it was fetched from (informational)

``<cache>`` is ``$VIDAX_CACHE``, else ``~/.cache/vidax``.
"""
from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

_CHECKSUM_FIELDS = ("md5Hash", "crc32c", "ETag", "etag", "checksum")


def is_url(source) -> bool:
    """Whether ``source`` names a remote (non-local) fsspec location. ``file://`` is local."""
    s = str(source)
    return "://" in s and not s.startswith(("file://", "local://"))


def local_path(source) -> Path:
    """A local source as a path (``file://`` stripped, ``~`` expanded)."""
    s = str(source)
    for scheme in ("file://", "local://"):
        s = s.removeprefix(scheme)
    return Path(s).expanduser()


def cache_dir() -> Path:
    return Path(os.environ.get("VIDAX_CACHE") or Path.home() / ".cache" / "vidax").expanduser()


def filesystem(url: str):
    """``(fs, path)`` for a URL; on GCS it skips gcsfs' per-call bucket-type probe, and talks to
    ``$STORAGE_EMULATOR_HOST`` anonymously when one is set."""
    import fsspec

    opts = {}
    if url.startswith(("gs://", "gcs://")):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            opts["token"] = "anon"
    return fsspec.core.url_to_fs(url, **opts)


@dataclass(frozen=True)
class FetchProgress:
    """One progress report of a fetch: the file being fetched and the byte counts so far."""

    url: str
    file: str  # relative path
    file_done: int
    file_size: int
    files_done: int  # completed files
    files: int
    done: int  # bytes, all files
    total: int


class PrintProgress:
    """The default reporter: a line on stderr when a fetch starts and as each file completes."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.t0 = None

    def __call__(self, p: FetchProgress) -> None:
        if self.t0 is None:
            self.t0 = time.perf_counter()
            print(f"vidax: fetching {p.url} ({p.files} files, {_human(p.total)})", file=self.stream, flush=True)
        if p.file_done == p.file_size:
            rate = p.done / max(time.perf_counter() - self.t0, 1e-6)
            print(f"  [{p.files_done}/{p.files}] {p.file} ({_human(p.file_size)}); "
                  f"{_human(p.done)} of {_human(p.total)}, {_human(rate)}/s", file=self.stream, flush=True)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass(frozen=True)
class RemoteFile:
    rel: str  # path relative to the source, "/"-separated
    path: str  # the filesystem's own path
    size: int
    checksum: str  # "<kind>:<value>"


def _checksum(fs, path: str, info: dict) -> str:
    for k in _CHECKSUM_FIELDS:
        v = info.get(k)
        if v:
            return f"{k}:{v}"
    return f"ukey:{fs.ukey(path)}"


def list_source(url: str) -> tuple[str, list[RemoteFile]]:
    """``("folder" | "file", files)`` of a remote source, from one listing (no data read).
    Raises FileNotFoundError when nothing is there."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    fs.invalidate_cache(root)  # listed fresh every time: a long-lived process sees changed objects
    found = fs.find(root, detail=True)
    if root in found or (not found and fs.isfile(root)):  # ``find`` of a file gives the file itself
        kind = "file"
        items = [(root.rsplit("/", 1)[-1], root, fs.info(root))]
    elif found:
        kind = "folder"
        items = [(p[len(root) + 1:], p, i) for p, i in found.items() if i.get("type") != "directory"]
    else:
        raise FileNotFoundError(f"{url}: no such file or folder")
    files = [RemoteFile(rel, p, int(i.get("size") or 0), _checksum(fs, p, i)) for rel, p, i in items if rel]
    return kind, sorted(files, key=lambda f: f.rel)


def check_source(source) -> str:
    """``"folder"`` or ``"file"`` for a local path or a URL (a listing, nothing downloaded);
    FileNotFoundError when there is nothing."""
    if is_url(source):
        kind, files = list_source(str(source))
        if kind == "folder" and not files:
            raise FileNotFoundError(f"{source}: an empty folder")
        return kind
    p = local_path(source)
    if p.is_dir():
        return "folder"
    if p.exists():
        return "file"
    raise FileNotFoundError(f"{source}: no such file or folder")


def snapshot_key(files: Iterable[RemoteFile]) -> str:
    """The content key of a set of remote files: relative paths, sizes and checksums."""
    doc = [[f.rel, f.size, f.checksum] for f in sorted(files, key=lambda f: f.rel)]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:32]


def resolve_source(source, *, include: Iterable[str] | None = None,
                   progress: Callable[[FetchProgress], None] | None = None, cache: str | os.PathLike | None = None
                   ) -> Path:
    """A local path for ``source``: a local path as it is (``file://`` stripped); a URL fetched once
    into the content-addressed cache (see the module docstring) and its cached copy returned — the
    folder, or for a URL naming one file, that file.

    ``include``: ``fnmatch`` patterns on the "/"-separated relative paths; only matching files are
    fetched (a snapshot of its own, e.g. the configs alone). ``progress``: called with a
    :class:`FetchProgress` as bytes arrive (default: :class:`PrintProgress` on stderr; nothing is
    reported when the cache already holds the files). ``cache``: default :func:`cache_dir`."""
    if not is_url(source):
        return local_path(source)
    url = str(source).rstrip("/")
    kind, files = list_source(url)
    if include is not None and kind == "folder":
        pats = list(include)
        files = [f for f in files if any(fnmatch.fnmatch(f.rel, p) for p in pats)]
    key = snapshot_key(files)
    base = Path(cache) if cache is not None else cache_dir()
    final = base / "checkpoints" / key
    if not final.is_dir():
        _fetch(url, files, base / "checkpoints", key, progress if progress is not None else PrintProgress())
    return final / files[0].rel if kind == "file" else final


def _fetch(url: str, files: list[RemoteFile], root: Path, key: str, progress) -> None:
    """Download ``files`` into ``root/.partial-<key>-<uuid>/``, check them, then rename the folder to
    ``root/<key>`` (if another process finished first, keep theirs)."""
    from fsspec.callbacks import Callback

    fs, _ = filesystem(url)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".partial-{key}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    total = sum(f.size for f in files)
    state = {"done": 0}

    class _Report(Callback):
        def __init__(self, i: int, f: RemoteFile):
            super().__init__()
            self.i, self.f, self.base, self.last = i, f, state["done"], 0

        def call(self, *args, **kwargs):
            n = min(int(self.value or 0), self.f.size)
            if n != self.last and n < self.f.size:
                self.last = n
                progress(FetchProgress(url, self.f.rel, n, self.f.size, self.i, len(files), self.base + n, total))

    try:
        for i, f in enumerate(files):
            dst = tmp / f.rel
            if not dst.resolve().is_relative_to(tmp.resolve()):
                raise ValueError(f"{url}: object name {f.rel!r} leaves the folder")
            dst.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f.path, str(dst), callback=_Report(i, f))
            _verify(url, f, dst)
            state["done"] += f.size
            progress(FetchProgress(url, f.rel, f.size, f.size, i + 1, len(files), state["done"], total))
        (root / f"{key}.json").write_text(json.dumps(
            {"url": url, "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "files": [[f.rel, f.size, f.checksum] for f in files]}, indent=1))
        try:
            tmp.rename(root / key)
        except OSError:
            if not (root / key).is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process committed the same snapshot first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _verify(url: str, f: RemoteFile, dst: Path) -> None:
    size = dst.stat().st_size
    if size != f.size:
        raise OSError(f"{url}/{f.rel}: fetched {size} bytes, the listing says {f.size}")
    if f.checksum.startswith("md5Hash:"):
        h = hashlib.md5()
        with open(dst, "rb") as fh:
            for chunk in iter(lambda: fh.read(16 << 20), b""):
                h.update(chunk)
        if base64.b64encode(h.digest()).decode() != f.checksum.split(":", 1)[1]:
            raise OSError(f"{url}/{f.rel}: md5 of the fetched bytes differs from the store's")
