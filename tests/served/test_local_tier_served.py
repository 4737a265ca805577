"""A node-local tier in front of Redis, through a real ``vllm serve`` consumer.

One api_server (worker processes, as in production) serves images precomputed into a real
redis-server, with ``local_tier`` set and 2.75 MB entries (Gemma 3 27B's size). Shown:

* a first load is a remote hit, written behind into the tier; the next load of that image
  is a local-tier hit; the tower stays idle both times;
* Redis SIGKILLed: an image the tier holds is still a hit (tower idle), one it never
  loaded is a miss (encoded), no request fails, and ``/metrics`` keeps counting hits,
  misses and local-tier hits;
* Redis back, empty: within a few refreshes neither the tier's copy nor the staged copy
  is served (both images encoded again).

vLLM keeps encoder outputs in its own cache until it needs the room, so between rounds
new filler images push them out and the engine asks the connector again; the connector's
staging holds one entry (``staging_bytes: 1``), so what is not the newest comes from
the tier.
"""

from __future__ import annotations

import time
import urllib.request

import pytest

from encache.connectors.vllm import transfer_config
from engine_support import PRECOMPUTE_KW
from served_support import draw_images, start_server, wide_model

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.redis]

MAX_LEN = 512
FILLERS = 6  # new images per round: 256 tokens each fill vLLM's 512-token encoder cache
P = "vllm:embedding_cache_"
ENTRY_BYTES = 256 * 2688 * 4  # one image's entry at the wide model's size (2.75 MB)


def metrics(base: str) -> dict[str, float]:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(P) and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0][len(P):]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def settled(base: str, before: dict, want: dict, timeout: float = 30.0) -> dict:
    """Metric deltas since ``before`` once they reach ``want`` (vLLM exports connector
    stats on its logging interval), or whatever they are at the deadline."""
    deadline = time.time() + timeout
    while True:
        now = metrics(base)
        delta = {k: now.get(k, 0) - before.get(k, 0)
                 for k in {"hits_total", "misses_total", "local_tier_hits_total",
                           "remote_hits_total", *want}}
        if all(delta[k] >= v for k, v in want.items()) or time.time() > deadline:
            return delta
        time.sleep(0.5)


def test_local_tier_through_vllm_serve_and_a_redis_outage(tmp_path, redis_factory):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    model = wide_model()
    redis = redis_factory()
    images = draw_images(tmp_path / "pre", {"a": (160, 128), "b": (128, 160), "c": (144, 144)},
                         seed=31)
    fills = draw_images(tmp_path / "fill", {f"f{i}": (100 + 6 * i, 90 + 4 * i)
                                            for i in range(3 * FILLERS)}, seed=32)
    fill = [fills[f"f{i}"] for i in range(3 * FILLERS)]
    pre = dict(PRECOMPUTE_KW, max_model_len=MAX_LEN)
    summary = precompute_corpus(str(tmp_path / "pre"),
                                PrecomputeOptions(model=model, store=redis.url, **pre))
    assert summary.encoded == 3
    tier = tmp_path / "tier"
    config = transfer_config(redis.url, "ec_consumer", {
        "local_tier": str(tier), "staging_bytes": 1, "index_refresh_s": 0.5,
        "counters_flush_s": 0.2, "store_stats_s": 0.5, "load_timeout_s": 2.0})
    server = start_server(model, config, tmp_path, max_model_len=MAX_LEN, probe="tier")
    try:
        server.wait_ready()
        log = server.encoder_log

        def ask(path, *, encoded: int) -> None:
            n = log.count()
            reply = server.chat([path], max_tokens=1)
            assert reply["choices"][0]["message"]["content"] is not None
            assert log.count() - n == encoded, path

        def flush(batch: int) -> None:
            for path in fill[batch * FILLERS:(batch + 1) * FILLERS]:
                ask(path, encoded=1)

        m0 = metrics(server.base)
        ask(images["a"], encoded=0)  # remote hits, written behind into the tier
        ask(images["b"], encoded=0)
        d = settled(server.base, m0, {"hits_total": 2, "remote_hits_total": 2})
        assert d["hits_total"] == 2 and d["remote_hits_total"] == 2, d
        deadline = time.time() + 10
        while len(list(tier.glob("*/encoder_cache.safetensors"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        flush(0)
        m1 = metrics(server.base)
        ask(images["a"], encoded=0)  # the tier's copy: a local hit
        d = settled(server.base, m1, {"local_tier_hits_total": 1})
        assert d["local_tier_hits_total"] == 1 and d["hits_total"] == 1, d
        deadline = time.time() + 30  # the tier's size: sampled with the traffic's stats
        while metrics(server.base).get("local_tier_bytes", 0) < 2 * ENTRY_BYTES:
            assert time.time() < deadline, metrics(server.base).get("local_tier_bytes")
            ask(images["a"], encoded=0)
            time.sleep(1.0)

        redis.kill()  # SIGKILL: the shared store is gone
        flush(1)  # misses meanwhile; no request fails
        m2 = metrics(server.base)
        ask(images["b"], encoded=0)  # in the tier, not staged: still a hit
        ask(images["c"], encoded=1)  # never loaded here: a miss
        d = settled(server.base, m2, {"hits_total": 1, "misses_total": 1,
                                      "local_tier_hits_total": 1})
        assert d["hits_total"] == 1 and d["local_tier_hits_total"] == 1, d
        assert d["misses_total"] == 1, d

        redis.restart()  # back, empty: what the tier and the staging hold is gone there
        time.sleep(3.0)  # a few index refreshes
        flush(2)
        ask(images["a"], encoded=1)
        ask(images["b"], encoded=1)
        assert not list(tier.glob("*/encoder_cache.safetensors")), "the tier kept purged copies"
        urllib.request.urlopen(server.base + "/health", timeout=5)
    finally:
        server.stop()
