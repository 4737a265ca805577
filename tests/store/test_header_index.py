"""The disk store's header index (scan cache): scans with it agree with a full scan under
writers, purges, evictions, in-place damage and a lost or foreign index file; unchanged
entries are not re-read; `stats` (also from the index's summary) and `verify` agree with a
full scan."""

from __future__ import annotations

import os
import pickle
import threading
import time
from functools import partial

import numpy as np
import pytest

from encache.connectors.store.disk import header_index
from encache.connectors.store.disk.store import ENTRY_FILE, META_DIR, DiskStore
from encache.connectors.store.summary import summarize_entries
from encache.connectors.store.ops.scanning import summarize
from entries import put_entry


put = partial(put_entry, rows=8, width=4)  # small random entries (seed=...)


def ident(i, lora=None):
    h = f"{i:064x}"
    return f"{lora}:{h}" if lora else h


def snapshot(store, use_index):
    """identifier -> everything a scan reports about it."""
    out = {}
    for e in store.scan(use_index=use_index):
        out[e.identifier] = (e.size, e.meta, e.created, e.accessed, e.error)
    return out


def assert_agrees(store):
    full = snapshot(store, use_index=False)
    assert snapshot(store, use_index=True) == full
    return full


@pytest.fixture
def store(tmp_path):
    s = DiskStore(tmp_path / "s", fsync=False)
    for i in range(60):
        put(s, ident(i, "ad" if i % 7 == 0 else None), seed=i, model="m" if i % 2 else "other")
    # a legacy (ECExampleConnector-style) entry and one with a broken header
    legacy = s.root / ident(100) / ENTRY_FILE
    legacy.parent.mkdir()
    from safetensors.numpy import save_file
    save_file({"ec_cache": np.zeros((4, 4), np.float16)}, str(legacy))
    bad = s.root / ident(101) / ENTRY_FILE
    bad.parent.mkdir()
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    return s


def count_header_reads(monkeypatch, store):
    calls = []
    real = store._stat_path

    def counting(name, path, with_version=False):
        if with_version:  # the indexed scan's reads (a full scan reads everything)
            calls.append(name)
        return real(name, path, with_version)
    monkeypatch.setattr(store, "_stat_path", counting)
    return calls


def test_index_is_built_used_and_incremental(store, monkeypatch):
    meta = store.root / META_DIR / header_index.INDEX_FILE
    assert not meta.exists()
    full = assert_agrees(store)
    assert len(full) == 62 and meta.exists()
    reads = count_header_reads(monkeypatch, store)
    assert snapshot(store, True) == full
    assert reads == []  # nothing changed: no header opened
    # between index updates: a rewrite, a purge, a new entry, in-place damage
    time.sleep(0.01)
    put(store, ident(3), seed=99, model="rewritten")
    store.delete(ident(4))
    put(store, ident(200), seed=5)
    victim = store.entry_path(ident(5))
    with open(victim, "r+b") as f:  # damage in place: same inode and size, new mtime
        f.seek(8)
        f.write(b"X")
    reads.clear()
    full = assert_agrees(store)
    assert full[ident(3)][1].model == "rewritten"
    assert ident(4) not in full and ident(200) in full
    assert full[ident(5)][4] is not None  # the damaged header is reported, not the cached one
    # only the changed entries were read (each once per scan)
    assert sorted(set(reads)) == sorted([ident(3), ident(200), ident(5)])


def test_access_tracking_keeps_the_index_valid(store, monkeypatch):
    assert_agrees(store)
    path = store.entry_path(ident(1))
    os.utime(path, ns=(time.time_ns() - 3600 * 10**9, os.stat(path).st_mtime_ns))
    assert store.read_entry(ident(1)) is not None  # a load: a fresh atime, and its stamp
    full = assert_agrees(store)
    assert full[ident(1)][3] == os.stat(path).st_atime  # fresh atime


def count_listings(monkeypatch, store):
    calls = []
    real = store._entry_dirs
    monkeypatch.setattr(store, "_entry_dirs", lambda: calls.append(1) or real())
    return calls


def test_an_unchanged_store_is_scanned_from_the_index_alone(store, monkeypatch):
    full = assert_agrees(store)  # the first indexed scan saves the index under the token
    listings = count_listings(monkeypatch, store)
    assert snapshot(store, True) == full and listings == []  # no listing, no stat
    # a load since the index was saved (its access stamp): listed and stat'ed again
    path = store.entry_path(ident(3))
    os.utime(path, ns=(time.time_ns() - 3600 * 10**9, os.stat(path).st_mtime_ns))
    assert store.read_entry(ident(3)) is not None
    got = snapshot(store, True)
    assert listings == [1] and got[ident(3)][3] == os.stat(path).st_atime
    # saved again by a scan begun more than ACCESS_STAMP_S after the stamp: current again
    monkeypatch.setattr(header_index, "ACCESS_STAMP_S", -1.0)
    snapshot(store, True)
    assert snapshot(store, True) == snapshot(store, False) and listings == [1, 1]
    # any change (put, delete, a directory made by another program): listed again
    put(store, ident(300), seed=3)
    store.delete(ident(6))
    got = snapshot(store, True)
    assert listings == [1, 1, 1] and ident(300) in got and ident(6) not in got
    assert got == snapshot(store, False)
    # an index older than SUMMARY_MAX_AGE_S is not taken as the store
    snapshot(store, True)
    monkeypatch.setattr(DiskStore, "SUMMARY_MAX_AGE_S", 0.0)
    snapshot(store, True)
    assert listings == [1, 1, 1, 1, 1]


def test_a_scan_beside_writers_agrees_and_ends_current(tmp_path):
    s = DiskStore(tmp_path / "w", fsync=False)
    for i in range(40):
        put(s, ident(i), seed=i)
    stop = threading.Event()

    def write():
        w = DiskStore(tmp_path / "w", fsync=False)
        k = 0
        while not stop.is_set():
            put(w, ident(1000 + k % 50), seed=k)
            if k % 3 == 0:
                w.delete(ident(1000 + (k // 3) % 50))
            k += 1

    t = threading.Thread(target=write)
    t.start()
    try:
        for _ in range(20):
            snapshot(s, True)  # an index saved meanwhile is never taken as current
    finally:
        stop.set()
        t.join()
    assert_agrees(s)
    assert snapshot(s, True) == snapshot(s, False)


@pytest.mark.parametrize("damage", ["missing", "garbage", "foreign-format", "evil-pickle"])
def test_lost_or_bad_index_is_rebuilt(store, damage):
    assert_agrees(store)
    path = store.root / META_DIR / header_index.INDEX_FILE
    if damage == "missing":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(b"\x80\x05garbage")
    elif damage == "foreign-format":
        path.write_bytes(pickle.dumps({"format": -1, "records": {}}))
    else:  # a file naming any other class must not be trusted (or run)
        path.write_bytes(pickle.dumps({"format": header_index.FORMAT,
                                       "records": {"x": os.system}}))
    assert header_index.load(path.parent) == {}
    assert_agrees(store)
    assert len(header_index.load(path.parent)) == 62  # rebuilt


def test_eviction_between_index_updates(tmp_path):
    s = DiskStore(tmp_path / "cap", fsync=False)
    for i in range(30):
        put(s, ident(i), seed=i, rows=64)
    assert_agrees(s)
    size = os.path.getsize(s.entry_path(ident(0)))
    capped = DiskStore(tmp_path / "cap", fsync=False, max_bytes=size * 20)
    put(capped, ident(999), seed=1, rows=64)  # over capacity: evicts down to the watermark
    full = assert_agrees(capped)
    assert len(full) < 30


def test_concurrent_writer_and_purge(store):
    """Scans (index on) run while a writer replaces/adds/deletes entries; every scan
    yields only real headers, and once the writer stops, index == full scan."""
    assert_agrees(store)
    stop = threading.Event()
    errors = []

    def writer():
        i = 0
        try:
            while not stop.is_set():
                put(store, ident(i % 40), seed=1000 + i, model=f"w{i}")
                put(store, ident(300 + i % 25), seed=i)
                store.delete(ident(300 + (i + 7) % 25))
                i += 1
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(15):
            for e in store.scan():
                assert e.size > 0
                if e.error is None and e.meta.model and e.meta.model.startswith("w"):
                    assert e.meta.identifier == e.identifier
    finally:
        stop.set()
        t.join()
    assert not errors
    full = assert_agrees(store)
    # a purge between index updates (the CLI's own purge path)
    from typer.testing import CliRunner

    from encache.cli.app import app
    r = CliRunner().invoke(app, ["purge", "-s", str(store.root), "--lora", "ad", "--yes"])
    assert r.exit_code == 0, r.output
    after = assert_agrees(store)
    assert len(after) < len(full) and not any(k.startswith("ad:") for k in after)


def test_stats_and_verify_agree_with_a_full_scan(store):
    from encache.connectors.store.ops.verify import verify_store

    assert_agrees(store)
    time.sleep(0.01)
    put(store, ident(9), seed=7, model="changed")
    store.delete(ident(8))
    with_index = summarize(store)
    full = summarize_entries(store.scan(use_index=False))
    assert with_index == full
    assert with_index.entries == 61 and with_index.unreadable == 1 and with_index.legacy == 1
    rep = verify_store(store, display_url=str(store.root), threads=2)
    assert rep.checked == full.entries
    assert len(rep.bad) == full.unreadable


def test_stats_summary_comes_from_the_index_only_when_nothing_changed(store, monkeypatch):
    full = summarize_entries(store.scan(use_index=False))
    assert summarize(store) == full  # first: builds the index
    assert store.summary_if_unchanged() == full
    calls = []
    real = header_index.load_records
    monkeypatch.setattr(header_index, "load_records", lambda d, *a: calls.append(d) or real(d, *a))
    assert summarize(store) == full and calls == []  # fast path: no records loaded
    # a load moves atime (and ctime) only: still the fast path, with the new last access
    path = store.entry_path(ident(2))
    hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(path, ns=(hour_ago, os.stat(path).st_mtime_ns))
    assert store.read_entry(ident(2)) is not None  # (refreshes an access older than 60 s)
    s = summarize(store)
    assert calls == [] and s.last_access == os.stat(path).st_atime
    assert s == summarize_entries(store.scan(use_index=False))
    # a rewrite: the fast path declines, the scan re-reads it and refreshes the summary
    time.sleep(0.01)
    put(store, ident(2), seed=77, model="new-model")
    assert store.summary_if_unchanged() is None
    s = summarize(store)
    assert calls and s == summarize_entries(store.scan(use_index=False))
    assert s.by_model["new-model"].entries == 1
    calls.clear()
    assert summarize(store) == s and calls == []  # and the next one is fast again
    store.delete(ident(2))
    assert store.summary_if_unchanged() is None


def test_stats_and_size_of_an_unchanged_store_list_no_entry(store, monkeypatch):
    """The summary kept under the store's generation: an unchanged store's stats and size
    are answered without listing a single entry (O(1) at any size); a put, a delete, a
    new entry directory or an old summary send them back to the scan."""
    from encache.connectors.store.ops.report import build_size
    from encache.connectors.store.disk.store import DiskStore

    full = summarize(store)  # builds the index and the summary under the generation
    real = DiskStore._entry_dirs

    def no_listing(self):
        raise AssertionError("an unchanged store was listed")

    monkeypatch.setattr(DiskStore, "_entry_dirs", no_listing)
    assert summarize(store) == full
    assert build_size(store, "s")["bytes"] == full.bytes == store.summary_if_unchanged().bytes
    monkeypatch.setattr(DiskStore, "_entry_dirs", real)
    assert build_size(store, "s")["bytes"] == store.used_bytes()

    put(store, ident(200), seed=5)  # a put: the generation moved
    assert store.summary_if_unchanged(stat_entries=False) is None
    s = summarize(store)
    assert s.entries == full.entries + 1 and s == summarize_entries(store.scan(use_index=False))
    assert store.summary_if_unchanged(stat_entries=False) == s  # current again
    store.delete(ident(200))
    assert store.summary_if_unchanged(stat_entries=False) is None
    assert summarize(store) == full
    (store.root / ident(201)).mkdir()  # another program's new directory: the root moved
    assert store.summary_if_unchanged(stat_entries=False) is None
    assert summarize(store) == full
    monkeypatch.setattr(DiskStore, "SUMMARY_MAX_AGE_S", 0.0)  # trusted this long at most
    assert store.summary_if_unchanged(stat_entries=False) is None
