"""Miss diagnosis on a real engine: the model given by a relative path.

precompute used the model's absolute path; a consumer engine started with a relative
path to the same directory computes other identifiers and misses everything. The
connector says so in one actionable line naming both model id strings, and the store's
counters record the misses as ``model`` (model id mismatch); ``encache stats`` breaks
them down by reason.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
from typer.testing import CliRunner

from encache.cli.app import app
from encache.connectors.store import open_store
from engine_support import PRECOMPUTE_KW, EncoderCounter, chat_texts, consumer_config, make_llm, shutdown

pytestmark = pytest.mark.engine


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_relative_model_path_misses_are_diagnosed(tiny_model, tmp_path):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from demo_corpus import make_corpus

    files = make_corpus(str(tmp_path / "corpus"), pages=3, seed=31)
    store = str(tmp_path / "store")
    absolute = os.path.abspath(tiny_model)
    options = PrecomputeOptions(model=absolute, store=store, **PRECOMPUTE_KW)
    assert precompute_corpus(str(tmp_path / "corpus"), options).encoded == 3
    relative = os.path.relpath(absolute)
    assert relative != absolute and os.path.realpath(relative) == absolute

    handler = Lines()
    logging.getLogger("encache.connector").addHandler(handler)
    counter = EncoderCounter()
    llm = make_llm(relative, consumer_config(store))
    try:
        from vllm.distributed.ec_transfer import get_ec_transfer  # noqa: F401  (engine is up)
        counter.reset()
        chat_texts(llm, files)
        assert counter.items == 3  # every image re-encoded: other identifiers
    finally:
        shutdown(llm)
        logging.getLogger("encache.connector").removeHandler(handler)
    lines = [l for l in handler.lines if "misses for model" in l]
    assert len(lines) == 1, handler.lines  # one line per interval, not one per miss
    assert repr(relative) in lines[0] and repr(absolute) in lines[0], lines[0]
    assert "--model" in lines[0]
    c = open_store(store).read_counters()
    assert c.get("misses") == 3 and c.get("misses_model") == 3, c
    r = CliRunner().invoke(app, ["stats", "--store", store, "--json"])
    s = json.loads(r.stdout)
    assert s["misses_by_reason"]["model"] == 3 and s["misses_by_reason"]["absent"] == 0
    r = CliRunner().invoke(app, ["stats", "--store", store])
    assert "model id mismatch 3" in r.stdout


def test_unknown_images_for_the_right_model_are_absent(tmp_path):
    """Unit level (no engine): the engine's model is in the store -> plain 'absent'."""
    from encache.connectors.vllm.diagnosis import MissDiagnosis
    from encache.connectors.store.entry import encode

    st = open_store(str(tmp_path / "s"))
    st.put("a" * 64, encode("a" * 64, b"\0" * 8, "F32", (2, 1), model="m1"))
    d = MissDiagnosis(st, "m1")
    d.start()
    d.wait()
    assert d.classify("absent") == "absent"
    assert d.classify("config") == "config"
    other = MissDiagnosis(st, "m2")
    other.start()
    other.wait()
    assert other.classify("absent") == "model"
