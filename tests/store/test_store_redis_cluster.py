"""RedisClusterStore on a real local Redis Cluster (3 primaries + 3 replicas): the store
contract suite, the slot-aligned key layout, URLs, per-primary capacity, resharding
under writers and readers, and a primary SIGKILLed (failover to its replica)."""

from __future__ import annotations

import hashlib
import threading
import time
import uuid

import pytest

from encache.connectors.store import StoreError, decode, open_store
from encache.connectors.store.redis.cluster import RedisClusterStore
from encache.connectors.store.redis.cluster_routing import key_slot, parse_cluster_url, slot_tags
from entries import big_blob
from store_contract import StoreContract, blob

pytestmark = pytest.mark.redis


def fresh_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}:"


class TestRedisClusterStore(StoreContract):
    @pytest.fixture
    def store(self, redis_cluster):
        s = RedisClusterStore(redis_cluster.url, prefix=fresh_prefix())
        yield s
        s.close()


class TestRedisClusterStoreOnValkey(StoreContract):
    """The same contract on a Valkey cluster through the same ``redis+cluster://`` URL."""

    @pytest.fixture
    def store(self, valkey_cluster):
        s = RedisClusterStore(valkey_cluster.url, prefix=fresh_prefix())
        yield s
        s.close()

    def test_info_names_the_valkey_release(self, store):
        extra = store.info().extra
        assert extra["valkey_version"] and extra["primaries"] == 3


@pytest.fixture
def store(redis_cluster):
    s = RedisClusterStore(redis_cluster.url, prefix=fresh_prefix())
    yield s
    s.close()


# -- URLs ---------------------------------------------------------------------------------------
def test_open_store_picks_the_cluster_store(redis_cluster):
    prefix = fresh_prefix()
    s = open_store(f"{redis_cluster.url}?prefix={prefix}&ttl=60", socket_timeout=1.5,
                   max_bytes=10, fsync=False)
    assert isinstance(s, RedisClusterStore) and s.prefix == prefix and s.ttl == 60.0
    assert s.backend == "redis-cluster" and s.socket_timeout == 1.5 and s.redirect_wait == 10
    assert open_store(f"{redis_cluster.url}?redirect_wait=2.5").redirect_wait == 2.5
    with pytest.raises(StoreError, match="redirect_wait"):
        open_store(f"{redis_cluster.url}?redirect_wait=soon")
    one = open_store(redis_cluster.url_for(nodes=1) + f"/0?prefix={prefix}")  # one seed node
    b = blob("x")
    s.put("x", b)
    assert bytes(one.get("x")) == b


def test_url_parsing_and_errors():
    nodes, single, query = parse_cluster_url("rediss+cluster://u:p%40w@h1:7000,[::1]:7001/0?prefix=a:")
    assert nodes == [("h1", 7000), ("::1", 7001)] and single == "rediss://u:p%40w@h1:7000/0"
    assert query == "prefix=a:"
    for bad, why in (("redis+cluster://h1:7000/3", "only database 0"),
                     ("redis+cluster://h1", "bad node"), ("redis+cluster://h1:x", "bad node")):
        with pytest.raises(StoreError, match=why):
            open_store(bad)
    with pytest.raises(StoreError, match="braces"):
        open_store("redis+cluster://127.0.0.1:1?prefix=a{b}:")


def test_password_is_redacted_and_required(redis_cluster_factory):
    c = redis_cluster_factory(3, 0, password="cl-Secret-77")
    good = open_store(c.url)
    b = blob("a")
    good.put("a", b)
    assert bytes(good.get("a")) == b and "cl-Secret-77" not in good.url + repr(good)
    assert "***" in good.url
    for url in (c.url_for(password="wrong-pw"), c.url_for(password=None)):
        with pytest.raises(StoreError, match="authentication failed|NOAUTH|WRONGPASS") as e:
            open_store(url).get("a")
        assert "cl-Secret-77" not in str(e.value) and "wrong-pw" not in str(e.value)
        assert "\n" not in str(e.value)


def test_tls_cluster(redis_cluster_factory):
    c = redis_cluster_factory(3, 0, tls=True, password="tls-cl-pw")
    url = c.url_for(nodes=3)
    assert url.startswith("rediss+cluster://")
    s = open_store(url)
    blobs = {f"t{i}": blob(f"t{i}", seed=i) for i in range(30)}
    for i, b in blobs.items():
        s.put(i, b)
    assert {i: bytes(s.get(i)) for i in blobs} == blobs and s.count() == 30
    assert len(s.info().extra["nodes"]) == 3 and "tls-cl-pw" not in s.url
    untrusted = open_store(url.split("?")[0])  # the system CAs do not know the certificate
    with pytest.raises(StoreError, match="certificate") as e:
        untrusted.get("t1")
    assert "tls-cl-pw" not in str(e.value) and "\n" not in str(e.value)


# -- layout -----------------------------------------------------------------------------------------
def test_slot_tags_are_slot_aligned():
    tags = slot_tags()
    assert len(tags) == 16384 and len(set(tags)) == 16384
    assert all(key_slot(t) == s for s, t in enumerate(tags))
    from redis.crc import key_slot as redis_key_slot
    assert all(redis_key_slot(b"x{%s}:e:y" % t) == s for s, t in list(enumerate(tags))[::97])


def test_entry_and_side_records_share_a_slot_and_spread_over_all_primaries(store, redis_cluster):
    r = redis_cluster.client()
    ids = [f"{i:064x}" for i in range(60)]
    for i in ids:
        store.put(i, blob(i))
    slots = set()
    for i in ids:
        key = store.key(i)
        meta, atime = store._side(i.encode())
        assert r.keyslot(key) == r.keyslot(meta) == r.keyslot(atime) == key_slot(i.encode())
        assert r.hexists(meta, i) and r.zscore(atime, i) is not None
        assert r.get(key) == bytes(store.get(i))
        slots.add(r.keyslot(key))
    owners = {r.get_node_from_key(store.key(i)).name for i in ids}
    assert owners == {n.name for n in r.get_primaries()}  # every primary holds entries
    per_node = [r.dbsize(target_nodes=n) for n in r.get_primaries()]
    assert all(n > 0 for n in per_node)
    assert store.count() == 60 and store.info().extra["entries"] == 60


def test_scan_rebuilds_missing_headers_and_prunes(store, redis_cluster):
    r = redis_cluster.client()
    for i in ("keep", "h1", "gone"):
        store.put(i, blob(i))
    r.delete(store._side(b"h1")[0])  # a bucket's header hash evicted
    r.delete(store.key("gone"))  # eviction takes only the blob
    infos = {e.identifier: e for e in store.scan()}
    assert set(infos) == {"keep", "h1"} and infos["h1"].meta.identifier == "h1"
    assert r.hexists(store._side(b"h1")[0], "h1")  # written back
    meta, atime = store._side(b"gone")
    assert not r.hexists(meta, "gone") and r.zscore(atime, "gone") is None  # pruned


def test_many_keys_scan_and_delete_many(store):
    ids = [f"l{i % 3}:{i:064x}" for i in range(1500)]
    one = blob("x", n=1)
    for i in ids:
        store.put(i, one)
    assert sorted(store.identifiers()) == sorted(ids) and len(list(store.scan())) == 1500
    assert store.delete_many(i for i in ids if i.startswith("l0:")) == 500
    assert store.count() == 1000 and not any(i.startswith("l0:") for i in store.identifiers())


# -- capacity per primary -------------------------------------------------------------------------------
def test_stats_info_and_warnings_per_primary(redis_cluster_factory):
    c = redis_cluster_factory(3, 1)
    s = open_store(c.url)
    s.put("a", blob("a"))
    info = s.info()
    nodes = info.extra["nodes"]
    assert len(nodes) == 3 and info.extra["primaries"] == 3
    assert {n["node"] for n in nodes} == {f"127.0.0.1:{p.port}" for p in c.primaries()}
    assert all(n["used_memory"] > 0 and n["replicas"] == 1 for n in nodes)
    w = info.extra["warnings"]
    assert sum("unbounded" in x for x in w) == 3 and sum("noeviction" in x for x in w) == 3
    assert info.max_bytes is None
    p0, p1, p2 = c.primaries()
    for p in (p0, p1, p2):
        p.client().config_set("maxmemory-policy", "allkeys-lru")
        p.client().config_set("maxmemory", 64 << 20)
    assert s.capacity_warnings() == []
    assert s.info().max_bytes == 3 * (64 << 20)
    p1.client().config_set("maxmemory-policy", "noeviction")  # one node misconfigured
    w = s.capacity_warnings()
    assert any(x.startswith(f"primary 127.0.0.1:{p1.port}: ") and "noeviction" in x for x in w)
    assert not any(f"127.0.0.1:{p0.port}" in x for x in w)
    assert any("disagree" in x for x in w)


# -- resharding -----------------------------------------------------------------------------------------
def test_resharding_under_writers_and_readers_loses_nothing(redis_cluster_factory):
    c = redis_cluster_factory(3, 0)
    s = open_store(c.url + "?prefix=rs:")
    blobs = {f"pre{i:04d}": big_blob(f"pre{i:04d}", 48 << 10, seed=i) for i in range(240)}
    for i, b in blobs.items():
        s.put(i, b)
    stop = threading.Event()
    written: dict[str, bytes] = {}
    problems: list[str] = []
    reads = [0]

    def writer():
        w = s.reopen()
        n = 0
        while not stop.is_set():
            ident = f"new{n:05d}"
            b = big_blob(ident, 24 << 10, seed=10_000 + n)
            try:
                w.put(ident, b)
                written[ident] = b
            except StoreError as e:
                problems.append(f"put {ident}: {e}")
            n += 1

    def reader():
        rd = s.reopen()
        ids = sorted(blobs)
        n = 0
        while not stop.is_set():
            ident = ids[n % len(ids)]
            try:  # every other read as a consumer loads: received and checked in one pass
                got = rd.get(ident) if n % 2 else (rd.read_verified(ident) or (None,))[0]
                if got is None or bytes(got) != blobs[ident]:
                    problems.append(f"get {ident}: {'miss' if got is None else 'wrong bytes'}")
                reads[0] += 1
            except StoreError as e:
                problems.append(f"get {ident}: {e}")
            n += 1

    scans = [0]

    def scanner():  # listings while slots move: every entry listed is whole (may miss a few)
        sc = s.reopen()
        while not stop.is_set():
            try:
                infos = list(sc.scan())
            except StoreError as e:
                problems.append(f"scan: {e}")
                continue
            bad = [e.identifier for e in infos if e.error or e.meta is None]
            if bad:
                problems.append(f"scan listed unreadable entries {bad[:3]}")
            scans[0] += 1

    threads = [threading.Thread(target=writer), threading.Thread(target=reader),
               threading.Thread(target=scanner)]
    for t in threads:
        t.start()
    try:
        p0, p1, p2 = c.primaries()
        before = c.slots_of(p0)
        out = c.reshard(p0, p1, 1500)
        assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-1000:]
        out = c.reshard(p2, p0, 700)
        assert out.returncode == 0, out.stdout[-1000:] + out.stderr[-1000:]
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert c.slots_of(p0) == before - 1500 + 700
    assert not problems, problems[:5]
    assert reads[0] > 0 and len(written) > 0 and scans[0] > 0
    everything = {**blobs, **written}
    fresh = s.reopen()
    assert set(fresh.identifiers()) == set(everything)
    for ident, b in everything.items():  # every entry whole, with its header and access time
        got = fresh.get(ident)
        assert got is not None and bytes(got) == b, ident
        decode(got, identifier=ident, verify=True)
        st = fresh.stat(ident)
        assert st.meta is not None and st.size == len(b) and st.accessed is not None
    r = c.client()
    for ident in list(everything)[::7]:  # still one slot, one node per bucket
        meta, atime = fresh._side(ident.encode())
        assert r.get_node_from_key(fresh.key(ident)).name == r.get_node_from_key(meta).name
        assert r.hexists(meta, ident)


def test_a_slot_held_half_way_through_a_move(redis_cluster_factory):
    """Each state a reshard passes a slot through, held by hand (no timing): an entry still
    on the old owner is read there; once its keys moved but the slot has not, it is read
    through ASK (whole, header and all); a write to the open slot waits until the move
    finishes, then lands whole on the new owner; after the move, reads follow MOVED."""
    c = redis_cluster_factory(3, 0)
    s = open_store(c.url + "?prefix=hw:")
    r = c.client()
    by_slot: dict[int, list[str]] = {}  # two identifiers that share a slot (a bucket)
    for i in range(4000):
        ident = hashlib.sha256(b"%d" % i).hexdigest()
        by_slot.setdefault(r.keyslot(s.key(ident)), []).append(ident)
    slot, (first, second, *_) = next((k, v) for k, v in by_slot.items() if len(v) >= 2)
    blobs = {i: big_blob(i, 64 << 10, seed=n) for n, i in enumerate((first, second))}
    s.put(first, blobs[first])
    src = c.slot_owner(slot)
    dst = next(p for p in c.primaries() if p is not src)

    c.begin_slot_move(slot, src, dst)  # open; every key still on src
    assert bytes(s.get(first)) == blobs[first]
    assert bytes(s.read_verified(first)[0]) == blobs[first]  # (a consumer's load)
    assert c.move_slot_keys(slot, src, dst) >= 2  # the entry and its side records
    assert src.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    got = s.get(first)  # src answers ASK: read from dst
    assert got is not None and bytes(got) == blobs[first]
    decode(got, identifier=first, verify=True)
    assert bytes(s.read_verified(first)[0]) == blobs[first]
    assert s.stat(first).meta is not None

    finisher = threading.Timer(0.6, c.finish_slot_move, (slot, src, dst))
    t0 = time.monotonic()
    finisher.start()
    s.put(second, blobs[second])  # cannot commit while the slot is open: waits it out
    waited = time.monotonic() - t0
    finisher.join()
    assert waited >= 0.5, f"the write to an open slot returned after {waited:.2f}s"
    assert c.slot_owner(slot) is dst
    fresh = s.reopen()
    for ident, b in blobs.items():  # whole, on the new owner, found by a listing
        got = fresh.get(ident)
        assert got is not None and bytes(got) == b
        assert bytes(s.read_verified(ident)[0]) == b  # the old map: MOVED, followed
        decode(got, identifier=ident, verify=True)
        assert fresh.stat(ident).meta is not None
    assert dst.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) >= 4
    assert {first, second} <= set(fresh.identifiers())
    fresh.close()
    s.close()


# -- failover ---------------------------------------------------------------------------------------------


def test_primary_killed_fails_fast_then_its_replica_serves(redis_cluster_factory):
    c = redis_cluster_factory(3, 1)
    s = open_store(c.url_for(nodes=6), socket_timeout=1.0)
    blobs = {f"f{i:03d}": blob(f"f{i:03d}", seed=i) for i in range(60)}
    for i, b in blobs.items():
        s.put(i, b)
    r = c.client()
    victim = c.primaries()[0]
    on_victim = [i for i in blobs if r.get_node_from_key(s.key(i)).port == victim.port]
    assert on_victim
    replica = c.replica_of(victim)
    assert replica is not None
    c.wait_replicated(victim)
    c.kill(victim)  # SIGKILL by PID
    writer = s.reopen()
    wrote: dict = {}
    rewrite = blob(on_victim[-1], seed=99)

    def write_during_failover():  # a producer's write waits out the promotion
        t = time.monotonic()
        try:
            writer.put(on_victim[-1], rewrite)
            wrote["seconds"] = time.monotonic() - t
        except StoreError as e:
            wrote["error"] = str(e)

    th = threading.Thread(target=write_during_failover)
    th.start()
    t0 = time.monotonic()
    failures, served = 0, None
    while time.monotonic() - t0 < 60:
        t = time.monotonic()
        try:
            got = s.get(on_victim[0])
        except StoreError as e:
            assert time.monotonic() - t < 5, f"a failed read took {time.monotonic() - t:.1f}s"
            assert "\n" not in str(e)
            failures += 1
            time.sleep(0.2)
            continue
        served = time.monotonic() - t0
        assert got is not None and bytes(got) == blobs[on_victim[0]]
        break
    assert served is not None, "the replica was never promoted / picked up"
    assert failures > 0  # the dead primary was noticed (not silently served stale)
    assert c.role(replica) == "master"
    th.join(30)
    assert "error" not in wrote, wrote  # retried until the replica took over
    blobs[on_victim[-1]] = rewrite
    for i, b in blobs.items():  # nothing lost: the replica had everything
        assert bytes(s.get(i)) == b
    s.put("after", blob("after"))
    assert set(s.identifiers()) == set(blobs) | {"after"}
    infos = list(s.scan())  # (the promoted replica has no scripts loaded: reloaded)
    assert {e.identifier for e in infos} == set(blobs) | {"after"}
    assert all(e.error is None and e.meta is not None for e in infos)
    print(f"\nfailover: {failures} failed reads, served again after {served:.1f}s; "
          f"a write during it took {wrote['seconds']:.1f}s")
