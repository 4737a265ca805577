"""DiskStore's buffers of recently served versions (connectors/store/disk/recent.py): a repeat
load of an unchanged entry reuses the buffer (no open, no map, no read), while a
replacement, an in-place write, a delete, access tracking and the bounds behave as
without the reuse."""

from __future__ import annotations

import os
import time

import numpy as np

from encache.connectors.store.disk.store import MMAP_MIN_BYTES, DiskStore
from encache.connectors.store.entry import decode
from encache.connectors.store.disk.recent import RecentBuffers
from store_contract import blob

SMALL, LARGE = 64, MMAP_MIN_BYTES // 16 + 64  # rows of 8 F16: 1 KiB and just over 1 MiB


def _bytes(buf) -> bytes:
    return bytes(memoryview(buf).cast("B"))


def test_repeat_load_reuses_the_buffer_without_opening(tmp_path, monkeypatch):
    store = DiskStore(tmp_path)
    assert store.mapped_loads
    for ident, n in (("small", SMALL), ("large", LARGE)):
        b = blob(ident, n=n)
        store.put(ident, b)
        first, v1 = store.read_entry(ident)
        opened = []
        real_open = os.open
        monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
        again, v2 = store.read_entry(ident)
        monkeypatch.setattr(os, "open", real_open)
        assert again is first and v1 == v2 and opened == []
        assert _bytes(again) == b


def test_replaced_written_in_place_and_deleted_entries_are_never_served_stale(tmp_path):
    store = DiskStore(tmp_path)
    for ident, n in (("small", SMALL), ("large", LARGE)):
        b1, b2, b4 = (blob(ident, n=n, seed=s) for s in (1, 2, 4))
        store.put(ident, b1)
        old, v1 = store.read_entry(ident)
        store.put(ident, b2)  # rename over: a new inode
        new, v2 = store.read_entry(ident)
        assert new is not old and v2 != v1
        assert _bytes(new) == b2
        assert _bytes(old) == b1  # a held buffer keeps its bytes
        # a foreign program writing in place (same inode, new mtime) is a new version
        path = store.entry_path(ident)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        with open(path, "r+b") as f:
            f.write(data)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        third, v3 = store.read_entry(ident)
        assert v3 != v2 and _bytes(third) == bytes(data)
        # removed by another process (not through this store object): a miss
        os.unlink(path)
        assert store.read_entry(ident) is None
        store.put(ident, b4)
        assert _bytes(store.read_entry(ident)[0]) == b4
        assert store.delete(ident) and store.read_entry(ident) is None


def test_access_time_is_still_refreshed_and_keeps_the_version(tmp_path):
    store = DiskStore(tmp_path, access_resolution_s=0.2)
    store.put("k", blob("k", n=LARGE))
    buf, v1 = store.read_entry("k")
    path = store.entry_path("k")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns - 10**10, st.st_mtime_ns))  # atime 10 s old
    time.sleep(0.25)
    again, v2 = store.read_entry("k")
    assert again is buf and v2 == v1  # same version, same buffer
    assert os.stat(path).st_atime_ns > st.st_atime_ns - 10**9  # refreshed (the LRU clock)


def test_read_mode_and_get_do_not_reuse(tmp_path):
    store = DiskStore(tmp_path, load_mode="read")
    store.put("k", blob("k"))
    assert store.read_entry("k")[0] is not store.read_entry("k")[0]
    store = DiskStore(tmp_path)
    assert store.get("k") is not store.get("k")  # get: a fresh writable copy each time
    off = DiskStore(tmp_path, reuse_buffers=False)
    assert off.read_entry("k")[0] is not off.read_entry("k")[0]


def test_decode_of_a_reused_buffer_validates(tmp_path):
    store = DiskStore(tmp_path)
    store.put("k", blob("k", n=LARGE))
    store.read_entry("k")
    meta, data = decode(store.read_entry("k")[0], identifier="k")
    assert meta.shape == (LARGE, 8) and data.nbytes == LARGE * 16


def test_bounds_items_bytes_and_age():
    r = RecentBuffers(max_items=2, read_bytes=100, mapped_bytes=100, max_age_s=60)
    a, b, c = (np.zeros(40, np.uint8) for _ in range(3))
    r.put("a", 1, a)
    r.put("b", 1, b)
    r.put("c", 1, c)  # over max_items: the least recently used goes
    assert r.get("a", 1)[0] is None and r.get("b", 1)[0] is b and r.get("c", 1)[0] is c
    r.put("d", 1, np.zeros(40, np.uint8))  # 120 bytes > 100: LRU ("b") goes
    assert r.get("b", 1)[0] is None and len(r) == 2
    r.put("big", 1, np.zeros(101, np.uint8))  # larger than the budget: never kept
    assert r.get("big", 1)[0] is None
    assert r.get("c", 2)[0] is None and r.get("c", 1)[0] is None  # other version: dropped
    old = RecentBuffers(max_age_s=0.05)
    old.put("x", 1, a)
    time.sleep(0.1)
    old.put("y", 1, b)  # an insert sweeps items unused for longer than max_age_s
    assert old.get("x", 1)[0] is None and old.get("y", 1)[0] is b


def test_eviction_and_delete_drop_the_held_buffer(tmp_path):
    store = DiskStore(tmp_path, max_bytes=3 * (LARGE * 16 + 4096), low_watermark=0.5)
    store.put("a", blob("a", n=LARGE))
    store.read_entry("a")
    path = str(store.entry_path("a"))
    assert store._recent.get(path, store.read_entry("a")[1])[0] is not None
    for k in "bcde":  # over capacity: "a" (least recently used) is evicted
        store.put(k, blob(k, n=LARGE))
    assert not os.path.exists(path)
    assert all(p != path for p in store._recent._items)  # before any read noticed it
    assert store.read_entry("a") is None
    store.read_entry("e")
    assert any(p.endswith("/e/encoder_cache.safetensors") for p in store._recent._items)
    store.delete("e")
    assert all(not p.endswith("/e/encoder_cache.safetensors") for p in store._recent._items)


def test_expired_buffers_go_on_lookups_too():
    r = RecentBuffers(max_age_s=0.05)
    a = np.zeros(4, np.uint8)
    r.put("x", 1, a)
    time.sleep(0.1)
    assert r.get("other", 1)[0] is None and len(r) == 0  # a lookup of anything sweeps


def test_maintain_drops_buffers_of_entries_other_processes_changed(tmp_path):
    """Another process (here: another store object, which shares no buffers) purges one
    entry and replaces another; ``maintain()`` (the consumer's index thread) drops exactly
    their kept buffers and keeps the unchanged one, without waiting for max_age_s."""
    mine, other = DiskStore(tmp_path), DiskStore(tmp_path)
    for k in ("keep", "gone", "new"):
        mine.put(k, blob(k, n=LARGE))
        mine.read_entry(k)
    held = lambda: sorted(p.split("/")[-2] for p in mine._recent._items)  # noqa: E731
    assert held() == ["gone", "keep", "new"]
    mine.maintain()
    assert held() == ["gone", "keep", "new"]  # nothing changed: all kept
    other.delete("gone")
    other.put("new", blob("new", n=LARGE, seed=7))  # a new inode under the same path
    mine.maintain()
    assert held() == ["keep"]
    buf, _ = mine.read_entry("new")  # the new version is read, and kept again
    assert _bytes(buf) == _bytes(other.read_entry("new")[0]) and held() == ["keep", "new"]


def test_sweep_keeps_a_buffer_re_read_during_it():
    """A stale verdict about an old version never drops the new version a load put there
    while the sweep was stat'ing outside the lock."""
    r = RecentBuffers()
    a, b = np.zeros(4, np.uint8), np.ones(4, np.uint8)
    r.put("p", (1, 1, 4, 1), a)

    def racing_stat(path):
        r.put("p", (1, 2, 4, 2), b)  # a load of the replacement, mid-sweep
        raise FileNotFoundError(path)
    assert r.sweep(stat=racing_stat) == 0
    assert r.get("p", (1, 2, 4, 2))[0] is b
