"""DiskStore: the contract suite plus disk-only behaviour (layout, legacy, capacity, crashes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from encache.connectors.store import CorruptEntry, decode, open_store
from encache.connectors.store.disk.store import ENTRY_FILE, DiskStore
from encache.connectors.store.keys import to_name
from store_contract import StoreContract, blob


class TestDiskStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path):
        return DiskStore(tmp_path / "store")

    def make_store(self, store):
        return DiskStore(store.root)


def test_layout_is_example_connector_compatible(tmp_path):
    s = DiskStore(tmp_path)
    ident = "ab" * 32
    s.put(ident, blob(ident))
    path = tmp_path / ident / ENTRY_FILE
    assert path.is_file()
    import safetensors.numpy
    arr = safetensors.numpy.load_file(str(path))["ec_cache"]
    assert arr.shape == (64, 8) and arr.dtype == np.float16


def test_legacy_entry_is_listed_and_readable(tmp_path):
    """An entry written by ECExampleConnector (plain safetensors, no metadata)."""
    import safetensors.numpy
    ident = "cd" * 32
    (tmp_path / ident).mkdir()
    safetensors.numpy.save_file({"ec_cache": np.zeros((16, 4), np.float32)},
                                str(tmp_path / ident / ENTRY_FILE))
    s = DiskStore(tmp_path, create=False)
    [info] = list(s.scan())
    assert info.identifier == ident and info.legacy and info.error is None
    meta, data = decode(s.get(ident), identifier=ident)
    assert meta.legacy and meta.shape == (16, 4) and data.nbytes == 256


def test_empty_directory_is_not_an_entry(tmp_path):
    s = DiskStore(tmp_path)
    (tmp_path / ("ee" * 32)).mkdir()  # what ECExampleConnector.has_cache_item leaves
    assert list(s.identifiers()) == [] and list(s.scan()) == []
    assert not s.contains("ee" * 32) and s.get("ee" * 32) is None
    assert tmp_path / ("ee" * 32) in s.stray_files()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_something_else_where_an_entry_file_belongs_is_reported_never_waited_on(tmp_path,
                                                                                kind):
    """A FIFO there hung every scan (list, stats, verify, purge) and would have hung a
    consumer's load; a directory there stopped every scan with an error. Each is an
    entry with the problem ``not-a-file``: listed, verified, quarantined by a repair;
    a load of it is a miss, and the media hasher refuses a FIFO the same way."""
    from encache.connectors.lookup import EntryLookup
    from encache.connectors.store.ops.verify import verify_store
    from encache.connectors.vllm.hashing import MediaError, identify_file

    s = DiskStore(tmp_path / "s")
    good, bad = "a" * 64, "b" * 64
    s.put(good, blob(good))
    s.put(bad, blob(bad))
    path = s.entry_path(bad)
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    for use_index in (True, False, True):
        assert {e.identifier: e.error for e in s.scan(use_index=use_index)} == {
            good: None, bad: "not-a-file"}
    assert s.read_entry(bad) is None and s.read_verified(bad) is None
    look = EntryLookup(s, index_refresh_s=3600, load_threads=1)
    try:
        assert look.load_now(bad) is None and look.load_now(good) is not None
    finally:
        look.close()
    rep = verify_store(s, repair=True)
    assert [(f.identifier, f.reason) for f in rep.problems] == [(bad, "not-a-file")]
    assert rep.repair.quarantined == [bad] and [e.identifier for e in s.scan()] == [good]
    if kind == "fifo":
        os.mkfifo(tmp_path / "page.png")
        with pytest.raises(MediaError, match="not a regular file"):
            identify_file(tmp_path / "page.png", "org/model")


def test_missing_store_is_an_error_when_not_creating(tmp_path):
    from encache.connectors.store import StoreError
    with pytest.raises(StoreError, match="no store"):
        DiskStore(tmp_path / "nope", create=False)


def test_file_url(tmp_path):
    s = open_store(f"file://{tmp_path}/st")
    assert isinstance(s, DiskStore) and s.root == tmp_path / "st"
    assert open_store(f"file://localhost{tmp_path}/st").root == tmp_path / "st"


@pytest.mark.parametrize("url, message", [
    ("file://", "names a path on this host"),  # (was the current directory)
    ("file://tmp/st", "names a path on this host"),  # (was /st: the host dropped)
    ("redis://[::1", "bad store URL"), ("//[x", "bad store URL"),
    ("redis://u:secret@[::1/0", "bad store URL"),
])
def test_a_malformed_store_url_is_a_store_error(url, message):
    from encache.connectors.store import StoreError
    with pytest.raises(StoreError, match=message) as e:
        open_store(url)
    assert "secret" not in str(e.value)


def test_truncated_file_detected_from_header(tmp_path):
    s = DiskStore(tmp_path)
    s.put("t", blob("t"))
    p = s.entry_path("t")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 10])
    assert s.stat("t").error == "truncated"
    with pytest.raises(CorruptEntry) as e:
        decode(s.get("t"))
    assert e.value.reason == "truncated"


def test_capacity_evicts_least_recently_used(tmp_path):
    one = len(blob("x0"))  # (entries differ by a header padding step: their write times)
    s = DiskStore(tmp_path, max_bytes=one * 5 + one // 2, fsync=False, low_watermark=1.0)
    for i in range(5):
        s.put(f"x{i}", blob(f"x{i}"))
    past = time.time() - 3600
    for i in range(5):  # x0 oldest access ... x4 newest, then touch x0 as just used
        os.utime(s.entry_path(f"x{i}"), (past + i, past))
    os.utime(s.entry_path("x0"), (time.time(), past))
    s.put("x5", blob("x5"))
    present = set(s.identifiers())
    assert "x1" not in present and {"x0", "x2", "x3", "x4", "x5"} <= present
    assert s.used_bytes() <= s.max_bytes
    assert s.read_counters()["evictions"] == 1
    assert s.removals() == {"x1": "evicted"}  # a refresh leaves it out (removals.py)


def test_removal_log_is_bounded_and_reads_past_damage(tmp_path):
    """The removal log keeps the newest ``limit`` records (rewritten once it has grown
    to about twice that), a torn or hand-edited line is read past, and the counts per
    reason are kept under the log's version."""
    from encache.connectors.store.removals import RemovalLog

    s = DiskStore(tmp_path, fsync=False)
    log = RemovalLog(tmp_path / ".encache", limit=10)
    ids = [f"{n:064x}" for n in range(30)]  # (real identifiers: ~100-byte lines)
    for ident in ids:
        log.record([ident], "evicted")
        time.sleep(0.001)  # (records are ordered by their time)
    assert set(log.read()) == set(ids[20:])
    assert len(log.path.read_bytes().splitlines()) < 20  # rewritten, not grown
    with open(log.path, "ab") as f:
        f.write(b'["evicted", 1.0, "torn\n{not json\n')
    log.record(["after"], "older-than")
    assert log.read()["after"] == "older-than" and len(log.read()) == 10
    assert s.removals()["after"] == "older-than"  # (the store's own log: the same file)
    counts = s.removal_counts()  # counted once, then kept under the log's version
    assert counts["older-than"] == 1 and counts["evicted"] >= 9
    kept = tmp_path / ".encache" / "removals.counts"
    kept.write_bytes(kept.read_bytes().replace(b'"older-than":1', b'"older-than":7'))
    assert s.removal_counts()["older-than"] == 7  # read from the kept counts, not the log
    kept.write_bytes(b"{damaged")
    assert s.removal_counts() == counts
    log.record(["more"], "older-than")  # the log changed: counted again
    assert s.removal_counts()["older-than"] == 2


def test_capacity_persists_in_store_config(tmp_path):
    DiskStore(tmp_path, max_bytes=12345)
    assert DiskStore(tmp_path).max_bytes == 12345
    assert DiskStore(tmp_path).info().max_bytes == 12345


def test_an_opener_that_changes_the_capacity_says_so(tmp_path, caplog):
    """The capacity is the store's: one writer configured apart from the others changes it
    for all of them, which is logged (setting it the first time, or to the same value,
    is not)."""
    with caplog.at_level("WARNING", logger="encache.connectors.store.disk.store"):
        DiskStore(tmp_path, max_bytes=50_000)
        DiskStore(tmp_path, max_bytes=50_000)
        DiskStore(tmp_path)
        assert not caplog.records
        DiskStore(tmp_path, max_bytes=20_000)
    [record] = caplog.records
    assert "changed from 50,000 bytes to 20,000 bytes" in record.getMessage()
    assert str(tmp_path) in record.getMessage()
    assert DiskStore(tmp_path).max_bytes == 20_000


def test_get_records_access_time(tmp_path):
    s = DiskStore(tmp_path)
    s.put("a", blob("a"))
    old = time.time() - 7200
    os.utime(s.entry_path("a"), (old, old))
    s.get("a")
    assert s.stat("a").accessed > old + 3600


WRITER = r"""
import sys, numpy as np
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store import encode_parts
s = DiskStore(sys.argv[1])
print("go", flush=True)
for seed in range(10**6):   # rewrite a 32 MiB entry until killed
    arr = np.full((16 * 1024 * 1024,), seed % 1000, np.float16)
    s.put("victim", encode_parts("victim", arr.view(np.uint8), "F16", arr.shape))
"""


def test_sigkill_mid_write_leaves_no_readable_partial_entry(tmp_path):
    """Writers killed with SIGKILL mid-write (and at random points) leave a complete entry
    or none."""
    import random
    store = DiskStore(tmp_path / "s")
    rng = random.Random(0)
    saw_partial_write = False
    def writing() -> bool:  # a temp file with bytes in it (a live writer's or not)
        d = store.root / to_name("victim")
        return d.is_dir() and any(p.name.startswith(".tmp-") and p.stat().st_size > 0
                                  for p in d.iterdir())

    for attempt in range(4):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(store.root)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "go"
            if attempt % 2:  # at a random point of the write loop
                time.sleep(rng.uniform(0.2, 0.6))
            else:  # as soon as a temp file holds bytes: surely mid-write
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    with contextlib.suppress(FileNotFoundError):
                        if writing():
                            break
                    time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
        if writing():  # the dead writer's temp file: a stray at once, not in flight
            saw_partial_write = True
            assert any(p.name.startswith(".tmp-") for p in store.stray_files())
            assert not store.in_flight("victim")
        got = store.get("victim")
        if got is not None:  # the last committed version, complete and verified
            meta, data = decode(got, identifier="victim", verify=True)
            assert data.nbytes == 32 * 1024 * 1024
        assert [e.error for e in store.scan()] in ([], [None])
    assert saw_partial_write, "no kill landed mid-write; the test proved nothing"


def test_an_entry_read_goes_into_the_callers_buffer(tmp_path):
    """``load_mode: read`` (a network filesystem reads too): ``read_verified(into=...)``
    reads the entry into the caller's buffer (shared memory a worker process maps) and
    checks it in the same pass; a mapped store serves its mapping instead."""
    from encache.connectors.store.memfd import SharedBuffer, shared_buffer

    b = blob("rd", n=8192)
    for mode, shared in (("read", True), ("mmap", False)):
        s = DiskStore(tmp_path / mode, load_mode=mode)
        s.put("rd", b)
        buf, version, meta, offset, hashed = s.read_verified("rd", into=shared_buffer)
        assert isinstance(buf, SharedBuffer) is shared and bytes(buf) == b and hashed
