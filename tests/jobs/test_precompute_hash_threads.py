"""Precompute's identify phase runs on a few threads (``LocalStage(hash_threads=)``):
the rows -- identifiers, states, failures, in corpus order -- are those of one thread,
and at most a bounded window of files is queued at a time. No engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import engine_support  # noqa: F401 (puts scripts/ on sys.path: make_demo_corpus)
from encache.jobs.precompute_identify import _ordered
from media_files import hostile_corpus


def _rows(corpus, store_dir, threads: int) -> list:
    from encache.connectors.corpus import walk
    from encache.connectors.store import open_store
    from encache.jobs.precompute import LocalStage, PrecomputeOptions, Summary

    options = PrecomputeOptions(model="org/vlm", store=str(store_dir))
    files = walk(str(corpus))
    with open_store(str(store_dir), create=True) as store:
        summary = Summary(store=store.url, model=options.model, lora=None)
        summary.encoder_config = options.encoder_config
        rows = list(LocalStage(hash_threads=threads).identify(files, {}, store, options,
                                                              summary, "", None))
    return [(f.rel, ident, hashed, state) for f, ident, hashed, state in rows]


def test_threads_give_the_rows_of_one_thread(tmp_path):
    from make_demo_corpus import make_corpus

    make_corpus(str(tmp_path / "c" / "docs"), pages=12, seed=3)
    hostile_corpus(tmp_path / "c" / "hostile")
    one = _rows(tmp_path / "c", tmp_path / "s", 1)
    four = _rows(tmp_path / "c", tmp_path / "s", 4)
    assert one == four
    states = {state for *_, state in one}
    assert {"missing", "unreadable", "non_media"} <= states  # a mixed corpus, really


def test_ordered_keeps_input_order_and_bounds_the_queue():
    in_flight, peak, lock = 0, 0, threading.Lock()

    def slow(i):
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        time.sleep(0.002 * (i % 3))
        with lock:
            in_flight -= 1
        return i * i

    submitted = []

    def items():
        for i in range(60):
            submitted.append(i)
            yield i
    with ThreadPoolExecutor(max_workers=4) as pool:
        out = []
        for k, value in enumerate(_ordered(pool, slow, items(), window=6)):
            assert len(submitted) <= k + 6  # never more than the window ahead of the reader
            out.append(value)
    assert out == [i * i for i in range(60)]
    assert peak <= 4
