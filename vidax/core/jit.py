"""jit helpers: a compile counter (used by tests and benchmarks to check "jit the unit")."""
from __future__ import annotations

import threading

from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts the XLA programs built while active: backend compilations plus programs taken from
    the persistent compilation cache (a cache hit is still a program the code asked to build, so
    "one compile per shape" reads the same with the cache on or off)::

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

    def _event(self, event, **kwargs):
        if event == _CACHE_HIT_EVENT:
            self.count += 1

    def __enter__(self):
        monitoring.register_event_duration_secs_listener(self._listener)
        monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._listener)
        monitoring.unregister_event_listener(self._event)
        return False


__all__ = ["CompileCounter"]
