"""A consumer's index refresh costs O(changes): after a change it reads the store's
change journal and looks up only the identifiers named there (disk, Redis, Redis
Cluster), and it still equals a fresh listing: adds, removals and replacements, also
while a writer runs beside it. Where the journal cannot tell, the store is listed."""

from __future__ import annotations

import threading
import uuid
from functools import partial

from encache.connectors.lookup import index as index_mod
from encache.connectors.lookup.index import StoreIndex
from encache.connectors.store import open_store
from encache.connectors.store.disk.store import DiskStore
from entries import put_entry

put = partial(put_entry, rows=4, fill=0.0)


def ident(i):
    return f"{i:064x}"


def listed(store) -> set[str]:
    return set(store.identifiers())


def check_changes_come_from_the_journal(store, writer):
    for i in range(50):
        put(store, ident(i))
    index = StoreIndex(store, refresh_s=0.0)
    assert len(index.refresh()) == 50 and index.listings == 1
    assert index.refresh() == set()
    put(writer, ident(100))  # an add
    put(writer, ident(3))  # a replacement (a new version of a held entry)
    writer.delete(ident(4))  # a removal
    assert index.refresh() == {ident(100), ident(3)}  # what was written since
    assert set(index._ids) == listed(store) and ident(4) not in index._ids
    writer.delete_many([ident(i) for i in range(10, 20)])
    for i in range(200, 230):
        put(writer, ident(i))
    assert index.refresh() == {ident(i) for i in range(200, 230)}
    assert set(index._ids) == listed(store)
    assert index.listings == 1 and index.journal_refreshes == 2
    return index


def test_disk_refresh_reads_the_journal_not_the_listing(tmp_path):
    store = DiskStore(tmp_path / "s", fsync=False)
    check_changes_come_from_the_journal(store, DiskStore(tmp_path / "s", fsync=False))


def test_redis_refresh_reads_the_journal_not_the_listing(redis_server):
    prefix = f"t-{uuid.uuid4().hex[:8]}:"
    store = open_store(redis_server.url, prefix=prefix)
    check_changes_come_from_the_journal(store, open_store(redis_server.url, prefix=prefix))


def test_redis_cluster_refresh_is_exact_after_changes(redis_cluster):
    # a cluster's journal may miss a change (``journal_complete`` False): it is read when
    # it names changes, and the store listed when the version moved with none named
    prefix = f"t-{uuid.uuid4().hex[:8]}:"
    store = open_store(redis_cluster.url, prefix=prefix)
    writer = open_store(redis_cluster.url, prefix=prefix)
    for i in range(20):
        put(store, ident(i))
    index = StoreIndex(store, refresh_s=0.0)
    index.refresh()
    put(writer, ident(50))
    writer.delete(ident(5))
    index.listing.ended = -1e9  # a listing, if one is needed, is due
    assert index.refresh() == {ident(50)}
    assert set(index._ids) == listed(store)


def test_a_journal_that_cannot_tell_means_a_listing(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "s", fsync=False)
    for i in range(5):
        put(store, ident(i))
    index = StoreIndex(store, refresh_s=0.0)
    index.refresh()
    monkeypatch.setattr(store, "changes_since", lambda cursor: (cursor, None))
    put(store, ident(9))
    index.listing.ended = -1e9
    assert index.refresh() == {ident(9)} and index.listings == 2
    monkeypatch.undo()
    # a journal that can miss a change is not trusted alone for longer than
    # JOURNAL_FULL_CHECK_S: then the store is listed whole
    monkeypatch.setattr(index_mod, "JOURNAL_FULL_CHECK_S", 0.0)
    put(store, ident(10))
    index.listing.ended = -1e9
    assert index.refresh() == {ident(10)} and index.listings == 3


def test_refreshes_beside_a_writer_end_equal_to_a_listing(tmp_path):
    store = DiskStore(tmp_path / "s", fsync=False)
    for i in range(100):
        put(store, ident(i))
    index = StoreIndex(store, refresh_s=0.0)
    index.refresh()
    writer = DiskStore(tmp_path / "s", fsync=False)
    done = threading.Event()

    def write():
        for k in range(300):
            put(writer, ident(1000 + k))
            if k % 3 == 0:
                writer.delete(ident(k // 3))
            if k % 7 == 0:
                put(writer, ident(1000 + k // 2))  # replaced
        done.set()

    t = threading.Thread(target=write)
    t.start()
    while not done.is_set():
        index.refresh()
    t.join()
    index.refresh()
    assert set(index._ids) == listed(store)
    assert index.journal_refreshes > 0


def test_nothing_changed_costs_no_journal_read(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "s", fsync=False)
    put(store, ident(1))
    index = StoreIndex(store, refresh_s=0.0)
    index.refresh()
    calls = []
    real = store.changes_since
    monkeypatch.setattr(store, "changes_since", lambda c: calls.append(c) or real(c))
    for _ in range(10):
        assert index.refresh() == set()
    assert calls == [] and index.listings == 1
