"""A stored entry whose shape does not fit the family's placeholder is a miss with a
one-line warning naming the family -- never served, never a crash.

Gemma 3 with pan-and-scan expects one entry holding every crop ((1 + crops) x 16 rows for
the tiny model). An entry holding only the global view (16 rows, as an engine without
pan-and-scan stores it) must not reach the language model. The encoder-config stamp
normally catches this first; with ``check_encoder_config: false`` (an operator's choice)
the row-count check is the net, and its message names the architecture.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from encache.connectors.store import open_store
from encache.connectors.store.entry import encode
from encache.connectors.vllm.hashing import identify_file
from engine_support import chat_texts, consumer_config, make_llm, shutdown
from served_support import draw_images

pytestmark = [pytest.mark.engine]


def test_gemma3_crop_count_mismatch_is_a_named_miss(tiny_gemma3, tmp_path, caplog):
    [wide] = draw_images(tmp_path / "img", {"wide": (1000, 400)}, seed=5).values()
    store = str(tmp_path / "store")
    identifier = identify_file(wide, tiny_gemma3).identifier
    rows = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    open_store(store, create=True).put(identifier, encode(
        identifier, rows.view(np.uint8), "F32", rows.shape, model=tiny_gemma3))
    llm = make_llm(tiny_gemma3, consumer_config(store, check_encoder_config=False),
                   max_model_len=2048, max_num_batched_tokens=2048,
                   mm_processor_kwargs={"do_pan_and_scan": True})
    try:
        with caplog.at_level(logging.WARNING, logger="encache"):
            [text] = chat_texts(llm, [wide], max_tokens=2)
        assert isinstance(text, str)
    finally:
        shutdown(llm)
    counters = open_store(store).read_counters()
    assert counters.get("hits", 0) == 0 and counters.get("load_errors", 0) == 1, counters
    [line] = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert "16 embeddings stored, 64 expected by Gemma3ForConditionalGeneration" in line
    assert "\n" not in line


def test_entries_of_another_dtype_hit_with_a_one_line_warning(tiny_gemma3, tmp_path, caplog):
    """float32 entries on a bfloat16 engine: hits (cast), and one warning saying outputs
    differ slightly from encoding there and which --dtype to precompute with."""
    [square] = draw_images(tmp_path / "img", {"square": (300, 300)}, seed=6).values()
    store = str(tmp_path / "store")
    identifier = identify_file(square, tiny_gemma3).identifier
    rows = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    open_store(store, create=True).put(identifier, encode(
        identifier, rows.view(np.uint8), "F32", rows.shape, model=tiny_gemma3))
    llm = make_llm(tiny_gemma3, consumer_config(store), max_model_len=2048,
                   max_num_batched_tokens=2048, dtype="bfloat16")
    try:
        with caplog.at_level(logging.WARNING, logger="encache"):
            chat_texts(llm, [square], max_tokens=1)
    finally:
        shutdown(llm)
    assert open_store(store).read_counters().get("hits", 0) == 1
    [line] = [r.getMessage() for r in caplog.records if "are cast to" in r.getMessage()]
    assert "torch.float32" in line and "torch.bfloat16" in line and "--dtype bfloat16" in line
