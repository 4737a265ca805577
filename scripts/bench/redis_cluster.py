"""Benchmark — Redis Cluster vs one Redis node as the shared L2 (issue #13), side by side.

Everything runs in one process against real local servers started here (loopback, no
persistence), interleaved round by round so machine load hits both sides alike:

1. **Load throughput**: ``store.get`` + ``entry.decode(verify=True)`` (xxh3 over the tensor)
   + one copy of the tensor into a preallocated buffer — the bytes a consumer really
   moves per hit — on a single node vs a 3-primary cluster, sequential and with 4 loader
   threads (the connector's ``load_threads`` default). Entries are one Gemma-3 image each
   (256 x 2560 BF16 = 1.25 MiB).
2. **has_cache_item**: the real scheduler-side ``EncacheConnector`` built from a
   VllmConfig (tiny model) on each store, every entry staged as ``ensure_cache_available``
   leaves it; p50/p99 per call for hits and misses. Also ``contains()`` (one ``EXISTS``
   round trip) and the consumer's index refresh (``identifiers()``: SCAN of every primary).
3. **stats scaling**: ``encache stats``' data builder (header-only scan + counters +
   per-primary INFO) over the same N small entries on one node and on clusters of 1, 3
   and 5 primaries.

Writes ``benchmarks/redis_cluster.json`` and ``.png``; prints the tables.

    .venv/bin/python scripts/bench/redis_cluster.py [--entries 100] [--stats-entries 20000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import (code_changed, code_state, loadavg, machine,  # noqa: E402
                            set_engine_env, summary, table, write_json)

GEMMA_SHAPE = (256, 2560)  # one Gemma-3 image, BF16


def _fill(store, ids, parts_for) -> float:
    t0 = time.perf_counter()
    for i in ids:
        store.put(i, parts_for(i))
    return time.perf_counter() - t0


def bench_loads(stores: dict, entries: int, rounds: int) -> dict:
    import numpy as np

    from encache.connectors.store.entry import decode, encode_parts

    data = np.random.default_rng(0).integers(0, 255, GEMMA_SHAPE[0] * GEMMA_SHAPE[1] * 2,
                                             dtype=np.uint8)
    ids = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(entries)]
    fill = {}
    for name, s in stores.items():
        fill[name] = _fill(s, ids, lambda i: encode_parts(i, data, "BF16", GEMMA_SHAPE))
    nbytes = len(s.get(ids[0]))
    local = threading.local()

    def load(store, ident):
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.empty(data.nbytes, np.uint8)
        blob = store.get(ident)
        _, tensor = decode(blob, identifier=ident, verify=True)
        np.copyto(buf, np.frombuffer(tensor, np.uint8))

    res: dict = {name: {"seq": [], "par": []} for name in stores}
    pool = ThreadPoolExecutor(4)
    for r in range(rounds + 1):
        order = list(stores)
        random.Random(r).shuffle(order)
        for name in order:
            s = stores[name]
            t0 = time.perf_counter()
            for i in ids:
                load(s, i)
            t_seq = time.perf_counter() - t0
            t0 = time.perf_counter()
            list(pool.map(lambda i, s=s: load(s, i), ids))
            t_par = time.perf_counter() - t0
            if r:  # round 0 warms connections and pages
                res[name]["seq"].append(t_seq)
                res[name]["par"].append(t_par)
    pool.shutdown()
    out = {}
    for name, d in res.items():
        out[name] = {"fill_s": fill[name]}
        for mode in ("seq", "par"):
            best = min(d[mode])
            med = statistics.median(d[mode])
            out[name][mode] = {"seconds": d[mode], "entries_per_s_median": entries / med,
                               "mib_per_s_median": entries * nbytes / med / 2**20,
                               "mib_per_s_best": entries * nbytes / best / 2**20}
    return {"entries": entries, "entry_bytes": nbytes, "rounds": rounds, "stores": out}


def _vllm_config(model: str, extra: dict):
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig

    from encache.connectors.vllm import CONNECTOR_MODULE
    mc = ModelConfig(model=model, dtype="float32", max_model_len=256)
    tc = ECTransferConfig(ec_connector="EncacheConnector", ec_role="ec_consumer",
                          ec_connector_module_path=CONNECTOR_MODULE,
                          ec_connector_extra_config=extra)
    return VllmConfig(model_config=mc, ec_transfer_config=tc)


def bench_lookup(urls: dict, entries: int, rounds: int) -> dict:
    import numpy as np
    from serving_models import ensure_model
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from encache.connectors.store import open_store
    from encache.connectors.store.entry import encode_parts
    from encache.connectors.vllm.connector import EncacheConnector

    model = ensure_model("tiny")
    data = np.zeros((16, 64), np.float32).view(np.uint8)
    hits = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(entries)]
    misses = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(entries)]
    conns, stores = {}, {}
    out: dict = {"entries": entries, "rounds": rounds, "cases": {}}
    try:
        for name, url in urls.items():
            stores[name] = s = open_store(url)
            for i in hits:
                s.put(i, list(encode_parts(i, data, "F32", (16, 64))))
            conns[name] = c = EncacheConnector(
                _vllm_config(model, {"store": url, "index_refresh_s": 3600,
                                     "counters_flush_s": 3600}), ECConnectorRole.SCHEDULER)
            lk = c.lookup
            lk.wait_index(60)
            for i in hits:
                lk.request(i)
            lk.wait_idle(120)
            assert sum(lk.is_ready(i) for i in hits) == entries, name
        pc = time.perf_counter_ns
        samples = {(n, k): [] for n in urls for k in ("hit", "miss", "contains", "index")}
        for r in range(rounds + 1):
            order = list(urls)
            random.Random(r).shuffle(order)
            for name in order:
                fn = conns[name].has_cache_item
                for kind, ids, want in (("hit", hits, True), ("miss", misses, False)):
                    for i in ids:
                        t0 = pc()
                        got = fn(i)
                        t1 = pc()
                        if got is not want:
                            raise AssertionError(f"{name}: has_cache_item {kind} = {got}")
                        if r:
                            samples[(name, kind)].append(t1 - t0)
                    conns[name].build_connector_meta(None)
                s = stores[name]
                for i in hits[:200]:
                    t0 = pc()
                    s.contains(i)
                    if r:
                        samples[(name, "contains")].append(pc() - t0)
                t0 = pc()
                n = sum(1 for _ in s.identifiers())
                if r:
                    samples[(name, "index")].append(pc() - t0)
                assert n == entries, (name, n)
        for (name, kind), xs in samples.items():
            out["cases"][f"{name}.{kind}"] = {"store": name, "kind": kind,
                                              "us": summary(xs, 1e-3)}
    finally:
        for c in conns.values():
            try:
                c.shutdown()
            except Exception:
                pass
        for s in stores.values():
            s.delete_many(list(s.identifiers()))
            s.close()
    return out


def bench_stats(urls: dict, entries: int, repeats: int) -> dict:
    import numpy as np

    from encache.connectors.store.ops.report import build_stats
    from encache.connectors.store import open_store
    from encache.connectors.store.entry import encode_parts

    data = np.zeros((4, 64), np.float32).view(np.uint8)
    ids = [f"{k:064x}" for k in range(entries)]
    out: dict = {"entries": entries, "repeats": repeats, "stores": {}}
    stores = {name: open_store(url) for name, url in urls.items()}
    for name, s in stores.items():
        t = _fill(s, ids, lambda i: encode_parts(i, data, "F32", (4, 64), model="m"))
        out["stores"][name] = {"fill_s": t, "seconds": []}
    for r in range(repeats + 1):
        order = list(stores)
        random.Random(100 + r).shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            st = build_stats(stores[name], name)
            dt = time.perf_counter() - t0
            assert st["entries"] == entries, (name, st["entries"])
            if r:
                out["stores"][name]["seconds"].append(dt)
    for name, d in out["stores"].items():
        d["median_s"] = statistics.median(d["seconds"])
        d["entries_per_s"] = entries / d["median_s"]
        stores[name].close()
    return out


def run(entries: int, stats_entries: int, rounds: int, lookups: int, out: str) -> dict:
    set_engine_env()
    from redis_cluster_fixture import LocalCluster
    from redis_fixture import RedisServer

    info = machine()
    code0 = code_state()
    la0 = loadavg()
    single = RedisServer()
    clusters: dict[int, LocalCluster] = {}
    results: dict = {"benchmark": "Redis Cluster vs one node (issue #13)", "machine": info}
    try:
        for n in (1, 3, 5):
            clusters[n] = LocalCluster(n, 0)
        prefix = f"?prefix=b{uuid.uuid4().hex[:6]}:"
        single_url = single.url + prefix
        c3 = clusters[3].url_for(nodes=3) + prefix
        from encache.connectors.store import open_store
        loads = {"single": open_store(single_url), "cluster3": open_store(c3)}
        results["loads"] = bench_loads(loads, entries, rounds)
        for s in loads.values():
            s.delete_many(list(s.identifiers()))
            s.close()
        results["lookup"] = bench_lookup({"single": single_url, "cluster3": c3}, lookups, rounds)
        stats_urls = {"single": single.url + "?prefix=st:"}
        for n, c in clusters.items():
            stats_urls[f"cluster{n}"] = c.url_for(nodes=n) + "?prefix=st:"
        results["stats"] = bench_stats(stats_urls, stats_entries, max(2, rounds))
    finally:
        for c in clusters.values():
            c.stop()
        single.stop()
    results["params"] = {"entries": entries, "stats_entries": stats_entries, "rounds": rounds,
                         "lookups": lookups, "loadavg": [la0, loadavg()], "code": code0,
                         "cluster": "local, loopback, no replicas (reads go to primaries)"}
    code_changed(code0, results["params"])
    write_json(out + ".json", results)
    plot(results, out + ".png")
    return results


def report(res: dict) -> str:
    L = res["loads"]["stores"]
    s1, c3 = L["single"], L["cluster3"]
    rows = []
    for mode, label in (("seq", "sequential"), ("par", "4 threads")):
        rows.append([f"load {label} MiB/s (median)", s1[mode]["mib_per_s_median"],
                     c3[mode]["mib_per_s_median"],
                     c3[mode]["mib_per_s_median"] / s1[mode]["mib_per_s_median"]])
    C = res["lookup"]["cases"]
    for kind in ("hit", "miss", "contains", "index"):
        a, b = C[f"single.{kind}"]["us"]["p50"], C[f"cluster3.{kind}"]["us"]["p50"]
        what = {"hit": "has_cache_item hit p50 us", "miss": "has_cache_item miss p50 us",
                "contains": "contains() p50 us",
                "index": f"identifiers() of {res['lookup']['entries']} p50 us"}[kind]
        rows.append([what, a, b, b / a])
    S = res["stats"]["stores"]
    base = S["single"]["median_s"]
    srows = [[name, d["median_s"], d["entries_per_s"], d["median_s"] / base]
             for name, d in S.items()]
    p = res["params"]
    head = (f"Redis Cluster (3 primaries) vs one node, side by side; {res['loads']['entries']} "
            f"entries of {res['loads']['entry_bytes']:,} B, {p['rounds']} rounds; loadavg "
            f"{p['loadavg'][0][0]}->{p['loadavg'][1][0]}")
    return "\n".join([head, table(rows, ["measure", "single", "cluster3", "cluster/single"]), "",
                      f"stats over {res['stats']['entries']:,} entries (median of "
                      f"{res['stats']['repeats']})",
                      table(srows, ["store", "seconds", "entries/s", "x single"])])


def plot(res: dict, filename: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from serving_common import BENCH_DIR
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    L = res["loads"]["stores"]
    ax = axes[0]
    for k, (name, color) in enumerate((("single", "#1f77b4"), ("cluster3", "#2ca02c"))):
        vals = [L[name]["seq"]["mib_per_s_median"], L[name]["par"]["mib_per_s_median"]]
        ax.bar([x + 0.38 * k for x in (0, 1)], vals, 0.38, label=name, color=color)
        for x, v in zip((0, 1), vals):
            ax.text(x + 0.38 * k, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([0.19, 1.19])
    ax.set_xticklabels(["sequential", "4 threads"])
    ax.set_ylabel("MiB/s (get + verify + copy)")
    ax.set_title(f"Load throughput ({res['loads']['entry_bytes'] / 2**20:.2f} MiB entries)",
                 fontsize=10)
    ax.legend(fontsize=8)
    C = res["lookup"]["cases"]
    ax = axes[1]
    kinds = ["hit", "miss", "contains", "index"]
    for k, (name, color) in enumerate((("single", "#1f77b4"), ("cluster3", "#2ca02c"))):
        vals = [C[f"{name}.{kind}"]["us"]["p50"] for kind in kinds]
        ax.bar([x + 0.38 * k for x in range(4)], vals, 0.38, label=name, color=color)
    ax.set_yscale("log")
    ax.set_xticks([x + 0.19 for x in range(4)])
    ax.set_xticklabels(["has_cache_item\nhit", "has_cache_item\nmiss", "contains()",
                        f"index refresh\n({res['lookup']['entries']})"], fontsize=8)
    ax.set_ylabel("µs, p50 (log)")
    ax.set_title("Scheduler lookups", fontsize=10)
    ax.legend(fontsize=8)
    S = res["stats"]["stores"]
    ax = axes[2]
    names = list(S)
    vals = [S[n]["median_s"] for n in names]
    ax.bar(names, vals, color=["#1f77b4"] + ["#2ca02c"] * (len(names) - 1))
    for x, v in enumerate(vals):
        ax.text(x, v, f"{v:.2f}s", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_title(f"encache stats over {res['stats']['entries']:,} entries", fontsize=10)
    m = res["machine"]
    fig.suptitle(f"Redis Cluster vs one node — {m['cpus']} CPUs, loadavg "
                 f"{res['params']['loadavg'][0][0]} (shared machine: compare ratios)", fontsize=10)
    fig.tight_layout()
    fig.savefig(BENCH_DIR / filename, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=100, help="1.25 MiB entries for loads")
    p.add_argument("--stats-entries", type=int, default=20000)
    p.add_argument("--lookups", type=int, default=1000, help="identifiers for has_cache_item")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="redis_cluster")
    a = p.parse_args(argv)
    print(report(run(a.entries, a.stats_entries, a.rounds, a.lookups, a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
