"""Staging: validated entries in memory, waiting to be handed to the worker.

The scheduler only says "yes, stored" (``has_cache_item``) for an entry whose bytes are
already read and verified: they wait here, in a byte-bounded LRU (``staging_bytes``),
until the step's connector metadata carries them to the worker, and stay as a small hot
tier for popular images. The newest entry is always kept, even when alone it exceeds
the bound.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import msgspec

from ..store.entry import EntryMeta


class Staged(msgspec.Struct, frozen=True):
    """A verified entry in memory: ``blob[offset:offset+meta.data_bytes]`` is the tensor.
    (A struct built in C: one per load.)"""

    identifier: str
    meta: EntryMeta
    blob: bytearray | bytes
    offset: int
    load_seconds: float
    #: the stored version these bytes were verified as (a disk file's identity), or None
    version: object = None
    #: which tier served them (``"local"`` / ``"remote"``; None: a store without tiers)
    source: str | None = None
    #: the read's :meth:`~encache.connectors.store.loaded.Loaded.pin`: these bytes kept
    #: for a worker process to open itself (``(fd, ref)``, or None); None: not pinnable
    pin: object = None

    @property
    def nbytes(self) -> int:
        return len(self.blob)


class StagingArea:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Staged] = OrderedDict()
        self._bytes = 0
        self._unchecked: set[str] = set()  # staged since the last revalidate()

    def revalidate(self, unchanged, everything: bool, also=None) -> list[str]:
        """Drop staged entries that are no longer the stored version (purged,
        quarantined, evicted, rewritten): ``unchanged`` is the store's
        :meth:`~encache.connectors.store.base.Store.unchanged`. Checks every staged entry
        (``everything``: the store changed) or those staged since the last call (a load
        may have read a version just before it was purged), plus those of ``also`` (the
        identifiers the store's journal says changed). Returns the dropped ones.
        Raises what the store raises (the entries stay: an outage serves what was
        current at the last successful check); an entry ``unchanged`` answers None for
        (its part of the store is down) stays too, and is checked again next time."""
        with self._lock:
            if everything:
                ids = list(self._entries)
            else:
                wanted = self._unchecked | set(also) if also else self._unchecked
                ids = [i for i in wanted if i in self._entries]
            self._unchecked.clear()
            held = [self._entries[i] for i in ids]
        if not held:
            return []
        try:
            current = unchanged([(s.identifier, s.version, s.meta) for s in held])
        except BaseException:
            with self._lock:
                self._unchecked.update(ids)
            raise
        dropped = []
        with self._lock:
            for st, ok in zip(held, current):
                if ok is None:  # the store could not tell (one part of it down): later
                    self._unchecked.add(st.identifier)
                elif not ok and self._entries.get(st.identifier) is st:
                    del self._entries[st.identifier]
                    self._bytes -= st.nbytes
                    dropped.append(st.identifier)
        return dropped

    @property
    def nbytes(self) -> int:
        return self._bytes

    # Reads are one dict operation each, atomic under the GIL: no lock on the scheduler's
    # per-item path (has_cache_item). Changes take the lock.
    def __contains__(self, identifier: str) -> bool:
        return identifier in self._entries

    def get(self, identifier: str) -> Staged | None:
        return self._entries.get(identifier)

    def touch(self, identifier: str) -> bool:
        """Is it staged? Marks it most recently used if so."""
        with self._lock:
            if identifier not in self._entries:
                return False
            self._entries.move_to_end(identifier)
            return True

    def add(self, staged: Staged) -> None:
        with self._lock:
            old = self._entries.pop(staged.identifier, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[staged.identifier] = staged
            self._unchecked.add(staged.identifier)
            self._bytes += staged.nbytes
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    def discard(self, identifier: str) -> None:
        with self._lock:
            st = self._entries.pop(identifier, None)
            if st is not None:
                self._bytes -= st.nbytes
