"""jit helpers: a compile counter (used by tests and benchmarks to check "jit the unit")."""
from __future__ import annotations

import threading

from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts XLA backend compilations while active::

        with CompileCounter() as cc:
            ...
        assert cc.count == 1
    """

    _lock = threading.Lock()

    def __init__(self):
        self.count = 0
        self.seconds = 0.0

    def _listener(self, event, duration, **kwargs):
        if event == _BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def __enter__(self):
        monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._listener)
        return False


__all__ = ["CompileCounter"]
