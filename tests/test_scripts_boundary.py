"""Tests import no ``scripts/``: what tests and scripts share lives in the package or in
``tests/`` (scripts import it from there), so a test never runs a script's module
(scripts are run, as commands, by the tests that check them)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def script_modules() -> set[str]:
    return {p.stem for p in [*(ROOT / "scripts").glob("*.py"),
                             *(ROOT / "scripts" / "bench").glob("*.py")]}


def test_no_test_imports_a_script_or_puts_scripts_on_the_path():
    names = script_modules()
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if "vllm_releases" in path.parts or path == Path(__file__).resolve():
            continue  # vLLM's own files, kept as data; this checker
        text = path.read_text()
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Import):
                hit = [a.name for a in node.names if a.name.split(".")[0] in names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                hit = [node.module] if (node.module or "").split(".")[0] in names else []
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} imports {h}" for h in hit]
        for n, line in enumerate(text.splitlines(), 1):
            if "sys.path" in line and '"scripts"' in line:
                bad.append(f"{path.relative_to(ROOT)}:{n} puts scripts/ on sys.path")
    assert bad == []


def test_the_checker_sees_a_script_import():
    names = script_modules()
    assert {"build_tiny_model", "policy_bench"} <= names
    tree = ast.parse("from policy_bench import main\nimport build_tiny_model\n")
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(found) == 2
