"""The run store: Zarr v3 groups, JSON documents and files under any fsspec URL.

    <root>/runs/<run_id>/request.json          the validated request
    <root>/runs/<run_id>/manifest.json         summary: stages, keys, status, timings, hardware
    <root>/runs/<run_id>/records/<stage>.json  completion records (the commit markers)
    <root>/runs/<run_id>/leases/<stage>.json   who is computing a stage, until when
    <root>/runs/<run_id>/encode.zarr           conditioning tensors
    <root>/runs/<run_id>/sample.zarr           final latents
    <root>/runs/<run_id>/checkpoints/<step>.zarr + <step>.json   sampling checkpoints + their markers
    <root>/runs/<run_id>/decode/<k>.zarr       decode stage k: its outputs + the packed carry it hands on
    <root>/runs/<run_id>/video.mp4, preview.png

A stage commits by writing its completion record **last**. The record holds, for every output,
a **content digest** (every byte that gives the data its meaning: values, dtype, shape, dimension
names, attributes) and, for every object written, the object store's own **signature** (size +
CRC32C/MD5/generation on GCS, size + modification time on a file system). Checking that a stage is
intact compares one listing with the record — no data is read; a consumer checks the content
digest of what it actually reads.

Every array is one object (Zarr's sharding codec when it has several chunks); state read on an
object store is always fresh (no listing or size cache), so a long-lived worker sees what other
processes wrote. Each :class:`RunStore` counts its requests and bytes (:class:`IOCounter`).
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import posixpath
import random
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import fsspec
import ml_dtypes
import numpy as np
import zarr
from zarr.storage import WrapperStore


class StoreError(RuntimeError):
    """The store URL cannot be reached or written."""


class CorruptDocument(ValueError):
    """A JSON document of the run store exists but cannot be parsed."""


class TransientStoreError(StoreError):
    """A storage request kept failing with a transient error (timeouts, 429/5xx, resets)."""


# ------------------------------------------------------------------ transient errors
def is_transient(exc: BaseException | None) -> bool:
    """Storage hiccups worth retrying: connection errors, timeouts, HTTP 429 and 5xx."""
    if exc is None:
        return False
    if isinstance(exc, (TransientStoreError, ConnectionError, TimeoutError)):
        return True
    code = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(code, int) and (code in (408, 429) or 500 <= code < 600):
        return True
    name = type(exc).__name__
    if name in ("ClientConnectionError", "ServerDisconnectedError", "ClientOSError", "ClientPayloadError",
                "ServerTimeoutError", "RetryError", "TransientError"):
        return True
    return is_transient(exc.__cause__) if exc.__cause__ is not None and exc.__cause__ is not exc else False


#: the storage libraries whose own error logging (with tracebacks) vidax replaces by one line
STORAGE_LOGGERS = ("gcsfs", "aiohttp", "fsspec", "s3fs", "adlfs", "google.auth", "urllib3")


class _DemoteToDebug(logging.Filter):
    """Turns a storage library's warnings and errors (gcsfs logs every exhausted retry with its
    aiohttp traceback) into debug records: vidax reports the failure itself, in one line naming the
    request and its attempts (:class:`TransientStoreError`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


_DEMOTE = _DemoteToDebug()


def quiet_storage_loggers(quiet: bool = True) -> None:
    """Demote (``quiet``) or restore the storage libraries' log records (:data:`STORAGE_LOGGERS`);
    what the command line and the flows run (``--debug`` keeps them)."""
    for name in STORAGE_LOGGERS:
        lg = logging.getLogger(name)
        if quiet:
            lg.addFilter(_DEMOTE)  # (a set: adding twice keeps one)
        else:
            lg.removeFilter(_DEMOTE)


#: transient-error retries: attempts and the first backoff (doubling, with jitter); env-overridable
RETRY_ATTEMPTS = int(os.environ.get("VIDAX_STORAGE_RETRIES", "6"))
RETRY_BASE_S = float(os.environ.get("VIDAX_STORAGE_BACKOFF", "0.25"))
#: how long a new lease on an object store settles before it is read back (see ``_confirm_lease``)
LEASE_CONFIRM_S = float(os.environ.get("VIDAX_LEASE_CONFIRM_SECONDS", "0.2"))


def retry(fn, *args, attempts: int | None = None, base: float | None = None, what: str = "storage request", **kw):
    """``fn(*args, **kw)``, retried with exponential backoff (and jitter) on transient errors;
    other errors propagate at once. After ``attempts`` transient failures: TransientStoreError."""
    attempts = RETRY_ATTEMPTS if attempts is None else attempts
    base = RETRY_BASE_S if base is None else base
    for i in range(attempts):
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                raise
            if i == attempts - 1:
                raise TransientStoreError(f"{what} kept failing after {attempts} attempts: {type(e).__name__}: {e}") from e
            time.sleep(base * 2 ** i * (0.5 + random.random()))


# ------------------------------------------------------------------ traffic
class IOCounter:
    """Requests and bytes moved through a store (documents, files and Zarr objects)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = self.bytes_read = self.bytes_written = 0

    def add(self, requests: int = 1, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_read += read
            self.bytes_written += written

    def snapshot(self) -> dict:
        with self._lock:
            return {"requests": self.requests, "bytes_read": self.bytes_read, "bytes_written": self.bytes_written}

    @staticmethod
    def delta(before: dict, after: dict) -> dict:
        return {k: after[k] - before[k] for k in after}


class CountingStore(WrapperStore):
    """A Zarr store that counts requests and bytes into an :class:`IOCounter` and retries
    transient errors."""

    def __init__(self, store, counter: IOCounter):
        super().__init__(store)
        self.counter = counter

    def _with_store(self, store):
        return type(self)(store, self.counter)

    def _where(self, key: str) -> str:
        """``key`` with the store's root (the object a failing request was for)."""
        root = str(getattr(self._store, "path", "") or "").rstrip("/")
        return f"{root}/{key}" if root else key

    async def _retry(self, coro_fn, what):
        import asyncio

        for i in range(RETRY_ATTEMPTS):
            try:
                return await coro_fn()
            except Exception as e:  # noqa: BLE001
                if not is_transient(e) or i == RETRY_ATTEMPTS - 1:
                    if is_transient(e):
                        raise TransientStoreError(f"{what} kept failing after {i + 1} attempts: "
                                                  f"{type(e).__name__}: {e}") from e
                    raise
                await asyncio.sleep(RETRY_BASE_S * 2 ** i * (0.5 + random.random()))

    async def get(self, key, prototype, byte_range=None):
        buf = await self._retry(lambda: self._store.get(key, prototype, byte_range), f"read {self._where(key)}")
        self.counter.add(read=len(buf) if buf is not None else 0)
        return buf

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        out = await self._retry(lambda: self._store.get_partial_values(prototype, key_ranges), "partial read")
        self.counter.add(requests=len(key_ranges), read=sum(len(b) for b in out if b is not None))
        return out

    async def set(self, key, value):
        await self._retry(lambda: self._store.set(key, value), f"write {self._where(key)}")
        self.counter.add(written=len(value))

    async def exists(self, key):
        self.counter.add()
        return await self._retry(lambda: self._store.exists(key), f"exists {self._where(key)}")

    async def delete(self, key):
        self.counter.add()
        return await self._retry(lambda: self._store.delete(key), f"delete {self._where(key)}")

    async def getsize(self, key):
        self.counter.add()
        return await self._store.getsize(key)

    async def list(self):
        self.counter.add()
        async for k in self._store.list():
            yield k

    async def list_prefix(self, prefix):
        self.counter.add()
        async for k in self._store.list_prefix(prefix):
            yield k

    async def list_dir(self, prefix):
        self.counter.add()
        async for k in self._store.list_dir(prefix):
            yield k


# ------------------------------------------------------------------ stores
def _prepare_env(url: str) -> None:
    if url.startswith(("gs://", "gcs://")):
        # gcsfs probes for hierarchical-namespace buckets on every call unless told not to
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


def normalize_url(url: str | os.PathLike) -> str:
    url = str(url)
    if "://" not in url:
        return "file://" + str(Path(url).expanduser().resolve())
    return url.rstrip("/")


def _fs_options(protocol: str) -> dict:
    if protocol == "file":
        return {"auto_mkdir": True}
    opts = {"use_listings_cache": False, "skip_instance_cache": True}  # always fresh run state
    if protocol in ("gs", "gcs"):
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            opts["token"] = "anon"
    return opts


@functools.lru_cache(maxsize=None)
def _gcs_class(attempts: int):
    """gcsfs with ``attempts`` tries per HTTP request. gcsfs fixes its own retries (6, backing off
    1+2+4+8+16 s) when the class is defined, and ignores a ``retries=`` argument; with our
    :func:`retry` around every operation that made an unreachable bucket cost minutes. Here
    gcsfs keeps its retry logic, with fewer attempts (``VIDAX_GCS_RETRIES``, default 2)."""
    import gcsfs
    from gcsfs.retry import retry_request

    base = gcsfs.GCSFileSystem
    return type("GCSFileSystem", (base,), {
        "_request": retry_request(retries=attempts)(base._request.__wrapped__),
        "__module__": __name__,
    })


def _url_to_fs(url: str, **options):
    """``fsspec.core.url_to_fs``, with our gcsfs for ``gs://`` (see :func:`_gcs_class`)."""
    protocol = url.split("://", 1)[0]
    if protocol in ("gs", "gcs"):
        fs = _gcs_class(max(1, int(os.environ.get("VIDAX_GCS_RETRIES", "2"))))(**options)
        return fs, fs._strip_protocol(url)
    return fsspec.core.url_to_fs(url, **options)


def _close_async_session(fs) -> None:
    """Close an asynchronous filesystem's HTTP session on Zarr's event loop, where it was opened
    (left to garbage collection it is closed on another loop, with a traceback at exit)."""
    session = getattr(fs, "_session", None)
    if session is None or session.closed:
        return
    try:
        from zarr.core.sync import sync

        sync(session.close())
    except Exception:  # noqa: BLE001 - best effort at interpreter exit
        pass


class RunStore:
    def __init__(self, url: str | os.PathLike):
        if not str(url).strip():
            raise StoreError("the store URL is empty")
        raw = str(url).strip()
        if "://" in raw:
            protocol, rest = raw.split("://", 1)
            if protocol != "file" and protocol != "memory" and not rest.split("/", 1)[0]:
                raise StoreError(f"store {raw}: no bucket named (e.g. {protocol}://my-bucket/vidax)")
        self.url = normalize_url(raw)
        _prepare_env(self.url)
        protocol = self.url.split("://", 1)[0]
        try:
            self.fs, self.root = _url_to_fs(self.url, **_fs_options(protocol))
        except (ImportError, ValueError) as e:
            raise StoreError(f"store {self.url}: {e}") from None
        self.protocol = protocol
        self.local = protocol == "file"
        self.counter = IOCounter()
        self._afs = None  # one asynchronous filesystem for every Zarr group of this store

    def __repr__(self):
        return f"RunStore({self.url})"

    def path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_of(self, *parts: str) -> str:
        p = self.path(*parts)
        return p if self.local else f"{self.protocol}://{p.removeprefix(self.protocol + '://')}"

    def async_fs(self):
        """The asynchronous twin of :attr:`fs` that Zarr reads through (created once)."""
        if self._afs is None:
            from zarr.core.sync import _get_loop

            self._afs, _ = _url_to_fs(self.url, asynchronous=True, loop=_get_loop(),
                                      **_fs_options(self.protocol))
            atexit.register(_close_async_session, self._afs)
        return self._afs

    def check_writable(self) -> None:
        """Write and delete a probe object; raise :class:`StoreError` naming the URL on failure."""
        probe = self.path(f".vidax-probe-{uuid.uuid4().hex}")
        try:
            retry(self.fs.pipe_file, probe, b"ok", attempts=3, what=f"write to {self.url}")
            self.fs.rm_file(probe)
        except Exception as e:  # noqa: BLE001 - any backend error means "not writable"
            msg = str(e).splitlines()[0] if str(e) else ""
            raise StoreError(f"cannot write to store {self.url}: {type(e).__name__}: {msg}") from None

    def run(self, run_id: str) -> "Run":
        return Run(self, run_id)

    def list_runs(self) -> list[str]:
        base = self.path("runs")
        try:
            entries = retry(self.fs.find, base, maxdepth=2, withdirs=False)
        except FileNotFoundError:
            return []
        self.counter.add()
        out = set()
        for e in entries:
            rel = posixpath.relpath(e, base)
            parts = rel.split("/")
            if len(parts) == 2 and parts[1] == "request.json":
                out.add(parts[0])
        return sorted(out)


@dataclass
class Lease:
    stage: str
    owner: str
    expires: float
    host: str = ""
    pid: int = 0

    def live(self) -> bool:
        """Unexpired, and (when held on this machine) its process still exists; a lease of this
        very process counts only while the stage it guards is computing (a release that failed,
        say on a cut network, does not block the next attempt of a long-lived worker)."""
        if self.expires <= time.time():
            return False
        if self.host == _host() and self.pid == os.getpid():
            return self.owner in _HELD
        if self.host == _host() and self.pid:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
        return True


class FollowerWrite(StoreError):
    """A process other than 0 of a multi-host job tried to change the run store."""


def _leader_only(what: str) -> None:
    """On a multi-host slice every process runs the stage but only process 0 changes the store
    (arrays are written once; records, manifests, checkpoints and leases by process 0)."""
    from vidax.core.mesh import is_leader, process_index

    if not is_leader():
        raise FollowerWrite(f"process {process_index()} of a multi-host job tried to {what}; only process 0 "
                            "writes to the run store")


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

    @property
    def counter(self) -> IOCounter:
        return self.store.counter

    # -------------------------------------------------------------- documents and files
    def exists(self, name: str) -> bool:
        self.counter.add()
        return retry(self.fs.exists, self.path(name))

    def read_bytes(self, name: str) -> bytes | None:
        try:
            data = retry(self.fs.cat_file, self.path(name), what=f"read {name}")
        except FileNotFoundError:
            self.counter.add()
            return None
        self.counter.add(read=len(data))
        return data

    def read_json(self, name: str):
        """The parsed document, None if absent; :class:`CorruptDocument` if unreadable."""
        data = self.read_bytes(name)
        if data is None:
            return None
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptDocument(f"{self.url(name)} is not valid JSON ({e})") from None

    def write_json(self, name: str, obj) -> None:
        self.write_bytes(name, json.dumps(obj, indent=2, sort_keys=True, default=str).encode())

    def write_bytes(self, name: str, data: bytes) -> None:
        _leader_only(f"write {name}")
        path = self.path(name)
        self.counter.add(written=len(data))
        if self.store.local:  # atomic on a file system: write aside, then rename
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        else:  # object stores make single-object writes atomic
            retry(self.fs.pipe_file, path, data, what=f"write {name}")

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create ``name`` only if it does not exist (an if-not-exists precondition on object
        stores, ``O_EXCL`` on file systems). True if this call created it."""
        _leader_only(f"create {name}")
        path = self.path(name)
        self.counter.add(written=len(data))
        if self.store.local:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        try:
            retry(self.fs.pipe_file, path, data, mode="create", what=f"create {name}")
            return True
        except FileExistsError:
            return False
        except Exception as e:  # noqa: BLE001 - 412 Precondition Failed
            if getattr(e, "code", None) == 412 or "412" in str(e) or "precondition" in str(e).lower():
                return False
            raise

    def put_file(self, local_path: str | os.PathLike, name: str) -> None:
        _leader_only(f"upload {name}")
        path = self.path(name)
        self.counter.add(written=os.path.getsize(local_path))
        if self.store.local:
            import shutil

            Path(path).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{path}.{uuid.uuid4().hex}.tmp"
            shutil.copyfile(local_path, tmp)
            os.replace(tmp, path)
        else:
            retry(self.fs.put_file, str(local_path), path, what=f"upload {name}")

    def get_file(self, name: str, local_path: str | os.PathLike) -> None:
        retry(self.fs.get_file, self.path(name), str(local_path), what=f"download {name}")
        self.counter.add(read=os.path.getsize(local_path))

    def delete(self, name: str) -> None:
        _leader_only(f"delete {name}")
        path = self.path(name)
        self.counter.add()
        try:
            if self.store.local:
                p = Path(path)
                if p.is_dir():
                    import shutil

                    shutil.rmtree(p, ignore_errors=True)
                elif p.exists():
                    p.unlink(missing_ok=True)
                return
            try:
                retry(self.fs.rm, path, recursive=True, what=f"delete {name}")
            except FileNotFoundError:
                pass
        except FileNotFoundError:
            pass

    # -------------------------------------------------------------- object signatures
    def objects(self, *names: str) -> dict[str, str]:
        """``{relative path: signature}`` of every object under ``names`` (folders or files),
        from one listing each: size + the store's checksum (CRC32C / MD5 / generation on GCS,
        size + mtime on a file system). No data is read."""
        out = {}
        for name in names:
            root = self.path(name)
            self.counter.add()
            if self.store.local:
                p = Path(root)
                files = [p] if p.is_file() else (sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [])
                for f in files:
                    if f.name.endswith(".tmp"):
                        continue
                    st = f.stat()
                    out[posixpath.relpath(f.as_posix(), self.base)] = f"size={st.st_size};mtime={st.st_mtime_ns}"
                continue
            try:
                found = retry(self.fs.find, root, detail=True, what=f"list {name}")
            except FileNotFoundError:
                continue
            for path, info in sorted(found.items()):
                if info.get("type") == "directory":
                    continue
                sig = [f"size={info.get('size')}"]
                for k in ("crc32c", "md5Hash", "generation", "ETag", "etag"):
                    if info.get(k) is not None:
                        sig.append(f"{k}={info[k]}")
                out[posixpath.relpath(path, self.base)] = ";".join(sig)
        return out

    # -------------------------------------------------------------- zarr
    def zstore(self, name: str, read_only: bool = True):
        if self.store.local:
            if not read_only:
                Path(self.path(name)).mkdir(parents=True, exist_ok=True)
            inner = zarr.storage.LocalStore(self.path(name), read_only=read_only)
        else:
            inner = zarr.storage.FsspecStore(fs=self.store.async_fs(), path=self.path(name), read_only=read_only)
        return CountingStore(inner, self.counter)

    def group(self, name: str, mode: str = "r") -> zarr.Group:
        """Open the Zarr group ``name`` (e.g. ``encode.zarr``) for reading (one metadata read:
        groups are written with consolidated metadata). Mode "a" opens it for changes in place
        (tests); stages write whole groups through :meth:`writer`."""
        zs = self.zstore(name, read_only=mode == "r")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=UserWarning)
            return zarr.open_group(store=zs, mode="r" if mode == "r" else "a", zarr_format=3)

    def writer(self, name: str) -> "GroupWriter":
        """A new Zarr group ``name``, built in memory and uploaded whole by ``flush()`` (replacing
        whatever was there): one request per object, no reads, no listings."""
        return GroupWriter(self, name)

    def put_objects(self, name: str, objects: dict[str, bytes]) -> None:
        """Write the objects ``{relative key: bytes}`` under ``name`` (concurrently on object stores)."""
        _leader_only(f"write {name}")
        self.counter.add(requests=len(objects), written=sum(len(v) for v in objects.values()))
        if self.store.local:
            for k, v in objects.items():
                p = Path(self.path(posixpath.join(name, k)))
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(v)
            return
        retry(self.fs.pipe, {self.path(posixpath.join(name, k)): v for k, v in objects.items()},
              what=f"write {name}")

    # -------------------------------------------------------------- records
    def record(self, stage: str):
        """The stage's completion record; None if absent; :class:`CorruptDocument` if unreadable."""
        return self.read_json(f"records/{record_name(stage)}.json")

    def write_record(self, stage: str, rec: dict) -> None:
        self.write_json(f"records/{record_name(stage)}.json", rec)

    def delete_record(self, stage: str) -> None:
        self.delete(f"records/{record_name(stage)}.json")

    # -------------------------------------------------------------- leases
    def lease(self, stage: str) -> Lease | None:
        try:
            d = self.read_json(f"leases/{record_name(stage)}.json")
        except CorruptDocument:
            return Lease(stage, "?", 0.0)  # unreadable: as good as expired
        if not d:
            return None
        try:
            return Lease(stage, str(d.get("owner")), float(d.get("expires", 0)), str(d.get("host", "")),
                         int(d.get("pid", 0)))
        except (TypeError, ValueError):
            return Lease(stage, "?", 0.0)

    def acquire_lease(self, stage: str, owner: str, seconds: float) -> bool:
        """Take the stage's lease if nobody holds a live one (an expired lease is taken over)."""
        name = f"leases/{record_name(stage)}.json"
        doc = json.dumps({"owner": owner, "expires": time.time() + seconds, "host": _host(), "pid": os.getpid()}).encode()
        cur = self.lease(stage)  # (stores without preconditions would let the create below overwrite it)
        if cur is not None and cur.live() and cur.owner != owner:
            return False
        if self.create_exclusive(name, doc):
            return self._confirm_lease(stage, owner)
        cur = self.lease(stage)
        if cur is not None and cur.live() and cur.owner != owner:
            return False
        # expired (or ours, or vanished): take it over, then confirm nobody else did the same
        self.delete(name)
        if not self.create_exclusive(name, doc):
            return False
        return self._confirm_lease(stage, owner)

    def _confirm_lease(self, stage: str, owner: str) -> bool:
        # object stores without precondition support (emulators) let two creators both succeed:
        # the last write wins, so read back after a moment and yield if it is not ours
        if not self.store.local:
            time.sleep(LEASE_CONFIRM_S)
        cur = self.lease(stage)
        if cur is not None and cur.owner == owner:
            _HELD.add(owner)
            return True
        return False

    def renew_lease(self, stage: str, owner: str, seconds: float) -> None:
        cur = self.lease(stage)
        if cur is not None and cur.owner == owner:
            self.write_json(f"leases/{record_name(stage)}.json",
                            {"owner": owner, "expires": time.time() + seconds, "host": _host(), "pid": os.getpid()})

    def release_lease(self, stage: str, owner: str) -> None:
        _HELD.discard(owner)  # even if the delete below fails, this process no longer holds it
        cur = self.lease(stage)
        if cur is not None and cur.owner == owner:
            self.delete(f"leases/{record_name(stage)}.json")


class GroupWriter:
    """Arrays of one stage output group, assembled in a memory store with consolidated metadata,
    then uploaded in one batch (see :meth:`Run.writer`)."""

    def __init__(self, run: Run, name: str):
        self.run, self.name = run, name
        self._objects: dict = {}
        self.group = zarr.open_group(store=zarr.storage.MemoryStore(store_dict=self._objects), mode="w",
                                     zarr_format=3)

    def array(self, name: str, arr: np.ndarray, dims: tuple[str, ...], **attrs) -> str:
        return write_array(self.group, name, arr, dims, **attrs)

    def flush(self) -> None:
        """Upload the group (process 0 of a multi-host job; the others computed the same arrays and
        write nothing)."""
        from vidax.core.mesh import is_leader

        if not is_leader():
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=UserWarning)  # consolidated metadata is a v3 extension
            zarr.consolidate_metadata(self.group.store)
        objects = {k: v.to_bytes() for k, v in self._objects.items()}
        self.run.delete(self.name)
        self.run.put_objects(self.name, objects)


#: owners of the leases this process holds now (see :meth:`Lease.live`)
_HELD: set[str] = set()


def _host() -> str:
    import socket

    return socket.gethostname()


def record_name(stage: str) -> str:
    return stage.replace("/", "-")


# ------------------------------------------------------------------ arrays
def content_digest(arr: np.ndarray, dims=(), attrs: dict | None = None) -> str:
    """sha256 over everything that gives stored data its meaning: dtype, shape, dimension
    names, attributes and the values."""
    arr = np.ascontiguousarray(arr)
    logical = "bfloat16" if arr.dtype == ml_dtypes.bfloat16 else str(arr.dtype)
    if arr.dtype == ml_dtypes.bfloat16:
        arr = arr.view(np.uint16)
    meta = {"dtype": logical, "stored": arr.dtype.str, "shape": list(arr.shape), "dims": list(dims or ()),
            "attrs": {k: v for k, v in (attrs or {}).items() if k != "logical_dtype"}}
    h = hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode())
    h.update(arr.tobytes())
    return h.hexdigest()


def write_array(group: zarr.Group, name: str, arr: np.ndarray, dims: tuple[str, ...], **attrs) -> str:
    """Write ``arr`` with dimension names and attributes as one object (Zarr's sharding codec
    when it has several chunks); bfloat16 is stored losslessly as its uint16 bits with
    ``logical_dtype="bfloat16"``. Returns its :func:`content_digest`."""
    arr = np.ascontiguousarray(arr)
    attrs = json.loads(json.dumps(attrs, default=_plain))  # exactly what the store will hold
    digest = content_digest(arr, dims, attrs)
    logical = str(arr.dtype)
    if arr.dtype == ml_dtypes.bfloat16:
        arr = arr.view(np.uint16)
        logical = "bfloat16"
    if len(dims) != arr.ndim:
        raise ValueError(f"array {name}: {arr.ndim} dims but names {dims}")
    chunks = _chunks(arr)
    kw = {}
    if arr.ndim and chunks != arr.shape:
        kw["shards"] = arr.shape  # one object, several inner chunks
    a = group.create_array(name, shape=arr.shape, dtype=arr.dtype, chunks=chunks if arr.ndim else None,
                           dimension_names=dims, overwrite=True, fill_value=0,
                           attributes={"logical_dtype": logical, **attrs}, **kw)
    a[...] = arr
    return digest


def _plain(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    return str(v)


def _chunks(arr: np.ndarray):
    # inner chunks up to ~64 MiB, split along the leading axes
    shape = list(arr.shape) or [1]
    budget = 64 * 2**20 // max(arr.itemsize, 1)
    chunks = list(shape)
    i = 0
    while int(np.prod(chunks)) > budget and i < len(chunks):
        chunks[i] = max(1, chunks[i] // max(2, int(np.prod(chunks)) // budget + 1))
        if chunks[i] == 1:
            i += 1
    return tuple(chunks)


class DigestMismatch(ValueError):
    """Stored data does not match the digest its record holds."""


def read_array(group: zarr.Group, name: str, digest: str | None = None) -> np.ndarray:
    """Read an array (bfloat16 restored from its bits). With ``digest``: check the content
    digest (values, dtype, shape, dimension names, attributes) and raise :class:`DigestMismatch`."""
    a = group[name]
    attrs = dict(a.attrs)
    logical = attrs.get("logical_dtype")
    data = np.asarray(a[...])
    if logical == "bfloat16":
        data = data.view(ml_dtypes.bfloat16)
    elif logical is not None and logical != str(data.dtype):
        raise DigestMismatch(f"{name}: stored as {data.dtype} but its logical dtype says {logical}")
    if digest is not None:
        dims = tuple(a.metadata.dimension_names or ())
        if logical is None:
            raise DigestMismatch(f"{name}: the logical_dtype attribute is missing")
        got = content_digest(data, dims, attrs)
        if got != digest:
            raise DigestMismatch(f"{name}: content digest {got[:12]} does not match the committed {digest[:12]}")
    return data


# ------------------------------------------------------------------ packed state (decode carry)
def pack(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, list]:
    """Many small arrays -> one flat array per dtype group (here: one array of float32 or the
    arrays' common dtype) + an index ``[[name, dtype, shape, offset], ...]``."""
    if not arrays:
        return np.zeros((0,), np.float32), []
    dtypes = {np.asarray(v).dtype for v in arrays.values()}
    common = dtypes.pop() if len(dtypes) == 1 else np.dtype(np.float32)
    flat, index, off = [], [], 0
    for n in sorted(arrays):
        v = np.asarray(arrays[n])
        index.append([n, str(v.dtype), list(v.shape), off])
        flat.append(v.astype(common, copy=False).reshape(-1))
        off += v.size
    return np.concatenate(flat), index


def unpack(flat: np.ndarray, index: list) -> dict[str, np.ndarray]:
    out = {}
    for n, dt, shape, off in index:
        size = int(np.prod(shape)) if shape else 1
        dt = ml_dtypes.bfloat16 if dt == "bfloat16" else np.dtype(dt)
        out[n] = flat[off:off + size].astype(dt, copy=False).reshape(shape)
    return out


def local_tmpdir() -> str:
    return tempfile.mkdtemp(prefix="vidax-")
