"""Process setup every entry point runs before touching a device: join the multi-host job when
the environment says so, and turn on JAX's persistent compilation cache.

- ``VIDAX_COORDINATOR`` / ``VIDAX_NUM_PROCESSES`` / ``VIDAX_PROCESS_ID`` (or
  ``VIDAX_DISTRIBUTED=auto`` on Cloud TPU pods and SLURM): every host of a slice runs the same
  stage as one JAX program (:func:`vidax.core.mesh.init_distributed`).
- ``VIDAX_COMPILE_CACHE``: where compiled programs are kept across processes (default
  ``~/.cache/vidax/jax``; a bucket path such as ``gs://bucket/jax-cache`` or a shared volume lets a
  whole pool reuse them; ``off`` disables it). A stage process then compiles a program only the
  first time any process of the pool sees its shape.
"""
from __future__ import annotations

import os
from pathlib import Path

_done = False


def compile_cache_dir() -> str | None:
    v = os.environ.get("VIDAX_COMPILE_CACHE", "").strip()
    if v.lower() in ("off", "none", "0", "false"):
        return None
    return v or str(Path.home() / ".cache" / "vidax" / "jax")


def setup() -> tuple[int, int]:
    """Idempotent. Returns ``(process_index, process_count)``."""
    global _done
    import jax

    from vidax.core.mesh import init_distributed

    if not _done:
        _done = True
        d = compile_cache_dir()
        if d is not None:
            if "://" not in d:
                Path(d).mkdir(parents=True, exist_ok=True)
            jax.config.update("jax_compilation_cache_dir", d)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return init_distributed()


def is_leader() -> bool:
    """Process 0 of the job: the one that writes arrays, records and leases (all processes compute)."""
    import jax

    return jax.process_index() == 0
