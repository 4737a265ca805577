"""``--over-capacity skip``'s room budget on a real disk store: exact on a small store
(re-read before every batch, another writer's entries seen at once), and on a store
whose usage is costly to sum it re-reads rarely, counting what it let in meanwhile, so
it still stops at the watermark and never makes the store evict."""

from __future__ import annotations

import time
from functools import partial

from encache.jobs.precompute.capacity import RoomBudget
from encache.connectors.store.disk.store import DiskStore
from entries import put_entry


put = partial(put_entry, width=16, fill=0.0)  # 64 x 16 zeros: all entries the same size


def ident(i):
    return f"{i:064x}"


def entry_bytes(tmp_path):
    probe = DiskStore(tmp_path / "probe", fsync=False)
    put(probe, ident(0))
    return probe.used_bytes()


def test_a_small_store_is_read_before_every_batch_and_sees_other_writers(tmp_path):
    one = entry_bytes(tmp_path)
    store = DiskStore(tmp_path / "s", max_bytes=one * 20, fsync=False, low_watermark=0.5)
    budget = RoomBudget(store, store.max_bytes, store.low_watermark, mean_bytes=one)
    assert budget.fits(4) == 4
    for i in range(4):
        put(store, ident(i))
    other = DiskStore(tmp_path / "s", fsync=False)  # another process's writes
    for i in range(100, 105):
        put(other, ident(i))
    # 9 stored, room for 10 under the watermark: one more fits, and it is seen at once
    assert budget.fits(4) == 1
    assert budget.reads == 2


def test_a_costly_usage_figure_is_read_rarely_and_the_watermark_still_holds(tmp_path):
    """Summing the usage stats every entry (seconds at a million); here a store of 3,000
    entries costs a few ms, and a run asking before each of 400 batches of 2 (2 ms of
    encoding each) reads it again as time passes, but for about 5 % of the time; what it
    lets in meanwhile (counted, not re-read) keeps the store under the watermark."""
    one = entry_bytes(tmp_path)
    store = DiskStore(tmp_path / "s", max_bytes=one * 4000, fsync=False, low_watermark=0.9)
    for i in range(3000):
        put(store, ident(i))
    budget = RoomBudget(store, store.max_bytes, store.low_watermark, mean_bytes=one)
    calls, written, t0 = 0, 0, time.monotonic()
    reading = 0.0
    real_used = store.used_bytes

    def timed_used():
        nonlocal reading
        t = time.monotonic()
        try:
            return real_used()
        finally:
            reading += time.monotonic() - t

    store.used_bytes = timed_used
    while calls < 400:
        calls += 1
        time.sleep(0.002)  # the engine encoding a batch
        n = budget.fits(2)
        for _ in range(n):
            put(store, ident(10_000 + written))
            written += 1
    elapsed = time.monotonic() - t0
    assert written == 600  # 3,000 + 600 = 0.9 × 4,000: stops exactly at the watermark
    assert real_used() <= store.max_bytes * store.low_watermark
    assert store.read_counters().get("evictions", 0) == 0
    assert len(list(store.identifiers())) == 3600  # nothing evicted
    print("reads", budget.reads, "of", calls, "reading", reading, "elapsed", elapsed)
    assert 2 <= budget.reads < calls / 4, budget.reads  # re-read as time passes, rarely
    assert reading <= 0.10 * elapsed + 0.05, (reading, elapsed)


def test_an_unknown_entry_size_lets_one_batch_in_then_reads_again(tmp_path):
    one = entry_bytes(tmp_path)
    store = DiskStore(tmp_path / "s", max_bytes=one * 10, fsync=False, low_watermark=0.5)
    for i in range(3):
        put(store, ident(i))
    budget = RoomBudget(store, store.max_bytes, store.low_watermark)  # size unknown
    waited = []
    budget.before_read = lambda: waited.append(True)
    assert budget.fits(8) == 8  # the first batch teaches the size
    for i in range(3, 6):  # it wrote 3 of them (the rest failed)
        put(store, ident(i))
    budget.mean_bytes = one
    assert budget.fits(8) == 0  # 6 stored > 5 under the watermark: read again, no room
    assert budget.reads == 2 and len(waited) == 2
