"""Bad input to the CLI: empty names, sizes, non-finite numbers, Rich markup in data, an
abandoned prompt, bad JSON options, missing files, a huge ``-j``, conflicting formats.

Each is a clear usage error (exit 2) naming the option, or the file's own error (exit 3)
while the others are processed — never a traceback, never an exception class name, and
data is printed exactly as it is. (The tests marked slow import vLLM's hasher.)
"""

from __future__ import annotations

import json

import pytest

from encache.cli import precompute as precompute_cli
from encache.cli import render
from encache.cli import errors
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.entry import encode_parts
from cli_support import ALL_IDS, H, invoke, one_line_error

MODEL = "org/some-vlm"
#: identifiers and models holding Rich markup (each once crashed `list` etc. with MarkupError)
MARKUP = [("a[/]b", "m[/]x"), ("lo[/]ra:" + "ab" * 32, "org/model"), ("c" * 64, "[bold]evil")]


def ids(store) -> set[str]:
    return {e.identifier for e in store.scan()}


def no_traceback(r) -> None:
    assert "Traceback" not in r.stderr and "Error: ValueError" not in r.stderr, r.stderr


@pytest.fixture
def markup_store(tmp_path) -> DiskStore:
    s = DiskStore(tmp_path / "markup")
    for ident, model in MARKUP:
        s.put(ident, list(encode_parts(ident, bytes(16), "F16", (2, 4), model=model)))
    return s


@pytest.fixture
def png(tmp_path):
    """A real PNG whose name holds markup."""
    from PIL import Image

    p = tmp_path / "x[red]y.png"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(p, format="PNG")
    return p


@pytest.fixture
def fake_precompute(monkeypatch):
    """`precompute` without vLLM: the job records its options and returns a summary whose
    data holds markup."""
    from encache.jobs.precompute import Summary

    seen = {}

    def run(corpus, options, **kw):
        seen["options"] = options
        s = Summary(store="/s[bold]x", model=options.model, lora=None, files=1, failed=1)
        s.failures.append({"path": "x[red]y.png", "error": "not [b]an[/b] image"})
        s.notes.append("note [dim]z[/]")
        return s

    monkeypatch.setattr(precompute_cli, "precompute_corpus", run)
    monkeypatch.setattr(precompute_cli, "quiet_engine_start", lambda: None)
    return seen


# -- 1. empty names are usage errors ------------------------------------------------------

def test_empty_model_with_repair_is_a_usage_error_and_changes_nothing(store):
    r = invoke("verify", "-s", store.root, "--model", "", "--repair")
    assert r.exit_code == errors.EXIT_USAGE, r.output
    assert "--model" in r.stderr and "must not be empty" in r.stderr
    assert ids(store) == ALL_IDS


@pytest.mark.parametrize("args", [
    ("list", "--model", ""), ("list", "--lora", " "), ("purge", "--lora", "", "--yes"),
    ("purge", "--model", "", "--yes")])
def test_empty_filters_are_usage_errors(store, args):
    r = invoke(args[0], "-s", store.root, *args[1:])
    assert r.exit_code == errors.EXIT_USAGE, r.output
    assert "must not be empty" in r.stderr
    assert ids(store) == ALL_IDS


@pytest.mark.parametrize("command", ["list", "stats", "verify", "size", "connector-config"])
def test_an_empty_store_is_a_usage_error(command):
    """(It was exit 7, a store error, where the table says a missing ``--store`` is 2.)"""
    r = invoke(command, "-s", "")
    assert r.exit_code == errors.EXIT_USAGE, r.output
    assert "must not be empty" in " ".join(r.stderr.replace("│", " ").split())


def test_empty_model_for_precompute_hash_warm_and_connector_config(store, tmp_path,
                                                                   fake_precompute):
    (tmp_path / "c").mkdir()
    for args in (("precompute", tmp_path / "c", "-m", "", "-s", store.root),
                 ("hash", tmp_path / "none.png", "-m", ""),
                 ("warm", "-s", store.root, tmp_path / "none.png", "-m", ""),
                 ("connector-config", "-s", store.root, "-m", "")):
        r = invoke(*args)
        assert r.exit_code == errors.EXIT_USAGE, (args, r.output)
        assert "must not be empty" in r.stderr, args
    assert "options" not in fake_precompute  # refused before any work


# -- 2. sizes, timeouts and the store URL -------------------------------------------------

def test_precompute_max_bytes_takes_a_size(store, tmp_path, fake_precompute):
    (tmp_path / "c").mkdir()
    r = invoke("precompute", tmp_path / "c", "-m", MODEL, "-s", store.root, "--max-bytes", "50G")
    assert r.exit_code == errors.EXIT_PARTIAL, r.output  # the fake run has one failure
    assert fake_precompute["options"].max_bytes == 50 * 2**30


@pytest.mark.parametrize("size", ["0", "-5", "-1G", "0.5", "lots"])
def test_precompute_max_bytes_zero_or_negative_is_a_usage_error(store, tmp_path, size,
                                                                fake_precompute):
    (tmp_path / "c").mkdir()
    r = invoke("precompute", tmp_path / "c", "-m", MODEL, "-s", store.root,
               f"--max-bytes={size}")
    assert r.exit_code == errors.EXIT_USAGE, r.output
    assert "--max-bytes" in r.stderr and "options" not in fake_precompute


def test_connector_config_max_bytes_takes_a_size_and_rejects_zero(tmp_path):
    r = invoke("connector-config", "-s", tmp_path, "--max-bytes", "50G")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ec_connector_extra_config"]["max_bytes"] == 50 * 2**30
    for size in ("0", "-5", "0.5"):
        r = invoke("connector-config", "-s", tmp_path, f"--max-bytes={size}")
        assert r.exit_code == errors.EXIT_USAGE, r.output
        assert "--max-bytes" in r.stderr and not r.stdout


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1"])
def test_connector_config_load_timeout_must_be_finite_and_not_negative(tmp_path, value):
    r = invoke("connector-config", "-s", tmp_path, f"--load-timeout-s={value}")
    assert r.exit_code == errors.EXIT_USAGE, r.output
    assert "--load-timeout-s" in r.stderr and not r.stdout
    no_traceback(r)


def test_connector_config_load_timeout_zero_and_fractions_pass(tmp_path):
    for value in ("0", "2.5"):
        r = invoke("connector-config", "-s", tmp_path, "--load-timeout-s", value)
        assert r.exit_code == 0, r.output
        extra = json.loads(r.stdout)["ec_connector_extra_config"]
        assert extra["load_timeout_s"] == float(value)


def test_connector_config_rejects_an_unsupported_scheme_like_every_command(tmp_path):
    r = invoke("connector-config", "-s", "ftp://x")
    assert r.exit_code == errors.EXIT_STORE and not r.stdout
    line = one_line_error(r)
    assert "unsupported store URL scheme 'ftp'" in line
    assert one_line_error(invoke("list", "-s", "ftp://x")) == line  # the same error
    for url in ("redis://h:6379/0", f"file://{tmp_path}", str(tmp_path / "not-yet")):
        assert invoke("connector-config", "-s", url).exit_code == 0, url


# -- 3. Rich markup in data is printed literally ------------------------------------------

@pytest.mark.parametrize("args", [
    ("list",), ("stats",), ("size", "--by", "model", "-H"), ("size", "--by", "lora", "-H"),
    ("purge", "--all", "--dry-run"), ("verify", "--model", "[bold]evil")])
def test_markup_in_identifiers_and_models_is_printed_as_is(markup_store, args):
    r = invoke(args[0], "-s", markup_store.root, *args[1:])
    assert r.exit_code in (0, errors.EXIT_PROBLEMS), r.output  # verify: 2 wrong-model
    no_traceback(r)
    assert "MarkupError" not in r.output
    shown = {"list": ["a[/]b", "m[/]x", "[bold]evil", "lo[/]ra"],
             "stats": ["m[/]x", "[bold]evil", "lo[/]ra"],
             "size": ["m[/]x", "[bold]evil"] if "model" in args else ["lo[/]ra"],
             "purge": ["a[/]b", "m[/]x", "[bold]evil"],
             "verify": ["a[/]b", "lo[/]ra:"]}[args[0]]
    for text in shown:
        assert text in r.stdout, (text, r.stdout)
    assert ids(markup_store) == {i for i, _ in MARKUP}


def test_precompute_summary_prints_paths_and_notes_as_is(store, tmp_path, fake_precompute):
    (tmp_path / "c").mkdir()
    r = invoke("precompute", tmp_path / "c", "-m", MODEL, "-s", store.root)
    assert r.exit_code == errors.EXIT_PARTIAL, r.output
    for text in ("precompute → /s[bold]x", "failed x[red]y.png: not [b]an[/b] image",
                 "note: note [dim]z[/]"):
        assert text in r.stdout, (text, r.stdout)


def test_progress_failure_lines_print_paths_as_is(monkeypatch):
    import io

    from rich.console import Console

    buf = io.StringIO()
    monkeypatch.setattr(render, "err_console",
                        lambda: Console(file=buf, width=100, force_terminal=False))
    with render.PhaseProgress(show_failures=True, terminal_only=False) as p:
        p.start("hashing", 2)
        p.advance(1, failed="x[red]y.png: not a readable image")
        p.advance(1, failed="a[/]b.png")
    assert "failed x[red]y.png: not a readable image" in buf.getvalue()
    assert "failed a[/]b.png" in buf.getvalue()


def test_table_cells_and_title_are_literal():
    import io

    from rich.console import Console

    buf = io.StringIO()
    t = render.table(["A", "B>"], [("[bold]x", "a[/]b")], title="t [red]y", caption="c[/]")
    Console(file=buf, width=100).print(t)
    text = buf.getvalue()
    assert "[bold]x" in text and "a[/]b" in text and "t [red]y" in text and "c[/]" in text


# -- 4. Ctrl-D / Ctrl-C at the confirmation ------------------------------------------------

def test_eof_at_the_purge_prompt_is_declined_exit_6(store, monkeypatch):
    monkeypatch.setattr(render, "can_prompt", lambda: True)  # "a terminal", then Ctrl-D
    r = invoke("purge", "-s", store.root, "--all", input="")
    assert r.exit_code == errors.EXIT_ABORTED, r.output
    prompt, error = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert prompt.startswith("Delete 9 entries") and "Traceback" not in r.stderr
    assert error == "Error: aborted; nothing was deleted"  # on its own line
    assert ids(store) == ALL_IDS


def test_interrupted_prompt_is_declined(monkeypatch):
    import typer

    def interrupted(*a, **kw):  # what typer.confirm raises on Ctrl-C (and Ctrl-D)
        raise typer.Abort()

    monkeypatch.setattr(render, "can_prompt", lambda: True)
    monkeypatch.setattr(typer, "confirm", interrupted)
    with pytest.raises(errors.EncacheError) as e:
        render.confirm("Delete?", refusal="refused", declined="aborted")
    assert e.value.exit_code == errors.EXIT_ABORTED and str(e.value) == "aborted"


# -- 5. JSON options: strict JSON, the expected structure, the option named ------------------

@pytest.mark.parametrize("option,value", [
    ("--mm-processor-kwargs", '{"x": NaN}'), ("--mm-processor-kwargs", '{"x": Infinity}'),
    ("--mm-processor-kwargs", '{"x": -1e999}'), ("--mm-processor-kwargs", "[1]"),
    ("--media-io-kwargs", '{"image": 5}'), ("--media-io-kwargs", '{"video": [1]}'),
    ("--media-io-kwargs", "{"), ("--request-media-io-kwargs", '{"image": "x"}'),
    ("--request-media-io-kwargs", '{"image": {"a": NaN}}')])
def test_hash_json_options_are_checked_as_options(tmp_path, option, value):
    r = invoke("hash", tmp_path / "any.png", "-m", MODEL, option, value, "--json")
    assert r.exit_code == errors.EXIT_USAGE, r.output
    assert option in r.stderr and not r.stdout
    no_traceback(r)
    assert "'int' object" not in r.stderr and "not a mapping" not in r.stderr


def test_precompute_request_kwargs_reject_nan(store, tmp_path, fake_precompute):
    (tmp_path / "c").mkdir()
    r = invoke("precompute", tmp_path / "c", "-m", MODEL, "-s", store.root,
               "--request-mm-processor-kwargs", '{"max_pixels": NaN}')
    assert r.exit_code == errors.EXIT_USAGE, r.output
    assert "--request-mm-processor-kwargs" in one_line_error(r)


# -- 6./7. hash and warm: a missing or bad file is that file's error -------------------------

@pytest.mark.slow
def test_hash_missing_and_bad_files_are_their_own_errors(tmp_path, png):
    bad = tmp_path / "bad[bold].png"
    bad.write_bytes(b"not an image")
    missing = tmp_path / "missing.png"
    r = invoke("hash", png, missing, bad, "-m", MODEL, "--json")
    assert r.exit_code == errors.EXIT_PARTIAL, r.output
    good, gone, broken = json.loads(r.stdout)["files"]
    assert good["error"] is None and len(good["identifier"]) == 64
    assert gone["error"] and broken["error"]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("Error: ") for ln in lines), r.stderr
    assert str(missing) in lines[0] and str(bad) in lines[1]
    assert lines[0].count(str(missing)) == 1  # named once, even when the error names it


@pytest.mark.slow
def test_hash_only_missing_files_is_exit_2_and_table_shows_names_as_is(tmp_path, png):
    r = invoke("hash", tmp_path / "missing.png", "-m", MODEL)
    assert r.exit_code == errors.EXIT_USAGE, r.output  # every file bad (docs: exit 2)
    assert "missing.png" in r.stderr
    r = invoke("hash", png, "-m", MODEL)
    assert r.exit_code == 0, r.output
    assert "x[red]y.png" in r.stdout


@pytest.mark.slow
def test_warm_missing_image_is_its_failure_others_processed(store, tmp_path, png):
    dst = DiskStore(tmp_path / "dst")
    missing = tmp_path / "missing.png"
    r = invoke("warm", "-s", dst.root, "--from", store.root, png, missing, "-m", MODEL,
               "--json")
    assert r.exit_code == errors.EXIT_PARTIAL, r.output
    d = json.loads(r.stdout)
    paths = {f["path"]: f["reason"] for f in d["failures"]}
    assert any(p.endswith("missing.png") for p in paths), d
    assert any(p.endswith("x[red]y.png") and reason == "missing" for p, reason in paths.items())


# -- 8. -j is bounded -------------------------------------------------------------------

def test_jobs_are_bounded(store):
    from encache.cli.options import MAX_JOBS

    for cmd in ("stats", "verify"):
        r = invoke(cmd, "-s", store.root, "-j", MAX_JOBS + 1, "--json")
        assert r.exit_code == errors.EXIT_USAGE, (cmd, r.output)
        assert "-j" in r.stderr and not r.stdout
    assert invoke("stats", "-s", store.root, "-j", 2, "--json").exit_code == 0


# -- 9. list -q --json ---------------------------------------------------------------------

def test_list_quiet_and_json_conflict(store):
    r = invoke("list", "-s", store.root, "-q", "--json")
    assert r.exit_code == errors.EXIT_USAGE and not r.stdout
    assert "-q and --json" in one_line_error(r)
    assert invoke("list", "-s", store.root, "-q").stdout.split() == sorted(ALL_IDS)
    assert H[0] in invoke("list", "-s", store.root, "--json").stdout
