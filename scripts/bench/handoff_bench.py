"""EPD hand-off benchmark: from an encoder's answer to PD holding the entry, on one host.

In encoder disaggregation the encoder's request is answered once its entry's write is
visible (the temp file exists); the proxy forwards the request to PD at once, and PD,
finding the write in flight, waits for its bytes and loads them (docs/epd.md). This
measures that wait without servers: a producer process (a real ``EntryWriter`` over its
own ``DiskStore``, as an encoder's worker runs it) writes an entry when told and says
when it is visible ("the encoder's answer") and when its bytes are all in; the bench
process (PD) then, at once, asks its ``EntryLookup`` for the entry (``request``: in
flight, a background load) and waits until it is staged. Two PD lookups on the same
store, each with its own entries, paired per entry in alternating order:

  wake     the default: between looks at the write, the reader waits on the writer's
           steps (``DiskStore.in_flight_wait``: inotify on the entry's directory and the
           verified log; a look every ``IN_FLIGHT_WATCHED_S`` at the latest)
  poll     the store default's wait (``Store.in_flight_wait``): a look every
           ``IN_FLIGHT_POLL_S`` (1 ms)

Per load: ``visible_to_ready`` (the encoder's answer to PD holding the entry: what PD's
request waits for), ``whole_to_ready`` (from the moment the writer had all the bytes in:
PD's reaction), and ``looks`` (``read_in_flight`` calls: each is a directory scan and an
open of the growing file, CPU the writer on the same host competes for). Entries are
deleted after each pair, so their page cache is reused (on this VM a write into pages
the guest never touched is several times slower and would swamp the rest; see
performance.md §11). Sizes: 2.75 MB and 11 MB (one Gemma 3 image; four crops).

    .venv/bin/python scripts/bench/handoff_bench.py [--entries 30] [--out handoff]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import (BENCH_DIR, code_state, finish_run, loadavg, machine,  # noqa: E402
                            set_engine_env, summary, table)

SIZES = [("2.75 MB", (256, 5376)), ("11 MB", (1024, 5376))]
VARIANTS = ("wake", "poll")

PRODUCER = r"""
import os, sys, time
import numpy as np
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.vllm.writer import EntryWriter

def say(*words):  # one write per line: atomic on a pipe, whichever thread says it
    os.write(1, (" ".join(map(str, words)) + "\n").encode())

class Timed(DiskStore):
    def put(self, identifier, parts, **kw):
        on_written = kw.get("on_written")
        def written():
            say("whole", identifier, time.monotonic_ns())
            if on_written is not None:
                on_written()
        kw["on_written"] = written
        return super().put(identifier, parts, **kw)

writer = EntryWriter(Timed(sys.argv[1]))
arrays = {}
for line in sys.stdin:
    cmd, ident, rows = line.split()
    if cmd == "flush":
        writer.flush(60)
        say("flushed", ident, 0)
        continue
    rows = int(rows)
    if rows not in arrays:
        arrays[rows] = np.random.default_rng(rows).standard_normal((rows, 5376)).astype(np.float16)
    a = arrays[rows]
    landed = writer.submit(ident, lambda a=a: (a.view(np.uint8), "F16", a.shape), a.nbytes,
                           model="bench", vllm_version="0.32.0")
    assert landed.result(60)
    say("visible", ident, time.monotonic_ns())
writer.close()
"""


def run(entries: int = 30, out: str = "handoff", tmpdir: str | None = None) -> dict:
    set_engine_env()
    import uuid

    from encache.connectors.lookup import EntryLookup
    from encache.connectors.store.base import Store
    from encache.connectors.store.disk.layout import IN_FLIGHT_WATCHED_S
    from encache.connectors.store.disk.store import DiskStore

    class PollingStore(DiskStore):
        """The store default's wait between looks: a sleep of IN_FLIGHT_POLL_S."""
        in_flight_wait = Store.in_flight_wait

    info = machine()
    code0 = code_state()
    tmp = Path(tempfile.mkdtemp(prefix="encache-bench-handoff-", dir=tmpdir))
    root = tmp / "store"
    results = {"benchmark": "EPD hand-off on one host: encoder's write visible -> PD staged",
               "machine": info,
               "params": {"entries_per_variant": entries, "code": code0,
                          "in_flight_watched_s": IN_FLIGHT_WATCHED_S,
                          "method": "variants paired per entry, order alternating; entries "
                                    "deleted after each pair; producer in its own process"},
               "sizes": []}
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER, str(root / "s")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines: dict[tuple[str, str], int] = {}

    def read_until(tag: str, ident: str) -> int:
        while (tag, ident) not in lines:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the producer exited")
            t, i, ns = line.split()
            lines[(t, i)] = int(ns)
        return lines.pop((tag, ident))

    try:
        stores = {"wake": DiskStore(root / "s", fsync=False),
                  "poll": PollingStore(root / "s", fsync=False)}
        looks: dict[str, list[int]] = {v: [] for v in VARIANTS}
        for v, store in stores.items():
            real = store.read_in_flight

            def counted(identifier, checksum=lambda version: True, _real=real, _v=v):
                looks[_v][-1] += 1
                return _real(identifier, checksum)
            store.read_in_flight = counted
        lookups = {v: EntryLookup(s, counters_flush_s=3600, load_threads=2,
                                  index_refresh_s=3600, verify_ahead=False)
                   for v, s in stores.items()}
        for look in lookups.values():
            assert look.start_verify_done.wait(60)
        for label, shape in SIZES:
            rows = shape[0]
            print(f"[handoff] {label}: {entries} entries per variant", file=sys.stderr)
            rec = {v: {"visible_to_ready": [], "whole_to_ready": [], "looks": [],
                       "in_flight": 0} for v in VARIANTS}
            la0 = loadavg()
            for k in range(entries + 2):  # the first two pairs: untimed warm-up
                order = VARIANTS if k % 2 == 0 else VARIANTS[::-1]
                done = []
                for v in order:
                    ident = uuid.uuid4().hex * 2
                    looks[v].append(0)
                    proc.stdin.write(f"put {ident} {rows}\n")
                    proc.stdin.flush()
                    visible = read_until("visible", ident)
                    look = lookups[v]
                    state = look.request(ident)
                    look.wait([ident], 30)
                    ready = time.monotonic_ns()
                    assert look.is_ready(ident), (v, state)
                    whole = read_until("whole", ident)
                    if k >= 2:
                        r = rec[v]
                        r["visible_to_ready"].append((ready - visible) / 1e9)
                        r["whole_to_ready"].append((ready - whole) / 1e9)
                        r["looks"].append(looks[v][-1])
                        r["in_flight"] += state.name == "PENDING"
                    done.append(ident)
                proc.stdin.write(f"flush {done[0]} 0\n")
                proc.stdin.flush()
                read_until("flushed", done[0])
                for ident in done:
                    stores["wake"].delete(ident)
                    for look in lookups.values():
                        look.staging.discard(ident)
            size = {"label": label, "shape": list(shape), "dtype": "F16",
                    "tensor_bytes": rows * 5376 * 2, "loadavg": [la0, loadavg()],
                    "variants": {}}
            for v in VARIANTS:
                r = rec[v]
                size["variants"][v] = {
                    "visible_to_ready_ms": summary(r["visible_to_ready"], 1e3),
                    "whole_to_ready_ms": summary(r["whole_to_ready"], 1e3),
                    "looks": summary(r["looks"]), "loads_in_flight": r["in_flight"],
                    "loads": len(r["looks"])}
            w, p = rec["wake"], rec["poll"]
            size["pairs"] = {  # per pair: poll / wake (> 1: waking is faster)
                "visible_to_ready_ratio_median": statistics.median(
                    b / a for a, b in zip(w["visible_to_ready"], p["visible_to_ready"])),
                "whole_to_ready_ms_saved_median": statistics.median(
                    (b - a) * 1e3 for a, b in zip(w["whole_to_ready"], p["whole_to_ready"]))}
            results["sizes"].append(size)
        for look in lookups.values():
            look.close()
    finally:
        proc.stdin.close()
        proc.wait(60)
        shutil.rmtree(tmp, ignore_errors=True)
    return finish_run(results, out, code0, plot_handoff)


def report(results: dict) -> str:
    rows = []
    for s in results["sizes"]:
        for v, d in s["variants"].items():
            rows.append([s["label"], v, f"{d['visible_to_ready_ms']['p50']:.2f}",
                         f"{d['visible_to_ready_ms']['p90']:.2f}",
                         f"{d['whole_to_ready_ms']['p50']:.2f}", f"{d['looks']['p50']:.0f}",
                         f"{d['loads_in_flight']}/{d['loads']}"])
    return table(rows, ["size", "variant", "visible->ready p50 ms", "p90", "whole->ready p50",
                        "looks p50", "in flight"])


def plot_handoff(results: dict, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = [s["label"] for s in results["sizes"]]
    for ax, key, title in ((axes[0], "visible_to_ready_ms", "encoder's answer -> PD staged"),
                           (axes[1], "whole_to_ready_ms", "bytes all in -> PD staged")):
        for j, v in enumerate(VARIANTS):
            vals = [s["variants"][v][key]["p50"] for s in results["sizes"]]
            ax.bar([i + j * 0.4 for i in range(len(labels))], vals, 0.4, label=v)
        ax.set_xticks([i + 0.2 for i in range(len(labels))], labels)
        ax.set_ylabel("p50 ms (lower is better)")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("EPD hand-off on one host (2-vCPU VM): wake on the writer's steps vs poll")
    fig.tight_layout()
    fig.savefig(BENCH_DIR / name, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=int, default=30)
    ap.add_argument("--out", default="handoff")
    ap.add_argument("--tmpdir")
    a = ap.parse_args(argv)
    res = run(a.entries, a.out, a.tmpdir)
    print(report(res))
    for s in res["sizes"]:
        print(s["label"], {k: round(v, 3) for k, v in s["pairs"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
