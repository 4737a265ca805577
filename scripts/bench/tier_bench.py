"""Local-tier benchmark: repeat loads through a node-local tier vs straight from Redis vs a
local disk store, side by side in one run.

For fp16 entries of 0.25 / 2.75 / 10 MB (shapes (64, 2048), (256, 5376), (1024, 5120)),
``n`` distinct entries per size (working set >= ``target_mb``), methods interleaved in a
shuffled order every round, warm page cache. Each timed load ends with the bytes usable:
``EntryLookup.load_now`` (the engine's read + validation) then ``_to_tensor`` (the
worker's conversion) and one copy of the tensor into a preallocated buffer (as the
engine's embedding merge or a device copy reads it: every byte is read). Methods:

  readinto        os.open + readinto of the entry file into a preallocated buffer (one
                  kernel copy: the floor for a loader that reads files; no further copy)
  disk            a local DiskStore (defaults: mapped, checksum once per stored version):
                  the goal's reference
  tier.local      a TieredStore (redis-server on loopback + a local tier) whose tier
                  holds every entry: a repeat load served by the tier
  redis           a RedisStore straight (no tier): every load crosses the network and is
                  hashed (a value has no version to remember)
  tier.first      the first load of an entry through a tier that does not hold it yet:
                  the remote read + checksum, and the write-behind handed to the tier's
                  thread (a fresh, empty tier each round, made untimed)

The tiers are built as the connector builds them (``open_store(..., local_tier=)``: the
tier's copies are not fsynced, see docs/local-tier.md). Off the request path:
``write_behind_ms``, the tier thread's work per copy (its ``put`` into the tier: file
write, rename), timed on the main thread after each tier.first round on a tier of the same
kind; ``write_behind_backlog_ms``, the wait per entry for the tier thread to finish after
the round's last load (near 0: it kept up with the loads).
Ratios are of median times within the run (``tier.local / disk`` is the goal: >= 0.9).
MB = 10^6 bytes.

    .venv/bin/python scripts/bench/tier_bench.py [--rounds 7] [--target-mb 64] [--out tier]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from math import prod
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import (BENCH_DIR, RedisServer, code_state, finish_run, fmt,  # noqa: E402
                            loadavg, machine, ratio, set_engine_env, summary, table)

SIZES = [("0.25 MB", (64, 2048)), ("2.75 MB", (256, 5376)), ("10 MB", (1024, 5120))]
METHODS = ["readinto", "disk", "tier.local", "redis", "tier.first"]
GOAL = 0.9  # a local-tier hit >= 0.9x a local disk store's load


def run(rounds: int = 7, target_mb: int = 64, out: str = "tier", plot: bool = True) -> dict:
    set_engine_env()
    import numpy as np
    import torch

    from encache.connectors.lookup import EntryLookup
    from encache.connectors.store import open_store
    from encache.connectors.store.disk.store import DiskStore
    from encache.connectors.store.entry import encode_parts
    from encache.connectors.store.redis.store import RedisStore
    from encache.connectors.vllm.loads import LoadItem
    from encache.connectors.vllm.worker import EncacheWorkerConnector

    worker = object.__new__(EncacheWorkerConnector)  # only these two fields matter
    worker.model_dtype = torch.float16
    worker._device = torch.device("cpu")

    dest = torch.empty(max(prod(s) for _, s in SIZES), dtype=torch.float16)

    def usable(staged):
        """The worker's tensor, copied once into a preallocated buffer (as the engine's
        embedding merge or a device copy reads it): every byte is read."""
        t = worker._to_tensor(LoadItem(staged.identifier, staged.blob, staged.offset,
                                       staged.meta.dtype, staged.meta.shape))
        dest[:t.numel()].copy_(t.reshape(-1))
        return t.numel()

    def lookup(store):
        return EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600,
                           load_threads=1, verify_ahead=False)

    info = machine()
    code0 = code_state()
    tmp = Path(tempfile.mkdtemp(prefix="encache-bench-tier-"))
    redis = RedisServer()
    results = {"benchmark": "local tier: repeat loads vs Redis vs a local disk store",
               "machine": info,
               "params": {"rounds": rounds, "target_mb_per_size": target_mb,
                          "redis": "redis-server on 127.0.0.1 (TCP)", "code": code0},
               "sizes": []}
    try:
        for label, shape in SIZES:
            nbytes = prod(shape) * 2
            n = max(4, -(-target_mb * 10**6 // nbytes))
            print(f"[tier] {label}: {n} entries, {rounds} rounds", file=sys.stderr)
            root = tmp / label.replace(" ", "")
            prefix = f"bench-{uuid.uuid4().hex[:8]}:"
            disk = DiskStore(root / "disk")
            remote = RedisStore(redis.url, prefix=prefix)
            rng = np.random.default_rng(0)
            ids = []
            for i in range(n):
                ident = f"{i:04d}" + uuid.uuid4().hex + uuid.uuid4().hex[:28]
                data = np.frombuffer(rng.bytes(nbytes), np.float16).reshape(shape)
                parts = encode_parts(ident, data.view(np.uint8), "F16", shape, model="bench",
                                     vllm_version="0.32.0", hash_algo="blake3")
                disk.put(ident, list(parts))
                remote.put(ident, list(parts))
                ids.append(ident)
            # tiers built as the connector builds them (open_store: copies not fsynced)
            warm_tier = open_store(redis.url, prefix=prefix, local_tier=str(root / "tier"))
            lk_disk, lk_redis, lk_tier = lookup(disk), lookup(remote), lookup(warm_tier)
            for i in ids:  # fill the tier (remote reads, written behind), verify once
                lk_tier.load_now(i)
            warm_tier.flush()
            for i in ids:
                assert warm_tier.holds_locally(i)
                lk_disk.load_now(i)
                lk_tier.load_now(i)
            # (entries differ by a byte or two: their headers hold the write time)
            pre = memoryview(bytearray(max(os.path.getsize(disk.entry_path(i)) for i in ids)))

            paths = [str(disk.entry_path(i)) for i in ids]  # (untimed: a path is given)

            def readinto(i):
                fd = os.open(paths[i], os.O_RDONLY)
                try:
                    size, got = os.fstat(fd).st_size, 0
                    while got < size:
                        n = os.readv(fd, [pre[got:size]])
                        if n <= 0:
                            raise OSError(f"{ids[i]}: short read")
                        got += n
                finally:
                    os.close(fd)
                return size

            first = {}

            def fresh_first():  # untimed: a new, empty tier in front of the same Redis
                if first:
                    first["lk"].close()
                    first["store"].close()
                    shutil.rmtree(first["dir"], ignore_errors=True)
                d = root / f"first-{uuid.uuid4().hex[:6]}"
                first["store"] = open_store(redis.url, prefix=prefix, local_tier=str(d))
                first["lk"], first["dir"] = lookup(first["store"]), d

            def put_times(store, d) -> list[float]:
                """Untimed for the methods: each copy the round wrote behind, put again into
                a tier of the same kind (what the tier thread did for it), timed."""
                again = type(store.tier)(d.parent / (d.name + "-again"), fsync=store.tier.fsync)
                out = []
                for i in ids:
                    blob = store.tier.get(i)
                    t0 = time.perf_counter()
                    again.put(i, blob)
                    out.append(time.perf_counter() - t0)
                again.close()
                shutil.rmtree(d.parent / (d.name + "-again"), ignore_errors=True)
                return out

            def load(lk, i):
                st = lk.load_now(ids[i])
                assert st is not None
                return usable(st)

            fns = {"readinto": readinto, "disk": lambda i: load(lk_disk, i),
                   "tier.local": lambda i: load(lk_tier, i),
                   "redis": lambda i: load(lk_redis, i),
                   "tier.first": lambda i: load(first["lk"], i)}
            times = {m: [] for m in METHODS}
            drains, puts = [], []
            la0 = loadavg()
            for r in range(rounds + 1):  # round 0: warm-up, untimed
                order = METHODS[:]
                random.Random(r).shuffle(order)
                for m in order:
                    if m == "tier.first":
                        fresh_first()
                    for i in range(n):
                        t0 = time.perf_counter()
                        fns[m](i)
                        if r:
                            times[m].append(time.perf_counter() - t0)
                    if m == "tier.first":
                        t0 = time.perf_counter()
                        first["store"].flush()
                        if r:
                            drains.append((time.perf_counter() - t0) / n)
                        assert all(first["store"].holds_locally(i) for i in ids)
                        if r:  # the tier thread's work, one copy at a time
                            puts.extend(put_times(first["store"], first["dir"]))
            methods = {}
            for m in METHODS:
                s = summary(times[m], 1e3)
                methods[m] = {"ms": s, "mb_s": nbytes / (s["p50"] / 1e3) / 1e6}
            p50 = {m: methods[m]["ms"]["p50"] for m in METHODS}
            row = {"label": label, "shape": list(shape), "tensor_bytes": nbytes, "entries": n,
                   "loads_per_method": n * rounds, "loadavg": [la0, loadavg()],
                   "methods": methods,
                   "write_behind_ms": summary(puts, 1e3),
                   "write_behind_backlog_ms": summary(drains, 1e3),
                   "ratios": {  # speed ratios (time of the reference / time of the method)
                       "tier_local_vs_disk": ratio(p50["disk"], p50["tier.local"]),
                       "tier_local_vs_redis": ratio(p50["redis"], p50["tier.local"]),
                       "tier_local_vs_readinto": ratio(p50["readinto"], p50["tier.local"]),
                       "disk_vs_readinto": ratio(p50["readinto"], p50["disk"]),
                       "redis_vs_disk": ratio(p50["disk"], p50["redis"]),
                       "tier_first_vs_redis": ratio(p50["redis"], p50["tier.first"])}}
            row["goal_met"] = row["ratios"]["tier_local_vs_disk"] >= GOAL
            results["sizes"].append(row)
            for x in (lk_disk, lk_redis, lk_tier):
                x.close()
            if first:
                first["lk"].close()
                first["store"].close()
            warm_tier.close()
            remote.close()
            shutil.rmtree(root, ignore_errors=True)
    finally:
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(results))
    return finish_run(results, out, code0, plot_tier if plot else None)


def report(results: dict) -> str:
    rows = []
    for row in results["sizes"]:
        m, r = row["methods"], row["ratios"]
        rows.append([row["label"], *(fmt(m[k]["ms"]["p50"], 3) for k in METHODS),
                     fmt(r["tier_local_vs_disk"]), fmt(r["tier_local_vs_redis"]),
                     fmt(r["tier_first_vs_redis"]), fmt(row["write_behind_ms"].get("p50"), 2)])
    return table(rows, ["size", *(k + " ms" for k in METHODS), "tier/disk", "tier/redis",
                        "first/redis", "wb ms"])


def plot_tier(results: dict, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = results["sizes"]
    colors = {"readinto": "#999999", "disk": "#1f77b4", "tier.local": "#2ca02c",
              "redis": "#d62728", "tier.first": "#ff7f0e"}
    fig, ax = plt.subplots(figsize=(10, 5.5))
    w = 0.8 / len(METHODS)
    for k, m in enumerate(METHODS):
        vals = [r["methods"][m]["mb_s"] for r in sizes]
        xs = [i + (k - len(METHODS) / 2 + 0.5) * w for i in range(len(sizes))]
        ax.bar(xs, vals, w, label=m, color=colors[m])
    ax.set_xticks(range(len(sizes)))
    ax.set_xticklabels([f"{r['label']}\ntier/disk {r['ratios']['tier_local_vs_disk']:.2f}x, "
                        f"tier/redis {r['ratios']['tier_local_vs_redis']:.1f}x" for r in sizes])
    ax.set_yscale("log")
    ax.set_ylabel("MB/s until the tensor is usable (median)")
    m = results["machine"]
    ax.set_title(f"Local tier vs Redis vs local disk store — {m['cpus']} CPUs, loadavg at "
                 f"start {m['loadavg_start'][0] if m.get('loadavg_start') else '?'}", fontsize=10)
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(BENCH_DIR / name, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--target-mb", type=int, default=64)
    ap.add_argument("--out", default="tier")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    run(a.rounds, a.target_mb, a.out, plot=not a.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
