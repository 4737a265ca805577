"""RecentBuffers: the disk store's buffers of recently served entry versions.

Why: without it a serving load of a disk entry opens the file, maps it (or reads it
into a fresh buffer) and unmaps it again every time. With the engine's copy of the
tensor counted, that set-up -- mmap + a page fault per 64 KiB + munmap, or a second full copy
for a read -- kept a repeat load at 0.6-0.85x a plain ``readinto`` of the file
(benchmarks/load.json). An entry served once is very likely served again (the reason the
cache exists), so the store keeps the buffer it produced, keyed by the entry's path, with
the file version it holds: (device, inode, size, mtime_ns). A later load ``stat``s the
path (one syscall, no open) and, when the version is the same, returns the same buffer:
its pages are already mapped or read, so the load is the engine's copy alone.

Guarantees kept:
  * a replaced entry (a writer renames a new file over it: new inode) or one written in
    place (new mtime) is a different version: the old buffer is dropped and the file is
    read again; a removed entry is a miss (the stat fails) and its buffer is dropped;
  * a buffer handed out before a replacement keeps the bytes it had (it is never reused
    for another version, only dropped);
  * bounded: at most ``max_items`` buffers, ``mapped_bytes`` of mappings (a mapping of a
    deleted file holds its disk blocks until dropped) and ``read_bytes`` of private
    buffers (anonymous memory), each unused for at most ``max_age_s`` (10 min: serving
    re-reads the same entries minutes apart; swept on every lookup and insert);
  * a buffer whose file another process replaced, rewrote or removed (a purge, another
    writer's eviction) is dropped by :meth:`RecentBuffers.sweep`, which a long-lived
    reader runs periodically (the consumer's index thread, through ``Store.maintain``),
    so it does not hold a deleted file's blocks for long.

The same buffer object is handed to every load of a version, as the lookup's staging
tier already does for repeat requests: consumers must not write into a loaded tensor
(vLLM does not; a mapping is copy-on-write, so a stray write never reaches the file).
Used only on local filesystems, where ``stat`` sees a rename at once.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict

from ..files import file_version

MAX_ITEMS = 4096
MAPPED_BYTES = 2 << 30
READ_BYTES = 256 << 20
MAX_AGE_S = 600.0


class RecentBuffers:
    """LRU of ``path -> (version, buffer, last_used, touched_ns)``; thread-safe.

    ``touched_ns``: when the store last refreshed (or tried to refresh) the file's access
    time for this buffer, so a file whose atime cannot be set does not cost an open per
    load."""

    def __init__(self, *, max_items: int = MAX_ITEMS, mapped_bytes: int = MAPPED_BYTES,
                 read_bytes: int = READ_BYTES, max_age_s: float = MAX_AGE_S):
        self.max_items = max_items
        self.limits = {True: mapped_bytes, False: read_bytes}
        self.max_age_s = max_age_s
        self._items: OrderedDict[str, list] = OrderedDict()
        self._bytes = {True: 0, False: 0}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, path: str) -> bool:
        """Whether a buffer is held for ``path`` (of some version: :meth:`get` checks)."""
        return path in self._items

    def get(self, path: str, version):
        """``(buffer, touched_ns)`` held for ``path`` if it holds ``version``; else
        ``(None, 0)`` (and a buffer of another version is dropped)."""
        with self._lock:
            now = time.monotonic()
            self._expire(now)  # on every call, not only on inserts
            item = self._items.get(path)
            if item is None:
                return None, 0
            if item[0] != version:
                self._drop(path)
                return None, 0
            item[2] = now
            self._items.move_to_end(path)
            return item[1], item[5]

    def put(self, path: str, version, buf, touched_ns: int = 0) -> None:
        mapped = isinstance(buf, mmap.mmap)
        size = len(buf)
        if size > self.limits[mapped]:
            self.discard(path)
            return
        now = time.monotonic()
        with self._lock:
            self._drop(path)
            self._items[path] = [version, buf, now, mapped, size, touched_ns]
            self._bytes[mapped] += size
            while self._items:  # LRU first, then expired ones from the old end
                _, oldest = next(iter(self._items.items()))
                over = (len(self._items) > self.max_items
                        or self._bytes[True] > self.limits[True]
                        or self._bytes[False] > self.limits[False])
                if not over and now - oldest[2] <= self.max_age_s:
                    break
                self._drop(next(iter(self._items)))

    def sweep(self, stat=os.stat) -> int:
        """Drop buffers whose path no longer holds their version (replaced, rewritten or
        removed, by anyone) and expired ones; returns how many were dropped. The ``stat``
        calls run outside the lock, so loads are never held up by a sweep."""
        with self._lock:
            held = [(path, item[0]) for path, item in self._items.items()]
        stale = []
        for path, version in held:
            try:
                st = stat(path)
            except OSError:
                stale.append((path, version))
                continue
            if file_version(st) != version:
                stale.append((path, version))
        now = time.monotonic()
        dropped = 0
        with self._lock:
            for path, version in stale:
                item = self._items.get(path)
                if item is not None and item[0] == version:  # not re-read meanwhile
                    self._drop(path)
                    dropped += 1
            dropped += self._expire(now)
        return dropped

    def discard(self, path: str) -> None:
        with self._lock:
            self._drop(path)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = {True: 0, False: 0}

    def _expire(self, now: float) -> int:  # caller holds the lock
        """Drop buffers unused for longer than ``max_age_s``, from the old end; how many."""
        dropped = 0
        while self._items and now - next(iter(self._items.values()))[2] > self.max_age_s:
            self._drop(next(iter(self._items)))
            dropped += 1
        return dropped

    def _drop(self, path: str) -> None:  # caller holds the lock
        item = self._items.pop(path, None)
        if item is not None:
            self._bytes[item[3]] -= item[4]
            # never close() a mapping here: a tensor handed out may still view it; the
            # mapping goes away with its last reference
