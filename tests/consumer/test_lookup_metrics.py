"""Tests for :mod:`encache.connectors.lookup.metrics`: store-wide facts sampled by the lookup."""

from __future__ import annotations

import os
import time

from encache.connectors.lookup import EntryLookup
from encache.connectors.store.disk.store import ENTRY_FILE, DiskStore
from lookup_support import put


def sample(lk, done, timeout: float = 5.0) -> dict:
    """The lookup's interval data once ``done(data)`` holds (its store sampler runs
    every ``store_stats_s``), or the last data at the deadline."""
    deadline = time.time() + timeout
    data: dict = {}
    while time.time() < deadline and not done(data):
        time.sleep(0.05)
        data = lk.take_interval()
    return data


def test_store_wide_metrics_are_sampled(tmp_path):
    """Entries, bytes and capacity as gauges; evictions/saves by any writer as deltas."""
    for i in range(3):
        put(DiskStore(tmp_path), f"e{i}", seed=i)
    one = os.path.getsize(tmp_path / "e0" / ENTRY_FILE)
    store = DiskStore(tmp_path, max_bytes=int(3.5 * one))
    lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, store_stats_s=0.05)
    try:
        data = sample(lk, lambda d: "store_entries" in d)
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


def test_a_local_tier_reports_its_size_and_capacity(tmp_path, monkeypatch):
    """Behind a local tier, the samples add the tier's bytes and capacity (the Prometheus
    gauges ``local_tier_bytes`` / ``local_tier_capacity_bytes``); without one, neither."""
    from encache.connectors.store import tiered as tiered_mod
    from encache.connectors.store.tiered import TieredStore

    monkeypatch.setattr(tiered_mod, "TIER_USAGE_S", 0.1)  # re-summed soon after the loads
    shared = DiskStore(tmp_path / "shared")
    for i in range(2):
        put(shared, f"e{i}", seed=i)
    # (the two entries' headers may differ by an 8-byte pad: their times' digits)
    sizes = [os.path.getsize(tmp_path / "shared" / f"e{i}" / ENTRY_FILE) for i in range(2)]
    one, both = sizes[0], sum(sizes)
    tiered = TieredStore(DiskStore(tmp_path / "shared"),
                         DiskStore(tmp_path / "tier", max_bytes=10 * one))
    lk = EntryLookup(tiered, index_refresh_s=3600, counters_flush_s=3600, store_stats_s=0.05)
    plain = EntryLookup(shared, index_refresh_s=3600, counters_flush_s=3600, store_stats_s=0.05)
    try:
        assert lk.wait_index(5)  # the tier's first sync
        for i in range(2):
            assert lk.load_now(f"e{i}") is not None  # remote hits, written behind
        tiered.flush()
        data = sample(lk, lambda d: d.get("local_tier_bytes") == both)
        assert data["local_tier_bytes"] == both, (data, tiered.stats)
        assert data["local_tier_capacity_bytes"] == 10 * one
        data = sample(plain, lambda d: "store_entries" in d)
        assert "store_entries" in data and "local_tier_bytes" not in data
    finally:
        lk.close()
        plain.close()
        tiered.close()
