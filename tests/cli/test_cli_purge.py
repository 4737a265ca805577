"""`encache purge`: plan -> dry-run -> confirm -> delete, on real disk stores."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from encache.cli import errors
from cli_support import ALL_IDS, H, file_sizes, invoke, one_line_error
from entries import put_entry


def remaining(store) -> set[str]:
    return set(store.identifiers())


def test_needs_a_selection(store):
    r = invoke("purge", "-s", store.root, "--yes")
    assert r.exit_code == errors.EXIT_USAGE
    assert "nothing selected" in one_line_error(r)
    r = invoke("purge", "-s", store.root, "--all", "--lora", "ad1", "--yes")
    assert r.exit_code == errors.EXIT_USAGE
    assert remaining(store) == ALL_IDS


def test_dry_run_shows_plan_and_bytes_and_deletes_nothing(store):
    sizes = file_sizes(store)
    r = invoke("purge", "-s", store.root, "--lora", "ad1", "--dry-run")
    assert r.exit_code == 0
    planned = {"ad1:" + H[3], "ad1:" + H[4], H[6]}
    for ident in planned:
        assert ident in r.stdout
    assert "Would delete 3 entries" in r.stdout
    from encache.connectors.store.units import human_bytes
    assert human_bytes(sum(sizes[i] for i in planned)) in r.stdout
    assert remaining(store) == ALL_IDS


def test_dry_run_json_plan(store):
    sizes = file_sizes(store)
    r = invoke("purge", "-s", store.root, "--model", "other", "--dry-run", "--json")
    d = json.loads(r.stdout)
    assert d["dry_run"] is True and d["result"] is None
    plan = d["plan"]
    assert plan["entries"] == 1 and plan["bytes"] == sizes[H[5]]
    [item] = plan["items"]
    assert item["identifier"] == H[5] and item["size"] == sizes[H[5]]
    assert item["action"] == "delete" and item["model"] == "other"
    assert remaining(store) == ALL_IDS


def test_refuses_without_terminal_and_without_yes(store):
    r = invoke("purge", "-s", store.root, "--all", input="y\n")  # stdin is not a TTY
    assert r.exit_code == errors.EXIT_ABORTED
    line = one_line_error(r)
    assert "refusing to delete 9 entries" in line and "--yes" in line
    assert remaining(store) == ALL_IDS


def test_yes_deletes_lora_by_prefix_and_metadata(store):
    sizes = file_sizes(store)
    r = invoke("purge", "-s", store.root, "--lora", "ad1", "--yes")
    assert r.exit_code == 0, r.output
    gone = {"ad1:" + H[3], "ad1:" + H[4], H[6]}
    assert remaining(store) == ALL_IDS - gone
    from encache.connectors.store.units import human_bytes
    assert f"Deleted 3 entries, freed {human_bytes(sum(sizes[i] for i in gone))}" in r.stdout
    assert not any((store.root / i).exists() for i in gone)  # directories tidied too


def test_model_and_older_than(store):
    r = invoke("purge", "-s", store.root, "--older-than", "7d", "-y", "--json")
    d = json.loads(r.stdout)
    assert d["result"]["deleted"] == 1 and remaining(store) == ALL_IDS - {H[7]}
    assert d["result"]["freed_bytes"] == d["plan"]["bytes"]
    r = invoke("purge", "-s", store.root, "-m", "m", "--lora", "ad1", "-y")
    assert r.exit_code == 0
    assert remaining(store) == ALL_IDS - {H[7], "ad1:" + H[3], "ad1:" + H[4], H[6]}


def test_older_than_is_recorded_as_a_policy_removal_the_others_are_not(store):
    """What --older-than deletes is remembered (precompute leaves it out of a refresh;
    stats counts it); --lora/--model/--all are explicit deletes, not remembered."""
    assert invoke("purge", "-s", store.root, "--older-than", "7d", "-y").exit_code == 0
    assert invoke("purge", "-s", store.root, "--lora", "ad1", "-y").exit_code == 0
    assert store.removals() == {H[7]: "older-than"}
    d = json.loads(invoke("stats", "-s", store.root, "--json").stdout)
    assert d["removed_by_policy"] == {"evicted": 0, "older-than": 1}
    r = invoke("stats", "-s", store.root)
    assert "Removed by policy" in r.stdout and "older-than 1" in r.stdout


def test_a_purge_while_another_runs_exits_5_silently_with_quiet(store):
    """Overlapping cron runs: the second purge exits 5 (one line; nothing with -q) and
    deletes nothing; the lock is the store's, so another process's purge holds it too."""
    with store.reopen().lock("purge"):
        r = invoke("purge", "-s", store.root, "--older-than", "7d", "--yes", "-q")
        assert (r.exit_code, r.stdout, r.stderr) == (errors.EXIT_LOCKED, "", "")
        r = invoke("purge", "-s", store.root, "--older-than", "7d", "--yes")
        assert r.exit_code == errors.EXIT_LOCKED and "locked by another purge" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert invoke("purge", "-s", store.root, "--all", "--dry-run").exit_code == 0
    assert remaining(store) == ALL_IDS and store.removals() == {}


def test_all(store):
    r = invoke("purge", "-s", store.root, "--all", "-y")
    assert r.exit_code == 0 and remaining(store) == set()
    assert [p.name for p in store.root.iterdir()] == [".encache"]


def test_nothing_to_purge(store):
    r = invoke("purge", "-s", store.root, "--lora", "nope", "-y")
    assert r.exit_code == 0 and "Nothing to purge" in r.stdout
    r = invoke("purge", "-s", store.root, "--lora", "nope", "--json")  # no --yes needed
    assert r.exit_code == 0 and json.loads(r.stdout)["plan"]["entries"] == 0


def test_long_plan_is_abbreviated_for_people(tmp_path):
    from encache.connectors.store.disk.store import DiskStore
    s = DiskStore(tmp_path / "big")
    for i in range(40):
        put_entry(s, f"{i:064x}", 4, i)
    r = invoke("purge", "-s", s.root, "--all", "--dry-run")
    assert "and 15 more" in r.stdout and "Would delete 40 entries" in r.stdout
    r = invoke("purge", "-s", s.root, "--all", "--dry-run", "-v")
    assert "more" not in r.stdout and f"{39:064x}" in r.stdout


def test_usage_errors_and_missing_store(store, tmp_path):
    assert invoke("purge", "-s", store.root, "--older-than", "old").exit_code == errors.EXIT_USAGE
    r = invoke("purge", "-s", tmp_path / "none", "--all", "-y")
    assert r.exit_code == errors.EXIT_STORE
    one_line_error(r)


# -- confirmation on a real terminal ---------------------------------------------------------

def _purge_on_tty(root, answer: bytes, *args) -> tuple[int, str]:
    """Run `encache purge` with a pseudo-terminal as stdin/stdout/stderr; answer the prompt."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "encache.cli", "purge", "-s", str(root), *args],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True,
                            env={**os.environ, "ENCACHE_DEBUG": "", "COLUMNS": "200"})
    os.close(slave)
    out, answered, deadline = b"", False, time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            if not answered and b"[y/N]" in out:
                os.write(master, answer)
                answered = True
            if proc.poll() is not None and not ready:
                break
        return proc.wait(timeout=30), out.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def test_confirm_declined_on_a_terminal(store):
    code, out = _purge_on_tty(store.root, b"n\n", "--lora", "ad1")
    assert "Delete 3 entries" in out, out
    assert code == errors.EXIT_ABORTED
    assert remaining(store) == ALL_IDS


def test_confirm_accepted_on_a_terminal(store):
    code, out = _purge_on_tty(store.root, b"y\n", "--lora", "ad1")
    assert code == 0, out
    assert "Deleted 3 entries" in out
    assert remaining(store) == ALL_IDS - {"ad1:" + H[3], "ad1:" + H[4], H[6]}


# -- a concurrent reader never sees a partial entry --------------------------------------------

READER = r"""
import sys, time
from encache.connectors.store import CorruptEntry, decode
from encache.connectors.store.disk.store import DiskStore
s = DiskStore(sys.argv[1], create=False)
ids = sys.argv[2].split(",")
whole = missing = bad = 0
first = True
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    present = 0
    for i in ids:
        b = s.get(i)
        if b is None:
            missing += 1
            continue
        try:
            decode(b, identifier=i, verify=True)
            whole += 1
            present += 1
        except CorruptEntry as e:
            bad += 1
            print("PARTIAL", i, e, file=sys.stderr)
    if first:
        print("READY", flush=True)
        first = False
    if present == 0:
        break
print(f"{whole} {missing} {bad}", flush=True)
"""


def test_purge_is_safe_against_a_concurrent_reader(tmp_path):
    from encache.connectors.store.disk.store import DiskStore
    s = DiskStore(tmp_path / "busy", fsync=False)
    ids = [f"{i:064x}" for i in range(150)]
    for i, ident in enumerate(ids):
        put_entry(s, ident, 2048, i)  # 32 KiB tensors: reads take long enough to overlap deletes
    reader = subprocess.Popen([sys.executable, "-c", READER, str(s.root), ",".join(ids)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "READY"
        r = invoke("purge", "-s", s.root, "--all", "--yes")
        assert r.exit_code == 0, r.output
        out, err = reader.communicate(timeout=90)
    finally:
        if reader.poll() is None:
            reader.kill()
    whole, missing, bad = map(int, out.split())
    assert bad == 0, err
    assert whole >= len(ids) and missing > 0  # it read them whole, then saw them vanish
    assert set(s.identifiers()) == set()


def test_quiet_for_cron(store):
    r = invoke("purge", "-s", store.root, "--older-than", "7d", "--yes", "-q")
    assert r.exit_code == 0 and r.stdout == "" and r.stderr == ""
    assert remaining(store) == ALL_IDS - {H[7]}
    r = invoke("purge", "-s", store.root, "--older-than", "7d", "--yes", "-q")
    assert r.exit_code == 0 and r.stdout == ""
