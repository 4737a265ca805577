"""`encache verify [--repair]` finding real damage in real disk stores."""

from __future__ import annotations

import json
import os
import time

import pytest

from encache.cli import errors
from encache.connectors.store.disk.store import DiskStore
from cli_support import H, file_sizes, invoke, one_line_error, populated, rewrite_header
from entries import put_entry


def verify(root, *extra):
    r = invoke("verify", "-s", root, "--json", *extra)
    return r, json.loads(r.stdout)


def reasons(d, key="problems") -> dict[str, str]:
    return {f["identifier"]: f["reason"] for f in d[key]}


@pytest.fixture
def clean(tmp_path):
    return populated(tmp_path / "clean", legacy=False)


def test_clean_store_exits_zero(clean):
    r, d = verify(clean.root)
    assert r.exit_code == errors.EXIT_OK
    assert d["clean"] is True and d["problems"] == [] and d["checked"] == 8
    assert d["bytes_checked"] == sum(file_sizes(clean).values())
    r = invoke("verify", "-s", clean.root)
    assert r.exit_code == 0 and "clean" in r.stdout


def test_legacy_entry_is_a_warning_not_a_failure(store):
    r, d = verify(store.root)
    assert r.exit_code == errors.EXIT_OK
    assert reasons(d, "warnings") == {H[8]: "legacy"}


def test_truncated_file(clean):
    p = clean.entry_path(H[0])
    p.write_bytes(p.read_bytes()[:-100])
    r, d = verify(clean.root)
    assert r.exit_code == errors.EXIT_PROBLEMS
    assert reasons(d) == {H[0]: "truncated"}


def test_bit_flipped_tensor(clean):
    p = clean.entry_path(H[1])
    data = bytearray(p.read_bytes())
    data[-5] ^= 0x10  # one bit in the tensor bytes: only the checksum can tell
    p.write_bytes(bytes(data))
    r, d = verify(clean.root)
    assert r.exit_code == errors.EXIT_PROBLEMS
    assert reasons(d) == {H[1]: "checksum"}
    assert "checksum" in invoke("verify", "-s", clean.root).stdout


def test_wrong_shape_entry(clean):
    p = clean.entry_path(H[2])

    def halve(h):
        h["ec_cache"]["shape"] = [16, 4]  # 16 x 8 F16 stored, header claims 16 x 4
    p.write_bytes(rewrite_header(p.read_bytes(), halve))
    r, d = verify(clean.root)
    assert r.exit_code == errors.EXIT_PROBLEMS
    assert reasons(d) == {H[2]: "wrong-shape"}


def test_wrong_identifier(clean):
    good = clean.get(H[0])
    clean.put(H[1], bytes(good))  # H[0]'s entry stored under H[1]'s name
    r, d = verify(clean.root)
    assert r.exit_code == errors.EXIT_PROBLEMS
    assert reasons(d) == {H[1]: "wrong-identifier"}


def test_several_problems_reported_each(clean):
    p = clean.entry_path(H[0])
    p.write_bytes(p.read_bytes()[:-1])
    p = clean.entry_path(H[1])
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    r, d = verify(clean.root)
    assert reasons(d) == {H[0]: "truncated", H[1]: "checksum"}
    r = invoke("verify", "-s", clean.root)
    assert r.exit_code == errors.EXIT_PROBLEMS
    assert H[0] in r.stdout and H[1] in r.stdout and "2 problem(s)" in r.stdout


def test_model_consistency(clean):
    r, d = verify(clean.root)
    assert [f["reason"] for f in d["info"]] == ["mixed-models"]
    r, d = verify(clean.root, "--model", "m")
    assert r.exit_code == errors.EXIT_PROBLEMS
    assert reasons(d) == {H[5]: "wrong-model"}
    r, d = verify(clean.root, "--model", "other")
    assert len(d["problems"]) == 7


def test_a_repair_for_a_model_no_entry_was_made_for_removes_none_of_them(clean):
    """A mistyped ``--model`` (or a cron job's unset variable) flagged every entry as
    made for another model, and the repair then removed every one. With no entry made
    for the model named, wrong-model entries are reported and kept (a warning says so);
    other damage is still repaired."""
    before = file_sizes(clean)
    r, d = verify(clean.root, "--model", "org/mistyped", "--repair", "--delete")
    assert r.exit_code == errors.EXIT_PROBLEMS and len(d["problems"]) == 8
    assert "no-entry-for-model" in reasons(d, "warnings").values()
    assert d["repair"]["deleted"] == 0 and file_sizes(clean) == before
    _damage(clean)
    r, d = verify(clean.root, "--model", "org/mistyped", "--repair", "--delete")
    assert d["repair"]["deleted"] == 2 and len(file_sizes(clean)) == 6
    r, d = verify(clean.root, "--model", "m", "--repair", "--delete")  # some are for "m"
    assert d["repair"]["deleted"] == 1 and H[5] not in file_sizes(clean)


def test_lora_mismatch(clean):
    put_entry(clean, "ad2:" + H[0], lora="ad3")
    r, d = verify(clean.root)
    assert reasons(d) == {"ad2:" + H[0]: "wrong-lora"}


def test_stray_files_are_warnings_and_respect_grace(clean):
    tmp = clean.root / H[0] / ".tmp-crashed"
    tmp.write_bytes(b"partial")
    (clean.root / ("ee" * 32)).mkdir()  # what ECExampleConnector.has_cache_item leaves
    r, d = verify(clean.root)
    assert r.exit_code == 0
    assert reasons(d, "warnings") == {str(clean.root / ("ee" * 32)): "stray"}  # tmp is young
    old = time.time() - 7200
    os.utime(tmp, (old, old))
    r, d = verify(clean.root)
    assert set(reasons(d, "warnings")) == {str(tmp), str(clean.root / ("ee" * 32))}


def _damage(s):
    p = s.entry_path(H[0])
    p.write_bytes(p.read_bytes()[:-3])
    p = s.entry_path(H[1])
    data = bytearray(p.read_bytes())
    data[-2] ^= 4
    p.write_bytes(bytes(data))
    (s.root / H[2] / ".tmp-crashed").write_bytes(b"x")
    (s.root / ("ee" * 32)).mkdir()


def test_repair_quarantines_bad_entries_and_removes_strays(clean):
    _damage(clean)
    before = {i: bytes(clean.get(i)) for i in (H[2], H[5], "ad1:" + H[3])}
    r = invoke("verify", "-s", clean.root, "--repair", "--grace", "0s")
    assert r.exit_code == errors.EXIT_PROBLEMS  # problems were found (and fixed)
    assert "quarantined 2 entries" in r.stdout and "removed 2 stray" in r.stdout
    q = clean.root / ".encache" / "quarantine"
    assert sorted(p.name.split(".")[0] for p in q.iterdir()) == sorted([H[0], H[1]])
    assert not (clean.root / H[0]).exists() and not (clean.root / ("ee" * 32)).exists()
    assert not (clean.root / H[2] / ".tmp-crashed").exists()
    assert {i: bytes(clean.get(i)) for i in before} == before  # good entries untouched
    r, d = verify(clean.root, "--grace", "0s")
    assert r.exit_code == 0 and d["warnings"] == [] and d["checked"] == 6
    assert H[0] not in invoke("list", "-s", clean.root, "-q").stdout.split()


def test_repair_json_and_delete_mode(clean):
    _damage(clean)
    r, d = verify(clean.root, "--repair", "--delete", "--grace", "0")
    assert r.exit_code == errors.EXIT_PROBLEMS
    rep = d["repair"]
    assert rep["deleted"] == 2 and rep["quarantined"] == 0 and rep["removed_stray"] == 2
    assert rep["freed_bytes"] > 0 and rep["failed"] == []
    assert not (clean.root / ".encache" / "quarantine").exists()
    assert verify(clean.root)[0].exit_code == 0


def test_repair_of_a_clean_store_does_nothing(clean):
    r, d = verify(clean.root, "--repair")
    assert r.exit_code == 0 and d["repair"]["deleted"] == 0 and d["repair"]["quarantined"] == 0
    assert len(file_sizes(clean)) == 8


def test_repair_that_cannot_finish_exits_partial(clean):
    _damage(clean)
    (clean.root / ".encache" / "quarantine").write_text("in the way")  # a file, not a dir
    r, d = verify(clean.root, "--repair")
    assert r.exit_code == errors.EXIT_PARTIAL
    assert len(d["repair"]["failed"]) == 2


def test_repair_leaves_an_entry_rewritten_since_the_check(clean):
    """The repair re-checks each entry just before removing it."""
    from encache.connectors.store.ops.verify import still_bad
    _damage(clean)
    check = still_bad(clean, None)
    assert check(H[0]) is True
    put_entry(clean, H[0])  # a producer rewrote it in the meantime
    assert check(H[0]) is False


def test_verify_reads_do_not_count_as_a_use(clean):
    """Reading whole entries must not refresh their access time (LRU clock, --older-than)."""
    from encache.connectors.store.ops.verify import read_untracked
    old = time.time() - 5 * 86400
    p = clean.entry_path(H[0])
    os.utime(p, (old, old))
    assert read_untracked(clean, H[0]) == p.read_bytes()
    os.utime(p, (old, old))  # (reading it here, the test itself may have bumped it)
    read_untracked(clean, H[0])
    assert abs(os.stat(p).st_atime - old) < 1


def test_verify_does_not_count_as_a_use(clean):
    old = time.time() - 5 * 86400
    p = clean.entry_path(H[0])
    os.utime(p, (old, old))
    assert invoke("verify", "-s", clean.root).exit_code == 0
    assert abs(os.stat(p).st_atime - old) < 1


def test_threads_option_and_usage_errors(clean):
    assert verify(clean.root, "-j", "1")[1]["checked"] == 8
    assert invoke("verify", "-s", clean.root, "-j", "0").exit_code == errors.EXIT_USAGE
    assert invoke("verify", "-s", clean.root, "--grace", "soon").exit_code == errors.EXIT_USAGE


def test_missing_store(tmp_path):
    r = invoke("verify", "-s", tmp_path / "none")
    assert r.exit_code == errors.EXIT_STORE
    one_line_error(r)


def test_empty_store(tmp_path):
    DiskStore(tmp_path / "e")
    r, d = verify(tmp_path / "e")
    assert r.exit_code == 0 and d["checked"] == 0


def test_quiet_clean_verify_prints_nothing(store):
    r = invoke("verify", "-s", store.root, "-q")  # a legacy warning, but clean
    assert r.exit_code == 0 and r.stdout == "" and r.stderr == ""
    p = store.entry_path(H[0])
    p.write_bytes(p.read_bytes()[:-1])
    r = invoke("verify", "-s", store.root, "-q")
    assert r.exit_code == errors.EXIT_PROBLEMS and H[0] in r.stdout
