"""An encoder instance re-saves what its own vLLM encoder cache still holds when the
store lost it.

vLLM answers an item from its encoder cache before it asks any connector, so an encoder
sent an image it encoded a moment ago runs no tower and calls no ``save_caches``: if the
store lost that entry meanwhile (a purge, an eviction), PD would find nothing (and fail a
metadata-only request). vLLM hands producers the encoder cache at every step
(``start_save_caches``) for this case: the scheduler names the items of new requests
that neither run the tower nor are in the store, and the worker saves them from the
cache. A real in-process encoder (``ec_producer``, encode-only), tiny LLaVA.
"""

from __future__ import annotations

import pytest

from encache.connectors.store import open_store
from encache.connectors.store.entry import validate_blob
from engine_support import EncoderCounter, chat_texts, consumer_config, make_llm, shutdown
from served_support import draw_images

pytestmark = [pytest.mark.engine]


def test_encoder_resaves_what_its_cache_holds_and_the_store_lost(tiny_model, tmp_path):
    imgs = draw_images(tmp_path / "img", {"a": (64, 48), "b": (48, 64)}, seed=11)
    store = str(tmp_path / "store")
    counter = EncoderCounter()
    enc = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        chat_texts(enc, [imgs["a"]], max_tokens=1)  # encoded and saved
        s = open_store(store)
        (ident,) = list(s.identifiers())
        first = bytes(s.get(ident))
        assert s.delete(ident)  # the store loses it (as a purge elsewhere would)
        counter.reset()
        chat_texts(enc, [imgs["a"]], max_tokens=1)
        assert counter.items == 0, "vLLM's encoder cache answered: no tower run"
        again = open_store(store).get(ident)
        assert again is not None, "the entry was not saved again"
        meta, off = validate_blob(again)
        fmeta, foff = validate_blob(first)
        assert bytes(again[off:]) == first[foff:]  # the same tensor
        counters = open_store(store).read_counters()
        assert counters.get("resaves", 0) >= 1, counters
        # an item the store still holds is not written again
        saves = counters.get("saves", 0)
        chat_texts(enc, [imgs["a"]], max_tokens=1)
        assert open_store(store).read_counters().get("saves", 0) == saves
    finally:
        shutdown(enc)
