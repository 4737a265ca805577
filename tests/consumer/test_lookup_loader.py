"""Tests for :mod:`encache.connectors.lookup.loader`: mapped and read loads, inline loads,
prefault, verify ahead (new entries and the start-up pass)."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

from encache.connectors.lookup import loader as lookup_mod  # where the load path reads and validates
from encache.connectors.store import encode, open_store
from encache.connectors.store.disk.store import MMAP_MIN_BYTES, MMAP_MIN_BYTES_KEPT, DiskStore
from encache.connectors.vllm.config import ConnectorConfig
from lookup_support import make, put, tensor_bytes


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


def test_connector_config_passes_load_mode(tmp_path):
    cfg = ConnectorConfig.from_extra({"store": str(tmp_path), "load_mode": "read"})
    store = open_store(cfg.store, **cfg.store_options())
    assert isinstance(store, DiskStore) and store.load_mode == "read" and not store.mapped_loads
    with pytest.raises(ValueError, match="load_mode"):
        DiskStore(tmp_path, load_mode="sometimes")


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


@pytest.mark.redis
def test_loads_that_read_the_bytes_anyway_check_them_as_they_read(redis_server, tmp_path):
    """A load from Redis, and a load through a local tier that no longer holds its copy
    (of an identifier this consumer served from that copy before), is the one-pass
    ``read_verified`` (received and checked together), never ``read_entry`` then a
    validation pass."""
    import uuid

    store = open_store(redis_server.url, prefix=f"t-{uuid.uuid4().hex[:8]}:",
                       local_tier=str(tmp_path / "tier"))
    data = put(store, "e", rows=4096)
    calls: list[str] = []
    for name in ("read_entry", "read_verified"):
        real = getattr(store, name)
        setattr(store, name,
                lambda *a, _n=name, _r=real, **kw: (calls.append(_n), _r(*a, **kw))[1])
    lk = make(store)
    try:
        def load() -> list[str]:
            calls.clear()
            staged = lk.load_now("e")
            assert staged is not None and tensor_bytes(staged) == data[-4096 * 16 * 2:]
            return list(calls)

        assert load() == ["read_verified"]  # remote, written behind
        store.flush()
        assert store.sync()  # (a copy that raced the start-up sync is served once checked)
        assert store.holds_locally("e")
        load()  # served from the tier's copy: this consumer has seen it
        assert store.stats["local_reads"] == 1
        store.tier.delete("e")  # the copy is gone (evicted, dropped by a sync)
        assert load() == ["read_verified"]  # remote again: received and checked at once
        assert store.stats["remote_reads"] == 2
    finally:
        lk.close()
        store.close()


def test_a_load_without_shared_memory_is_still_a_hit(tmp_path, monkeypatch):
    """``shared_from``: an entry that is read (``load_mode: read`` here, as Redis or a
    network filesystem) goes into shared memory from that size; when no memfd can be had
    (descriptors exhausted) it goes into private memory, one warning, still a hit."""
    import errno

    from encache.connectors.store.memfd import SharedBuffer

    store = DiskStore(tmp_path, load_mode="read")
    data = put(store, "big", rows=4096)
    put(store, "small", rows=16)
    lk = make(store, shared_from=64 << 10)
    try:
        assert isinstance(lk.load_now("big").blob, SharedBuffer)
        assert not isinstance(lk.load_now("small").blob, SharedBuffer)

        def exhausted(n):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(lookup_mod, "shared_buffer", exhausted)
        lk.verified.forget_all()
        staged = lk.load_now("big")
        assert not isinstance(staged.blob, SharedBuffer)
        assert tensor_bytes(staged) == data[-4096 * 16 * 2:]
    finally:
        lk.close()
