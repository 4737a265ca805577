"""A real consumer engine on a store where a newer encache wrote some of the entries.

precompute writes 3 entries; 2 are then given a header this build does not know (a next
entry format; this format with an unknown checksum algorithm), as a newer encache on
another host would write them. A consumer engine of this build serves the third from the
store and encodes the other two itself: misses counted ``newer_format`` (the store's
counters, ``encache stats``), not load errors; the two entries are left byte for byte.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from encache.cli.app import app
from encache.connectors.store import open_store
from engine_support import (PRECOMPUTE_KW, EncoderCounter, chat_texts, consumer_config, make_llm,
                            shutdown)
from entries import rewrite_header

pytestmark = pytest.mark.engine


def test_a_consumer_encodes_what_a_newer_encache_wrote_and_keeps_it(tiny_model, tmp_path):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from demo_corpus import make_corpus

    files = make_corpus(str(tmp_path / "corpus"), pages=3, seed=41)
    store = str(tmp_path / "store")
    options = PrecomputeOptions(model=tiny_model, store=store, **PRECOMPUTE_KW)
    assert precompute_corpus(str(tmp_path / "corpus"), options).encoded == 3
    st = open_store(store)
    idents = sorted(st.identifiers())
    newer = {
        idents[0]: rewrite_header(bytes(st.get(idents[0])),
                                  lambda h: h["__metadata__"].update(encache_format="2")),
        idents[1]: rewrite_header(bytes(st.get(idents[1])),
                                  lambda h: h["__metadata__"].update(checksum="xxh3_256x1m:0")),
    }
    for ident, blob in newer.items():
        st.put(ident, blob)

    counter = EncoderCounter()
    llm = make_llm(tiny_model, consumer_config(store))
    try:
        counter.reset()
        chat_texts(llm, files)
        assert counter.items == 2  # the newer encache's two: encoded here
    finally:
        shutdown(llm)
    c = st.read_counters()
    assert c.get("hits") == 1 and c.get("misses") == 2 and c.get("misses_newer_format") == 2, c
    assert not c.get("load_errors"), c
    for ident, blob in newer.items():
        assert bytes(st.get(ident)) == blob
    s = json.loads(CliRunner().invoke(app, ["stats", "--store", store, "--json"]).stdout)
    assert s["misses_by_reason"]["newer_format"] == 2 and s["newer_format_entries"] == 2
