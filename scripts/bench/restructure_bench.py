"""Before / after a restructuring: the load, EPD hand-off and CLI benchmarks of two commits,
side by side in one run.

Code that moves without changing behaviour must cost what it did. This checks out
``--base`` (default: the commit before the store was restructured) into a temporary git
worktree, then runs each benchmark alternately under the base and under this checkout
(base, this, base, this, ...: ``--rounds`` pairs), each from its own tree (its own bench
script, its own ``encache`` on ``PYTHONPATH``), and compares what a user waits for:

  load      ``load_bench.py``: p50 ms of a first (checksummed) load, a repeat, a staged load
            (0.25 / 2.75 / 10 MB fp16 entries, interleaved methods, warm page cache)
  handoff   ``handoff_bench.py``: p50 ms from an encoder's answer to PD holding the entry
            (2.75 and 11 MB)
  cli       ``cli_bench.py``: best seconds of ``stats --json``, ``list --json`` and ``size``
            over a synthetic store (``--cli-entries``)

Ratios are after / before of the medians over rounds (1.0: the same). Writes
``benchmarks/restructure.json`` and ``.png``.

    scripts/bench/restructure [--base REV] [--rounds 2] [--cli-entries 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import loadavg, machine  # noqa: E402

BASE = "fe05490"  # main before the store's loads and modules were restructured
PACKAGES = ("cli", "connectors", "jobs", "policy")


def tree_at(rev: str, where: Path) -> Path:
    """A worktree of ``rev`` with the shared venv and a ``.shim/encache`` over its folders."""
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(where), rev], cwd=ROOT,
                   check=True, capture_output=True)
    (where / ".venv").symlink_to(ROOT / ".venv")
    shim = where / ".shim" / "encache"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    for p in PACKAGES:
        (shim / p).symlink_to(where / p)
    for so in (ROOT / "connectors" / "store").glob("_readpool*.so"):  # the C helper, as built
        shutil.copy2(so, where / "connectors" / "store" / so.name)
    return where


def shim_of(tree: Path) -> Path:
    """This checkout has no shim of its own in CI: make one in the temporary folder."""
    if (tree / ".shim" / "encache").is_dir():
        return tree / ".shim"
    shim = Path(tempfile.mkdtemp(prefix="encache-shim-")) / "encache"
    shim.mkdir()
    (shim / "__init__.py").write_text("")
    for p in PACKAGES:
        (shim / p).symlink_to(tree / p)
    return shim.parent


def run_bench(tree: Path, shim: Path, argv: list[str], out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(shim), HF_HUB_OFFLINE="1")
    subprocess.run([str(ROOT / ".venv" / "bin" / "python"), *argv], cwd=tree, env=env,
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def figures(kind: str, res: dict) -> dict[str, float]:
    """What a user waits for in one result: ``{name: ms or s}``."""
    out = {}
    if kind == "load":
        for size in res["sizes"]:
            for m in ("encache.first", "encache.repeat", "encache.staged"):
                if m in size["methods"]:
                    out[f"load {size['label']} {m.split('.')[1]} (ms)"] = \
                        size["methods"][m]["ms"]["p50"]
    elif kind == "handoff":
        for size in res["sizes"]:
            out[f"handoff {size['label']} (ms)"] = \
                size["variants"]["wake"]["visible_to_ready_ms"]["p50"]
    else:
        for r in res["results"]:
            if r["name"] in ("encache stats --json -j1", "encache list --json", "encache size"):
                out[f"{r['name'].replace('encache ', '')} (s)"] = r["min_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=BASE)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cli-entries", type=int, default=20_000)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "restructure")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="encache-bench-restructure-"))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    base_rev = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    load0 = loadavg()
    try:
        trees = {"before": tree_at(a.base, tmp / "base"), "after": ROOT}
        shims = {k: shim_of(t) for k, t in trees.items()}
        store = tmp / "cli-store"
        samples: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
        for r in range(a.rounds):
            for which in (("before", "after") if r % 2 == 0 else ("after", "before")):
                o = tmp / f"{which}-{r}"
                benches = {
                    "load": (["scripts/bench/load_bench.py", "--rounds", "3", "--target-mb", "32",
                              "--no-plot", "--out", str(o) + "-load", "--tmpdir", str(tmp)],
                             Path(str(o) + "-load.json")),
                    "handoff": (["scripts/bench/handoff_bench.py", "--entries", "12",
                                 "--out", str(o) + "-handoff", "--tmpdir", str(tmp)],
                                Path(str(o) + "-handoff.json")),
                    "cli": (["scripts/bench/cli_bench.py", "--entries", str(a.cli_entries),
                             "--repeats", "2", "--store", str(store), "--out", str(o) + "-cli",
                             "--skip", "full read,safe_open,no header index,-j2"],
                            Path(str(o) + "-cli.json")),
                }
                for kind, (cmd, out) in benches.items():
                    print(f"round {r} {which}: {kind}", file=sys.stderr, flush=True)
                    for name, v in figures(kind, run_bench(trees[which], shims[which],
                                                           cmd, out)).items():
                        samples[which].setdefault(name, []).append(v)
        rows = {}
        for name, xs in samples["after"].items():
            before = statistics.median(samples["before"][name])
            after = statistics.median(xs)
            rows[name] = {"before": round(before, 4), "after": round(after, 4),
                          "ratio": round(after / before, 3) if before else None,
                          "before_runs": samples["before"][name], "after_runs": xs}
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "base")], cwd=ROOT,
                       capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    result = {"benchmark": "load, EPD hand-off and CLI: before / after a restructuring",
              "machine": machine(), "loadavg": [load0, loadavg()],
              "params": {"before": base_rev, "after": head, "rounds": a.rounds,
                         "cli_entries": a.cli_entries,
                         "method": "each benchmark alternately under each commit's tree; "
                                   "medians over rounds; ratio = after / before"},
              "rows": rows}
    a.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, a.out.with_suffix(".png"))
    for name, row in rows.items():
        print(f"{name:40s} {row['before']:10.4f} {row['after']:10.4f}  x{row['ratio']}")
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    names = list(rows)
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(names) + 1.5))
    ax.barh(range(len(names)), [rows[n]["ratio"] or 0 for n in names], color="#4a7")
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(range(len(names)), [f"{n}: {rows[n]['before']:g} -> {rows[n]['after']:g}"
                                      for n in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"after / before (median of {result['params']['rounds']} runs each; "
                  "1.0 = unchanged)")
    ax.set_title(f"{result['params']['before']} -> {result['params']['after']}: "
                 "load, EPD hand-off, CLI")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
