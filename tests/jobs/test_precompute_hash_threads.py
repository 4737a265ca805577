"""Precompute's identify phase runs on a few threads (``LocalStage(hash_threads=)``):
the rows -- identifiers, states, failures, in corpus order -- are those of one thread,
and at most a bounded window of files is queued at a time. No engine."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from encache.jobs.precompute.identify import _ordered
from media_files import hostile_corpus


def _rows(corpus, store_dir, threads: int) -> list:
    from encache.jobs.corpus import walk
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
    from demo_corpus import make_corpus

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


def test_row_stream_hands_rows_over_in_order_and_reports_errors():
    """``RowStream`` computes rows on its own thread: they come out in input order, a
    progress object is advanced once per row -- with ``phase="hashing"`` when its
    ``advance`` takes a phase, without one when it does not (the older protocol) -- and
    an error of the row function is raised to the consumer, not lost in the thread."""
    from encache.jobs.precompute.identify import RowStream

    class File:
        def __init__(self, i):
            self.i, self.rel = i, f"f{i}"

    def row(f):
        time.sleep(0.001 * (f.i % 3))
        return (f, f"id{f.i}", True, "missing")

    class Phased:
        def __init__(self):
            self.calls = []

        def advance(self, n, failed=None, phase=None):
            self.calls.append((n, phase))

    files = [File(i) for i in range(40)]
    progress = Phased()
    stream = RowStream(files, row, threads=3, progress=progress)
    assert [ident for _, ident, _, _ in stream] == [f"id{i}" for i in range(40)]
    assert list(stream) == []  # the end stays the end
    stream.close()
    assert progress.calls == [(1, "hashing")] * 40

    def broken(f):
        if f.i == 7:
            raise OSError("disk gone")
        return row(f)

    stream = RowStream(files, broken, threads=2)
    taken = []
    try:
        for r in stream:
            taken.append(r[1])
        raise AssertionError("the row function's error was not raised")
    except OSError as e:
        assert str(e) == "disk gone"
    assert taken == [f"id{i}" for i in range(7)]
    stream.close()
