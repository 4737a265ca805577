"""Multiprocess executor (tensor parallel 2): what shipping entry bytes to every worker in
the scheduler's connector metadata costs per step, vs workers loading entries themselves
(issue #11, item 6).

vLLM's multiprocess executor broadcasts each step's SchedulerOutput — with the connector
metadata inside — to every worker through ``MessageQueue`` (shared-memory ring buffer;
messages over ``VLLM_MQ_MAX_CHUNK_BYTES_MB`` overflow to a local zmq socket). This bench
uses that real queue (``vllm.distributed.device_communicators.shm_broadcast``) with two
reader processes, exactly the executor's layout, and times one "step": from the
scheduler's ``enqueue`` until both workers hold every loaded tensor copied once into a
preallocated buffer (the engine's merge). Designs, interleaved step by step:

  bytes.inband   the old ``LoadItem.__getstate__``: tensor bytes ``tobytes()``'d into the
                 pickle stream (a copy, then another into the stream, then the queue)
  bytes.oob      the current ``LoadItem``: protocol-5 out-of-band PickleBuffer (written
                 once from the staged buffer into the queue; each worker gets a copy)
  worker.reads   ``worker_loads: files`` (``auto`` does this for entries of 1 MiB+ with
                 the multiprocess executor on a local disk store, and ships smaller ones
                 as bytes.oob): the metadata carries a pinned file (scheduler
                 pid + open fd + verified version, the load's ``pin()``); each worker opens
                 ``/proc/<pid>/fd/<n>``, checks the version, maps (1 MiB+) or reads it,
                 and copies (``EncacheWorkerConnector._to_tensor`` / ``open_pinned``)
  worker.reads.shared  an entry received from Redis or Redis Cluster (or read from a
                 network filesystem) with workers in other processes: received into shared
                 memory (a memfd: ``store/memfd.py``; here the staged bytes are copied into
                 one, untimed, as the receive would have put them there), sealed and
                 pinned (``pin_shared``); each worker opens it through /proc as above.
                 Before, such entries went as bytes.oob

The scheduler side (index, verify-once, staging) is the same for all.

    .venv/bin/python scripts/bench/tp_bench.py [--steps 40] [--items 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from math import prod
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import (BENCH_DIR, code_state, loadavg, machine, set_engine_env,  # noqa: E402
                            table, write_json)

SIZES = [("0.25 MB", (64, 2048)), ("2.75 MB", (256, 5376)), ("10 MB", (1024, 5120))]
DESIGNS = ["bytes.inband", "bytes.oob", "worker.reads", "worker.reads.shared"]


set_engine_env()
from encache.connectors.store.loaded import pin_shared
from encache.connectors.vllm.loads import DTYPE_BYTES, LoadItem


class LegacyLoadItem(LoadItem):
    """LoadItem as pickled before issue #11 (tobytes into the stream)."""

    def __reduce_ex__(self, protocol):
        return object.__reduce_ex__(self, protocol)

    def __getstate__(self):
        view = memoryview(self.blob).cast("B")
        nbytes = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            nbytes *= s
        state = dict(self.__dict__)
        state["blob"] = view[self.offset:self.offset + nbytes].tobytes()
        state["offset"] = 0
        return state


def _worker(handle, rank, store_root, shapes, results):
    set_engine_env()
    import torch
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from encache.connectors.vllm.worker import EncacheWorkerConnector

    torch.set_num_threads(1)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    w = object.__new__(EncacheWorkerConnector)
    w.model_dtype = torch.float16
    w._device = torch.device("cpu")
    dst = {tuple(s): torch.empty(s, dtype=torch.float16) for s in shapes}
    while True:
        msg = mq.dequeue(indefinite=True)
        if msg is None:
            break
        design, t_send, items = msg
        t_got = time.perf_counter()
        for item in items:  # EncacheConnector's worker path (a pinned file or bytes)
            t = w._to_tensor(item)
            dst[tuple(item.shape)].copy_(t)
        t_done = time.perf_counter()
        results.put((rank, t_got - t_send, t_done - t_send))


def run(steps: int = 40, items: int = 4, out: str = "tp", plot: bool = True) -> dict:
    set_engine_env()
    import numpy as np
    from vllm import envs
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    from encache.connectors.lookup import EntryLookup
    from encache.connectors.store.disk.store import DiskStore
    from encache.connectors.store.entry import encode_parts
    from encache.connectors.store.memfd import shared_buffer

    Legacy = LegacyLoadItem

    tmp = Path(tempfile.mkdtemp(prefix="encache-bench-tp-"))
    store = DiskStore(tmp / "store", fsync=False)
    ctx = mp.get_context("fork")
    max_chunk = envs.VLLM_MQ_MAX_CHUNK_BYTES_MB * 1024 * 1024
    mq = MessageQueue(2, 2, max_chunk_bytes=max_chunk)  # the executor's layout: 2 local workers
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(mq.export_handle(), r, str(store.root),
                                               [s for _, s in SIZES], results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    mq.wait_until_ready()
    rng = np.random.default_rng(0)
    res = {"benchmark": "TP=2 connector metadata: bytes vs workers reading (issue #11)",
           "machine": machine(), "params": {
               "steps": steps, "items_per_step": items, "workers": 2,
               "transport": "vllm MessageQueue (shm ring, zmq overflow), as the mp executor",
               "max_chunk_bytes": max_chunk, "code": code_state(),
               "method": "designs interleaved per step, medians"},
           "sizes": []}
    try:
        for label, shape in SIZES:
            nbytes = prod(shape) * 2
            n = max(items * 4, -(-256 * 10**6 // nbytes) // 4)
            ids = []
            for i in range(n):
                ident = f"{i:05d}" + uuid.uuid4().hex + uuid.uuid4().hex[:27]
                data = rng.standard_normal(shape).astype(np.float16)
                header, view = encode_parts(ident, data.view(np.uint8), "F16", shape, model="b")
                store.put(ident, [header, view])
                ids.append(ident)
            lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600,
                             load_threads=1, staging_bytes=1 << 40)
            staged = {i: lk.load_now(i) for i in ids}  # the scheduler side: verified, staged
            shared = {}  # the same entries as received into shared memory (Redis)
            for i in ids:
                size = memoryview(staged[i].blob).nbytes
                shared[i] = shared_buffer(size)
                shared[i][:] = memoryview(staged[i].blob).cast("B")

            pins: list[int] = []

            def message(design, idents):
                if design == "worker.reads":  # what build_connector_meta does
                    out = []
                    for i in idents:
                        fd, ref = staged[i].pin()
                        pins.append(fd)
                        out.append(LoadItem(i, staged[i].blob, staged[i].offset, "F16", shape, ref))
                    return out
                if design == "worker.reads.shared":
                    out = []
                    for i in idents:
                        fd, ref = pin_shared(shared[i])
                        pins.append(fd)
                        out.append(LoadItem(i, shared[i], staged[i].offset, "F16", shape, ref))
                    return out
                cls = Legacy if design == "bytes.inband" else LoadItem
                return [cls(i, staged[i].blob, staged[i].offset, "F16", shape) for i in idents]
            times = {d: [] for d in DESIGNS}
            enq = {d: [] for d in DESIGNS}
            for step in range(steps + 2):  # 2 warm-up steps
                idents = random.Random(step).sample(ids, items)
                order = DESIGNS[:]
                random.Random(1000 + step).shuffle(order)
                for d in order:
                    t0 = time.perf_counter()
                    mq.enqueue((d, t0, message(d, idents)))
                    t1 = time.perf_counter()
                    done = [results.get(timeout=120) for _ in range(2)]
                    while pins:
                        os.close(pins.pop())
                    if step >= 2:
                        times[d].append(max(x[2] for x in done))
                        enq[d].append(t1 - t0)
            row = {"label": label, "tensor_bytes": nbytes, "entries": n,
                   "step_bytes": nbytes * items, "loadavg": loadavg(), "designs": {}}
            base = statistics.median(times["bytes.inband"])
            for d in DESIGNS:
                med = statistics.median(times[d])
                row["designs"][d] = {"step_ms_p50": med * 1e3,
                                     "step_ms_p90": sorted(times[d])[int(0.9 * len(times[d]))] * 1e3,
                                     "enqueue_ms_p50": statistics.median(enq[d]) * 1e3,
                                     "speedup_vs_inband": base / med}
            res["sizes"].append(row)
            print(f"[tp] {label}: " + ", ".join(
                f"{d} {row['designs'][d]['step_ms_p50']:.2f} ms" for d in DESIGNS), file=sys.stderr)
            lk.close()
            for i in ids:
                store.delete(i)
    finally:
        mq.enqueue(None)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    write_json(out + ".json", res)
    if plot:
        _plot(res, out + ".png")
    return res


def report(res: dict) -> str:
    rows = []
    for r in res["sizes"]:
        for d, v in r["designs"].items():
            rows.append([r["label"], d, f"{v['step_ms_p50']:.3f}", f"{v['step_ms_p90']:.3f}",
                         f"{v['enqueue_ms_p50']:.3f}", f"{v['speedup_vs_inband']:.2f}"])
    return table(rows, ["entry", "design", "step p50 ms", "step p90 ms", "enqueue p50 ms",
                        "x bytes.inband"])


def _plot(res: dict, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in res["sizes"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    w = 0.8 / len(DESIGNS)
    for k, d in enumerate(DESIGNS):
        ax.bar([i + k * w for i in range(len(labels))],
               [r["designs"][d]["step_ms_p50"] for r in res["sizes"]], w, label=d)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(labels))], labels)
    ax.set_yscale("log")
    ax.set_ylabel(f"ms per step ({res['params']['items_per_step']} entries to 2 workers), p50")
    ax.set_title("TP=2 metadata: shipping bytes vs workers reading (shared 2-vCPU VM)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(BENCH_DIR / name, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--items", type=int, default=4)
    ap.add_argument("--out", default="tp")
    a = ap.parse_args(argv)
    res = run(a.steps, a.items, a.out)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
