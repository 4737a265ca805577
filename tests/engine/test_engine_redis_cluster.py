"""Real vLLM engines on a real local Redis Cluster (3 primaries + 3 replicas):

* ``precompute`` into ``redis+cluster://…`` while slots are being resharded back and forth:
  every page written once, whole, and readable after;
* a consumer on the cluster loading from slots in each state of a move (held by hand: open,
  ASK, MOVED) and during a reshard: it never runs the vision encoder and matches a
  cache-less engine token for token;
* a primary SIGKILLed under the serving consumer: requests keep being answered (its
  entries are re-encoded: misses, no crash), and once the replica is promoted the consumer's
  first requests for that node's entries are hits, without a restart (its cluster client
  still routes those slots to the dead node: the first load re-reads the slot map);
* a primary lost for good (no replica, no full coverage required) under a serving
  consumer: only the pages on it are re-encoded, the others hit all through the outage.

Engines run in-process, one at a time (see engine_support.EngineSlot).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from encache.connectors.store import decode, open_store
from engine_support import (PRECOMPUTE_KW, chat_texts, chat_within, consumer_config,
                            engine_module_fixtures, make_llm, shutdown, store_troubles,
                            wait_consumer_sees)
from redis_cluster_fixture import LocalCluster

pytestmark = [pytest.mark.engine, pytest.mark.redis]

PAGES = 10


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(3, 1)
    yield c
    c.stop()


manifest_home, corpus, idents, reference, engines, counter = engine_module_fixtures(PAGES, 23)


class Resharder:
    """Moves slots back and forth between two primaries with ``redis-cli --cluster reshard``
    in a thread until stopped. ``running`` is set while a reshard command runs (after the
    nodes agreed on the slot map, so it is really moving slots): a test that waits for it
    knows its next requests meet a reshard in progress, however fast or slow the machine."""

    def __init__(self, cluster: LocalCluster, slots: int = 300):
        self.cluster, self.slots = cluster, slots
        self.moves = 0
        self.running = threading.Event()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        a, b = self.cluster.primaries()[:2]
        while not self._stop.is_set():
            self.cluster.wait_agreement(a, time.monotonic() + 60)
            self.running.set()
            out = self.cluster.reshard(a, b, self.slots)
            self.running.clear()
            if out.returncode != 0:
                self.errors.append((out.stdout + out.stderr)[-500:])
                return
            self.moves += 1
            a, b = b, a

    def wait_running(self, timeout: float = 120) -> None:
        assert self.running.wait(timeout), f"no reshard started: {self.errors[:1]}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(300)
        assert not self.errors, self.errors[0]
        self.cluster.wait_ok()


def cluster_url(cluster: LocalCluster) -> str:
    return cluster.url_for(nodes=6) + "?prefix=eng:"


def test_precompute_while_slots_move(cluster, corpus, idents, tiny_model, engines):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    engines.release()
    url = cluster_url(cluster)

    class WriteDuringAReshard:
        """precompute's progress hook: once the engine is up and the first batch encoded,
        hold the run until a reshard is in progress, so the batches that follow are
        written while slots move (by construction, not by timing)."""

        during = 0

        def start(self, phase, total):
            self.phase = phase

        def advance(self, n, failed=None, phase=None):
            if (phase or self.phase) == "encoding" and not self.during:
                mover.wait_running()
                self.during = mover.moves + 1  # the reshard being run now

    hook = WriteDuringAReshard()
    with Resharder(cluster, slots=1000) as mover:
        summary = precompute_corpus(corpus["root"], PrecomputeOptions(
            model=tiny_model, store=url, batch=2, **PRECOMPUTE_KW), progress=hook)
    assert (summary.files, summary.encoded, summary.failed) == (PAGES, PAGES, 0), summary.failures
    assert hook.during and mover.moves >= hook.during, "no reshard ran under the writes"
    store = open_store(url)
    assert set(store.identifiers()) == set(idents.values())
    for ident in idents.values():  # whole entries with their headers, after every move
        meta, _ = decode(store.get(ident), identifier=ident, verify=True)
        assert meta.model == tiny_model and store.stat(ident).meta is not None
    r = cluster.client()
    owners = {r.get_node_from_key(store.key(i)).name for i in idents.values()}
    assert len(owners) >= 2  # spread over the primaries
    store.close()


def test_consumer_serves_while_slots_move(cluster, engines, corpus, idents, reference, counter):
    """Loads from slots in each state of a move: held by hand (the entry still on the old
    owner of an open slot; moved, so the old owner answers ASK; the move finished, MOVED),
    then during a ``redis-cli --cluster reshard``. Every page hits, token for token."""
    url = cluster_url(cluster)
    llm = engines.get("cluster", url, index_refresh_s=0.2, load_timeout_s=5)
    store = open_store(url)
    r = cluster.client()
    pages = corpus["pages"][:4]
    slots = [r.keyslot(store.key(idents[p])) for p in pages[:3]]
    if len(set(slots)) < 3:
        pytest.skip("two of the first pages share a slot")
    moves = []
    for slot in slots:
        src = cluster.slot_owner(slot)
        dst = next(n for n in cluster.primaries() if n is not src)
        cluster.begin_slot_move(slot, src, dst)
        moves.append((slot, src, dst))
    _, src, dst = moves[1]
    assert cluster.move_slot_keys(moves[1][0], src, dst) > 0  # page 1: ASK from src to dst
    cluster.move_slot_keys(moves[2][0], *moves[2][1:])
    cluster.finish_slot_move(*moves[2])  # page 2: moved, MOVED
    counter.reset()
    texts = []
    for p in pages[:3]:
        texts += chat_texts(llm, [p])
    for m in moves[:2]:
        cluster.move_slot_keys(*m)
        cluster.finish_slot_move(*m)
    cluster.wait_ok()
    with Resharder(cluster, slots=1000) as mover:
        mover.wait_running()
        texts += chat_texts(llm, pages[3:])
    assert texts == [reference[p] for p in pages]
    assert counter.calls == 0, f"the consumer ran the encoder {counter.calls} times"
    store.close()




def test_primary_killed_under_consumer_then_hits_resume(cluster, engines, corpus, idents,
                                                        reference, counter):
    url = cluster_url(cluster)
    llm = engines.get("cluster", url, index_refresh_s=0.2, load_timeout_s=5)
    store = open_store(url)
    r = cluster.client()
    rest = corpus["pages"][4:]  # never served by this engine
    by_node: dict[int, list[str]] = {}
    for p in rest:
        by_node.setdefault(r.get_node_from_key(store.key(idents[p])).port, []).append(p)
    port, on_victim = max(by_node.items(), key=lambda kv: len(kv[1]))
    if len(on_victim) < 2:
        pytest.skip("the corpus put fewer than 2 unserved pages on any primary")
    victim = next(n for n in cluster.nodes if n.port == port)
    replica = cluster.replica_of(victim)
    assert replica is not None
    cluster.wait_replicated(victim)
    cluster.kill(victim)  # SIGKILL by PID
    t0 = time.monotonic()
    during = on_victim[0]
    counter.reset()
    [text] = chat_within(llm, [during], 60, on_timeout=lambda: None)
    assert text == reference[during]  # answered, by re-encoding: a miss, no crash
    assert counter.calls == 1
    deadline = time.monotonic() + 60
    while cluster.role(replica) != "master" or cluster.slots_of(replica) == 0:
        assert time.monotonic() < deadline, "the replica was not promoted"
        time.sleep(0.2)
    while True:  # the store serves that node's entries again
        try:
            if store.get(idents[on_victim[1]]) is not None:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the promoted replica never served"
        time.sleep(0.2)
    promoted = time.monotonic() - t0
    cluster.wait_agreed_primary(replica)  # any node the consumer re-reads the map from
    # ...and serves every slot: right after a promotion a node can still answer CLUSTERDOWN
    # for a moment, and the consumer's index refresh that meets it rightly opens the breaker
    # (every lookup a miss for a second): not what this test is about
    cluster.wait_ok()
    # the consumer's own cluster client still routes that node's slots to the dead node: its
    # first load of each re-reads the slot map and retries at once (a hit, not a miss)
    wait_consumer_sees(llm, [idents[p] for p in on_victim[1:]],  # its index refresh probes
                       "the consumer never saw the promoted node again")  # (breaker closes)
    after = on_victim[1:]
    counter.reset()
    with store_troubles(llm) as troubles:
        texts = chat_within(llm, after, 60, on_timeout=lambda: None)
    assert texts == [reference[p] for p in after]
    assert counter.calls == 0, \
        f"the consumer did not hit the promoted replica's entries; its store troubles: {troubles}"
    print(f"\nfailover under a consumer: promoted and serving after {promoted:.1f}s")
    store.close()


def test_a_dead_primary_costs_a_consumer_only_its_own_entries(cluster, redis_cluster_factory,
                                                              engines, corpus, idents,
                                                              reference, counter):
    """A cluster that serves without full slot coverage loses a primary for good (no
    replica): the serving consumer re-encodes only the pages stored on it. Every other
    page is a hit (the tower idle) all through the outage, token for token: the failed
    loads and the index refreshes that meet the dead node (it holds the store's ``gen``
    key, every refresh's first read) open its breaker alone."""
    private = redis_cluster_factory(3, 0, config={"cluster-require-full-coverage": "no"})
    url = private.url_for(nodes=3) + "?prefix=eng:"
    source, store = open_store(cluster_url(cluster)), open_store(url)
    pages = corpus["pages"]
    for p in pages:  # the precomputed entries, copied whole
        store.put(idents[p], bytes(source.get(idents[p])))
    r = private.client()
    node_of = {p: r.get_node_from_key(store.key(idents[p])).port for p in pages}
    # the victim holds the store's gen key too: every index refresh meets the dead node
    victim = next(n for n in private.primaries()
                  if n.port == r.get_node_from_key(store._gen_key).port)
    on_victim = [p for p in pages if node_of[p] == victim.port]
    elsewhere = [p for p in pages if node_of[p] != victim.port]
    if len(on_victim) < 1 or len(elsewhere) < 4:
        pytest.skip("the corpus put too few pages on one side")
    llm = engines.get("cluster-outage", url, index_refresh_s=0.2, load_timeout_s=5)
    counter.reset()
    assert chat_texts(llm, elsewhere[:1]) == [reference[elsewhere[0]]]
    assert counter.calls == 0  # (the consumer's client is built: it routes to the victim)
    private.kill(victim)  # SIGKILL by PID; nothing replaces it
    counter.reset()
    assert chat_texts(llm, on_victim) == [reference[p] for p in on_victim]
    assert counter.items == len(on_victim)  # its pages: re-encoded, answered
    t0 = time.monotonic()
    counter.reset()
    with store_troubles(llm) as troubles:
        texts = chat_texts(llm, elsewhere[1:-1])
        while time.monotonic() - t0 < 2.0:  # (index refreshes meet the dead node meanwhile)
            time.sleep(0.1)
        texts += chat_texts(llm, elsewhere[-1:])
    assert texts == [reference[p] for p in elsewhere[1:]]
    assert counter.calls == 0, \
        f"the other primaries' entries were re-encoded; the consumer's store troubles: {troubles}"
    assert not any(what == "breaker opened" for _, what in troubles), troubles
    source.close()
    store.close()


def test_a_dead_primary_never_stalls_a_serving_encoder(redis_cluster_factory, engines, corpus,
                                                        idents, tiny_model):
    """An encoder instance (``ec_producer``, serving defaults) on a cluster that lost a
    primary for good: its requests are answered at their usual pace. Its header reads
    and writes for the dead primary's slots fail at once (``redirect_wait`` 0 for a
    serving engine; precompute waits a failover out instead) rather than holding every
    step for up to ``redirect_wait`` + ``save_wait_s``; the other primaries' entries
    are written, and consumers encode the rest themselves."""
    engines.release()
    private = redis_cluster_factory(3, 0, config={"cluster-require-full-coverage": "no"})
    url = private.url_for(nodes=3) + "?prefix=enc:"
    store = open_store(url)
    r = private.client()
    pages = corpus["pages"]
    port = {p: r.get_node_from_key(store.key(idents[p])).port for p in pages[1:]}
    victim = max(private.primaries(), key=lambda n: sum(v == n.port for v in port.values()))
    on_victim = [p for p in pages[1:] if port[p] == victim.port]
    elsewhere = [p for p in pages[1:] if port[p] != victim.port]
    if len(on_victim) < 2 or len(elsewhere) < 2:
        pytest.skip("the corpus put too few pages on one side")
    enc = make_llm(tiny_model, consumer_config(url, role="ec_producer"))
    try:
        chat_texts(enc, pages[:1], max_tokens=1)  # (the encoder's client is built)
        private.kill(victim)  # SIGKILL by PID; nothing replaces it
        took = []
        for p in pages[1:]:
            t = time.monotonic()
            chat_texts(enc, [p], max_tokens=1)
            took.append(time.monotonic() - t)
        assert max(took) < 5, f"requests stalled on the dead primary: {took}"
        assert all(store.get(idents[p]) is not None for p in elsewhere)
        print(f"\nencoder with a dead primary: slowest request {max(took):.2f}s; "
              f"{len(elsewhere)} entries written, {len(on_victim)} left to consumers")
    finally:
        shutdown(enc)
        store.close()


def test_ec_both_on_the_cluster_saves_then_loads_across_restarts(cluster, engines, corpus,
                                                                 idents, reference, counter):
    """The connector's third role on the cluster: an ec_both engine saves what it encodes,
    and a restarted one loads it instead of encoding."""
    url = cluster.url_for(nodes=6) + "?prefix=both:"
    pages = corpus["pages"][:3]
    llm = engines.get("both-1", url, role="ec_both", index_refresh_s=0.2)
    counter.reset()
    assert chat_texts(llm, pages) == [reference[p] for p in pages]
    assert counter.items == len(pages)  # an empty store: everything encoded...
    deadline = time.monotonic() + 30
    store = open_store(url)
    while set(store.identifiers()) != {idents[p] for p in pages}:  # ...and saved
        assert time.monotonic() < deadline, "the ec_both engine did not save its entries"
        time.sleep(0.2)
    llm = engines.get("both-2", url, role="ec_both", index_refresh_s=0.2)
    counter.reset()
    assert chat_texts(llm, pages) == [reference[p] for p in pages]
    assert counter.items == 0, "the restarted ec_both engine encoded instead of loading"
    store.delete_many(list(store.identifiers()))
    store.close()


def test_precompute_rides_through_a_primary_failover(cluster, engines, corpus, idents,
                                                     tiny_model):
    """A primary SIGKILLed while ``precompute`` writes: its writes wait until the replica
    is promoted (``redirect_wait``). The run never claims a page it did not store (Redis
    replication is asynchronous: a write acknowledged just before the kill can be lost,
    and precompute's read-back then reports it), and a second run writes exactly what is
    missing — every page stored whole."""
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    engines.release()
    for node in cluster.nodes:  # the previous test's dead primary rejoins as a replica
        if not node.alive:
            node.restart()
    cluster.wait_ok()
    url = cluster.url_for(nodes=6) + "?prefix=pf:"
    store = open_store(url)
    r = cluster.client()
    killed: dict = {}

    class KillWhileWriting:
        """precompute's progress hook: after the first page is encoded (one page per
        engine call), SIGKILL the primary holding most of the pages still to be written,
        so the writes that follow must wait out the failover -- deterministic, where a
        watcher thread polling the store could miss a fast run."""

        phase = ""

        def start(self, phase, total):
            self.phase = phase

        def advance(self, n, failed=None, phase=None):
            if (phase or self.phase) != "encoding" or killed:
                return
            pending: dict[int, list[str]] = {}
            for ident in set(idents.values()) - set(store.identifiers()):
                port = r.get_node_from_key(store.key(ident)).port
                pending.setdefault(port, []).append(ident)
            candidates = [n for n in cluster.primaries() if pending.get(n.port)
                          and cluster.replica_of(n) is not None]
            if not candidates:
                killed["none"] = pending
                return
            victim = max(candidates, key=lambda n: len(pending[n.port]))
            killed.update(replica=cluster.replica_of(victim), pending=pending[victim.port])
            cluster.kill(victim)
            killed["node"] = victim

    first = precompute_corpus(corpus["root"], PrecomputeOptions(
        model=tiny_model, store=url, batch=1, **PRECOMPUTE_KW), progress=KillWhileWriting())
    assert "node" in killed, f"no primary was killed while entries were pending: {killed}"
    deadline = time.monotonic() + 60
    while True:  # the replica takes over; every node agrees on the new topology
        try:
            if cluster.role(killed["replica"]) == "master":
                present = set(open_store(url).identifiers())
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the replica was not promoted"
        time.sleep(0.3)
    by_ident = {v: k for k, v in idents.items()}
    reported = {f["path"] for f in first.failures}
    missing = set(idents.values()) - present
    assert first.encoded + first.failed == PAGES
    assert {os.path.relpath(by_ident[i], corpus["root"]) for i in missing} <= reported, \
        "precompute claimed a page the store does not hold"
    again = precompute_corpus(corpus["root"], PrecomputeOptions(model=tiny_model, store=url,
                                                                batch=4, **PRECOMPUTE_KW))
    assert (again.encoded, again.failed) == (len(missing), 0), again.failures
    fresh = open_store(url)
    assert set(fresh.identifiers()) == set(idents.values())
    for ident in idents.values():  # including those written to the failed-over slots
        meta, _ = decode(fresh.get(ident), identifier=ident, verify=True)
        assert meta.model == tiny_model
    print(f"\nprecompute through a failover: {len(killed['pending'])} pages pending on the "
          f"killed primary; first run {first.encoded} stored / {first.failed} reported, "
          f"second run {again.encoded}")
    fresh.delete_many(list(fresh.identifiers()))
    fresh.close()
    store.close()
