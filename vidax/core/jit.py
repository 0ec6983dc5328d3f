"""jit helpers: a compile counter (used by tests and benchmarks to check "jit the unit")."""
from __future__ import annotations

import threading

from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts the XLA programs built while active, whether the backend compiled them or read them
    from the persistent compilation cache (JAX times both under its backend-compile event, the cache
    lookup inside it), so "one compile per shape" reads the same with the cache on or off.
    ``cache_hits`` says how many came from the cache, ``compiled`` how many were compiled::

        with CompileCounter() as cc:
            ...
        assert cc.count == 1
    """

    _lock = threading.Lock()

    def __init__(self):
        self.count = 0  # programs built: compiled + read back from the persistent cache
        self.cache_hits = 0  # of which came from the persistent compilation cache
        self.seconds = 0.0  # time spent building them (compiling, or reading the cache)

    @property
    def compiled(self) -> int:
        """Programs the backend compiled (not found in the persistent cache)."""
        return self.count - self.cache_hits

    def _listener(self, event, duration, **kwargs):
        if event == _BACKEND_COMPILE_EVENT:
            self.count += 1
            self.seconds += duration

    def _event(self, event, **kwargs):
        if event == _CACHE_HIT_EVENT:
            self.cache_hits += 1

    def to_json(self) -> dict:
        return {"programs": self.count, "compiled": self.compiled, "cache_hits": self.cache_hits,
                "compile_seconds": round(self.seconds, 3)}

    def __enter__(self):
        monitoring.register_event_duration_secs_listener(self._listener)
        monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc):
        monitoring.unregister_event_duration_listener(self._listener)
        monitoring.unregister_event_listener(self._event)
        return False


__all__ = ["CompileCounter"]
