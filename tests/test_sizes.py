"""No product module over 800 lines, no class over 500: a newcomer reads one concept at a
time. A module or class that grows past its limit fails here by name; split it by
concept (a backend's catalogue, bookkeeping, writes in flight: mixins beside it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("cli", "connectors", "jobs", "policy")
MODULE_MAX_LINES = 800
CLASS_MAX_LINES = 500


def sources():
    for folder in PRODUCT:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_the_product_code_is_found():
    assert sum(1 for _ in sources()) > 50


def test_no_module_over_800_lines():
    too_long = {str(p.relative_to(ROOT)): n for p in sources()
                if (n := len(p.read_text().splitlines())) > MODULE_MAX_LINES}
    assert not too_long, f"modules over {MODULE_MAX_LINES} lines: {too_long}"


def test_no_class_over_500_lines():
    too_long = {}
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                if (n := node.end_lineno - first + 1) > CLASS_MAX_LINES:
                    too_long[f"{path.relative_to(ROOT)}:{node.name}"] = n
    assert not too_long, f"classes over {CLASS_MAX_LINES} lines: {too_long}"
