"""Tests for :mod:`encache.connectors.lookup.verified`: verify once per stored version, and
the verified log that lets restarted consumers trust versions checked since boot."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from encache.connectors.lookup import State, parse_verify
from encache.connectors.store.disk.store import ENTRY_FILE, MMAP_MIN_BYTES, DiskStore
from lookup_support import make, put, tensor_bytes


def test_checksum_runs_once_per_stored_version(tmp_path, counted):
    store = DiskStore(tmp_path)
    put(store, "v", seed=1)
    lk = make(store)
    try:
        assert lk.start_verify_done.wait(30)  # (its log read: not after forget_verified)
        for _ in range(3):
            assert lk.load_now("v") is not None
        assert counted == [True]  # verified on the first load only
        time.sleep(0.02)
        put(store, "v", seed=2)  # a new version: verified again
        assert tensor_bytes(lk.load_now("v")) == tensor_bytes(lk.load_now("v"))
        assert counted == [True, True]
        lk.forget_verified()
        lk.load_now("v")
        assert len(counted) == 3
    finally:
        lk.close()


@pytest.mark.parametrize("load_mode", ["read", "mmap"])
def test_a_store_that_reads_every_load_hashes_each_version_once(tmp_path, counted, load_mode):
    """``load_mode: read`` (and a network filesystem) reads the bytes on every load; a
    version validated here before is read with header checks only, as a mapped one."""
    store = DiskStore(tmp_path, load_mode=load_mode, reuse_buffers=False)
    put(store, "r", seed=1)
    lk = make(store)
    try:
        first = tensor_bytes(lk.load_now("r"))
        for _ in range(3):
            assert tensor_bytes(lk.load_now("r")) == first
        assert [v for v in counted if v] == [True]  # one checksum pass
        assert lk.take_interval().get("checksums") == 1
        time.sleep(0.02)
        put(store, "r", seed=2)  # a new version: hashed again
        assert tensor_bytes(lk.load_now("r")) != first
        assert [v for v in counted if v] == [True, True]
    finally:
        lk.close()


def test_in_place_corruption_of_a_verified_file_is_caught(tmp_path):
    """A write into the file changes its version (mtime/ctime), so the next load hashes
    it again and the flipped byte makes it a miss."""
    store = DiskStore(tmp_path, load_mode="read")
    put(store, "c")
    lk = make(store)
    try:
        assert lk.load_now("c") is not None
        time.sleep(0.02)
        path = store.entry_path("c")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        assert lk.load_now("c") is None
        assert lk.take_interval().get("load_errors") == 1
    finally:
        lk.close()


def test_verify_always_hashes_every_load(tmp_path, counted):
    store = DiskStore(tmp_path)
    put(store, "a")
    lk = make(store, verify="always")
    try:
        for _ in range(3):
            assert lk.load_now("a") is not None
        assert counted == [True, True, True]
    finally:
        lk.close()


def test_verify_off_still_parses_once(tmp_path, counted):
    store = DiskStore(tmp_path)
    put(store, "n")
    lk = make(store, verify=False)
    try:
        lk.load_now("n")
        lk.load_now("n")
        assert counted == [False]
    finally:
        lk.close()


def test_same_version_other_identifier_is_not_reused(tmp_path, counted):
    """The cache is keyed by version *and* identifier (a hard link under another name
    must still be checked against the identifier it is loaded as)."""
    store = DiskStore(tmp_path)
    put(store, "one")
    (tmp_path / "two").mkdir()
    os.link(tmp_path / "one" / ENTRY_FILE, tmp_path / "two" / ENTRY_FILE)
    lk = make(store)
    try:
        assert lk.load_now("one") is not None
        assert lk.load_now("two") is None  # header says "one": wrong identifier, a miss
    finally:
        lk.close()


@pytest.mark.parametrize("value,expected", [
    (True, (True, False)), (False, (False, False)), ("always", (True, True)),
    ("true", (True, False)), ("off", (False, False)), ("ALWAYS", (True, True)),
])
def test_parse_verify(value, expected):
    assert parse_verify(value) == expected


def test_parse_verify_rejects_nonsense():
    with pytest.raises(ValueError, match="verify must be"):
        parse_verify("sometimes")


def test_access_time_updates_do_not_force_a_rehash(tmp_path, counted):
    """Idle past the access-time update interval: the LRU refresh (os.utime on the open
    entry) must move atime but keep the verified version, so later loads skip the hash.
    Uses the real mechanism with a short interval (the default is a minute)."""
    store = DiskStore(tmp_path, access_resolution_s=0.2)
    put(store, "idle", rows=MMAP_MIN_BYTES // 16)  # 2 MiB: mapped
    put(store, "small", rows=16)  # read, not mapped
    path = store.entry_path("idle")
    lk = make(store)
    try:
        for ident in ("idle", "small"):
            assert lk.load_now(ident) is not None
        assert counted == [True, True]
        before = os.stat(path)
        for _ in range(3):
            time.sleep(0.3)  # past the update interval
            for ident in ("idle", "small"):
                assert lk.load_now(ident) is not None
        after = os.stat(path)
        assert after.st_atime_ns > before.st_atime_ns  # the LRU clock did move
        assert after.st_ctime_ns > before.st_ctime_ns  # (utime changes ctime)
        assert after.st_mtime_ns == before.st_mtime_ns  # but not what a writer sets
        assert counted == [True, True]  # and no entry was hashed again
        time.sleep(0.02)
        put(store, "idle", rows=MMAP_MIN_BYTES // 16, seed=5)  # a writer's new version still is
        assert lk.load_now("idle") is not None
        assert counted == [True, True, True]
    finally:
        lk.close()


def test_a_restarted_consumer_trusts_versions_verified_since_boot(tmp_path, counted,
                                                                   monkeypatch):
    """What one consumer checksummed, a restarted one (a new store handle and lookup, as
    after vLLM's SIGKILL) loads without a checksum -- beyond the start-up budget too, and
    for a big entry inline. A version changed since (rewritten in place, replaced) is
    hashed again and a corrupt rewrite is still a miss; ``remember_verified: false``,
    ``verify: always`` and another boot trust nothing."""
    store = DiskStore(tmp_path)
    put(store, "small", seed=1)
    put(store, "big", rows=MMAP_MIN_BYTES // 16, seed=2)
    put(store, "changed", seed=3)
    put(store, "replaced", seed=4)
    first = make(store)
    try:
        for ident in ("small", "big", "changed", "replaced"):
            assert first.load_now(ident) is not None
        assert counted == [True] * 4
    finally:
        first.close()
    path = store.entry_path("changed")  # rewritten in place with the same length: corrupt
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    put(DiskStore(tmp_path), "replaced", seed=5)  # another writer's new version

    counted.clear()
    again = make(DiskStore(tmp_path))  # no start-up pass: everything is beyond its budget
    try:
        assert again.start_verify_done.wait(30)
        assert again.request("big", inline=True) is State.READY  # not deferred: trusted
        assert again.load_now("small") is not None
        assert counted == [False, False]  # header and size checks only
        assert again.verified.trusted_loads == 2
        assert again.load_now("changed") is None  # a new mtime: hashed, and corrupt
        assert again.load_now("replaced") is not None
        assert counted[2:] == [True, True]
    finally:
        again.close()
    counters = DiskStore(tmp_path).read_counters()  # what `encache stats` shows
    assert (counters["checksums"], counters["checksums_skipped"]) == (5, 2)

    for kw in ({"remember_verified": False}, {"verify": "always"}):
        counted.clear()
        other = make(DiskStore(tmp_path), **kw)
        try:
            assert other.start_verify_done.wait(30)
            assert other.load_now("small") is not None and counted == [True], kw
        finally:
            other.close()
    counted.clear()
    from encache.connectors.store import verified_log
    (tmp_path / "boot_id").write_text("another-boot\n")
    monkeypatch.setattr(verified_log, "BOOT_ID_PATH", str(tmp_path / "boot_id"))
    rebooted = make(DiskStore(tmp_path))
    try:
        assert rebooted.start_verify_done.wait(30)
        assert rebooted.load_now("small") is not None and counted == [True]
    finally:
        rebooted.close()


def test_a_logged_version_rewritten_in_place_with_its_mtime_put_back_is_hashed(tmp_path,
                                                                              counted):
    """Silent corruption staged by hand: same inode, same size, the old mtime restored.
    The log binds the inode's change time, which user space cannot set back, so a
    restarted consumer hashes the entry, finds it corrupt and misses."""
    store = DiskStore(tmp_path)
    put(store, "e", rows=MMAP_MIN_BYTES // 16, seed=1)
    first = make(store)
    try:
        assert first.load_now("e") is not None and counted == [True]
    finally:
        first.close()
    path = store.entry_path("e")
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size,
                                                                 st.st_mtime_ns)
    counted.clear()
    again = make(DiskStore(tmp_path))
    try:
        assert again.start_verify_done.wait(30)
        assert again.load_now("e") is None and counted == [True]
        assert again.miss_reason("e") == "corrupt"
    finally:
        again.close()


def test_the_access_time_refresh_keeps_a_version_trusted_across_restarts(tmp_path, counted):
    """The store's LRU clock (``os.utime``) moves ctime; the consumer that refreshed it
    records the new ctime of the version it verified, so the next consumer still trusts
    it. Without that record it would hash it again."""
    store = DiskStore(tmp_path, access_resolution_s=0.05)
    put(store, "e", seed=1)
    first = make(store)
    try:
        assert first.load_now("e") is not None
        before = os.stat(store.entry_path("e")).st_ctime_ns
        time.sleep(0.2)
        assert first.load_now("e") is not None  # refreshes the access time
        assert os.stat(store.entry_path("e")).st_ctime_ns != before
        assert counted == [True]
    finally:
        first.close()
    counted.clear()
    again = make(DiskStore(tmp_path))
    try:
        assert again.start_verify_done.wait(30)
        assert again.load_now("e") is not None and counted == [False]
    finally:
        again.close()


def test_after_encache_verify_consumers_load_without_hashing(tmp_path, counted):
    """``verify_store`` (``encache verify``) records each entry whose checksum passed:
    a consumer started afterwards trusts them; the corrupt one is still hashed and missed."""
    from encache.connectors.store.ops.verify import verify_store
    store = DiskStore(tmp_path)
    for i in range(3):
        put(store, f"e{i}", seed=i)
    bad = bytearray(put(store, "bad", seed=9))
    bad[-1] ^= 0xFF
    with open(store.entry_path("bad"), "r+b") as f:
        f.write(bytes(bad))
    report = verify_store(DiskStore(tmp_path))
    assert report.checked == 4 and [f.identifier for f in report.problems] == ["bad"]
    lk = make(DiskStore(tmp_path))
    try:
        assert lk.start_verify_done.wait(30)
        for i in range(3):
            assert lk.load_now(f"e{i}") is not None
        assert counted == [False, False, False]
        assert lk.load_now("bad") is None and counted[3:] == [True]
    finally:
        lk.close()


def test_entries_a_producer_on_this_host_encoded_need_no_checksum(tmp_path, counted):
    """A producer's writer (``EntryWriter``: the codec made the bytes and their checksum
    in that process) records what it wrote in the store's verified log: a consumer on the
    same host loads those versions without hashing them. Bytes stored by a plain ``put``
    (a copy from elsewhere: ``warm``, ``rsync``) are hashed; so is a later version."""
    from encache.connectors.vllm.writer import EntryWriter
    store = DiskStore(tmp_path)
    arr = np.random.default_rng(7).standard_normal((4096, 16)).astype(np.float16)
    writer = EntryWriter(store)
    writer.submit("made", lambda: (arr.view(np.uint8), "F16", arr.shape), arr.nbytes, model="m")
    assert writer.flush(30)
    writer.close()
    assert writer.counters.get("saves") == 1
    put(store, "copied", seed=8)
    lk = make(DiskStore(tmp_path))
    try:
        assert lk.start_verify_done.wait(30)
        assert tensor_bytes(lk.load_now("made")) == arr.tobytes()
        assert counted == [False]  # trusted: header and size checks only
        assert lk.load_now("copied") is not None and counted == [False, True]
    finally:
        lk.close()
    put(DiskStore(tmp_path), "made", seed=9)  # a new version, not this host's encoding
    counted.clear()
    lk = make(DiskStore(tmp_path))
    try:
        assert lk.start_verify_done.wait(30)
        assert lk.load_now("made") is not None and counted == [True]
    finally:
        lk.close()


PRODUCER = """
import sys
import numpy as np
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.vllm.writer import EntryWriter
store = DiskStore(sys.argv[1])
writer = EntryWriter(store)
for n, ident in enumerate(sys.argv[2:]):
    arr = np.full((4096, 16), n + 1, np.float16)
    writer.submit(ident, lambda arr=arr: (arr.view(np.uint8), "F16", arr.shape), arr.nbytes,
                  model="m")
assert writer.flush(30)
writer.close()
"""


def _produce(root, *identifiers):
    """Another process encodes ``identifiers`` into the store at ``root`` (EntryWriter)."""
    import subprocess
    import sys
    subprocess.run([sys.executable, "-c", PRODUCER, str(root), *identifiers], check=True,
                   timeout=120)


def test_a_running_consumer_trusts_what_a_producer_on_this_host_commits_meanwhile(tmp_path,
                                                                                  counted):
    """EPD on one host: the encoder (another process) commits entries while the prefill
    instance runs; the prefill instance's first loads of them are not hashed a second
    time (it reads the log's new records). A version changed after the record (rewritten
    in place) is hashed and, corrupt, a miss; a plain ``put`` (bytes from elsewhere) is
    hashed."""
    store = DiskStore(tmp_path)
    put(store, "before", seed=1)
    lk = make(DiskStore(tmp_path))
    try:
        assert lk.start_verify_done.wait(30)
        _produce(tmp_path, "e1", "e2", "e3")
        put(DiskStore(tmp_path), "copied", seed=2)
        assert tensor_bytes(lk.load_now("e1")) == np.full((4096, 16), 1, np.float16).tobytes()
        assert lk.request("e2", inline=True) is State.READY  # big, yet not deferred: trusted
        assert counted == [False, False]
        assert lk.verified.trusted_loads == 2
        assert lk.load_now("copied") is not None and counted[2:] == [True]
        path = store.entry_path("e3")  # changed in place after the encoder recorded it
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        assert lk.load_now("e3") is None and counted[3:] == [True]
        _produce(tmp_path, "e4")  # later records are read as well
        assert lk.load_now("e4") is not None and counted[4:] == [False]
    finally:
        lk.close()


def test_a_log_replaced_under_a_running_consumer_is_loaded_again(tmp_path, counted):
    """Another process compacted the log (a new file) after this consumer loaded it: the
    consumer loads the new file and goes on following it."""
    from encache.connectors.store import verified_log
    lk = make(DiskStore(tmp_path))
    try:
        assert lk.start_verify_done.wait(30)
        _produce(tmp_path, "e1")
        assert lk.load_now("e1") is not None and counted == [False]
        log = lk.verified.log
        old = os.stat(log.path).st_ino
        verified_log.VerifiedLog(log.directory, log.path.name)._replace(log.path.read_bytes())
        assert os.stat(log.path).st_ino != old
        _produce(tmp_path, "e2")
        assert lk.load_now("e2") is not None and counted == [False, False]
        _produce(tmp_path, "e3")
        assert lk.load_now("e3") is not None and counted == [False, False, False]
    finally:
        lk.close()
