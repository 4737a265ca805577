"""Tests for :mod:`encache.connectors.lookup.entry_lookup`: the composed EntryLookup and its
background thread."""

from __future__ import annotations

import logging
import os
import time

from encache.connectors.store.disk.store import MMAP_MIN_BYTES, DiskStore
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


def test_a_store_directory_removed_while_serving_is_said_and_counted_as_down(tmp_path,
                                                                             caplog):
    """Every request became a miss, with nothing in the log. The index refresh now says
    the directory is gone (the store is down: the breaker opens, lookups answer at
    once); once it is back, the entries are found again."""
    root = tmp_path / "store"
    store = DiskStore(root)
    put(store, "a")
    lk = make(store, index_refresh_s=0.05)
    try:
        assert lk.load_now("a") is not None
        with caplog.at_level(logging.WARNING, logger="encache.lookup"):
            os.rename(root, tmp_path / "away")  # (at once: the lookup's thread writes there)
            deadline = time.time() + 10
            while time.time() < deadline and not lk.breaker.is_open():
                time.sleep(0.02)
        assert lk.breaker.is_open()
        assert any("is gone" in r.getMessage() for r in caplog.records)
        os.rename(tmp_path / "away", root)  # restored
        deadline = time.time() + 40
        while time.time() < deadline and (lk.breaker.is_open() or not lk.index.holds("a")):
            time.sleep(0.05)
        assert not lk.breaker.is_open() and lk.load_now("a") is not None
    finally:
        lk.close()
