"""Circuit breaker: a store that errors is treated as down for a growing backoff.

While the breaker is open every lookup is a miss at once (the engine re-encodes): no
request waits on a dead store and no request retries it. The background index refresh
is the probe: its first success closes the breaker. The backoff doubles from 1 s to
30 s per consecutive failure.
"""

from __future__ import annotations

import threading
import time

MAX_BACKOFF_S = 30.0


class CircuitBreaker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._down_until = 0.0

    def trip(self) -> None:
        """A store error: open the breaker (or keep it open longer)."""
        with self._lock:
            self._backoff = min(MAX_BACKOFF_S, max(1.0, self._backoff * 2))
            self._down_until = time.monotonic() + self._backoff

    def reset(self) -> None:
        """The store answered: close the breaker."""
        with self._lock:
            self._backoff = 0.0
            self._down_until = 0.0

    def is_open(self, now: float | None = None) -> bool:
        """Is the store considered down (every lookup a miss)?"""
        return (time.monotonic() if now is None else now) < self._down_until
