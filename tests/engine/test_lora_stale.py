"""Stale-LoRA guard on real engines: an adapter retrained and served under the old name.

Entries precomputed with adapter A under the name ``adA`` are stamped with A's digest. A
consumer engine serving adapter B (another seed: "retrained") under the same name treats
them as misses (re-encodes: the encoder runs for every image, counted ``lora_stale``)
instead of serving A's embeddings, and gives the same output as a cache-less engine with
B. ``stats`` shows the stale entries, ``purge --lora adA --stale`` removes exactly them,
and ``precompute --lora adA --lora-path B`` replaces them.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from typer.testing import CliRunner

from encache.cli.app import app
from encache.connectors.store.lora_stamp import adapter_digest
from encache.connectors.store import open_store
from engine_support import (LORA_KW, PRECOMPUTE_KW, EncoderCounter, chat_texts, consumer_config,
                            make_llm, shutdown)

pytestmark = pytest.mark.engine
KW = dict(PRECOMPUTE_KW, engine_args=dict(PRECOMPUTE_KW["engine_args"], max_lora_rank=8))


@pytest.fixture(scope="module")
def two_adapters(tiny_lora_model, tmp_path_factory):
    from lora_adapters import build_lora
    model, adapter_a = tiny_lora_model
    root = tmp_path_factory.mktemp("stale")
    adapter_b = build_lora(model, str(root / "adapter-b"), seed=2)  # "retrained"
    return model, adapter_a, adapter_b, root


def test_retrained_adapter_under_the_old_name(two_adapters):
    from vllm.lora.request import LoRARequest

    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from demo_corpus import make_corpus
    model, adapter_a, adapter_b, root = two_adapters
    da, db = adapter_digest(adapter_a), adapter_digest(adapter_b)
    assert da and db and da != db
    old = make_corpus(str(root / "old"), pages=3, seed=11)
    new = make_corpus(str(root / "new"), pages=2, seed=12)
    store_path = str(root / "store")

    with_a = PrecomputeOptions(model=model, store=store_path, lora="adA", lora_path=adapter_a, **KW)
    with_b = dataclasses.replace(with_a, lora_path=adapter_b)  # retrained, same LoRA name
    s = precompute_corpus(str(root / "old"), with_a)
    assert (s.encoded, s.failed) == (3, 0)
    store = open_store(store_path)
    assert {i.meta.lora_digest for i in store.scan()} == {da}
    s = precompute_corpus(str(root / "new"), with_b)
    assert (s.encoded, s.failed) == (2, 0)

    # stats: the three entries made with A are stale (B is the newest adapter for adA)
    r = CliRunner().invoke(app, ["stats", "--store", store_path, "--json"])
    assert r.exit_code == 0, r.output
    stats = json.loads(r.stdout)
    assert [(g["name"], g["entries"]) for g in stats["stale_lora"]] == [("adA", 3)]

    # a reference engine with B and no cache, then a consumer serving B under "adA"
    lora_b = LoRARequest("adA", 1, adapter_b)
    ref = make_llm(model, **LORA_KW)
    reference = chat_texts(ref, old, lora=lora_b)
    shutdown(ref)
    counter = EncoderCounter()
    llm = make_llm(model, consumer_config(store_path), **LORA_KW)
    try:
        counter.reset()
        assert chat_texts(llm, old, lora=lora_b) == reference  # B's output, not A's embeddings
        assert counter.items == 3, "entries made with another adapter must be re-encoded"
        counter.reset()
        chat_texts(llm, new, lora=lora_b)
        assert counter.items == 0, "entries made with the served adapter are loaded"
    finally:
        shutdown(llm)
    c = open_store(store_path).read_counters()
    assert c.get("lora_stale") == 3 and c.get("misses_lora_stale") == 3, c
    assert c.get("hits") == 2

    # purge --stale: plan, dry run, then delete exactly the three (on a copy)
    copy = str(root / "copy")
    shutil.copytree(store_path, copy, ignore=shutil.ignore_patterns("counters"))
    r = CliRunner().invoke(app, ["purge", "--store", copy, "--lora", "adA", "--stale",
                                 "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["plan"]["entries"] == 3
    r = CliRunner().invoke(app, ["purge", "--store", copy, "--lora", "adA", "--stale", "--yes"])
    assert r.exit_code == 0, r.output
    assert {i.meta.lora_digest for i in open_store(copy).scan()} == {db}
    assert len(list(open_store(copy).identifiers())) == 2
    r = CliRunner().invoke(app, ["purge", "--store", copy, "--stale"])
    assert r.exit_code == 2  # --stale needs --lora

    # precompute with B replaces the stale entries
    s = precompute_corpus(str(root / "old"), with_b)
    assert (s.stale_lora, s.encoded, s.present) == (3, 3, 0)
    assert {i.meta.lora_digest for i in open_store(store_path).scan()} == {db}
