"""A checksummed read of a file entry with the read-ahead helper (store.read_ahead): real
files, the real helper threads (C, _readpool.c). The bytes and every check are those of
a read on one thread; the helper never outlives the read (it never writes into a buffer
handed back); a load that finds no helper free reads on its own thread. A helper made
slow or late (its CPU busy) is a test hook of the C module (``delay_helpers``)."""

import contextlib
import json
import os
import struct
import threading
import time
from functools import partial

import numpy as np
import pytest

from encache.connectors.store import _readpool, read_ahead
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.entry import (FILE_CHUNK, HASH_PIECE, CorruptEntry, checksum,
                                            encode, read_verified)
from entries import rewrite_header


@pytest.fixture(autouse=True)
def helpers():
    """At least one helper, whatever the CPU count (one CPU has none by default); no
    helper delayed after the test."""
    _readpool.set_helpers(max(1, read_ahead.HELPERS))
    yield
    _readpool.delay_helpers(0, 0)
    _readpool.set_helpers(read_ahead.HELPERS)


def _helper_steps() -> int:
    return _readpool.counts()[1]


def _hold_every_helper(fd: int, size: int) -> list:
    """Jobs that keep every helper busy until closed (a load then finds none free)."""
    held = []
    while (job := read_ahead.start(fd, memoryview(bytearray(size)), size)) is not None:
        held.append(job)
    return held


def _blob(nbytes: int = 3 << 20, seed: int = 0, ident: str = "x", *,
          algo: str = "xxh3_128x512k", **header) -> bytes:
    """An entry of ``nbytes`` random tensor bytes checksummed with ``algo`` (a format of
    earlier entries: ``xxh3_128``), its JSON header written with ``header`` (json.dumps
    options: another writer's spacing)."""
    arr = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    blob = encode(ident, arr, "U8", arr.shape)
    if algo == "xxh3_128x512k" and not header:
        return blob
    value = checksum(arr, algo)
    return rewrite_header(blob, lambda h: h["__metadata__"].update(checksum=value), **header)


class _Spy:
    """read_ahead.start, counting the jobs it handed to a helper (``hashed``: the jobs
    that hash the pieces they read). ``chunk``: the step of a job that only reads (a
    hashing job's step is a piece of the checksum)."""

    def __init__(self, fd: int, chunk: int = read_ahead.CHUNK):
        self.fd, self.chunk, self.jobs, self.hashed = fd, chunk, 0, 0

    def __call__(self, view, size, **kw):
        if not kw.get("hash"):
            kw["chunk"] = self.chunk
        job = read_ahead.start(self.fd, view, size, **kw)
        self.jobs += job is not None
        self.hashed += job is not None and bool(kw.get("hash"))
        return job


def _read(path, size=None, *, chunk=read_ahead.CHUNK, identifier=None, buf=None,
          spy=None):
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size if size is None else size
        buf = bytearray(size) if buf is None else buf
        spy = _Spy(fd, chunk) if spy is None else spy
        spy.fd = fd
        meta, offset = read_verified(lambda view: os.readv(fd, [view]), size, buf,
                                     chunk=FILE_CHUNK, identifier=identifier, ahead=spy)
        return buf, meta, offset, spy.jobs
    finally:
        os.close(fd)


def _write(tmp_path, blob: bytes, name: str = "e") -> str:
    path = tmp_path / name
    path.write_bytes(blob)
    return str(path)


@pytest.mark.parametrize("chunk", [4096, 300_001, read_ahead.CHUNK])
@pytest.mark.parametrize("algo", ["xxh3_128x512k", "xxh3_128"])
def test_the_helper_reads_what_one_thread_would(tmp_path, chunk, algo):
    """An entry checksummed in pieces is hashed by the helper too (a hashing job); one
    with a single hash over its bytes (written before) by the load's thread alone."""
    blob = _blob(algo=algo)
    spy = _Spy(0, chunk)
    buf, meta, offset, jobs = _read(_write(tmp_path, blob), identifier="x", spy=spy)
    assert jobs == 1 and bytes(buf) == blob and meta.identifier == "x"
    assert offset == len(blob) - meta.data_bytes and meta.checksum.startswith(algo + ":")
    assert spy.hashed == (algo == "xxh3_128x512k")


@pytest.mark.parametrize("nbytes", [(1 << 20) - 9, 2 * HASH_PIECE, 5 * HASH_PIECE + 3])
def test_pieces_on_both_threads_at_any_tensor_size(tmp_path, nbytes):
    """Tensors of whole pieces and of a short last one; the pieces a load hashes are its
    front's, the rest the helper's, and the helper's steps are the pieces."""
    blob = _blob(nbytes)
    spy = _Spy(0)
    buf, meta, offset, jobs = _read(_write(tmp_path, blob), spy=spy)
    assert bytes(buf) == blob and meta.data_bytes == nbytes and spy.hashed == jobs == 1


@pytest.mark.parametrize("algo", ["xxh3_128x512k", "xxh3_128"])
@pytest.mark.parametrize("where", ["front", "before the split", "at the split",
                                   "helper's part", "last byte"])
def test_a_flipped_byte_anywhere_is_caught(tmp_path, where, algo):
    blob = bytearray(_blob(algo=algo))
    offset = len(blob) - (3 << 20)
    pieces = int(-(-(3 << 20) // HASH_PIECE) * read_ahead_front())
    split = (read_ahead.split(len(blob)) if algo == "xxh3_128" else
             offset + pieces * HASH_PIECE)
    at = {"front": 1000, "before the split": split - 1, "at the split": split,
          "helper's part": (split + len(blob)) // 2, "last byte": len(blob) - 1}[where]
    blob[at] ^= 1
    with pytest.raises(CorruptEntry) as e:
        _read(_write(tmp_path, bytes(blob)), chunk=256 << 10)
    assert e.value.reason == "checksum"


def read_ahead_front() -> float:
    from encache.connectors.store.entry import HASHED_FRONT
    return HASHED_FRONT


@pytest.mark.parametrize("header", [{"gap": 16}, {"separators": (", ", ": ")}],
                         ids=["tensor after a gap", "another writer's spacing"])
def test_an_entry_not_as_encache_lays_it_out_is_still_checked_whole(tmp_path, header):
    """The load takes a header's checksum for pieces and lets the helper hash from a
    peek at its bytes; a tensor that does not start right after the header (a gap
    before it), or a header the peek does not recognise, is hashed in order instead:
    still verified, and a flipped byte still caught."""
    blob = _blob(**header)
    buf, meta, offset, _ = _read(_write(tmp_path, blob))
    assert bytes(buf) == blob and offset == len(blob) - meta.data_bytes
    bad = bytearray(blob)
    bad[(offset + len(blob)) // 2] ^= 1
    with pytest.raises(CorruptEntry) as e:
        _read(_write(tmp_path, bytes(bad), "bad"))
    assert e.value.reason == "checksum"


def test_a_file_that_ends_early_is_truncated(tmp_path):
    """The size promised (an fstat a moment before) is more than the file holds: the
    helper's short read is the load's ``truncated``, not a hang."""
    blob = _blob()
    path = _write(tmp_path, blob[:-(1 << 20)])
    with pytest.raises(CorruptEntry) as e:
        _read(path, size=len(blob))
    assert e.value.reason == "truncated"


def test_a_header_longer_than_the_front_is_read_from_the_helpers_steps(tmp_path):
    arr = np.arange(1 << 18, dtype=np.float32)
    header = {"__metadata__": {"encache_format": "1", "identifier": "x",
                               "note": "n" * (700 << 10)},
              "ec_cache": {"dtype": "F32", "shape": [arr.size],
                           "data_offsets": [0, arr.nbytes]}}
    raw = json.dumps(header).encode()
    blob = struct.pack("<Q", len(raw)) + raw + arr.tobytes()
    assert 8 + len(raw) > read_ahead.split(len(blob))
    buf, meta, offset, jobs = _read(_write(tmp_path, blob), chunk=4096)
    assert jobs == 1 and bytes(buf) == blob and meta.extra["note"].startswith("nnn")
    assert offset == 8 + len(raw)


def test_an_error_on_the_helper_reaches_the_load(tmp_path):
    """The helper's read fails (here: its descriptor is a directory's): the load raises
    that OSError."""
    blob = _blob()
    path = _write(tmp_path, blob)
    fd, dfd = os.open(path, os.O_RDONLY), os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(IsADirectoryError):
            read_verified(lambda view: os.readv(fd, [view]), len(blob), bytearray(len(blob)),
                          chunk=FILE_CHUNK, ahead=partial(read_ahead.start, dfd))
    finally:
        os.close(fd)
        os.close(dfd)
    # the helper is free again: the next load has it
    assert _read(path)[3] == 1


def test_the_helper_is_done_before_the_load_returns(tmp_path):
    """A load that stops early (the wrong entry) ends the helper's job before it raises:
    nothing writes into the buffer afterwards."""
    blob = _blob(16 << 20)
    buf = bytearray(len(blob))
    with pytest.raises(CorruptEntry) as e:
        _read(_write(tmp_path, blob), identifier="y", buf=buf, chunk=4096)
    assert e.value.reason == "wrong-identifier"
    buf[:] = bytes(len(buf))
    time.sleep(0.05)
    assert not any(buf)


def test_a_helper_not_scheduled_costs_the_load_nothing(tmp_path):
    """The helper starts its job late (its CPU busy; here it sleeps first): the load
    reads the back part itself and returns at once, and the helper, when it runs, finds
    every step taken and touches nothing."""
    _readpool.delay_helpers(1.0, 0)
    runs0, steps0 = _readpool.counts()
    blob = _blob()
    buf = bytearray(len(blob))
    t0 = time.monotonic()
    _, meta, _, jobs = _read(_write(tmp_path, blob), buf=buf, identifier="x")
    assert time.monotonic() - t0 < 0.5 and jobs == 1 and bytes(buf) == blob
    buf[:] = bytes(len(buf))
    time.sleep(1.2)
    assert not any(buf)
    deadline = time.monotonic() + 5  # the late job ran, reading nothing
    while _readpool.counts()[0] == runs0 and time.monotonic() < deadline:
        time.sleep(0.05)
    runs, steps = _readpool.counts()
    assert runs > runs0 and steps == steps0


def test_a_load_right_after_another_has_the_helper(tmp_path):
    """The helper is free again once a load returned, not once its thread has left the
    job: loads back to back (a step's items) each have it."""
    path = _write(tmp_path, _blob())
    assert [_read(path, identifier="x")[3] for _ in range(50)] == [1] * 50


def test_closing_a_job_twice_returns_at_once_and_frees_the_helper_once(tmp_path):
    """A job ended before its steps were taken (a load that stopped early) and closed
    again (a caller's cleanup after its own): the second close waits for nothing, and the pool
    holds the helper once: the next two loads at once do not both get it."""
    blob = _blob()
    fd = os.open(_write(tmp_path, blob), os.O_RDONLY)
    try:
        buf = bytearray(len(blob))
        job = read_ahead.start(fd, memoryview(buf), len(blob))
        assert job is not None
        time.sleep(0.2)  # the helper reads its steps; the load stops early (no landed())
        job.close()
        done = threading.Event()
        threading.Thread(target=lambda: (job.close(), done.set()), daemon=True).start()
        assert done.wait(2), "a second close blocked"
        first = read_ahead.start(fd, memoryview(bytearray(len(blob))), len(blob))
        second = read_ahead.start(fd, memoryview(bytearray(len(blob))), len(blob))
        try:
            assert first is not None and (second is None or read_ahead.HELPERS > 1)
        finally:
            for j in (first, second):
                if j is not None:
                    j.close()
    finally:
        os.close(fd)


def test_a_late_helper_given_more_jobs_runs_each_and_touches_none(tmp_path):
    """The helper is given jobs faster than it gets scheduled (it sleeps before each):
    every load reads whole on its own thread meanwhile, the helper is given each next job
    at once, and it later runs the jobs it was given, in order, touching none of them."""
    _readpool.delay_helpers(0.2, 0)
    runs0, steps0 = _readpool.counts()
    blob = _blob()
    path = _write(tmp_path, blob)
    bufs = [bytearray(len(blob)) for _ in range(4)]
    for buf in bufs:
        assert _read(path, buf=buf, identifier="x")[3] == 1 and bytes(buf) == blob
        buf[:] = bytes(len(buf))
    deadline = time.monotonic() + 10
    while _readpool.counts()[0] < runs0 + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    runs, steps = _readpool.counts()
    assert runs >= runs0 + 4 and steps == steps0 and not any(any(b) for b in bufs)


def test_a_slow_helper_leaves_the_load_the_rest_of_its_part(tmp_path):
    """The helper stalls on the step it reads (its CPU taken away; here a sleep): the
    load reads every other step of the part itself, from the end, while it waits."""
    _readpool.delay_helpers(0, 0.5)
    steps0 = _helper_steps()
    blob = _blob()
    t0 = time.monotonic()
    buf, _, _, jobs = _read(_write(tmp_path, blob), chunk=256 << 10, identifier="x")
    took = time.monotonic() - t0
    assert jobs == 1 and bytes(buf) == blob
    # the back part is several steps; the helper read at most the one it was on when
    # the load ended (the load waits for that one: about its 0.5 s, not one per step)
    assert len(range(read_ahead.split(len(blob)), len(blob), 256 << 10)) > 2
    assert _helper_steps() - steps0 <= 1 and took < 1.5


def test_small_entries_and_no_free_helper_read_on_the_loads_thread(tmp_path):
    small = _blob(read_ahead.MIN_BYTES // 2)
    buf, _, _, jobs = _read(_write(tmp_path, small, "small"), identifier="x")
    assert jobs == 0 and bytes(buf) == small
    blob = _blob()
    path = _write(tmp_path, blob)
    fd = os.open(path, os.O_RDONLY)
    held = _hold_every_helper(fd, len(blob))  # every helper busy
    try:
        assert held
        buf, _, _, jobs = _read(path, identifier="x")
        assert jobs == 0 and bytes(buf) == blob
    finally:
        for job in held:
            job.close()
        os.close(fd)


def test_concurrent_loads_share_the_helpers(tmp_path):
    """More loads at once than helpers: each is read whole and checked, by a helper or
    on its own thread."""
    blobs = [_blob(2 << 20, seed=i, ident=f"e{i}") for i in range(6)]
    paths = [_write(tmp_path, b, f"e{i}") for i, b in enumerate(blobs)]
    errors, jobs = [], []

    def load(i):
        try:
            for _ in range(20):
                buf, meta, _, n = _read(paths[i], identifier=f"e{i}")
                assert bytes(buf) == blobs[i]
                jobs.append(n)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(jobs) == 20 * len(paths) and sum(jobs) > 0


class _Staging:
    """A device copy's reused staging (HostStaging): what makes a mapped-size entry be
    read rather than mapped."""
    stages = True

    def __call__(self, n):
        return np.empty(n, np.uint8)


@pytest.fixture
def store_jobs(monkeypatch):
    """The jobs stores start (read_ahead.start patched): ``(fd, given to a helper,
    hashing)`` per call, in order."""
    jobs = []
    real = read_ahead.start

    def spy(fd, *a, **kw):
        job = real(fd, *a, **kw)
        jobs.append((fd, job is not None, bool(kw.get("hash"))))
        return job
    monkeypatch.setattr(read_ahead, "start", spy)
    return jobs


def test_a_store_read_into_staging_uses_the_helper(tmp_path, store_jobs):
    store = DiskStore(tmp_path / "s", fsync=False)
    arr = np.random.default_rng(1).integers(0, 255, 3 << 20, dtype=np.uint8)
    blob = encode("k", arr, "U8", arr.shape)
    store.put("k", blob)
    buf, _, meta, offset, hashed = store.read_verified("k", into=_Staging())
    assert hashed and [given for _, given, _ in store_jobs] == [True]
    assert bytes(memoryview(buf)[offset:offset + meta.data_bytes]) == arr.tobytes()
    path = store.entry_path("k")
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(CorruptEntry) as e:
        store.read_verified("k", into=_Staging())
    assert e.value.reason == "checksum"
    # read_threads=1 (connector setting): the load reads alone, the same checks
    alone = DiskStore(tmp_path / "s", read_threads=1)
    assert alone.reopen().read_threads == 1
    with pytest.raises(CorruptEntry):
        alone.read_verified("k", into=_Staging())
    store.put("k", blob)
    buf, _, meta, offset, hashed = alone.read_verified("k", into=_Staging())
    assert hashed and [given for _, given, _ in store_jobs] == [True, True]  # (none more)
    assert bytes(memoryview(buf)[offset:offset + meta.data_bytes]) == arr.tobytes()


def test_a_job_dropped_without_close_is_ended_before_its_buffer_goes(tmp_path):
    """A job whose caller lost it (never closed: an exception path that forgot it) is
    ended when it is freed: the helper is done with the buffer and free again."""
    _readpool.delay_helpers(0, 0.2)
    blob = _blob()
    fd = os.open(_write(tmp_path, blob), os.O_RDONLY)
    try:
        job = read_ahead.start(fd, memoryview(bytearray(len(blob))), len(blob))
        assert job is not None and _readpool.busy_helpers() == 1
        del job
        assert _readpool.busy_helpers() == 0
    finally:
        os.close(fd)


def test_a_forked_child_has_helpers_of_its_own(tmp_path):
    """After fork() the child has none of the parent's threads: its pool starts empty and
    makes its own helper, and its load uses it."""
    blob = _blob()
    path = _write(tmp_path, blob)
    assert _read(path)[3] == 1  # the parent's helper exists
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if its load used a helper and was right
        code = 1
        try:
            runs0 = _readpool.counts()[0]
            buf, _, _, jobs = _read(path, identifier="x")
            deadline = time.monotonic() + 5  # (a parent's helper would never run it)
            while _readpool.counts()[0] == runs0 and time.monotonic() < deadline:
                time.sleep(0.01)
            code = 0 if jobs == 1 and bytes(buf) == blob and _readpool.counts()[0] > runs0 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_hashing_job_gives_each_steps_xxh3_whoever_read_it(tmp_path):
    """The C hash (vendored xxHash, the CPU's widest vector unit) is python-xxhash's,
    for the steps the helper read and those the load took from the end; the digests are
    there only once every step was yielded, and only for a job that hashes."""
    import xxhash
    data = np.random.default_rng(3).integers(0, 255, 5 * HASH_PIECE + 123, dtype=np.uint8)
    path = _write(tmp_path, data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        for delay in (0.0, 0.002):  # (a slow helper: the load reads steps from the end)
            _readpool.delay_helpers(0, delay)
            buf = bytearray(data.nbytes)
            job = read_ahead.start(fd, memoryview(buf), data.nbytes, begin=100,
                                   chunk=HASH_PIECE, hash=True)
            steps = []
            with pytest.raises(ValueError):
                job.digests()
            steps = list(job.landed())
            got = job.digests()
            job.close()
            want = b"".join(xxhash.xxh3_128_digest(data[a:b].tobytes()) for a, b in steps)
            assert got == want and bytes(buf[100:]) == data[100:].tobytes()
        plain = read_ahead.start(fd, memoryview(bytearray(data.nbytes)), data.nbytes)
        list(plain.landed())
        with pytest.raises(ValueError):
            plain.digests()
        plain.close()
    finally:
        os.close(fd)


def test_a_job_without_a_descriptor_only_hashes_the_bytes_it_is_given():
    """fd -1: the bytes are in the buffer already (a mapping, read-only will do); the job
    hashes its steps, whoever claims them, and reads nothing. A job with neither a
    descriptor nor a hash is refused."""
    import xxhash
    data = np.random.default_rng(4).integers(0, 255, 5 * HASH_PIECE + 77, dtype=np.uint8)
    frozen = data.tobytes()  # (read-only)
    for delay in (0.0, 0.002):  # (a slow helper: the caller hashes steps from the end)
        _readpool.delay_helpers(0, delay)
        job = read_ahead.start(-1, memoryview(frozen), len(frozen), begin=100,
                               chunk=HASH_PIECE, hash=True)
        steps = list(job.landed())
        got = job.digests()
        job.close()
        assert got == b"".join(xxhash.xxh3_128_digest(frozen[a:b]) for a, b in steps)
        assert steps[0][0] == 100 and steps[-1][1] == len(frozen)
    with pytest.raises(ValueError):
        _readpool.start(-1, bytearray(len(frozen)), 0, len(frozen), HASH_PIECE, False)


@pytest.mark.parametrize("where", [None, "front", "at the split", "last byte"])
def test_a_mapped_first_load_is_hashed_on_both_threads(tmp_path, store_jobs, where):
    """A CPU engine's first load of an entry maps it and hashes the mapping: the load
    hashes the front half of the pieces while a helper hashes the rest (faulting in
    their pages). A flipped byte anywhere is caught; ``read_threads`` 1 and an entry
    with one hash over its bytes are hashed on the load's thread alone."""
    blob = bytearray(_blob(3 << 20, seed=5, ident="k"))
    offset = len(blob) - (3 << 20)
    split = offset + int(6 * read_ahead_front()) * HASH_PIECE
    if where is not None:
        blob[{"front": offset + 10, "at the split": split,
              "last byte": len(blob) - 1}[where]] ^= 1
    DiskStore(tmp_path / "s", fsync=False).put("k", bytes(blob))
    store = DiskStore(tmp_path / "s", fsync=False)
    if where is None:
        buf, _, _, _, hashed = store.read_verified("k")
        assert hashed and not isinstance(buf, (bytearray, np.ndarray))  # (a mapping)
        assert bytes(buf) == bytes(blob)
    else:
        with pytest.raises(CorruptEntry) as e:
            store.read_verified("k")
        assert e.value.reason == "checksum"
    assert store_jobs == [(-1, True, True)]
    alone = DiskStore(tmp_path / "s", fsync=False, read_threads=1)
    with pytest.raises(CorruptEntry) if where else contextlib.nullcontext():
        alone.read_verified("k")
    assert len(store_jobs) == 1
    if where is None:  # an entry written with one xxh3 over its bytes
        DiskStore(tmp_path / "s", fsync=False).put("k", _blob(3 << 20, algo="xxh3_128",
                                                              ident="k"))
        assert DiskStore(tmp_path / "s", fsync=False).read_verified("k")[4]
        assert len(store_jobs) == 1


def test_a_read_that_does_not_hash_is_split_too(tmp_path, store_jobs):
    """A version that needs no hash, read into a device copy's staging (a producer on
    this host vouched for it), is read on two threads all the same: a job that only
    reads; ``read_threads`` 1 reads alone."""
    blob = _blob(3 << 20, seed=6, ident="k")
    DiskStore(tmp_path / "s", fsync=False).put("k", blob)
    store = DiskStore(tmp_path / "s", fsync=False)
    buf, _, _, _, hashed = store.read_verified("k", lambda version: False, into=_Staging())
    assert not hashed and [(given, hashing) for _, given, hashing in store_jobs] == [
        (True, False)]
    assert bytes(buf) == blob
    DiskStore(tmp_path / "s", read_threads=1).read_verified("k", lambda version: False,
                                                            into=_Staging())
    assert len(store_jobs) == 1
