"""Helpers of the lookup tests (``test_lookup_*.py``): entries to store, a lookup to test."""

from __future__ import annotations

from functools import partial

from encache.connectors.lookup import EntryLookup
from entries import put_entry


put = partial(put_entry, rows=4096, width=16)  # 32 bytes a row: 128 KiB by default


def make(store, **kw) -> EntryLookup:
    """A lookup for these tests: no periodic refresh, and no start-up verify-ahead unless
    a test asks (it would verify entries behind the test's back)."""
    kw.setdefault("index_refresh_s", 3600)
    kw.setdefault("verify_ahead_start_bytes", 0)
    return EntryLookup(store, counters_flush_s=3600, load_threads=1, **kw)


def tensor_bytes(staged) -> bytes:
    view = memoryview(staged.blob).cast("B")
    return bytes(view[staged.offset:staged.offset + staged.meta.data_bytes])
