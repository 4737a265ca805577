"""cli/render.py, the one output path: JSON encoding, the confirmation prompt, the phase
progress object job code drives."""

from __future__ import annotations

import io
import json
import sys

import pytest

from encache.cli import errors
from encache.cli.render import PhaseProgress, confirm, emit_json, json_text


def test_json_text_modes():
    obj = {"store": "/d/ü", "n": 1}
    assert json_text(obj) == '{"store": "/d/ü", "n": 1}'
    assert json_text(obj, compact=True, ascii=True) == '{"store":"/d/\\u00fc","n":1}'
    with pytest.raises(ValueError):
        json_text({"x": float("nan")})  # never emit invalid JSON


def test_emit_json_is_one_line_on_stdout(capsys):
    emit_json({"a": [1, 2]})
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1 and json.loads(out) == {"a": [1, 2]}


def test_confirm_refuses_without_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a TTY: never read
    with pytest.raises(errors.EncacheError) as e:
        confirm("Delete?", refusal="refusing: not on a terminal", declined="aborted",
                hint="pass --yes")
    assert e.value.exit_code == errors.EXIT_ABORTED and "not on a terminal" in str(e.value)


def test_phase_progress_is_silent_off_a_terminal(capsys):
    with PhaseProgress() as p:  # pytest's stderr is not a terminal
        p.start("encoding", 3)
        p.advance(3)
    assert p.bar is None and capsys.readouterr().err == ""


def test_phase_progress_draws_phases_and_failures(monkeypatch):
    """With terminal_only=False it draws on stderr (precompute's mode): every phase's bar
    stays (transient=False) and failures are printed as they come."""
    import encache.cli.render as render

    buf = io.StringIO()
    from rich.console import Console
    monkeypatch.setattr(render, "err_console",
                        lambda: Console(file=buf, width=100, force_terminal=False))
    with PhaseProgress(width=15, transient=False, show_failures=True,
                       terminal_only=False) as p:
        p.start("hashing", 2)
        p.advance(1, failed="a.png: not a readable image (truncated)")
        p.advance(1)
        p.start("encoding", 1)
        p.advance(1)
    text = buf.getvalue()
    assert "failed a.png: not a readable image (truncated)" in text
    assert "hashing" in text and "encoding" in text and "2/2" in text and "1/1" in text
