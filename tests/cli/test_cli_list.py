"""`encache list` on real disk stores."""

from __future__ import annotations

import json
import time

from encache.cli import errors
from cli_support import ALL_IDS, H, OLD, file_sizes, invoke, one_line_error

ENTRY_KEYS = {"identifier", "lora", "model", "shape", "dtype", "size", "created", "accessed",
              "legacy", "vllm_version", "hash_algo", "error"}


def ids(result) -> list[str]:
    return result.stdout.split()


def test_table_for_people(store):
    r = invoke("list", "-s", store.root)
    assert r.exit_code == 0, r.output
    for ident in ALL_IDS:
        assert ident in r.stdout
    assert "9 entries" in r.stdout
    assert "64×8" in r.stdout and "F16" in r.stdout and "(legacy)" in r.stdout
    assert r.stderr == ""  # no progress when stderr is not a terminal


def test_json_schema(store):
    r = invoke("list", "-s", store.root, "--json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert set(data) == {"store", "count", "bytes", "unreachable", "entries"}
    assert data["unreachable"] == []
    assert data["store"] == str(store.root)
    assert data["count"] == 9 and {e["identifier"] for e in data["entries"]} == ALL_IDS
    sizes = file_sizes(store)
    assert data["bytes"] == sum(sizes.values())
    for e in data["entries"]:
        assert set(e) == ENTRY_KEYS
        assert e["size"] == sizes[e["identifier"]] and isinstance(e["size"], int)
        assert isinstance(e["created"], float) and abs(e["created"] - time.time()) < OLD + 3600
    by_id = {e["identifier"]: e for e in data["entries"]}
    assert by_id[H[0]]["shape"] == [64, 8] and by_id[H[0]]["dtype"] == "F16"
    assert by_id[H[0]]["model"] == "m" and by_id[H[0]]["lora"] is None
    assert by_id["ad1:" + H[3]]["lora"] == "ad1"
    assert by_id[H[8]]["legacy"] is True and by_id[H[8]]["model"] is None
    assert by_id[H[8]]["shape"] == [16, 4] and by_id[H[8]]["dtype"] == "F32"


def test_quiet_prints_identifiers_only(store):
    r = invoke("list", "-s", store.root, "-q")
    assert r.exit_code == 0
    assert set(ids(r)) == ALL_IDS and len(ids(r)) == 9


def test_filter_lora_matches_prefix_and_metadata(store):
    r = invoke("list", "-s", store.root, "-q", "--lora", "ad1")
    assert set(ids(r)) == {"ad1:" + H[3], "ad1:" + H[4], H[6]}


def test_filter_model(store):
    assert ids(invoke("list", "-s", store.root, "-q", "--model", "other")) == [H[5]]
    assert len(ids(invoke("list", "-s", store.root, "-q", "-m", "m"))) == 7


def test_filter_older_than(store):
    assert ids(invoke("list", "-s", store.root, "-q", "--older-than", "7d")) == [H[7]]
    assert ids(invoke("list", "-s", store.root, "-q", "--older-than", "11d")) == []


def test_filters_combine(store):
    r = invoke("list", "-s", store.root, "-q", "--lora", "ad1", "--model", "other")
    assert r.exit_code == 0 and ids(r) == []


def test_sort_and_limit(store):
    sizes = file_sizes(store)
    desc = ids(invoke("list", "-s", store.root, "-q", "--sort", "size"))
    assert [sizes[i] for i in desc] == sorted(sizes.values(), reverse=True)
    asc = ids(invoke("list", "-s", store.root, "-q", "--sort", "size:asc"))
    assert [sizes[i] for i in asc] == sorted(sizes.values())
    newest = ids(invoke("list", "-s", store.root, "-q", "--sort", "created"))
    assert newest[-1] == H[7]  # the 10-day-old entry comes last
    top = ids(invoke("list", "-s", store.root, "-q", "--sort", "size", "--limit", "2"))
    assert top == desc[:2]
    table = invoke("list", "-s", store.root, "--sort", "size", "--limit", "2")
    assert f"2 of {len(ALL_IDS)} entries (--limit)" in table.output, table.output
    by_name = ids(invoke("list", "-s", store.root, "-q", "--sort", "identifier"))
    assert by_name == sorted(ALL_IDS)


def test_usage_errors(store):
    for bad in (["--sort", "colour"], ["--sort", "size:up"], ["--older-than", "7 days"],
                ["--limit", "-1"], ["--limit", "0"]):
        r = invoke("list", "-s", store.root, *bad)
        assert r.exit_code == errors.EXIT_USAGE, (bad, r.output)


def test_empty_store(tmp_path):
    from encache.connectors.store.disk.store import DiskStore
    DiskStore(tmp_path / "e")
    r = invoke("list", "-s", tmp_path / "e")
    assert r.exit_code == 0 and r.stdout == "" and "No entries" in r.stderr
    r = invoke("list", "-s", tmp_path / "e", "--json")
    assert json.loads(r.stdout)["entries"] == []


def test_unreadable_entry_is_listed_with_its_problem(store):
    p = store.entry_path(H[0])
    p.write_bytes(p.read_bytes()[:-7])
    r = invoke("list", "-s", store.root, "--json")
    e = {x["identifier"]: x for x in json.loads(r.stdout)["entries"]}[H[0]]
    assert e["error"] == "truncated"
    r = invoke("list", "-s", store.root)
    assert "truncated" in r.stdout


def test_file_url(store):
    r = invoke("list", "-s", f"file://{store.root}", "-q")
    assert set(ids(r)) == ALL_IDS


def test_missing_store(tmp_path):
    r = invoke("list", "-s", tmp_path / "x")
    assert r.exit_code == errors.EXIT_STORE
    one_line_error(r)


def test_huge_listing_is_plain_aligned_text(tmp_path):
    from encache.cli.render import RICH_MAX_ROWS
    from encache.connectors.store.disk.store import DiskStore
    from entries import put_entry
    s = DiskStore(tmp_path / "big", fsync=False)
    n = RICH_MAX_ROWS + 50
    for i in range(n):
        put_entry(s, f"{i:064x}", 1, i)
    r = invoke("list", "-s", s.root)
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["Identifier", "LoRA", "Model", "Shape", "Dtype", "Size",
                                "Created", "Accessed"]
    rows = [ln for ln in lines[2:] if ln.strip()][:-1]
    assert len(rows) == n and rows[0].split()[0] == f"{0:064x}"
    assert len({ln.index(" m ") for ln in rows}) == 1  # columns aligned
    assert lines[-1].startswith(f"{n:,} entries, ") and lines[-1].endswith("KiB")


def test_json_document_is_the_generic_encoding_byte_for_byte(store):
    """``list --json`` writes its records from a template (cli/list.py json_document): the
    text must be exactly json.dumps of the dict records, for every kind of entry."""
    from msgspec.structs import replace

    from encache.cli.list import json_document
    from encache.connectors.store.ops.report import build_list, entry_dicts
    from encache.cli.render import json_text
    from encache.connectors.store.base import EntryInfo

    p = store.entry_path(H[0])
    p.write_bytes(p.read_bytes()[:-7])  # an unreadable entry: meta None, error set
    entries = build_list(store)
    assert any(e.error for e in entries) and any(e.meta and e.meta.legacy for e in entries)
    odd = entries[1].meta
    entries += [
        EntryInfo("ad2:" + H[5], 12, None, None, None, "gone"),  # no times, LoRA by prefix
        EntryInfo(H[6], 2**40, replace(odd, model='mo"dèl\\\n☃', lora="ünï", shape=(),
                                       vllm_version=None), 1e-7, 1.5e16, None),
        EntryInfo(H[7], 0, replace(odd, shape=(3, 0, 5), dtype="BF16"), 0.0, -1.0),
    ]
    for url in (str(store.root), 'redis://h:1/0?x="y"'):
        want = json_text({"store": url, "count": len(entries),
                          "bytes": sum(e.size for e in entries), "unreachable": [],
                          "entries": entry_dicts(entries)})
        assert json_document(url, entries) == want
        assert json_document(url, []) == json_text({"store": url, "count": 0, "bytes": 0,
                                                     "unreachable": [], "entries": []})
        down = [{"part": "10.0.0.2:7001", "error": 'connection "refused"'}]
        assert json_document(url, entries, down) == json_text(
            {"store": url, "count": len(entries), "bytes": sum(e.size for e in entries),
             "unreachable": down, "entries": entry_dicts(entries)})


def test_json_is_written_as_rendered_and_is_the_same_document(store, capsys):
    """``list --json`` writes its records a few thousand at a time (render_json): the
    text is json_document's byte for byte, across chunk boundaries and when empty."""
    from encache.cli.list import build_list, json_document, render_json
    from encache.connectors.store.base import EntryInfo

    one = build_list(store)
    entries = [EntryInfo(f"{i:064x}", e.size + i, e.meta, e.created, e.accessed, e.error)
               for i in range(3 * 4096 + 5) for e in (one[i % len(one)],)]
    for es, down in ((entries, []), ([], []), (one, [{"part": "p", "error": "e"}])):
        render_json(str(store.root), es, down)
        assert capsys.readouterr().out == json_document(str(store.root), es, down) + "\n"
