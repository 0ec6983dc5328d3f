"""The run store: Zarr v3 groups, JSON documents and files under any fsspec URL.

    <root>/runs/<run_id>/request.json        the validated request
    <root>/runs/<run_id>/manifest.json       summary: stages, keys, status, timings, hardware
    <root>/runs/<run_id>/records/<stage>.json completion records (the commit markers)
    <root>/runs/<run_id>/encode.zarr         prompt / negative embeddings
    <root>/runs/<run_id>/sample.zarr         final latents + the newest step checkpoint
    <root>/runs/<run_id>/decode/<k>.zarr     decode stage k: frames + the cache it hands on
    <root>/runs/<run_id>/video.mp4, preview.png

A stage commits by writing its completion record **last**; readers trust only outputs whose record
exists, whose key matches and whose checksums verify.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import tempfile
import uuid
from pathlib import Path

import fsspec
import ml_dtypes
import numpy as np
import zarr


class StoreError(RuntimeError):
    """The store URL cannot be reached or written."""


def _prepare_env(url: str) -> None:
    if url.startswith(("gs://", "gcs://")):
        # gcsfs probes for hierarchical-namespace buckets on every call unless told not to
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def normalize_url(url: str | os.PathLike) -> str:
    url = str(url)
    if "://" not in url:
        return "file://" + str(Path(url).expanduser().resolve())
    return url.rstrip("/")


class RunStore:
    def __init__(self, url: str | os.PathLike):
        self.url = normalize_url(url)
        _prepare_env(self.url)
        protocol = self.url.split("://", 1)[0]
        opts = {"auto_mkdir": True} if protocol == "file" else {}
        if protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
            opts["token"] = "anon"
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **opts)
        except (ImportError, ValueError) as e:
            raise StoreError(f"store {self.url}: {e}") from None
        self.protocol = protocol
        self.local = protocol == "file"

    def __repr__(self):
        return f"RunStore({self.url})"

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, *parts: str) -> str:
        p = self.path(*parts)
        return p if self.local else f"{self.protocol}://{p.removeprefix(self.protocol + '://')}"

    def check_writable(self) -> None:
        """Write and delete a probe object; raise :class:`StoreError` naming the URL on failure."""
        probe = self.path(f".vidax-probe-{uuid.uuid4().hex}")
        try:
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 - any backend error means "not writable"
            raise StoreError(f"cannot write to store {self.url}: {type(e).__name__}: {e}") from None

    def run(self, run_id: str) -> "Run":
        return Run(self, run_id)

    def list_runs(self) -> list[str]:
        base = self.path("runs")
        try:
            entries = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for e in entries:
            name = posixpath.basename(e.rstrip("/"))
            if self.fs.exists(posixpath.join(e, "request.json")):
                out.append(name)
        return sorted(out)


class Run:
    def __init__(self, store: RunStore, run_id: str):
        self.store, self.run_id = store, run_id
        self.base = store.path("runs", run_id)

    def path(self, name: str) -> str:
        return posixpath.join(self.base, name)

    def url(self, name: str = "") -> str:
        return self.store.url_of("runs", self.run_id, name) if name else self.store.url_of("runs", self.run_id)

    @property
    def fs(self):
        return self.store.fs

    # -------------------------------------------------------------- documents
    def exists(self, name: str) -> bool:
        return self.fs.exists(self.path(name))

    def read_json(self, name: str):
        try:
            with self.fs.open(self.path(name), "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    def write_json(self, name: str, obj) -> None:
        data = json.dumps(obj, indent=2, sort_keys=True, default=str).encode()
        self.write_bytes(name, data)

    def write_bytes(self, name: str, data: bytes) -> None:
        path = self.path(name)
        if self.store.local:  # atomic on a file system: write aside, then rename
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:  # object stores make single-object writes atomic
            self.fs.pipe_file(path, data)

    def put_file(self, local_path: str | os.PathLike, name: str) -> None:
        path = self.path(name)
        if self.store.local:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            import shutil

            shutil.copyfile(local_path, tmp)
            os.replace(tmp, path)
        else:
            self.fs.put_file(str(local_path), path)

    def get_file(self, name: str, local_path: str | os.PathLike) -> None:
        self.fs.get_file(self.path(name), str(local_path))

    def delete(self, name: str) -> None:
        path = self.path(name)
        try:
            if self.fs.isdir(path):
                self.fs.rm(path, recursive=True)
            elif self.fs.exists(path):
                self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    # -------------------------------------------------------------- zarr
    def group(self, name: str, mode: str = "r") -> zarr.Group:
        """Open the Zarr group ``name`` (e.g. ``encode.zarr``); mode "w" replaces it."""
        if mode == "w":
            self.delete(name)
        if self.store.local:
            Path(self.path(name)).mkdir(parents=True, exist_ok=True) if mode != "r" else None
            zstore = zarr.storage.LocalStore(self.path(name), read_only=mode == "r")
        else:
            zstore = zarr.storage.FsspecStore.from_url(
                self.url(name), read_only=mode == "r",
                storage_options={"token": "anon"} if self.store.protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST") else None,
            )
        return zarr.open_group(store=zstore, mode="r" if mode == "r" else "a")

    # -------------------------------------------------------------- records
    def record(self, stage: str):
        return self.read_json(f"records/{record_name(stage)}.json")

    def write_record(self, stage: str, rec: dict) -> None:
        self.write_json(f"records/{record_name(stage)}.json", rec)

    def delete_record(self, stage: str) -> None:
        self.delete(f"records/{record_name(stage)}.json")


def record_name(stage: str) -> str:
    return stage.replace("/", "-")


# ------------------------------------------------------------------ arrays
def write_array(group: zarr.Group, name: str, arr: np.ndarray, dims: tuple[str, ...], **attrs) -> str:
    """Write ``arr`` with dimension names and attributes; bfloat16 is stored losslessly as its
    uint16 bits with ``logical_dtype="bfloat16"``. Returns the sha256 of the stored bytes."""
    arr = np.ascontiguousarray(arr)
    logical = str(arr.dtype)
    if arr.dtype == ml_dtypes.bfloat16:
        arr = arr.view(np.uint16)
        logical = "bfloat16"
    if len(dims) != arr.ndim:
        raise ValueError(f"array {name}: {arr.ndim} dims but names {dims}")
    chunks = _chunks(arr)
    a = group.create_array(name, shape=arr.shape, dtype=arr.dtype, chunks=chunks, dimension_names=dims,
                           overwrite=True, fill_value=0)
    a[...] = arr
    a.attrs.update({"logical_dtype": logical, **attrs})
    return checksum(arr)


def _chunks(arr: np.ndarray):
    # one chunk up to ~64 MiB, else split along the leading axes
    shape = list(arr.shape) or [1]
    budget = 64 * 2**20 // max(arr.itemsize, 1)
    chunks = list(shape)
    i = 0
    while int(np.prod(chunks)) > budget and i < len(chunks):
        chunks[i] = max(1, chunks[i] // max(2, int(np.prod(chunks)) // budget + 1))
        if chunks[i] == 1:
            i += 1
    return tuple(chunks) if arr.ndim else None


def read_array(group: zarr.Group, name: str) -> np.ndarray:
    a = group[name]
    data = np.asarray(a[...])
    if a.attrs.get("logical_dtype") == "bfloat16":
        data = data.view(ml_dtypes.bfloat16)
    return data


def checksum(arr: np.ndarray) -> str:
    arr = np.ascontiguousarray(arr)
    if arr.dtype == ml_dtypes.bfloat16:
        arr = arr.view(np.uint16)
    h = hashlib.sha256()
    h.update(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(arr.tobytes())
    return h.hexdigest()


def local_tmpdir() -> str:
    return tempfile.mkdtemp(prefix="vidax-")
