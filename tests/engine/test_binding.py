"""Entries bound to their inputs, on real engines: a client-chosen uuid cannot poison the store.

The attack: a client sends image A to a producer with ``uuid`` set to image B's identifier
(anyone who has B can compute it). A uuid of 64 hex digits on an item with its data is not
used: A's output lands under A's own identifier, never under B's; other client uuids live
in a namespace of their own (:mod:`encache.connectors.vllm.uuids`, ``uuid=…``); a later
request for B (no uuid) on a consumer is answered from B's own pixels. Two clients that
pick one uuid for different pixels meet the binding (a digest
of the inputs the producer's tower consumed, :mod:`encache.connectors.vllm.binding`): the
consumer refuses the entry, encodes its own pixels and counts the refusal. An honest uuid
(the same pixels under a client's own uuid) and precompute still hit; an online
producer's entry for an item it hashed itself is keyed by content, so a consumer's first
load of it digests nothing.

Engines run in-process and one at a time (a reference, the producer, the consumer).
"""

from __future__ import annotations

import time

import pytest

from encache.connectors.store import open_store
from encache.connectors.vllm.hashing import identify_file
from encache.connectors.vllm.uuids import uuid_identifier
from engine_support import (PRECOMPUTE_KW, EncoderCounter, TowerTap, consumer_config,
                            data_url, make_llm, shutdown)

pytestmark = pytest.mark.engine


def chat(llm, items, max_tokens: int = 6, **kw) -> list[str]:
    """Greedy replies to one single-image chat per ``(path, uuid or None)`` (``kw``: more
    ``LLM.chat`` arguments)."""
    from vllm import SamplingParams
    convs = []
    for path, uuid in items:
        part = {"type": "image_url", "image_url": {"url": data_url(path)}}
        if uuid is not None:
            part["uuid"] = uuid
        convs.append([{"role": "user", "content": [part, {"type": "text",
                                                          "text": "What is on this page?"}]}])
    outs = llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0),
                    use_tqdm=False, **kw)
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


def _saved(producer) -> None:
    from vllm.distributed.ec_transfer import get_ec_transfer
    assert get_ec_transfer().wait_for_saves(30)


def _count_digests(monkeypatch) -> list:
    """Every input digest the consumer's scheduler computes from now on (one per call)."""
    from encache.connectors.vllm import scheduler as scheduler_mod
    digests: list = []
    real = scheduler_mod.item_binding
    monkeypatch.setattr(scheduler_mod, "item_binding",
                        lambda data: digests.append(1) or real(data))
    return digests


def test_a_client_uuid_never_names_content_and_honest_uuids_hit(tiny_model, pages, reference,
                                                                 tmp_path):
    a, b, c = pages
    assert reference[a] != reference[b], "the tiny model must tell the two pages apart"
    store = str(tmp_path / "store")
    b_id = identify_file(b, tiny_model).identifier
    honest, shared = "client-chosen-id-for-c", "a-uuid-two-clients-picked"

    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        # the attack: A's pixels under B's identifier, and under a uuid another client
        # will pick for B; an honest client's own uuid for C
        chat(producer, [(a, b_id), (a, shared), (c, honest)])
        _saved(producer)
    finally:
        shutdown(producer)
    s = open_store(store)
    assert not s.contains(b_id) and not s.contains(uuid_identifier(b_id)), \
        "a client's hex uuid named an entry"
    assert s.stat(identify_file(a, tiny_model).identifier).meta.keyed_by == "content"
    planted = s.stat(uuid_identifier(shared)).meta
    assert planted.binding.startswith("blake3:") and planted.keyed_by == ""
    assert s.stat(uuid_identifier(honest)).meta.keyed_by == ""
    assert uuid_identifier(honest).startswith("uuid=") and ":" not in uuid_identifier(honest)

    counter = EncoderCounter()
    consumer = make_llm(tiny_model, consumer_config(store, index_refresh_s=0.2))
    try:
        counter.reset()
        # an honest client uuid: the same pixels under it -- a hit
        assert chat(consumer, [(c, honest)]) == [reference[c]]
        assert counter.items == 0
        # B asked about without a uuid: nothing stored under B's identifier, B encoded
        assert chat(consumer, [(b, None)]) == [reference[b]]
        assert counter.items == 1
        # B sent under the uuid the attacker used for A: A's entry, bound to A: refused
        assert chat(consumer, [(b, shared)]) == [reference[b]]
        assert counter.items == 2
        counters = _wait_counter(store, "misses_binding", 1)
        assert counters.get("binding_mismatches") == 1 and counters.get("misses_binding") == 1
        assert counters.get("hits") == 1
    finally:
        shutdown(consumer)
    # the planted entry was served to nobody and is still there (a consumer writes nothing)
    assert open_store(store).stat(uuid_identifier(shared)).meta.binding == planted.binding


def test_encoder_reencodes_an_entry_bound_to_other_pixels_and_replaces_it(
        tiny_model, pages, reference, tmp_path):
    """Two clients pick one uuid for different pixels: an encoder-only producer (EPD) does
    not skip the second client's item for the first one's entry: it encodes the
    request's own pixels and overwrites the entry, so a PD instance that loads it next
    gets the second client's output."""
    a, b, _ = pages
    store = str(tmp_path / "store")
    shared = "a-uuid-two-clients-picked"
    uuid_id = uuid_identifier(shared)
    tap = TowerTap(tiny_model)
    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        chat(producer, [(a, shared)])
        _saved(producer)
        first = open_store(store).stat(uuid_id).meta.binding
        # this engine's own encoder cache now holds A under the uuid: a fresh one follows
    finally:
        shutdown(producer)
    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        tap.on = True
        chat(producer, [(b, shared)])
        assert len(tap.items) == 1, "the encoder skipped B for the other client's entry"
        _saved(producer)
        second = open_store(store).stat(uuid_id).meta.binding
        assert second and second != first
    finally:
        tap.close()
        shutdown(producer)
    consumer = make_llm(tiny_model, consumer_config(store))
    counter = EncoderCounter()
    try:
        counter.reset()
        assert chat(consumer, [(b, shared)]) == [reference[b]]
        assert counter.items == 0  # the replaced entry is B's: a hit
    finally:
        shutdown(consumer)


def test_an_online_producers_content_hashed_entry_loads_without_a_digest(
        tiny_model, pages, reference, tmp_path, monkeypatch):
    """A request without a uuid: vLLM hashes the item's bytes, client uuids cannot reach
    that identifier, so the online producer stamps the entry ``keyed_by: content`` and a
    consumer's first load of it digests nothing. A uuid that vLLM hashes again with the
    request's ``mm_processor_kwargs`` stays in the uuid namespace, not keyed by content."""
    from encache.connectors.vllm.uuids import in_namespace, is_content_hash
    a, b, c = pages
    store = str(tmp_path / "store")
    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        chat(producer, [(a, None), (b, None)])
        _saved(producer)
        known = set(_identifiers(store))
        chat(producer, [(c, "uuid-with-kwargs")], mm_processor_kwargs={"do_normalize": False})
        _saved(producer)
        (hashed_again,) = set(_identifiers(store)) - known
        # vLLM's processor cache knows the item by the identifier it ended up with
        cache = producer.llm_engine.renderer.mm_processor_cache
        assert cache is not None and cache.is_cached_item(hashed_again)
    finally:
        shutdown(producer)
    for p in (a, b):
        meta = open_store(store).stat(identify_file(p, tiny_model).identifier).meta
        assert meta.keyed_by == "content" and meta.binding.startswith("blake3:")
    assert in_namespace(hashed_again) and not is_content_hash(hashed_again)
    assert hashed_again != uuid_identifier("uuid-with-kwargs")  # (the kwargs are a factor)
    assert open_store(store).stat(hashed_again).meta.keyed_by == ""
    digests = _count_digests(monkeypatch)
    counter = EncoderCounter()
    consumer = make_llm(tiny_model, consumer_config(store, index_refresh_s=0.2))
    try:
        counter.reset()
        assert chat(consumer, [(a, None), (b, None)]) == [reference[a], reference[b]]
        assert counter.items == 0 and digests == []  # hits, and no input digested
    finally:
        shutdown(consumer)


def test_precomputed_entries_load_without_a_digest_and_a_client_uuid_cannot_replace_one(
        tiny_model, pages, reference, tmp_path, monkeypatch):
    """Precompute computes each identifier from the item's bytes and passes it as the
    item's uuid, unmapped (``content_keyed``): its entries land where a request without a
    uuid looks, say so (``keyed_by: content``), and a consumer serves them without
    digesting the request's inputs. A client that sends A under B's identifier reaches
    A's own identifier: the precomputed entry for B is untouched and still hits."""
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
    assert not any(e.startswith("uuid=") for e in _identifiers(store))

    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        chat(producer, [(a, b_id)])  # A's pixels under the precomputed B's identifier
        _saved(producer)
    finally:
        shutdown(producer)
    assert open_store(store).stat(b_id).meta.keyed_by == "content"
    assert not open_store(store).contains(uuid_identifier(b_id))

    digests = _count_digests(monkeypatch)
    counter = EncoderCounter()
    consumer = make_llm(tiny_model, consumer_config(store, index_refresh_s=0.2))
    try:
        counter.reset()
        assert chat(consumer, [(p, None) for p in pages]) == [reference[p] for p in pages]
        assert counter.items == 0 and digests == []  # hits, and no input digested
    finally:
        shutdown(consumer)


def test_a_hex_uuid_on_an_item_with_its_data_keys_it_by_its_bytes_and_a_reference_finds_it(
        tiny_model, pages, reference, tmp_path):
    """A uuid of 64 hex digits (what vLLM's EPD proxy gives every item) on an item with its
    data, for LLaVA (no placeholder metadata): the entry lands under the image's own
    identifier, keyed by content, and a later uuid-only reference to that uuid (vLLM's
    processor-cache reference: no data) in the same server is answered as the image."""
    from vllm import SamplingParams
    a = pages[0]
    hex_uuid = "5a" * 32
    store = str(tmp_path / "store")
    producer = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        chat(producer, [(a, hex_uuid)])
        _saved(producer)
    finally:
        shutdown(producer)
    s = open_store(store)
    assert s.stat(identify_file(a, tiny_model).identifier).meta.keyed_by == "content"
    assert not s.contains(uuid_identifier(hex_uuid))
    consumer = make_llm(tiny_model, consumer_config(store, index_refresh_s=0.2))
    try:
        assert chat(consumer, [(a, hex_uuid)]) == [reference[a]]  # (a hit, by content)
        ref = [{"role": "user", "content": [
            {"type": "image_url", "image_url": None, "uuid": hex_uuid},
            {"type": "text", "text": "What is on this page?"}]}]
        out = consumer.chat([ref], SamplingParams(max_tokens=6, temperature=0),
                            use_tqdm=False)
        assert out[0].outputs[0].text == reference[a]
    finally:
        shutdown(consumer)


def _identifiers(store: str) -> list[str]:
    return list(open_store(store).identifiers())
