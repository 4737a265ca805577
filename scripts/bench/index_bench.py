"""A consumer's background index work on a big disk store, side by side in one run.

baseline  list every entry at every refresh (what a consumer did before
          ``DiskStore.index_version()``; ``StoreIndex.refresh`` with no token)
encache   ``StoreIndex.refresh``: two ``stat`` calls for the store's token, a listing
          only when it moved, at most while listing costs 5 % of the time

Two phases on the same store (built by ``cli_bench.build_store``: 100,000 entries by
default, reused if present), each refreshing every ``--interval`` seconds (the connector's
default ``index_refresh_s`` is 5) with both methods in the same tick:

* idle: nothing writes;
* writing: a writer process puts small entries at ``--rate`` per second the whole time
  (a producer filling the store while consumers serve); its entries are removed after.

Reported per phase: CPU seconds spent refreshing per minute of wall time (thread CPU
time around each call), listings, and the ratio baseline / encache; JSON + PNG under
benchmarks/.

    .venv/bin/python scripts/bench/index_bench.py [--entries 100000] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

WRITER = """
import sys, time
import numpy as np
from encache.connectors.store import encode
from encache.connectors.store.disk.store import DiskStore
store = DiskStore(sys.argv[1], fsync=False)
rate, seconds = float(sys.argv[2]), float(sys.argv[3])
arr = np.zeros((16, 64), dtype=np.float16)
t0, n = time.monotonic(), 0
while time.monotonic() - t0 < seconds:
    ident = f"bench-index:{n:08d}"
    store.put(ident, encode(ident, arr.view(np.uint8), "F16", arr.shape, model="bench"))
    n += 1
    time.sleep(max(0.0, t0 + n / rate - time.monotonic()))
print(n)
"""


def run_phase(store, seconds: float, interval: float, writer: subprocess.Popen | None) -> dict:
    from encache.connectors.lookup.index import StoreIndex

    index = StoreIndex(store, refresh_s=interval)
    index.refresh()  # the start-up listing, untimed for both
    index.mark_ready()
    cpu = {"baseline": 0.0, "encache": 0.0}
    listings = {"baseline": 0, "encache": 0}
    ticks = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        order = ("baseline", "encache") if ticks % 2 == 0 else ("encache", "baseline")
        for method in order:
            c0 = time.thread_time()
            if method == "baseline":
                set(store.identifiers())
                listings["baseline"] += 1
            else:
                before = index.listings
                index.refresh()
                listings["encache"] += index.listings - before
            cpu[method] += time.thread_time() - c0
        ticks += 1
        time.sleep(max(0.0, t0 + ticks * interval - time.monotonic()))
    wall = time.monotonic() - t0
    written = None
    if writer is not None:
        out, _ = writer.communicate(timeout=seconds + 60)
        written = int(out.strip() or 0)
    per_min = {m: round(cpu[m] * 60 / wall, 4) for m in cpu}
    return {"wall_s": round(wall, 2), "refreshes": ticks, "cpu_s": {m: round(v, 4) for m, v in cpu.items()},
            "cpu_s_per_min": per_min, "listings": listings, "written_meanwhile": written,
            "cpu_share_of_one_core": {m: round(cpu[m] / wall, 4) for m in cpu},
            "ratio_baseline_over_encache": (round(cpu["baseline"] / cpu["encache"], 1)
                                            if cpu["encache"] > 0 else None),
            "loadavg_end": os.getloadavg()}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(result["phases"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    w = 0.38
    for k, method in enumerate(("baseline", "encache")):
        vals = [result["phases"][p]["cpu_s_per_min"][method] for p in phases]
        bars = ax.bar([i + (k - 0.5) * w for i in range(len(phases))], vals, w,
                      label={"baseline": "list at every refresh (before)",
                             "encache": "token + 5 % bound"}[method])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(phases)), [f"{p}\n(ratio {result['phases'][p]['ratio_baseline_over_encache']}x)"
                                        for p in phases])
    ax.set_ylabel("CPU s per minute (refresh thread)")
    ax.set_title(f"consumer index refresh, {result['store']['entries']:,} entries, "
                 f"every {result['params']['interval_s']} s")
    ax.legend(fontsize=8, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--store", type=Path, default=None,
                    help="the synthetic store (default: $TMPDIR/encache-bench-cli-N, shared "
                         "with cli_bench)")
    ap.add_argument("--seconds", type=float, default=60.0, help="per phase")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes")
    ap.add_argument("--rate", type=float, default=20.0, help="writer puts per second")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "index")
    args = ap.parse_args(argv)

    from cli_bench import build_store, default_store
    from serving_common import code_state

    from encache.connectors.store.disk.store import DiskStore

    path = args.store or default_store(args.entries)
    print(f"building / reusing {path} ({args.entries:,} entries)", file=sys.stderr)
    spec = build_store(path, args.entries)
    store = DiskStore(path, fsync=False)
    result = {"benchmark": "consumer index refresh on a big disk store: list every refresh "
                           "vs token + 5 % bound",
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform(), "loadavg_at_start": os.getloadavg()},
              "params": {"interval_s": args.interval, "seconds": args.seconds,
                         "writer_rate_per_s": args.rate, "code": code_state(),
                         "method": "both methods in every tick, order alternating; thread "
                                   "CPU time around each call"},
              "store": {**spec, "path": str(path)},
              "phases": {}}
    print("idle …", file=sys.stderr)
    result["phases"]["idle"] = run_phase(store, args.seconds, args.interval, None)
    print("writing …", file=sys.stderr)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(args.rate),
                               str(args.seconds)], stdout=subprocess.PIPE, text=True)
    try:
        result["phases"]["writing"] = run_phase(store, args.seconds, args.interval, writer)
    finally:
        writer.kill()
        removed = sum(store.delete(i) for i in list(store.identifiers())
                      if i.startswith("bench-index:"))
        print(f"removed the writer's {removed} entries", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({p: {k: v for k, v in r.items() if k in ("cpu_s_per_min", "listings",
                                                              "ratio_baseline_over_encache")}
                      for p, r in result["phases"].items()}, indent=2))


if __name__ == "__main__":
    main()
