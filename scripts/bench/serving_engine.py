"""Benchmarks 3 and 4 — a real CPU vLLM engine serving cached images (issues #4, #5).

One *model run* (a fresh process: ``serving_bench.py --part engine --model M``) builds a
corpus of distinct page images, writes one synthetic entry per image — the right
identifier (vLLM's own hasher), shape (image tokens x LM width) and dtype (F32, the
engine's dtype) — both as an encache store (with checksums) and as an ECExampleConnector
directory (``safetensors.torch.save_file``), then runs one in-process consumer engine per
configuration, one after another (each shut down before the next):

  none       no connector: the vision encoder runs for every image (the reference)
  ecexample  vLLM's ECExampleConnector: synchronous safetensors loads inside the worker's
             start_load_caches
  encache    EncacheConnector over the disk store (defaults: verify on, 4 load threads):
             background read + verify on the scheduler side, torch.frombuffer in the worker

Both connectors are subclassed here only to time them (``TimedECExample``,
``TimedEncache``): every worker ``start_load_caches`` call is timed, and then one byte per
4 KiB page of each tensor it produced is read inside the timed region — ECExample's
tensors are lazy mmaps on CPU, so without this its page faults would land, untimed, in the
model step. The call alone is recorded too. On the scheduler side ``TimedEncache``
records each hit's background read+verify time (``Staged.load_seconds``). The vision
encoder (``LlavaForConditionalGeneration.embed_multimodal``) and every engine step
(``LLMEngine.step``) are timed by wrappers.

Workload per configuration, every image seen once per engine (so neither vLLM's encoder
cache nor its processor cache can serve it): ``warmup`` images in one batch (untimed),
``sequential`` images one request at a time (user-visible latency), then ``batch`` images
submitted together (throughput, per-request latency from vLLM's request metrics).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import loadavg, set_engine_env, summary  # noqa: E402

set_engine_env()

import torch  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.example_connector import (  # noqa: E402
    ECExampleConnector,
)

from encache.connectors.vllm.connector import EncacheConnector  # noqa: E402

# -- instrumentation (module globals: the in-process engine imports this module by name) --------

REC = {"loads": [], "staged": [], "encoder": [], "steps": []}


def reset_records() -> None:
    for v in REC.values():
        v.clear()


def _touch(t: torch.Tensor) -> int:
    flat = t.reshape(-1).view(torch.uint8)
    return int(flat[::4096].sum())


class _TimedLoads:
    def start_load_caches(self, encoder_cache, **kwargs) -> None:
        before = set(encoder_cache)
        t0 = time.perf_counter()
        super().start_load_caches(encoder_cache, **kwargs)
        t1 = time.perf_counter()
        new = [encoder_cache[k] for k in encoder_cache.keys() - before]
        for t in new:
            _touch(t)
        t2 = time.perf_counter()
        REC["loads"].append((t2 - t0, t1 - t0, len(new), sum(t.nbytes for t in new)))


class TimedECExample(_TimedLoads, ECExampleConnector):
    pass


class TimedEncache(_TimedLoads, EncacheConnector):
    def update_state_after_alloc(self, request, index: int) -> None:
        if self.lookup is not None:
            staged = self.scheduler._pinned.get(request.mm_features[index].identifier) \
                or self.lookup.get_staged(request.mm_features[index].identifier)
            if staged is not None:
                REC["staged"].append(staged.load_seconds)
        super().update_state_after_alloc(request, index)


def instrument_encoder() -> None:
    from vllm.model_executor.models import llava
    cls = llava.LlavaForConditionalGeneration
    if getattr(cls, "_bench_timed", False):
        return
    original = cls.embed_multimodal

    def timed(model_self, **kwargs):
        t0 = time.perf_counter()
        out = original(model_self, **kwargs)
        dt = time.perf_counter() - t0
        if isinstance(out, (list, tuple)):
            items = len(out)
        else:  # one tensor: (images, tokens, hidden) for a batch, (tokens, hidden) for one
            items = out.shape[0] if out.dim() == 3 else 1
        REC["encoder"].append((dt, items))
        return out
    cls.embed_multimodal = timed
    cls._bench_timed = True


def instrument_steps(llm) -> None:
    engine = llm.llm_engine
    original = engine.step

    def step():
        t0 = time.perf_counter()
        out = original()
        REC["steps"].append(time.perf_counter() - t0)
        return out
    engine.step = step


# -- the workload ------------------------------------------------------------------------------

def make_images(root: Path, count: int, seed: int) -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from demo_corpus import page
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        p = root / f"page{i:03d}.png"
        page(i, seed, size=(192, 256)).save(p, "PNG")
        paths.append(str(p))
    return paths


def write_entries(model: str, paths: list[str], tokens: int, hidden: int, enc_dir: Path,
                  ex_dir: Path) -> list[str]:
    import numpy as np
    from safetensors.torch import save_file

    from encache.connectors.store import open_store
    from encache.connectors.store.entry import encode_parts
    from encache.connectors.vllm.hashing import identify_file

    store = open_store(str(enc_dir))
    rng = np.random.default_rng(0)
    ids = []
    for path in paths:
        ident = identify_file(path, model).identifier
        arr = (rng.standard_normal((tokens, hidden), dtype=np.float32) * 0.02)
        header, view = encode_parts(ident, arr.view(np.uint8), "F32", arr.shape, model=model,
                                    vllm_version="0.32.0", hash_algo="blake3")
        store.put(ident, [header, view])
        p = ex_dir / ident / "encoder_cache.safetensors"
        p.parent.mkdir(parents=True, exist_ok=True)
        save_file({"ec_cache": torch.from_numpy(arr)}, str(p))
        with open(p, "rb+") as f:  # clean pages, so the cold phases can evict them
            os.fsync(f.fileno())
        ids.append(ident)
    return ids


def ec_config(kind: str, enc_dir: Path, ex_dir: Path) -> dict | None:
    if kind == "none":
        return None
    if kind == "ecexample":
        return {"ec_connector": "TimedECExample", "ec_role": "ec_consumer",
                "ec_connector_module_path": "serving_engine",
                "ec_connector_extra_config": {"shared_storage_path": str(ex_dir)}}
    if kind == "encache":
        return {"ec_connector": "TimedEncache", "ec_role": "ec_consumer",
                "ec_connector_module_path": "serving_engine",
                "ec_connector_extra_config": {"store": str(enc_dir), "counters_flush_s": 0.2}}
    raise ValueError(kind)


def _raw_request_metrics(outs) -> dict:
    ttft, e2e, queue = [], [], []
    for o in outs:
        m = o.metrics
        if m is None or not getattr(m, "queued_ts", 0):
            continue
        if m.first_token_ts:
            ttft.append(m.first_token_ts - m.queued_ts)
        if m.last_token_ts:
            e2e.append(m.last_token_ts - m.queued_ts)
        if m.scheduled_ts:
            queue.append(m.scheduled_ts - m.queued_ts)
    return {"ttft": ttft, "e2e": e2e, "queue": queue}


def _raw_records() -> dict:
    return {k: list(v) for k, v in REC.items()}


def phase_summary(raws: list[dict]) -> dict:
    """Pool one phase's raw samples over repetitions and summarise them."""
    cat = {}
    for r in raws:
        for k, v in r.items():
            if isinstance(v, list):
                cat.setdefault(k, []).extend(v)
    loads_all = cat.get("loads", [])
    loads = [x for x in loads_all if x[2]]
    items = sum(x[2] for x in loads)
    enc = cat.get("encoder", [])
    enc_items = sum(n for _, n in enc)
    enc_time = sum(t for t, _ in enc)
    steps = cat.get("steps", [])
    walls = [r["wall_s"] for r in raws]
    reqs = [r["requests"] for r in raws]
    out = {
        "repetitions": len(raws),
        "requests": sum(reqs),
        "wall_s": sum(walls),
        # throughput: median over repetitions of requests / wall (robust to one noisy rep)
        "throughput_req_s": _median([n / w for n, w in zip(reqs, walls) if w]),
        "throughput_req_s_reps": [n / w for n, w in zip(reqs, walls) if w],
        "engine_steps": len(steps),
        "step_ms": summary(steps, 1e3),
        "step_total_s": sum(steps),
        "load_calls": len(loads_all),
        "load_calls_with_items": len(loads),
        "loaded_items": items,
        "loaded_bytes": sum(x[3] for x in loads),
        # per start_load_caches call that loaded something: call + fault-in / call alone
        "block_ms_per_loading_step": summary([x[0] for x in loads], 1e3),
        "block_call_only_ms_per_loading_step": summary([x[1] for x in loads], 1e3),
        "block_total_ms": sum(x[0] for x in loads_all) * 1e3,
        "block_ms_per_item": (sum(x[0] for x in loads) / items * 1e3) if items else None,
        "block_ms_per_item_samples": summary([x[0] / x[2] for x in loads], 1e3),
        "block_all_steps_ms": summary([x[0] for x in loads_all], 1e3),
        "encoder_calls": len(enc),
        "encoder_items": enc_items,
        "encoder_total_ms": enc_time * 1e3,
        "encoder_ms_per_item": (enc_time / enc_items * 1e3) if enc_items else None,
        "encoder_ms_per_item_by_call": summary([t / n for t, n in enc if n], 1e3),
        "staged_load_ms": summary(cat.get("staged", []), 1e3),
    }
    if cat.get("latency"):
        out["latency_ms"] = summary(cat["latency"], 1e3)
    if cat.get("e2e"):
        out["ttft_ms"] = summary(cat["ttft"], 1e3)
        out["e2e_ms"] = summary(cat["e2e"], 1e3)
        out["queued_to_scheduled_ms"] = summary(cat["queue"], 1e3)
    return out


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def evict(paths) -> None:
    """Drop these files from the page cache (posix_fadvise DONTNEED; clean pages only)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_config(kind: str, model: str, images: dict, files: dict, enc_dir: Path, ex_dir: Path,
               max_tokens: int, engine_kw: dict) -> dict:
    """One engine, every phase; raw samples per phase (pooled by :func:`phase_summary`)."""
    from engine_support import conversation, make_llm, shutdown
    from vllm import SamplingParams

    from encache.connectors.store import open_store

    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    res = {"config": kind, "loadavg_start": loadavg()}
    t0 = time.perf_counter()
    llm = make_llm(model, ec_config(kind, enc_dir, ex_dir), disable_log_stats=False, **engine_kw)
    res["engine_start_s"] = time.perf_counter() - t0
    instrument_steps(llm)
    try:
        llm.chat([conversation(p) for p in images["warmup"]], sp, use_tqdm=False)
        if kind == "encache":
            time.sleep(0.5)  # let the warm-up's counters flush (every 0.2 s), then zero them
            open_store(str(enc_dir)).reset_counters()
        phases = ["sequential", "batch"]
        if kind != "none" and "batch_cold" in images:  # cold only matters when reading files
            phases += ["sequential_cold", "batch_cold"]
        for phase in phases:
            group = images[phase]
            if phase.endswith("_cold"):
                evict(f for p in group for f in files[p])
            reset_records()
            if phase.startswith("sequential"):
                lat = []
                for p in group:
                    t = time.perf_counter()
                    llm.chat([conversation(p)], sp, use_tqdm=False)
                    lat.append(time.perf_counter() - t)
                res[phase] = {"requests": len(lat), "wall_s": sum(lat), "latency": lat,
                              **_raw_records()}
            else:
                t = time.perf_counter()
                outs = llm.chat([conversation(p) for p in group], sp, use_tqdm=False)
                wall = time.perf_counter() - t
                res[phase] = {"requests": len(outs), "wall_s": wall,
                              **_raw_request_metrics(outs), **_raw_records()}
                res["output_tokens_per_request"] = sum(
                    len(o.outputs[0].token_ids) for o in outs) / len(outs)
        if kind == "encache":
            from vllm.distributed.ec_transfer import get_ec_transfer
            with contextlib.suppress(Exception):
                res["worker_stats"] = dict(get_ec_transfer().worker.stats)
    finally:
        shutdown(llm)
        gc.collect()
    if kind == "encache":
        time.sleep(0.5)  # counters flush every 0.2 s (and at shutdown)
        res["store_counters"] = open_store(str(enc_dir)).read_counters()
    res["loadavg_end"] = loadavg()
    return res


def direct_load_times(ids: list[str], enc_dir: Path, ex_dir: Path, rounds: int = 5) -> dict:
    """The load path outside the engine on the same entries (warm page cache), per image."""
    from safetensors.torch import load_file

    from encache.connectors.lookup import EntryLookup
    from encache.connectors.store import open_store
    from encache.connectors.vllm.loads import LoadItem
    from encache.connectors.vllm.worker import EncacheWorkerConnector

    worker = object.__new__(EncacheWorkerConnector)
    worker.model_dtype = torch.float32
    worker._device = torch.device("cpu")
    store = open_store(str(enc_dir))
    out = {}
    # "encache": the first load of each stored version (read/map + full verify), what the
    # engine does for an image it has not loaded before; "encache_verified": a later load
    # of the unchanged file (verification reused)
    for mode in ("encache", "encache_verified"):
        lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600)
        xs = []
        for r in range(rounds + 1):
            for ident in ids:
                if mode == "encache":
                    lk.forget_verified()
                t0 = time.perf_counter()
                st = lk.load_now(ident)
                t = worker._to_tensor(LoadItem(ident, st.blob, st.offset, st.meta.dtype,
                                               st.meta.shape))
                _touch(t)
                if r:
                    xs.append(time.perf_counter() - t0)
        lk.close()
        out[mode] = summary(xs, 1e3)
    xs = []
    for r in range(rounds + 1):
        for ident in ids:
            t0 = time.perf_counter()
            t = load_file(str(ex_dir / ident / "encoder_cache.safetensors"))["ec_cache"]
            _touch(t)
            if r:
                xs.append(time.perf_counter() - t0)
    out["ecexample"] = summary(xs, 1e3)
    return out


def run_model(kind: str, configs: list[str], n_warmup: int, n_seq: int, n_batch: int,
              max_tokens: int, workdir: str, out_json: str, cold: bool = True,
              reps: int = 2) -> dict:
    """Every configuration once, then the connector configurations ``reps`` times in all,
    alternating in mirrored order (none, A, B, B, A, ...) so slow drifts of a shared
    machine's load hit both alike; samples are pooled over repetitions."""
    from serving_models import ensure_model, model_info
    model = ensure_model(kind)
    info = model_info(model)
    work = Path(workdir)
    sizes = [("warmup", n_warmup), ("sequential", n_seq), ("batch", n_batch)]
    if cold:
        sizes += [("sequential_cold", n_seq), ("batch_cold", n_batch)]
    paths = make_images(work / "images", sum(n for _, n in sizes), seed=11)
    images, k = {}, 0
    for name, n in sizes:
        images[name], k = paths[k:k + n], k + n
    enc_dir, ex_dir = work / "encache", work / "ecexample"
    t = time.perf_counter()
    ids = write_entries(model, paths, info["image_tokens"], info["text_hidden"], enc_dir, ex_dir)
    by_path = dict(zip(paths, ids))
    from encache.connectors.store import open_store
    from encache.connectors.store.entry import parse_header
    enc_store = open_store(str(enc_dir))
    head = bytes(enc_store.get(ids[0])[:4096])
    checksum_algo = (parse_header(memoryview(head))[0].checksum or "none").split(":")[0]
    files = {}
    for p, ident in by_path.items():  # both layouts' files of an image (for eviction)
        files[p] = [str(enc_store.entry_path(ident)),
                    str(ex_dir / ident / "encoder_cache.safetensors")]
    entry_bytes = info["image_tokens"] * info["text_hidden"] * 4
    result = {"model": kind, "model_path": model, "model_info": info,
              "entry_shape": [info["image_tokens"], info["text_hidden"]], "entry_dtype": "F32",
              "entry_bytes": entry_bytes, "write_entries_s": time.perf_counter() - t,
              "images": {k: len(v) for k, v in images.items()}, "max_tokens": max_tokens,
              "torch_threads": torch.get_num_threads(), "checksum_algo": checksum_algo,
              "disk_get_buffer": type(enc_store.get(ids[0])).__name__, "configs": {}}
    engine_kw = {}
    instrument_encoder()
    conn = [c for c in configs if c != "none"]
    order = [c for c in configs if c == "none"]
    for r in range(reps):
        order += conn if r % 2 == 0 else conn[::-1]
    result["order"] = order
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for i, cfg in enumerate(order):
        print(f"[engine] {kind}: {cfg} ({i + 1}/{len(order)}) ...", file=sys.stderr, flush=True)
        runs[cfg].append(run_config(cfg, model, images, files, enc_dir, ex_dir, max_tokens,
                                    engine_kw))
    for cfg, rs in runs.items():
        agg = {"config": cfg, "repetitions": len(rs),
               "engine_start_s": [r["engine_start_s"] for r in rs],
               "loadavg": [[r["loadavg_start"], r["loadavg_end"]] for r in rs],
               "loadavg_start": rs[0]["loadavg_start"]}
        for phase in ("sequential", "batch", "sequential_cold", "batch_cold"):
            raws = [r[phase] for r in rs if phase in r]
            if raws:
                agg[phase] = phase_summary(raws)
        for key in ("worker_stats", "store_counters", "output_tokens_per_request"):
            if key in rs[-1]:
                agg[key] = [r.get(key) for r in rs]
        result["configs"][cfg] = agg
    Path(out_json).write_text(json.dumps(result))
    warm_ids = [by_path[p] for p in images["sequential"] + images["batch"]]
    result["direct_load_ms"] = direct_load_times(warm_ids, enc_dir, ex_dir)
    Path(out_json).write_text(json.dumps(result))
    return result

