"""A damaged bookkeeping file of a disk store is ignored (and rewritten by its next
writer): never an error, never a lost entry, never a consumer that cannot start or a
background thread that stops.

Each case damages one file of a real store's ``.encache/`` directory the ways a crash, a
full disk, a hand edit or another program can: bytes that are not UTF-8, JSON of the
wrong type, values of the wrong type, a directory in the file's place. Then the CLI's
read commands run (exit 0, nothing lost) and a consumer starts, loads and counts.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from cli_support import H, invoke, populated
from encache.connectors.lookup import EntryLookup
from encache.connectors.store import open_store
from encache.connectors.store.disk import header_index
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.tiered import STATE_NOTE
from entries import put_entry

NOT_UTF8 = b"\xff{\xfe"


def _damage(path, content) -> None:
    """``content`` in place of the file ``path``: bytes, or ``dir`` for a directory."""
    if path.is_dir():
        os.rmdir(path)
    elif path.exists():
        path.unlink()
    if content == "dir":
        path.mkdir(parents=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def _reads_ok(root, n: int) -> None:
    """The read commands answer for all ``n`` entries; a consumer starts and loads."""
    for cmd in ("list", "stats", "verify", "size"):
        r = invoke(cmd, "--store", root)
        assert r.exit_code == 0, (cmd, r.output)
        assert "Error" not in r.output, (cmd, r.output)
    assert json.loads(invoke("stats", "--json", "--store", root).stdout)["entries"] == n
    listed = json.loads(invoke("list", "--json", "--store", root).stdout)["entries"]
    assert len(listed) == n and not any(e.get("error") for e in listed)
    look = EntryLookup(DiskStore(root), index_refresh_s=0.05, counters_flush_s=0.05,
                       load_threads=1)
    try:
        assert look.load_now(H[0]) is not None
        look.count("hits")
        time.sleep(0.3)  # refreshes, store samples and flushes run in its thread
        assert look._background.is_alive()
    finally:
        look.close()


@pytest.mark.parametrize("content", [
    NOT_UTF8, b"[1, 2]", b'{"max_bytes": "abc"}', b'{"max_bytes": 1e999}',
    b'{"max_bytes": -5}', b'{"max_bytes": true}', b'{"max_bytes": 1.5}', "dir"])
def test_a_config_without_a_positive_limit_sets_none_and_evicts_nothing(tmp_path, content):
    """A limit read as tiny would evict every entry at the next write (it did, for -5
    and true); a damaged file stopped every command and every store open."""
    root = tmp_path / "store"
    populated(root, legacy=False)
    _damage(root / ".encache" / "config.json", content)
    store = DiskStore(root)
    assert store.max_bytes is None
    before = store.count()
    put_entry(store, H[8])
    assert store.count() == before + 1  # nothing evicted
    _reads_ok(root, before + 1)


CHILD = r"""
import sys, time
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.lookup import EntryLookup
lk = EntryLookup(DiskStore(sys.argv[1]), index_refresh_s=3600, counters_flush_s=3600)
lk.count("hits", 3)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("content", [
    b'{"hits": "abc", "evictions": null, "misses": [1], "updated": "x", "saves": Infinity,'
    b' "loads": 2}', NOT_UTF8, b'"hits"'])
def test_counters_that_are_not_numbers_are_dropped(tmp_path, content):
    """Folding a SIGKILLed engine's counter file into a damaged ``counters.json`` raised
    in the next consumer's start; a string total killed the lookup's background thread
    (no more index refreshes), and a write that evicted then failed to count."""
    root = tmp_path / "store"
    populated(root, legacy=False)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    _damage(root / ".encache" / "counters.json", content)
    _reads_ok(root, 8)
    store = DiskStore(root)
    totals = store.read_counters()
    assert totals["hits"] == 4  # the dead engine's 3, the consumer's 1
    assert all(type(v) in (int, float) for v in totals.values())
    if content.startswith(b"{"):
        assert totals["loads"] == 2
    store = DiskStore(root, max_bytes=store.used_bytes())  # the next write evicts, then counts
    put_entry(store, H[8])
    assert store.stat(H[8]) is not None and store.read_counters()["evictions"] >= 1


def _rewrite_index(root, change) -> None:
    meta = root / ".encache"
    data = header_index._read(meta)
    assert data is not None
    change(data, header_index.load(meta))
    (meta / header_index.INDEX_FILE).write_bytes(pickle.dumps(data))


@pytest.mark.parametrize("change", [
    lambda d, r: d.update(records=pickle.dumps({k: 5 for k in r})),
    lambda d, r: d.update(records=pickle.dumps({k: (v[0],) for k, v in r.items()})),
    lambda d, r: d.update(records=pickle.dumps({k: (v[0], "info") for k, v in r.items()})),
    lambda d, r: d.update(records=pickle.dumps(
        {k: (v[0], v[1].__class__(v[1].identifier, "big", 7, None, None, None))
         for k, v in r.items()})),
    lambda d, r: d.update(summary=[1, 2]),
    lambda d, r: d.update(summary={"entries": "x"}),
    lambda d, r: d["summary"].update(bogus=1),
], ids=["record-int", "record-short", "record-str", "record-fields", "summary-list",
        "summary-partial", "summary-extra"])
def test_a_damaged_header_index_is_read_past_and_rewritten(tmp_path, change):
    """Its versions still matched the files, so a damaged record or summary was used, and
    every list, verify and stats failed the same way for good."""
    root = tmp_path / "store"
    populated(root, legacy=False)
    assert invoke("list", "--store", root).exit_code == 0  # writes the index
    _rewrite_index(root, change)
    _reads_ok(root, 8)
    assert invoke("list", "--store", root).exit_code == 0
    assert DiskStore(root).summary_if_unchanged() is not None  # rewritten whole


@pytest.mark.parametrize("line", [b'"ab\xff"\n', b"[" * 200_000 + b"\n", "dir"])
def test_a_damaged_journal_segment_cannot_tell_and_is_passed(tmp_path, line):
    """A line that is not UTF-8 or nests too deep, or a directory by a segment's name,
    raised from every read of the journal: a consumer that follows it (a network
    filesystem's) counted each refresh as a store failure, and its breaker stayed open."""
    root = tmp_path / "store"
    store = populated(root, legacy=False)
    cursor, _ = store.changes_since(None)
    segments = root / ".encache" / "journal"
    if line == "dir":
        (segments / "zzzzzzzzzzzzzzzzzzzz-h-1-dead.log").mkdir()
    else:
        name = next(p for p in segments.iterdir() if p.name.endswith(".log"))
        with open(name, "ab") as f:
            f.write(line)
    cursor, changed = store.changes_since(cursor)
    assert changed is None  # cannot tell: the caller re-checks what it holds
    put_entry(store, H[8])
    cursor, changed = store.changes_since(cursor)
    if line == "dir":
        assert changed is None
    else:
        assert changed == {H[8]}  # past the bad line
    _reads_ok(root, 9)


@pytest.mark.parametrize("note", [
    NOT_UTF8, b'"[1]"', b'{"remote": 1}', b'"{\\"remote\\": \\"R\\", \\"synced\\": null}"',
    b'"{\\"remote\\": \\"R\\", \\"synced\\": \\"x\\"}"',
    b'"{\\"remote\\": \\"R\\", \\"synced\\": 1, \\"cursor\\": {\\"t\\": \\"x\\"}}"',
    b'"{\\"remote\\": \\"R\\", \\"synced\\": 1, \\"cursor\\": {\\"s\\": [1]}}"', "dir"])
def test_a_damaged_local_tier_note_starts_the_tier_as_never_synced(tmp_path, note):
    """The tier's note (its last sync with the shared store) raised in the tier's open,
    or left a cursor its every sync then failed on: the tier served its copies as if the
    store were down, for good."""
    shared = tmp_path / "shared"
    populated(shared, legacy=False)
    tier_dir = tmp_path / "tier"
    tier = open_store(str(shared), local_tier=str(tier_dir))
    assert tier.read_entry(H[0]) is not None  # copied into the tier
    tier.close()
    content = note
    if isinstance(note, bytes) and b"R" in note:
        content = note.replace(b"R", f"{shared}#".encode())
    _damage(tier_dir / ".encache" / "notes" / STATE_NOTE, content)
    tier = open_store(str(shared), local_tier=str(tier_dir))
    try:
        assert tier.sync()
        DiskStore(shared).delete(H[0])
        assert tier.sync()
        assert tier.read_entry(H[0]) is None  # the purge reached the tier
    finally:
        tier.close()
    r = invoke("stats", "--store", shared, "--local-tier", tier_dir)
    assert r.exit_code == 0 and "Error" not in r.output, r.output
