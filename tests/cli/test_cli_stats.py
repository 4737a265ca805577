"""`encache stats` and `encache size` on real disk stores."""

from __future__ import annotations

import json

from encache.cli import errors
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.ops.scanning import EntryFilter, summarize
from cli_support import H, file_sizes, invoke, one_line_error
from entries import put_entry


def stats_json(root, *extra):
    r = invoke("stats", "-s", root, "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_json_contents_and_breakdowns(store):
    sizes = file_sizes(store)
    d = stats_json(store.root)
    assert d["entries"] == 9 and d["bytes"] == sum(sizes.values())
    assert d["legacy_entries"] == 1 and d["legacy_bytes"] == sizes[H[8]]
    assert d["unreadable_entries"] == 0
    assert d["max_bytes"] is None and d["used_ratio"] is None
    models = {g["name"]: g for g in d["by_model"]}
    assert models["m"]["entries"] == 7 and models["other"]["entries"] == 1
    assert models[None]["entries"] == 1  # the legacy entry: model unknown
    assert sum(g["bytes"] for g in d["by_model"]) == d["bytes"]
    loras = {g["name"]: g["entries"] for g in d["by_lora"]}
    assert loras == {None: 6, "ad1": 3}
    assert d["oldest_created"] < d["newest_created"]
    # how a consumer will load from here (tests run on a local filesystem)
    from encache.connectors.store.files import filesystem_type
    assert d["backend_info"]["filesystem"] == filesystem_type(store.root)
    assert d["backend_info"]["serving_loads"].startswith("mmap")


def test_every_json_key_is_documented(store):
    """docs/cli.md lists ``stats --json``'s keys: exactly the ones it prints."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    para = text[text.index("`--json` keys: `store,"):]
    para = para[:para.index("backend_info`") + len("backend_info`")]
    documented = {k for group in re.findall(r"`([a-z_, \n]+)`", para)
                  for k in re.split(r"[,\s]+", group) if k}
    assert documented == set(stats_json(store.root))


def test_counters(store):
    store.add_counters({"hits": 30, "misses": 10, "load_seconds": 0.6, "bytes_loaded": 4096,
                        "load_errors": 1, "saves": 9, "bytes_saved": 1234})
    d = stats_json(store.root)
    assert (d["hits"], d["misses"]) == (30, 10)
    assert d["hit_ratio"] == 0.75
    assert abs(d["mean_load_seconds"] - 0.02) < 1e-12
    assert d["load_errors"] == 1 and d["saves"] == 9 and d["bytes_saved"] == 1234
    assert isinstance(d["counters_updated"], float)
    assert (d["checksums"], d["checksums_skipped"]) == (0, 0)
    store.add_counters({"checksums": 3, "checksums_skipped": 1200})
    d = stats_json(store.root)
    assert (d["checksums"], d["checksums_skipped"]) == (3, 1200)
    out = invoke("stats", "-s", store.root).output
    assert "3 / 1,200 (verified or encoded on this host this boot)" in " ".join(out.split())


def test_no_counters_yet(store):
    d = stats_json(store.root)
    assert d["hits"] == 0 and d["misses"] == 0 and d["hit_ratio"] is None
    assert d["mean_load_seconds"] is None and d["counters_updated"] is None


def test_capacity_percentage(tmp_path):
    s = DiskStore(tmp_path / "cap", max_bytes=100_000)
    put_entry(s, H[0])
    d = stats_json(s.root)
    assert d["max_bytes"] == 100_000
    assert abs(d["used_ratio"] - d["bytes"] / 100_000) < 1e-12
    r = invoke("stats", "-s", s.root)
    assert f"{100 * d['bytes'] / 100_000:.1f}%" in r.stdout


def test_table_for_people(store):
    store.add_counters({"hits": 3, "misses": 1})
    r = invoke("stats", "-s", store.root)
    assert r.exit_code == 0
    for text in ("Entries", "Legacy entries", "Hit ratio", "75.0%", "ad1", "other", "(none)",
                 "no capacity set"):
        assert text in r.stdout, text


def test_reset_counters_prints_then_resets(store):
    store.add_counters({"hits": 5, "misses": 5})
    r = invoke("stats", "-s", store.root, "--reset-counters", "--json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["hits"] == 5  # the values being reset are reported
    assert store.read_counters().get("hits", 0) == 0
    assert stats_json(store.root)["hits"] == 0
    r = invoke("stats", "-s", store.root, "--reset-counters")
    assert r.exit_code == 0 and "Counters reset" in r.stderr


def test_empty_store(tmp_path):
    DiskStore(tmp_path / "e")
    d = stats_json(tmp_path / "e")
    assert d["entries"] == 0 and d["bytes"] == 0 and d["by_model"] == []
    assert invoke("stats", "-s", tmp_path / "e").exit_code == 0


def test_missing_store(tmp_path):
    r = invoke("stats", "-s", tmp_path / "none")
    assert r.exit_code == errors.EXIT_STORE
    one_line_error(r)


def test_parallel_summary_equals_sequential(store):
    for i in range(40):
        put_entry(store, f"{i:060x}abcd", 8, i, model=f"m{i % 3}")
    seq = summarize(store)
    par = summarize(store, url=str(store.root), workers=2, min_parallel=0)
    assert par.entries == seq.entries == 49 and par.bytes == seq.bytes
    assert par.legacy == seq.legacy and par.oldest == seq.oldest and par.newest == seq.newest
    assert {k: (g.entries, g.bytes) for k, g in par.by_model.items()} == \
        {k: (g.entries, g.bytes) for k, g in seq.by_model.items()}
    flt = EntryFilter(model="m1")
    assert summarize(store, flt, url=str(store.root), workers=2, min_parallel=0).entries == \
        summarize(store, flt).entries == 13
    d = stats_json(store.root, "-j", "2")
    assert d["entries"] == 49


# -- size ---------------------------------------------------------------------------------

def test_size_raw_when_piped(store):
    r = invoke("size", "-s", store.root)
    assert r.exit_code == 0
    assert r.stdout == f"{sum(file_sizes(store).values())}\n"


def test_size_human(store):
    r = invoke("size", "-s", store.root, "--human")
    assert r.exit_code == 0 and r.stdout.strip().endswith("KiB")
    r = invoke("size", "-s", store.root, "-H")
    assert r.stdout.strip().endswith("KiB")


def test_size_by_model_and_lora(store):
    sizes = file_sizes(store)
    r = invoke("size", "-s", store.root, "--by", "model")
    rows = {ln.split("\t")[0]: ln.split("\t")[1:] for ln in r.stdout.splitlines()}
    assert rows["other"] == ["1", str(sizes[H[5]])]
    assert rows["(unknown)"] == ["1", str(sizes[H[8]])]
    assert sum(int(v[1]) for v in rows.values()) == sum(sizes.values())
    r = invoke("size", "-s", store.root, "--by", "lora", "--json")
    d = json.loads(r.stdout)
    assert d["by"] == "lora" and d["bytes"] == sum(sizes.values()) and d["entries"] == 9
    assert {g["name"]: g["entries"] for g in d["groups"]} == {None: 6, "ad1": 3}
    r = invoke("size", "-s", store.root, "--by", "lora", "--human")
    assert "ad1" in r.stdout and "Total" in r.stdout


def test_size_json_and_errors(store, tmp_path):
    d = json.loads(invoke("size", "-s", store.root, "--json").stdout)
    assert d == {"store": str(store.root), "bytes": sum(file_sizes(store).values()),
                 "unreachable": []}
    assert invoke("size", "-s", store.root, "--by", "colour").exit_code == errors.EXIT_USAGE
    assert invoke("size", "-s", tmp_path / "none").exit_code == errors.EXIT_STORE


def test_encoder_config_breakdown_and_mismatch_counter(tmp_path):
    s = DiskStore(tmp_path / "cfg")
    for n, cfg in enumerate(("", "", "00aa11bb22cc33dd")):
        put_entry(s, H[n], encoder_config=cfg)
    s.add_counters({"config_mismatches": 2})
    d = stats_json(s.root)
    groups = {g["name"]: g["entries"] for g in d["by_encoder_config"]}
    assert groups == {"": 2, "00aa11bb22cc33dd": 1} and d["config_mismatches"] == 2
    out = invoke("stats", "-s", s.root).stdout
    for text in ("Encoder config", "(default)", "00aa11bb22cc33dd", "Config mismatches"):
        assert text in out, text
    s.delete(H[2])  # one config only: no breakdown table for it
    assert "Encoder config" not in invoke("stats", "-s", s.root).stdout


def test_reading_a_directory_nothing_wrote_to_leaves_it_as_it_was(tmp_path):
    """A read-only command pointed at a directory that holds no store (a new path, a typo)
    reports it empty and writes nothing there: no ``.encache/`` appears."""
    for command in ("stats", "list", "verify"):
        r = invoke(command, "--store", tmp_path)
        assert r.exit_code == 0, r.output
        assert list(tmp_path.iterdir()) == [], command
