"""The local encode stage reads batch k+1's files while the engine encodes batch k, and
encodes while the rest of the corpus is still being hashed.

Real engine (the tiny model), real files: the same corpus precomputed with and without
the reader thread gives the same identifiers and the same tensor bytes, and the stage
timestamps show the overlap (the read of a next batch starts before the encode of the
current one ends) without asserting any speed. Without prefetch, no read of a next batch
starts before the previous encode ended (the control: the trace can tell the two apart).
"""

from __future__ import annotations

import pytest

from engine_support import PRECOMPUTE_KW

pytestmark = pytest.mark.engine
BATCH = 2
PAGES = 8


def _run(files, model, store, prefetch):
    from encache.jobs.precompute import LocalStage, PrecomputeOptions, precompute_files

    trace: list[tuple[str, int, float, float]] = []
    options = PrecomputeOptions(model=model, store=store, batch=BATCH, **PRECOMPUTE_KW)
    stage = LocalStage(prefetch=prefetch, trace=lambda *event: trace.append(event))
    summary = precompute_files(files, options, stage=stage)
    assert summary.encoded == PAGES and summary.failed == 0, summary.failures
    return trace


def _tensors(store_dir) -> dict:
    from encache.connectors.store import decode, open_store

    with open_store(str(store_dir), create=False) as store:
        out = {}
        for ident in store.identifiers():
            meta, data = decode(store.get(ident), identifier=ident)
            out[ident] = (meta.dtype, tuple(meta.shape), bytes(data))
    return out


def test_reads_overlap_encodes_and_output_is_the_same(tiny_model, tmp_path):
    from encache.jobs.corpus import walk
    from demo_corpus import make_corpus

    make_corpus(str(tmp_path / "corpus"), pages=PAGES, seed=11)
    files = [f.path for f in walk(str(tmp_path / "corpus"))]
    assert len(files) == PAGES
    piped = _run(files, tiny_model, str(tmp_path / "piped"), prefetch=True)
    serial = _run(files, tiny_model, str(tmp_path / "serial"), prefetch=False)

    # same entries, byte for byte
    a, b = _tensors(tmp_path / "piped"), _tensors(tmp_path / "serial")
    assert len(a) == PAGES and sorted(a) == sorted(b)
    assert all(a[i] == b[i] for i in a)

    batches = PAGES // BATCH
    for trace in (piped, serial):  # every batch read once and encoded once, in order
        assert sorted(k for s, k, *_ in trace if s == "read") == list(range(batches))
        assert [k for s, k, *_ in trace if s == "encode"] == list(range(batches))

    def overlaps(trace) -> list[bool]:
        read = {k: (t0, t1) for s, k, t0, t1 in trace if s == "read"}
        enc = {k: (t0, t1) for s, k, t0, t1 in trace if s == "encode"}
        # the read of batch k+1 started while batch k was still being encoded
        return [read[k + 1][0] < enc[k][1] for k in range(batches - 1)]

    assert any(overlaps(piped)), piped
    assert not any(overlaps(serial)), serial


def test_the_engine_encodes_while_the_rest_is_still_being_hashed(tiny_model, tmp_path):
    """Identification runs on a background thread and feeds the engine batch by batch.
    Here it is held after the first two batches' files until a batch has been encoded:
    a stage that hashed the whole corpus before encoding would never encode one (the
    hold times out and the test fails). Every file is still encoded, under the
    identifiers hashing alone gives."""
    import threading

    from encache.jobs.corpus import walk
    from encache.connectors.store import open_store
    from encache.connectors.vllm.hashing import identify_file
    from encache.jobs.precompute import PrecomputeOptions, precompute_files
    from demo_corpus import make_corpus

    make_corpus(str(tmp_path / "corpus"), pages=PAGES, seed=5)
    files = [f.path for f in walk(str(tmp_path / "corpus"))]

    class HoldHashing:
        def __init__(self):
            self.encoded = threading.Event()
            self.hashed = 0
            self.held = None

        def start(self, phase, total):
            pass

        def advance(self, n, failed=None, phase=None):
            if phase == "hashing":
                self.hashed += n
                if self.hashed == 2 * BATCH:
                    self.held = self.encoded.wait(120)
            else:  # the encode loop's advance: a batch went through the engine
                self.encoded.set()

    hold = HoldHashing()
    options = PrecomputeOptions(model=tiny_model, store=str(tmp_path / "s"), batch=BATCH,
                                **PRECOMPUTE_KW)
    s = precompute_files(files, options, progress=hold)
    assert hold.held is True, "no batch was encoded before hashing finished"
    assert s.encoded == PAGES and s.hashed == PAGES and s.failed == 0, s.failures
    expected = {identify_file(p, tiny_model).identifier for p in files}
    assert set(open_store(str(tmp_path / "s")).identifiers()) == expected
