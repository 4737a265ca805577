"""The management commands on a real local Redis Cluster (3 primaries + 3 replicas):
list / stats / size / verify / purge / warm through ``redis+cluster://`` URLs, walking
every primary."""

from __future__ import annotations

import json
import uuid

import pytest

from encache.cli import errors
from encache.connectors.store import decode, open_store
from encache.connectors.store.disk import DiskStore
from redis_fixture import free_port
from cli_support import H, invoke, one_line_error
from entries import put_entry

pytestmark = pytest.mark.redis

IDS = [f"{i:064x}" for i in range(100, 130)]  # enough to land on every primary


@pytest.fixture
def cstore(redis_cluster):
    url = f"{redis_cluster.url}?prefix=t-ccli-{uuid.uuid4().hex[:10]}:"
    s = open_store(url)
    for n, i in enumerate(IDS):
        put_entry(s, i, 32, n, model="m" if n % 3 else "other")
    put_entry(s, "ad1:" + H[2], 64, 2)
    yield url, s
    s.delete_many(list(s.identifiers()))
    s.reset_counters()
    s.close()


def on_every_primary(redis_cluster, s, idents) -> bool:
    r = redis_cluster.client()
    return {r.get_node_from_key(s.key(i)).name for i in idents} == \
        {n.name for n in r.get_primaries()}


def test_list_stats_size_walk_every_primary(cstore, redis_cluster):
    url, s = cstore
    assert on_every_primary(redis_cluster, s, IDS)
    r = invoke("list", "-s", url, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["count"] == 31 and {e["identifier"] for e in d["entries"]} == set(IDS) | {"ad1:" + H[2]}
    s.add_counters({"hits": 4, "misses": 1})
    st = json.loads(invoke("stats", "-s", url, "--json").stdout)
    assert st["backend"] == "redis-cluster" and st["entries"] == 31 and st["hits"] == 4
    assert st["bytes"] == sum(e["size"] for e in d["entries"])
    nodes = st["backend_info"]["nodes"]
    assert len(nodes) == 3 and all(n["replicas"] == 1 and n["used_memory"] > 0 for n in nodes)
    assert len([w for w in st["backend_info"]["warnings"] if "unbounded" in w]) == 3
    assert invoke("size", "-s", url).stdout.strip() == str(st["bytes"])
    assert invoke("list", "-s", url, "-q", "--lora", "ad1").stdout.split() == ["ad1:" + H[2]]
    table = invoke("stats", "-s", url)
    assert table.exit_code == 0, table.output
    assert "redis-cluster" in table.stdout and "Nodes" in table.stdout
    for n in nodes:
        assert n["node"] in table.stdout  # one row per primary
    by = json.loads(invoke("size", "-s", url, "--by", "model", "--json").stdout)
    assert {g["name"]: g["entries"] for g in by["groups"]} == {"m": 21, "other": 10}


def test_purge_across_primaries(cstore):
    url, s = cstore
    r = invoke("purge", "-s", url, "--model", "other", "--dry-run")
    assert r.exit_code == 0 and "Would delete 10 entries" in r.stdout
    r = invoke("purge", "-s", url, "--model", "other", "-y", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["result"]["deleted"] == 10
    assert len(set(s.identifiers())) == 21 and s.count() == 21


def test_verify_and_repair(cstore):
    url, s = cstore
    b = bytearray(s.get(IDS[1]))
    b[-1] ^= 1
    s.put(IDS[1], bytes(b))
    r = invoke("verify", "-s", url, "--json")
    assert r.exit_code == errors.EXIT_PROBLEMS
    assert [(f["identifier"], f["reason"]) for f in json.loads(r.stdout)["problems"]] == \
        [(IDS[1], "checksum")]
    d = json.loads(invoke("verify", "-s", url, "--repair", "--json").stdout)
    assert d["repair"]["deleted"] == 1 and not s.contains(IDS[1])
    assert invoke("verify", "-s", url).exit_code == 0


def test_warm_promotes_a_disk_store_into_the_cluster(tmp_path, redis_cluster):
    src = DiskStore(tmp_path / "disk", fsync=False)
    for n, i in enumerate(IDS):
        put_entry(src, i, 16 + n, seed=n)
    url = f"{redis_cluster.url}?prefix=t-cwarm-{uuid.uuid4().hex[:10]}:"
    r = invoke("warm", "--from", src.root, "--store", url, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["copied"], d["skipped"], d["failed"]) == (len(IDS), 0, 0)
    dst = open_store(url)
    assert on_every_primary(redis_cluster, dst, IDS)
    for i in IDS:
        got = dst.get(i)
        assert bytes(got) == src.entry_path(i).read_bytes()
        decode(got, identifier=i, verify=True)
    again = json.loads(invoke("warm", "--from", src.root, "--store", url, "--json").stdout)
    assert (again["copied"], again["skipped"]) == (0, len(IDS))
    r = invoke("warm", "--store", url)  # page-cache warming is for disk stores
    assert r.exit_code == errors.EXIT_USAGE
    dst.delete_many(IDS)


def test_cluster_errors_are_one_line_store_errors(redis_cluster_factory):
    r = invoke("stats", "-s", f"redis+cluster://127.0.0.1:{free_port()},127.0.0.1:{free_port()}")
    assert r.exit_code == errors.EXIT_STORE
    assert "connection refused" in one_line_error(r)
    r = invoke("list", "-s", "redis+cluster://127.0.0.1:1/5")
    assert r.exit_code == errors.EXIT_STORE and "database 0" in one_line_error(r)
    c = redis_cluster_factory(3, 0, password="Cli-pw-1")
    r = invoke("stats", "-s", c.url_for(password="wrong"))
    assert r.exit_code == errors.EXIT_STORE and "authentication failed" in one_line_error(r)
    assert "Cli-pw-1" not in r.stdout + r.stderr and "wrong" not in r.stderr
    r = invoke("stats", "-s", c.url, "--json")
    assert r.exit_code == 0 and "Cli-pw-1" not in r.stdout


def test_connector_config_keeps_the_cluster_url(redis_cluster):
    url = redis_cluster.url_for(nodes=3) + "?prefix=llava:"
    for role in ("ec_consumer", "ec_producer", "ec_both"):
        r = invoke("connector-config", "--store", url, "--role", role)
        assert r.exit_code == 0, r.output
        cfg = json.loads(r.stdout)
        assert cfg["ec_role"] == role and cfg["ec_connector_extra_config"]["store"] == url
