"""The management commands on the shared stores: a real single Redis (``redis://``) and a
real local Redis Cluster (``redis+cluster://``, 3 primaries + 3 replicas, walking every
primary). Same code paths as disk, via the URL.

The flows both backends share are one test parametrised over ``shared`` (ids ``redis`` /
``redis-cluster``); what only one backend has (passwords and unreachable servers of a
single Redis; cluster node rows, cluster errors, warming into the cluster,
connector-config) is tested for that backend alone, below them.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

import pytest

from encache.cli import errors
from encache.connectors.store import decode, open_store
from encache.connectors.store.disk.store import DiskStore
from redis_fixture import free_port
from cli_support import H, invoke, one_line_error
from entries import put_entry

pytestmark = pytest.mark.redis

IDS = [f"{i:064x}" for i in range(100, 130)]  # enough to land on every primary of the cluster


# (identifier, rows, seed, model) written into each backend's store
REDIS_ENTRIES = [(H[0], 64, 0, "m"), (H[1], 32, 1, "m"), ("ad1:" + H[2], 64, 2, "m"),
                 (H[3], 64, 3, "other")]  # model "m" 3 (one of LoRA "ad1"), "other" 1
CLUSTER_ENTRIES = [(i, 32, n, "m" if n % 3 else "other") for n, i in enumerate(IDS)] + \
    [("ad1:" + H[2], 64, 2, "m")]  # on every primary; model "m" 21 (one of LoRA "ad1"), "other" 10


@dataclass
class Shared:
    """A populated shared store: its URL (with a fresh prefix), the open store, and what
    was written into it."""

    backend: str  # "redis" | "redis-cluster": the stats backend name, and the test id
    url: str
    store: object
    entries: list[tuple[str, int, int, str]]  # (identifier, rows, seed, model), in order
    cluster: object | None = None  # the redis_cluster fixture, for the cluster backend

    @property
    def ids(self) -> list[str]:
        return [e[0] for e in self.entries]

    def with_model(self, model: str) -> set[str]:
        return {e[0] for e in self.entries if e[3] == model}


@pytest.fixture(params=["redis", "redis-cluster"])
def shared(request):
    """A populated :class:`Shared` store per backend; only that backend's server is started."""
    if request.param == "redis":
        server, cluster, entries = request.getfixturevalue("redis_server"), None, REDIS_ENTRIES
        url = f"{server.url}?prefix=t-cli-{uuid.uuid4().hex}:"
    else:
        cluster = server = request.getfixturevalue("redis_cluster")
        entries = CLUSTER_ENTRIES
        url = f"{server.url}?prefix=t-ccli-{uuid.uuid4().hex[:10]}:"
    s = open_store(url)
    for ident, rows, seed, model in entries:
        put_entry(s, ident, rows, seed, model=model)
    yield Shared(request.param, url, s, entries, cluster)
    s.delete_many(list(s.identifiers()))
    s.reset_counters()
    s.close()


def on_every_primary(redis_cluster, s, idents) -> bool:
    r = redis_cluster.client()
    return {r.get_node_from_key(s.key(i)).name for i in idents} == \
        {n.name for n in r.get_primaries()}


# ---- the flows of both backends ------------------------------------------------------------


def test_list_stats_size(shared):
    url, s = shared.url, shared.store
    if shared.cluster:
        assert on_every_primary(shared.cluster, s, IDS)
    n = {"redis": 4, "redis-cluster": 31}[shared.backend]
    assert len(shared.entries) == n
    r = invoke("list", "-s", url, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["count"] == n
    assert {e["identifier"] for e in d["entries"]} == set(shared.ids)
    s.add_counters({"hits": 4, "misses": 1})
    st = json.loads(invoke("stats", "-s", url, "--json").stdout)
    assert st["backend"] == shared.backend and st["entries"] == n
    assert st["hits"] == 4 and st["misses"] == 1
    assert st["bytes"] == sum(e["size"] for e in d["entries"])
    assert invoke("size", "-s", url).stdout.strip() == str(st["bytes"])
    assert invoke("list", "-s", url, "-q", "--lora", "ad1").stdout.split() == ["ad1:" + H[2]]
    by = json.loads(invoke("size", "-s", url, "--by", "model", "--json").stdout)
    assert {g["name"]: g["entries"] for g in by["groups"]} == \
        {"redis": {"m": 3, "other": 1}, "redis-cluster": {"m": 21, "other": 10}}[shared.backend]
    if shared.cluster:
        nodes = st["backend_info"]["nodes"]
        assert len(nodes) == 3 and all(p["replicas"] == 1 and p["used_memory"] > 0 for p in nodes)
        assert len([w for w in st["backend_info"]["warnings"] if "unbounded" in w]) == 3


def test_stats_table_shows_backend_details(shared):
    url = shared.url
    r = invoke("stats", "-s", url)
    assert r.exit_code == 0, r.output
    assert shared.backend in r.stdout
    if shared.cluster:
        assert "Nodes" in r.stdout
        nodes = json.loads(invoke("stats", "-s", url, "--json").stdout)["backend_info"]["nodes"]
        assert len(nodes) == 3
        for n in nodes:
            assert n["node"] in r.stdout  # one row per primary
    else:
        assert "Used memory" in r.stdout and "Prefix" in r.stdout


# the model purged, and how many entries go / stay
PURGE = {"redis": ("m", 3, 1), "redis-cluster": ("other", 10, 21)}


def test_purge(shared):
    url, s = shared.url, shared.store
    model, n_gone, n_kept = PURGE[shared.backend]
    gone = shared.with_model(model)
    kept = set(shared.ids) - gone
    assert (len(gone), len(kept)) == (n_gone, n_kept)
    r = invoke("purge", "-s", url, "--model", model, "--dry-run")
    assert r.exit_code == 0 and f"Would delete {len(gone)} entries" in r.stdout
    r = invoke("purge", "-s", url, "--model", model, "-y", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["result"]["deleted"] == len(gone)
    assert set(s.identifiers()) == kept and s.count() == len(kept)
    if not shared.cluster:
        assert kept == {H[3]}


def test_verify_and_repair_delete(shared):
    url, s = shared.url, shared.store
    bad = shared.ids[1]  # redis H[1], redis-cluster IDS[1]
    b = bytearray(s.get(bad))
    b[-1] ^= 1
    s.put(bad, bytes(b))
    r = invoke("verify", "-s", url, "--json")
    assert r.exit_code == errors.EXIT_PROBLEMS
    assert [(f["identifier"], f["reason"]) for f in json.loads(r.stdout)["problems"]] == \
        [(bad, "checksum")]
    d = json.loads(invoke("verify", "-s", url, "--repair", "--json").stdout)
    assert d["repair"]["deleted"] == 1 and d["repair"]["quarantined"] == 0  # no quarantine
    assert not s.contains(bad)
    assert invoke("verify", "-s", url).exit_code == 0


# ---- single Redis only ---------------------------------------------------------------------


def test_password_is_redacted_and_bad_password_is_store_error(redis_factory):
    server = redis_factory(password="s3cret-pw")
    url = server.url_for(password="s3cret-pw")
    r = invoke("stats", "-s", url, "--json")
    assert r.exit_code == 0, r.output
    assert "s3cret-pw" not in r.stdout
    bad = server.url_for(password="wrong")
    r = invoke("list", "-s", bad)
    assert r.exit_code == errors.EXIT_STORE
    assert "s3cret-pw" not in one_line_error(r) and "wrong" not in r.stderr


def test_unreachable_redis_is_store_error():
    r = invoke("stats", "-s", f"redis://127.0.0.1:{free_port()}/0")
    assert r.exit_code == errors.EXIT_STORE
    one_line_error(r)


# ---- Redis Cluster only --------------------------------------------------------------------


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


def test_a_dead_primary_gives_partial_reports_of_the_others(redis_cluster_factory):
    """A primary lost for good on a cluster that serves the rest
    (``cluster-require-full-coverage no``, as docs/redis-cluster.md recommends for a
    cache): every management command reports the live primaries' entries, names the dead
    one (``unreachable`` in JSON, a ``Partial:`` line on stderr) and exits 3; a purge
    deletes what it can reach. With the default ``yes`` the whole cluster refuses: exit 7,
    saying so."""
    c = redis_cluster_factory(3, 0, config={"cluster-require-full-coverage": "no"})
    url = c.url_for(nodes=3) + "?prefix=dead:"
    s = open_store(url)
    for ident, rows, seed, model in CLUSTER_ENTRIES:
        put_entry(s, ident, rows, seed, model=model)
    r = c.client()
    victim = c.primaries()[1]
    lost = {i for i, *_ in CLUSTER_ENTRIES if r.get_node_from_key(s.key(i)).port == victim.port}
    live = {i for i, *_ in CLUSTER_ENTRIES} - lost
    assert lost and live
    counters_on_victim = r.get_node_from_key(s._counters_key).port == victim.port
    s.add_counters({"hits": 2})
    s.close()
    c.kill(victim)
    gone = [{"part": f"127.0.0.1:{victim.port}",
             "error": "connection refused (is redis-server running there?)"}]

    def partial(*args):
        res = invoke(*args, "-s", url)
        assert res.exit_code == errors.EXIT_PARTIAL, res.output
        assert f"Partial: 127.0.0.1:{victim.port} did not answer" in res.stderr
        assert "Traceback" not in res.stderr
        return res

    d = json.loads(partial("list", "--json").stdout)
    assert d["unreachable"] == gone and {e["identifier"] for e in d["entries"]} == live
    assert set(partial("list", "-q").stdout.split()) == live
    st = json.loads(partial("stats", "--json").stdout)
    assert st["unreachable"] == gone and st["entries"] == len(live)
    assert st["hits"] == (0 if counters_on_victim else 2)
    assert (st["counters_unavailable"] is not None) == counters_on_victim
    nodes = {n["node"]: n for n in st["backend_info"]["nodes"]}
    assert nodes[gone[0]["part"]]["reachable"] is False and len(nodes) == 3
    table = partial("stats").stdout
    assert f"127.0.0.1:{victim.port}  unreachable" in table
    size = json.loads(partial("size", "--by", "model", "--json").stdout)
    assert size["entries"] == len(live) and size["unreachable"] == gone
    ver = json.loads(partial("verify", "--json").stdout)
    assert ver["checked"] == len(live) and ver["clean"] and ver["unreachable"] == gone
    res = invoke("purge", "--lora", "ad1", "--stale", "--dry-run", "-s", url)
    assert res.exit_code == errors.EXIT_STORE  # the newest adapter may be on the dead one
    assert "cannot be told" in one_line_error(res)
    plan = json.loads(partial("purge", "--all", "--dry-run", "--json").stdout)["plan"]
    assert plan["entries"] == len(live) and plan["unreachable"] == gone
    done = json.loads(partial("purge", "--all", "--yes", "--json").stdout)
    assert done["result"]["deleted"] == len(live)
    assert json.loads(partial("list", "--json").stdout)["entries"] == []

    down = redis_cluster_factory(3, 0)  # cluster-require-full-coverage yes (the default)
    s = open_store(down.url)
    for n, ident in enumerate(IDS):  # (on every primary: the live ones' pages are read)
        put_entry(s, ident, 32, n)
    s.close()
    down.kill(down.primaries()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the nodes agree the slots are uncovered
        res = invoke("list", "-s", down.url)
        if "cluster is down" in res.stderr:
            break
        time.sleep(0.2)
    assert res.exit_code == errors.EXIT_STORE, res.output
    assert "cluster-require-full-coverage" in one_line_error(res)


def test_a_purge_whose_lock_is_on_a_dead_primary_purges_the_others(redis_cluster_factory):
    """The ``purge`` lock is one key, on one primary: when that primary is lost the
    purge goes on without it (a partial purge, exit 3), as it does for the entries."""
    c = redis_cluster_factory(3, 0, config={"cluster-require-full-coverage": "no"})
    r = c.client()
    victim = c.primaries()[1]
    prefix = next(p for p in (f"lk{n}:" for n in range(1000))  # its lock key on the victim
                  if r.get_node_from_key(f"{p}lock:purge").port == victim.port)
    url = c.url_for(nodes=3) + f"?prefix={prefix}"
    s = open_store(url)
    for n, ident in enumerate(IDS):
        put_entry(s, ident, 32, n)
    live = {i for i in IDS if r.get_node_from_key(s.key(i)).port != victim.port}
    s.close()
    c.kill(victim)
    res = invoke("purge", "--all", "--yes", "--json", "-s", url)
    assert res.exit_code == errors.EXIT_PARTIAL, res.output
    assert json.loads(res.stdout)["result"]["deleted"] == len(live)
