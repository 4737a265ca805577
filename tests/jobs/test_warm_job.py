"""The warm job's library parts (``encache.jobs.warm``) without the CLI: promote
between two real disk stores, the page-cache read, selection counts."""

from __future__ import annotations

import os
import time

import pytest

from encache.connectors.media import unreadable_reason
from encache.connectors.store.disk.store import DiskStore
from encache.jobs.warm import WarmSummary, count_selected, promote, read_into_page_cache
from store_contract import blob

BASE = [f"{i:064x}" for i in range(4)]
LORA = [f"adapterA:{i:064x}" for i in range(10, 13)]


class Recorded:
    """A :class:`encache.jobs.progress.Progress` that records what it is told."""

    def __init__(self):
        self.calls: list = []

    def start(self, phase, total):
        self.calls.append((phase, total))

    def advance(self, n, failed=None, phase=None):
        self.calls.append(n if failed is None else (n, failed))


@pytest.fixture
def disk(tmp_path):
    s = DiskStore(tmp_path / "src", fsync=False)
    for i in BASE + LORA:
        s.put(i, blob(i, seed=len(i)))
    return s


def test_promote_copies_one_lora_and_skips_what_is_there(disk, tmp_path):
    dst = DiskStore(tmp_path / "dst", fsync=False)
    dst.put(LORA[0], disk.get(LORA[0]))
    summary = WarmSummary(mode="copy", store=dst.url, source=disk.url, lora="adapterA")
    ticks = Recorded()
    ticks.start("Copying", 3)
    promote(disk, dst, None, summary, lora="adapterA", progress=ticks)
    assert (summary.copied, summary.skipped, summary.failed) == (2, 1, 0)
    assert sorted(dst.identifiers()) == sorted(LORA)
    assert summary.bytes == sum(len(disk.get(i)) for i in LORA[1:])
    assert ticks.calls == [("Copying", 3), 1, 1, 1]
    assert count_selected(disk, None, "adapterA") == 3 and count_selected(disk, None, None) == 7


def test_promote_reports_a_missing_identifier_with_its_file(disk, tmp_path):
    dst = DiskStore(tmp_path / "dst", fsync=False)
    gone = f"{99:064x}"
    summary = WarmSummary(mode="copy", store=dst.url, source=disk.url)
    promote(disk, dst, [BASE[0], gone], summary, paths={gone: "/img/x.png"})
    assert summary.copied == 1
    assert summary.failures == [{"identifier": gone, "path": "/img/x.png", "reason": "missing"}]


def test_read_into_page_cache_does_not_touch_atime(disk):
    old = time.time() - 5 * 86400
    p = disk.entry_path(BASE[1])
    os.utime(p, (old, old))
    summary = WarmSummary(mode="page-cache", store=disk.url)
    missing = f"{98:064x}"
    read_into_page_cache(disk, [BASE[1], missing], summary)
    assert summary.entries == 1 and summary.bytes == p.stat().st_size
    assert [f["identifier"] for f in summary.failures] == [missing]
    assert abs(os.stat(p).st_atime - old) < 1


def test_unreadable_reason_is_one_short_line():
    e = OSError("cannot identify image file <_io.BytesIO object at 0x7f00deadbeef>\nmore")
    assert unreadable_reason(e) == "not a readable image (cannot identify image file more)"
    assert len(unreadable_reason(ValueError("x" * 1000))) == 300
