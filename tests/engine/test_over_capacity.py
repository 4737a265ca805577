"""A corpus larger than the store's --max-bytes, with real precompute runs.

Run 1 fills a small cap and says, with numbers, that the corpus does not fit. Run 2 (a
cron refresh) re-encodes what run 1 evicted and reports the evictions the store counted
during the run (it used to say "evicted 0" while the store's counter rose). Run 3 with
``--over-capacity skip`` starts no engine, evicts nothing and counts what it skipped.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from encache.cli.app import app
from encache.connectors.store import open_store
from engine_support import PRECOMPUTE_KW

pytestmark = pytest.mark.engine
CAP = 50_000


def test_corpus_larger_than_capacity(tiny_model, tmp_path):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from make_demo_corpus import make_corpus

    make_corpus(str(tmp_path / "corpus"), pages=24, seed=4)
    store_path = str(tmp_path / "store")
    s1 = precompute_corpus(str(tmp_path / "corpus"), PrecomputeOptions(
        model=tiny_model, store=store_path, max_bytes=CAP, **PRECOMPUTE_KW))
    store = open_store(store_path)
    kept1 = set(store.identifiers())
    assert s1.encoded == 24 and s1.failed == 0 and len(kept1) < 24
    assert s1.evicted == store.read_counters()["evictions"] > 0
    cap = s1.capacity
    assert cap is not None and cap["max_bytes"] == CAP and cap["entries"] == 24
    assert cap["need_bytes"] > CAP and str(24) in cap["message"]
    assert "--over-capacity skip" in cap["message"]

    before = store.read_counters()["evictions"]
    s2 = precompute_corpus(str(tmp_path / "corpus"), PrecomputeOptions(
        model=tiny_model, store=store_path, **PRECOMPUTE_KW))
    after = store.read_counters()["evictions"]
    assert s2.present == len(kept1) and s2.encoded == 24 - len(kept1)
    assert s2.evicted == after - before > 0, (s2.evicted, before, after)  # not "evicted 0"
    assert s2.capacity is not None

    # skip: nothing fits without evicting, so no engine, no eviction, the rest counted
    kept2 = set(store.identifiers())
    r = CliRunner().invoke(app, ["precompute", str(tmp_path / "corpus"), "--model", tiny_model,
                                 "--store", store_path, "--over-capacity", "skip", "--json"])
    assert r.exit_code == 0, r.output
    s3 = json.loads(r.stdout)
    assert s3["engine_started"] is False and s3["encoded"] == 0
    assert s3["skipped_capacity"] == 24 - len(kept2) and s3["evicted"] == 0
    assert "skipped" in s3["capacity"]["message"]
    assert set(store.identifiers()) == kept2
    assert store.read_counters()["evictions"] == after
    r = CliRunner().invoke(app, ["precompute", str(tmp_path / "corpus"), "--model", tiny_model,
                                 "--store", store_path, "--over-capacity", "bogus"])
    assert r.exit_code == 2


def test_skip_fills_free_room_and_evicts_nothing(tiny_model, tmp_path):
    """--over-capacity skip from an empty store: encodes batch by batch while there is
    room under the low watermark, then skips the rest; the store never evicts."""
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from make_demo_corpus import make_corpus

    make_corpus(str(tmp_path / "corpus"), pages=24, seed=4)
    store_path = str(tmp_path / "store")
    s = precompute_corpus(str(tmp_path / "corpus"), PrecomputeOptions(
        model=tiny_model, store=store_path, max_bytes=CAP, over_capacity="skip", batch=4,
        **PRECOMPUTE_KW))
    store = open_store(store_path)
    kept = list(store.identifiers())
    assert s.failed == 0 and s.encoded == len(kept) > 0
    assert s.skipped_capacity == 24 - s.encoded > 0
    assert s.evicted == 0 and store.read_counters().get("evictions", 0) == 0
    assert store.used_bytes() <= CAP
    assert s.capacity is not None and "skipped" in s.capacity["message"]
