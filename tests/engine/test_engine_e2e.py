"""Real vLLM engine, end to end: precompute → store → consumer, and faults that must miss.

Engines run in-process and in sequence (a cache-less reference, the precompute producer,
then one consumer shared by this module's tests).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from encache.connectors.store import decode, encode, open_store
from engine_support import (PRECOMPUTE_KW, EncoderCounter, chat_texts, consumer_config,
                            consumer_lookup, make_llm, shutdown)

pytestmark = pytest.mark.engine

FAULTS = ("bitflip", "truncated", "wrong-shape", "vanished", "garbage")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from demo_corpus import make_corpus
    root = tmp_path_factory.mktemp("corpus")
    pages = make_corpus(str(root / "docs"), pages=8, seed=1)
    faults = make_corpus(str(root / "faults"), pages=len(FAULTS), seed=2)
    return {"root": root, "pages": pages, "faults": dict(zip(FAULTS, faults))}


@pytest.fixture(scope="module")
def reference(tiny_model, corpus):
    """Greedy outputs of a cache-less engine, computed before any connector exists."""
    llm = make_llm(tiny_model)
    paths = corpus["pages"] + list(corpus["faults"].values())
    texts = dict(zip(paths, chat_texts(llm, paths)))
    shutdown(llm)
    return texts


@pytest.fixture(scope="module")
def precomputed(tiny_model, corpus, tmp_path_factory, reference):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    store = str(tmp_path_factory.mktemp("store"))
    options = PrecomputeOptions(model=tiny_model, store=store, batch=4, **PRECOMPUTE_KW)
    summary = precompute_corpus(str(corpus["root"]), options)
    return store, summary


@pytest.fixture(scope="module")
def consumer(tiny_model, precomputed):
    store, _ = precomputed
    counter = EncoderCounter()
    # load_mode mmap: every entry (4 KiB here) is a mapped file, as big entries are by default
    llm = make_llm(tiny_model, consumer_config(store, index_refresh_s=0.2, load_mode="mmap"))
    yield llm, counter, store
    shutdown(llm)


def identify(path, model):
    from encache.connectors.vllm.hashing import identify_file
    return identify_file(path, model).identifier


def test_precompute_writes_entries_with_metadata(precomputed, corpus, tiny_model):
    store_path, summary = precomputed
    n = len(corpus["pages"]) + len(FAULTS)
    assert (summary.files, summary.encoded, summary.failed) == (n, n, 0)
    assert summary.engine_started and summary.bytes_written > 0
    store = open_store(store_path, create=False)
    import vllm
    for path in corpus["pages"]:
        ident = identify(path, tiny_model)
        meta, data = decode(store.get(ident), identifier=ident)
        assert meta.model == tiny_model and meta.vllm_version == vllm.__version__
        assert meta.hash_algo == "blake3" and meta.format_version == "1"
        assert meta.shape == (16, 64) and meta.dtype == "F32"  # 16 image tokens x LM width
        assert meta.created and abs(meta.created - time.time()) < 600
        assert np.isfinite(np.frombuffer(data, np.float32)).all()


def test_rerun_skips_present_entries_without_engine(precomputed, corpus, tiny_model):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    store, _ = precomputed
    again = precompute_corpus(str(corpus["root"]),
                              PrecomputeOptions(model=tiny_model, store=store))
    assert again.engine_started is False and again.encoded == 0
    assert again.present == again.files and again.from_manifest == again.files


def test_consumer_never_encodes_and_matches_reference(consumer, corpus, reference, monkeypatch):
    """... and a (re)started consumer verified the stored entries it can use at start, in
    the background, so the requests' loads run no checksum."""
    from encache.connectors.lookup import loader

    llm, counter, store = consumer
    lookup = consumer_lookup(llm)
    assert lookup.start_verify_done.wait(60)
    assert lookup.verified_at_start == len(corpus["pages"]) + len(FAULTS)
    # the producer on this host wrote them: its verified log spared every checksum
    assert lookup.verified.trusted_loads == lookup.verified_at_start
    checksums = []
    real = loader.validate_blob
    monkeypatch.setattr(loader, "validate_blob",
                        lambda blob, **kw: checksums.append(kw) or real(blob, **kw))
    counter.reset()
    texts = chat_texts(llm, corpus["pages"])
    assert checksums == [], "a request-path load hashed an entry verified at start"
    assert counter.calls == 0, f"the consumer ran the vision encoder {counter.calls} times"
    assert texts == [reference[p] for p in corpus["pages"]]
    deadline = time.time() + 5
    while time.time() < deadline and open_store(store).read_counters().get("hits", 0) < len(texts):
        time.sleep(0.1)
    counters = open_store(store).read_counters()
    assert counters["hits"] >= len(texts) and counters.get("misses", 0) == 0
    assert counters["bytes_loaded"] > 0


def _damage(store_path: str, ident: str, kind: str) -> None:
    store = open_store(store_path)
    path = Path(store.entry_path(ident))
    blob = bytearray(path.read_bytes())
    if kind == "bitflip":
        blob[-5] ^= 0x10
        path.write_bytes(bytes(blob))
    elif kind == "truncated":
        path.write_bytes(bytes(blob[: len(blob) // 2]))
    elif kind == "wrong-shape":  # valid entry, but 8 embeddings where the prompt has 16
        meta, data = decode(bytes(blob))
        half = np.frombuffer(data, np.float32).reshape(meta.shape)[:8].copy()
        store.put(ident, encode(ident, half.view(np.uint8), "F32", half.shape))
    elif kind == "vanished":
        store.delete(ident)
    elif kind == "garbage":
        path.write_bytes(b"\xff" * 64)


@pytest.mark.parametrize("kind", FAULTS)
def test_bad_entry_is_a_miss_and_engine_keeps_serving(consumer, corpus, reference, tiny_model, kind):
    llm, counter, store = consumer
    path = corpus["faults"][kind]
    _damage(store, identify(path, tiny_model), kind)
    counter.reset()
    before = open_store(store).read_counters()
    [text] = chat_texts(llm, [path])
    assert counter.calls == 1, "the damaged entry must be re-encoded exactly once"
    assert text == reference[path]
    # and the engine still serves cached pages without encoding
    counter.reset()
    assert chat_texts(llm, corpus["pages"][:2]) == [reference[p] for p in corpus["pages"][:2]]
    assert counter.calls == 0
    deadline = time.time() + 5
    while time.time() < deadline:
        after = open_store(store).read_counters()
        if after.get("misses", 0) > before.get("misses", 0):
            break
        time.sleep(0.1)
    assert after.get("misses", 0) == before.get("misses", 0) + 1
    if kind != "vanished":
        assert after.get("load_errors", 0) >= before.get("load_errors", 0) + 1


def test_precompute_respects_disk_capacity(tiny_model, corpus, tmp_path, consumer):
    """A producer writing past max_bytes evicts least-recently-used entries (real engine)."""
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    llm, _, _ = consumer
    shutdown(llm)  # one engine at a time: the module's consumer is done by now
    store_path = str(tmp_path / "small")
    one = 16 * 64 * 4 + 512  # an entry: 16 embeddings x 64 floats + header
    options = PrecomputeOptions(model=tiny_model, store=store_path, batch=4, max_bytes=4 * one,
                                **PRECOMPUTE_KW)
    summary = precompute_corpus(str(corpus["root"]), options)
    n = len(corpus["pages"]) + len(FAULTS)
    assert summary.failed == 0 and summary.encoded == n and summary.evicted > 0
    store = open_store(store_path)
    assert store.used_bytes() <= 4 * one and store.info().max_bytes == 4 * one
    assert store.read_counters()["evictions"] >= summary.evicted
    assert len(list(store.identifiers())) == n - summary.evicted
