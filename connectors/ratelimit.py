"""One warning per key per interval, with a count of what was suppressed.

Serving code (the lookup, the writer, the miss diagnosis) warns from the engine's hot
path; a store that goes away or a corpus of corrupt entries would otherwise write a log
line per item per step. Pure Python, shared by every serving-side module.
"""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLog:
    """One warning per key per interval, with a count of what was suppressed."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0):
        self.logger, self.interval = logger, interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e18) < self.interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            n = self._suppressed.pop(key, 0)
            self._last[key] = now
        suffix = f" ({n} similar suppressed)" if n else ""
        self.logger.warning(msg + suffix, *args)
        return True
