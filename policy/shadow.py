"""Shadow caches: metadata-only caches that tell dlfu which half-life pays on live traffic.

One :class:`Shadow` per half-life level replays the (spatially sampled) access stream and
evicts by that level's score; :class:`~encache.policy.dlfu.DecayedLFU` compares their hits
to pick its active level.
"""

from __future__ import annotations

import heapq

from .base import Key

__all__ = ["Shadow"]


class Shadow:
    """A metadata-only cache that evicts by one ladder level's score (no pinning; a new
    key with the lowest score is simply not kept).  Used to measure, on the live stream,
    how many hits another half-life would have produced.

    Its heap holds ``(score, seq, key)``; scores only grow between rebases, so an entry
    whose key has a higher score now is re-pushed when popped (lazy increase-key)."""

    __slots__ = ("j", "cap", "used", "res", "heap", "seq")

    def __init__(self, j: int, cap: float):
        self.j, self.cap, self.used = j, cap, 0
        self.res: dict[Key, int] = {}
        self.heap: list[tuple[float, int, Key]] = []
        self.seq = 0

    def rebuild(self, hist: dict) -> None:
        j = self.j
        self.heap = [(hist[k][j], i, k) for i, k in enumerate(self.res)]
        heapq.heapify(self.heap)
        self.seq = len(self.heap)

    def downsample(self, mask: int, sample: dict, hist: dict) -> None:
        """Keep only keys in the halved sample (``hash & mask == 0``); halve capacity."""
        self.res = {k: s for k, s in self.res.items() if not (sample[k] & mask)}
        self.used = sum(self.res.values())
        self.cap /= 2
        self.rebuild(hist)

    def miss(self, key, size, hist) -> bool:
        """Insert ``key`` (not resident) and evict down to capacity; returns False."""
        res = self.res
        j = self.j
        res[key] = size
        self.used += size
        heap = self.heap
        self.seq += 1
        heapq.heappush(heap, (hist[key][j], self.seq, key))
        while self.used > self.cap and heap:
            prio, _, k = heapq.heappop(heap)
            if k not in res:
                continue
            cur = hist[k][j]
            if cur != prio:
                self.seq += 1
                heapq.heappush(heap, (cur, self.seq, k))
                continue
            self.used -= res.pop(k)
        return False

    def access(self, key, size, hist) -> bool:
        """Return True on a hit; on a miss insert and evict down to capacity."""
        return key in self.res or self.miss(key, size, hist)
