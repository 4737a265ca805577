"""Tests for :mod:`encache.connectors.lookup.entry_lookup`: the composed EntryLookup and its
background thread."""

from __future__ import annotations

import time

from encache.connectors.store.disk import MMAP_MIN_BYTES, DiskStore
from lookup_support import make, put


def test_the_index_thread_drops_buffers_of_entries_removed_elsewhere(tmp_path):
    """The consumer's background thread runs the store's housekeeping every refresh: a
    kept mapping of an entry another process purged is let go within a refresh period."""
    store = DiskStore(tmp_path)
    put(store, "big", rows=MMAP_MIN_BYTES // 16)
    lk = make(store, index_refresh_s=0.05, verify_ahead_start_bytes=0)
    try:
        assert lk.load_now("big") is not None and len(store._recent) == 1
        DiskStore(tmp_path).delete("big")  # another process's purge
        deadline = time.time() + 10
        while time.time() < deadline and len(store._recent):
            time.sleep(0.02)
        assert len(store._recent) == 0
    finally:
        lk.close()
