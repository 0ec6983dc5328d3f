"""Process setup every entry point runs before touching a device: join the multi-host job when
the environment says so, and turn on JAX's persistent compilation cache.

- ``VIDAX_COORDINATOR`` / ``VIDAX_NUM_PROCESSES`` / ``VIDAX_PROCESS_ID`` (or
  ``VIDAX_DISTRIBUTED=auto`` on Cloud TPU pods and SLURM): every host of a slice runs the same
  stage as one JAX program (:func:`vidax.core.mesh.init_distributed`).
- ``VIDAX_COMPILE_CACHE``: where compiled programs are kept across processes (default
  ``~/.cache/vidax/jax``; a bucket path such as ``gs://bucket/jax-cache`` or a shared volume lets a
  whole pool reuse them; ``off`` disables it). A stage process then compiles a program only the
  first time any process of the pool sees its shape. ``VIDAX_COMPILE_CACHE_MIN_SECONDS`` (default
  0.5): only programs that took at least this long to compile are kept. ``VIDAX_COMPILE_CACHE_MAX_GB``
  (default 32): a local directory's size bound (least recently used entries go first).
- ``VIDAX_CPU_CONV``: ``xla`` (default) or ``ynnpack``, the kernels a VAE's convs run on over CPU
  (:func:`vidax.core.conv.compiler_options`).
- :func:`collect_own_garbage`: a stage frees what it dropped when it returns, without walking the
  whole heap of a long-lived process, and hands the freed memory back to the system
  (:func:`release_free_memory`).

:func:`setup` checks these settings first: a bad value is a :class:`SettingError` naming the variable.
"""
from __future__ import annotations

import ctypes
import functools
import gc
import os
import threading
from contextlib import contextmanager
from pathlib import Path

_done = False


class SettingError(ValueError):
    """An environment variable vidax reads holds a value it cannot use (the message names it)."""


def _number(name: str, default: str) -> float:
    v = os.environ.get(name, default)
    try:
        x = float(v)
    except ValueError:
        x = -1.0
    if not x >= 0:
        raise SettingError(f"{name}={v!r}: expected a number of at least 0 (default {default})")
    return x


def check_settings() -> None:
    """Every vidax environment setting readable, or a :class:`SettingError` naming the first bad one."""
    _number("VIDAX_COMPILE_CACHE_MAX_GB", "32")
    _number("VIDAX_COMPILE_CACHE_MIN_SECONDS", "0.5")
    v = os.environ.get("VIDAX_CPU_CONV", "xla")
    if v not in ("xla", "ynnpack"):
        raise SettingError(f"VIDAX_CPU_CONV={v!r}: expected 'xla' (the default: XLA's own conv kernels) or 'ynnpack'")


def compile_cache_dir() -> str | None:
    v = os.environ.get("VIDAX_COMPILE_CACHE", "").strip()
    if v.lower() in ("off", "none", "0", "false"):
        return None
    return v or str(Path.home() / ".cache" / "vidax" / "jax")


def setup() -> tuple[int, int]:
    """Idempotent. Returns ``(process_index, process_count)``."""
    global _done

    from vidax.core.mesh import init_distributed

    if not _done:
        check_settings()
        _done = True
        compile_cache()
    return init_distributed()


def compile_cache() -> str | None:
    """Point JAX's persistent compilation cache at :func:`compile_cache_dir` (programs that took
    at least ``VIDAX_COMPILE_CACHE_MIN_SECONDS``, default 0.5, to compile are kept). Call before
    the first compilation; returns the directory, or None when the cache is off."""
    import jax

    d = compile_cache_dir()
    if d is not None:
        if "://" not in d:
            Path(d).mkdir(parents=True, exist_ok=True)
            # A size bound turns on JAX's LRU eviction and with it a file lock around every read and
            # write of the directory: processes sharing it (a worker's flow runs, a test session's
            # workers) never read an entry another one is still writing. VIDAX_COMPILE_CACHE_MAX_GB
            # (default 32).
            gb = _number("VIDAX_COMPILE_CACHE_MAX_GB", "32")
            jax.config.update("jax_compilation_cache_max_size", int(gb * 2**30))
        jax.config.update("jax_compilation_cache_dir", d)
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          _number("VIDAX_COMPILE_CACHE_MIN_SECONDS", "0.5"))
    return d


def is_leader() -> bool:
    """Process 0 of the job: the one that writes arrays, records and leases (all processes compute)."""
    import jax

    return jax.process_index() == 0


_scope_lock = threading.Lock()
_scopes = 0  # work units inside collect_own_garbage() now (a batch may run several in threads)


@contextmanager
def collect_own_garbage():
    """Run a unit of work (a stage) and collect, when it ends, the garbage it made -- not the whole heap.

    What the work drops (its weights, traced programs' temporaries) is freed when it returns even
    where reference cycles hold it, as a full ``gc.collect()`` would; but a full collection walks
    every object of the process, which in a long-lived worker (a Prefect worker, a ``vidax batch``
    of many prompts) costs seconds per call. Objects that existed before the first of the
    concurrent units started are frozen (``gc.freeze``) until the last one ends, so collections
    during and after the work walk only what was allocated since.
    """
    global _scopes
    with _scope_lock:
        if _scopes == 0:
            gc.freeze()
        _scopes += 1
    try:
        yield
    finally:
        with _scope_lock:
            gc.collect()
            _scopes -= 1
            if _scopes == 0:
                gc.unfreeze()
                release_free_memory()


@functools.cache
def _malloc_trim():
    try:  # glibc's; None where the C library has none (macOS, musl)
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """Give the free pages of the C heap back to the system (glibc ``malloc_trim``); whether it could.

    Host arrays below glibc's mmap threshold (128 KB to 32 MB: a VAE's activations on CPU, XLA's
    temporaries, a checkpoint's small tensors) live in the heap, and freeing them keeps their
    pages resident until the heap's top is free: a process keeps its high-water mark into its next
    unit of work (5-8 GB resident after one released-width LTX decode whose models were dropped,
    about 1 GB after a trim). Costs a walk of the heap's free lists: call it where a unit of work
    ends, not per step."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
