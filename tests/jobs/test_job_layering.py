"""Jobs are library code: nothing under jobs/ or connectors/ imports the CLI layer (the
error type and the codes it carries live in jobs/errors.py), so a Python user or a Ray
worker never runs CLI code; and the CLI modules of precompute and warm hold no job
logic."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _cli_imports(path: Path) -> list[str]:
    found = []
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            mod = ("." * node.level) + (node.module or "")
            names = [a.name for a in node.names]
            if mod.startswith("encache.cli") or mod.lstrip(".").startswith("cli") and node.level:
                found.append(f"{where}: from {mod} import {names}")
            elif mod.strip(".") == "" and node.level >= 2 and "cli" in names:
                found.append(f"{where}: from {mod} import cli")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("encache.cli"):
                    found.append(f"{where}: import {a.name}")
    return found


def test_jobs_and_connectors_do_not_import_the_cli():
    bad = [hit for folder in ("jobs", "connectors") for p in sorted((ROOT / folder).rglob("*.py"))
           for hit in _cli_imports(p)]
    assert bad == []


def test_the_checker_sees_a_cli_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from ..cli.render import note\nfrom ..cli.common import EXIT_USAGE\n"
                     "from encache.cli import render\nimport encache.cli.warm\n")
    assert len(_cli_imports(probe)) == 4


def test_cli_precompute_and_warm_only_parse_and_render():
    for name in ("precompute.py", "warm.py"):
        tree = ast.parse((ROOT / "cli" / name).read_text())
        defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defs & {"precompute_corpus", "precompute_files", "_hash_phase",
                           "_encode_missing", "_check_capacity", "compute_missing",
                           "_drop_manifest", "_RichProgress", "_clean_error"}, (name, defs)


def test_cli_list_stats_and_size_only_render():
    """Their data is built in the library (encache.connectors.store.ops.report)."""
    for name in ("list.py", "stats.py", "size.py"):
        tree = ast.parse((ROOT / "cli" / name).read_text())
        defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defs & {"build_list", "build_stats", "build_size", "entry_dict",
                           "entry_dicts", "tier_stats", "parse_sort"}, (name, defs)


def test_every_package_folder_is_installed():
    """pyproject's explicit package list names every folder with an ``__init__.py``: a
    missing one installs fine in editable mode (the tests) and breaks a wheel install."""
    import tomllib
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    folders = {}
    for name, folder in cfg["package-dir"].items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            folders[".".join([name, *rel.parts])] = init.parent
    assert set(folders) <= listed, sorted(set(folders) - listed)
