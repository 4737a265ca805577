"""EncacheStats: aggregation and reduction as vLLM's stats logger uses them."""

import pytest

pytest.importorskip("vllm")


def test_stats_aggregate_and_reduce():
    from encache.connectors.vllm.metrics import EncacheStats
    a = EncacheStats(data={"hits": 3, "misses": 1, "bytes_loaded": 2 * 2**20,
                           "load_latencies": [0.001, 0.003], "staged_bytes": 10})
    b = EncacheStats(data={"hits": 1, "load_errors": 2, "load_latencies": [0.002], "staged_bytes": 7})
    m = a.aggregate(b)
    assert m.data["hits"] == 4 and m.data["load_errors"] == 2 and m.data["staged_bytes"] == 7
    r = m.reduce()
    assert r == {"hits": 4, "misses": 1, "hit_ratio": 0.8, "load_errors": 2,
                 "loaded_MiB": 2.0, "mean_load_ms": 2.0}
    assert not m.is_empty() and EncacheStats().is_empty()
    mismatched = m.aggregate(EncacheStats(data={"config_mismatches": 3}))
    assert mismatched.reduce()["config_mismatches"] == 3 and not EncacheStats(
        data={"config_mismatches": 1}).is_empty()
    stale = m.aggregate(EncacheStats(data={"lora_stale": 2, "misses_model": 5}))
    assert stale.reduce()["lora_stale"] == 2 and stale.reduce()["misses_model"] == 5
    assert not EncacheStats(data={"lora_stale": 1}).is_empty()
    m.reset()
    assert m.is_empty()
    # a store sample alone is exported (gauges current while nothing loads); staged
    # bytes alone (they only accompany other data) are not
    assert not EncacheStats(data={"staged_bytes": 0, "local_tier_bytes": 5}).is_empty()
    assert not EncacheStats(data={"store_entries": 3}).is_empty()
    assert EncacheStats(data={"staged_bytes": 7}).is_empty()
    # the breaker's state: a gauge (latest wins), in the log line only while down
    down = m.aggregate(EncacheStats(data={"hits": 1, "store_down": 0, "store_parts_down": 1}))
    down = down.aggregate(EncacheStats(data={"misses": 1, "store_down": 0,
                                             "store_parts_down": 2}))
    assert down.data["store_parts_down"] == 2 and down.reduce()["store_parts_down"] == 2
    assert "store_down" not in down.reduce()
    assert EncacheStats(data={"staged_bytes": 7, "store_down": 0,
                              "store_parts_down": 0}).is_empty()


def test_connector_builds_its_stats_class():
    from encache.connectors.vllm.connector import EncacheConnector
    from encache.connectors.vllm.metrics import EncacheStats
    s = EncacheConnector.build_ec_connector_stats({"hits": 2})
    assert isinstance(s, EncacheStats) and s.reduce()["hits"] == 2
