"""The tests' child processes (CLI runs killed on purpose, racing writers, Prefect servers, workers
and their flow runs, the GCS emulator): their environment and their lifetime.

- One persistent compilation cache per test session (``VIDAX_TEST_COMPILE_CACHE``, made once by
  the controlling process before pytest-xdist starts its workers, removed at the end) is the
  default ``VIDAX_COMPILE_CACHE`` of the workers and of every child: a program is compiled only the
  first time any process of the session sees it. ``VIDAX_COMPILE_CACHE=off make test`` turns it off.
  Likewise one ``VIDAX_CACHE`` per session (``VIDAX_TEST_CACHE``): the tests never write the user's.
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
os.environ.setdefault("VIDAX_COMPILE_CACHE", COMPILE_CACHE)
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
