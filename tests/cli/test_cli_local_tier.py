"""The local tier from the command line: ``connector-config --local-tier``, ``warm
--local-tier`` (fill a node's tier from the shared store), ``stats --local-tier``, and
``verify`` / ``purge`` on the tier directory (an ordinary disk store), against a real
redis-server."""

from __future__ import annotations

import json
import uuid

import pytest

from cli_support import invoke
from encache.connectors.store import open_store
from encache.connectors.store.redis.store import RedisStore
from entries import put_entry

pytestmark = pytest.mark.redis


@pytest.fixture
def shared(redis_server):
    """(URL, handle) of a fresh namespace on the shared Redis with three entries."""
    prefix = f"t-cli-tier-{uuid.uuid4().hex[:8]}:"
    store = RedisStore(redis_server.url, prefix=prefix)
    for n, ident in enumerate(("a" * 64, "b" * 64, "lx:" + "c" * 64)):
        put_entry(store, ident, rows=256, seed=n)
    yield f"{redis_server.url}?prefix={prefix}", store
    store.close()


def test_connector_config_prints_the_tier_keys(tmp_path):
    r = invoke("connector-config", "--store", "redis://cache:6379/0", "--local-tier",
               tmp_path / "tier", "--local-tier-max-bytes", "200G")
    assert r.exit_code == 0, r.output
    extra = json.loads(r.stdout)["ec_connector_extra_config"]
    assert extra == {"store": "redis://cache:6379/0", "local_tier": str(tmp_path / "tier"),
                     "local_tier_max_bytes": 200 << 30}
    from encache.connectors.vllm.config import ConnectorConfig
    cfg = ConnectorConfig.from_extra({**extra, "local_tier_max_bytes": "200G"})
    assert cfg.local_tier_max_bytes == 200 << 30  # the same, written by hand
    bad = invoke("connector-config", "--store", "redis://c:1/0", "--local-tier-max-bytes", "9Q")
    assert bad.exit_code == 2 and "invalid size" in bad.output
    alone = invoke("connector-config", "--store", "redis://c:1/0", "--local-tier-max-bytes", "1G")
    assert alone.exit_code == 2 and "needs --local-tier" in alone.output
    encoder = invoke("connector-config", "--store", "redis://c:1/0", "--role", "ec_producer",
                     "--local-tier", tmp_path / "tier")
    assert encoder.exit_code == 2 and "ec_producer (encode-only) loads none" in encoder.output


def test_warm_fills_the_tier_and_the_tier_serves_it(shared, tmp_path):
    url, store = shared
    tier = tmp_path / "tier"
    r = invoke("warm", "--store", url, "--local-tier", tier, "--local-tier-max-bytes", "64M",
               "--lora", "lx", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["copied"] == 1
    r = invoke("warm", "--store", url, "--local-tier", tier, "--json")
    assert json.loads(r.stdout)["copied"] == 2 and json.loads(r.stdout)["skipped"] == 1
    local = open_store(str(tier), create=False)
    assert local.count() == 3 and local.max_bytes == 64 << 20
    tiered = open_store(url, local_tier=str(tier))
    try:
        got = tiered.read_verified("a" * 64)
        assert got.source == "local"  # checked at its first sync, kept
        assert bytes(memoryview(got[0]).cast("B")) == bytes(store.get("a" * 64))
    finally:
        tiered.close()


def test_warm_into_a_tier_too_small_says_what_it_holds(shared, tmp_path):
    """A capacity below the selection: each copy evicts the one before. warm reports the
    copies as copied and, as evicted again, those the tier no longer holds, with a hint."""
    url, store = shared
    tier = tmp_path / "tier"
    size = store.stat("a" * 64).size
    r = invoke("warm", "--store", url, "--local-tier", tier, "--local-tier-max-bytes",
               str(size + 100), "--json")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    local = open_store(str(tier), create=False)
    held = local.count()
    assert got["copied"] == 3 and held < 3
    assert got["evicted"] == 3 - held and got["capacity"] == size + 100
    r = invoke("warm", "--store", url, "--local-tier", tier, "--overwrite")
    assert r.exit_code == 0, r.output
    assert "evicted again (capacity)" in r.output
    assert "below the selection" in r.output and "--local-tier-max-bytes" in r.output


def test_warm_local_tier_usage_errors(shared, tmp_path):
    url, _ = shared
    tier = ("--local-tier", tmp_path / "t")
    for args, text in (((*tier, "--from", tmp_path / "x"), "drop --from"),
                       (("--local-tier", url), "directory on this node"),
                       (("--local-tier-max-bytes", "1G"), "needs --local-tier"),
                       ((*tier, "--compute-missing", tmp_path), "without --local-tier")):
        r = invoke("warm", "--store", url, *args)
        assert r.exit_code == 2, (args, r.output)
        assert text in r.output, (args, r.output)


def test_stats_verify_and_purge_show_and_work_on_the_tier(shared, tmp_path):
    url, store = shared
    tier = tmp_path / "tier"
    tiered = open_store(url, local_tier=str(tier))
    for ident in ("a" * 64, "b" * 64):
        tiered.read_verified(ident)
    tiered.flush()
    tiered.sync()
    tiered.add_counters({"hits": 5, "hits_local": 3, "hits_remote": 2})
    tiered.close()
    r = invoke("stats", "--store", url, "--local-tier", tier, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["hits_local"] == 3 and s["hits_remote"] == 2
    assert s["local_tier"]["entries"] == 2 and s["local_tier"]["same_store"]
    assert s["local_tier"]["last_sync"] is not None
    table = invoke("stats", "--store", url, "--local-tier", tier).stdout
    assert "Local tier (this node)" in table and "local 3 (60.0%), remote 2" in table
    assert invoke("verify", "--store", tier).exit_code == 0
    r = invoke("purge", "--store", tier, "--all", "--yes", "--quiet")
    assert r.exit_code == 0 and open_store(str(tier)).count() == 0
    assert store.count() == 3  # the shared store keeps its entries
