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


def test_warm_options_share_the_producer_settings_with_precompute():
    """One options object per job: WarmOptions carries precompute's ProducerSettings (one
    definition), and --compute-missing runs precompute with them as given."""
    from dataclasses import fields

    from encache.jobs.precompute import PrecomputeOptions, ProducerSettings
    from encache.jobs.warm import WarmOptions

    shared = {f.name for f in fields(ProducerSettings)}
    assert shared <= {f.name for f in fields(WarmOptions)}
    assert shared <= {f.name for f in fields(PrecomputeOptions)}
    options = WarmOptions("redis://h:1/0", source="/d", images=("a.png",), model="m",
                          compute=True, lora="ad", lora_path="/lora", max_model_len=64,
                          dtype="float32", engine_args={"enforce_eager": True}, tag="t")
    pre = options.precompute_options()
    assert (pre.model, pre.store, pre.refill_removed) == ("m", "redis://h:1/0", True)
    assert {k: getattr(pre, k) for k in shared} == {k: getattr(options, k) for k in shared}
    assert pre.encoder_config == options.encoder_config != WarmOptions("s").encoder_config


def test_warm_reports_its_phases_to_one_progress(disk, tmp_path):
    """warm() reports to the jobs' one Progress protocol: each step a phase, each entry
    an advance (the CLI draws the same object with PhaseProgress)."""
    from encache.jobs.warm import WarmOptions, warm

    dst = tmp_path / "dst"
    DiskStore(dst, fsync=False).close()
    seen = Recorded()
    summary = warm(WarmOptions(str(dst), source=str(disk.root), lora="adapterA"),
                   progress=seen)
    assert summary.copied == 3
    assert seen.calls == [("Copying", 3), 1, 1, 1]
    seen = Recorded()
    assert warm(WarmOptions(str(dst)), progress=seen).entries == 3
    assert seen.calls == [("Reading into the page cache", 3), 1, 1, 1]


def test_warm_options_are_checked_before_anything_opens(tmp_path):
    from encache.jobs.errors import EXIT_USAGE, EncacheError
    from encache.jobs.warm import WarmOptions, warm

    with pytest.raises(EncacheError, match="only applies with --compute-missing") as e:
        warm(WarmOptions(str(tmp_path / "nowhere"), tag="t"))
    assert e.value.exit_code == EXIT_USAGE and not (tmp_path / "nowhere").exists()
