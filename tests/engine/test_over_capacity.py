"""A corpus larger than the store's --max-bytes, with real precompute runs.

Run 1 fills a small cap and says, with numbers, that the corpus does not fit. Run 2 (a
cron refresh) leaves out what run 1's evictions removed: no engine starts, they are
counted as ``skipped_removed``. Run 2b with ``refill_removed`` (``--refill-removed``)
re-encodes them and reports the evictions the store counted during the run (it used to
say "evicted 0" while the store's counter rose). Run 3 with ``--over-capacity skip``
starts no engine, evicts nothing and counts what it skipped. The same lifecycle with
``purge --older-than``: what it deleted is not re-encoded by the next refresh, unless
asked for.
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
    from demo_corpus import make_corpus

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

    gone = store.removals()  # what the evictions removed, remembered
    assert len(gone) == 24 - len(kept1) and set(gone.values()) == {"evicted"}
    assert not set(gone) & kept1

    # the cron refresh does not undo the eviction: nothing to encode, no engine
    s2 = precompute_corpus(str(tmp_path / "corpus"), PrecomputeOptions(
        model=tiny_model, store=store_path, **PRECOMPUTE_KW))
    assert (s2.present, s2.skipped_removed, s2.encoded) == (len(kept1), 24 - len(kept1), 0)
    assert s2.engine_started is False and set(store.identifiers()) == kept1

    # asked for (--refill-removed): encoded again, evicting others
    before = store.read_counters()["evictions"]
    s2 = precompute_corpus(str(tmp_path / "corpus"), PrecomputeOptions(
        model=tiny_model, store=store_path, refill_removed=True, **PRECOMPUTE_KW))
    after = store.read_counters()["evictions"]
    assert s2.present == len(kept1) and s2.encoded == 24 - len(kept1)
    assert s2.evicted == after - before > 0, (s2.evicted, before, after)  # not "evicted 0"
    assert s2.capacity is not None and s2.refilled_removed > 0

    # skip: nothing fits without evicting, so no engine, no eviction, the rest counted
    # (--refill-removed: what is missing was evicted, and is wanted back)
    kept2 = set(store.identifiers())
    r = CliRunner().invoke(app, ["precompute", str(tmp_path / "corpus"), "--model", tiny_model,
                                 "--store", store_path, "--over-capacity", "skip", "--json",
                                 "--refill-removed"])
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
    from demo_corpus import make_corpus

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


def test_purged_by_age_is_not_re_encoded_unless_asked_for(tiny_model, tmp_path):
    """precompute 4 images, ``purge --older-than 1s --yes``, precompute again: nothing is
    encoded and no engine starts (the issue's cron jobs undid each other here); stats
    counts the removals; with ``--refill-removed`` the 4 are encoded again, and their
    records are dropped."""
    import time

    from demo_corpus import make_corpus

    make_corpus(str(tmp_path / "corpus"), pages=4, seed=5)
    store_path = str(tmp_path / "store")
    engine = ["--max-model-len", "256", "--dtype", "float32", "--engine-arg",
              "enforce_eager=true", "--engine-arg", "max_num_seqs=4", "--engine-arg",
              "max_num_batched_tokens=256", "--engine-arg", "seed=0"]

    def precompute(*extra):
        r = CliRunner().invoke(app, ["precompute", str(tmp_path / "corpus"), "-m", tiny_model,
                                     "-s", store_path, *engine, "--json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    assert precompute()["encoded"] == 4
    time.sleep(1.1)
    r = CliRunner().invoke(app, ["purge", "-s", store_path, "--older-than", "1s", "--yes"])
    assert r.exit_code == 0 and "Deleted 4 entries" in r.stdout, r.output
    again = precompute()
    assert (again["encoded"], again["skipped_removed"], again["engine_started"]) == (0, 4, False)
    r = CliRunner().invoke(app, ["stats", "-s", store_path, "--json"])
    assert json.loads(r.stdout)["removed_by_policy"]["older-than"] == 4
    refill = precompute("--refill-removed")
    assert (refill["encoded"], refill["refilled_removed"], refill["failed"]) == (4, 4, 0)
    assert open_store(store_path).removals() == {}
    assert precompute()["present"] == 4
