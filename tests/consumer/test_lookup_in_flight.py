"""A write in flight (EPD on a local disk store): the encoder's request finishes once the
entry's write is visible (its temp file created), before its bytes, their fsync and the
rename that commits them (held while the engine answers the request); a consumer that
looks the entry up in between waits for those bytes and reads them (checked in full), or
the commit, instead of encoding the image again.

Real files, a real ``EntryWriter`` and lookup at a Gemma-3-sized entry (256 x 2688
fp32, 2.75 MB). The writer's bytes or fsync are held until the test lets them go, so the
window between "visible" and "committed" (a few ms at this size here, more on a busy
disk) lasts as long as the test needs.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from encache.connectors.lookup.loader import State
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.files import TEMP_PREFIX
from encache.connectors.vllm.writer import EntryWriter
from cli_support import invoke
from lookup_support import make, tensor_bytes

ARR = np.random.default_rng(5).standard_normal((256, 2688)).astype(np.float32)


def entry_temp_file(fd: int) -> bool:
    """``fd`` is an entry's temp file (not a bookkeeping file under ``.encache/``)."""
    path = os.readlink(f"/proc/self/fd/{fd}")
    return os.path.basename(path).startswith(TEMP_PREFIX) and "/.encache/" not in path


@pytest.fixture
def held_fsync(monkeypatch):
    """``os.fsync`` of an entry's temp file waits for ``release``; ``entered`` is set
    when one does. Other fsyncs (bookkeeping files) pass."""
    real, entered, release = os.fsync, threading.Event(), threading.Event()

    def fsync(fd):
        if entry_temp_file(fd):
            entered.set()
            assert release.wait(30)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield entered, release
    release.set()


def save(writer: EntryWriter, identifier: str):
    return writer.submit(identifier, lambda: (ARR.view(np.uint8), "F32", ARR.shape),
                         ARR.nbytes, model="m")


class SlowBytes(DiskStore):
    """A disk store whose writes stop between becoming visible and their first byte
    until ``release`` is set (a write that takes its time: a busy disk, a busy CPU)."""
    release: threading.Event

    def put(self, identifier, parts, *, on_visible=None, **kw):
        def visible():
            if on_visible is not None:
                on_visible()
            assert self.release.wait(30)
        return super().put(identifier, parts, on_visible=visible, **kw)


def test_a_write_lands_when_visible_and_a_reader_waits_for_its_bytes(tmp_path):
    """The writer reports the entry landed once its temp file exists, before any byte
    is in it; a consumer that looks it up then waits (no miss, no torn read) and loads
    the bytes once whole, checked in full."""
    store = SlowBytes(tmp_path)
    store.release = threading.Event()
    writer = EntryWriter(store)
    reader = DiskStore(tmp_path)
    lk = make(reader)
    try:
        landed = save(writer, "img")
        assert landed.result(timeout=30) is True  # the encoder's request may finish now
        assert reader.in_flight("img") and reader.read_in_flight("img") is None
        assert lk.request("img") is State.PENDING  # waits for the bytes
        time.sleep(0.3)
        assert lk.request("img") is State.PENDING and not lk.is_ready("img")
        store.release.set()
        lk.wait(["img"], 10)
        assert lk.request("img") is State.READY
        assert tensor_bytes(lk.get_staged("img")) == ARR.tobytes()
        assert lk.metrics.pending("in_flight_loads") == 1
        assert writer.flush(30) and not writer.errors
        assert reader.contains("img") and not reader.in_flight("img")
    finally:
        store.release.set()
        writer.close()
        lk.close()


def test_a_reader_loads_a_written_entry_before_its_commit(tmp_path, held_fsync, counted):
    """The fsync is held: the entry is not committed, yet a consumer loads its bytes
    from the temp file (header and size checked; not hashed: the producer, on this host,
    recorded the whole temp file in the verified log), then keeps that copy through the
    commit (the same version)."""
    entered, release = held_fsync
    writer = EntryWriter(DiskStore(tmp_path))
    reader = DiskStore(tmp_path)
    lk = make(reader)
    try:
        assert lk.start_verify_done.wait(30)
        landed = save(writer, "img")
        assert landed.result(timeout=30) is True  # the encoder's request may finish now
        assert entered.wait(10)  # the fsync has begun (and is held)
        assert not reader.contains("img") and reader.in_flight("img")
        assert lk.request("img") is State.PENDING  # not a miss: read in the background
        lk.wait(["img"], 10)
        assert lk.request("img") is State.READY
        staged = lk.get_staged("img")
        assert tensor_bytes(staged) == ARR.tobytes()
        assert not reader.contains("img")  # still not committed
        assert lk.metrics.pending("in_flight_loads") == 1
        assert counted == [False] and lk.metrics.pending("checksums_skipped") == 1
        lk.maybe_flush(force=True)  # `encache stats` shows it
        stats = invoke("stats", "-s", str(tmp_path), "--json")
        assert stats.exit_code == 0 and json.loads(stats.output)["in_flight_loads"] == 1
        assert json.loads(stats.output)["mean_in_flight_wait_seconds"] > 0
        release.set()
        assert writer.flush(30)  # flush waits for commits
        assert writer.counters.get("saves") == 1 and not writer.errors
        assert reader.contains("img") and not reader.in_flight("img")
        assert reader.unchanged([("img", staged.version, staged.meta)]) == [True]
    finally:
        release.set()
        writer.close()
        lk.close()


def test_bytes_from_elsewhere_in_flight_are_hashed(tmp_path, counted):
    """A write in flight that no producer here encoded (a plain ``put``: ``warm``, a
    copy) is read before its commit checked in full, checksum included."""
    from encache.connectors.store.entry import encode_parts
    store, release = DiskStore(tmp_path), threading.Event()
    written = threading.Event()

    def on_written():
        written.set()
        assert release.wait(30)

    parts = encode_parts("img", ARR.view(np.uint8), "F32", ARR.shape, model="m")
    t = threading.Thread(target=store.put, args=("img", parts), kwargs={"on_written": on_written})
    lk = make(DiskStore(tmp_path))
    try:
        assert lk.start_verify_done.wait(30)
        t.start()
        assert written.wait(10)
        assert lk.request("img") is State.PENDING
        lk.wait(["img"], 10)
        assert lk.request("img") is State.READY
        assert tensor_bytes(lk.get_staged("img")) == ARR.tobytes()
        assert counted == [True] and lk.metrics.pending("in_flight_loads") == 1
    finally:
        release.set()
        t.join(30)
        lk.close()


def test_a_partly_written_entry_is_not_read_before_it_is_whole(tmp_path):
    """A temp file whose bytes are still coming (or stopped: a killed writer) is never
    served: a reader waits for it whole, or for the commit."""
    from encache.connectors.store.entry import encode_parts
    from encache.connectors.store.keys import to_name

    store = DiskStore(tmp_path)
    header, view = encode_parts("part", ARR.view(np.uint8), "F32", ARR.shape, model="m")
    whole = header + bytes(view)
    d = tmp_path / to_name("part")
    d.mkdir()
    tmp = d / (TEMP_PREFIX + "w")
    tmp.write_bytes(b"")
    held = os.open(tmp, os.O_RDONLY)  # the writer's hold on its temp file (writer_alive)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        for cut in (0, 5, len(header) - 1, len(header) + 1000, len(whole) - 1):
            tmp.write_bytes(whole[:cut])
            assert store.in_flight("part") and store.read_in_flight("part") is None, cut
        bad = bytearray(whole)
        bad[-3] ^= 0xFF
        tmp.write_bytes(bytes(bad))
        assert store.read_in_flight("part") is None
        tmp.write_bytes(whole)
        buf, version, meta, offset = store.read_in_flight("part")
        assert bytes(memoryview(buf)[offset:offset + meta.data_bytes]) == ARR.tobytes()
    finally:
        os.close(held)
    assert not store.in_flight("part")  # nobody holds it now: a dead writer's leftover


@pytest.mark.parametrize("fsync", [True, False])
def test_a_landed_entrys_commit_is_held_while_the_answer_goes_out(tmp_path, monkeypatch,
                                                                   fsync):
    """With or without fsync, an entry lands (readable in flight) before its commit, and
    the commit is held (``COMMIT_HOLD_S``; long here, so no timing decides the test): a
    reader takes the bytes meanwhile. A write that finds no idle thread ends the hold at
    once, and so does ``flush``. With the real hold, a lone write commits by itself."""
    import encache.connectors.vllm.writer as writer_module

    store = DiskStore(tmp_path, fsync=fsync)
    monkeypatch.setattr(writer_module, "COMMIT_HOLD_S", 60.0)
    writer = EntryWriter(store, threads=1)
    try:
        assert save(writer, "a").result(timeout=30) is True
        time.sleep(0.3)
        assert store.in_flight("a") and not store.contains("a")  # held
        buf, _, meta, offset = store.read_in_flight("a")  # whole, checked
        assert bytes(memoryview(buf)[offset:offset + meta.data_bytes]) == ARR.tobytes()
        t0 = time.monotonic()
        b = save(writer, "b")  # the only thread holds a's commit: it goes now
        assert b.result(timeout=30) is True
        assert store.contains("a") and time.monotonic() - t0 < 10
        assert store.in_flight("b") and not store.contains("b")
        t0 = time.monotonic()
        assert writer.flush(30) and time.monotonic() - t0 < 10
        assert store.contains("b") and not store.in_flight("b")
    finally:
        writer.close()
    monkeypatch.undo()
    writer = EntryWriter(store)
    try:
        assert save(writer, "c").result(timeout=30) is True
        deadline = time.monotonic() + 10
        while not store.contains("c"):
            assert time.monotonic() < deadline, "a held commit never went"
            time.sleep(0.01)
    finally:
        writer.close()


def test_off_a_local_filesystem_a_write_lands_at_its_commit(tmp_path):
    """A network filesystem (a reader's cached lookups could hide the commit): no
    in-flight writes; the writer reports the entry once it is committed."""
    nfs = DiskStore(tmp_path / "nfs")
    nfs.supports_in_flight = False  # what a non-local filesystem type gives
    writer = EntryWriter(nfs)
    try:
        assert save(writer, "img").result(timeout=30) is True
        assert nfs.contains("img")
    finally:
        writer.close()
    (tmp_path / "nfs" / "x").mkdir()
    (tmp_path / "nfs" / "x" / (TEMP_PREFIX + "1")).write_bytes(b"1")
    assert not nfs.in_flight("x")


@pytest.mark.parametrize("stop", [{"before_bytes": 120},  # visible, no byte written
                                  {"before_commit": 120, "until": "written"}],
                         ids=["on_visible", "on_written"])
def test_a_killed_writers_temp_file_is_not_waited_for(tmp_path, writer_process, stop):
    """An encoder SIGKILLed mid-write (before its bytes, or with them all written but
    uncommitted) leaves a temp file. While the writer lived, it was in flight; once it is
    dead, a reader does not wait for it (a client's retry sent to another encoder, or
    PD, looks the image up at once and encodes it), and ``encache verify --repair``
    counts it a stray at once."""
    store = DiskStore(tmp_path)
    proc = writer_process(tmp_path, "k1", **stop)
    assert store.in_flight("k1") and store.stray_files() == []
    proc.kill()
    proc.wait()
    assert not store.in_flight("k1") and store.read_in_flight("k1") is None
    assert [p.name.startswith(TEMP_PREFIX) for p in store.stray_files()] == [True]
    lk = make(store, load_timeout_s=5.0)
    try:
        t0 = time.monotonic()
        # its directory is listed (the index is a hint: a read finds nothing there)
        state = lk.request("k1")
        if state is State.PENDING:
            lk.loader.wait_idle(5.0)
            state = lk.request("k1")
        assert state is State.MISS
        assert time.monotonic() - t0 < 1.0
    finally:
        lk.close()


def test_a_stuck_writers_temp_file_is_waited_for_once_then_not(tmp_path, writer_process):
    """A writer that lives but does not finish (a stopped or hung process) keeps its
    write in flight: a reader waits up to ``load_timeout_s`` once, then the item is a miss
    (encoded) without another wait. Past ``IN_FLIGHT_S`` it is not in flight at all; it
    is never a stray while its writer holds it."""
    store = DiskStore(tmp_path)
    proc = writer_process(tmp_path, "stuck", before_bytes=120)  # no byte written yet
    proc.send_signal(signal.SIGSTOP)
    lk = make(store, load_timeout_s=0.3)
    try:
        assert store.in_flight("stuck") and store.read_in_flight("stuck") is None
        assert lk.request("stuck") is State.PENDING
        lk.wait(["stuck"], 5)
        time.sleep(0.25)  # past the index's short memory of an absent identifier
        assert lk.request("stuck") is State.MISS  # no second wait
        tmp = store.in_flight_paths("stuck")[0]
        old = time.time() - 60
        os.utime(tmp, (old, old))
        assert not store.in_flight("stuck")
        assert store.stray_files(older_than=0.0) == []  # its writer still holds it
    finally:
        lk.close()
        proc.send_signal(signal.SIGCONT)


def test_a_write_that_fails_after_it_landed_is_said_on_the_writer_side(tmp_path, monkeypatch):
    """The request finished when the write was visible; the commit then fails (the
    fsync raises): counted and logged on the encoder, nothing visible, readers stop
    waiting (the temp file is gone)."""
    def failing(fd):
        if entry_temp_file(fd):
            raise OSError(5, "Input/output error")
        return real(fd)

    real = os.fsync
    monkeypatch.setattr(os, "fsync", failing)
    store = DiskStore(tmp_path)
    writer = EntryWriter(store)
    try:
        assert save(writer, "img").result(timeout=30) is True
        assert writer.flush(30)
        assert writer.counters.get("save_errors") == 1 and "img" in writer.errors
        assert not store.contains("img") and not store.in_flight("img")
    finally:
        writer.close()


def test_a_lookup_right_after_landing_never_misses(tmp_path):
    """The proxy's timing, many times over with real fsyncs: the moment a write lands
    (the encoder's answer), a consumer looks its entry up -- before, during or after its
    bytes and its commit, never a miss, and what it loads is the entry."""
    writer = EntryWriter(DiskStore(tmp_path), threads=2)
    lk = make(DiskStore(tmp_path))
    small = ARR[:16]  # 172 KB: many rounds, commits a fraction of a millisecond away
    try:
        for i in range(300):
            arr = ARR if i % 20 == 0 else small  # a Gemma-sized entry now and then
            landed = writer.submit(f"n{i}", lambda a=arr: (a.view(np.uint8), "F32", a.shape),
                                   arr.nbytes, model="m")
            assert landed.result(timeout=30) is True
            state = lk.request(f"n{i}", inline=True)
            assert state is not State.MISS, i
            if i % 20 == 0:
                lk.wait([f"n{i}"], 10)
                assert lk.request(f"n{i}") is State.READY, i
                assert tensor_bytes(lk.get_staged(f"n{i}")) == arr.tobytes()
        assert writer.flush(30) and not writer.errors
    finally:
        writer.close()
        lk.close()
