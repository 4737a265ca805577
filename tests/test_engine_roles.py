"""The other connector roles on a real engine: ec_both, and a producer whose store is down."""

from __future__ import annotations

import socket
import time

import pytest

from encache.connectors.store import open_store
from engine_support import EncoderCounter, chat_texts, consumer_config, make_llm, shutdown

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    from make_demo_corpus import make_corpus
    return make_corpus(str(tmp_path_factory.mktemp("roles")), pages=4, seed=21)


def _wait_saves():
    from vllm.distributed.ec_transfer import get_ec_transfer
    assert get_ec_transfer().wait_for_saves(30)


def test_ec_both_saves_then_loads_across_restarts(tiny_model, pages, tmp_path):
    store = str(tmp_path / "both")
    counter = EncoderCounter()
    llm = make_llm(tiny_model, consumer_config(store, role="ec_both"))
    counter.reset()  # (a producer encodes one dummy item at start-up to size its outputs)
    try:
        first = chat_texts(llm, pages)
        assert counter.items == len(pages)  # empty store: everything encoded...
        _wait_saves()
        assert len(list(open_store(store).identifiers())) == len(pages)  # ...and saved
    finally:
        shutdown(llm)
    llm = make_llm(tiny_model, consumer_config(store, role="ec_both"))
    counter.reset()
    try:
        assert chat_texts(llm, pages) == first
        assert counter.items == 0  # a restarted engine loads what the last one saved
    finally:
        shutdown(llm)


def test_producer_keeps_serving_when_its_store_is_down(tiny_model, pages):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    llm = make_llm(tiny_model, consumer_config(dead, role="ec_producer"))
    try:
        t0 = time.monotonic()
        texts = chat_texts(llm, pages)
        assert len(texts) == len(pages) and all(isinstance(t, str) for t in texts)
        from vllm.distributed.ec_transfer import get_ec_transfer
        connector = get_ec_transfer()
        assert connector.wait_for_saves(30)
        assert len(connector.writer.errors) == len(pages)  # every failed save is reported
        assert all("refused" in e for e in connector.writer.errors.values())
        assert time.monotonic() - t0 < 60
    finally:
        shutdown(llm)
