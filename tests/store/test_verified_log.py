"""The disk store's per-boot log of verified entry versions (store/verified_log.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from encache.connectors.store import verified_log as vl
from encache.connectors.store.disk import DiskStore
from encache.connectors.store.verified_log import VerifiedLog, record_key


def test_keys_bind_identifier_version_and_ctime():
    k = record_key("a", (1, 2, 3, 4), 7)
    assert k == record_key("a", [1, 2, 3, 4], 7)
    assert len({k, record_key("b", (1, 2, 3, 4), 7), record_key("a", (1, 2, 3, 5), 7),
                record_key("a", (1, 9, 3, 4), 7), record_key("a", (1, 2, 3, 4), 8)}) == 5
    assert record_key("\udcff odd", (1, 2, 3, 4), 7) != k  # any identifier, surrogates too


def test_append_then_load_sorted_and_distinct(tmp_path):
    log = VerifiedLog(tmp_path / "verified", "boot-a")
    keys = [record_key(f"e{i}", (1, i, 10, 5), 0) for i in range(50)]
    for k in keys + keys[:10]:
        log.append(k)
    got = VerifiedLog(tmp_path / "verified", "boot-a").load()
    assert got.dtype == np.uint64 and got.tolist() == sorted(set(keys))
    assert os.path.getsize(log.path) == 60 * 8
    log.close()


def test_another_boot_starts_empty_and_removes_old_logs(tmp_path):
    old = VerifiedLog(tmp_path / "v", "boot-old")
    old.append(record_key("e", (1, 1, 1, 1), 0))
    old.close()
    new = VerifiedLog(tmp_path / "v", "boot-new")
    assert new.load().size == 0
    assert not old.path.exists()


def test_a_torn_tail_is_ignored(tmp_path):
    log = VerifiedLog(tmp_path / "v", "b")
    k = record_key("e", (1, 1, 1, 1), 0)
    log.append(k)
    log.close()
    with open(log.path, "ab") as f:
        f.write(b"\x01\x02\x03")  # a short write (full disk)
    assert VerifiedLog(tmp_path / "v", "b").load().tolist() == [k]


def test_duplicates_are_compacted_and_an_appender_follows_the_new_file(tmp_path):
    writer = VerifiedLog(tmp_path / "v", "b")
    k = record_key("e", (1, 1, 1, 1), 0)
    for _ in range(3000):
        writer.append(k)
    reader = VerifiedLog(tmp_path / "v", "b")
    assert reader.load().tolist() == [k]
    assert os.path.getsize(reader.path) == 8  # compacted to its distinct keys
    k2 = record_key("e2", (1, 1, 1, 1), 0)
    writer.append(k2)  # its open file was replaced: it reopens the log
    assert sorted(VerifiedLog(tmp_path / "v", "b").load().tolist()) == sorted([k, k2])
    writer.close()


def test_an_oversized_log_starts_afresh(tmp_path, monkeypatch):
    monkeypatch.setattr(vl, "MAX_RECORDS", 10)
    log = VerifiedLog(tmp_path / "v", "b")
    for i in range(11):
        log.append(record_key(f"e{i}", (1, 1, 1, 1), 0))
    assert VerifiedLog(tmp_path / "v", "b").load().size == 0
    assert os.path.getsize(log.path) == 0
    log.close()


def test_disk_store_keeps_a_log_only_where_it_is_safe(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "s")
    log = store.verified_log()
    assert log is not None and log.path.parent == tmp_path / "s" / ".encache" / "verified"
    assert log.path.name == vl.boot_id()
    store.fs_type = "nfs4"  # a network filesystem: another host's clock and page cache
    assert store.verified_log() is None
    store.fs_type = "ext4"
    store.read_only = True
    assert store.verified_log() is None
    store.read_only = False
    monkeypatch.setattr(vl, "BOOT_ID_PATH", str(tmp_path / "missing"))
    assert store.verified_log() is None


def test_the_log_is_invisible_to_listings(tmp_path):
    store = DiskStore(tmp_path / "s")
    store.verified_log().append(record_key("e", (1, 1, 1, 1), 0))
    assert list(store.identifiers()) == [] and store.stray_files() == []
    assert store.used_bytes() == 0


@pytest.mark.skipif(not os.path.exists(vl.BOOT_ID_PATH), reason="needs Linux's boot id")
def test_boot_id_is_this_kernels():
    with open(vl.BOOT_ID_PATH) as f:
        assert vl.boot_id() == f.read().strip()
