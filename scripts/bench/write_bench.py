"""Write benchmark: a producer's entry write to a local disk store, vs a plain write of the
same bytes and vs vLLM's ECExampleConnector.save_caches.

In encoder disaggregation (EPD) an encoder's request is answered once its entry's write is
visible (the temp file exists) and PD loads the entry once its bytes are all in the temp
file: PD waits for the write (docs/epd.md). For fp16 entries of 0.25 / 2.75 / 11 MB
(64 x 2048, 256 x 5376, four 256 x 5376 crops), ``n`` entries per size (>= ``--target-mb``),
methods interleaved in a shuffled order every round, each pass's files deleted after it
(before writeback: no disk I/O). Timed per entry:

  write               os.open(O_CREAT | O_EXCL) of a new file + one os.write of the
                      entry's bytes (header + tensor, built beforehand) + close: the floor
                      for a file writer (ratios are against this)
  write.prealloc      the same with the file's blocks reserved first (fallocate(2),
                      FALLOC_FL_KEEP_SIZE; files.preallocate): the kernel's part alone
  ecexample           vLLM's ECExampleConnector.save_caches (its real code: makedirs +
                      safetensors.torch.save_file of the tensor), synchronous
  encache.put         DiskStore(fsync=False).put of encode_parts (the header, the xxh3
                      checksum over the tensor), what the producer's writer thread runs:
                      directory, temp file, blocks reserved, bytes, rename, journal record
  encache.put.noprealloc  the same with DiskStore(preallocate=False)

The fsync of a put (``fsync=True``, the default) follows the moment readers may take the
bytes, and sends them to the disk: not measured here (a disk's flush, and a shared VM's
journal commits stall the other rows' writes).

For the encache rows the JSON also has ``whole_ms``: the time from the call to the moment
the bytes are all in the temp file (``on_written``), what an EPD PD load waits for.

Ratios are medians of per-round ratios (write median / method median within a round:
higher is faster). MB = 10^6 bytes.

    .venv/bin/python scripts/bench/write_bench.py [--rounds 9] [--target-mb 48] [--out write]
"""

from __future__ import annotations

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
from serving_common import (code_state, finish_run, loadavg, machine,  # noqa: E402
                            plot_method_bars, round_args, set_engine_env, summary, table)

SIZES = [("0.25 MB", (64, 2048)), ("2.75 MB", (256, 5376)), ("11 MB", (1024, 5376))]
METHODS = ["write", "write.prealloc", "ecexample", "encache.put", "encache.put.noprealloc"]
ENCACHE = [m for m in METHODS if m.startswith("encache.")]


def run(rounds: int = 9, target_mb: int = 48, out: str = "write", plot: bool = True,
        tmpdir: str | None = None) -> dict:
    set_engine_env()
    import numpy as np
    import torch
    from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

    from encache.connectors.store.disk.store import DiskStore
    from encache.connectors.store.entry import encode_parts
    from encache.connectors.store.files import preallocate

    torch.set_num_threads(1)
    ecx = object.__new__(ECExampleConnector)  # its worker side, as an encoder builds it
    ecx._is_producer = True
    info = machine()
    code0 = code_state()
    tmp = Path(tempfile.mkdtemp(prefix="encache-bench-write-", dir=tmpdir))
    results = {"benchmark": "a producer's entry write, vs a plain write and ECExample's save",
               "machine": info,
               "params": {"rounds": rounds, "target_mb_per_size": target_mb, "code": code0,
                          "filesystem": DiskStore(tmp / "probe").fs_type,
                          "method": "methods interleaved per round, ratios are within-round "
                                    "medians; each pass's files deleted after it"},
               "sizes": []}
    try:
        for label, shape in SIZES:
            nbytes = prod(shape) * 2
            n = max(4, -(-target_mb * 10**6 // nbytes))
            print(f"[write] {label}: {n} entries of {shape} F16, {rounds} rounds", file=sys.stderr)
            root = tmp / label.replace(" ", "")
            stores = {"encache.put": DiskStore(root / "put", fsync=False),
                      "encache.put.noprealloc": DiskStore(root / "putn", fsync=False,
                                                          preallocate=False)}
            assert stores["encache.put"].preallocates, "no preallocation on this filesystem"
            raw = root / "raw"
            raw.mkdir(parents=True)
            ecx._storage_path = str(root / "ecexample")
            rng = np.random.default_rng(0)
            tensors = [torch.from_numpy(np.frombuffer(rng.bytes(nbytes), np.float16)
                                        .reshape(shape).copy()) for _ in range(n)]
            whole: dict[str, list[float]] = {m: [] for m in ENCACHE}

            def ident():
                return uuid.uuid4().hex + uuid.uuid4().hex

            def entry_bytes(i):
                header, view = encode_parts("x" * 64, tensors[i].numpy().view(np.uint8), "F16",
                                            shape, model="bench", vllm_version="0.32.0")
                return bytes(header) + bytes(view)

            blobs = [entry_bytes(i) for i in range(n)]

            def write(prealloc):
                def fn(i):
                    fd = os.open(raw / ident(), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                    try:
                        if prealloc:
                            preallocate(fd, len(blobs[i]))
                        os.write(fd, blobs[i])
                    finally:
                        os.close(fd)
                return fn

            def ecexample(i):
                h = ident()
                ecx.save_caches({h: tensors[i]}, h)

            def put(key):
                store, marks = stores[key], whole[key]

                def fn(i):
                    t0 = time.perf_counter()
                    name = ident()
                    header, view = encode_parts(name, tensors[i].numpy().view(np.uint8), "F16",
                                                shape, model="bench", vllm_version="0.32.0")
                    store.put(name, [header, view],
                              on_written=lambda: marks.append(time.perf_counter() - t0))
                return fn

            def clean():
                for d in [raw, Path(ecx._storage_path)] + [s.root for s in stores.values()]:
                    for p in d.iterdir() if d.exists() else ():
                        if p.name == ".encache":
                            continue
                        if p.is_dir():
                            shutil.rmtree(p, ignore_errors=True)
                        else:
                            p.unlink()

            fns = {"write": write(False), "write.prealloc": write(True), "ecexample": ecexample}
            fns.update({k: put(k) for k in ENCACHE})
            times = {m: [] for m in METHODS}
            per_round = {m: [] for m in METHODS}
            la0 = loadavg()
            for r in range(rounds + 1):  # round 0: untimed warm-up
                order = METHODS[:]
                random.Random(r).shuffle(order)
                round_t = {}
                for m in order:
                    fn, ts = fns[m], []
                    if m in whole:
                        mark = len(whole[m])
                    for i in range(n):
                        t0 = time.perf_counter()
                        fn(i)
                        ts.append(time.perf_counter() - t0)
                    clean()
                    round_t[m] = statistics.median(ts)
                    if r:
                        times[m] += ts
                    elif m in whole:
                        del whole[m][mark:]
                if r:
                    for m in METHODS:
                        per_round[m].append(round_t["write"] / round_t[m])
            methods = {}
            base = statistics.median(times["write"])
            ex = statistics.median(times["ecexample"])
            for m in METHODS:
                s = summary(times[m], 1e3)
                methods[m] = {"ms": s, "mb_s": nbytes / (s["p50"] / 1e3) / 1e6,
                              "vs_write": base / statistics.median(times[m]),
                              "vs_write_rounds": per_round[m],
                              "vs_write_round_median": statistics.median(per_round[m]),
                              "vs_ecexample": ex / statistics.median(times[m])}
                if m in whole:
                    methods[m]["whole_ms"] = summary(whole[m], 1e3)
            results["sizes"].append({
                "label": label, "shape": list(shape), "dtype": "F16", "tensor_bytes": nbytes,
                "file_bytes": len(blobs[0]), "entries": n, "rounds": rounds,
                "loadavg": [la0, loadavg()], "methods": methods,
                # speed-up of reserving the blocks first: time without / time with
                "prealloc_vs_not": {
                    "put": statistics.median(
                        a / b for a, b in zip(per_round["encache.put"],
                                              per_round["encache.put.noprealloc"])),
                    "whole_p50": (methods["encache.put.noprealloc"]["whole_ms"]["p50"]
                                  / methods["encache.put"]["whole_ms"]["p50"])}})
            shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return finish_run(results, out, code0, plot_write if plot else None)


def report(results: dict) -> str:
    rows = []
    for row in results["sizes"]:
        for m, d in row["methods"].items():
            w = d.get("whole_ms")
            rows.append([row["label"], m, f"{d['ms']['p50']:.3f}",
                         f"{w['p50']:.3f}" if w else "-", f"{d['mb_s']:,.0f}",
                         f"{d['vs_write_round_median']:.2f}", f"{d['vs_ecexample']:.2f}"])
    return table(rows, ["size", "method", "p50 ms", "whole p50 ms", "MB/s p50", "x write",
                        "x ECExample"])


def plot_write(results: dict, name: str) -> None:
    plot_method_bars(results, METHODS, "vs_write_round_median", name,
                     ylabel="x a plain write (higher is faster)",
                     title="An entry write to a local disk store (ext4, 2-vCPU VM)")


def main(argv=None) -> int:
    a = round_args(__doc__, argv, rounds=9, target_mb=48, out="write")
    res = run(a.rounds, a.target_mb, a.out, not a.no_plot, a.tmpdir)
    print(report(res))
    for row in res["sizes"]:
        print(row["label"], "preallocated / not:",
              {k: round(v, 3) for k, v in row["prealloc_vs_not"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
