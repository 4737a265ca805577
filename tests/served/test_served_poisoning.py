"""A shared store no client can poison, through real servers (``api_server``).

A producer server (``ec_producer``) and a consumer server (``ec_consumer``) share one
store, on disk and on Redis, as in EPD or a precompute-plus-online fleet. The attack, as
a client would play it: send image A to the producer with ``"uuid"`` set to image B's
identifier (``encache hash B``), hoping A's encoder output is stored under B's key, for a
later client who asks the consumer about B with no uuid. Shown for each store:

* a client uuid of 64 hex digits on an item with its data is not used: A's output lands
  under A's own identifier, never under B's, and the consumer answers B from B's own
  pixels (its tower encodes B; the first token's top-5 logprobs are not A's);
* other client uuids live in their own namespace (``uuid=…``): a client that sends B
  under a uuid the attacker used for A meets A's entry there and the binding: refused
  and counted (``misses_binding``, ``binding_mismatches``), B encoded;
* an honest client uuid (the same pixels under the client's own id), a precomputed image
  and vLLM's EPD proxy flow (media to the encoder, then the request to PD) still hit, the
  consumer's tower idle for them;
* an entry the producer wrote for an item without a uuid is stamped ``keyed_by:
  content`` (its identifier is vLLM's hash of the bytes, which no client uuid can name):
  the consumer serves it without digesting its inputs, and entries under client uuids
  are not stamped so.

The two pairs of servers start together (the engine in the API server's engine-core
process: ``executor="uni"``).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from encache.connectors.vllm.hashing import identify_file
from encache.connectors.vllm.uuids import uuid_identifier
from engine_support import PRECOMPUTE_KW, consumer_config
from served_support import (counter_deltas, draw_images, first_token_logprobs,
                            image_request, post_chat_ok, proxy_flow, start_server)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.redis]

KEYS = ("hits", "misses", "misses_binding", "binding_mismatches", "misses_absent",
        "inputs_digested")


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory, redis_server):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    root = tmp_path_factory.mktemp("poison")
    images = draw_images(root / "img", {"a": (200, 160), "b": (200, 160), "c": (180, 150),
                                        "pre": (150, 170), "epd": (170, 190),
                                        "d": (190, 150)}, seed=60)
    stores = {"disk": str(root / "store"),
              "redis": f"{redis_server.url}?prefix=poison-{uuid.uuid4().hex[:8]}:"}
    pre_dir = root / "pre"
    pre_dir.mkdir()
    (pre_dir / "pre.png").write_bytes(Path(images["pre"]).read_bytes())
    for store in stores.values():
        summary = precompute_corpus(str(pre_dir), PrecomputeOptions(
            model=tiny_model, store=store, **PRECOMPUTE_KW))
        assert summary.encoded == 1
    servers = {}
    try:
        for name, store in stores.items():
            servers[f"e-{name}"] = start_server(
                tiny_model, consumer_config(store, role="ec_producer"), root,
                probe=f"e-{name}", executor="uni")
            servers[f"c-{name}"] = start_server(
                tiny_model, consumer_config(store, index_refresh_s=0.2), root,
                probe=f"c-{name}", executor="uni")
        for s in servers.values():
            s.wait_ready()
        yield {"model": tiny_model, "images": images, "stores": stores, "servers": servers}
    finally:
        for s in servers.values():
            s.stop()


def request(model: str, path: str, client_uuid: str | None = None) -> dict:
    body = image_request(model, path)
    if client_uuid is not None:
        body["messages"][0]["content"][0]["uuid"] = client_uuid
    return body


def header(s, identifier: str, timeout: float = 10.0):
    """The header of ``identifier``'s entry once committed (a producer's request ends
    when the entry is readable, its commit may follow)."""
    import time
    deadline = time.time() + timeout
    while (info := s.stat(identifier)) is None or info.meta is None:
        assert time.time() < deadline, (identifier, sorted(s.identifiers()))
        time.sleep(0.05)
    return info.meta


@pytest.mark.parametrize("backend", ["disk", "redis"])
def test_a_planted_entry_is_never_served_and_honest_flows_hit(fleet, backend):
    from encache.connectors.store import open_store

    model, images, store = fleet["model"], fleet["images"], fleet["stores"][backend]
    producer, consumer = fleet["servers"][f"e-{backend}"], fleet["servers"][f"c-{backend}"]
    b_id = identify_file(images["b"], model).identifier
    honest, shared = f"tenant-{backend}-c", f"tenant-{backend}-shared"

    # the attack (A under B's identifier, and under a uuid another client will pick for
    # B), and an honest client's own uuid, on the producer
    post_chat_ok(producer.base, request(model, images["a"], b_id))
    post_chat_ok(producer.base, request(model, images["a"], shared))
    post_chat_ok(producer.base, request(model, images["c"], honest))
    s = open_store(store)
    planted = header(s, uuid_identifier(shared))
    assert not s.contains(b_id) and not s.contains(uuid_identifier(b_id)), \
        "a client's hex uuid named an entry"
    assert header(s, identify_file(images["a"], model).identifier).keyed_by == "content"
    assert planted.keyed_by == "" and planted.binding.startswith("blake3:")
    assert header(s, uuid_identifier(honest)).keyed_by == ""

    before = s.read_counters()
    runs = consumer.encoder_log.count()
    # a later client asks the consumer about B, no uuid: B's own pixels are encoded
    got_b = first_token_logprobs(post_chat_ok(consumer.base, request(model, images["b"])))
    assert consumer.encoder_log.count() == runs + 1, "the consumer loaded an entry for B"
    # ... and B's answer is not what A's encoder output gives (A asked plainly: the entry
    # the attacker's request left under A's own identifier, A's own output: a hit)
    got_a = first_token_logprobs(post_chat_ok(consumer.base, request(model, images["a"])))
    assert got_a != got_b, "B was answered from A's encoder output"
    # B sent under the uuid the attacker used for A: A's entry, bound to A: refused
    got_b_uuid = first_token_logprobs(post_chat_ok(consumer.base,
                                                   request(model, images["b"], shared)))
    assert consumer.encoder_log.count() == runs + 2, "the consumer served A's entry for B"
    assert got_b_uuid == got_b
    deltas = counter_deltas(store, before, keys=KEYS)
    assert deltas == {"hits": 1, "misses": 2, "misses_binding": 1, "binding_mismatches": 1,
                      "misses_absent": 1, "inputs_digested": 1}, deltas

    # the producer's entry for an item sent without a uuid is keyed by its content
    post_chat_ok(producer.base, request(model, images["d"]))
    d_meta = header(s, identify_file(images["d"], model).identifier)
    assert d_meta.keyed_by == "content" and d_meta.binding.startswith("blake3:")

    # honest flows still hit, the consumer's tower idle: a client's own uuid for its own
    # pixels, a precomputed image, the producer's content-keyed entry, and the EPD
    # proxy's flow (encoder, then PD)
    before = s.read_counters()
    runs = consumer.encoder_log.count()
    post_chat_ok(consumer.base, request(model, images["c"], honest))
    post_chat_ok(consumer.base, request(model, images["pre"]))
    post_chat_ok(consumer.base, request(model, images["d"]))
    proxy_flow(producer, consumer, request(model, images["epd"]))
    assert consumer.encoder_log.count() == runs, "an honest item was encoded again"
    assert header(s, identify_file(images["epd"], model).identifier).keyed_by == "content"
    deltas = counter_deltas(store, before, keys=KEYS)
    assert deltas["hits"] == 4 and deltas["misses"] == 0, deltas
    # only the entry under the client's uuid was compared with the request's inputs: the
    # content-keyed ones (precomputed, the producer's, the encoder's) cost no digest
    assert deltas["inputs_digested"] == 1, deltas
