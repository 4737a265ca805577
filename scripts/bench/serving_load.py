"""Benchmark 1 — load throughput of one entry, side by side (issue #4).

For fp16 entries of 0.25 / 2.75 / 10 MB (shapes (64, 2048), (256, 5376), (1024, 5120)),
each method loads every one of ``n`` distinct entries (working set ≥ 64 MB per size, so
no CPU cache holds them), ``rounds`` times, methods interleaved round by round. Timed per
load, from the call until the bytes are usable: the call, then one byte read per 4 KiB
page of the result (free for a buffer already in memory; for an mmap-backed tensor —
safetensors' default on CPU — it is the page-fault cost the model step would otherwise pay
on first use). MB/s = tensor bytes / median time (1 MB = 10^6 bytes); "best" uses the
10th-percentile time (the least disturbed loads on a shared machine). The call alone is
reported too (``call_only``).

Reference (the limit on this machine)
  memcpy.pagecache   os.readv of the encache file into a *preallocated* buffer from a warm
                     page cache: one kernel copy, no allocation — the floor for any loader
                     that reads files (the ratios below are against this one)
  memcpy.ram         numpy.copyto between two in-memory buffers (RAM bandwidth, no syscall)

encache (exactly the code that runs in the engine)
  encache.disk       EntryLookup.load_now + EncacheWorkerConnector._to_tensor with the defaults:
                     the entry file is memory-mapped (load_mode auto, local filesystem) and
                     the checksum runs once per stored file version — steady state, the
                     version was verified by an earlier load
  encache.disk.first the same, but each load is the *first* of its file version: full
                     header parse + xxh3 checksum over the mapped bytes (what a new or
                     rewritten entry costs once)
  encache.disk.read  load_mode=read: the entry is read() into a fresh buffer (one copy),
                     checksum once per version
  encache.disk.always  mapped, verify="always": the checksum on every load
  encache.redis / encache.redis.noverify   RedisStore over loopback (a value has no
                     version: verify hashes every load)

baseline
  ecexample.disk     safetensors.torch.load_file(path)["ec_cache"] on files written by
                     safetensors.torch.save_file — what ECExampleConnector.start_load_caches
                     runs per item (its per-item os.makedirs is not included here)

Breakdown rows (to explain the gap): the read alone into a fresh zero-filled bytearray(n)
and into an uninitialised np.empty buffer; the checksum alone as ``entry.checksum`` computes
it for new entries (the algorithm is recorded), and blake3 for reference; a RedisStore.get
alone; a checked Redis read received and hashed in one pass (``RedisStore.read_verified``,
what ``encache.redis`` runs) beside the same check done as GET then a validation pass;
and both again with the entry's access-time refresh due on every load (``.touch``: a
store with ``access_resolution=0``; in EPD every PD load is the first of its entry): the
one-pass read sends its ``ZADD XX`` in the same write as the ``GET``, redis-py's ``get``
in a pipeline with it. ``params.code`` records the encache commit and any uncommitted change to the
measured code, and ``params.checksum_algo`` / ``params.disk_get_buffer`` what it did.

All files are in the page cache (written just before and read once untimed): this measures
the software path, not the disk.
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
from serving_common import (code_state, finish_run, loadavg, machine, ratio, RedisServer,  # noqa: E402
                            set_engine_env, summary, table)

SIZES = [("0.25 MB", (64, 2048)), ("2.75 MB", (256, 5376)), ("10 MB", (1024, 5120))]
METHODS = ["memcpy.pagecache", "memcpy.ram", "encache.disk", "encache.disk.first",
           "encache.disk.read", "encache.disk.always", "encache.redis", "encache.redis.noverify",
           "ecexample.disk"]
BREAKDOWN = ["read.fresh_bytearray", "read.fresh_empty", "checksum", "blake3", "redis.get",
             "redis.receive_verified", "redis.get_then_validate",
             "redis.receive_verified.touch", "redis.get_then_validate.touch"]
# cold page cache (posix_fadvise DONTNEED on the file before each load): disk paths only
COLD = ["memcpy.pagecache", "encache.disk", "encache.disk.first", "encache.disk.read",
        "ecexample.disk"]


def run(rounds: int = 7, target_mb: int = 64, out: str = "serving_load", plot: bool = True,
        tmpdir: str | None = None, cold_rounds: int = 2) -> dict:
    set_engine_env()
    import numpy as np
    import torch
    from blake3 import blake3
    from safetensors.torch import load_file, save_file

    from encache.connectors.lookup import EntryLookup
    from encache.connectors.store.disk.store import DiskStore
    from encache.connectors.store.entry import checksum as entry_checksum
    from encache.connectors.store.entry import encode_parts, parse_header
    from encache.connectors.store.redis.store import RedisStore
    from encache.connectors.store.base import Store
    from encache.connectors.vllm.loads import LoadItem
    from encache.connectors.vllm.worker import EncacheWorkerConnector

    # the worker half of EncacheConnector without a VllmConfig: only these two fields matter
    worker = object.__new__(EncacheWorkerConnector)
    worker.model_dtype = torch.float16
    worker._device = torch.device("cpu")

    def to_tensor(staged):
        return worker._to_tensor(LoadItem(staged.identifier, staged.blob, staged.offset,
                                          staged.meta.dtype, staged.meta.shape))

    info = machine()
    code0 = code_state()
    tmp = Path(tempfile.mkdtemp(prefix="encache-bench-load-", dir=tmpdir))
    redis = RedisServer()
    results = {"benchmark": "load throughput (issue #4)", "machine": info,
               "params": {"rounds": rounds, "cold_rounds": cold_rounds,
                          "target_mb_per_size": target_mb,
                          "redis": "redis-server on 127.0.0.1 (TCP)",
                          "redis_parser": _redis_parser(), "code": code0},
               "sizes": []}
    try:
        for label, shape in SIZES:
            nbytes = prod(shape) * 2
            n = max(4, -(-target_mb * 10**6 // nbytes))
            print(f"[load] {label}: {n} entries of {shape} F16, {rounds} rounds", file=sys.stderr)
            root = tmp / label.replace(" ", "")
            dstore = DiskStore(root / "encache", fsync=True)  # clean pages: evictable
            prefix = f"bench-{uuid.uuid4().hex[:8]}:"
            rstore = RedisStore(redis.url, prefix=prefix)
            tstore = RedisStore(redis.url, prefix=prefix, access_resolution=0)  # every load
            exdir = root / "ecexample"
            rng = np.random.default_rng(0)
            ids, expaths, ram = [], [], []
            for i in range(n):
                ident = f"{i:04d}" + uuid.uuid4().hex + uuid.uuid4().hex[:28]
                data = np.frombuffer(rng.bytes(nbytes), np.float16).reshape(shape)
                header, view = encode_parts(ident, data.view(np.uint8), "F16", shape,
                                            model="bench", vllm_version="0.32.0",
                                            hash_algo="blake3")
                dstore.put(ident, [header, view])
                rstore.put(ident, [header, view])
                p = exdir / ident / "encoder_cache.safetensors"
                p.parent.mkdir(parents=True, exist_ok=True)
                save_file({"ec_cache": torch.from_numpy(data.copy())}, str(p))
                with open(p, "rb+") as f:
                    os.fsync(f.fileno())
                ids.append(ident)
                expaths.append(str(p))
                ram.append(np.frombuffer(data.tobytes(), np.uint8))
            file_size = os.path.getsize(dstore.entry_path(ids[0]))
            pre = bytearray(file_size)
            pre_view = memoryview(pre)
            dst = np.empty(nbytes, np.uint8)
            rdstore = DiskStore(root / "encache", fsync=True, load_mode="read")

            def make_lookup(store, verify):
                return EntryLookup(store, verify=verify, index_refresh_s=3600,
                                   counters_flush_s=3600, load_threads=1)
            lk = {"default": make_lookup(dstore, True), "first": make_lookup(dstore, True),
                  "read": make_lookup(rdstore, True), "always": make_lookup(dstore, "always")}
            lr = {v: EntryLookup(rstore, verify=v, index_refresh_s=3600, counters_flush_s=3600,
                                 load_threads=1) for v in (True, False)}
            blobs = [bytes(dstore.get(i)) for i in ids[:2]]
            offset = len(blobs[0]) - nbytes
            meta0, _ = parse_header(memoryview(blobs[0]))
            results["params"]["checksum_algo"] = (meta0.checksum or "none").split(":")[0]
            results["params"]["disk_get_buffer"] = type(dstore.read_entry(ids[0])[0]).__name__
            results["params"]["disk_read_mode_buffer"] = type(rdstore.read_entry(ids[0])[0]).__name__
            results["params"]["filesystem"] = dstore.fs_type

            def readv_into(buf, i):
                fd = os.open(dstore.entry_path(ids[i]), os.O_RDONLY)
                try:
                    size = os.fstat(fd).st_size
                    view, got = memoryview(buf), 0
                    while got < size:
                        got += os.readv(fd, [view[got:size]])
                finally:
                    os.close(fd)
                return buf

            def load(lookup, i):
                st = lookup.load_now(ids[i])
                assert st is not None
                return to_tensor(st)

            fns = {
                "memcpy.pagecache": lambda i: readv_into(pre_view, i),
                "memcpy.ram": lambda i: (np.copyto(dst, ram[i]), dst)[1],
                "encache.disk": lambda i: load(lk["default"], i),
                "encache.disk.first": lambda i: load(lk["first"], i),
                "encache.disk.read": lambda i: load(lk["read"], i),
                "encache.disk.always": lambda i: load(lk["always"], i),
                "encache.redis": lambda i: load(lr[True], i),
                "encache.redis.noverify": lambda i: load(lr[False], i),
                "ecexample.disk": lambda i: load_file(expaths[i])["ec_cache"],
                "read.fresh_bytearray": lambda i: readv_into(bytearray(file_size), i),
                "read.fresh_empty": lambda i: readv_into(np.empty(file_size, np.uint8), i),
                "checksum": lambda i: entry_checksum(memoryview(blobs[i % 2])[offset:]),
                "blake3": lambda i: blake3(memoryview(blobs[i % 2])[offset:]).digest(),
                "redis.get": lambda i: rstore.get(ids[i]),
                # a checked Redis load: received and hashed in one pass (what encache.redis
                # runs), and as it was before, GET's bytes then a validation pass
                "redis.receive_verified": lambda i: rstore.read_verified(ids[i])[0],
                "redis.get_then_validate": lambda i: Store.read_verified(rstore, ids[i])[0],
                "redis.receive_verified.touch": lambda i: tstore.read_verified(ids[i])[0],
                "redis.get_then_validate.touch":
                    lambda i: Store.read_verified(tstore, ids[i])[0],
            }

            def touch(res):
                """Read one byte per 4 KiB page: faults in an mmap-backed (lazy) result."""
                if res is None or isinstance(res, (str, bytes)) and len(res) < 4096:
                    return 0  # a digest: nothing to fault in
                if isinstance(res, torch.Tensor):
                    res = res.reshape(-1).view(torch.uint8).numpy()
                elif not isinstance(res, np.ndarray):
                    res = np.frombuffer(res, np.uint8)
                return int(res[::4096].sum())
            # correctness: every path returns the same tensor
            ref = load_file(expaths[0])["ec_cache"]
            for name in ("encache.disk", "encache.disk.first", "encache.disk.read",
                         "encache.disk.always", "encache.redis"):
                got = fns[name](0)
                assert got.shape == ref.shape and got.dtype == ref.dtype, name
                assert torch.equal(got.flatten().view(torch.uint8),
                                   ref.flatten().view(torch.uint8)), name
            def measure(names, rounds_, evict=None):
                times = {m: [] for m in names}  # call + touch every page: bytes usable
                calls = {m: [] for m in names}  # the call alone (lazy if mmap-backed)
                for r in range(rounds_ + 1):  # round 0: untimed warm-up
                    order = names[:]
                    random.Random(r).shuffle(order)
                    for m in order:
                        fn = fns[m]
                        for i in range(n):
                            if evict:
                                evict(m, i)
                            if m == "encache.disk.first":
                                lk["first"].forget_verified()  # untimed: a new version
                            t0 = time.perf_counter()
                            res = fn(i)
                            t1 = time.perf_counter()
                            touch(res)
                            t2 = time.perf_counter()
                            del res
                            if r:
                                times[m].append(t2 - t0)
                                calls[m].append(t1 - t0)
                out = {}
                for m in names:
                    s, c = summary(times[m], 1e3), summary(calls[m], 1e3)  # ms
                    out[m] = {"ms": s, "mb_s": nbytes / (s["p50"] / 1e3) / 1e6,
                              "mb_s_best": nbytes / (s["p10"] / 1e3) / 1e6,
                              "mb_s_p10_p90": [nbytes / (s["p90"] / 1e3) / 1e6,
                                               nbytes / (s["p10"] / 1e3) / 1e6],
                              "call_only_ms": c,
                              "call_only_mb_s": nbytes / (c["p50"] / 1e3) / 1e6}
                return out

            def ratios(methods, names):
                ms = {m: methods[m]["mb_s"] for m in methods}
                mb = {m: methods[m]["mb_s_best"] for m in methods}
                return {m: {"vs_memcpy_pagecache": ratio(ms[m], ms["memcpy.pagecache"]),
                            "vs_memcpy_ram": ratio(ms.get(m), ms.get("memcpy.ram")),
                            "vs_ecexample": ratio(ms[m], ms["ecexample.disk"]),
                            "best_vs_memcpy_pagecache": ratio(mb[m], mb["memcpy.pagecache"]),
                            "best_vs_ecexample": ratio(mb[m], mb["ecexample.disk"])}
                        for m in names}

            la0 = loadavg()
            warm = measure(METHODS + BREAKDOWN, rounds)
            row = {"label": label, "shape": list(shape), "dtype": "F16", "tensor_bytes": nbytes,
                   "entries": n, "rounds": rounds, "loads_per_method": n * rounds,
                   "loadavg": [la0, loadavg()], "methods": warm,
                   "ratios": ratios(warm, METHODS)}
            if cold_rounds:
                paths = {m: (lambda i: expaths[i]) if m == "ecexample.disk"
                         else (lambda i: str(dstore.entry_path(ids[i]))) for m in COLD}

                def evict(m, i):
                    fd = os.open(paths[m](i), os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
                cold = measure(COLD, cold_rounds, evict)
                row["cold"] = {"rounds": cold_rounds, "methods": cold,
                               "ratios": ratios(cold, COLD)}
            results["sizes"].append(row)
            for lookup in (*lk.values(), *lr.values()):
                lookup.close()
            rstore.close()
            tstore.close()
            _flush_redis(redis.url)
            shutil.rmtree(root, ignore_errors=True)
            ram = blobs = None  # (free them before the next size)
    finally:
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    results["goals"] = goals(results)
    return finish_run(results, out, code0, plot_load if plot else None)


def _redis_parser() -> str:
    from redis.utils import HIREDIS_AVAILABLE
    return "hiredis" if HIREDIS_AVAILABLE else "python (hiredis not installed)"


def _flush_redis(url: str) -> None:
    import redis as r
    r.Redis.from_url(url).flushall()


def goals(results: dict) -> dict:
    """The issue's targets, per size: encache disk >= 0.8 x memcpy, and >= ECExample."""
    out = {}
    for row in results["sizes"]:
        r = row["ratios"]
        g = {
            "encache_disk_vs_memcpy": r["encache.disk"]["vs_memcpy_pagecache"],
            "encache_disk_ge_0.8_memcpy": (r["encache.disk"]["vs_memcpy_pagecache"] or 0) >= 0.8,
            "encache_disk_vs_ecexample": r["encache.disk"]["vs_ecexample"],
            "encache_disk_not_slower_than_ecexample": (r["encache.disk"]["vs_ecexample"] or 0) >= 1.0,
            "encache_disk_first_vs_memcpy": r["encache.disk.first"]["vs_memcpy_pagecache"],
            "encache_disk_first_ge_0.8_memcpy":
                (r["encache.disk.first"]["vs_memcpy_pagecache"] or 0) >= 0.8,
            "encache_disk_first_vs_ecexample": r["encache.disk.first"]["vs_ecexample"],
            "encache_disk_read_vs_memcpy": r["encache.disk.read"]["vs_memcpy_pagecache"],
            "encache_disk_read_ge_0.8_memcpy":
                (r["encache.disk.read"]["vs_memcpy_pagecache"] or 0) >= 0.8,
            "encache_disk_always_vs_memcpy": r["encache.disk.always"]["vs_memcpy_pagecache"],
        }
        m = {k: v["ms"]["p50"] for k, v in row["methods"].items()}
        # where the time goes (medians of the breakdown rows)
        g["why"] = {
            "encache_disk_ms": m["encache.disk"],
            "checksum_ms": m["checksum"],
            "checksum_algo": results["params"].get("checksum_algo"),
            "disk_get_buffer": results["params"].get("disk_get_buffer"),
            "read_into_fresh_bytearray_ms": m["read.fresh_bytearray"],
            "read_into_uninitialised_buffer_ms": m["read.fresh_empty"],
            "zero_fill_cost_ms": m["read.fresh_bytearray"] - m["read.fresh_empty"],
            "memcpy_pagecache_ms": m["memcpy.pagecache"],
            "ecexample_call_only_ms": row["methods"]["ecexample.disk"]["call_only_ms"]["p50"],
            "redis_get_ms": m["redis.get"],
            "redis_receive_verified_ms": m["redis.receive_verified"],
            "redis_get_then_validate_ms": m["redis.get_then_validate"],
        }
        g["redis_one_pass_vs_get_then_validate"] = (m["redis.get_then_validate"]
                                                    / m["redis.receive_verified"])
        g["redis_one_pass_vs_get_alone"] = m["redis.get"] / m["redis.receive_verified"]
        g["redis_one_pass_vs_get_then_validate_touch_due"] = (
            m["redis.get_then_validate.touch"] / m["redis.receive_verified.touch"])
        if "cold" in row:
            rc = row["cold"]["ratios"]
            g["cold_encache_disk_vs_ecexample"] = rc["encache.disk"]["vs_ecexample"]
            g["cold_encache_disk_first_vs_ecexample"] = rc["encache.disk.first"]["vs_ecexample"]
            g["cold_encache_disk_vs_memcpy"] = rc["encache.disk"]["vs_memcpy_pagecache"]
        out[row["label"]] = g
    return out


def _rows(methods: dict, ratios: dict, names: list[str]) -> list[list]:
    rows = []
    for name in names:
        m, r = methods[name], ratios.get(name, {})
        rows.append([name, m["ms"]["p50"], m["ms"]["p90"], m["mb_s"], m["mb_s_best"],
                     r.get("vs_memcpy_pagecache"), r.get("vs_ecexample"),
                     m["call_only_ms"]["p50"]])
    return rows


HEADER = ["method", "p50 ms", "p90 ms", "MB/s p50", "MB/s best", "x memcpy", "x ECExample",
          "call-only ms"]


def report(results: dict) -> str:
    lines = []
    for row in results["sizes"]:
        lines.append(f"Load throughput, {row['label']} {tuple(row['shape'])} F16, warm page cache "
                     f"({row['entries']} entries x {row['rounds']} rounds, "
                     f"loadavg {row['loadavg'][0][0]}->{row['loadavg'][1][0]})")
        lines.append(table(_rows(row["methods"], row["ratios"], METHODS + BREAKDOWN), HEADER))
        lines.append("")
        if "cold" in row:
            c = row["cold"]
            lines.append(f"  cold page cache (fadvise DONTNEED before each load, "
                         f"{c['rounds']} rounds; memcpy.pagecache = cold read into a "
                         f"preallocated buffer)")
            lines.append(table(_rows(c["methods"], c["ratios"], COLD), HEADER))
            lines.append("")
    lines.append("Goals (warm page cache, medians): encache disk >= 0.8 x memcpy; never slower "
                 "than ECExampleConnector")
    for label, g in results["goals"].items():
        w = g["why"]
        lines.append(
            f"  {label}: encache disk {g['encache_disk_vs_memcpy']:.2f} x memcpy "
            f"({'met' if g['encache_disk_ge_0.8_memcpy'] else 'NOT met'}; first load of a "
            f"version {g['encache_disk_first_vs_memcpy']:.2f} x, read mode "
            f"{g['encache_disk_read_vs_memcpy']:.2f} x), {g['encache_disk_vs_ecexample']:.2f} x "
            f"ECExample ({'met' if g['encache_disk_not_slower_than_ecexample'] else 'NOT met'}"
            + (f"; cold {g['cold_encache_disk_vs_ecexample']:.2f} x" if "cold_encache_disk_vs_ecexample" in g
               else "") + ")")
        lines.append(
            f"    why: the default load maps the file ({w.get('disk_get_buffer')}) and reuses "
            f"the verification of an unchanged version, so it copies nothing "
            f"({w['encache_disk_ms']:.3f} ms); the first load of a version adds the "
            f"{w.get('checksum_algo')} pass over every page (checksum alone, cache-hot: "
            f"{w['checksum_ms']:.3f} ms); a read() into a fresh buffer takes "
            f"{w['read_into_uninitialised_buffer_ms']:.3f} ms vs memcpy "
            f"{w['memcpy_pagecache_ms']:.3f} ms; ECExample's load_file returns an mmap view in "
            f"{w['ecexample_call_only_ms']:.3f} ms (no checksum)")
    lines.append("")
    p = results["params"]
    code = p.get("code") or {}
    lines.append(f"Measured code: encache {code.get('commit', '?')}"
                 + (f" + uncommitted changes in {', '.join(code['dirty'])}" if code.get("dirty")
                    else "") + (" — CHANGED DURING THE RUN" if p.get("code_changed") else "")
                 + f"; checksum {p.get('checksum_algo')}; serving-load buffer "
                 f"{p.get('disk_get_buffer')} (read mode: {p.get('disk_read_mode_buffer')}) on "
                 f"{p.get('filesystem')}.")
    lines.append(f"MB/s = tensor bytes / time from the call until every page of the result is "
                 f"readable (best = 10th-percentile time); x memcpy is against memcpy.pagecache "
                 f"(os.readv into a preallocated buffer). Redis client parser: "
                 f"{p['redis_parser']}.")
    return "\n".join(lines)


SERIES = [("memcpy.pagecache", "memcpy: readv page cache → preallocated buffer", "#777777"),
          ("memcpy.ram", "memcpy: RAM → RAM (numpy.copyto)", "#bbbbbb"),
          ("encache.disk", "encache disk (default: mmap, verified version)", "#1f77b4"),
          ("encache.disk.first", "encache disk, first load of a version (mmap + checksum)",
           "#6baed6"),
          ("encache.disk.read", "encache disk, load_mode read (copy)", "#aec7e8"),
          ("encache.disk.always", "encache disk, verify always (mmap + checksum)", "#9467bd"),
          ("encache.redis", "encache Redis (verify)", "#2ca02c"),
          ("encache.redis.noverify", "encache Redis (verify off)", "#98df8a"),
          ("ecexample.disk", "ECExampleConnector: safetensors.load_file (mmap) + page faults",
           "#d62728")]


def plot_load(results: dict, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from serving_common import BENCH_DIR
    sizes = results["sizes"]
    has_cold = all("cold" in r for r in sizes)
    fig, axes = plt.subplots(1, 2 if has_cold else 1, figsize=(15 if has_cold else 10, 5.5),
                             squeeze=False, gridspec_kw={"width_ratios": [7, 4]} if has_cold else None)
    panels = [("warm page cache", [r["methods"] for r in sizes], SERIES)]
    if has_cold:
        panels.append(("cold page cache (fadvise DONTNEED)", [r["cold"]["methods"] for r in sizes],
                       [s for s in SERIES if s[0] in COLD]))
    for ax, (title, data, series) in zip(axes[0], panels):
        w = 0.8 / len(series)
        for k, (key, lab, col) in enumerate(series):
            if key == "memcpy.pagecache" and "cold" in title:
                lab = "readv (cold) → preallocated buffer"
            vals = [d[key]["mb_s"] for d in data]
            lo = [max(0.0, v - d[key]["mb_s_p10_p90"][0]) for v, d in zip(vals, data)]
            hi = [max(0.0, d[key]["mb_s_p10_p90"][1] - v) for v, d in zip(vals, data)]
            xs = [i + (k - len(series) / 2 + 0.5) * w for i in range(len(sizes))]
            ax.bar(xs, vals, w, label=lab, color=col, yerr=[lo, hi], capsize=2,
                   error_kw={"elinewidth": 0.7})
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([f"{r['label']}\n{tuple(r['shape'])} fp16" for r in sizes])
        ax.set_yscale("log")
        ax.set_ylabel("MB/s until the tensor is readable (median; bars p10–p90)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
    m = results["machine"]
    fig.suptitle(f"Benchmark 1 — load one encoder-cache entry: {m['cpus']} CPUs "
                 f"({m['cpu']}), loadavg at start {m['loadavg_start'][0] if m['loadavg_start'] else '?'}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(BENCH_DIR / name, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--target-mb", type=int, default=64)
    p.add_argument("--cold-rounds", type=int, default=2)
    p.add_argument("--out", default="serving_load")
    a = p.parse_args(argv)
    res = run(a.rounds, a.target_mb, a.out, cold_rounds=a.cold_rounds)
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
