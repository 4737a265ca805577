"""vLLM's own EPD proxy in front of encache: ``disagg_epd_proxy.py`` of the installed
vLLM release, taken from that release's source distribution (the wheel does not ship it;
``scripts/setup`` keeps that one file under ``.vllm-src/``, nothing of it is committed).

An encoder (``ec_producer``) and a PD instance (``ec_consumer``) share one disk store;
the model is the tiny LLaVA with Gemma-3-sized entries (2.75 MB), whose placeholders,
like Gemma 3's, need no metadata. Two proxies stand in front of the pair: vLLM's default
and ``--no-rewrite``. Clients post to a proxy, as in production. Shown:

* ``--no-rewrite``: every PD item is a store hit with the
  PD tower idle, for clients with and without a uuid, answered as a plain server answers;
  an image precomputed before is served from the store on both sides (the encoder's tower
  idle too).
* the default: the same. The proxy gives the encoder each item under a uuid of its own
  (sha256 of the URL) and, for a model whose placeholders need no metadata, sends PD the
  raw item without it (vLLM 0.32-0.34; vLLM PR #57275): encache keys an item that
  carries its data under such a hex uuid by its bytes, on both servers, so they agree
  (and precomputed entries serve both); a client's own uuid hits too.
* the attack of docs/security.md through the proxy: image A sent under image B's
  identifier as its uuid is never what a later request for B is answered from.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from encache.connectors.store import open_store
from encache.connectors.vllm.hashing import identify_file
from encache.connectors.vllm.uuids import uuid_identifier
from engine_support import PRECOMPUTE_KW, consumer_config
from served_support import (assert_logprobs_close, counter_deltas, draw_images,
                            first_token_logprobs, image_request, post_chat_ok, start_proxy,
                            start_server, wide_model)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MAX_LEN = 512
KEYS = ("hits", "misses", "saves")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    model = wide_model()
    root = tmp_path_factory.mktemp("vllm-proxy")
    images = draw_images(root / "img", {
        "n1": (200, 160), "n2": (170, 190), "u1": (180, 150), "u2": (150, 170),
        "pre": (160, 200), "pre2": (210, 150), "a": (190, 170), "b": (190, 170)}, seed=57)
    store = str(root / "store")
    pre_dir = root / "pre"
    pre_dir.mkdir()
    for name in ("pre", "pre2"):
        (pre_dir / f"{name}.png").write_bytes(Path(images[name]).read_bytes())
    pre = dict(PRECOMPUTE_KW, max_model_len=MAX_LEN,
               engine_args={**PRECOMPUTE_KW["engine_args"], "max_num_batched_tokens": MAX_LEN})
    assert precompute_corpus(str(pre_dir), PrecomputeOptions(
        model=model, store=store, **pre)).encoded == 2
    started = {}
    try:  # (started inside: a start that fails stops the ones started before it)
        for name, config in (("plain", None),
                             ("e", consumer_config(store, role="ec_producer")),
                             ("pd", consumer_config(store))):
            started[name] = start_server(model, config, root, max_model_len=MAX_LEN,
                                         probe=name, executor="uni")
        for s in started.values():
            s.wait_ready()
        e, pd = started["e"], started["pd"]
        started["default"] = start_proxy(e, pd, root).wait_ready()
        started["no-rewrite"] = start_proxy(e, pd, root, "--no-rewrite").wait_ready()
        yield {"model": model, "images": images, "store": store, **started}
    finally:
        for s in started.values():
            s.stop()


def ask(fleet, proxy: str, image: str, client_uuid: str | None = None) -> dict:
    """One client request through ``proxy``: its first-token top-5 logprobs."""
    body = image_request(fleet["model"], fleet["images"][image])
    if client_uuid is not None:
        body["messages"][0]["content"][0]["uuid"] = client_uuid
    return first_token_logprobs(post_chat_ok(fleet[proxy].base, body))


def plain(fleet, image: str) -> dict:
    body = image_request(fleet["model"], fleet["images"][image])
    return first_token_logprobs(post_chat_ok(fleet["plain"].base, body))


def runs(fleet) -> tuple[int, int]:
    return fleet["e"].encoder_log.count(), fleet["pd"].encoder_log.count()


def test_no_rewrite_every_pd_item_hits_and_precomputed_images_serve_both_sides(fleet):
    s = open_store(fleet["store"])
    before, (e0, pd0) = s.read_counters(), runs(fleet)
    got = {"n1": ask(fleet, "no-rewrite", "n1"),
           "u1": ask(fleet, "no-rewrite", "u1", "tenant-7/u1"),
           "pre": ask(fleet, "no-rewrite", "pre")}
    e1, pd1 = runs(fleet)
    assert pd1 == pd0, "the PD tower ran: a silent re-encode"
    assert e1 - e0 == 2, "the encoder encoded a precomputed image (or missed one)"
    assert counter_deltas(fleet["store"], before, keys=KEYS) == {
        "hits": 3, "misses": 0, "saves": 2}
    for name, logprobs in got.items():
        assert_logprobs_close(logprobs, plain(fleet, name))
    # the proxy forwarded the items as sent: vLLM's content hash, and the client's uuid
    # in encache's namespace
    assert s.stat(identify_file(fleet["images"]["n1"], fleet["model"]).identifier)
    assert s.stat(uuid_identifier("tenant-7/u1"))


def test_default_proxy_every_pd_item_hits_with_or_without_a_client_uuid(fleet):
    """vLLM's proxy gives the encoder each item under sha256 of its URL and sends PD the
    raw item without it; encache keys that item by its bytes on both servers."""
    s = open_store(fleet["store"])
    before, (e0, pd0) = s.read_counters(), runs(fleet)
    got = {"u2": ask(fleet, "default", "u2", "tenant-8/u2"),
           "n2": ask(fleet, "default", "n2"),
           "pre2": ask(fleet, "default", "pre2")}
    assert runs(fleet) == (e0 + 2, pd0), "the PD tower ran (or the encoder's, for pre)"
    assert counter_deltas(fleet["store"], before, keys=KEYS) == {
        "hits": 3, "misses": 0, "saves": 2}
    for name, logprobs in got.items():
        assert_logprobs_close(logprobs, plain(fleet, name))
    # the proxy's uuid is not what the entry is stored under: the image's own hash is,
    # and the entry says it is keyed by its content
    n2 = identify_file(fleet["images"]["n2"], fleet["model"]).identifier
    assert s.stat(n2).meta.keyed_by == "content"
    assert s.stat(uuid_identifier("tenant-8/u2")).meta.keyed_by == ""


def test_an_image_sent_under_anothers_identifier_never_answers_for_it(fleet):
    images, model = fleet["images"], fleet["model"]
    b_id = identify_file(images["b"], model).identifier
    for proxy in ("default", "no-rewrite"):  # the attack: A's pixels under B's identifier
        ask(fleet, proxy, "a", b_id)
    s = open_store(fleet["store"])
    assert not s.contains(b_id) and not s.contains(uuid_identifier(b_id)), \
        "a client's uuid named an entry"
    want_b, want_a = plain(fleet, "b"), plain(fleet, "a")
    for proxy in ("default", "no-rewrite"):
        got_b = ask(fleet, proxy, "b")
        assert_logprobs_close(got_b, want_b)
        assert got_b != want_a
