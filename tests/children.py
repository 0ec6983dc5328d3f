"""The tests' child processes (CLI runs killed on purpose, racing writers, Prefect servers, workers
and their flow runs, the GCS emulator): their environment and their lifetime.

- JAX's persistent compilation cache is off for the workers and every child by default. Shared
  by the whole session it saved no time (the same tests with it and without: 261 against 263 s of
  CPU, 2026-12-03: at the tests' optimisation level compiling costs about as much as the cache's
  writes and reads), and every native crash of a test worker with a recorded stack was inside its
  write (XLA:CPU's ``executable.serialize()``, jaxlib 0.10.2; twice in one ``make test-all``).
  ``VIDAX_TEST_SHARED_COMPILE_CACHE=1`` turns it on: one cache per session
  (``VIDAX_TEST_COMPILE_CACHE``, made by the controlling process before pytest-xdist starts its
  workers, removed at the end) as every process's ``VIDAX_COMPILE_CACHE``. Tests of the cache itself
  (``tests/test_compile_once.py``) give their processes a cache of their own.
  One ``VIDAX_CACHE`` per session (``VIDAX_TEST_CACHE``): the tests never write the user's.
- :data:`ENV`: this environment, unbuffered, for the children.
- :func:`dies_with_parent`: a pytest-xdist worker killed by a native crash runs no fixture
  teardown, so the servers it started would outlive it. The wrapped command gets SIGKILL when its
  parent exits (``PR_SET_PDEATHSIG``, set in the child just before it execs the command: it
  survives ``execve``).
"""
from __future__ import annotations

import os
import sys
import tempfile

MADE_CACHE = "VIDAX_TEST_COMPILE_CACHE" not in os.environ  # this process made it (and removes it at the end)
if MADE_CACHE:
    os.environ["VIDAX_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="vidax-test-jax-")
    # and vidax's own cache (``$VIDAX_CACHE``: fetched checkpoints, code digests), not the user's
    os.environ["VIDAX_TEST_CACHE"] = tempfile.mkdtemp(prefix="vidax-test-cache-")
COMPILE_CACHE = os.environ["VIDAX_TEST_COMPILE_CACHE"]
SHARED_COMPILE_CACHE = os.environ.get("VIDAX_TEST_SHARED_COMPILE_CACHE", "").strip() not in ("", "0", "false", "off")
os.environ.setdefault("VIDAX_COMPILE_CACHE", COMPILE_CACHE if SHARED_COMPILE_CACHE else "off")
VIDAX_CACHE = os.environ.get("VIDAX_TEST_CACHE", "")
if VIDAX_CACHE:
    os.environ.setdefault("VIDAX_CACHE", VIDAX_CACHE)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

_PRELUDE = ("import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(1, 9); "  # PR_SET_PDEATHSIG, SIGKILL
            "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


def dies_with_parent(argv: list) -> list[str]:
    """``argv`` run so that it is killed when this process exits (on Linux; elsewhere unchanged)."""
    if not sys.platform.startswith("linux"):
        return [str(a) for a in argv]
    return [sys.executable, "-c", _PRELUDE, str(os.getpid()), *map(str, argv)]
