"""Per-process counter files: counts survive SIGKILL, dead processes are folded, reset.

Real processes: a child counts through an EntryLookup on a disk store and is killed with
SIGKILL mid-run; its counts are in ``read_counters`` and, after compaction, in
``counters.json`` with its file gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from encache.connectors.store import counters
from encache.connectors.store.disk.store import DiskStore

CHILD = r"""
import sys, time
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.lookup import EntryLookup
store = DiskStore(sys.argv[1])
lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600)  # never flushes
for _ in range(7):
    lk.count("hits")
lk.count("load_seconds", 0.25)
print("ready", flush=True)
time.sleep(600)
"""


def _child(root: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_counts_survive_sigkill_and_dead_files_are_folded(tmp_path):
    store = DiskStore(tmp_path / "s")
    store.add_counters({"hits": 1, "misses": 2})  # folded totals from earlier
    child = _child(tmp_path / "s")
    try:
        live = store.read_counters()
        assert live["hits"] == 8 and live["misses"] == 2 and live["load_seconds"] == 0.25
        files = list((tmp_path / "s" / ".encache" / "counters").glob("*.cnt"))
        assert len(files) == 1 and f"-{child.pid}-" in files[0].name  # alive: not folded
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    after = store.read_counters()  # folds the dead process's file
    assert after["hits"] == 8 and after["misses"] == 2 and after["load_seconds"] == 0.25
    assert not list((tmp_path / "s" / ".encache" / "counters").glob("*.cnt"))
    assert counters.read_json(tmp_path / "s" / ".encache" / "counters.json")["hits"] == 8


def test_many_dead_processes_do_not_grow_the_directory(tmp_path):
    root = tmp_path / "s"
    DiskStore(root)
    for _ in range(3):
        c = _child(root)
        os.kill(c.pid, signal.SIGKILL)
        c.wait(10)
    # each new process folded its dead predecessors when it opened its own file
    assert len(list((root / ".encache" / "counters").glob("*.cnt"))) == 1
    assert DiskStore(root).read_counters()["hits"] == 21
    assert not list((root / ".encache" / "counters").glob("*.cnt"))


def test_reset_zeroes_totals_without_touching_live_files(tmp_path):
    store = DiskStore(tmp_path / "s")
    child = _child(tmp_path / "s")
    try:
        store.add_counters({"misses": 3})
        assert store.read_counters()["hits"] == 7
        store.reset_counters()
        c = store.read_counters()
        assert c.get("hits", 0) == 0 and c.get("misses", 0) == 0
        live = store.live_counters()  # this process counts on after the reset
        live.add("hits", 2)
        assert store.read_counters()["hits"] == 2
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    assert store.read_counters()["hits"] == 2  # the dead child's 7 cancel its reset share


def test_counting_is_cheap_and_updated_is_a_max(tmp_path):
    store = DiskStore(tmp_path / "s")
    live = store.live_counters()
    t0 = time.perf_counter()
    for _ in range(10_000):
        live.add("hits")
    per_count = (time.perf_counter() - t0) / 10_000
    assert per_count < 50e-6, per_count  # no system call per count
    c = store.read_counters()
    assert c["hits"] == 10_000 and abs(c["updated"] - time.time()) < 60


REDIS_CHILD = r"""
import sys, time
from encache.connectors.store import open_store
from encache.connectors.lookup import EntryLookup
from encache.connectors.vllm.config import ConnectorConfig
cfg = ConnectorConfig.from_extra({"store": sys.argv[1]})  # the connector's defaults
store = open_store(sys.argv[1])
lk = EntryLookup(store, **cfg.lookup_options())
for _ in range(5):
    lk.count("hits")
print("ready", flush=True)
time.sleep(600)
"""


def test_redis_counters_flush_within_a_second_of_counting(redis_server):
    """Redis keeps batched counters (no per-count round trip): with the default flush
    period a SIGKILL loses at most the last 0.5 s; counts older than that are stored."""
    from encache.connectors.store import open_store

    url = redis_server.url_for(db=3)
    store = open_store(url)
    store.reset_counters()
    p = subprocess.Popen([sys.executable, "-c", REDIS_CHILD, url], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # > the default 0.5 s flush period (+ one tick)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    assert store.read_counters().get("hits") == 5
