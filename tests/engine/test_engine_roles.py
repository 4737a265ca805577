"""The other connector roles on a real engine: ec_both, a producer whose store is down,
and engines whose encoder configs differ (the encoder-config stamp)."""

from __future__ import annotations

import os
import shutil
import socket
import time

import numpy as np
import pytest

from encache.connectors.encoder_config import encoder_config_digest
from encache.connectors.store import encode, open_store
from engine_support import (PRECOMPUTE_KW, EncoderCounter, chat_texts, consumer_config,
                            make_llm, shutdown)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    from demo_corpus import make_corpus
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


def test_entries_of_another_encoder_config_are_misses_then_replaced(tiny_model, pages, tmp_path):
    """vLLM's identifier ignores the server's mm_processor_kwargs, which change the encoder
    output: the stamp keeps a differently configured engine from loading the default
    engine's entries (it encodes them and, as ec_both, replaces them), and an engine with
    the same setting then loads the replacements."""
    store = str(tmp_path / "cfg")
    kw = {"do_normalize": False}
    counter = EncoderCounter()
    llm = make_llm(tiny_model, consumer_config(store, role="ec_both"))
    try:
        chat_texts(llm, pages)
        _wait_saves()
    finally:
        shutdown(llm)
    st = open_store(store)
    before = {i: st.stat(i).meta for i in st.identifiers()}
    assert len(before) == len(pages) and all(m.encoder_config == "" for m in before.values())

    llm = make_llm(tiny_model, consumer_config(store, role="ec_both"), mm_processor_kwargs=kw)
    counter.reset()
    try:
        changed = chat_texts(llm, pages)
        assert counter.items == len(pages)  # none of the default engine's entries was used
        _wait_saves()
    finally:
        shutdown(llm)
    after = {i: st.stat(i).meta for i in st.identifiers()}
    assert set(after) == set(before)  # the same identifiers: the key ignores the setting...
    for ident, meta in after.items():  # ...but the outputs differ, and were replaced
        assert meta.checksum != before[ident].checksum
        assert meta.encoder_config == encoder_config_digest(kw)

    llm = make_llm(tiny_model, consumer_config(store), mm_processor_kwargs=kw)
    counter.reset()
    try:
        assert chat_texts(llm, pages) == changed
        assert counter.items == 0
    finally:
        shutdown(llm)


def test_precompute_with_a_tag_replaces_other_config_entries(tiny_model, pages, tmp_path):
    """`precompute --tag` computes the digest the producer connector stamps: entries of
    another config are re-encoded and replaced, and the next run finds them present."""
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from encache.connectors.vllm.hashing import identify_file
    corpus = str(tmp_path / "c")
    os.makedirs(corpus)
    for p in pages:
        shutil.copy(p, corpus)
    store = str(tmp_path / "tagged")
    st = open_store(store, create=True)
    for p in pages:  # stand-ins for entries an untagged (default-config) run wrote
        ident = identify_file(p, tiny_model).identifier
        arr = np.zeros((16, 64), np.float32)
        st.put(ident, encode(ident, arr.view(np.uint8), "F32", arr.shape, model=tiny_model))
    default = PrecomputeOptions(model=tiny_model, store=store)
    default_run = precompute_corpus(corpus, default, dry_run=True)
    assert default_run.present == len(pages) and default_run.other_config == 0

    tagged = precompute_corpus(corpus, PrecomputeOptions(model=tiny_model, store=store,
                                                         tag="weights-v2", **PRECOMPUTE_KW))
    assert (tagged.other_config, tagged.encoded, tagged.failed) == (len(pages), len(pages), 0)
    digest = encoder_config_digest(tag="weights-v2")
    assert tagged.encoder_config == digest
    for ident in st.identifiers():
        meta = st.stat(ident).meta
        assert meta.encoder_config == digest and meta.checksum is not None
    again = precompute_corpus(corpus, PrecomputeOptions(model=tiny_model, store=store,
                                                        tag="weights-v2"))
    assert again.engine_started is False and again.present == len(pages)
    assert precompute_corpus(corpus, default, dry_run=True).other_config == len(pages)



def test_a_producer_leaves_a_local_tier_unused(tiny_model, pages, tmp_path):
    """A local tier holds copies of loaded entries; an encode-only producer loads none, so a
    config that names one (by hand: ``connector-config`` refuses it) is told so and the
    tier is never made."""
    store, tier = str(tmp_path / "store"), tmp_path / "tier"
    llm = make_llm(tiny_model, consumer_config(store, role="ec_producer", local_tier=str(tier)))
    try:
        chat_texts(llm, pages)
        _wait_saves()
        assert len(list(open_store(store).identifiers())) == len(pages)
        assert not tier.exists()
    finally:
        shutdown(llm)
