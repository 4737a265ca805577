"""A purge (or a rewrite) on the store reaches a running consumer's in-memory copies.

A consumer keeps verified entries in memory (its staging, 512 MiB by default) and says
"stored" for them without asking the store. Here a real in-process engine serves two
precomputed images (hits, then hits from memory); then another process purges one with
``encache purge`` and rewrites the other under another encoder config. Within a few
index-refresh periods neither is served from memory any more: the purged image is
encoded again (a miss), the rewritten one is a config mismatch; on a disk store, on a
real redis-server, and behind a node-local tier (whose copies go too) on a shared
directory (the disk store's journal, as on a network filesystem), on Redis and on a real
Redis Cluster (its journal record is written after the entry, in another slot).
With a tier, repeat loads are shown to come from it (local hits) before the purge.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from encache.connectors.store import open_store
from encache.connectors.store.entry import encode_parts, validate_blob
from engine_support import (PRECOMPUTE_KW, EncoderCounter, chat_texts, consumer_config,
                            make_llm, shutdown)
from served_support import draw_images

pytestmark = [pytest.mark.engine, pytest.mark.redis]

REFRESH_S = 0.3
FILLERS = 24  # new images: push the engine's own encoder cache (256 tokens here) past a, b


def flush_engine_cache(llm, folder, seed: int = 77) -> None:
    """vLLM keeps freed encoder outputs in its own cache until it needs the room: new
    images make it drop ``a`` and ``b``, so the next request for them asks the connector
    (which then answers from its memory or the store)."""
    fill = draw_images(folder, {f"f{i}": (40 + i, 40) for i in range(FILLERS)}, seed=seed)
    for path in fill.values():
        chat_texts(llm, [path])


def store_url(backend: str, tmp_path, redis_server, request) -> str:
    """A disk store (``dir-tier``: a shared directory, as on a network filesystem), or a
    fresh prefix on Redis or on the session's Redis Cluster (``*-tier``: with a local
    tier; the cluster is started only when asked for)."""
    if backend in ("disk", "dir-tier"):
        return str(tmp_path / "store")
    prefix = f"t-purge-{uuid.uuid4().hex[:8]}:"
    if backend.startswith("cluster"):
        return f"{request.getfixturevalue('redis_cluster').url}?prefix={prefix}"
    return f"{redis_server.url}?prefix={prefix}"


def tier_copies(tmp_path) -> list:
    return list((tmp_path / "tier").glob("*/encoder_cache.safetensors"))


def precompute(corpus, model: str, store: str):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    return precompute_corpus(str(corpus), PrecomputeOptions(model=model, store=store,
                                                            **PRECOMPUTE_KW))


@pytest.mark.parametrize("backend", ["disk", "dir-tier", "redis", "redis-tier", "cluster-tier"])
def test_a_purge_reaches_a_running_consumers_memory(backend, tmp_path, tiny_model, redis_server,
                                                    request, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # Redis stores' manifests
    imgs = draw_images(tmp_path / "corpus", {"a": (64, 48), "b": (48, 64)}, seed=5)
    store = store_url(backend, tmp_path, redis_server, request)
    summary = precompute(tmp_path / "corpus", tiny_model, store)
    assert summary.encoded == 2
    counter = EncoderCounter()
    # with a tier, (almost) no in-memory staging: the repeat loads below come from the tier
    tier = ({"local_tier": str(tmp_path / "tier"), "staging_bytes": 1}
            if backend.endswith("-tier") else {})
    llm = make_llm(tiny_model, consumer_config(store, index_refresh_s=REFRESH_S, **tier))
    try:
        for _ in range(2):  # a hit from the store, then from memory
            counter.reset()
            chat_texts(llm, [imgs["a"], imgs["b"]])
            assert counter.items == 0
        if tier:  # the remote hits were written behind into the tier: copies the purge must drop
            deadline = time.time() + 10
            while len(tier_copies(tmp_path)) < 2 and time.time() < deadline:
                time.sleep(0.1)
            assert len(tier_copies(tmp_path)) == 2
            before = open_store(store).read_counters().get("hits_local", 0)
            flush_engine_cache(llm, tmp_path / "fill0", seed=78)
            counter.reset()
            chat_texts(llm, [imgs["a"], imgs["b"]])  # loaded again: from the tier
            assert counter.items == 0
            deadline = time.time() + 10
            while (open_store(store).read_counters().get("hits_local", 0) - before < 2
                   and time.time() < deadline):
                time.sleep(0.2)
            assert open_store(store).read_counters().get("hits_local", 0) - before == 2
        out = subprocess.run([sys.executable, "-m", "encache.cli", "purge", "--store", store,
                              "--all", "--yes", "--quiet"], capture_output=True, text=True,
                             timeout=120)  # another process
        assert out.returncode == 0, out.stderr
        assert open_store(store).count() == 0
        time.sleep(REFRESH_S * 4)
        flush_engine_cache(llm, tmp_path / "fill")
        counter.reset()
        chat_texts(llm, [imgs["a"], imgs["b"]])
        assert counter.items == 2, "a purged entry was still served from memory"
        want_invalidated = 1 if tier else 2  # a 1-byte staging holds one entry at most
        deadline = time.time() + 10
        while time.time() < deadline:
            c = open_store(store).read_counters()
            if c.get("staged_invalidated", 0) >= want_invalidated:
                break
            time.sleep(0.2)
        assert c.get("staged_invalidated", 0) >= want_invalidated, c
        if tier:  # the tier's copies went too (its next sync, through the journal)
            assert not tier_copies(tmp_path)
    finally:
        shutdown(llm)


def test_a_rewrite_under_another_encoder_config_is_not_served_from_memory(
        tmp_path, tiny_model):
    """The stored version changes (another producer's settings): the copy in memory
    is dropped, and the new entry is a config mismatch (re-encoded)."""
    imgs = draw_images(tmp_path / "corpus", {"a": (64, 48)}, seed=9)
    store = str(tmp_path / "store")
    precompute(tmp_path / "corpus", tiny_model, store)
    s = open_store(store)
    (ident,) = list(s.identifiers())
    counter = EncoderCounter()
    llm = make_llm(tiny_model, consumer_config(store, index_refresh_s=REFRESH_S))
    try:
        for _ in range(2):
            counter.reset()
            chat_texts(llm, [imgs["a"]])
            assert counter.items == 0
        meta, off = validate_blob(s.get(ident))
        data = bytes(s.get(ident)[off:off + meta.data_bytes])
        other = open_store(store)  # as another process would
        other.put(ident, encode_parts(ident, data, meta.dtype, meta.shape, model=meta.model,
                                      vllm_version=meta.vllm_version,
                                      hash_algo=meta.hash_algo, encoder_config="0123abcd0123abcd"))
        time.sleep(REFRESH_S * 4)
        flush_engine_cache(llm, tmp_path / "fill")
        counter.reset()
        chat_texts(llm, [imgs["a"]])
        assert counter.items == 1, "a rewritten entry's old copy was served from memory"
    finally:
        shutdown(llm)
