"""EntryLookup's load path: memory-mapped disk loads and verify-once-per-version.

The engine tests cover the lookup end to end; these pin down the two load-path rules
that make warm loads cheap without giving up integrity checks:

* a disk entry of at least ``map_min_bytes`` on a local filesystem is mapped, not copied,
  and the mapping stays valid when the entry is replaced or purged meanwhile;
* the checksum runs once per stored version; a rewritten file is verified again, and
  ``verify="always"`` hashes every load.
"""

from __future__ import annotations

import mmap
import os
import time
from functools import partial

import numpy as np
import pytest

from encache.connectors.lookup import loader as lookup_mod  # where the load path reads and validates
from encache.connectors.lookup import EntryLookup, State, parse_verify
from encache.connectors.store import encode, open_store
from encache.connectors.store.disk import (ENTRY_FILE, MMAP_MIN_BYTES, MMAP_MIN_BYTES_KEPT,
                                           DiskStore)
from encache.connectors.vllm.config import ConnectorConfig
from entries import put_entry


put = partial(put_entry, rows=4096, width=16)  # 32 bytes a row: 128 KiB by default


@pytest.fixture
def counted(monkeypatch):
    """Count full validations (header parse + checksum) done by the lookup: of a buffer
    (``validate_blob``, the lookup's or the disk store's first-load check) or while
    reading a first load (``read_verified``)."""
    import encache.connectors.store.disk as disk_mod

    calls = []
    real, real_read = lookup_mod.validate_blob, disk_mod.read_verified

    def counting(blob, **kw):
        calls.append(kw.get("verify"))
        return real(blob, **kw)

    def counting_read(*args, **kw):
        calls.append(kw.get("verify"))
        return real_read(*args, **kw)
    monkeypatch.setattr(lookup_mod, "validate_blob", counting)
    monkeypatch.setattr(disk_mod, "validate_blob", counting)
    monkeypatch.setattr(disk_mod, "read_verified", counting_read)
    return calls


def make(store, **kw) -> EntryLookup:
    """A lookup for these tests: no periodic refresh, and no start-up verify-ahead unless
    a test asks (it would verify entries behind the test's back)."""
    kw.setdefault("index_refresh_s", 3600)
    kw.setdefault("verify_ahead_start_bytes", 0)
    return EntryLookup(store, counters_flush_s=3600, load_threads=1, **kw)


def tensor_bytes(staged) -> bytes:
    view = memoryview(staged.blob).cast("B")
    return bytes(view[staged.offset:staged.offset + staged.meta.data_bytes])


def test_large_disk_entries_are_mapped_small_ones_read(tmp_path):
    """``load_mode: auto`` maps entries from MMAP_MIN_BYTES_KEPT (64 KiB) when the store
    keeps served buffers (the default), from MMAP_MIN_BYTES (1 MiB) when it does not."""
    for store, limit in ((DiskStore(tmp_path), MMAP_MIN_BYTES_KEPT),
                         (DiskStore(tmp_path, reuse_buffers=False), MMAP_MIN_BYTES)):
        assert store.mapped_loads and store.map_min_bytes == limit  # a local filesystem
        big = put(store, "big", rows=limit // 32 + 64)  # just over the threshold
        put(store, "small", rows=16)  # 512 B
        assert len(big) >= limit
        put(store, "under", rows=limit // 32 - 64)  # just under: read
        lk = make(store)
        try:
            assert isinstance(lk.load_now("big").blob, mmap.mmap)
            assert not isinstance(lk.load_now("small").blob, mmap.mmap)
            assert not isinstance(lk.load_now("under").blob, mmap.mmap)
            assert tensor_bytes(lk.load_now("big")) == big[-(limit // 32 + 64) * 16 * 2:]
        finally:
            lk.close()
    read_only = DiskStore(tmp_path, load_mode="read")
    assert not read_only.mapped_loads
    lk = make(read_only)
    try:
        assert not isinstance(lk.load_now("big").blob, mmap.mmap)
    finally:
        lk.close()


def test_mapped_entry_survives_replace_and_purge(tmp_path):
    """The rename commit point makes mapping safe: held bytes never change or vanish."""
    store = DiskStore(tmp_path)
    old = put(store, "e", seed=1)
    lk = make(store)
    try:
        staged = lk.load_now("e")
        before = tensor_bytes(staged)
        put(store, "e", seed=2)  # a producer rewrites the entry (rename over it)
        assert tensor_bytes(staged) == before == old[-len(before):]
        store.delete("e")  # and a purge removes it
        assert tensor_bytes(staged) == before
        assert lk.load_now("e") is None  # the store itself now misses
    finally:
        lk.close()


def test_checksum_runs_once_per_stored_version(tmp_path, counted):
    store = DiskStore(tmp_path)
    put(store, "v", seed=1)
    lk = make(store)
    try:
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


def test_connector_config_passes_load_mode(tmp_path):
    cfg = ConnectorConfig.from_extra({"store": str(tmp_path), "load_mode": "read"})
    store = open_store(cfg.store, **cfg.store_options())
    assert isinstance(store, DiskStore) and store.load_mode == "read" and not store.mapped_loads
    with pytest.raises(ValueError, match="load_mode"):
        DiskStore(tmp_path, load_mode="sometimes")


def test_store_wide_metrics_are_sampled(tmp_path):
    """Entries, bytes and capacity as gauges; evictions/saves by any writer as deltas."""
    for i in range(3):
        put(DiskStore(tmp_path), f"e{i}", seed=i)
    one = os.path.getsize(tmp_path / "e0" / ENTRY_FILE)
    store = DiskStore(tmp_path, max_bytes=int(3.5 * one))
    lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, store_stats_s=0.05)
    try:
        deadline = time.time() + 5
        data = {}
        while time.time() < deadline and "store_entries" not in data:
            time.sleep(0.05)
            data = lk.take_interval()
        assert data["store_entries"] == 3 and data["store_capacity_bytes"] == int(3.5 * one)
        assert data["store_bytes"] == 3 * one
        assert "store_evictions" not in data  # the first sample is only the baseline
        writer = DiskStore(tmp_path)  # another process's handle: it evicts to make room
        for i in range(3, 5):
            put(writer, f"e{i}", seed=i)
        seen: dict = {}
        deadline = time.time() + 5
        while time.time() < deadline and not seen.get("store_evictions"):
            time.sleep(0.05)
            for k, v in lk.take_interval().items():
                seen[k] = seen.get(k, 0) + v if k.startswith("store_e") or k.startswith("store_bytes_") else v
        assert seen.get("store_evictions", 0) >= 1
        assert seen.get("store_bytes_saved", 0) == 0  # DiskStore.put alone is not a producer save
    finally:
        lk.close()


def test_inline_request_loads_local_entries_at_once(tmp_path):
    from encache.connectors.lookup import State
    store = DiskStore(tmp_path)
    put(store, "here")
    lk = make(store)
    try:
        assert lk.request("here", inline=True) is State.READY  # no thread, no deferral
        assert lk.get_staged("here") is not None
        assert lk.request("absent", inline=True) is State.MISS
    finally:
        lk.close()


def test_inline_request_defers_big_unverified_entries(tmp_path):
    """A large entry's first load (a checksum over every page) runs in the background;
    once its version is verified, later inline requests map it at once."""
    from encache.connectors.lookup import INLINE_VERIFY_MAX, State
    store = DiskStore(tmp_path)
    b = put(store, "big", rows=INLINE_VERIFY_MAX // 32 + 64)  # > INLINE_VERIFY_MAX
    assert len(b) > INLINE_VERIFY_MAX
    lk = make(store, staging_bytes=1)  # keeps one staged entry: the newest
    try:
        lk.wait_index(5)
        assert lk.request("big", inline=True) is State.PENDING  # handed to a thread
        lk.wait(["big"], 5)
        assert lk.request("big", inline=True) is State.READY
        put(store, "other", rows=16)
        assert lk.request("other", inline=True) is State.READY  # small: inline; evicts "big"
        assert lk.get_staged("big") is None
        assert lk.request("big", inline=True) is State.READY  # verified version: inline
    finally:
        lk.close()


def test_inline_request_is_background_for_remote_stores(tmp_path, monkeypatch):
    """A store that is not local (Redis) is never read in the scheduler's thread."""
    from encache.connectors.lookup import State
    store = DiskStore(tmp_path)
    put(store, "far")
    monkeypatch.setattr(store, "local", False)
    monkeypatch.setattr(store, "mapped_loads", False)
    lk = make(store)
    try:
        lk.wait_index(5)
        assert lk.request("far", inline=True) is State.PENDING
        lk.wait(["far"], 5)
        assert lk.request("far", inline=True) is State.READY
    finally:
        lk.close()


def _resident_fraction(m: mmap.mmap) -> float:
    """Share of a mapping's pages in memory (mincore(2) via ctypes)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    n = (len(m) + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(len(m)), vec) == 0
    return sum(v & 1 for v in vec) / n


def test_prefault_starts_reading_a_cold_mapped_entry(tmp_path):
    """A verified version is mapped without reading it; prefault must start the disk
    reads at once so the model step does not page-fault them in."""
    from encache.connectors.store.files import prefault
    store = DiskStore(tmp_path)  # fsync'ed writes: clean pages the kernel may drop
    put(store, "cold", rows=32768)  # 1 MiB
    path = store.entry_path("cold")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    buf, _ = store.read_entry("cold")
    assert isinstance(buf, mmap.mmap)
    if _resident_fraction(buf) > 0.5:
        pytest.skip("the kernel kept the pages cached; cannot observe readahead")
    prefault(buf)
    deadline = time.time() + 5
    while time.time() < deadline and _resident_fraction(buf) < 0.9:
        time.sleep(0.01)
    assert _resident_fraction(buf) >= 0.9
    prefault(np.zeros(4, np.uint8))  # not a mapping: nothing to do, no error


def test_lookup_prefaults_verified_versions_idle_for_a_while(tmp_path, monkeypatch):
    """Readahead is for entries not loaded recently (their pages may be gone); a load
    right after the last one skips the syscall."""
    calls = []
    monkeypatch.setattr(lookup_mod, "prefault", lambda buf: calls.append(buf))
    monkeypatch.setattr(lookup_mod, "PREFAULT_AFTER_S", 0.2)
    store = DiskStore(tmp_path)
    put(store, "p", rows=MMAP_MIN_BYTES // 32 + 64)  # mapped
    lk = make(store)
    try:
        lk.load_now("p")  # first load: verified by hashing every page, no readahead
        lk.load_now("p")  # just loaded: pages are cached
        assert calls == []
        time.sleep(0.3)
        lk.load_now("p")  # idle for longer than PREFAULT_AFTER_S
        assert len(calls) == 1 and isinstance(calls[0], mmap.mmap)
    finally:
        lk.close()


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


def test_verify_ahead_hashes_new_entries_before_their_first_load(tmp_path, counted):
    """An entry written while the consumer runs is verified by the background index
    refresh, so its first request-path load does no checksum; entries present at start
    are not hashed ahead (start-up budget 0); a corrupt new entry is still a miss when
    loaded."""
    store = DiskStore(tmp_path)
    put(store, "old")
    lk = make(store, index_refresh_s=0.05, verify_ahead_start_bytes=0)
    try:
        assert lk.wait_index(5)
        time.sleep(0.3)
        assert counted == []  # nothing hashed ahead at start
        put(store, "new", seed=3)
        bad = bytearray(encode("bad", np.ones((64, 16), np.float16).view(np.uint8), "F16",
                               (64, 16), model="m"))
        bad[-1] ^= 0xFF
        store.put("bad", bytes(bad))
        deadline = time.time() + 30  # both checked in the background (order unknown)
        while time.time() < deadline and (lk.verified_count(["new"]) < 1
                                          or counted.count(True) < 2):
            time.sleep(0.02)
        assert lk.verified_count(["new", "bad", "old"]) == 1
        assert counted.count(True) == 2  # "new" and "bad" were checked ahead
        assert lk.load_now("new") is not None
        assert counted.count(True) == 2  # first load: no checksum on the request path
        assert lk.load_now("bad") is None  # the bad one is hashed again and refused
        assert lk.take_interval().get("load_errors") == 1
        assert lk.load_now("old") is not None and counted.count(True) == 4
    finally:
        lk.close()
    off = make(store, index_refresh_s=0.05, verify_ahead=False)
    try:
        assert off.wait_index(5)
        put(store, "later", seed=4)
        time.sleep(0.4)
        assert off.verified_count(["later"]) == 0
    finally:
        off.close()


def _set_atime(store, ident: str, atime_s: float) -> None:
    """Set an entry's access clock the way the store does (mtime_ns kept: same version)."""
    path = store.entry_path(ident)
    os.utime(path, ns=(int(atime_s * 1e9), os.stat(path).st_mtime_ns))


def test_start_up_verify_ahead_takes_the_most_recently_used_entries_first(tmp_path, counted):
    """A restarted consumer verifies, in the background, the entries used most recently
    (the store's access clock) that this engine can use (its model), newest first, until
    the byte budget is spent; their first request-path loads then do no checksum. Older
    entries and other models' are left to the request path; a corrupt recent entry uses
    budget, is not remembered, and its load is still a miss."""
    store = DiskStore(tmp_path)
    now = time.time()
    for i in range(6):
        put(store, f"e{i}", seed=i)
        _set_atime(store, f"e{i}", now - 600 + 60 * i)  # e5 used last
    arr = np.ones((4096, 16), np.float16)
    store.put("other", encode("other", arr.view(np.uint8), "F16", arr.shape, model="another"))
    _set_atime(store, "other", now)  # newest of all, but not this engine's model
    bad = bytearray(encode("bad", arr.view(np.uint8), "F16", arr.shape, model="m"))
    bad[-1] ^= 0xFF
    store.put("bad", bytes(bad))
    _set_atime(store, "bad", now - 1)
    size = os.path.getsize(store.entry_path("e0"))
    assert os.path.getsize(store.entry_path("bad")) == size

    lk = make(store, verify_ahead_start_bytes=3 * size + size // 2, model="m")
    try:
        assert lk.start_verify_done.wait(30)
        assert counted == [True, True, True]  # bad, e5, e4: the budget holds three
        assert lk.verified_at_start == 2
        assert lk.verified_count(["e5", "e4"]) == 2
        assert lk.verified_count(["e0", "e1", "e2", "e3", "other", "bad"]) == 0
        assert lk.load_now("e5") is not None and lk.load_now("e4") is not None
        assert len(counted) == 3  # their first loads did no checksum
        assert lk.load_now("e3") is not None and len(counted) == 4  # beyond the budget
        assert lk.load_now("bad") is None and len(counted) == 5  # corrupt: still a miss
    finally:
        lk.close()
    counted.clear()
    for kw in ({"verify_ahead": False}, {"verify_ahead_start_bytes": 0}, {"verify": "always"}):
        off = make(store, model="m", **{"verify_ahead_start_bytes": 1 << 30, **kw})
        try:
            assert off.start_verify_done.wait(30)
            assert counted == [] and off.verified_count(["e5"]) == 0, kw
        finally:
            off.close()


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


def _present_fraction(m: mmap.mmap) -> float:
    """Fraction of a mapping's pages with a page-table entry (/proc/self/pagemap bit 63)."""
    import ctypes
    import struct
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    n = (len(m) + 4095) // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // 4096 * 8)
        data = f.read(n * 8)
    return sum(struct.unpack_from("<Q", data, 8 * i)[0] >> 63 for i in range(n)) / n


def _populate_works(tmp_path) -> bool:
    path = tmp_path / "probe"
    path.write_bytes(b"\0" * 8192)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        m.madvise(22)
        return _present_fraction(m) == 1.0
    except (OSError, ValueError):
        return False
    finally:
        m.close()


def test_start_up_pass_maps_every_page_of_a_trusted_entry(tmp_path):
    """A restarted consumer's start-up pass skips the checksum of a version verified
    earlier this boot, yet still leaves its kept mapping fully mapped (as the hash pass
    did), so the first request's copy takes no page faults (benchmarks/load.json:
    first.restart)."""
    if not os.path.exists("/proc/self/pagemap") or not _populate_works(tmp_path):
        pytest.skip("needs /proc/self/pagemap and MADV_POPULATE_READ (Linux 5.14+)")
    from encache.connectors.store.files import file_version
    store = DiskStore(tmp_path / "s")
    put(store, "e", rows=MMAP_MIN_BYTES // 4, seed=3)  # 8 MiB: more than one folio
    first = make(store)
    try:
        assert first.load_now("e") is not None
    finally:
        first.close()
    again_store = DiskStore(tmp_path / "s")
    again = make(again_store, verify_ahead_start_bytes=1 << 30)
    try:
        assert again.start_verify_done.wait(30) and again.verified.trusted_loads == 1
        path = str(again_store.entry_path("e"))
        kept, _ = again_store._recent.get(path, file_version(os.stat(path)))
        assert isinstance(kept, mmap.mmap)  # kept for the first request
        assert _present_fraction(kept) == 1.0
    finally:
        again.close()


def test_after_encache_verify_consumers_load_without_hashing(tmp_path, counted):
    """``verify_store`` (``encache verify``) records each entry whose checksum passed:
    a consumer started afterwards trusts them; the corrupt one is still hashed and missed."""
    from encache.connectors.store.verify import verify_store
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
    from encache.connectors.writer import EntryWriter
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


def test_circuit_breaker_backs_off_and_closes():
    """A store error opens the breaker for 1 s, doubling per consecutive failure up to
    30 s; a success closes it at once."""
    from encache.connectors.lookup.breaker import CircuitBreaker

    b = CircuitBreaker()
    assert not b.is_open()
    now = time.monotonic()
    b.trip()
    assert b.is_open() and not b.is_open(now + 1.5)  # 1 s
    for _ in range(3):
        b.trip()
    assert b.is_open(now + 7.5) and not b.is_open(now + 8.5)  # 1, 2, 4, 8 s
    for _ in range(10):
        b.trip()
    assert b.is_open(now + 29.5) and not b.is_open(now + 31)  # capped at 30 s
    b.reset()
    assert not b.is_open()


def test_staging_is_a_byte_bounded_lru_that_keeps_the_newest():
    from encache.connectors.lookup.staging import Staged, StagingArea

    def st(name, n):
        return Staged(name, None, bytearray(n), 0, 0.0)

    area = StagingArea(max_bytes=100)
    area.add(st("a", 40))
    area.add(st("b", 40))
    assert area.touch("a")  # a is now the most recently used
    area.add(st("c", 40))  # over the bound: the least recently used (b) goes
    assert "a" in area and "c" in area and "b" not in area and area.nbytes == 80
    area.add(st("big", 500))  # alone over the bound: kept, everything else goes
    assert area.get("big") is not None and "a" not in area and area.nbytes == 500
    area.discard("big")
    assert area.nbytes == 0 and not area.touch("big")
