"""RedisStore on a real redis-server: the contract suite plus Redis-only behaviour
(key layout, scan without tensors, AUTH, server crash/hang, capacity warnings, locks)."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from encache.connectors.store import LockBusy, StoreError, decode, encode_parts, open_store
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.redis.store import RedisStore
from entries import big_blob
from redis_fixture import free_port
from store_contract import StoreContract, blob

pytestmark = pytest.mark.redis


def fresh_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:12]}:"


class TestRedisStore(StoreContract):
    @pytest.fixture
    def store(self, redis_server):
        s = RedisStore(redis_server.url, prefix=fresh_prefix())
        yield s
        s.close()

    def make_store(self, store):
        return store.reopen()


class TestRedisStoreOnValkey(StoreContract):
    """The same contract on ``valkey-server`` through the same ``redis://`` URL."""

    @pytest.fixture
    def store(self, valkey_server):
        s = RedisStore(valkey_server.url, prefix=fresh_prefix())
        yield s
        s.close()

    def test_info_names_the_valkey_release(self, store):
        extra = store.info().extra
        assert extra["valkey_version"] and extra["redis_version"]


@pytest.fixture
def store(redis_server):
    s = RedisStore(redis_server.url, prefix=fresh_prefix())
    yield s
    s.close()


# -- URLs, layout ---------------------------------------------------------------------------
def test_open_store_picks_redis_and_passes_options(redis_server):
    prefix = fresh_prefix()
    s = open_store(redis_server.url, prefix=prefix, socket_timeout=1.5, max_bytes=10, fsync=False)
    assert isinstance(s, RedisStore) and s.prefix == prefix and s.socket_timeout == 1.5
    q = open_store(redis_server.url + f"?prefix={prefix}&ttl=60")
    assert q.prefix == prefix and q.ttl == 60.0
    bx = blob("x")
    s.put("x", bx)
    assert bytes(q.get("x")) == bx
    u = open_store(redis_server.unix_url + f"&prefix={prefix}")
    assert u.url.startswith("unix:") and bytes(u.get("x")) == bx


def test_key_layout_and_same_bytes_as_disk(store, redis_server, tmp_path):
    ident = "lora9:" + "ab" * 32
    b = blob(ident)
    store.put(ident, b)
    disk = DiskStore(tmp_path)
    disk.put(ident, b)
    r = redis_server.client()
    p = store.prefix.encode()
    assert r.get(p + b"e:" + ident.encode()) == disk.entry_path(ident).read_bytes() == b
    assert r.type(p + b"meta") == b"hash" and r.hexists(p + b"meta", ident)
    assert r.zscore(p + b"atime", ident) is not None
    assert sorted(r.scan_iter(match=p + b"*")) == sorted(
        [p + b"e:" + ident.encode(), p + b"gen", p + b"journal", p + b"meta", p + b"atime"])
    assert r.type(p + b"journal") == b"stream"


def test_prefixes_isolate_tenants(redis_server):
    a = RedisStore(redis_server.url, prefix=fresh_prefix())
    b = RedisStore(redis_server.url, prefix=fresh_prefix())
    a.put("same", blob("same", seed=1))
    b.put("same", blob("same", seed=2))
    a.add_counters({"hits": 1})
    assert bytes(a.get("same")) != bytes(b.get("same"))
    assert list(a.identifiers()) == ["same"] and b.read_counters() == {}
    b.delete("same")
    assert a.contains("same")


def test_glob_characters_in_prefix_are_literal(redis_server):
    plain = RedisStore(redis_server.url, prefix="globx:")
    plain.put("p", blob("p"))
    star = RedisStore(redis_server.url, prefix="glob*:")
    star.put("s", blob("s"))
    assert list(star.identifiers()) == ["s"] and list(plain.identifiers()) == ["p"]
    plain.delete("p"), star.delete("s")


def test_get_many_keeps_order_and_misses(store):
    blobs = {i: blob(i) for i in ("a", "b", "c")}
    for i, b in blobs.items():
        store.put(i, b)
    got = store.get_many(["c", "nope", "a"])
    assert [bytes(g) if g else None for g in got] == [blobs["c"], None, blobs["a"]]


def test_large_multipart_put_is_exact(store, redis_server):
    arr = np.arange(3 << 20, dtype=np.uint8)  # 3 MiB: SET + APPEND inside MULTI
    header, view = encode_parts("big", arr, "U8", arr.shape)
    assert store.put("big", [header, view]) == len(header) + arr.nbytes
    got = store.get("big")
    meta, data = decode(got, identifier="big")
    assert bytes(data) == arr.tobytes()
    assert store.stat("big").size == len(got)


# -- scan: headers only, no LRU touch, self-repair ----------------------------------------------
def test_scan_reads_no_tensor_bytes_and_touches_no_entry(redis_factory):
    server = redis_factory()
    s = RedisStore(server.url)
    n, size = 20, 1 << 20
    for i in range(n):
        s.put(f"{i:064x}", big_blob(f"{i:064x}", size, seed=i))
    r = server.client()

    def stats():
        cmd = r.info("commandstats")
        calls = {k: v["calls"] for k, v in cmd.items()}
        return calls, r.info("stats")["total_net_output_bytes"]

    calls0, out0 = stats()
    infos = list(s.scan())
    calls1, out1 = stats()
    assert len(infos) == n and all(e.error is None and e.size > size for e in infos)
    for cmd in ("cmdstat_get", "cmdstat_getrange", "cmdstat_strlen", "cmdstat_mget"):
        assert calls1.get(cmd, 0) == calls0.get(cmd, 0), f"scan used {cmd}"
    assert out1 - out0 < n * 2000, "scan transferred more than headers"
    # a load is visible (the same measure is not blind)
    s.get(f"{0:064x}")
    assert stats()[1] - out1 > size


def test_scan_rebuilds_missing_headers(store, redis_server):
    for i in range(3):
        store.put(f"h{i}", blob(f"h{i}"))
    r = redis_server.client()
    r.delete(store.prefix + "meta")  # e.g. the side hash itself was evicted
    infos = {e.identifier: e for e in store.scan()}
    assert set(infos) == {"h0", "h1", "h2"}
    assert all(e.meta is not None and e.size == len(blob(e.identifier)) for e in infos.values())
    assert r.hlen(store.prefix + "meta") == 3  # written back
    r.hdel(store.prefix + "meta", "h1")
    assert store.stat("h1").meta.identifier == "h1"


def test_evicted_entry_disappears_and_side_records_are_pruned(store, redis_server):
    for i in ("keep", "gone"):
        store.put(i, blob(i))
    r = redis_server.client()
    r.delete(store.prefix + "e:gone")  # what eviction / expiry does: only the blob goes
    assert not store.contains("gone") and store.stat("gone") is None
    assert [e.identifier for e in store.scan()] == ["keep"]
    assert r.hkeys(store.prefix + "meta") == [b"keep"]
    assert r.zrange(store.prefix + "atime", 0, -1) == [b"keep"]


def test_scan_and_delete_many_on_thousands_of_keys(store):
    n = 3000
    one = blob("x", n=1)
    pipe_ids = [f"l{i % 3}:{i:064x}" for i in range(n)]
    t0 = time.perf_counter()
    for i in pipe_ids:
        store.put(i, one)
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    ids = list(store.identifiers())
    infos = list(store.scan())
    t_scan = time.perf_counter() - t0
    assert len(ids) == len(set(ids)) == n and len(infos) == n
    assert sum(e.lora == "l0" for e in infos) == 1000
    t0 = time.perf_counter()
    removed = store.delete_many(i for i in ids if i.startswith("l0:"))
    t_del = time.perf_counter() - t0
    assert removed == 1000
    assert store.delete_many([pipe_ids[0], "never-there"]) == 0
    assert store.delete_many([pipe_ids[1], "never-there", pipe_ids[2]], per_item=True) == \
        [True, False, True]
    left = set(store.identifiers())
    assert len(left) == 1998 and not any(i.startswith("l0:") for i in left)
    assert store.count() == 1998
    print(f"\n3000 keys: put {t_put:.2f}s, identifiers+scan {t_scan:.2f}s, delete_many {t_del:.3f}s")
    assert t_scan < 5 and t_del < 5


# -- access times, TTL ----------------------------------------------------------------------------
def test_get_records_access_time_throttled(store, redis_server):
    store.put("a", blob("a"))
    r = redis_server.client()
    old = time.time() - 7200
    r.zadd(store.prefix + "atime", {"a": old})
    store.get("a")  # this handle recorded an access at put time: throttled
    assert store.stat("a").accessed == pytest.approx(old)
    other = store.reopen()
    other.get("a")
    assert store.stat("a").accessed > time.time() - 60
    other.get("missing")  # a miss records nothing
    assert r.zscore(store.prefix + "atime", "missing") is None
    info = store.stat("a")
    assert info.created is not None and info.created <= info.accessed


def test_ttl_option_expires_entries(redis_server):
    s = RedisStore(redis_server.url, prefix=fresh_prefix(), ttl=0.5)
    arr = np.zeros(2 << 20, np.uint8)  # multi-part path keeps the TTL too
    s.put("t", list(encode_parts("t", arr, "U8", arr.shape)))
    s.put("u", blob("u"))
    r = redis_server.client()
    assert 0 < r.pttl(s.key("t")) <= 500 and 0 < r.pttl(s.key("u")) <= 500
    time.sleep(0.65)
    assert s.get("t") is None and list(s.identifiers()) == []
    assert list(s.scan()) == [] and r.hlen(s.prefix + "meta") == 0


# -- counters, lock ---------------------------------------------------------------------------------
def test_counters_are_shared_between_handles(store):
    other = store.reopen()
    store.add_counters({"hits": 2, "load_seconds": 0.25})
    other.add_counters({"hits": 1, "bytes_loaded": 1000})
    c = store.read_counters()
    assert c["hits"] == 3 and c["bytes_loaded"] == 1000 and c["load_seconds"] == 0.25
    assert isinstance(c["hits"], int) and c["updated"] > time.time() - 60
    other.reset_counters()
    assert store.read_counters() == {}


def test_keys_no_encache_writer_made_and_damaged_side_records(store):
    """A key under the entry prefix whose name is not UTF-8 (another program's) stopped
    every listing, and a consumer's index refresh counted the store as down for good: it
    is left out. A damaged side record (the ``meta`` row of a good entry) made verify
    report the entry, and a repair removed it: the entry's own header decides, and the
    row is written again."""
    from encache.connectors.lookup import EntryLookup
    from encache.connectors.store.ops.verify import verify_store

    good, damaged, bad = "a" * 64, "b" * 64, "c" * 64
    r, prefix = store._r, store.prefix.encode()
    r.set(prefix + b"e:\xff\xfe", b"x")  # not an identifier
    assert list(store.scan()) == [] and list(store.identifiers()) == []  # (a page of it)
    for ident in (good, damaged, bad):
        store.put(ident, blob(ident))
    r.hset(store._meta_key, damaged.encode(), b"\xff\xfe not a header record")
    r.set(prefix + b"e:" + bad.encode(), b"not an entry")  # a bad entry
    assert sorted(store.identifiers()) == [good, damaged, bad]
    scanned = {e.identifier: e.error for e in store.scan()}
    assert scanned[good] is None and scanned[damaged] is None  # (bad: its row is still good)
    rep = verify_store(store, repair=True)
    assert [f.identifier for f in rep.problems] == [bad]
    assert sorted(store.identifiers()) == [good, damaged]
    look = EntryLookup(store.reopen(), index_refresh_s=3600, load_threads=1)
    try:
        assert not look.breaker.is_open()
        assert look.load_now(good) is not None and look.load_now(damaged) is not None
    finally:
        look.close()


def test_a_database_that_is_not_a_number_is_an_error(redis_server):
    """redis-py reads ``/abc`` as no database at all: database 0, silently."""
    with pytest.raises(StoreError, match="database 'abc' is not a number"):
        open_store(redis_server.url.rsplit("/", 1)[0] + "/abc")


def test_damaged_bookkeeping_keys_are_read_past(store):
    """A counter that is not a finite number is left out; a generation key that is not a
    number, a journal record that is not UTF-8 or a cursor that is not the store's make
    the journal say it cannot tell (the caller re-checks what it holds), never an error
    (one would count as a store failure on every refresh)."""
    r = store._r
    store.add_counters({"hits": 2})
    r.hset(store._counters_key, mapping={b"misses": b"nan", b"saves": b"inf", b"x": b"y"})
    assert store.read_counters() == {"hits": 2, "updated": pytest.approx(time.time(), abs=60)}
    store.put("a" * 64, blob("a" * 64))
    gen, _ = store.changes_since(None)
    for cursor in ("x", [1], {"t": 1}, 1.5):
        assert store.changes_since(cursor) == (gen, None)
    r.xadd(store._journal_key, {b"i": b"\xff\xfe"}, id=f"{gen + 1}-0")
    r.set(store._gen_key, gen + 1)
    assert store.changes_since(gen) == (gen + 1, None)
    r.set(store._gen_key, b"not a number")
    assert store.changes_since(gen)[1] is None
    store.put("b" * 64, blob("b" * 64))  # (a write still goes in)
    assert store.stat("b" * 64) is not None


def test_lock_busy_names_holder_and_is_released(store):
    other = store.reopen()
    with store.lock("precompute"):
        t0 = time.monotonic()
        with pytest.raises(LockBusy) as e:
            with other.lock("precompute", wait=0.3):
                pass
        assert 0.25 < time.monotonic() - t0 < 2
        assert "pid " in str(e.value) and "precompute" in str(e.value)
        with other.lock("other-name"):  # names are independent
            pass
    with other.lock("precompute", wait=0):
        pass


def test_lock_waiter_gets_it_when_released(store):
    other = store.reopen()
    got = []

    def waiter():
        with other.lock("job", wait=3):
            got.append(time.monotonic())

    with store.lock("job"):
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)
        assert not got
        released = time.monotonic()
    t.join(5)
    assert got and got[0] >= released


def test_lock_is_renewed_while_held_and_expires_after_a_crash(redis_server):
    s = RedisStore(redis_server.url, prefix=fresh_prefix(), lock_ttl=1.0)
    other = s.reopen()
    r = redis_server.client()
    key = s.prefix + "lock:long"
    with s.lock("long") as handle:
        time.sleep(1.4)  # longer than the TTL: only renewal keeps it
        assert r.pttl(key) > 0 and not handle.lost
        with pytest.raises(LockBusy):
            with other.lock("long"):
                pass
    assert r.exists(key) == 0
    # a holder that died without releasing: the key expires and a waiter gets it
    r.set(key, "dead pid 1 on elsewhere", px=300)
    with pytest.raises(LockBusy, match="pid 1 on elsewhere"):
        with other.lock("long"):
            pass
    with other.lock("long", wait=2):
        pass


# -- AUTH and redaction ------------------------------------------------------------------------------
def test_auth_required(redis_factory):
    pw = "p@ss:w/rd%Secret-123"
    server = redis_factory(password=pw)
    good = RedisStore(server.url)
    ba = blob("a")
    good.put("a", ba)
    assert bytes(good.get("a")) == ba
    unix = RedisStore(server.unix_url)
    assert unix.contains("a") and pw not in unix.url and "password=***" in unix.url

    texts = [str(good), repr(good), good.url, good.info().url, str(good.info()), str(unix)]
    for url, expect in ((server.url_for(password="wrong-one"), "wrong password"),
                        (server.url_for(password=None), "requires a password")):
        bad = RedisStore(url)
        t0 = time.monotonic()
        with pytest.raises(StoreError) as e:
            bad.get("a")
        assert time.monotonic() - t0 < 1.0  # auth failures are not retried
        assert expect in str(e.value) and "\n" not in str(e.value)
        texts += [str(e.value), str(bad)]
        with pytest.raises(StoreError):
            bad.put("b", blob("b"))
    with pytest.raises(StoreError) as e:
        RedisStore(server.url_for(password="wrong-one")).info()
    texts.append(str(e.value))
    assert all(pw not in t and "wrong-one" not in t for t in texts), texts
    assert "***" in good.url and "***" in texts[-1]


# -- faults: killed and hung server ----------------------------------------------------------------
def test_killed_server_fails_fast_then_recovers(redis_factory):
    server = redis_factory()
    s = RedisStore(server.url, prefix="f:")
    s.put("a", blob("a"))
    assert s.get("a") is not None
    server.kill()  # SIGKILL by PID
    ops = {
        "get": lambda: s.get("a"), "put": lambda: s.put("b", blob("b")),
        "contains": lambda: s.contains("a"), "scan": lambda: list(s.scan()),
        "identifiers": lambda: list(s.identifiers()),
        "counters": lambda: s.add_counters({"hits": 1}), "info": s.info,
    }
    for name, op in ops.items():
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="connection refused"):
            op()
        assert time.monotonic() - t0 < 2.0, name
    server.restart()  # same port, empty data
    assert s.get("a") is None
    ba = blob("a")
    s.put("a", ba)
    assert bytes(s.get("a")) == ba and list(s.identifiers()) == ["a"]


def test_hung_server_times_out(redis_factory):
    server = redis_factory()
    s = RedisStore(server.url, socket_timeout=1.0)  # default retries=2
    ba = blob("a")
    s.put("a", ba)
    server.pause()  # SIGSTOP: connections accepted by the kernel, never answered
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="timed out"):
            s.get("a")
        assert time.monotonic() - t0 < 1.9  # one timeout (a retry would be a second one)
    finally:
        server.resume()
    assert bytes(s.get("a")) == ba


def test_nothing_listening_is_a_store_error():
    s = RedisStore(f"redis://127.0.0.1:{free_port()}/0")  # constructing does not connect
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="connection refused"):
        s.ping()
    assert time.monotonic() - t0 < 2.0


# -- capacity ----------------------------------------------------------------------------------------
def test_capacity_warnings(redis_factory):
    server = redis_factory()
    s = RedisStore(server.url)
    r = server.client()
    w = s.capacity_warnings()  # defaults: maxmemory 0, noeviction
    assert len(w) == 2 and "unbounded" in w[0] and "noeviction" in w[1]
    r.config_set("maxmemory", 100 << 20)
    r.config_set("maxmemory-policy", "allkeys-lru")
    assert s.capacity_warnings() == []
    info = s.info()
    assert info.max_bytes == 100 << 20 and info.extra["warnings"] == []
    assert info.extra["maxmemory_policy"] == "allkeys-lru" and info.extra["used_memory"] > 0
    r.config_set("maxmemory-policy", "noeviction")
    [w] = s.capacity_warnings()
    assert "noeviction" in w and "fails" in w
    r.config_set("maxmemory-policy", "volatile-lru")
    [w] = s.capacity_warnings()
    assert "TTL" in w
    assert RedisStore(server.url, ttl=3600).capacity_warnings() == []  # entries do expire
    r.config_set("maxmemory-policy", "allkeys-lfu")
    r.config_set("maxmemory", 0)
    [w] = s.capacity_warnings()
    assert "unbounded" in w
    assert s.info().max_bytes is None


def test_capacity_read_from_info_when_config_is_disabled(redis_factory):
    server = redis_factory(config={"maxmemory": "50mb", "maxmemory-policy": "allkeys-lru",
                                   "rename-command": ["CONFIG", ""]})
    s = RedisStore(server.url)
    with pytest.raises(Exception):
        server.client().config_get("maxmemory")  # CONFIG really is gone
    assert s.capacity_warnings() == []
    assert s.info().max_bytes == 50 << 20


def test_full_noeviction_server_fails_writes_cleanly(redis_factory):
    server = redis_factory(config={"maxmemory": "3mb", "maxmemory-policy": "noeviction"})
    s = RedisStore(server.url)
    with pytest.raises(StoreError, match="out of memory"):
        for i in range(20):
            s.put(f"e{i}", big_blob(f"e{i}", 512 << 10, seed=i))
    failed = f"e{i}"
    assert not s.contains(failed) and s.stat(failed) is None
    assert failed not in set(s.identifiers())
    assert all(e.error is None for e in s.scan())
    assert any("noeviction" in w for w in s.info().extra["warnings"])


def test_tls_url(redis_factory):
    server = redis_factory(tls=True, password="tls-secret")
    s = RedisStore(server.tls_url)
    b = blob("t")
    s.put("t", b)
    assert bytes(s.get("t")) == b and s.url.startswith("rediss://:***@")
    untrusted = RedisStore(server.tls_url.split("?")[0])  # system CAs do not know the cert
    with pytest.raises(StoreError, match="certificate") as e:
        untrusted.get("t")
    assert "tls-secret" not in str(e.value) and "\n" not in str(e.value)


def test_header_longer_than_first_read(store, redis_server):
    ident = "L" * 4000  # header > 4 KiB: needs the second, exact GETRANGE when rebuilt
    b = blob(ident)
    store.put(ident, b)
    [info] = list(store.scan())
    assert info.identifier == ident and info.error is None and info.size == len(b)
    redis_server.client().delete(store.prefix + "meta")
    [info] = list(store.scan())
    assert info.identifier == ident and info.error is None and info.meta.shape == (64, 8)


def test_non_entry_bytes_are_listed_with_an_error(store):
    store.put("junk", b"not a safetensors file")
    [info] = list(store.scan())
    assert info.identifier == "junk" and info.meta is None and info.error == "bad-header"


def test_reads_work_on_a_read_only_replica(redis_factory):
    primary = redis_factory(config={"repl-diskless-sync-delay": "0"})
    replica = redis_factory(config={"replicaof": ["127.0.0.1", str(primary.port)]})
    b = blob("r")
    RedisStore(primary.url).put("r", b)
    ro = RedisStore(replica.url)
    deadline = time.monotonic() + 5
    while not ro.contains("r") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bytes(ro.get("r")) == b  # the access-time write is refused; the load is not
    assert [bytes(x) for x in ro.get_many(["r"])] == [b]
    assert [e.identifier for e in ro.scan()] == ["r"]
    with pytest.raises(StoreError, match="read-only replica"):
        ro.put("w", b)


def test_index_version_changes_only_on_writes(redis_server):
    from encache.connectors.store.redis.store import RedisStore
    s = RedisStore(redis_server.url, prefix="t-gen-ver:")
    v0 = s.index_version()
    assert s.index_version() == v0  # reads do not change it
    s.put("g1", blob("g1"))
    v1 = s.index_version()
    assert v1 != v0
    s.get("g1")
    assert s.index_version() == v1
    s.delete("g1")
    assert s.index_version() != v1
    s.close()
