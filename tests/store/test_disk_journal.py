"""A disk store's change journal (``connectors/store/disk/journal.py``).

A reader that holds copies (a local tier in front of a shared directory, a consumer's
staged buffers on a network filesystem) learns what changed from per-writer segment
files instead of a ``stat`` per copy. Shown here with real files and real processes:
two writer processes at once, and two churning through segments, every change named
once; segments sealed (by rotation, at exit, not when killed), followed through seals
past a stale listing, removed and forgotten; every case where the journal cannot tell (a
wiped journal, a shrunk segment, a line that is not an identifier, a cursor too old)
answers None; evictions, quarantines and removals by raw name are journaled; a reader on
a read-only mount; a tier over a directory and a consumer on a network filesystem
re-check only what the journal names.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from encache.connectors.store.disk import journal as disk_journal
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.tiered import TieredStore
from store_contract import blob


def journal_dir(store: DiskStore) -> str:
    return os.path.join(store.root, ".encache", "journal")


def segments(store: DiskStore) -> list[str]:
    return sorted(n for n in os.listdir(journal_dir(store)) if n.endswith(".log"))


WRITER = r"""
import sys
sys.path[:0] = [{tests!r}]
from encache.connectors.store.disk.store import DiskStore
from store_contract import blob
s = DiskStore({root!r}, fsync=False)
tag = sys.argv[1]
for n in range(200):
    s.put(f"{{tag}}-{{n}}", blob(f"{{tag}}-{{n}}", n=4))
    if n % 3 == 0:
        s.delete(f"{{tag}}-{{n}}")
"""


def test_two_writer_processes_at_once_every_change_is_named(tmp_path):
    """Each writer appends to its own segment: no record is lost or torn between
    processes writing at the same time, and a reader named each identifier."""
    root = tmp_path / "shared"
    reader = DiskStore(root)
    cursor, changed = reader.changes_since(None)
    assert changed is None
    tests = os.path.dirname(os.path.dirname(__file__))
    script = WRITER.format(tests=tests, root=str(root))
    procs = [subprocess.Popen([sys.executable, "-c", script, tag]) for tag in ("a", "b")]
    seen: set[str] = set()
    while any(p.poll() is None for p in procs):
        cursor, changed = reader.changes_since(cursor)  # read while they write
        assert changed is not None
        seen |= changed
        time.sleep(0.01)
    assert all(p.returncode == 0 for p in procs)
    cursor, changed = reader.changes_since(cursor)
    seen |= changed
    assert seen == {f"{t}-{n}" for t in ("a", "b") for n in range(200)}
    assert len(segments(reader)) == 2
    assert reader.changes_since(cursor) == (cursor, set())


CHURN = r"""
import sys, time
sys.path[:0] = [{tests!r}]
from encache.connectors.store.disk import journal as disk_journal
disk_journal.SEGMENT_BYTES, disk_journal.ROTATE_S = 120, 0.05  # seal and start often
disk_journal.KEEP_S, disk_journal.SKEW_S = 1.0, 0.2  # remove what is 1 s untouched
from encache.connectors.store.disk.store import DiskStore
from store_contract import blob
s = DiskStore({root!r}, fsync=False)
tag = sys.argv[1]
for n in range(300):
    s.put(f"{{tag}}-{{n}}", blob(f"{{tag}}-{{n}}", n=4))
    if n % 50 == 0:
        s = s.reopen()  # a new handle: a new segment, the old one left unsealed
    time.sleep(0.006)
"""


def test_rotation_and_removal_under_churn_lose_no_change(tmp_path, monkeypatch):
    """Two writer processes sealing, starting and removing segments many times a second
    (and abandoning unsealed ones) while a reader follows: every change is named, and
    the reader never has to answer "cannot tell"."""
    monkeypatch.setattr(disk_journal, "KEEP_S", 1.0)
    monkeypatch.setattr(disk_journal, "SKEW_S", 0.2)
    root = tmp_path / "shared"
    reader = DiskStore(root)
    cursor, _ = reader.changes_since(None)
    tests = os.path.dirname(os.path.dirname(__file__))
    script = CHURN.format(tests=tests, root=str(root))
    procs = [subprocess.Popen([sys.executable, "-c", script, tag]) for tag in ("a", "b")]
    seen: set[str] = set()
    followed: set[str] = set()  # segments the reader's cursor held at some point
    unknown = 0
    last = time.monotonic()
    while any(p.poll() is None for p in procs):
        gap = time.monotonic() - last  # since the reader last looked
        cursor, changed = reader.changes_since(cursor)
        last = time.monotonic()
        followed |= set(cursor["s"])
        if changed is None:
            # only a reader that did not look for longer than a segment is kept may
            # have lost one (a machine too busy to run it): it then lists the store
            # (a cursor's time is renewed once half that window old)
            assert gap > (disk_journal.KEEP_S - disk_journal.SKEW_S) / 2, \
                f"cannot tell after {gap:.2f} s"
            unknown += 1
            seen |= {info.identifier for info in reader.scan()}
        else:
            seen |= changed
        time.sleep(0.02)
    assert all(p.returncode == 0 for p in procs)
    seen |= reader.changes_since(cursor)[1]
    assert seen == {f"{t}-{n}" for t in ("a", "b") for n in range(300)}
    assert len(followed - set(segments(reader))) >= 5, "segments were removed meanwhile"


def test_a_reader_of_a_quiet_store_keeps_following(tmp_path, monkeypatch):
    """Nothing written for longer than a segment is kept: a reader that looks regularly
    still answers what changed (nothing, then the next put), never "cannot tell"."""
    monkeypatch.setattr(disk_journal, "KEEP_S", 1.0)
    monkeypatch.setattr(disk_journal, "SKEW_S", 0.2)
    root = tmp_path / "quiet"
    writer, reader = DiskStore(root, fsync=False), DiskStore(root)
    writer.put("a", blob("a"))
    cursor, _ = reader.changes_since(None)
    deadline = time.monotonic() + 2.0  # 2.5 windows of KEEP_S - SKEW_S
    while time.monotonic() < deadline:
        cursor, changed = reader.changes_since(cursor)
        assert changed == set()
        time.sleep(0.1)
    writer.put("b", blob("b"))
    assert reader.changes_since(cursor)[1] == {"b"}


def test_sealed_segments_are_followed_then_skipped(tmp_path, monkeypatch):
    """A writer seals a full segment and starts the next; a reader follows it across
    the seal, and a sealed segment read to its end is not opened again."""
    monkeypatch.setattr(disk_journal, "SEGMENT_BYTES", 16)
    store = DiskStore(tmp_path / "s", fsync=False)
    cursor, _ = store.changes_since(None)
    for n in range(10):
        store.put(f"k{n}", blob(f"k{n}", n=4))
    assert len(segments(store)) >= 3
    cursor, changed = store.changes_since(cursor)
    assert changed == {f"k{n}" for n in range(10)}
    sealed = [n for n, off in cursor["s"].items() if off is None]
    assert len(sealed) == len(segments(store)) - 1
    opened = []
    real = disk_journal.DiskJournal._read_segment
    monkeypatch.setattr(disk_journal.DiskJournal, "_read_segment",
                        lambda self, name, off: opened.append(name) or real(self, name, off))
    store.delete("k3")
    cursor, changed = store.changes_since(cursor)
    assert changed == {"k3"} and not set(opened) & set(sealed)


def test_a_writer_that_exits_seals_its_segment_one_killed_does_not(tmp_path):
    """Readers stop opening the segment of a process that exited (or dropped its
    handle); a killed one's stays unsealed until it is removed."""
    root = tmp_path / "s"
    reader = DiskStore(root)
    cursor, _ = reader.changes_since(None)
    tests = os.path.dirname(os.path.dirname(__file__))
    code = ("import os, sys; sys.path[:0] = [{t!r}]\n"
            "from encache.connectors.store.disk.store import DiskStore\n"
            "from store_contract import blob\n"
            "s = DiskStore({r!r}, fsync=False); s.put(sys.argv[1], blob(sys.argv[1], n=4))\n"
            "if sys.argv[1] == 'killed': os.kill(os.getpid(), 9)\n").format(t=tests, r=str(root))
    for tag in ("exited", "killed"):
        subprocess.run([sys.executable, "-c", code, tag], timeout=60)
    cursor, changed = reader.changes_since(cursor)
    assert changed == {"exited", "killed"}
    assert sorted(off is None for off in cursor["s"].values()) == [False, True]
    store = DiskStore(root)
    store.put("dropped", blob("dropped", n=4))
    del store  # a handle dropped: its segment sealed too
    gc.collect()
    cursor, changed = reader.changes_since(cursor)
    assert changed == {"dropped"}
    assert sum(off is None for off in cursor["s"].values()) == 2


def test_a_reader_follows_a_seal_to_a_segment_its_listing_does_not_show(tmp_path,
                                                                      monkeypatch):
    """An NFS client's cached directory listing can miss a new segment: the old
    segment's seal names it, and the reader reads it all the same."""
    monkeypatch.setattr(disk_journal, "SEGMENT_BYTES", 16)
    store = DiskStore(tmp_path / "s", fsync=False)
    reader = store.reopen()
    store.put("a", blob("a", n=4))
    cursor, _ = reader.changes_since(None)
    listed = segments(store)
    for n in range(6):
        store.put(f"k{n}", blob(f"k{n}", n=4))
    monkeypatch.setattr(reader._journal, "_segments", lambda: listed)  # a stale listing
    cursor, changed = reader.changes_since(cursor)
    assert changed == {f"k{n}" for n in range(6)}
    assert set(cursor["s"]) - set(listed), "segments reached through seals"


def test_old_segments_are_removed_and_a_reader_that_saw_their_seal_goes_on(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(disk_journal, "SEGMENT_BYTES", 16)
    store = DiskStore(tmp_path / "s", fsync=False)
    reader = store.reopen()
    cursor, _ = reader.changes_since(None)
    for n in range(6):
        store.put(f"k{n}", blob(f"k{n}", n=4))
    cursor, changed = reader.changes_since(cursor)
    assert changed == {f"k{n}" for n in range(6)}
    old = segments(store)
    past = time.time() - disk_journal.KEEP_S - 60
    for name in old:
        os.utime(os.path.join(journal_dir(store), name), (past, past))
    for n in range(6, 12):  # rotations remove the old segments (the current one stays)
        store.put(f"k{n}", blob(f"k{n}", n=4))
    assert len(set(old) & set(segments(store))) <= 1
    cursor, changed = reader.changes_since(cursor)
    assert changed == {f"k{n}" for n in range(6, 12)}, "sealed segments it read may go"


def test_when_the_journal_cannot_tell_the_answer_is_none(tmp_path):
    store = DiskStore(tmp_path / "s", fsync=False)
    reader = store.reopen()
    store.put("a", blob("a", n=4))
    cursor, _ = reader.changes_since(None)
    # a segment read to its end and removed (KEEP_S after its last line): forgotten
    os.unlink(os.path.join(journal_dir(store), segments(store)[-1]))
    store.put("b", blob("b", n=4))  # the writer starts a new segment
    cursor2, changed = reader.changes_since(cursor)
    assert changed == {"b"}
    store.put("c", blob("c", n=4))
    assert reader.changes_since(cursor2)[1] == {"c"}
    # a segment that shrank (truncated by hand)
    path = os.path.join(journal_dir(store), segments(store)[-1])
    cursor, _ = reader.changes_since(cursor2)
    os.truncate(path, 0)
    assert reader.changes_since(cursor)[1] is None
    # a wiped journal (another id)
    cursor, _ = reader.changes_since(None)
    shutil.rmtree(journal_dir(store))
    store.put("d", blob("d", n=4))
    cursor, changed = reader.changes_since(cursor)
    assert changed is None
    # a line that is not an identifier
    path = os.path.join(journal_dir(store), segments(store)[-1])
    with open(path, "ab") as f:
        f.write(b"not json\n")
    cursor, changed = reader.changes_since(cursor)
    assert changed is None
    # a cursor that has not moved for longer than the journal keeps segments
    stale = dict(cursor, t=cursor["t"] - disk_journal.KEEP_S)
    assert reader.changes_since(stale)[1] is None


def test_a_line_being_written_is_read_when_whole(tmp_path):
    store = DiskStore(tmp_path / "s", fsync=False)
    store.put("a", blob("a", n=4))
    cursor, _ = store.changes_since(None)
    path = os.path.join(journal_dir(store), segments(store)[-1])
    with open(path, "ab") as f:
        f.write(json.dumps("half").encode()[:3])
    cursor, changed = store.changes_since(cursor)
    assert changed == set()
    with open(path, "ab") as f:
        f.write(json.dumps("half").encode()[3:] + b"\n")
    assert store.changes_since(cursor)[1] == {"half"}


def test_evictions_quarantines_and_raw_name_removals_are_journaled(tmp_path):
    from encache.connectors.store.ops.verify import verify_store

    one = len(blob("x0", n=256))
    store = DiskStore(tmp_path / "s", fsync=False, max_bytes=int(3.5 * one), eviction="fifo")
    reader = store.reopen()
    cursor, _ = reader.changes_since(None)
    for n in range(5):
        store.put(f"x{n}", blob(f"x{n}", n=256))
        time.sleep(0.01)
    cursor, changed = reader.changes_since(cursor)
    evicted = {f"x{n}" for n in range(5)} - set(store.identifiers())
    assert evicted and changed == {f"x{n}" for n in range(5)}
    # a corrupt entry quarantined by verify --repair
    kept = sorted(store.identifiers())[0]
    path = store.entry_path(kept)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    cursor, _ = reader.changes_since(cursor)
    verify_store(store, repair=True, grace=0)
    cursor, changed = reader.changes_since(cursor)
    assert changed == {kept} and not store.contains(kept)
    # an entry whose identifier only its header holds (a hashed name) removed unread
    long_id = "z" * 300
    store.put(long_id, blob(long_id, n=4))
    cursor, _ = reader.changes_since(cursor)
    name = next(p for p in os.listdir(store.root) if p.startswith("~h"))
    (store.root / name / "encoder_cache.safetensors").write_bytes(b"garbage")
    verify_store(store, repair=True, grace=0, quarantine=False)
    assert reader.changes_since(cursor)[1] is None, "cannot name it: re-check everything"


def test_a_read_only_reader_follows_the_journal(tmp_path):
    """A consumer on a read-only mount of the shared directory (a bind mount here)
    writes nothing and reads what writers elsewhere journal."""
    store = DiskStore(tmp_path / "s", fsync=False)
    store.put("a", blob("a", n=4))
    ro = tmp_path / "ro"
    ro.mkdir()
    for args in (["--bind", str(tmp_path / "s"), str(ro)], ["-o", "remount,bind,ro", str(ro)]):
        r = subprocess.run(["mount", *args], capture_output=True, text=True)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(ro)], capture_output=True)
            pytest.skip(f"mount not permitted here: {r.stderr.strip()}")
    try:
        reader = DiskStore(ro)  # as a consumer opens it
        assert reader.read_only
        cursor, _ = reader.changes_since(None)
        store.delete("a")
        store.put("b", blob("b", n=4))
        assert reader.changes_since(cursor)[1] == {"a", "b"}
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


def test_a_tier_over_a_directory_checks_only_what_changed(tmp_path, monkeypatch):
    """A local tier in front of a shared directory (a network filesystem's stand-in):
    a purge and a rewrite elsewhere drop those copies, and no other copy is checked."""
    shared = DiskStore(tmp_path / "shared", fsync=False)
    tier = TieredStore(DiskStore(tmp_path / "shared", fsync=False),
                       DiskStore(tmp_path / "tier"))
    try:
        for n in range(40):
            shared.put(f"k{n}", blob(f"k{n}", seed=n))
            assert tier.read_verified(f"k{n}") is not None
        tier.flush()
        assert tier.sync() and tier.tier.count() == 40
        checked = []
        real = tier.remote.unchanged
        monkeypatch.setattr(tier.remote, "unchanged", lambda e: checked.extend(e) or real(e))
        full = tier.stats["full_checks"]
        shared.delete("k1")
        shared.put("k2", blob("k2", seed=99, encoder_config="0123abcd0123abcd"))
        assert tier.sync()
        assert not tier.tier.contains("k1") and not tier.tier.contains("k2")
        assert tier.tier.count() == 38 and tier.stats["full_checks"] == full
        assert sorted(i for i, _, _ in checked) == ["k1", "k2"], "only what the journal named"
        tier._next_full = 0.0  # (JOURNAL_FULL_CHECK_S elapsed): a change it cannot see
        os.unlink(shared.entry_path("k3"))  # removed by hand, not journaled
        assert tier.sync() and not tier.tier.contains("k3")
        assert tier.stats["full_checks"] == full + 1
    finally:
        tier.close()


def test_a_consumer_on_a_network_filesystem_rechecks_only_what_changed(tmp_path, monkeypatch):
    """On a network filesystem (no version token) a consumer's staged entries are
    checked through the journal: a purge elsewhere drops its copy, the rest are not
    ``stat``-ed again; every ``JOURNAL_FULL_CHECK_S`` all of them are."""
    from encache.connectors.lookup import EntryLookup

    shared = DiskStore(tmp_path / "shared", fsync=False)
    for n in range(20):
        shared.put(f"k{n}", blob(f"k{n}", seed=n))
    store = DiskStore(tmp_path / "shared", fsync=False)
    store.fs_type = "nfs4"  # index_version: None, as on NFS
    lk = EntryLookup(store, index_refresh_s=0.05, counters_flush_s=3600)
    try:
        assert lk.wait_index(5)
        ids = [f"k{n}" for n in range(20)]
        for i in ids:
            lk.request(i)
        lk.wait(ids, timeout=10)
        assert all(i in lk.staging for i in ids)
        time.sleep(0.3)  # the loads' own check done
        checked = []
        real = store.unchanged
        monkeypatch.setattr(store, "unchanged", lambda e: checked.extend(e) or real(e))
        lk._next_full_check = time.monotonic() + 3600
        shared.delete("k1")
        deadline = time.time() + 5
        while "k1" in lk.staging and time.time() < deadline:
            time.sleep(0.05)
        assert "k1" not in lk.staging and "k2" in lk.staging
        assert {i for i, _, _ in checked} == {"k1"}
        os.unlink(shared.entry_path("k5"))  # by hand: only a full check sees it
        lk._next_full_check = 0.0
        deadline = time.time() + 5
        while "k5" in lk.staging and time.time() < deadline:
            time.sleep(0.05)
        assert "k5" not in lk.staging
    finally:
        lk.close()
