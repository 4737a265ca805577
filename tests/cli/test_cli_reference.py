"""docs/cli-reference.md is the CLI as it is: ``scripts/cli-docs`` writes it from the Typer
app, and these tests fail when the committed page is stale, when an option or argument of a
command is missing from it, or when it documents one that does not exist."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import typer

from encache.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "cli-reference.md"


def documented() -> dict[str, set[str]]:
    """Each command's section ("" for the top level) and the flags and argument names its
    bullets name."""
    sections: dict[str, set[str]] = {}
    current = ""
    kind = None
    for line in PAGE.read_text().splitlines():
        m = re.match(r"^#+ `encache ?([\w-]*)`$", line) or re.match(r"^# encache CLI", line)
        if m:
            current = m.group(1) if m.groups() else ""
            sections.setdefault(current, set())
            continue
        if line.startswith("**"):
            kind = line.strip("*:")
            continue
        b = re.match(r"^\* `([^`]+)`", line)
        if not b or kind not in ("Options", "Arguments"):
            continue
        head = b.group(1)
        if kind == "Options":
            sections[current] |= set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", head))
        else:
            sections[current].add(head.split()[0])
    return sections


def actual() -> dict[str, set[str]]:
    """Each command's flags and arguments (metavar, else name), from the Click command Typer
    builds. ``--help`` and the shell-completion options are left out: the page says once that
    every command takes ``--help``, and lists neither of the others."""
    group = typer.main.get_command(app)
    out = {}
    ctx = group.context_class(group, info_name="encache")
    for name, cmd in [("", group)] + sorted(group.commands.items()):
        names: set[str] = set()
        for p in cmd.get_params(ctx):
            if p.param_type_name == "option":
                if not {"--help", "--install-completion", "--show-completion"} & set(p.opts):
                    names |= set(p.opts) | set(p.secondary_opts)
            else:
                names.add(p.metavar or p.name)
        out[name] = names
    return out


def test_the_reference_is_what_the_generator_writes_now(tmp_path):
    fresh = tmp_path / "cli-reference.md"
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run([str(ROOT / "scripts" / "cli-docs"), str(fresh)], check=True, env=env,
                   timeout=120)
    assert fresh.read_text() == PAGE.read_text(), "docs/cli-reference.md is stale: run scripts/cli-docs"


def test_every_command_and_option_is_documented_and_nothing_else():
    doc, real = documented(), actual()
    assert set(doc) == set(real), (sorted(set(real) - set(doc)), sorted(set(doc) - set(real)))
    for name in real:
        missing, extra = real[name] - doc[name], doc[name] - real[name]
        assert not missing and not extra, (name or "encache", sorted(missing), sorted(extra))


def test_the_parser_sees_options_it_should():
    """The check above is not vacuous: known options of known commands are found."""
    doc = documented()
    assert {"--batch", "--engine-arg", "--dtype", "--tag", "--over-capacity",
            "--no-manifest"} <= doc["precompute"]
    assert {"--role", "--load-mode", "--verify", "--tag"} <= doc["connector-config"]
    assert {"--from", "--identifier"} <= doc["warm"]
    assert "takes `--help`" in PAGE.read_text()
