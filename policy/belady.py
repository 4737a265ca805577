"""``belady``: Belady's MIN, the offline reference -- evict the entry re-used furthest away."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .base import Key, Policy

__all__ = ["Belady"]


class Belady(Policy):
    """Belady's MIN: evict the unreferenced entry whose next access is furthest away.

    ``accesses`` must be the exact key sequence of the caller's ``hit``/``insert`` calls.
    Exactly optimal for unit-size entries (also with pinning: pinned sets do not depend on
    the policy); with variable sizes it is the standard offline reference but not a proof
    of optimality (the variable-size problem is NP-hard) -- ``simulate.space_time_bound``
    gives a true upper bound for that case.
    """

    name = "belady"
    needs_future = True

    def __init__(self, capacity: int, accesses: Sequence[Key]):
        super().__init__(capacity)
        n = len(accesses)
        nxt = [n + 1] * n
        last: dict[Key, int] = {}
        for i in range(n - 1, -1, -1):
            k = accesses[i]
            nxt[i] = last.get(k, n + 1 + i)  # never again: further than anything (by age)
            last[k] = i
        self._keys = accesses
        self._next_use = nxt
        self.clear()

    def clear(self):
        self._pos = 0
        self._next: dict[Key, int] = {}
        self._pinned: set[Key] = set()
        self._heap: list[tuple[int, Key]] = []

    def _advance(self, key):
        pos = self._pos
        if pos >= len(self._keys) or self._keys[pos] != key:
            raise RuntimeError(f"access #{pos} ({key!r}) does not match the future trace")
        self._next[key] = self._next_use[pos]
        self._pos = pos + 1

    def insert(self, key, size):
        self._advance(key)
        self._pinned.add(key)

    def hit(self, key):
        self._advance(key)

    def pin(self, key):
        self._pinned.add(key)

    def release(self, key):
        self._pinned.discard(key)
        heapq.heappush(self._heap, (-self._next[key], key))

    def evict(self):
        heap, pinned, nxt = self._heap, self._pinned, self._next
        while heap:
            neg, key = heapq.heappop(heap)
            if key in pinned or nxt.get(key) != -neg:
                continue
            del nxt[key]
            return key
        raise LookupError("no evictable entry")
