"""Real vLLM engine + real redis-server: precompute into Redis, serve from it, survive it.

* precompute into ``redis://…`` → a consumer on the same URL never runs the vision
  encoder and matches a cache-less reference engine token for token;
* ``precompute --shard 0/2`` + ``--shard 1/2`` into one Redis cover the corpus once;
* ``encache warm --compute-missing`` fills Redis from a disk store plus the engine;
* Redis SIGKILLed under a serving consumer: requests keep being answered (re-encoded), and
  once Redis is back (and refilled) the consumer hits again without a restart;
* AUTH: the right password hits, a wrong one degrades to re-encoding.

Engines run in-process and strictly one at a time (vLLM keeps the worker-side connector
in a process global): ``engine_support.EngineSlot`` shuts the current engine down before another
one (or a precompute producer) starts, and at the end of the module.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

from encache.connectors.store import decode, open_store
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.ops.transfer import copy_entries, shard_of
from engine_support import (PRECOMPUTE_KW, chat_texts, chat_within, wait_consumer_sees,
                            engine_module_fixtures)
from redis_fixture import RedisServer
from cli_support import invoke

pytestmark = [pytest.mark.engine, pytest.mark.redis]

PAGES = 8
PASSWORD = "engine-Pw-9182"
# `encache precompute`/`warm --compute-missing` options equal to PRECOMPUTE_KW
ENGINE_CLI = ["--max-model-len", "256", "--dtype", "float32", "--engine-arg", "enforce_eager=true",
              "--engine-arg", "max_num_seqs=4", "--engine-arg", "max_num_batched_tokens=256",
              "--engine-arg", "seed=0"]


class RedactedPasswordBug(Exception):
    """precompute's producer engine was given the store URL with the password redacted."""


# -- module fixtures -------------------------------------------------------------------

manifest_home, corpus, idents, reference, engines, counter = engine_module_fixtures(PAGES, 11)


def prefixed(server: RedisServer, what: str) -> str:
    return f"{server.url}?prefix=t-eng-{what}-{uuid.uuid4().hex[:10]}:"


def drop_all(url: str) -> None:
    s = open_store(url)
    try:
        for i in list(s.identifiers()):
            s.delete(i)
        s.reset_counters()
    finally:
        s.close()


@pytest.fixture(scope="module")
def redis_a(redis_server, corpus, tiny_model, engines):
    """The corpus precomputed straight into Redis (a producer engine, then closed)."""
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    url = prefixed(redis_server, "a")
    engines.release()
    options = PrecomputeOptions(model=tiny_model, store=url, batch=4, **PRECOMPUTE_KW)
    summary = precompute_corpus(corpus["root"], options)
    yield url, summary
    drop_all(url)


@pytest.fixture(scope="module")
def disk_full(redis_a, tmp_path_factory):
    """A disk copy of the precomputed entries (Redis -> disk), to refill Redis from."""
    disk = DiskStore(tmp_path_factory.mktemp("disk-full"), fsync=False)
    src = open_store(redis_a[0])
    rep = copy_entries(src, disk)
    src.close()
    assert rep.ok and rep.copied == PAGES
    return disk


def store_ids(url: str) -> set[str]:
    s = open_store(url)
    try:
        return set(s.identifiers())
    finally:
        s.close()


def wait_counter(url: str, name: str, at_least: float, timeout: float = 5.0) -> dict:
    deadline = time.time() + timeout
    while True:
        s = open_store(url)
        try:
            c = s.read_counters()
        finally:
            s.close()
        if c.get(name, 0) >= at_least or time.time() > deadline:
            return c
        time.sleep(0.1)


def warm_cli(*args) -> dict:
    r = invoke("warm", *args, "--json")
    assert r.exit_code == 0, (r.exit_code, r.stdout, r.stderr)
    assert PASSWORD not in r.stdout + r.stderr
    return json.loads(r.stdout)


# -- (a) precompute into Redis, serve from Redis ---------------------------------------

def test_precompute_into_redis_writes_every_page(redis_a, corpus, idents, tiny_model):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    url, s = redis_a
    assert (s.files, s.encoded, s.failed, s.present) == (PAGES, PAGES, 0, 0), s.failures
    assert s.engine_started and "t-eng-a-" in s.store
    store = open_store(url)
    assert set(store.identifiers()) == set(idents.values())
    total = 0
    for ident in idents.values():
        meta, _ = decode(store.get(ident), identifier=ident, verify=True)
        assert meta.model == tiny_model and meta.shape == (16, 64) and meta.dtype == "F32"
        total += store.stat(ident).size
    assert s.bytes_written == total
    store.close()
    again = precompute_corpus(corpus["root"], PrecomputeOptions(model=tiny_model, store=url,
                                                                batch=4, **PRECOMPUTE_KW))
    assert again.engine_started is False and again.encoded == 0 and again.present == PAGES


def test_consumer_on_redis_never_encodes_and_matches_reference(engines, redis_a, corpus,
                                                              reference, counter):
    url, _ = redis_a
    llm = engines.get("a", url, index_refresh_s=0.2)
    counter.reset()
    texts = chat_texts(llm, corpus["pages"])
    assert counter.calls == 0, f"the consumer ran the encoder {counter.calls} times"
    assert texts == [reference[p] for p in corpus["pages"]]
    c = wait_counter(url, "hits", PAGES)
    assert c.get("hits", 0) >= PAGES and c.get("misses", 0) == 0 and c["bytes_loaded"] > 0


# -- (d) shards --------------------------------------------------------------------------

def test_valkey_precompute_then_consumer_never_encodes(valkey_server, engines, corpus, idents,
                                                      reference, counter, tiny_model):
    """Valkey (the fork managed "Redis" services run) through the same ``redis://`` URL:
    precompute fills it, a consumer serves from it without running the encoder."""
    url = prefixed(valkey_server, "valkey")
    engines.release()
    r = invoke("precompute", corpus["root"], "-m", tiny_model, "-s", url, "--batch", "4",
               *ENGINE_CLI, "--json")
    assert r.exit_code == 0, (r.exit_code, r.stdout, r.stderr)
    s = json.loads(r.stdout)
    assert (s["files"], s["encoded"], s["failed"]) == (PAGES, PAGES, 0)
    assert store_ids(url) == set(idents.values())
    llm = engines.get("valkey", url, index_refresh_s=0.2)
    counter.reset()
    texts = chat_texts(llm, corpus["pages"])
    assert counter.calls == 0, f"the consumer ran the encoder {counter.calls} times"
    assert texts == [reference[p] for p in corpus["pages"]]
    assert wait_counter(url, "hits", PAGES).get("hits", 0) >= PAGES
    drop_all(url)


def test_shards_cover_the_corpus_exactly_once(engines, redis_server, corpus, idents,
                                              tiny_model):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    engines.release()
    url = prefixed(redis_server, "shard")
    root = corpus["root"]
    # the documented split: sha256 of the path relative to the corpus root, modulo N
    want = [{idents[p] for p in corpus["pages"] if shard_of(os.path.relpath(p, root), i, 2)}
            for i in (0, 1)]
    assert want[0] and want[1], "the test corpus must put pages in both shards"
    options = PrecomputeOptions(model=tiny_model, store=url, batch=4, **PRECOMPUTE_KW)
    try:
        s0 = precompute_corpus(root, options, shard="0/2")
        after0 = store_ids(url)
        s1 = precompute_corpus(root, options, shard="1/2")
        after1 = store_ids(url)
    finally:
        drop_all(url)
    assert after0 == want[0]
    assert (s0.files, s0.encoded, s0.present, s0.failed) == (len(want[0]), len(want[0]), 0, 0)
    # shard 1 found none of its pages already written: no overlap with shard 0
    assert (s1.files, s1.encoded, s1.present, s1.failed) == (len(want[1]), len(want[1]), 0, 0)
    assert s0.files + s1.files == PAGES
    assert after1 == set(idents.values()) and len(after1) == PAGES


# -- warm --compute-missing, then a consumer; Redis crash and recovery ------------------

@pytest.fixture(scope="module")
def crash_redis():
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def crash_filled(crash_redis, disk_full, corpus, idents, tiny_model, engines,
                 tmp_path_factory):
    """Redis filled by `encache warm`: 6 pages copied from a disk store that lacks 2,
    which --compute-missing encodes with a producer engine."""
    pages = corpus["pages"]
    partial = DiskStore(tmp_path_factory.mktemp("disk-partial"), fsync=False)
    rep = copy_entries(disk_full, partial, [idents[p] for p in pages[2:]])
    assert rep.copied == PAGES - 2
    engines.release()
    d = warm_cli("--from", partial.root, "--store", crash_redis.url, "--model", tiny_model,
                 "--compute-missing", *ENGINE_CLI, *pages)
    return d


def test_warm_compute_missing_then_consumer_hits(crash_filled, crash_redis, engines, corpus,
                                                 idents, reference, counter, tiny_model):
    d = crash_filled
    pages = corpus["pages"]
    assert (d["requested"], d["copied"], d["computed"], d["skipped"], d["failed"]) == \
        (PAGES, PAGES - 2, 2, 0, 0), d["failures"]
    assert store_ids(crash_redis.url) == set(idents.values())
    store = open_store(crash_redis.url)
    for p in pages[:2]:  # the computed ones are real entries for this model
        meta, _ = decode(store.get(idents[p]), identifier=idents[p], verify=True)
        assert meta.model == tiny_model and meta.shape == (16, 64)
    store.close()
    llm = engines.get("crash", crash_redis.url, index_refresh_s=0.2, load_timeout_s=2)
    counter.reset()
    group = pages[0:3]  # two computed by warm, one copied
    assert chat_texts(llm, group) == [reference[p] for p in group]
    assert counter.calls == 0, f"the consumer ran the encoder {counter.calls} times"


def test_redis_killed_consumer_keeps_answering(crash_filled, crash_redis, engines, corpus,
                                               reference, counter):
    llm = engines.get("crash", crash_redis.url, index_refresh_s=0.2, load_timeout_s=2)
    pages = corpus["pages"]
    if not crash_redis.alive:
        pytest.skip("needs the filled Redis from the fixture")
    crash_redis.kill(signal.SIGKILL)
    assert not crash_redis.alive
    group = pages[3:5]  # in the consumer's index, never loaded by it
    counter.reset()
    for p in group:  # one request at a time: one encoder call each
        [text] = chat_within(llm, [p], 15, on_timeout=crash_redis.restart)
        assert text == reference[p]
    assert counter.calls == len(group), "each page must be re-encoded once"


def test_consumer_hits_again_after_redis_restart(crash_redis, engines, disk_full, corpus,
                                                 idents, reference, counter, tiny_model):
    pages = corpus["pages"]
    llm = engines.get("crash", crash_redis.url, index_refresh_s=0.2, load_timeout_s=2)
    if crash_redis.alive:  # (the previous test leaves it dead, or restarted and empty)
        crash_redis.kill(signal.SIGKILL)
    crash_redis.restart()  # same port, no data
    assert store_ids(crash_redis.url) == set()
    d = warm_cli("--from", disk_full.root, "--store", crash_redis.url)  # refill
    assert d["copied"] == PAGES and d["failed"] == 0
    before = open_store(crash_redis.url).read_counters().get("hits", 0)
    group = pages[5:8]  # never served by this engine
    wait_consumer_sees(llm, [idents[p] for p in group],  # it rescans the index by itself
                       "the consumer never rescanned the restarted Redis")
    counter.reset()
    texts = chat_within(llm, group, 60, on_timeout=lambda: None)
    assert texts == [reference[p] for p in group]
    assert counter.calls == 0, "the consumer did not pick the restarted Redis up again"
    c = wait_counter(crash_redis.url, "hits", before + len(group))
    assert c.get("hits", 0) >= before + len(group)


# -- (c) AUTH ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def auth_redis(disk_full):
    server = RedisServer(password=PASSWORD)
    d = warm_cli("--from", disk_full.root, "--store", server.url_for(password=PASSWORD))
    assert d["copied"] == PAGES and "***" in d["store"]
    yield server
    server.stop()


def test_consumer_with_password_hits(auth_redis, engines, corpus, reference, counter):
    url = auth_redis.url_for(password=PASSWORD)
    llm = engines.get("auth", url, index_refresh_s=0.2)
    group = corpus["pages"][:4]
    counter.reset()
    assert chat_texts(llm, group) == [reference[p] for p in group]
    assert counter.calls == 0, f"the consumer ran the encoder {counter.calls} times"
    c = wait_counter(url, "hits", len(group))
    assert c.get("hits", 0) >= len(group)


def test_consumer_with_wrong_password_re_encodes(auth_redis, engines, corpus, reference,
                                                 counter):
    url = auth_redis.url_for(password="not-the-password")
    good = open_store(auth_redis.url_for(password=PASSWORD))
    before = good.read_counters()
    llm = engines.get("auth-wrong", url, index_refresh_s=0.2, load_timeout_s=2)
    group = corpus["pages"][4:6]
    counter.reset()
    for p in group:  # one request at a time: one encoder call each
        assert chat_within(llm, [p], 60, on_timeout=lambda: None) == [reference[p]]
    assert counter.calls == len(group)
    engines.release()  # flushes its counters: it cannot, it has no access
    assert good.read_counters() == before
    good.close()


def test_precompute_into_password_redis(auth_redis, engines, corpus, tiny_model, idents):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    engines.release()
    url = f"{auth_redis.url_for(password=PASSWORD)}?prefix=t-eng-pw:"
    try:
        s = precompute_corpus(corpus["root"], PrecomputeOptions(model=tiny_model, store=url,
                                                                batch=4, **PRECOMPUTE_KW))
        ids = store_ids(url)
    finally:
        drop_all(url)
    assert PASSWORD not in s.store
    if s.failed and all("authentication failed" in f["error"] for f in s.failures):
        raise RedactedPasswordBug(s.failures[0]["error"])
    assert (s.encoded, s.failed) == (PAGES, 0), s.failures[:1]
    assert ids == set(idents.values())
