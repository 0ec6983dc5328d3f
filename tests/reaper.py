"""Test services that die with the test process that started them.

A pytest-xdist worker killed by a native crash runs no fixture teardown, so the servers it started
(the GCS emulator, a Prefect server and its workers) would outlive it. :func:`dies_with_parent`
wraps a command so that Linux sends it SIGKILL when its parent exits (``PR_SET_PDEATHSIG``, set in
the child just before it execs the command: it survives ``execve``).
"""
from __future__ import annotations

import os
import sys

_PRELUDE = ("import ctypes, os, sys; ctypes.CDLL(None, use_errno=True).prctl(1, 9); "  # PR_SET_PDEATHSIG, SIGKILL
            "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


def dies_with_parent(argv: list[str]) -> list[str]:
    """``argv`` run so that it is killed when this process exits (on Linux; elsewhere unchanged)."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-c", _PRELUDE, str(os.getpid()), *map(str, argv)]
