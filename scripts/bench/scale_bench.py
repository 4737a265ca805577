"""A million entries as a normal day: the CLI and a consumer over a big store, in one run.

Disk store (``cli_bench.build_store``: N entries, default 1,000,000, each a sparse file of
a 256 x 2560 BF16 tensor, 1.25 MiB logical, ~4 KiB on disk), a fresh process per run,
after one warm-up, beside ``du -sb`` and ``find | wc -l`` on the same tree:

  encache stats --json / size --json    an unchanged store (the summary under its token)
  encache list --json                   streamed: time to its first byte and to its end
  encache purge --lora NAME --dry-run --json   the plan
  encache verify vs cat                 a separate store of real (non-sparse) 2.75 MB
                                        entries (256 x 5376 BF16), warm page cache:
                                        bytes per second of each, and the ratio

Redis and Redis Cluster (servers started here on free loopback ports, stopped by PID;
the cluster: 3 primaries, no replicas) at N small entries (16 x 64 F16, 2 KiB): the same
commands (stats, size, list, purge plan), times stated.

A consumer over each store, in a fresh process (``EntryLookup``, as a serving engine
builds it, verify-ahead off so only the index is measured): ready (index loaded), the
growth of its resident memory for the index, ``probably_stored`` (the scheduler's
per-item lookup) p50/p99, and one index refresh after 0, 1,000 and 100,000 changes
(new entries put by another handle) since the last refresh.

A 10M projection (``--fit-from`` a run at a smaller N: each time fitted a + b N through
the two sizes), labelled as one. Writes ``benchmarks/scale.json`` and ``scale.png``.

    scripts/bench/scale [--entries 1000000] [--redis-entries N] [--reuse] [--skip redis,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from cli_bench import ENCACHE, build_store  # noqa: E402

TARGETS = {"stats_s": 1.0, "size_s": 1.0, "list_s": 10.0, "purge_plan_s": 5.0,
           "verify_vs_cat": 0.8, "ready_s": 5.0, "rss_mb": 200.0, "lookup_p50_us": 1.0}
SMALL = (16, 64)  # the small entries of the Redis stores: 2 KiB of F16
VERIFY_SHAPE = (256, 5376)  # a Gemma 3 27B image: 2.75 MB of BF16


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- timing commands ---------------------------------------------------------------------

def timed(argv: list[str], *, shell: bool = False, ok=(0,), stream: bool = False) -> dict:
    """Run ``argv`` (a fresh process); wall and CPU seconds, and with ``stream`` the time
    to its first byte of output."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, shell=shell, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "ENCACHE_DEBUG": ""})
    first, nbytes = None, 0
    err = b""
    drain = threading.Thread(target=lambda: globals().__setitem__("_err", p.stderr.read()))
    drain.start()
    while True:
        chunk = p.stdout.read1(1 << 20) if stream else p.stdout.read()
        if not chunk:
            break
        if first is None:
            first = time.perf_counter() - t0
        nbytes += len(chunk)
        if not stream:
            break
    rc = p.wait()
    dt = time.perf_counter() - t0
    drain.join()
    err = globals().pop("_err", b"")
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc not in ok:
        raise SystemExit(f"{argv if not shell else argv} failed ({rc}): {err.decode()[-500:]}")
    out = {"seconds": round(dt, 4), "cpu_seconds": round((ru1.ru_utime - ru0.ru_utime)
                                                         + (ru1.ru_stime - ru0.ru_stime), 4),
           "stdout_bytes": nbytes, "loadavg_before": load0}
    if stream:
        out["first_byte_s"] = round(first if first is not None else dt, 4)
    return out


def run_cases(cases: list[dict], repeats: int) -> dict:
    """Each case once (untimed warm-up), then ``repeats`` times interleaved; the best and
    median per case."""
    for c in cases:
        timed(c["argv"], shell=c.get("shell", False), ok=c.get("ok", (0,)))
    runs: dict[str, list] = {c["name"]: [] for c in cases}
    for _ in range(repeats):
        for c in cases:
            r = timed(c["argv"], shell=c.get("shell", False), ok=c.get("ok", (0,)),
                      stream=c.get("stream", False))
            runs[c["name"]].append(r)
            print(f"  {c['name']:<48} {r['seconds']:8.3f} s  (cpu {r['cpu_seconds']:.2f} s, "
                  f"load {r['loadavg_before']:.1f})", file=sys.stderr)
    out = {}
    for c in cases:
        rs = runs[c["name"]]
        secs = [r["seconds"] for r in rs]
        row = {"kind": c["kind"], "min_s": min(secs), "median_s": statistics.median(secs),
               "min_cpu_s": min(r["cpu_seconds"] for r in rs), "runs": rs,
               "argv": c["argv"] if isinstance(c["argv"], str) else
               [a for a in c["argv"]]}
        if c.get("stream"):
            row["first_byte_min_s"] = min(r["first_byte_s"] for r in rs)
        out[c["name"]] = row
    return out


def cli_cases(url: str, lora: str, tree: str | None) -> list[dict]:
    cases = [
        {"name": "encache stats --json", "kind": "encache", "argv": [ENCACHE, "stats", "-s", url, "--json"]},
        {"name": "encache size --json", "kind": "encache", "argv": [ENCACHE, "size", "-s", url, "--json"]},
        {"name": "encache list --json", "kind": "encache", "stream": True,
         "argv": [ENCACHE, "list", "-s", url, "--json"]},
        {"name": f"encache purge --lora {lora} --dry-run --json", "kind": "encache",
         "argv": [ENCACHE, "purge", "-s", url, "--lora", lora, "--dry-run", "--json"]},
    ]
    if tree is not None:
        cases += [{"name": "baseline: du -sb", "kind": "baseline", "argv": ["du", "-sb", tree]},
                  {"name": "baseline: find | wc -l", "kind": "baseline", "shell": True,
                   "argv": f"find {tree} | wc -l"}]
    return cases


# -- the verify subset: real entries -----------------------------------------------------

def build_verify_store(root: Path, gib: float, reuse: bool) -> dict:
    """Real (non-sparse, random) 2.75 MB entries, ``gib`` GiB in all."""
    import numpy as np

    from encache.connectors.store.disk.store import DiskStore
    from encache.connectors.store.entry import encode_parts

    nbytes = 2 * VERIFY_SHAPE[0] * VERIFY_SHAPE[1]
    n = max(1, int(gib * 2**30 // nbytes))
    spec = {"entries": n, "shape": list(VERIFY_SHAPE), "dtype": "BF16", "sparse": False}
    marker = root / ".encache" / "bench.json"
    if reuse and marker.exists() and json.loads(marker.read_text()) == spec:
        return spec
    if root.exists():
        shutil.rmtree(root)
    store = DiskStore(root, fsync=False)
    rng = np.random.default_rng(0)
    for i in range(n):
        ident = f"v{i:063x}"
        data = memoryview(rng.integers(0, 255, nbytes, dtype=np.uint8).data)
        header, view = encode_parts(ident, data, "BF16", VERIFY_SHAPE, model=MODEL_V,
                                    vllm_version="0.32.0", hash_algo="blake3")
        store.put(ident, [header, view])
    marker.write_text(json.dumps(spec))
    return spec


MODEL_V = "google/gemma-3-27b-it"


VERIFY_IN_PROCESS = r"""
import json, sys, time
from encache.connectors.store import open_store
from encache.connectors.store.ops.verify import verify_store
st = open_store(sys.argv[1], create=False)
verify_store(st)
best = None
for _ in range(int(sys.argv[2])):
    t = time.perf_counter(); rep = verify_store(st); dt = time.perf_counter() - t
    best = dt if best is None else min(best, dt)
print(json.dumps({"seconds": best, "bytes": rep.bytes_checked, "clean": rep.clean}))
"""


def verify_vs_cat(root: Path, repeats: int) -> dict:
    files = f"find {root} -name '*.safetensors' -print0 | xargs -0 cat > /dev/null"
    du = int(subprocess.run(["du", "-sb", "--apparent-size", str(root)], capture_output=True,
                            text=True).stdout.split()[0])
    cases = [{"name": "encache verify", "kind": "encache",
              "argv": [ENCACHE, "verify", "-s", str(root), "--json", "-q"]},
             {"name": "baseline: cat of the same files", "kind": "baseline", "shell": True,
              "argv": files}]
    rows = run_cases(cases, repeats)
    v, c = rows["encache verify"]["min_s"], rows["baseline: cat of the same files"]["min_s"]
    p = subprocess.run([sys.executable, "-c", VERIFY_IN_PROCESS, str(root), str(repeats)],
                       capture_output=True, text=True, check=True)
    lib = json.loads(p.stdout)
    assert lib["clean"]
    return {"bytes": du, "results": rows,
            "verify_gb_s": round(du / v / 1e9, 3), "cat_gb_s": round(du / c / 1e9, 3),
            "verify_vs_cat": round(c / v, 3),
            "verify_read_gb_s": round(lib["bytes"] / lib["seconds"] / 1e9, 3),
            "verify_read_vs_cat": round(lib["bytes"] / lib["seconds"] / (du / c), 3),
            "note": "verify_vs_cat: the command end to end (interpreter start-up included: "
                    "~0.3 s); verify_read_*: the reading and checking itself "
                    "(ops.verify.verify_store in a warm process), against cat's bytes/s"}


# -- Redis / Cluster ---------------------------------------------------------------------

def fill_redis(url: str, n: int, threads: int = 6) -> float:
    """``n`` small entries (10 % under LoRA prefixes, as the disk store), put by
    ``threads`` threads; seconds taken."""
    import numpy as np

    from encache.connectors.store import open_store
    from encache.connectors.store.entry import encode

    arr = np.zeros(SMALL, dtype=np.float16).view(np.uint8)
    loras = ("invoices", "receipts", "forms")
    t0 = time.perf_counter()

    def work(k):
        store = open_store(url)
        for i in range(k, n, threads):
            ident = f"{i:064x}"
            lora = loras[i % 3] if i % 10 == 0 else None
            if lora:
                ident = f"{lora}:{ident}"
            store.put(ident, encode(ident, arr, "F16", SMALL, model="google/gemma-3-4b-it",
                                    lora=lora, vllm_version="0.32.0", hash_algo="blake3"))
            if k == 0 and i and i % (threads * 20000) == 0:
                print(f"  put {i:,} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return round(time.perf_counter() - t0, 2)


# -- the consumer ------------------------------------------------------------------------

CONSUMER = r"""
import gc, json, os, random, sys, time
import numpy as np
url, changes = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
def rss():
    gc.collect()
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('VmRSS:'):
                return int(line.split()[1]) * 1024
from encache.connectors.store import open_store
from encache.connectors.store.entry import encode
from encache.connectors.lookup.entry_lookup import EntryLookup
store = open_store(url)
store.index_version()
rss0 = rss()
t0 = time.perf_counter()
lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, store_stats_s=3600,
                 verify_ahead=False, load_threads=1)
assert lk.wait_index(600)
ready = time.perf_counter() - t0
rss1 = rss()
ids = list(lk.index._ids)
n = len(ids)
rng = random.Random(0)
sample = [ids[rng.randrange(n)] for _ in range(200000)] if n else []
del ids
pc = time.perf_counter_ns
over = []
for _ in range(20000):
    a = pc(); b = pc(); over.append(b - a)
over = sorted(over)[len(over) // 2]
def lat(fn):
    ts = []
    for i in sample:
        a = pc(); fn(i); b = pc(); ts.append(b - a - over)
    ts.sort()
    t0 = time.perf_counter()
    for i in sample:
        fn(i)
    mean = (time.perf_counter() - t0) / len(sample)
    return {"p50_us": ts[len(ts) // 2] / 1e3, "p99_us": ts[int(len(ts) * 0.99)] / 1e3,
            "mean_us": round(mean * 1e6, 4)}
lookups = {"probably_stored": lat(lk.probably_stored), "index.holds": lat(lk.index.holds)}
writer = store.reopen()
if hasattr(writer, "fsync"):
    writer.fsync = False  # (a producer's puts, less the flush to the device)
arr = np.zeros((16, 64), dtype=np.float16).view(np.uint8)
refresh = {}
for k in changes:
    made = [f"scale-change:{k}:{i:08d}" for i in range(k)]
    for ident in made:
        writer.put(ident, encode(ident, arr, "F16", (16, 64), model="bench"))
    lk.index.listing.ended = 0.0  # due now: time the refresh itself, not the pacing
    listings = lk.index.listings
    t0 = time.perf_counter(); c0 = time.thread_time()
    new = lk.index.refresh()
    dt, cpu = time.perf_counter() - t0, time.thread_time() - c0
    ok = all(lk.index.holds(i) for i in made[:1000])
    refresh[str(k)] = {"seconds": round(dt, 4), "cpu_seconds": round(cpu, 4), "new": len(new),
                       "listed": lk.index.listings - listings, "sees_the_changes": ok}
    writer.delete_many(made)
    lk.index.listing.ended = 0.0
    lk.index.refresh()
lk.close()
print(json.dumps({"entries": n, "ready_s": round(ready, 4), "rss_before_mb": round(rss0 / 2**20, 1),
                  "rss_after_mb": round(rss1 / 2**20, 1), "rss_growth_mb": round((rss1 - rss0) / 2**20, 1),
                  "timer_overhead_ns": over, "lookups": lookups, "refresh": refresh}))
"""


def consumer(url: str, changes: list[int]) -> dict:
    p = subprocess.run([sys.executable, "-c", CONSUMER, url, ",".join(map(str, changes))],
                       capture_output=True, text=True, env={**os.environ, "ENCACHE_DEBUG": ""})
    if p.returncode != 0:
        raise SystemExit(f"consumer over {url} failed: {p.stderr[-1500:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"  consumer: ready {out['ready_s']} s, RSS +{out['rss_growth_mb']} MB, "
          f"lookup p50 {out['lookups']['probably_stored']['p50_us']:.3f} us, refresh "
          + ", ".join(f"{k}: {v['seconds']} s" for k, v in out["refresh"].items()), file=sys.stderr)
    return out


# -- summary, projection, plot -----------------------------------------------------------

def summarize(backend: dict, lora: str) -> dict:
    r = backend.get("cli", {})
    get = lambda name, k="min_s": r.get(name, {}).get(k)  # noqa: E731
    s = {"entries": backend["entries"],
         "stats_s": get("encache stats --json"), "size_s": get("encache size --json"),
         "list_s": get("encache list --json"),
         "list_first_byte_s": get("encache list --json", "first_byte_min_s"),
         "purge_plan_s": get(f"encache purge --lora {lora} --dry-run --json"),
         "du_s": get("baseline: du -sb"), "find_wc_s": get("baseline: find | wc -l")}
    c = backend.get("consumer")
    if c:
        s.update(ready_s=c["ready_s"], rss_mb=c["rss_growth_mb"],
                 lookup_p50_us=round(c["lookups"]["probably_stored"]["p50_us"], 4),
                 lookup_p99_us=round(c["lookups"]["probably_stored"]["p99_us"], 4),
                 refresh_s={k: v["seconds"] for k, v in c["refresh"].items()})
    met = {}
    for k, target in TARGETS.items():
        v = s.get(k)
        if v is not None:
            met[k] = v >= target if k == "verify_vs_cat" else v <= target
    s["targets_met"] = met
    return s


def project(small: dict, big: dict, n: int = 10_000_000) -> dict:
    """Each plain time of ``big``'s summary fitted a + b N through the two sizes."""
    out = {"label": "PROJECTION, not a measurement: each time fitted linearly (a + b N) "
                    f"through the runs at {small['entries']:,} and {big['entries']:,} entries",
           "entries": n}
    for k, v in big.items():
        w = small.get(k)
        if isinstance(v, (int, float)) and isinstance(w, (int, float)) \
                and k not in ("entries", "verify_vs_cat", "verify_read_vs_cat") \
                and not isinstance(v, bool):
            b = (v - w) / (big["entries"] - small["entries"])
            out[k] = round(max(v, v + b * (n - big["entries"])), 3)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["stats_s", "size_s", "list_s", "purge_plan_s", "du_s", "find_wc_s", "ready_s"]
    backends = [b for b in ("disk", "redis", "cluster") if b in result["backends"]]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    ax = axes[0]
    w = 0.8 / max(1, len(backends))
    for j, b in enumerate(backends):
        s = result["backends"][b]["summary"]
        vals = [s.get(k) or 0 for k in names]
        bars = ax.bar([i + (j - (len(backends) - 1) / 2) * w for i in range(len(names))], vals, w,
                      label=f"{b} ({s['entries']:,} entries)")
        ax.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    for i, k in enumerate(names):
        t = TARGETS.get(k)
        if t:
            ax.hlines(t, i - 0.45, i + 0.45, colors="red", linestyles="dashed")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), [k[:-2].replace("_", " ") for k in names], fontsize=8)
    ax.set_ylabel("seconds (best run), log; red: the issue's target")
    ax.legend(fontsize=7)
    ax.set_title("CLI commands and consumer start-up (du / find: the disk tree)", fontsize=9)
    ax = axes[1]
    for b in backends:
        c = result["backends"][b].get("consumer")
        if not c:
            continue
        ks = list(c["refresh"])
        ax.plot([int(k) for k in ks], [max(c["refresh"][k]["seconds"], 1e-5) for k in ks],
                marker="o", label=b)
    ax.set_xscale("symlog", linthresh=1000)
    ax.set_yscale("log")
    ax.set_xlabel("changes since the last refresh")
    ax.set_ylabel("one index refresh, seconds")
    ax.legend(fontsize=7)
    ax.set_title("consumer index refresh cost", fontsize=9)
    v = result.get("verify")
    fig.suptitle(f"encache at scale; {result['machine']['cpus']} CPUs, load "
                 f"{result['machine']['loadavg_at_start'][0]}–{result['machine']['loadavg_at_end'][0]}"
                 + (f"; verify {v['verify_gb_s']} GB/s vs cat {v['cat_gb_s']} GB/s "
                    f"({v['verify_vs_cat']}x)" if v else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--redis-entries", type=int, default=None, help="default: --entries")
    ap.add_argument("--cluster-entries", type=int, default=None, help="default: --redis-entries")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--verify-gib", type=float, default=6.0)
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the disk stores of an earlier run where their spec matches")
    ap.add_argument("--skip", default="", help="comma-separated: disk,verify,redis,cluster,consumer")
    ap.add_argument("--changes", default="0,1000,10000,100000",
                    help="index refresh after this many changes (each at most N/2)")
    ap.add_argument("--fit-from", type=Path, default=None,
                    help="a scale JSON at a smaller N: the 10M projection is fitted through both")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "scale")
    ap.add_argument("--keep", action="store_true",
                    help="carry what --skip leaves out over from the JSON at --out (each "
                         "part keeps the date it was measured)")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    n = args.entries
    rn = args.redis_entries or n
    cn = args.cluster_entries or rn
    lora = "invoices"
    result = {"benchmark": "encache at scale: CLI and consumer over a big store",
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform(), "loadavg_at_start": loadavg(),
                          "note": "a shared machine: other work ran beside it (the load "
                                  "average); compare ratios and CPU seconds"},
              "targets": TARGETS, "backends": {}}

    def changes_for(k):
        return [c for c in map(int, args.changes.split(",")) if c <= k // 2]

    if "disk" not in skip:
        root = tmp / f"encache-bench-cli-{n}"
        if not args.reuse and root.exists():
            shutil.rmtree(root)
        print(f"disk: building / reusing {root} ({n:,} entries)", file=sys.stderr)
        t0 = time.perf_counter()
        spec = build_store(root, n)
        built = time.perf_counter() - t0
        du = int(subprocess.run(["du", "-sb", str(root)], capture_output=True, text=True).stdout.split()[0])
        disk = {"entries": n, "store": {**spec, "path": str(root), "du_bytes": du,
                                        "entry": "sparse file: 256 x 2560 BF16 (1.25 MiB "
                                                 "logical, ~4 KiB on disk)",
                                        "build_s": round(built, 1)}}
        disk["cli"] = run_cases(cli_cases(str(root), lora, str(root)), args.repeats)
        if "consumer" not in skip:
            disk["consumer"] = consumer(str(root), changes_for(n))
        disk["summary"] = summarize(disk, lora)
        result["backends"]["disk"] = disk
    if "verify" not in skip:
        vroot = tmp / f"encache-bench-verify-{args.verify_gib:g}g"
        print(f"verify: building / reusing {vroot} ({args.verify_gib} GiB)", file=sys.stderr)
        vspec = build_verify_store(vroot, args.verify_gib, args.reuse)
        result["verify"] = {"store": {**vspec, "path": str(vroot)}, **verify_vs_cat(vroot, args.repeats)}
        if "disk" in result["backends"]:
            s = result["backends"]["disk"]["summary"]
            s["verify_vs_cat"] = result["verify"]["verify_vs_cat"]
            s["verify_read_vs_cat"] = result["verify"]["verify_read_vs_cat"]
            s["targets_met"]["verify_vs_cat"] = s["verify_vs_cat"] >= TARGETS["verify_vs_cat"]
            s["targets_met"]["verify_read_vs_cat"] = (s["verify_read_vs_cat"]
                                                      >= TARGETS["verify_vs_cat"])
    from redis_fixture import RedisServer  # (tests/: the suite's real servers)
    from redis_cluster_fixture import LocalCluster
    servers = {
        "redis": (rn, "redis-server, one process",
                  lambda: RedisServer(config={"save": "", "appendonly": "no"})),
        "cluster": (cn, "Redis Cluster, 3 primaries, no replicas",
                    lambda: LocalCluster(primaries=3, replicas=0,
                                         config={"save": "", "appendonly": "no"})),
    }
    for kind, (n, what, start) in servers.items():
        if kind in skip:
            continue
        server = start()
        try:
            print(f"{kind}: filling {n:,} small entries", file=sys.stderr)
            fill = fill_redis(server.url, n)
            b = {"entries": n, "fill_s": fill, "entry": "16 x 64 F16 (2 KiB)", "server": what}
            b["cli"] = run_cases(cli_cases(server.url, lora, None), args.repeats)
            if "consumer" not in skip:
                b["consumer"] = consumer(server.url, changes_for(n))
            b["summary"] = summarize(b, lora)
            result["backends"][kind] = b
        finally:
            server.stop()
    for b in result["backends"].values():
        b["measured"] = result["date"]
    if "verify" in result:
        result["verify"]["measured"] = result["date"]
    if args.keep and args.out.with_suffix(".json").exists():
        old = json.loads(args.out.with_suffix(".json").read_text())
        for kind, b in old.get("backends", {}).items():
            if kind in skip:
                result["backends"].setdefault(kind, {**b, "measured": b.get("measured", old["date"])})
        if "verify" in skip and "verify" in old:
            result["verify"] = {**old["verify"], "measured": old["verify"].get("measured", old["date"])}
        if "disk" in skip and "projection_10m_disk" in old:
            result["projection_10m_disk"] = old["projection_10m_disk"]
        disk = result["backends"].get("disk")
        if disk is not None and "verify" in result:  # (the disk summary carries verify's ratio)
            for k in ("verify_vs_cat", "verify_read_vs_cat"):
                disk["summary"][k] = result["verify"][k]
                disk["summary"]["targets_met"][k] = result["verify"][k] >= TARGETS["verify_vs_cat"]
    if args.fit_from and "disk" in result["backends"]:
        small = json.loads(args.fit_from.read_text())["backends"]["disk"]["summary"]
        big = result["backends"]["disk"]["summary"]
        if small["entries"] < big["entries"]:
            result["projection_10m_disk"] = project(small, big)
    result["machine"]["loadavg_at_end"] = loadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({b: v["summary"] for b, v in result["backends"].items()}, indent=2))
    if "projection_10m_disk" in result:
        print(json.dumps(result["projection_10m_disk"], indent=2))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    gc.collect()
    main()
