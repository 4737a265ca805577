"""The lookup's counters: persisted to the store, and reported to vLLM's metrics.

Two consumers of one count: the store's counters (``encache stats``, shared by every
engine on the store) and the engine's Prometheus metrics (per interval,
:mod:`encache.connectors.vllm.metrics`). Where the store offers in-place per-process
counters (disk, :mod:`encache.connectors.counters`) each count goes straight there and
survives the engine's SIGKILL; otherwise (Redis) deltas are batched and flushed every
``counters_flush_s`` by the lookup's background thread, and kept for the next flush when
the store is down. A read-only store records nothing (the engine's metrics still do).
Store-wide facts (entries, bytes, capacity, the growth of evictions and saves) are
sampled every ``store_stats_s`` and reported once each.
"""

from __future__ import annotations

import threading
import time

from ..ratelimit import RateLimitedLog
from ..store.counters import open_live_counters
from ..store.base import Store
from ..store.throttle import ScanThrottle

STORE_COUNTERS = ("evictions", "bytes_saved")  # exported as store_* counters
LATENCIES_MAX = 10_000  # load latencies kept per interval
BYTES_SHARE = 0.05  # the largest share of time spent summing the store's bytes


class LookupMetrics:
    STORE_COUNTERS = STORE_COUNTERS

    def __init__(self, store: Store, warn: RateLimitedLog, counters_flush_s: float = 0.5):
        self.store, self.warn = store, warn
        self.counters_flush_s = counters_flush_s
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}  # not yet flushed to the store
        self._interval: dict[str, float] = {}  # since the last take_interval() (engine metrics)
        self._latencies: list[float] = []
        self._store_gauges: dict[str, float] = {}  # latest store-wide facts
        self._store_totals: dict[str, float] | None = None  # last seen store counters
        self._last_flush = time.monotonic()
        self._live = open_live_counters(store, warn)
        self._bytes: int | None = None  # the last sum of the store's bytes (_store_bytes)
        self._bytes_version = None
        self._summing = ScanThrottle(BYTES_SHARE)

    def count(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._pending[name] = self._pending.get(name, 0) + value
            self._interval[name] = self._interval.get(name, 0) + value
        if self._live is not None:
            self._live.add(name, value)

    def pending(self, name: str) -> float:
        """Count of ``name`` not yet flushed to the store (tests)."""
        with self._lock:
            return self._pending.get(name, 0)

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            if len(self._latencies) < LATENCIES_MAX:
                self._latencies.append(seconds)

    def take_interval(self, staged_bytes: int) -> dict:
        """Counter deltas and load latencies since the last call (for vLLM's metrics)."""
        with self._lock:
            data, self._interval = self._interval, {}
            lat, self._latencies = self._latencies, []
            if lat:
                data["load_latencies"] = lat
            if data or self._store_gauges:
                data["staged_bytes"] = staged_bytes
                data.update(self._store_gauges)
                self._store_gauges = {}  # report each sample once
        return data

    def sample_store(self, entries: int) -> None:
        """Store-wide facts for the engine's metrics: entries (the index's size), bytes
        used and capacity (disk), and the growth of the store's shared counters
        (evictions and saves by every writer on this store)."""
        gauges: dict[str, float] = {"store_entries": entries}
        try:
            max_bytes = self.store.max_bytes
            if max_bytes:
                gauges["store_capacity_bytes"] = max_bytes
            if self.store.supports_used_bytes:
                gauges["store_bytes"] = self._store_bytes()
            tier = self.store.local_tier_usage()
            if tier is not None:
                gauges["local_tier_bytes"] = tier[0]
                if tier[1]:
                    gauges["local_tier_capacity_bytes"] = tier[1]
            totals = self.store.read_counters()
        except Exception as e:
            self.warn.warning("store-stats", "encache: cannot read the state of %s: %s",
                              self.store.url, e)
            return
        with self._lock:
            self._store_gauges = gauges
            if self._store_totals is not None:  # the first sample is the baseline
                for k in STORE_COUNTERS:
                    delta = totals.get(k, 0) - self._store_totals.get(k, 0)
                    if delta > 0:  # a reset (encache stats --reset) is not negative growth
                        self._interval["store_" + k] = self._interval.get("store_" + k, 0) + delta
            self._store_totals = {k: totals.get(k, 0) for k in STORE_COUNTERS}

    def _store_bytes(self) -> int:
        """The store's bytes, summed again only when its ``index_version()`` moved (or it
        has none) and at most while that costs ``BYTES_SHARE`` of the time: a disk store
        stats every entry to sum them, seconds at a million."""
        version = self.store.index_version()
        if self._bytes is not None and (
                (version is not None and version == self._bytes_version)
                or not self._summing.due()):
            return self._bytes
        self._bytes = int(self._summing.run(self.store.used_bytes))
        self._bytes_version = version
        return self._bytes

    @property
    def bytes_reads(self) -> int:
        """How many times the store's bytes were summed (tests)."""
        return self._summing.walks

    def maybe_flush(self, force: bool = False) -> None:
        """Persist counter deltas to the store (called by the background thread)."""
        now = time.monotonic()
        if not force and now - self._last_flush < self.counters_flush_s:
            return
        with self._lock:
            deltas, self._pending = self._pending, {}
            self._last_flush = now
        if not deltas or self._live is not None or self.store.read_only:
            # recorded in place already, or a read-only store that records nothing (the
            # engine's metrics still do)
            return
        try:
            self.store.add_counters(deltas)
        except Exception as e:
            with self._lock:  # keep them for the next flush
                for k, v in deltas.items():
                    self._pending[k] = self._pending.get(k, 0) + v
            self.warn.warning("counters", "encache: cannot record counters in %s: %s",
                              self.store.url, e)
