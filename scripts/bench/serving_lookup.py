"""Benchmark 2 — ``has_cache_item`` latency on the scheduler's hot path (issue #5).

vLLM calls ``has_cache_item(identifier)`` for every multimodal item of every request the
scheduler considers, every step. This measures the *real methods* on real scheduler-side
connector instances built from a VllmConfig (the tiny model; nothing else is loaded):

  encache.disk     EncacheConnector(store=<dir>)            staged-dict lookup (+ pin on a hit)
  encache.redis    EncacheConnector(store=redis://127.0.0.1) the same code: no network on this path
  ecexample        ECExampleConnector(shared_storage_path=<dir>): os.makedirs(dir, exist_ok=True)
                   + os.path.exists(file) per call

Identifiers: *hit* = stored (for encache: prefetched and verified, i.e. what a request
deferred by ``ensure_cache_available`` asks on its next step); *miss* = not stored.
ECExampleConnector's miss is measured twice: *first* lookup of an identifier (its
``makedirs`` creates an empty directory in the store — one per distinct miss, forever) and
*repeat* lookups (the directory exists; ``makedirs`` raises and catches FileExistsError).

Each call is timed alone with ``time.perf_counter_ns`` (its own overhead, reported as
``timer_overhead_ns``, is included in every sample); calls of all connectors are
interleaved round by round. The pin set (``EncacheSchedulerConnector._pinned``) is cleared every
round by ``build_connector_meta`` as the engine does every step.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import (code_state, finish_run, loadavg, machine, RedisServer,  # noqa: E402
                            set_engine_env, summary, table)

GOAL_US = 5.0


def _vllm_config(model: str, connector: str, module: str, extra: dict):
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
    mc = ModelConfig(model=model, dtype="float32", max_model_len=256)
    tc = ECTransferConfig(ec_connector=connector, ec_role="ec_consumer",
                          ec_connector_module_path=module, ec_connector_extra_config=extra)
    return VllmConfig(model_config=mc, ec_transfer_config=tc)


def run(entries: int = 1000, rounds: int = 20, out: str = "serving_lookup", plot: bool = True,
        tmpdir: str | None = None) -> dict:
    set_engine_env()
    import numpy as np
    from serving_models import ensure_model
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

    from encache.connectors.store import open_store
    from encache.connectors.store.entry import encode_parts
    from encache.connectors.vllm.connector import EncacheConnector

    info = machine()
    code0 = code_state()
    model = ensure_model("tiny")
    tmp = Path(tempfile.mkdtemp(prefix="encache-bench-lookup-", dir=tmpdir))
    redis = RedisServer()
    conns = {}
    try:
        disk_dir, ex_dir = tmp / "encache", tmp / "ecexample"
        prefix = f"bench-{uuid.uuid4().hex[:8]}:"
        redis_url = redis.url + f"?prefix={prefix}"
        dstore, rstore = open_store(str(disk_dir)), open_store(redis_url)
        data = np.zeros((16, 64), np.float32).view(np.uint8)
        hits = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(entries)]
        misses = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(entries)]
        for ident in hits:
            header, view = encode_parts(ident, data, "F32", (16, 64))
            dstore.put(ident, [header, view])
            rstore.put(ident, [header, view])
            p = ex_dir / ident / "encoder_cache.safetensors"
            p.parent.mkdir(parents=True)
            p.write_bytes(bytes(header) + bytes(view))
        from encache.connectors.vllm import CONNECTOR_MODULE as mod
        common = {"index_refresh_s": 3600, "counters_flush_s": 3600}
        conns["encache.disk"] = EncacheConnector(
            _vllm_config(model, "EncacheConnector", mod, {"store": str(disk_dir), **common}),
            ECConnectorRole.SCHEDULER)
        conns["encache.redis"] = EncacheConnector(
            _vllm_config(model, "EncacheConnector", mod, {"store": redis_url, **common}),
            ECConnectorRole.SCHEDULER)
        conns["ecexample"] = ECExampleConnector(
            _vllm_config(model, "ECExampleConnector", None, {"shared_storage_path": str(ex_dir)}),
            ECConnectorRole.SCHEDULER)
        # stage every stored entry as ensure_cache_available would (background read+verify)
        for name in ("encache.disk", "encache.redis"):
            lk = conns[name].lookup
            lk.wait_index(30)
            for ident in hits:
                lk.request(ident)
            lk.wait_idle(60)
            staged = sum(lk.is_ready(i) for i in hits)
            assert staged == entries, f"{name}: only {staged}/{entries} staged"
        for name, c in conns.items():
            assert all(c.has_cache_item(i) for i in hits[:10]), name
            assert not any(c.has_cache_item(i) for i in misses[:10]), name

        # timer overhead
        pc = time.perf_counter_ns
        over = []
        for _ in range(20000):
            t0 = pc()
            over.append(pc() - t0)
        overhead = summary(over)

        cases = [("encache.disk", "hit"), ("encache.disk", "miss"),
                 ("encache.redis", "hit"), ("encache.redis", "miss"),
                 ("ecexample", "hit"), ("ecexample", "miss.repeat"), ("ecexample", "miss.first")]
        samples = {c: [] for c in cases}
        fresh = 0
        la0 = loadavg()
        for r in range(rounds + 1):  # round 0: warm-up (and creates ECExample's miss dirs)
            order = cases[:]
            random.Random(r).shuffle(order)
            for name, kind in order:
                fn = conns[name].has_cache_item
                if kind == "miss.first":
                    ids = [f"first{fresh + k:07d}" + uuid.uuid4().hex for k in range(entries // 4)]
                    fresh += len(ids)
                else:
                    ids = hits if kind == "hit" else misses
                want = kind == "hit"
                acc = samples[(name, kind)]
                for ident in ids:
                    t0 = pc()
                    got = fn(ident)
                    t1 = pc()
                    if r:
                        acc.append(t1 - t0)
                    if got is not want:
                        raise AssertionError(f"{name} {kind}: has_cache_item({ident}) = {got}")
                if name.startswith("encache"):
                    conns[name].build_connector_meta(None)  # clears the pins, as each step does
        la1 = loadavg()
        created = sum(1 for d in os.scandir(ex_dir) if d.is_dir()) - entries
        res = {}
        for (name, kind), xs in samples.items():
            s = summary(xs, 1e-3)  # ns -> us
            res[f"{name}.{kind}"] = {"backend": name, "kind": kind, "us": s,
                                     "meets_goal_p50": s["p50"] <= GOAL_US}
        results = {
            "benchmark": "has_cache_item latency (issue #5)", "machine": info,
            "params": {"entries": entries, "rounds": rounds, "goal_us_p50": GOAL_US,
                       "model": model, "loadavg": [la0, la1], "code": code0},
            "timer_overhead_ns": overhead,
            "ecexample_empty_dirs_created": created,
            "cases": res,
        }
    finally:
        for c in conns.values():
            try:
                c.shutdown()
            except Exception:
                pass
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return finish_run(results, out, code0, plot_lookup if plot else None)


def report(results: dict) -> str:
    rows = []
    for key, c in results["cases"].items():
        rows.append([f"{c['backend']} {c['kind']}", c["us"]["p50"], c["us"]["p90"],
                     c["us"]["p99"], c["us"]["max"], c["us"]["n"],
                     "yes" if c["meets_goal_p50"] else "NO"])
    p = results["params"]
    head = (f"has_cache_item latency, us per call ({p['entries']} identifiers x {p['rounds']} "
            f"rounds; timer overhead {results['timer_overhead_ns']['p50']:.0f} ns included; "
            f"loadavg {p['loadavg'][0][0]}->{p['loadavg'][1][0]})")
    tail = (f"ECExampleConnector created {results['ecexample_empty_dirs_created']:,} empty "
            f"directories in its store while answering 'miss'.")
    return "\n".join([head, table(rows, ["connector / case", "p50", "p90", "p99", "max", "calls",
                                         f"p50<={GOAL_US:g}us"]), tail])


def plot_lookup(results: dict, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from serving_common import BENCH_DIR
    cases = list(results["cases"].values())
    labels = [f"{c['backend']}\n{c['kind']}" for c in cases]
    colors = {"encache.disk": "#1f77b4", "encache.redis": "#2ca02c", "ecexample": "#d62728"}
    fig, ax = plt.subplots(figsize=(10, 4.8))
    xs = range(len(cases))
    p50 = [c["us"]["p50"] for c in cases]
    p99 = [c["us"]["p99"] for c in cases]
    ax.bar([x - 0.2 for x in xs], p50, 0.4, label="p50",
           color=[colors[c["backend"]] for c in cases])
    ax.bar([x + 0.2 for x in xs], p99, 0.4, label="p99", alpha=0.45,
           color=[colors[c["backend"]] for c in cases])
    for x, a, b in zip(xs, p50, p99):
        ax.text(x - 0.2, a, f"{a:.2g}", ha="center", va="bottom", fontsize=7)
        ax.text(x + 0.2, b, f"{b:.2g}", ha="center", va="bottom", fontsize=7)
    ax.axhline(GOAL_US, color="k", ls="--", lw=0.8, label=f"goal: p50 ≤ {GOAL_US:g} µs")
    ax.set_yscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("µs per call (log)")
    m = results["machine"]
    ax.set_title(f"Benchmark 2 — has_cache_item latency (real scheduler-side connectors; "
                 f"{m['cpus']} CPUs, loadavg {results['params']['loadavg'][0][0]})", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(BENCH_DIR / name, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", default="serving_lookup")
    a = p.parse_args(argv)
    print(report(run(a.entries, a.rounds, a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
