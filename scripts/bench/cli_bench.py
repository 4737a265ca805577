"""Benchmark the management CLI over a synthetic store (default 100,000 entries).

Measures, as a user runs them (a fresh process each time, so interpreter start-up and
imports are included), against naive baselines side by side:

  encache stats --json (-j1, and -jN processes)   header-only scan + consumer counters
  encache list --json                             header-only scan, one JSON record per entry
  encache size                                    file sizes only (no header read)
  baseline: du -sb                                file sizes only, in C
  baseline: full read + decode (Python)           read every entry whole to learn its model
  baseline: safetensors.safe_open per entry       the official library reading each header

Writes ``benchmarks/cli.json`` (every run, with the machine's load average around it, since
a shared machine's timings are noisy: compare the *min* columns, and the CPU seconds, which
load disturbs far less) and ``benchmarks/cli.png``.

    scripts/bench/cli [--entries 100000] [--repeats 3] [--store DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
ENCACHE = str(VENV_BIN / "encache") if (VENV_BIN / "encache").exists() else "encache"

MODELS = ("google/gemma-3-4b-it", "Qwen/Qwen2.5-VL-3B-Instruct")
LORAS = ("invoices", "receipts", "forms")
# One Gemma-3 image: 256 soft tokens x 2560 hidden, BF16 = 1.25 MiB per entry, so a
# 100,000-entry store is 125 GiB as a real one would be. The files are *sparse* (header
# written, tensor left as a hole reading back as zeros, which the recorded checksum
# matches): the store costs < 1 GB of disk, and a full read still has to move every byte.
SHAPE = (256, 2560)
DTYPE = "BF16"


# -- the synthetic store -------------------------------------------------------------------

def default_store(n: int) -> Path:
    """Where the synthetic ``n``-entry store is built and reused ($TMPDIR), by this
    benchmark and by ``index_bench.py``."""
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"encache-bench-cli-{n}"


def build_store(root: Path, n: int) -> dict:
    """``n`` entries: 90 % base-model, 10 % LoRA, two models, 1 % legacy, 30 days of ages."""
    from encache.connectors.store.disk.store import DiskStore
    from encache.connectors.store.entry import encode_parts, parse_header

    marker = root / ".encache" / "bench.json"
    spec = {"entries": n, "shape": list(SHAPE), "dtype": DTYPE, "sparse": True, "version": 2}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return spec
    if root.exists():
        shutil.rmtree(root)
    store = DiskStore(root, fsync=False)
    nbytes = 2 * SHAPE[0] * SHAPE[1]
    zeros = memoryview(bytes(nbytes))
    # every tensor is the same zeros: hash them once (1M entries build in minutes, not 25)
    from encache.connectors.store import entry as codec
    zeros_sum, real_checksum = codec.checksum(zeros), codec.checksum
    codec.checksum = lambda data, algo=codec.CHECKSUM_ALGO: (
        zeros_sum if getattr(data, "obj", None) is zeros.obj and algo == codec.CHECKSUM_ALGO else real_checksum(data, algo))
    legacy = _legacy_header(nbytes)
    now = time.time()
    t0 = time.perf_counter()
    for i in range(n):
        ident = f"{i:064x}"
        if i % 100 == 99:
            header = legacy
        else:
            lora = LORAS[i % 3] if i % 10 == 0 else None
            if lora:
                ident = f"{lora}:{ident}"
            header, _ = encode_parts(ident, zeros, DTYPE, SHAPE, model=MODELS[i % 2], lora=lora,
                                     vllm_version="0.32.0", hash_algo="blake3",
                                     created=now - (i % 30) * 86400 - i * 1e-3)
        path = store.entry_path(ident)
        path.parent.mkdir()
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(len(header) + nbytes)  # the tensor: a hole of zeros
        if i and i % 10000 == 0:
            print(f"  built {i:,} entries ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    codec.checksum = real_checksum
    meta, _ = parse_header(path.read_bytes()[:65536], total_size=path.stat().st_size)
    assert meta.shape == SHAPE
    store.add_counters({"hits": 81234, "misses": 4321, "load_seconds": 81234 * 0.0021,
                        "bytes_loaded": 81234 * nbytes})
    marker.write_text(json.dumps(spec))
    return spec


def _legacy_header(nbytes: int) -> bytes:
    """An ECExampleConnector entry's header: plain safetensors, no encache metadata."""
    import struct

    header = {"ec_cache": {"dtype": DTYPE, "shape": list(SHAPE), "data_offsets": [0, nbytes]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


# -- baselines (run as `python -c`) ----------------------------------------------------------

FULL_READ = r"""
import os, sys, json
from collections import Counter
from encache.connectors.store.entry import decode
root, limit = sys.argv[1], int(sys.argv[2])
models, total, n = Counter(), 0, 0
for d in os.scandir(root):
    if n >= limit:
        break
    if d.name.startswith('.') or not d.is_dir():
        continue
    try:
        with open(os.path.join(d.path, 'encoder_cache.safetensors'), 'rb') as f:
            blob = f.read()
    except FileNotFoundError:
        continue
    meta, _ = decode(blob, verify=False)
    models[meta.model] += 1
    total += len(blob)
    n += 1
print(json.dumps({"entries": n, "bytes": total, "models": len(models)}))
"""

SAFE_OPEN = r"""
import os, sys, json
from collections import Counter
from safetensors import safe_open
root = sys.argv[1]
models, total, n = Counter(), 0, 0
for d in os.scandir(root):
    if d.name.startswith('.') or not d.is_dir():
        continue
    p = os.path.join(d.path, 'encoder_cache.safetensors')
    try:
        with safe_open(p, framework='numpy') as f:
            md = f.metadata() or {}
            f.get_slice('ec_cache').get_shape()
    except FileNotFoundError:
        continue
    models[md.get('model')] += 1
    total += os.path.getsize(p)
    n += 1
print(json.dumps({"entries": n, "bytes": total, "models": len(models)}))
"""


#: the full-read baseline reads this many entries and is scaled to the whole store (reading
#: 125 GiB on a shared machine for every run would take many minutes and tell nothing more)
FULL_READ_SAMPLE = 10_000


def cases(store: Path, workers: int, entries: int) -> list[dict]:
    s = str(store)
    py = sys.executable
    sample = min(entries, FULL_READ_SAMPLE)
    index = store / ".encache" / "header-index.pickle"

    def drop_index():
        with contextlib.suppress(FileNotFoundError):
            index.unlink()
    return [
        {"name": "encache stats --json -j1", "kind": "encache", "what": "stats",
         "argv": [ENCACHE, "stats", "-s", s, "--json", "-j1"]},
        {"name": "encache stats --json -j1 (no header index)", "kind": "encache",
         "what": "stats", "argv": [ENCACHE, "stats", "-s", s, "--json", "-j1"],
         "pre": drop_index},  # a first scan: reads every header, then writes the index
        {"name": f"encache stats --json -j{workers}", "kind": "encache", "what": "stats",
         "argv": [ENCACHE, "stats", "-s", s, "--json", f"-j{workers}"]},
        {"name": "encache list --json", "kind": "encache", "what": "list",
         "argv": [ENCACHE, "list", "-s", s, "--json"]},
        {"name": "encache size", "kind": "encache", "what": "size",
         "argv": [ENCACHE, "size", "-s", s]},
        {"name": "baseline: du -sb", "kind": "baseline", "what": "size",
         "argv": ["du", "-sb", s]},
        {"name": "baseline: full read + decode"
                 + (f" ({sample:,} sampled, scaled)" if sample < entries else ""),
         "kind": "baseline", "what": "stats", "argv": [py, "-c", FULL_READ, s, str(sample)],
         "repeats": 1, "scale": entries / sample},
        {"name": "baseline: safetensors.safe_open", "kind": "baseline", "what": "stats",
         "argv": [py, "-c", SAFE_OPEN, s]},
    ]


def run_cases(cases_: list[dict], repeats: int) -> list[dict]:
    """Every case once per repetition, interleaved (a shared machine's load then hits
    encache and the baselines alike); returns one aggregated row per case."""
    runs: dict[str, list] = {c["name"]: [] for c in cases_}
    for rep in range(repeats):
        for c in cases_:
            if rep < c.get("repeats", repeats):
                runs[c["name"]] += run_case(c, 1, aggregate=False)
    return [_aggregate(c, runs[c["name"]]) for c in cases_]


def run_case(case: dict, repeats: int, aggregate: bool = True):
    runs = []
    for _ in range(case.get("repeats", repeats) if aggregate else repeats):
        if case.get("pre"):
            case["pre"]()
        load0 = os.getloadavg()[0]
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        p = subprocess.run(case["argv"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env={**os.environ, "ENCACHE_DEBUG": ""})
        dt = time.perf_counter() - t
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        if p.returncode not in case.get("ok_codes", (0,)):
            raise SystemExit(f"{case['name']} failed ({p.returncode}): {p.stderr.decode()[-500:]}")
        runs.append({"seconds": round(dt, 4), "cpu_seconds": round(cpu, 4), "loadavg_before": load0,
                     "loadavg_after": os.getloadavg()[0], "stdout_bytes": len(p.stdout)})
        print(f"  {case['name']:<44} {dt:7.2f} s wall {cpu:7.2f} s cpu  (load {load0:.1f})",
              file=sys.stderr)
    return _aggregate(case, runs) if aggregate else runs


def _aggregate(case: dict, runs: list) -> dict:
    scale = case.get("scale", 1.0)
    if scale != 1.0:
        for r in runs:
            r["measured_seconds"], r["seconds"] = r["seconds"], round(r["seconds"] * scale, 4)
            r["cpu_seconds"] = round(r["cpu_seconds"] * scale, 4)
    secs = [r["seconds"] for r in runs]
    out = {k: v for k, v in case.items() if k not in ("argv", "ok_codes", "pre")}
    out.update(argv=[a if len(a) < 200 else "<script>" for a in case["argv"]], runs=runs,
               min_s=min(secs), median_s=statistics.median(secs),
               min_cpu_s=min(r["cpu_seconds"] for r in runs))
    return out


def plot(result: dict, path: Path) -> None:
    """Two panels: wall time (what a user waits) and CPU time (what load disturbs least)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    names = [r["name"] for r in rows]
    colors = ["#2b7bba" if r["kind"] == "encache" else "#b0b0b0" for r in rows]
    y = list(range(len(rows)))[::-1]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.55 * len(rows) + 2.0), sharey=True)
    panels = [("wall seconds (bar: best run, tick: median)",
               [r["min_s"] for r in rows], [r["median_s"] for r in rows]),
              ("CPU seconds of the process (best run)",
               [r.get("min_cpu_s", 0.0) for r in rows], None)]
    for ax, (label, best, med) in zip(axes, panels):
        ax.barh(y, best, color=colors)
        if med is not None:
            ax.scatter(med, y, color="black", marker="|", s=200, label="median", zorder=3)
            ax.legend(loc="lower right", fontsize=8)
        top = [max(b, m) for b, m in zip(best, med or best)]
        for yi, b, t in zip(y, best, top):
            ax.text(t * 1.08, yi, f"{b:.2f} s", va="center", fontsize=8)
        ax.set_xscale("log")
        ax.set_xlim(min(v for v in best if v > 0) * 0.5, max(top) * 5)
        ax.set_xlabel(label + ", log scale", fontsize=9)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(names, fontsize=8)
    n = result["store"]["entries"]
    gib = result["store"]["du_bytes"] / 2**30
    loads = [r[k] for row in rows for r in row["runs"] for k in ("loadavg_before", "loadavg_after")]
    fig.suptitle(f"encache CLI over a {n:,}-entry disk store ({gib:,.0f} GiB, warm page cache); "
                 f"a fresh process per run\n{result['machine']['cpus']} CPUs, "
                 f"load average {min(loads):.1f}–{max(loads):.1f} during the runs.   "
                 "Blue: encache, grey: naive baselines", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--store", type=Path, default=None,
                    help="where to build the synthetic store (default: $TMPDIR/encache-bench-cli-N)")
    ap.add_argument("--workers", type=int, default=max(2, os.cpu_count() or 1))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "cli")
    ap.add_argument("--skip", default="", help="comma-separated substrings of case names to skip")
    args = ap.parse_args(argv)
    load_at_start = os.getloadavg()
    store = args.store or default_store(args.entries)
    print(f"building / reusing {store} ({args.entries:,} entries)", file=sys.stderr)
    spec = build_store(store, args.entries)
    du = subprocess.run(["du", "-sb", str(store)], capture_output=True, text=True).stdout.split()[0]
    # one untimed pass: every run below starts from the same warm page cache
    subprocess.run(["du", "-sb", str(store)], capture_output=True)
    subprocess.run([ENCACHE, "stats", "-s", str(store), "--json", "-j1"], capture_output=True)
    cs = cases(store, args.workers, args.entries)
    if args.skip:
        cs = [c for c in cs if not any(k in c["name"] for k in args.skip.split(","))]
    results = run_cases(cs, args.repeats)
    by = {r["name"]: r for r in results}
    nan = {"min_s": None, "median_s": None, "runs": [{"stdout_bytes": None}], "min_cpu_s": None}
    for c in cases(store, args.workers, args.entries):
        by.setdefault(c["name"], nan)
    stats1 = by["encache stats --json -j1"]["min_s"]
    statsn = by[f"encache stats --json -j{args.workers}"]["min_s"] or stats1

    def vs_du(name):
        a, b = by[name]["median_s"], by["baseline: du -sb"]["median_s"]
        return round(a / b, 3) if a and b else None
    result = {
        "benchmark": "encache CLI over a synthetic disk store",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform(), "loadavg_at_start": load_at_start,
                    "method": "cases interleaved per repetition, a fresh process per run, "
                              "the load average before and after each run recorded; "
                              "compare medians, ratios and CPU seconds"},
        "store": {**spec, "path": str(store), "du_bytes": int(du),
                  "page_cache": "warm (one untimed pass first)"},
        "results": results,
        "summary": {
            "entries": args.entries,
            "stats_best_s": min(stats1, statsn),
            "stats_j1_s": stats1,
            f"stats_j{args.workers}_s": statsn,
            "list_json_s": by["encache list --json"]["min_s"],
            "list_json_bytes": by["encache list --json"]["runs"][0]["stdout_bytes"],
            "size_s": by["encache size"]["min_s"],
            "du_s": by["baseline: du -sb"]["min_s"],
            "full_read_s": next((r["min_s"] for r in results
                                 if r["name"].startswith("baseline: full read")), None),
            "stats_j1_median_s": by["encache stats --json -j1"]["median_s"],
            "stats_no_index_median_s": by["encache stats --json -j1 (no header index)"]["median_s"],
            "list_json_median_s": by["encache list --json"]["median_s"],
            "du_median_s": by["baseline: du -sb"]["median_s"],
            "stats_vs_du_median": vs_du("encache stats --json -j1"),
            "stats_no_index_vs_du_median": vs_du("encache stats --json -j1 (no header index)"),
            "list_json_vs_du_median": vs_du("encache list --json"),
            "safe_open_s": by["baseline: safetensors.safe_open"]["min_s"],
            "stats_entries_per_s": round(args.entries / min(stats1, statsn)),
            "cpu_s": {r["name"]: r["min_cpu_s"] for r in results},
        },
    }
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=2))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    main()
