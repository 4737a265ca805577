"""The disk store's per-boot log of verified entry versions (store/verified_log.py)."""

from __future__ import annotations

import os

import pytest

from encache.connectors.store import verified_log as vl
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.verified_log import VerifiedLog, record_key


def test_keys_bind_identifier_and_version():
    k = record_key("a", (1, 2, 3, 4))
    assert k == record_key("a", [1, 2, 3, 4])
    assert len({k, record_key("b", (1, 2, 3, 4)), record_key("a", (1, 2, 3, 5)),
                record_key("a", (1, 9, 3, 4))}) == 4
    assert record_key("\udcff odd", (1, 2, 3, 4)) != k  # any identifier, surrogates too


def test_a_record_holds_only_at_its_ctime_and_the_last_one_wins(tmp_path):
    log = VerifiedLog(tmp_path / "verified", "boot-a")
    keys = [record_key(f"e{i}", (1, i, 10, 5)) for i in range(50)]
    for n, k in enumerate(keys):
        log.append(k, 1000 + n)
    log.append(keys[0], 5000)  # the same version after an access-time refresh
    table = VerifiedLog(tmp_path / "verified", "boot-a").load()
    assert len(table) == 50 and list(table.keys) == sorted(keys)
    assert table.holds(keys[0], 5000) and not table.holds(keys[0], 1000)
    assert table.holds(keys[7], 1007) and not table.holds(keys[7], 1008)
    assert not table.holds(record_key("other", (1, 1, 1, 1)), 1000)
    assert os.path.getsize(log.path) == 51 * 16
    log.close()


def test_another_boot_starts_empty_and_removes_old_logs(tmp_path):
    old = VerifiedLog(tmp_path / "v", "boot-old")
    old.append(record_key("e", (1, 1, 1, 1)), 1)
    old.close()
    new = VerifiedLog(tmp_path / "v", "boot-new")
    assert len(new.load()) == 0
    assert not old.path.exists()


def test_a_torn_tail_is_ignored(tmp_path):
    log = VerifiedLog(tmp_path / "v", "b")
    k = record_key("e", (1, 1, 1, 1))
    log.append(k, 42)
    log.close()
    with open(log.path, "ab") as f:
        f.write(b"\x01\x02\x03")  # a short write (full disk)
    table = VerifiedLog(tmp_path / "v", "b").load()
    assert len(table) == 1 and table.holds(k, 42)


def test_superseded_records_are_compacted_and_an_appender_follows_the_new_file(tmp_path):
    writer = VerifiedLog(tmp_path / "v", "b")
    k = record_key("e", (1, 1, 1, 1))
    for c in range(3000):  # e.g. one access-time refresh a minute for two days
        writer.append(k, c)
    reader = VerifiedLog(tmp_path / "v", "b")
    table = reader.load()
    assert len(table) == 1 and table.holds(k, 2999)
    assert os.path.getsize(reader.path) == 16  # compacted to the last record of each
    k2 = record_key("e2", (1, 1, 1, 1))
    writer.append(k2, 7)  # its open file was replaced: it reopens the log
    table = VerifiedLog(tmp_path / "v", "b").load()
    assert table.holds(k, 2999) and table.holds(k2, 7)
    writer.close()


def test_an_oversized_log_starts_afresh(tmp_path, monkeypatch):
    monkeypatch.setattr(vl, "MAX_VERSIONS", 10)
    log = VerifiedLog(tmp_path / "v", "b")
    for i in range(11):
        log.append(record_key(f"e{i}", (1, 1, 1, 1)), 1)
    assert len(VerifiedLog(tmp_path / "v", "b").load()) == 0
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
    store.verified_log().append(record_key("e", (1, 1, 1, 1)), 1)
    assert list(store.identifiers()) == [] and store.stray_files() == []
    assert store.used_bytes() == 0


def test_a_put_of_bytes_encoded_here_is_logged_with_the_files_ctime(tmp_path):
    """``put(encoded_here=True)`` records the version as it stands after the rename
    (which moves ctime); a plain put records nothing."""
    from encache.connectors.store.entry import encode
    from encache.connectors.store.files import ServedVersion
    store = DiskStore(tmp_path / "s")
    blob = encode("made", b"\x00" * 64, "U8", (64,))
    store.put("made", blob, encoded_here=True)
    store.put("copied", encode("copied", b"\x00" * 64, "U8", (64,)))
    table = store.verified_log().load()
    st = os.stat(store.entry_path("made"))
    assert len(table) == 1
    assert table.holds(record_key("made", ServedVersion.of(st)), st.st_ctime_ns)


@pytest.mark.skipif(not os.path.exists(vl.BOOT_ID_PATH), reason="needs Linux's boot id")
def test_boot_id_is_this_kernels():
    with open(vl.BOOT_ID_PATH) as f:
        assert vl.boot_id() == f.read().strip()


def test_records_appended_meanwhile_are_read_and_folded_in(tmp_path):
    """A running reader (``read_new``) gets what other processes append after its
    ``load``, whole records only; many of them are folded into the sorted table, where
    the last record of a key wins."""
    from encache.connectors.lookup.verified import VerifiedVersions
    from encache.connectors.store.files import ServedVersion

    def version(i: int, ctime: int) -> ServedVersion:
        v = ServedVersion((1, i, 10, 5))
        v.ctime_ns = v.touched_ctime_ns = ctime
        return v

    writer = VerifiedLog(tmp_path / "v", "b")
    writer.append(record_key("old", (1, 0, 10, 5)), 7)
    reader = VerifiedLog(tmp_path / "v", "b")
    versions = VerifiedVersions(True, reader)
    assert versions.load_log() == 1
    assert len(reader.read_new()[0]) == 0
    writer.append(record_key("e", (1, 1, 10, 5)), 100)
    with open(writer.path, "ab") as f:
        f.write(record_key("e", (1, 2, 10, 5)).to_bytes(8, "little")[:5])  # torn
    assert versions.trusted("e", version(1, 100)) and not versions.trusted("e", version(1, 101))
    assert versions._new == {record_key("e", (1, 1, 10, 5)): 100}  # not the torn tail
    assert len(reader.read_new()[0]) == 0

    fresh = VerifiedLog(tmp_path / "w", "b")
    keys = [record_key(f"k{i}", (1, i, 10, 5)) for i in range(5000)]
    for n, k in enumerate(keys):
        fresh.append(k, n)
    fresh.append(keys[3], 99_999)  # an access-time refresh: the last record wins
    many = VerifiedVersions(True, VerifiedLog(tmp_path / "w", "b"))
    many.load_log()
    for n, k in enumerate(keys):
        fresh.append(record_key(f"n{n}", (1, n, 10, 5)), 10 + n)
    assert many.trusted("n4999", version(4999, 5009))
    assert not many._new and len(many._trusted) == 10_000  # folded into the table
    assert many.trusted("k3", version(3, 99_999)) and many.trusted("n0", version(0, 10))
    writer.close()
    fresh.close()


APPENDER = """
import sys
from encache.connectors.store.verified_log import VerifiedLog, record_key
log = VerifiedLog(sys.argv[1], "b")
for i in range(int(sys.argv[3])):
    log.append(record_key(f"{sys.argv[2]}{i}", (1, i, 10, 5)), i)
log.close()
"""


def test_a_reader_following_concurrent_appenders_gets_every_record_once(tmp_path):
    """Two processes append while a reader follows the log: the reader gets every
    record exactly once, whole (never a key or a ctime torn between two reads)."""
    import subprocess
    import sys
    reader = VerifiedLog(tmp_path / "v", "b")
    reader.load()
    n = 3000
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(tmp_path / "v"), name, str(n)])
             for name in ("a", "b")]
    got = []
    while True:
        done = all(p.poll() is not None for p in procs)
        keys, ctimes = reader.read_new()
        got.extend(zip(keys.tolist(), ctimes.tolist()))
        if done:
            keys, ctimes = reader.read_new()
            got.extend(zip(keys.tolist(), ctimes.tolist()))
            break
    assert all(p.returncode == 0 for p in procs)
    want = {(record_key(f"{name}{i}", (1, i, 10, 5)), i) for name in ("a", "b") for i in range(n)}
    assert len(got) == 2 * n and set(got) == want
