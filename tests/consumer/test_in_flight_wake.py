"""A reader waiting for a write in flight wakes on the writer's steps, not by looking every
millisecond (``DiskStore.in_flight_wait``, ``store/disk/inotify.py``): a producer on this host
appending its record to the verified log (its bytes all in), the rename that commits the
entry, the writer gone. Real writer processes and a real lookup at a Gemma-3-sized entry
(2.75 MB). To show that the wake comes from the event and not from the periodic look, the
tests set that period (``IN_FLIGHT_WATCHED_S``) to a minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from encache.connectors.lookup.loader import State
from encache.connectors.store.disk import in_flight as disk_in_flight
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.disk.inotify import IN_CREATE, IN_MOVED_TO, DirectoryWatch
from lookup_support import make, tensor_bytes

ARR = np.random.default_rng(5).standard_normal((256, 2688)).astype(np.float32)

@pytest.fixture
def writer(tmp_path, writer_process):
    """``start(identifier, encoded_here, before_bytes, before_commit)``: the conftest's
    writer process on the store at ``tmp_path/s``; returns once the write is visible."""
    def start(identifier: str, encoded_here: bool, before_bytes: float, before_commit: float):
        return writer_process(tmp_path / "s", identifier, encoded_here=encoded_here,
                              before_bytes=before_bytes, before_commit=before_commit)
    return start


@pytest.fixture
def looks(monkeypatch):
    """No periodic look for a minute; ``count(store)``: the store's looks at a write in
    flight, counted."""
    monkeypatch.setattr(disk_in_flight, "IN_FLIGHT_WATCHED_S", 60.0)

    def count(store):
        calls = []
        real = store.read_in_flight

        def read_in_flight(identifier, checksum=lambda version: True):
            calls.append(time.monotonic())
            return real(identifier, checksum)

        monkeypatch.setattr(store, "read_in_flight", read_in_flight)
        return calls
    return count


def staged_in_time(lk, identifier: str) -> bool:
    """PD's side: once ``lk`` has read the verified log at its start (before following
    it), ask for ``identifier``, in flight, and wait: staged within 10 s (not the
    minute of the periodic look)."""
    assert lk.start_verify_done.wait(30)
    t0 = time.monotonic()
    assert lk.request(identifier) is State.PENDING
    lk.wait([identifier], 20)
    return lk.is_ready(identifier) and time.monotonic() - t0 < 10


def test_a_reader_wakes_when_a_producer_here_vouches_for_the_bytes(tmp_path, writer, looks):
    """The bytes go in 0.3 s after the write is visible, the commit 30 s later: the
    reader, waiting from the start, wakes at the producer's record, loads the bytes from
    the temp file without hashing them, and looked a few times, not hundreds."""
    store = DiskStore(tmp_path / "s", fsync=False)
    calls = looks(store)
    proc = writer("e1", True, 0.3, 30)
    lk = make(store, load_timeout_s=90)
    try:
        assert staged_in_time(lk, "e1")
        assert tensor_bytes(lk.get_staged("e1")) == ARR.tobytes()
        assert proc.poll() is None and not store.contains("e1")  # still uncommitted
        assert len(calls) <= 5
        assert lk.verified.trusted_loads == 1  # the producer's record: no checksum
        assert lk.metrics.pending("in_flight_wait_seconds") >= 0.1  # the 0.3 s, counted
    finally:
        lk.close()


def test_a_reader_wakes_at_the_commit_of_a_write_nobody_vouched_for(tmp_path, writer, looks):
    """A write that records nothing (its bytes from elsewhere) is read once committed:
    the rename wakes the reader, which then loads the stored entry (hashed)."""
    store = DiskStore(tmp_path / "s", fsync=False)
    calls = looks(store)
    proc = writer("e2", False, 0.2, 0.5)
    lk = make(store, load_timeout_s=90)
    try:
        assert staged_in_time(lk, "e2")
        assert proc.wait(10) == 0 and store.contains("e2")
        assert tensor_bytes(lk.get_staged("e2")) == ARR.tobytes()
        assert len(calls) <= 5
        assert lk.verified.trusted_loads == 0
    finally:
        lk.close()


def test_a_reader_stops_waiting_when_the_writer_is_killed(tmp_path, writer, looks):
    """An encoder SIGKILLed while PD waits for its write: the kernel closes the temp
    file, which wakes the reader; the write is not in flight any more (its lock went
    with the process), so the item is a miss at once, not after the wait's bound."""
    store = DiskStore(tmp_path / "s", fsync=False)
    looks(store)
    proc = writer("e4", True, 60, 60)  # visible, no byte for a minute
    lk = make(store, load_timeout_s=90)
    try:
        assert lk.start_verify_done.wait(30)
        assert lk.request("e4") is State.PENDING
        time.sleep(0.2)  # the reader is waiting now
        t0 = time.monotonic()
        proc.kill()
        lk.wait(["e4"], 20)
        assert time.monotonic() - t0 < 10  # not the minute of the periodic look
        assert not lk.is_ready("e4") and not store.in_flight("e4")
    finally:
        lk.close()


def test_where_nothing_can_be_watched_the_reader_looks_every_millisecond(tmp_path, writer,
                                                                         monkeypatch):
    """No inotify (a limit reached, another kernel): the wait is the store default's
    sleep, and the reader still loads what the producer wrote."""
    monkeypatch.setattr(DirectoryWatch, "open", classmethod(lambda cls, watches: None))
    store = DiskStore(tmp_path / "s", fsync=False)
    calls = []
    real = store.read_in_flight
    monkeypatch.setattr(store, "read_in_flight",
                        lambda i, checksum=lambda v: True: calls.append(1) or real(i, checksum))
    writer("e3", True, 0.2, 30)
    lk = make(store, load_timeout_s=90)
    try:
        assert lk.start_verify_done.wait(30)  # (its log read at start, before following it)
        assert lk.request("e3") is State.PENDING
        lk.wait(["e3"], 20)
        assert lk.is_ready("e3")
        assert tensor_bytes(lk.get_staged("e3")) == ARR.tobytes()
        assert len(calls) > 5  # looked again and again in the 0.2 s
    finally:
        lk.close()


def test_a_directory_watch_wakes_on_another_processs_change_and_times_out_otherwise(tmp_path):
    assert DirectoryWatch.open([(str(tmp_path / "missing"), IN_CREATE)]) is None
    (tmp_path / "d").mkdir()
    with DirectoryWatch.open([(str(tmp_path / "d"), IN_CREATE | IN_MOVED_TO)]) as watch:
        t0 = time.monotonic()
        assert watch.wait(0.05) is False and time.monotonic() - t0 >= 0.04
        threading.Timer(0.1, lambda: subprocess.run(
            [sys.executable, "-c", f"open({str(tmp_path / 'd' / 'x')!r}, 'w').close()"])).start()
        assert watch.wait(30) is True  # the other process's file
        assert watch.wait(0.05) is False  # the events were read: nothing new
        (tmp_path / "y").write_text("")
        os.rename(tmp_path / "y", tmp_path / "d" / "y")
        assert watch.wait(0) is True and watch.wakes == 2
        (tmp_path / "d" / "z").write_text("")  # an event nobody reads before the close
        fd = watch.fd
    # closing keeps the instance for the next watch (closing one waits for the kernel),
    # without its watches or unread events
    (tmp_path / "e").mkdir()
    with DirectoryWatch.open([(str(tmp_path / "e"), IN_CREATE)]) as again:
        assert again.fd == fd
        assert again.wait(0.05) is False
        (tmp_path / "d" / "w").write_text("")  # the old directory: not watched any more
        assert again.wait(0.05) is False
        (tmp_path / "e" / "w").write_text("")
        assert again.wait(30) is True
