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
from served_support import counters_after, draw_images

pytestmark = [pytest.mark.engine]


def committed(store: str, identifier: str | None = None, timeout: float = 10.0):
    """The entry once committed: an encoder's request finishes when its entries' bytes
    are written (readers take them from there), the rename follows its fsync."""
    import time
    deadline = time.monotonic() + timeout
    while True:
        s = open_store(store)
        ids = [identifier] if identifier else list(s.identifiers())
        blob = s.get(ids[0]) if ids else None
        if blob is not None or time.monotonic() > deadline:
            return (ids[0] if ids else None), blob
        time.sleep(0.01)


def test_encoder_resaves_what_its_cache_holds_and_the_store_lost(tiny_model, tmp_path):
    imgs = draw_images(tmp_path / "img", {"a": (64, 48), "b": (48, 64)}, seed=11)
    store = str(tmp_path / "store")
    counter = EncoderCounter()
    enc = make_llm(tiny_model, consumer_config(store, role="ec_producer"))
    try:
        chat_texts(enc, [imgs["a"]], max_tokens=1)  # encoded and saved
        s = open_store(store)
        ident, first = committed(store)
        assert len(list(s.identifiers())) == 1
        first = bytes(first)
        assert s.delete(ident)  # the store loses it (as a purge elsewhere would)
        counter.reset()
        chat_texts(enc, [imgs["a"]], max_tokens=1)
        assert counter.items == 0, "vLLM's encoder cache answered: no tower run"
        _, again = committed(store, ident)
        assert again is not None, "the entry was not saved again"
        meta, off = validate_blob(again)
        fmeta, foff = validate_blob(first)
        assert bytes(again[off:]) == first[foff:]  # the same tensor
        counters = counters_after(store, "saves", 1)  # the first save and the resave
        assert counters.get("resaves", 0) >= 1, counters
        # an item the store still holds is not written again
        chat_texts(enc, [imgs["a"]], max_tokens=1)
        assert counters_after(store, "saves", 2, timeout=1.0).get("saves", 0) == 2
    finally:
        shutdown(enc)
