"""Delete plans (build -> execute) behind `purge` and `verify --repair`, on real disk stores."""

from __future__ import annotations

import pytest

from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.ops.plan import build_purge_plan, build_repair_plan, execute
from encache.connectors.store.units import format_age, parse_age, parse_size
from encache.connectors.store.ops.scanning import EntryFilter
from cli_support import ALL_IDS, H, file_sizes, populated


class FlakyDisk(DiskStore):
    """A disk store whose delete fails for one identifier (a permission problem, say)."""

    def delete(self, identifier):
        if identifier == H[1]:
            raise PermissionError(13, "Permission denied")
        return super().delete(identifier)


class BulkDisk(DiskStore):
    calls: list
    supports_batch = True  # declared: execute() must then use delete_many

    def delete_many(self, identifiers, *, per_item=False):
        self.calls = getattr(self, "calls", []) + [list(identifiers)]
        res = [DiskStore.delete(self, i) for i in identifiers]
        return res if per_item else sum(res)


def test_plan_needs_a_selection(tmp_path):
    s = populated(tmp_path / "s")
    with pytest.raises(ValueError):
        build_purge_plan(s, EntryFilter(), display_url="x")


def test_plan_is_data_and_execute_reports(tmp_path):
    s = populated(tmp_path / "s")
    sizes = file_sizes(s)
    plan = build_purge_plan(s, EntryFilter(model="m"), display_url="x")
    assert plan.entries == 7 and plan.bytes == sum(sizes[i.identifier] for i in plan.items)
    assert set(s.identifiers()) == ALL_IDS  # building changes nothing
    res = execute(plan, s)
    assert len(res.deleted) == 7 and res.freed_bytes == plan.bytes and res.ok
    res = execute(plan, s)  # again: everything already gone
    assert res.deleted == [] and len(res.missing) == 7 and res.freed_bytes == 0


def test_failures_are_reported_not_raised(tmp_path):
    populated(tmp_path / "s")
    s = FlakyDisk(tmp_path / "s")
    plan = build_purge_plan(s, None, display_url="x", everything=True)
    res = execute(plan, s)
    assert [i for i, _ in res.failed] == [H[1]] and "Permission denied" in res.failed[0][1]
    assert not res.ok and set(s.identifiers()) == {H[1]}
    assert res.freed_bytes == plan.bytes - next(i.size for i in plan.items if i.identifier == H[1])


def test_bulk_delete_is_used_when_the_backend_has_it(tmp_path):
    populated(tmp_path / "s")
    s = BulkDisk(tmp_path / "s")
    plan = build_purge_plan(s, EntryFilter(lora="ad1"), display_url="x")
    s.delete("ad1:" + H[3])  # vanishes between plan and execution
    res = execute(plan, s)
    assert len(s.calls) == 1 and sorted(s.calls[0]) == sorted(i.identifier for i in plan.items)
    assert sorted(res.deleted) == sorted(["ad1:" + H[4], H[6]]) and res.missing == ["ad1:" + H[3]]


def test_repair_plan_quarantines_on_disk_only(tmp_path):
    s = populated(tmp_path / "s")
    bad = [(s.stat(H[0]), "checksum")]
    assert build_repair_plan(s, bad, display_url="x").items[0].action == "quarantine"
    assert build_repair_plan(s, bad, display_url="x", quarantine=False).items[0].action == "delete"


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("12h", 43200),
                                           ("7d", 604800), ("2w", 1209600), ("45", 45),
                                           ("1.5h", 5400), ("7D", 604800)])
def test_parse_age(text, seconds):
    assert parse_age(text) == seconds


@pytest.mark.parametrize("text", ["", "7 days", "d", "-1d", "1y", "7dd"])
def test_parse_age_rejects(text):
    with pytest.raises(ValueError):
        parse_age(text)


@pytest.mark.parametrize("text, n", [("500M", 500 << 20), ("50G", 50 << 30), ("1.5KiB", 1536),
                                     ("2tb", 2 << 40), ("4096", 4096), ("1", 1)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "0", "0.5", "-5", "-1G", "lots", "5X"])
def test_parse_size_rejects(text):
    """The library refuses a size under one byte too ("0.5" is 0 bytes: a capacity of
    nothing), not only the CLI: connector settings parse sizes with it."""
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_age():
    assert [format_age(x) for x in (604800, 86400 * 3, 7200, 90, 60)] == ["1w", "3d", "2h", "90s", "1m"]
