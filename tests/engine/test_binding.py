"""Entries bound to their inputs, on real engines: a client-chosen uuid cannot poison the store.

The attack: a client sends image A to a producer with ``uuid`` set to image B's identifier
(anyone who has B can compute it), so A's encoder output is stored under B's key. A later
request for B (no uuid) on a consumer must be answered from B's own pixels: the entry's
binding (a digest of the inputs the producer's tower consumed, :mod:`encache.connectors.
vllm.binding`) is not B's, so the consumer refuses it, encodes B, and counts the refusal.
An honest uuid (the same pixels under a client's own uuid) and precompute still hit.

Engines run in-process and one at a time (a reference, the producer, the consumer).
"""

from __future__ import annotations

import time

import pytest

from encache.connectors.store import open_store
from encache.connectors.vllm.hashing import identify_file
from engine_support import (PRECOMPUTE_KW, EncoderCounter, TowerTap, consumer_config,
                            data_url, make_llm, shutdown)

pytestmark = pytest.mark.engine


def chat(llm, items, max_tokens: int = 6) -> list[str]:
    """Greedy replies to one single-image chat per ``(path, uuid or None)``."""
    from vllm import SamplingParams
    convs = []
    for path, uuid in items:
        part = {"type": "image_url", "image_url": {"url": data_url(path)}}
        if uuid is not None:
            part["uuid"] = uuid
        convs.append([{"role": "user", "content": [part, {"type": "text",
                                                          "text": "What is on this page?"}]}])
    outs = llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0),
                    use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    from demo_corpus import make_corpus
    return make_corpus(str(tmp_path_factory.mktemp("binding")), pages=3, seed=60)


@pytest.fixture(scope="module")
def reference(tiny_model, pages):
    llm = make_llm(tiny_model)
    try:
        return dict(zip(pages, chat(llm, [(p, None) for p in pages])))
    finally:
        shutdown(llm)


def _wait_counter(store: str, name: str, want: float, timeout: float = 10) -> dict:
    deadline = time.time() + timeout
    while True:
        counters = open_store(store).read_counters()
        if counters.get(name, 0) >= want or time.time() > deadline:
            return counters
        time.sleep(0.1)


def test_planted_entry_is_refused_and_honest_uuid_hits(tiny_model, pages, reference, tmp_path):
    a, b, c = pages
    assert reference[a] != reference[b], "the tiny model must tell the two pages apart"
    store = str(tmp_path / "store")
    b_id = identify_file(b, tiny_model).identifier

    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        # the attack: A's pixels under B's identifier; an honest client's own uuid for C
        chat(producer, [(a, b_id), (c, "client-chosen-id-for-c")])
        from vllm.distributed.ec_transfer import get_ec_transfer
        assert get_ec_transfer().wait_for_saves(30)
    finally:
        shutdown(producer)
    planted = open_store(store).stat(b_id).meta
    assert planted.binding.startswith("blake3:")

    counter = EncoderCounter()
    consumer = make_llm(tiny_model, consumer_config(store, index_refresh_s=0.2))
    try:
        counter.reset()
        # an honest client uuid: the same pixels under it -- a hit
        assert chat(consumer, [(c, "client-chosen-id-for-c")]) == [reference[c]]
        assert counter.items == 0
        # B asked about without a uuid: answered from B's own pixels, not A's output
        assert chat(consumer, [(b, None)]) == [reference[b]]
        assert counter.items == 1
        counters = _wait_counter(store, "misses_binding", 1)
        assert counters.get("binding_mismatches") == 1 and counters.get("misses_binding") == 1
        assert counters.get("hits") == 1
    finally:
        shutdown(consumer)
    # the planted entry was served to nobody and is still there (a consumer writes nothing)
    assert open_store(store).stat(b_id).meta.binding == planted.binding


def test_encoder_reencodes_a_planted_entry_and_replaces_it(tiny_model, pages, reference,
                                                          tmp_path):
    """An encoder-only producer (EPD) does not skip an item whose stored entry is bound to
    other pixels: it encodes the request's own and overwrites the entry, so a PD instance
    that loads it next (with or without the pixels) gets B's output."""
    a, b, _ = pages
    store = str(tmp_path / "store")
    b_id = identify_file(b, tiny_model).identifier
    tap = TowerTap(tiny_model)
    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        from vllm.distributed.ec_transfer import get_ec_transfer
        chat(producer, [(a, b_id)])
        assert get_ec_transfer().wait_for_saves(30)
        planted = open_store(store).stat(b_id).meta.binding
        # a second encoder instance would find the entry; this one's own encoder cache holds
        # the planted output under b_id too, so the honest request goes to a fresh engine
    finally:
        shutdown(producer)
    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        from vllm.distributed.ec_transfer import get_ec_transfer
        tap.on = True
        chat(producer, [(b, None)])
        assert len(tap.items) == 1, "the encoder skipped B for the planted entry"
        assert get_ec_transfer().wait_for_saves(30)
        honest = open_store(store).stat(b_id).meta.binding
        assert honest and honest != planted
        tap.items.clear()
        chat(producer, [(b, None)])  # a second request for B: vLLM's own encoder cache
    finally:
        tap.close()
        shutdown(producer)
    consumer = make_llm(tiny_model, consumer_config(store))
    counter = EncoderCounter()
    try:
        counter.reset()
        assert chat(consumer, [(b, None)]) == [reference[b]]
        assert counter.items == 0  # the replaced entry is B's: a hit
    finally:
        shutdown(consumer)


def test_precomputed_entries_load_without_a_digest_and_a_plant_over_one_is_refused(
        tiny_model, pages, reference, tmp_path, monkeypatch):
    """Precompute computes each identifier from the item's bytes, so its entries say so
    (``keyed_by: content``) and a consumer serves them without digesting the request's
    inputs (a first load pays no binding). An online producer cannot tell a client's uuid
    from a hash: its entries are not keyed by content, so a plant over a precomputed
    entry is digested and refused as any other."""
    from encache.connectors.vllm import scheduler as scheduler_mod
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    a, b, _ = pages
    root = tmp_path / "corpus"
    root.mkdir()
    for p in pages:
        (root / p.rsplit("/", 1)[-1]).write_bytes(open(p, "rb").read())
    store = str(tmp_path / "store")
    summary = precompute_corpus(str(root), PrecomputeOptions(model=tiny_model, store=store,
                                                             batch=4, **PRECOMPUTE_KW))
    assert summary.encoded == len(pages)
    b_id = identify_file(b, tiny_model).identifier
    for p in pages:
        meta = open_store(store).stat(identify_file(p, tiny_model).identifier).meta
        assert meta.keyed_by == "content" and meta.binding.startswith("blake3:")

    digests = []
    real = scheduler_mod.item_binding
    monkeypatch.setattr(scheduler_mod, "item_binding",
                        lambda data: digests.append(1) or real(data))
    counter = EncoderCounter()
    consumer = make_llm(tiny_model, consumer_config(store, index_refresh_s=0.2))
    try:
        counter.reset()
        assert chat(consumer, [(p, None) for p in pages]) == [reference[p] for p in pages]
        assert counter.items == 0 and digests == []  # hits, and no input digested
    finally:
        shutdown(consumer)

    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        chat(producer, [(a, b_id)])  # A's pixels over the precomputed entry for B
        from vllm.distributed.ec_transfer import get_ec_transfer
        assert get_ec_transfer().wait_for_saves(30)
    finally:
        shutdown(producer)
    planted = open_store(store).stat(b_id).meta
    assert planted.keyed_by == "" and planted.binding.startswith("blake3:")
    consumer = make_llm(tiny_model, consumer_config(store, index_refresh_s=0.2))
    try:
        counter.reset()
        assert chat(consumer, [(b, None)]) == [reference[b]]
        assert counter.items == 1 and digests  # digested, refused, B encoded
        counters = _wait_counter(store, "misses_binding", 1)
        assert counters.get("binding_mismatches") == 1
    finally:
        shutdown(consumer)
