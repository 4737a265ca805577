"""Engine metrics: encache's consumer counters through vLLM's connector-stats hooks.

The scheduler-side connector returns an :class:`EncacheStats` per stats interval
(``get_ec_connector_stats``); vLLM aggregates them, logs a one-line summary
(``EC Transfer metrics: hits=… misses=…``) and feeds :class:`EncachePromMetrics`, which
exports Prometheus series on vLLM's ``/metrics`` endpoint. Names follow Dynamo's
multimodal embedding-cache metrics (``embedding_cache_hits_total``,
``…_misses_total``, ``…_evictions_total``, ``…_entries``, ``…_current_bytes``,
``…_capacity_bytes``, ``…_utilization``) under vLLM's ``vllm:`` prefix, plus encache's own:

    vllm:embedding_cache_hits_total           items served from the store (this engine)
    vllm:embedding_cache_misses_total         items this engine had to encode
    vllm:embedding_cache_load_errors_total    corrupt / unreadable / unusable entries (re-encoded)
    vllm:embedding_cache_config_mismatches_total  entries produced under another encoder
                                              config (re-encoded; see encoder_config)
    vllm:embedding_cache_lora_stale_total     LoRA entries made with another adapter under
                                              the served name (re-encoded; see lora_stamp)
    vllm:embedding_cache_binding_mismatches_total  entries computed from other inputs than
                                              the request's (a client-chosen uuid; the
                                              request's own are encoded: docs/security.md)
    vllm:embedding_cache_model_mismatch_misses_total  misses while the store holds entries
                                              only for other --model strings (see diagnosis)
    vllm:embedding_cache_newer_format_misses_total  entries written by a newer encache than
                                              this engine's (re-encoded; the entry is kept)
    vllm:embedding_cache_local_tier_hits_total   hits served from the node's local tier
    vllm:embedding_cache_remote_hits_total    hits read from the shared store behind a local
                                              tier (both 0 without a tier)
    vllm:embedding_cache_loaded_bytes_total   tensor bytes handed to the engine
    vllm:embedding_cache_load_latency_seconds read + verify time per loaded entry (histogram)
    vllm:embedding_cache_staged_bytes         verified bytes held in memory (gauge)
    vllm:embedding_cache_local_tier_bytes     bytes in this node's local tier (gauge)
    vllm:embedding_cache_local_tier_capacity_bytes  its local_tier_max_bytes (gauge)
    vllm:embedding_cache_store_down           1 while this engine treats the store as down:
                                              its circuit breaker is open, every lookup a
                                              miss (gauge)
    vllm:embedding_cache_store_parts_down     parts of the store (Redis Cluster primaries)
                                              this engine treats as down: lookups of their
                                              entries are misses (gauge)
    store-wide, sampled every ``store_stats_s`` (every engine on a store reports the same
    figures: aggregate them with max(), not sum()):
    vllm:embedding_cache_entries              entries in the store (gauge)
    vllm:embedding_cache_current_bytes        bytes used (gauge; disk stores)
    vllm:embedding_cache_capacity_bytes       max_bytes (gauge; disk stores with a capacity)
    vllm:embedding_cache_utilization          current / capacity (gauge, 0-1)
    vllm:embedding_cache_evictions_total      capacity evictions by any writer
    vllm:embedding_cache_saved_bytes_total    bytes written by any producer
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

COUNTERS = ("hits", "misses", "load_errors", "config_mismatches", "lora_stale",
            "binding_mismatches", "misses_model", "misses_newer_format", "hits_local",
            "hits_remote", "bytes_loaded", "store_evictions", "store_bytes_saved")
GAUGES = ("staged_bytes", "store_entries", "store_bytes", "store_capacity_bytes",
          "local_tier_bytes", "local_tier_capacity_bytes", "store_down", "store_parts_down")
#: gauges every non-empty interval carries (the others: a store sample was taken)
INTERVAL_GAUGES = ("staged_bytes", "store_down", "store_parts_down")
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
            elif k in GAUGES:
                merged[k] = v  # a gauge: latest wins
            else:
                merged[k] = merged.get(k, 0) + v
        return EncacheStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        hits, misses = d.get("hits", 0), d.get("misses", 0)
        lat = d.get("load_latencies", [])
        out = {
            "hits": int(hits), "misses": int(misses),
            "hit_ratio": round(hits / (hits + misses), 4) if hits + misses else 0.0,
            "load_errors": int(d.get("load_errors", 0)),
            "loaded_MiB": round(d.get("bytes_loaded", 0) / 2**20, 3),
            "mean_load_ms": round(1000 * sum(lat) / len(lat), 3) if lat else 0.0,
        }
        if d.get("config_mismatches"):  # only when it happens: a misconfiguration to see
            out["config_mismatches"] = int(d["config_mismatches"])
        for key in ("lora_stale", "binding_mismatches", "misses_model",  # likewise
                    "misses_newer_format", "hits_local", "hits_remote", "store_down",
                    "store_parts_down"):
            if d.get(key):
                out[key] = int(d[key])
        return out

    def is_empty(self) -> bool:
        """Nothing to export: no counter moved, no latency, and no store sample (a sample
        is exported even in an interval without loads, so the gauges stay current while
        the engine serves requests the connector is not asked about)."""
        return (not any(self.data.get(k) for k in COUNTERS + ("load_latencies",))
                and not any(k in self.data for k in GAUGES if k not in INTERVAL_GAUGES))


class EncachePromMetrics(ECConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def counter(name, doc):
            return create_metric_per_engine(
                self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)

        def gauge(name, doc):
            return create_metric_per_engine(
                self._gauge_cls(name=name, documentation=doc, multiprocess_mode="mostrecent",
                                labelnames=labelnames),
                per_engine_labelvalues)

        p = "vllm:embedding_cache_"
        self.counters = {
            "hits": counter(p + "hits", "Encoder outputs served from the encache store."),
            "misses": counter(p + "misses", "Encoder outputs this engine had to compute."),
            "load_errors": counter(p + "load_errors",
                                   "Corrupt, unreadable or unusable encache entries (re-encoded)."),
            "config_mismatches": counter(
                p + "config_mismatches",
                "Entries produced under another encoder config (re-encoded)."),
            "lora_stale": counter(
                p + "lora_stale",
                "LoRA entries made with another adapter under the served name (re-encoded)."),
            "binding_mismatches": counter(
                p + "binding_mismatches",
                "Entries computed from other inputs than the request's (not served; "
                "the request's own inputs are encoded)."),
            "misses_model": counter(
                p + "model_mismatch_misses",
                "Misses while the store holds entries only for other model id strings."),
            "misses_newer_format": counter(
                p + "newer_format_misses",
                "Entries written by a newer encache than this engine's (re-encoded, kept)."),
            "hits_local": counter(p + "local_tier_hits",
                                  "Hits served from this node's local tier."),
            "hits_remote": counter(p + "remote_hits",
                                   "Hits read from the shared store behind a local tier."),
            "bytes_loaded": counter(p + "loaded_bytes", "Tensor bytes loaded from the encache store."),
            "store_evictions": counter(p + "evictions",
                                       "Store-wide capacity evictions (any writer on the store)."),
            "store_bytes_saved": counter(p + "saved_bytes",
                                         "Store-wide bytes written (any producer on the store)."),
        }
        self.latency = create_metric_per_engine(
            self._histogram_cls(name=p + "load_latency_seconds",
                                documentation="Read + verify time per loaded encache entry.",
                                buckets=list(LATENCY_BUCKETS), labelnames=labelnames),
            per_engine_labelvalues)
        self.gauges = {
            "staged_bytes": gauge(p + "staged_bytes", "Verified encache bytes held in memory."),
            "store_entries": gauge(p + "entries", "Entries in the encache store."),
            "store_bytes": gauge(p + "current_bytes", "Bytes used by the encache store."),
            "store_capacity_bytes": gauge(p + "capacity_bytes", "Capacity (max_bytes) of the store."),
            "local_tier_bytes": gauge(p + "local_tier_bytes",
                                      "Bytes held by this node's local tier."),
            "local_tier_capacity_bytes": gauge(p + "local_tier_capacity_bytes",
                                               "Capacity (local_tier_max_bytes) of this node's tier."),
            "store_down": gauge(p + "store_down",
                                "1 while the store is treated as down (every lookup a miss)."),
            "store_parts_down": gauge(
                p + "store_parts_down",
                "Parts of the store (Redis Cluster primaries) treated as down "
                "(lookups of their entries are misses)."),
        }
        self.utilization = gauge(p + "utilization", "Store bytes used / capacity (0-1).")

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data or {}
        for key, metric in self.counters.items():
            if d.get(key):
                metric[engine_idx].inc(d[key])
        for s in d.get("load_latencies", []):
            self.latency[engine_idx].observe(s)
        for key, metric in self.gauges.items():
            if key in d:
                metric[engine_idx].set(d[key])
        if d.get("store_capacity_bytes") and "store_bytes" in d:
            self.utilization[engine_idx].set(d["store_bytes"] / d["store_capacity_bytes"])
