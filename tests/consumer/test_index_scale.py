"""A consumer's background work on a big disk store stays small: the index is refreshed
only when the store's ``index_version()`` moved (two ``stat`` calls instead of a
``stat`` per entry), from the change journal where it names the change, else by a
listing at most while listing costs ~5 % of the time; the store's bytes
are summed only when it changed. An entry written meanwhile is still found (one
``stat`` for an identifier the index does not hold yet)."""

from __future__ import annotations

import logging
import os
import time
from functools import partial

from encache.connectors.lookup.index import StoreIndex
from encache.connectors.lookup.metrics import LookupMetrics
from encache.connectors.ratelimit import RateLimitedLog
from encache.connectors.store.disk.store import ENTRY_FILE, DiskStore
from entries import put_entry


put = partial(put_entry, rows=4, fill=0.0)  # tiny all-zero entries


def ident(i):
    return f"{i:064x}"


def test_the_disk_token_moves_for_every_change_of_the_entry_set_and_only_then(tmp_path):
    store = DiskStore(tmp_path / "s", fsync=False, access_resolution_s=0.0)
    v0 = store.index_version()
    put(store, ident(1))
    v1 = store.index_version()
    assert v1 != v0
    store.get(ident(1)), store.read_entry(ident(1)), list(store.scan()), store.used_bytes()
    assert store.index_version() == v1  # reads, access-time refreshes, scans: unchanged
    put(store, ident(1))  # a new version in an existing directory moves no directory
    v2 = store.index_version()
    assert v2 != v1
    other = DiskStore(tmp_path / "s", fsync=False)  # another process's writes
    put(other, ident(2))
    v3 = store.index_version()
    assert v3 != v2
    # a foreign writer (no encache: a directory and a file, as ECExampleConnector-style
    # tools write them) still moves the root's mtime
    time.sleep(0.01)
    d = store.entry_path(ident(3)).parent
    d.mkdir()
    (d / ENTRY_FILE).write_bytes(open(store.entry_path(ident(2)), "rb").read())
    v4 = store.index_version()
    assert v4 != v3
    other.delete(ident(1))
    assert store.index_version() != v4


def test_an_eviction_moves_the_token(tmp_path):
    probe = DiskStore(tmp_path / "p", fsync=False)
    put(probe, ident(0))
    one = probe.used_bytes()
    # room for three entries and half of a fourth: entries differ by a header padding step
    # (their write time's digits), so exactly three entries must fit, whatever their times
    store = DiskStore(tmp_path / "s", fsync=False, max_bytes=one * 3 + one // 2,
                      low_watermark=1.0)
    for i in range(3):
        put(store, ident(i))
    reader = DiskStore(tmp_path / "s", fsync=False)
    before = reader.index_version()
    put(store, ident(9))  # a fourth entry: the least recently used one is evicted
    assert len(list(reader.identifiers())) == 3 and store.read_counters()["evictions"] == 1
    assert reader.index_version() != before


def test_a_big_store_is_listed_rarely_and_new_entries_are_still_found(tmp_path):
    store = DiskStore(tmp_path / "s", fsync=False)
    for i in range(3000):
        put(store, ident(i))
    index = StoreIndex(store, refresh_s=0.0)
    assert len(index.refresh()) == 3000 and index.listings == 1
    index.mark_ready()
    # nothing changes: 200 refreshes list nothing (before: 200 listings of 3,000 entries)
    for _ in range(200):
        assert index.refresh() == set()
    assert index.listings == 1

    # a producer writes all the time: the version moves at every put, and each refresh
    # reads the store's change journal and looks up only what it names: no listing
    writer = DiskStore(tmp_path / "s", fsync=False)
    written = []
    for k in range(300):
        written.append(ident(10_000 + k))
        put(writer, written[-1])
        assert index.refresh() == {written[-1]}
    assert index.listings == 1 and index.journal_refreshes == 300
    # a change the journal cannot see (an entry directory made by hand) moves the token
    # with nothing journaled: the store is listed again, as often as ~5 % of the time allows
    d = store.entry_path(ident(20_000)).parent
    d.mkdir()
    (d / ENTRY_FILE).write_bytes(open(store.entry_path(ident(1)), "rb").read())
    time.sleep(index.listing.cost / 0.05 + 0.01)
    assert ident(20_000) in index.refresh() and index.listings == 2  # in time
    # whatever the last listing did not see yet is found with one stat each
    assert all(index.holds(i) for i in written)
    assert not index.holds(ident(99_999))


def test_the_store_bytes_gauge_is_summed_again_only_after_a_change(tmp_path):
    store = DiskStore(tmp_path / "s", fsync=False)
    for i in range(5):
        put(store, ident(i))
    metrics = LookupMetrics(store, RateLimitedLog(logging.getLogger("t")))
    metrics.sample_store(5)
    first = metrics.take_interval(0)["store_bytes"]
    assert first == store.used_bytes() and metrics.bytes_reads == 1
    for _ in range(5):
        metrics.sample_store(5)
    assert metrics.take_interval(0)["store_bytes"] == first and metrics.bytes_reads == 1
    put(store, ident(99))
    time.sleep(0.05)  # past 20 x the (sub-millisecond) cost of the last sum
    metrics.sample_store(6)
    assert metrics.take_interval(0)["store_bytes"] == store.used_bytes() > first
    assert metrics.bytes_reads == 2


def test_a_network_filesystem_has_no_token(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "s", fsync=False)
    monkeypatch.setattr(store, "fs_type", "nfs")
    assert store.index_version() is None
    assert os.path.isdir(store.root)
