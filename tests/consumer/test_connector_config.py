"""``ec_connector_extra_config`` values are checked when the engine starts.

A value of the wrong type or range once started the engine and then failed its first
request (``staging_bytes: "512M"``, ``inline_wait_s: "0.01"``), stopped the consumer's
background thread without a word (``index_refresh_s: null``: no more index refreshes),
or meant the opposite of what was written (``fsync: "false"`` is a true string). Each is
now refused at start, with a line naming the key.
"""

from __future__ import annotations

import logging

import pytest

from encache.connectors.vllm.config import ConnectorConfig


def config(**extra) -> ConnectorConfig:
    return ConnectorConfig.from_extra({"store": "/srv/encache", **extra})


@pytest.mark.parametrize("key, value", [
    ("staging_bytes", None), ("staging_bytes", -1), ("staging_bytes", "lots"),
    ("max_bytes", 0), ("max_bytes", -1), ("max_bytes", [1]), ("max_bytes", True),
    ("local_tier_max_bytes", 0), ("verify_ahead_start_bytes", None),
    ("max_pending_write_bytes", 0),
    ("load_threads", 0), ("load_threads", "4"), ("write_threads", -1), ("write_threads", 1.5),
    ("load_timeout_s", 0), ("load_timeout_s", None), ("load_timeout_s", "5"),
    ("load_timeout_s", float("nan")), ("inline_wait_s", "0.01"), ("inline_wait_s", -0.1),
    ("index_refresh_s", None), ("index_refresh_s", float("inf")), ("counters_flush_s", "0.5"),
    ("store_stats_s", 0), ("save_wait_s", None), ("save_wait_s", True),
    ("fsync", "false"), ("verify_ahead", 0), ("remember_verified", "no"),
    ("check_encoder_config", None), ("skip_existing", "true"),
    ("verify", 2), ("verify", ["always"]), ("verify", "sometimes"),
    ("eviction", "LRU"), ("load_mode", "map"), ("worker_loads", "maybe"),
    ("tag", ["v2"]), ("prefix", 5), ("local_tier", 5),
])
def test_a_bad_value_stops_the_start_naming_its_key(key, value):
    with pytest.raises(ValueError, match=f"^encache connector: {key} must be "):
        config(**{key: value})


def test_good_values_and_their_forms():
    c = config(staging_bytes="512M", max_bytes="50G", verify_ahead_start_bytes=0,
               load_timeout_s=2, inline_wait_s=0, save_wait_s=0, verify="always",
               fsync=False, tag="v2", prefix="tenant:", local_tier="/nvme/tier")
    assert c.staging_bytes == 512 << 20 and c.max_bytes == 50 << 30
    assert c.load_timeout_s == 2.0 and type(c.load_timeout_s) is float
    assert c.inline_wait_s == 0.0 and c.verify == "always" and c.fsync is False
    assert config(verify=False).verify is False and config().max_bytes is None


@pytest.mark.parametrize("extra, message", [
    ({"store": 5}, "store must be a string"),
    ({"store": "/a", "path": "/b"}, "store, path all name the store"),
    ({"store": "", "path": "/b"}, "store, path all name the store"),
    ({"shared_storage_path": ["/b"]}, "shared_storage_path must be a string"),
    ({}, "needs a 'store'"),
])
def test_the_store_is_named_once_as_a_string(extra, message):
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.from_extra(extra)


def test_a_relative_store_path_is_warned_about(caplog):
    """It resolves against the server's working directory: a number given as the store
    once made a directory named ``5`` wherever the server was started."""
    with caplog.at_level(logging.WARNING, logger="encache.connector"):
        assert config().store == "/srv/encache" and not caplog.records
        ConnectorConfig.from_extra({"store": "cache/encache"})
        ConnectorConfig.from_extra({"store": "redis://h:6379/0"})
    assert [r.getMessage().split(" is ")[0] for r in caplog.records] == [
        "encache connector: store 'cache/encache'"]


def test_read_threads_reach_disk_stores(tmp_path):
    """``read_threads`` (1 or 2) reaches the store and its local tier; anything else is
    refused in one line."""
    from encache.connectors.store import open_store

    assert config().store_options()["read_threads"] == 2
    options = ConnectorConfig.from_extra({"store": str(tmp_path / "shared"), "read_threads": 1,
                                          "local_tier": str(tmp_path / "tier")}).store_options()
    store = open_store(str(tmp_path / "shared"), **options)
    try:
        assert store.remote.read_threads == 1 and store.tier.read_threads == 1
    finally:
        store.close()
    for bad in (0, 3, "2", True, 1.0):
        with pytest.raises(ValueError, match="read_threads must be 1 or 2"):
            config(read_threads=bad)


def test_a_serving_engine_never_waits_out_a_cluster_failover():
    """``redirect_wait`` reaches a Redis Cluster store only: 0 for a serving engine (its
    writes and header reads for a dead primary fail at once), what precompute's engine
    passes (the store's default: a batch job rides through a failover), and never over
    the URL's own value. Other stores take no such option."""
    from encache.connectors.store.redis.cluster import REDIRECT_WAIT_S
    cluster = "redis+cluster://127.0.0.1:7000?prefix=p:"
    assert ConnectorConfig.from_extra({"store": cluster}).store_options()["redirect_wait"] == 0
    assert ConnectorConfig.from_extra({"store": cluster, "redirect_wait": REDIRECT_WAIT_S}
                                      ).store_options()["redirect_wait"] == REDIRECT_WAIT_S
    assert "redirect_wait" not in ConnectorConfig.from_extra(
        {"store": cluster + "&redirect_wait=3"}).store_options()
    for query in ("&xredirect_wait=3", "&redirect_wait="):  # (as the store parses its URL)
        assert ConnectorConfig.from_extra({"store": cluster + query}
                                          ).store_options()["redirect_wait"] == 0
    assert "redirect_wait" not in config(redirect_wait=5).store_options()  # a directory
    assert "redirect_wait" not in ConnectorConfig.from_extra(
        {"store": "redis://127.0.0.1:6379/0"}).store_options()
    with pytest.raises(ValueError, match="redirect_wait"):
        config(redirect_wait=-1)
