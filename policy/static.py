"""``static``: the offline static oracle -- the best *fixed* ranking, by true popularity."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .base import Key, Policy, ReleaseHeap

__all__ = ["StaticOracle"]


class StaticOracle(ReleaseHeap, Policy):
    """Offline static oracle: the best *fixed* ranking, by true popularity.

    Evicts the unreferenced entry with the lowest ``weight * cost(size) / size`` (with the
    default cost exponent 1: the lowest weight), ties broken oldest-release first.  In
    steady state it keeps the top-C items by true frequency -- the classic IRM benchmark
    for online policies -- while still paying compulsory misses.

    ``weights`` is the true popularity (the generator's ``RagWorkload.popularity``).  For a
    replayed trace, whose true popularity is unknown, pass ``accesses`` instead: the
    realised whole-trace counts are used, a *hindsight* ranking that also exploits the
    trace's sampling noise and is therefore a stronger (less attainable) reference.
    """

    name = "static"
    needs_future = True

    def __init__(self, capacity: int, accesses: Sequence[Key] | None = None,
                 weights: dict | None = None, cost_exponent: float = 1.0):
        super().__init__(capacity)
        if weights is None:
            if accesses is None:
                raise ValueError("static oracle needs weights or accesses")
            counts: dict[Key, float] = {}
            for k in accesses:
                counts[k] = counts.get(k, 0) + 1
            weights = counts
        self.source = "popularity" if accesses is None else "hindsight-counts"
        self._counts = weights
        self.cost_exponent = cost_exponent
        self.clear()

    def describe(self):
        return {"policy": self.name, "ranking": self.source}

    def clear(self):
        self._heap: list[tuple[float, int, Key]] = []
        self._pinned: set[Key] = set()
        self._size: dict[Key, int] = {}
        self._seq = 0

    def _prio(self, key):
        c = float(self._counts.get(key, 0))
        if self.cost_exponent != 1.0:
            c *= self._size[key] ** (self.cost_exponent - 1.0)
        return c

    def insert(self, key, size):
        self._size[key] = size
        self._pinned.add(key)

    def hit(self, key):
        pass


    def evict(self):
        heap, pinned = self._heap, self._pinned
        while heap:
            _, _, key = heapq.heappop(heap)
            if key in pinned or key not in self._size:
                continue
            del self._size[key]
            return key
        raise LookupError("no evictable entry")
