"""``lru``: evict the unreferenced entry whose last access is oldest."""

from __future__ import annotations

from collections import OrderedDict

from .base import Key, Policy

__all__ = ["LRU"]


class LRU(Policy):
    """True LRU: evict the unreferenced entry whose last access is oldest."""

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest access first
        self._pinned: set[Key] = set()

    def insert(self, key, size):
        self._order[key] = None
        self._pinned.add(key)

    def hit(self, key):
        self._order.move_to_end(key)

    def pin(self, key):
        self._pinned.add(key)

    def release(self, key):
        self._pinned.discard(key)

    def evict(self):
        # Pinned entries were accessed recently (their request is in flight), so they sit
        # near the young end; the scan stops at the first unpinned one.
        for key in self._order:
            if key not in self._pinned:
                del self._order[key]
                return key
        raise LookupError("no evictable entry")

    def clear(self):
        self._order.clear()
        self._pinned.clear()
