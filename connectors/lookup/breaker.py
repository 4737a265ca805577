"""Circuit breaker: a store that errors is treated as down for a growing backoff.

While the breaker is open every lookup is a miss at once (the engine re-encodes): no
request waits on a dead store and no request retries it. The background index refresh
is the probe: its first success closes the breaker. The backoff doubles from 1 s to
30 s per consecutive failure.

A store whose parts fail apart (``supports_failure_domains``: a Redis Cluster's
primaries) trips the breaker of one part (a *domain*): only the lookups of entries that
part serves are misses, the others still load. Each domain backs off on its own; the
lookup's background thread probes the open ones (``Store.probe_domain``) and closes each
that answers.
"""

from __future__ import annotations

import threading
import time

MAX_BACKOFF_S = 30.0


class _State:
    __slots__ = ("backoff", "down_until")

    def __init__(self) -> None:
        self.backoff = 0.0
        self.down_until = 0.0

    def trip(self) -> None:
        self.backoff = min(MAX_BACKOFF_S, max(1.0, self.backoff * 2))
        self.down_until = time.monotonic() + self.backoff


class CircuitBreaker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._store = _State()
        #: domain -> its state, for the domains tripped since they last answered (read
        #: without the lock: the dict is replaced whole when a domain comes or goes; a
        #: state's backoff changes in place)
        self._domains: dict[str, _State] = {}

    def trip(self, domain: str | None = None) -> None:
        """A store error: open the breaker (or keep it open longer): the store's, or
        only ``domain``'s (the part of the store the error concerns)."""
        with self._lock:
            if domain is None:
                self._store.trip()
                return
            state = self._domains.get(domain)
            if state is None:  # a new domain: readers see the old dict or the new one
                state = _State()
                self._domains = {**self._domains, domain: state}
            state.trip()

    def reset(self, domain: str | None = None) -> None:
        """The store answered: close the breaker (the store's; or ``domain``'s, which
        then backs off from 1 s again)."""
        with self._lock:
            if domain is None:
                self._store = _State()
            elif domain in self._domains:
                domains = dict(self._domains)
                del domains[domain]
                self._domains = domains

    def is_open(self, now: float | None = None, domain: str | None = None) -> bool:
        """Is the store considered down (every lookup a miss), or the part ``domain``?"""
        now = time.monotonic() if now is None else now
        if now < self._store.down_until:
            return True
        state = self._domains.get(domain) if domain is not None else None
        return state is not None and now < state.down_until

    def open_domains(self, now: float | None = None) -> int:
        """How many domains are within their own backoff (whatever the store's state)."""
        now = time.monotonic() if now is None else now
        return sum(now < state.down_until for state in self._domains.values())

    def has_tripped_domains(self) -> bool:
        return bool(self._domains)

    def tripped_domains(self) -> list[str]:
        """The domains tripped and not closed since (open or backed off): to probe."""
        return list(self._domains)
