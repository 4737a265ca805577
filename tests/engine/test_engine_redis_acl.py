"""A consumer engine under the read-only Redis ACL user of docs/security.md, on a real server.

Precompute writes with the writer's credentials; a consumer engine whose URL names the
reader serves every item from the store (its tower idle, its hits recorded in the store's
counters, which the reader may write). Under an ACL tighter than documented (no ``GET``:
no entry can be read) the engine keeps serving: every item is encoded, the answers are
the same, and the refusal is one line naming the ACL, never a traceback.
"""

from __future__ import annotations

import time

import pytest

from encache.connectors.store import open_store
from engine_support import (PRECOMPUTE_KW, EncoderCounter, chat_texts, consumer_config,
                            make_llm, shutdown)

pytestmark = [pytest.mark.engine, pytest.mark.redis]


def _acl_line(user: str) -> list[str]:
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))
    from test_store_redis_acl import acl_line
    return acl_line(user)


def _user(server, name: str, args: list[str], password: str) -> str:
    args = [a if a != ">PASSWORD" else f">{password}" for a in args]
    args[2] = name
    server.client().execute_command(*args)
    return f"redis://{name}:{password}@{server.host}:{server.port}/0"


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    from demo_corpus import make_corpus
    return make_corpus(str(tmp_path_factory.mktemp("acl")), pages=3, seed=61)


def test_reader_serves_hits_and_a_tighter_acl_fails_cleanly(tiny_model, pages, redis_factory,
                                                            caplog):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    server = redis_factory()
    writer = _user(server, "encache-writer", _acl_line("encache-writer"), "w-secret")
    reader = _user(server, "encache-reader", _acl_line("encache-reader"), "r-secret")
    tight = _user(server, "encache-tight",
                  [a for a in _acl_line("encache-reader") if a != "+get"], "t-secret")
    root = str(__import__("pathlib").Path(pages[0]).parent.parent)
    summary = precompute_corpus(root, PrecomputeOptions(model=tiny_model, store=writer,
                                                        **PRECOMPUTE_KW))
    assert (summary.encoded, summary.failed) == (len(pages), 0)

    counter = EncoderCounter()
    llm = make_llm(tiny_model, consumer_config(reader))
    try:
        counter.reset()
        texts = chat_texts(llm, pages)
        assert counter.items == 0, "the consumer under the reader ACL encoded"
    finally:
        shutdown(llm)
    deadline = time.time() + 10
    while open_store(writer).read_counters().get("hits", 0) < len(pages):
        assert time.time() < deadline, open_store(writer).read_counters()
        time.sleep(0.2)

    import logging
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="encache"):
        llm = make_llm(tiny_model, consumer_config(tight))
        try:
            counter.reset()
            assert chat_texts(llm, pages) == texts
            assert counter.items == len(pages)  # every read refused: encoded instead
        finally:
            shutdown(llm)
    said = [r for r in caplog.records if r.name.startswith("encache")]
    denied = [r.getMessage() for r in said if "permission denied: this user's ACL" in r.getMessage()]
    assert denied, [r.getMessage() for r in said]
    assert all("\n" not in r.getMessage() and "t-secret" not in r.getMessage()
               and r.exc_info is None for r in said)
