"""A consumer's loads across a Redis Cluster failover, on a real local cluster.

redis-py's cluster client keeps routing a dead primary's slots to it until a failed call
makes it re-read the slot map. A consumer's load (``get``/``read_entry``/``get_many``)
that meets such a stale route re-reads the map once and retries once, at once: its first
load after the replica's promotion is a hit, not a miss (and its first listing, an index
refresh, walks the new primaries instead of failing on the dead one) — also for a client that does no
retries of its own (``retries=0``: redis-py then gives up on the first refused
connection). While the primary is dead and not yet promoted, loads still fail fast and
those re-reads are rate-limited (once per ~0.5 s per store).
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from encache.connectors.store import StoreError, open_store
from store_contract import blob

pytestmark = pytest.mark.redis




def _fresh_reads(url: str, ident: str) -> bool:
    """Does a brand-new client (slot map read now) load ``ident``?"""
    fresh = open_store(url)
    try:
        return fresh.get(ident) is not None
    except StoreError:
        return False
    finally:
        fresh.close()


def _all_nodes_know(c, victim) -> bool:
    """Has every live node heard of the promotion (no CLUSTER SLOTS names ``victim``)?
    (Right after a failover, nodes learn it by gossip within some ms of each other: a
    slot-map re-read that asks a node not yet told still gets the old route.)"""
    for n in c.nodes:
        if n.alive:
            try:
                slots = n.client().execute_command("CLUSTER SLOTS")
            except Exception:
                return False
            if any(int(s[2][1]) == victim.port for s in slots):
                return False
    return True


def _stored_on_a_victim(c, tag: str, n: int):
    """``n`` entries stored under a fresh prefix; ``(url, writer, blobs, victim,
    identifiers on victim)``, the victim being the first primary, which also holds the
    store's ``gen`` key (an index refresh's first read)."""
    r = c.client()
    victim = c.primaries()[0]
    while True:
        prefix = f"{tag}-{uuid.uuid4().hex[:8]}:"
        if r.get_node_from_key(f"{{{prefix}}}gen").port == victim.port:
            break
    url = c.url_for(nodes=6) + f"?prefix={prefix}"
    writer = open_store(url)
    assert writer._gen_key == f"{{{prefix}}}gen".encode()
    blobs = {f"{tag}{i:03d}": blob(f"{tag}{i:03d}", seed=i) for i in range(n)}
    for i, b in blobs.items():
        writer.put(i, b)
    on_victim = [i for i in blobs if r.get_node_from_key(writer.key(i)).port == victim.port]
    return url, writer, blobs, victim, on_victim


def test_first_load_after_promotion_is_a_hit(redis_cluster_factory):
    c = redis_cluster_factory(3, 1)
    url, writer, blobs, victim, on_victim = _stored_on_a_victim(c, "f", 60)
    assert len(on_victim) >= 7
    # three consumers, each with a client that routes the victim's slots to it: one reads
    # with read_entry (plain GET: its access time was just refreshed), one with get and an
    # access time refreshed on every load (GET + ZADD pipeline), one with get_many
    # a fourth does no retries of its own (retries=0: redis-py stops at the first refused
    # connection; with retries redis-py itself re-reads the map and retries too)
    by_entry = open_store(url)
    by_get = open_store(url, access_resolution=0)
    by_many = open_store(url)
    no_retries = open_store(url, retries=0)
    threaded = open_store(url, retries=0)  # four load threads at once, as a consumer's pool
    # and the consumer's own load: the GET's reply received and checked in one pass (its
    # socket taken from the stale map's pool: connection refused, then get()'s recovery)
    by_verified = open_store(url)
    consumers = (by_entry, by_get, by_many, no_retries, threaded, by_verified)
    for consumer in consumers:
        assert all(bytes(consumer.get(i)) == blobs[i] for i in on_victim)
    by_list = open_store(url)  # and a consumer's index refresh (the walk over the primaries)
    assert set(by_list.identifiers()) == set(blobs)
    by_version = open_store(url, retries=0)  # and its first read: the gen key, on the victim
    version = by_version.index_version()
    replica = c.replica_of(victim)
    assert replica is not None
    c.wait_replicated(victim)
    c.kill(victim)  # SIGKILL by PID
    deadline = time.monotonic() + 60
    while not (c.role(replica) == "master" and c.slots_of(replica) > 0
               and _fresh_reads(url, on_victim[0]) and _all_nodes_know(c, victim)):
        assert time.monotonic() < deadline, "the replica was not promoted / never served"
        time.sleep(0.2)
    # the consumers' clients still route those slots to the dead node: their FIRST loads
    t = time.monotonic()
    got = by_entry.read_entry(on_victim[0])
    took = time.monotonic() - t
    assert got is not None and bytes(got[0]) == blobs[on_victim[0]]
    got = by_get.get(on_victim[1])
    assert got is not None and bytes(got) == blobs[on_victim[1]]
    many = by_many.get_many(on_victim)
    assert [bytes(v) for v in many] == [blobs[i] for i in on_victim]
    # ... even when its store re-read the map a moment ago and learnt nothing (it asked a
    # node not yet told of the promotion, as a consumer's index refresh can): its own
    # re-read is then rate-limited, and redis-py's GET re-reads the map and retries
    by_verified._next_reroute = time.monotonic() + 60
    before = time.time()
    got = by_verified.read_verified(on_victim[0])
    assert got is not None and bytes(got[0]) == blobs[on_victim[0]] and got[4] is True
    member = on_victim[0].encode()  # its access time refreshed on the new primary
    assert c.client().zscore(by_verified._side(member)[1], member) >= before
    got = no_retries.read_entry(on_victim[2])
    assert got is not None and bytes(got[0]) == blobs[on_victim[2]]
    assert no_retries.route_refreshes == 1  # (its own re-read made the hit)
    with ThreadPoolExecutor(4) as pool:  # only one may re-read the map: all four still hit
        got = list(pool.map(threaded.read_entry, on_victim[3:7]))
    assert [bytes(g[0]) for g in got] == [blobs[i] for i in on_victim[3:7]]
    assert set(by_list.identifiers()) == set(blobs)  # the first listing walks the new map
    assert by_list.route_refreshes == 1
    assert by_version.index_version() == version  # (its slot is the hash tag's: rerouted)
    assert by_version.route_refreshes == 1
    by_version.close()
    by_list.close()
    for consumer in consumers:
        assert all(bytes(consumer.get(i)) == blobs[i] for i in on_victim)
        consumer.close()
    print(f"\nfirst load after the promotion: a hit in {took * 1000:.0f} ms")
    writer.close()


def test_loads_fail_fast_and_refreshes_are_rate_limited_until_promotion(redis_cluster_factory):
    # the replica never takes over (cluster-replica-no-failover) and the other slots stay
    # served (no full coverage required): a primary that is dead and not promoted, for as
    # long as the test likes
    c = redis_cluster_factory(3, 1, config={"cluster-replica-no-failover": "yes",
                                            "cluster-require-full-coverage": "no"})
    url, writer, blobs, victim, on_victim = _stored_on_a_victim(c, "d", 30)
    elsewhere = [i for i in blobs if i not in on_victim]
    assert on_victim and elsewhere
    consumers = [open_store(url), open_store(url, retries=0)]
    for consumer in consumers:  # (builds the client; routes the victim's slots to it)
        assert consumer.get(on_victim[0]) is not None
    c.kill(victim)  # SIGKILL by PID
    for consumer in consumers:
        t0 = time.monotonic()
        took = []
        failed = 0
        while time.monotonic() - t0 < 2.0:  # a consumer hammering the dead slots for 2 s
            for n, i in enumerate(on_victim):
                t = time.monotonic()
                try:  # (both load paths: redis-py's GET, and the one-pass receive)
                    consumer.read_entry(i) if n % 2 else consumer.read_verified(i)
                except StoreError as e:  # one line, naming the dead primary
                    assert "\n" not in str(e)
                    assert e.domain == f"{victim.host}:{victim.port}", e
                    assert str(e).endswith(f" [primary {e.domain}]"), e
                    failed += 1
                took.append(time.monotonic() - t)
        elapsed = time.monotonic() - t0
        print(f"\nretries={consumer._options['retries']}: {len(took)} failed loads in "
              f"{elapsed:.1f}s (slowest {max(took) * 1000:.0f} ms), "
              f"{consumer.route_refreshes} slot-map re-reads for loads")
        assert failed == len(took), "a dead primary's entry was served"
        # fail fast: loads take milliseconds, none waits for a socket timeout (2 s); the
        # bound on the slowest leaves room for one scheduling stall on a busy 2-core host
        took.sort()
        p90 = took[int(len(took) * 0.9)]
        assert p90 < 0.1, f"p90 of failed loads {p90:.2f}s"
        assert took[-1] < 1.5, f"a failed load took {took[-1]:.2f}s (a socket timeout?)"
        assert len(took) > 20  # (fail fast: many loads fit in 2 s)
        # re-reads for loads: at most one per ~0.5 s, however many loads failed
        assert 1 <= consumer.route_refreshes <= elapsed / 0.5 + 1
        for i in elsewhere[:5]:  # the live primaries' slots still load
            assert bytes(consumer.get(i)) == blobs[i]
        consumer.close()
    writer.close()


def test_a_dead_primary_makes_misses_of_its_entries_only(redis_cluster_factory):
    """A consumer's lookup on a cluster whose primary died (and is not replaced: the other
    slots stay served) misses only that primary's entries: its failed loads and its index
    refreshes (whose walk meets the dead node) trip the breaker of that primary alone, and
    the entries on the other primaries still load, for as long as the outage lasts. Once
    the node serves again, the lookup's probe closes its breaker: an entry written to its
    slots loads."""
    from encache.connectors.lookup import EntryLookup
    from encache.connectors.lookup.loader import State

    c = redis_cluster_factory(3, 1, config={"cluster-replica-no-failover": "yes",
                                            "cluster-require-full-coverage": "no"})
    url, writer, blobs, victim, on_victim = _stored_on_a_victim(c, "p", 40)
    elsewhere = [i for i in blobs if i not in on_victim]
    assert len(on_victim) >= 4 and len(elsewhere) >= 20
    store = open_store(url)
    look = EntryLookup(store, index_refresh_s=0.2, load_threads=2, load_timeout_s=2,
                       counters_flush_s=3600, store_stats_s=3600)
    try:
        assert look.wait_index(10)

        def load(ident: str) -> bool:
            if look.request(ident) is State.MISS:
                return False
            look.wait([ident], 5)
            return look.is_ready(ident)

        assert load(on_victim[0])  # (routes the victim's slots to it)
        domain = store.failure_domain(on_victim[0])
        assert domain == f"{victim.host}:{victim.port}"
        c.kill(victim)  # SIGKILL by PID
        assert not load(on_victim[1])  # a miss: a load error...
        assert look.breaker.is_open(domain=domain) and not look.breaker.is_open()  # ...of one
        t0 = time.monotonic()
        hits = 0
        for n, i in enumerate(elsewhere):  # >= 2 s of refreshes failing on the dead node
            assert load(i), f"{i} (on a live primary) missed during the outage"
            hits += 1
            assert not look.probably_stored(on_victim[2 + n % (len(on_victim) - 2)])
            if n == 9:
                while time.monotonic() - t0 < 2.0:
                    time.sleep(0.1)
            assert not look.breaker.is_open()  # the store as a whole was never down
        assert look.breaker.tripped_domains() == [domain]
        gauges = look.take_interval()  # (what the engine's metrics export)
        assert (gauges["store_down"], gauges["store_parts_down"]) == (0, 1)
        victim.restart()  # back, empty (no persistence), serving its slots again
        deadline = time.monotonic() + 30
        while True:
            try:
                writer.put(on_victim[1], blobs[on_victim[1]])
                break
            except StoreError:
                assert time.monotonic() < deadline, "the restarted primary never served"
                time.sleep(0.2)
        while look.breaker.tripped_domains():  # the probe finds it serving
            assert time.monotonic() < deadline, "the lookup never probed the node back"
            time.sleep(0.1)
        assert load(on_victim[1])
        gauges = look.take_interval()
        assert (gauges["store_down"], gauges["store_parts_down"]) == (0, 0)
        print(f"\none primary down for {time.monotonic() - t0:.1f}s: {hits} loads from the "
              "others hit meanwhile")
    finally:
        look.close()
        writer.close()


def test_a_purge_reaches_staged_entries_while_the_journal_primary_is_dead(
        redis_cluster_factory):
    """The primary holding the store's change journal (and ``gen`` key) dies for good,
    the others serve (``cluster-require-full-coverage no``). A consumer's index refresh
    still lists the live primaries, and its staged entries are checked against them in
    full (the journal cannot say what changed): an entry purged meanwhile on a live
    primary is no longer served from memory; the others stay staged."""
    from encache.connectors.lookup import EntryLookup
    from encache.connectors.lookup.loader import State

    c = redis_cluster_factory(3, 0, config={"cluster-require-full-coverage": "no"})
    url, writer, blobs, victim, on_victim = _stored_on_a_victim(c, "j", 30)
    elsewhere = [i for i in blobs if i not in on_victim]
    assert len(elsewhere) >= 3
    store = open_store(url)
    look = EntryLookup(store, index_refresh_s=0.2, load_threads=2, load_timeout_s=2,
                       counters_flush_s=3600, store_stats_s=3600)
    purger = open_store(url + "&redirect_wait=0")  # (its journal write fails at once)
    try:
        assert look.wait_index(10)
        for i in elsewhere[:3]:
            assert look.request(i) is not State.MISS
        look.wait(elsewhere[:3], 5)
        assert all(look.get_staged(i) is not None for i in elsewhere[:3])
        c.kill(victim)  # SIGKILL by PID; nothing replaces it
        purger.delete(elsewhere[0])
        deadline = time.monotonic() + 10
        while look.get_staged(elsewhere[0]) is not None:
            assert time.monotonic() < deadline, "the purge never reached the staged entry"
            time.sleep(0.05)
        assert all(look.get_staged(i) is not None for i in elsewhere[1:3])
        domain = f"{victim.host}:{victim.port}"
        assert look.breaker.tripped_domains() == [domain] and not look.breaker.is_open()
        assert look.probably_stored(elsewhere[1])
    finally:
        look.close()
        writer.close()
        purger.close()
