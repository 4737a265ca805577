"""The policy interface: what a cache core calls, and the pinning helper policies share.

What: pure-Python replacement policies (no vLLM import) behind one small interface, so the
trace simulator (:mod:`encache.policy.simulate`) and the vLLM manager
(``encache.connectors.vllm.manager``) run exactly the same decision code.

Why the interface looks like this: vLLM's ``EncoderCacheManager`` is a *demand* cache with
reference counts.  Every item a scheduled request needs must be resident while the request
holds a reference to it (the encoder output is read from the cache by the model runner),
and only unreferenced entries may be evicted, lazily, when space is needed.  So a policy
never decides *whether* to insert; it only decides *which unreferenced entry to drop* when
the manager needs room.  Admission-style policies (TinyLFU, S3-FIFO's small queue) express
"do not admit" as "evict first once released".

The caller (a cache core) guarantees the call protocol:

* ``insert(key, size)``  -- a miss: ``key`` becomes resident *and pinned*;
* ``hit(key)``           -- a new reference to a resident ``key`` (called after ``pin``
  when the entry was unreferenced);
* ``pin(key)``           -- a resident, unreferenced entry gets a reference again;
* ``release(key)``       -- the last reference was dropped; the entry is now evictable;
* ``evict() -> key``     -- remove and return one evictable entry (the caller guarantees
  one exists);
* ``clear()``            -- forget all resident entries (``EncoderCacheManager.reset``).

``hit``/``insert`` are the *accesses* (one per request and item); evictions triggered by
a miss happen before its ``insert``, as in vLLM (``can_allocate`` evicts, ``allocate``
inserts).  Sizes are in encoder embeddings ("tokens"), the unit of vLLM's cache budget.

The offline policies (``needs_future = True``) need the future: pass
``accesses=[key, ...]`` -- the exact sequence of ``hit``/``insert`` keys the caller will
produce (see ``simulate.access_sequence``).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Any

__all__ = ["Key", "Policy", "ReleaseHeap"]

Key = Hashable


class Policy:
    """Common interface (see the module docstring for the call protocol)."""

    name = "base"
    needs_future = False

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = int(capacity)

    def insert(self, key: Key, size: int) -> None:
        raise NotImplementedError

    def hit(self, key: Key) -> None:
        raise NotImplementedError

    def pin(self, key: Key) -> None:
        raise NotImplementedError

    def release(self, key: Key) -> None:
        raise NotImplementedError

    def evict(self) -> Key:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Parameters, for reports."""
        return {"policy": self.name}


class ReleaseHeap:
    """Pinning for score-ranked policies: a released entry is pushed on a min-heap with
    its current ``_prio`` (ties: oldest release first); ``evict`` pops lazily, skipping
    entries that are pinned, gone, or re-released since (each class checks staleness)."""

    def pin(self, key):
        self._pinned.add(key)

    def release(self, key):
        self._pinned.discard(key)
        self._seq += 1
        heapq.heappush(self._heap, (self._prio(key), self._seq, key))
