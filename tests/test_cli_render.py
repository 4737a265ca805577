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
