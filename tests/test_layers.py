"""The layers hold: every import of every module (function-local ones included) goes
down the declared layers, and no module imports itself back through others.

:data:`LAYERS` is the declaration; ``docs/architecture.md``'s layer table is checked
against it (each layer's folder and what it may import). A new upward import, or a
cycle, fails here with the edge that breaks it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"cli": "encache.cli", "connectors": "encache.connectors", "jobs": "encache.jobs",
            "policy": "encache.policy"}

#: layer -> (module prefix, the layers it may import). Order: bottom up. A module belongs
#: to the layer with the longest matching prefix.
LAYERS = {
    "store core": ("encache.connectors.store", set()),
    "policy": ("encache.policy", set()),
    "helpers": ("encache.connectors", {"store core"}),
    "lookup": ("encache.connectors.lookup", {"store core", "helpers"}),
    "vllm adapter": ("encache.connectors.vllm", {"store core", "helpers", "lookup", "policy"}),
    "jobs": ("encache.jobs", {"store core", "helpers", "lookup", "vllm adapter", "policy"}),
    "cli": ("encache.cli", {"store core", "helpers", "lookup", "vllm adapter", "policy", "jobs"}),
}

#: edges against the layers that are known and not yet moved (each a reason); a new one
#: is a failure, and so is an entry here that no longer exists
KNOWN: dict[tuple[str, str], str] = {}


def modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for path in sorted([*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.so")]):
            rel = path.relative_to(ROOT / folder).parts
            rel = (*rel[:-1], rel[-1].split(".")[0])  # a C extension: _readpool.cpython-…so
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join([pkg, *rel])] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """encache modules ``name`` imports, anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # ``from pkg import mod`` imports the module; ``from pkg import name`` the
            # package (its ``__init__``): each an edge, the package's face included
            subs = [f"{base}.{a.name}" for a in node.names]
            targets = [t for t in subs if t in known]
            if len(targets) < len(subs):
                targets.append(base)
        else:
            continue
        for t in targets:
            while t and t not in known:  # ``import a.b.c``: the deepest known module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def layer_of(module: str) -> str:
    best = max((prefix for prefix, _ in LAYERS.values()
                if module == prefix or module.startswith(prefix + ".")), key=len)
    return next(name for name, (prefix, _) in LAYERS.items() if prefix == best)


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) if path.suffix == ".py" else set()
            for name, path in known.items()}


def test_every_import_goes_down_the_layers():
    bad, seen_known = [], set()
    for mod, targets in graph().items():
        here = layer_of(mod)
        for t in targets:
            there = layer_of(t)
            if there == here or there in LAYERS[here][1]:
                continue
            if (mod, t) in KNOWN:
                seen_known.add((mod, t))
                continue
            bad.append(f"{mod} ({here}) -> {t} ({there})")
    assert bad == []
    assert seen_known == set(KNOWN), f"no longer there: {set(KNOWN) - seen_known}"


def test_no_import_cycles():
    """Cycles between modules, an import of a package's face (its ``__init__``:
    ``from . import open_store``) an edge like any other."""
    edges = graph()
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_checker_sees_local_and_relative_imports(tmp_path):
    known = {"encache.connectors.store.disk": None, "encache.connectors.store": None,
             "encache.connectors.counters": None, "encache.connectors.vllm.hashing": None}
    probe = tmp_path / "disk.py"
    probe.write_text("def f():\n    from .. import counters\n"
                     "    import encache.connectors.vllm.hashing\n")
    assert imports("encache.connectors.store.disk", probe, known) == {
        "encache.connectors.counters", "encache.connectors.vllm.hashing"}


def test_the_architecture_table_matches_the_declaration():
    """docs/architecture.md's table names each layer, its folder and what it imports."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| ([a-z ]+) \| `([^`]+)` \(`([^`]+)`\) \| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = (m.group(3), m.group(4))
    assert set(rows) == set(LAYERS), (sorted(rows), sorted(LAYERS))
    for name, (prefix, allowed) in LAYERS.items():
        package, may = rows[name]
        assert package == prefix, (name, package)
        said = {s.strip() for s in re.split(r",| and ", may.split(";")[0]) if s.strip()}
        said.discard("nothing of encache")
        assert said == allowed, (name, said, allowed)


def test_the_checker_counts_an_import_of_a_package_face(tmp_path):
    """``from . import open_store`` is an edge to the package's ``__init__`` (a cycle
    through it fails); ``from . import header_index`` one to that module only."""
    known = {"encache.connectors.store": None, "encache.connectors.store.scanning": None,
             "encache.connectors.store.header_index": None}
    probe = tmp_path / "scanning.py"
    probe.write_text("from . import header_index\n\ndef f():\n    from . import open_store\n")
    assert imports("encache.connectors.store.scanning", probe, known) == {
        "encache.connectors.store", "encache.connectors.store.header_index"}
