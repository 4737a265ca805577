"""Engine metrics: encache's consumer counters through vLLM's connector-stats hooks.

The scheduler-side connector returns an :class:`EncacheStats` per stats interval
(``get_ec_connector_stats``); vLLM aggregates them, logs a one-line summary
(``EC Transfer metrics: hits=… misses=…``) and feeds :class:`EncachePromMetrics`, which
exports Prometheus series on vLLM's ``/metrics`` endpoint:

    vllm:encache_hits_total             items served from the store
    vllm:encache_misses_total           items the engine had to encode
    vllm:encache_load_errors_total      corrupt / unreadable / unusable entries (then re-encoded)
    vllm:encache_loaded_bytes_total     tensor bytes handed to the engine
    vllm:encache_load_latency_seconds   read + verify time per loaded entry (histogram)
    vllm:encache_staged_bytes           verified bytes held in memory (gauge)

Producer-side saves happen in the worker, whose stats vLLM does not collect; they are in
the store's counters (``encache stats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

COUNTERS = ("hits", "misses", "load_errors", "bytes_loaded")
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class EncacheStats(ECConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> EncacheStats:
        merged = dict(self.data)
        for k, v in (other.data or {}).items():
            if k == "load_latencies":
                merged[k] = list(merged.get(k, [])) + list(v)
            elif k == "staged_bytes":
                merged[k] = v  # a gauge: latest wins
            else:
                merged[k] = merged.get(k, 0) + v
        return EncacheStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        hits, misses = d.get("hits", 0), d.get("misses", 0)
        lat = d.get("load_latencies", [])
        return {
            "hits": int(hits), "misses": int(misses),
            "hit_ratio": round(hits / (hits + misses), 4) if hits + misses else 0.0,
            "load_errors": int(d.get("load_errors", 0)),
            "loaded_MiB": round(d.get("bytes_loaded", 0) / 2**20, 3),
            "mean_load_ms": round(1000 * sum(lat) / len(lat), 3) if lat else 0.0,
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS + ("load_latencies",))


class EncachePromMetrics(ECConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def counter(name, doc):
            return create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)

        self.hits = counter("vllm:encache_hits", "Encoder-cache items served from the encache store.")
        self.misses = counter("vllm:encache_misses", "Encoder-cache items the engine had to encode.")
        self.errors = counter("vllm:encache_load_errors",
                              "Corrupt, unreadable or unusable encache entries (re-encoded).")
        self.loaded = counter("vllm:encache_loaded_bytes", "Tensor bytes loaded from the encache store.")
        self.latency = create_metric_per_engine(
            self._histogram_cls(name="vllm:encache_load_latency_seconds",
                                documentation="Read + verify time per loaded encache entry.",
                                buckets=list(LATENCY_BUCKETS), labelnames=labelnames),
            per_engine_labelvalues)
        self.staged = create_metric_per_engine(
            self._gauge_cls(name="vllm:encache_staged_bytes",
                            documentation="Verified encache bytes held in memory.",
                            multiprocess_mode="mostrecent", labelnames=labelnames),
            per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data or {}
        for metric, key in ((self.hits, "hits"), (self.misses, "misses"),
                            (self.errors, "load_errors"), (self.loaded, "bytes_loaded")):
            if d.get(key):
                metric[engine_idx].inc(d[key])
        for s in d.get("load_latencies", []):
            self.latency[engine_idx].observe(s)
        if "staged_bytes" in d:
            self.staged[engine_idx].set(d["staged_bytes"])
