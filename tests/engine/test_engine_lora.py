"""Tower-connector LoRA end to end: `precompute --lora` keys entries `{lora}:{hash}`.

A consumer engine with the same adapter loads them (zero encoder runs, same greedy output
as a cache-less engine with the adapter); the same images without the adapter are
different identifiers, so they miss and are encoded with the base weights.
"""

from __future__ import annotations

import pytest

from encache.connectors.store import open_store
from engine_support import (LORA_KW, PRECOMPUTE_KW, EncoderCounter, chat_texts, consumer_config,
                            make_llm, shutdown)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def setup(tiny_lora_model, tmp_path_factory):
    from vllm.lora.request import LoRARequest
    from demo_corpus import make_corpus
    model, adapter = tiny_lora_model
    root = tmp_path_factory.mktemp("lora")
    paths = make_corpus(str(root / "corpus"), pages=3, seed=11)
    lora = LoRARequest("adA", 1, adapter)
    ref = make_llm(model, **LORA_KW)
    reference = {"lora": chat_texts(ref, paths, lora=lora), "base": chat_texts(ref, paths)}
    shutdown(ref)
    return model, adapter, root, paths, lora, reference


def test_precompute_with_lora_then_consume(setup):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from encache.connectors.vllm.hashing import identify_file
    model, adapter, root, paths, lora, reference = setup
    assert reference["lora"] != reference["base"], "the adapter must change the outputs"
    store_path = str(root / "store")
    kw = dict(PRECOMPUTE_KW, engine_args=dict(PRECOMPUTE_KW["engine_args"], max_lora_rank=8))
    options = PrecomputeOptions(model=model, store=store_path, lora="adA", lora_path=adapter,
                                **kw)
    summary = precompute_corpus(str(root / "corpus"), options)
    assert summary.encoded == 3 and summary.failed == 0
    assert summary.notes == []  # LLaVA's tower-connector LoRA reaches its encoder

    store = open_store(store_path)
    expected = {identify_file(p, model, lora="adA").identifier for p in paths}
    assert set(store.identifiers()) == expected
    assert all(i.startswith("adA:") for i in expected)
    assert all(info.lora == "adA" and info.meta.lora == "adA" for info in store.scan())

    counter = EncoderCounter()
    llm = make_llm(model, consumer_config(store_path), **LORA_KW)
    try:
        counter.reset()
        assert chat_texts(llm, paths, lora=lora) == reference["lora"]
        assert counter.items == 0, "LoRA entries must be loaded, not re-encoded"
        counter.reset()
        assert chat_texts(llm, paths) == reference["base"]  # no adapter: other identifiers
        assert counter.items == 3
    finally:
        shutdown(llm)
