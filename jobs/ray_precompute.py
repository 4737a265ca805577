"""``encache precompute CORPUS --ray ADDRESS``: the precompute job spread over a Ray cluster.

What: the same job as single-host precompute (same identifiers, same entries, same
``Summary``), with the work done by Ray:

1. **Check** (one zero-CPU task pinned to every alive node): the store and the corpus must
   be the same on every node. The driver writes a random marker into the store (a file under
   a disk store's ``.encache/``, a short-lived key in Redis) and each node must read it back,
   and must see the corpus's first file with the driver's size. A path that exists only on
   the driver's host, or ``redis://localhost`` that means another Redis on each node, is
   refused with one line (exit 7) before anything runs.
2. **Identify** (Ray tasks over chunks of files): the manifest check (a chunk carries each
   file's manifest record), vLLM's hasher for new or changed files (``identify_file``), and
   skip-present (one header read per identifier, ``holds()`` semantics). No engine starts
   when nothing is missing, as single-host.
3. **Encode** (Ray Data): ``from_items(missing)`` (identifier, path) ->
   ``map_batches(_EngineActor, concurrency=N)``: each actor reads its batch's files (bytes
   to data URLs, as single-host) and holds one in-process ``ProducerEngine`` whose
   connector writes to the shared store
   (atomic renames / MULTI: nothing partial is ever visible). A batch returns only once
   its entries are written, so a batch that reported "ok" is durable. An actor process that
   dies is restarted by Ray and its batch retried (``max_restarts``/``max_task_retries``).
4. **Finish** on the driver, under the store's precompute lock held for the whole run: each
   encoded identifier is checked in the store (as single-host), ``--prune-missing``, and the
   manifest is saved (a killed driver leaves the manifest as it was; a re-run skips what
   the store already holds and does only the rest).

Why Ray: it is what vLLM users run for multi-node batch inference, and it brings
placement, retries, global progress and load balancing (a slow node takes fewer batches).

Requirements on the cluster: ``encache[ray]`` and vLLM installed on every node (the same
versions as the driver), the model at the same path/id on every node, the corpus and the
store reachable under the same path/URL. Environment variables the engine reads
(``VLLM_*``, ``HF_*``, ``TRANSFORMERS_*``, ``ENCACHE_*``) are forwarded from the driver in
the job's runtime environment. Connecting and the node check live in
:mod:`encache.jobs.ray_cluster`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from dataclasses import dataclass, field

from ..cli.errors import EXIT_CLUSTER, EXIT_ENGINE, EXIT_USAGE, EncacheError
from ..cli.precompute import (NON_MEDIA, UNREADABLE, Summary, identify_or_mark, engine_encoder_config,
                              hashing_settings, manifest_key, validate_args)
from .ray_cluster import RayNotices, check_nodes, connect

log = logging.getLogger("encache.ray")

HASH_CHUNK = 256  # files per identify task


@dataclass
class RaySummary(Summary):
    """``Summary`` plus where the work ran: one row per engine actor."""

    ray_address: str = ""
    nodes: int = 0
    engines: list = field(default_factory=list)  # [{engine, node_id, pids, batches, images, seconds, images_per_second}]
    restarts: int = 0  # engine actor processes beyond one per engine (a died actor restarted)
    identify_seconds: float = 0.0  # the manifest/hash/skip-present stage on the cluster (wall)


# --------------------------------------------------------------------------- identify

def identify_chunk(chunk: list, store_url: str, model: str, lora: str | None, hash_algo: str,
                   media_io_kwargs: dict | None, digest: str) -> list:
    """Runs as a Ray task: for each ``(CorpusFile, manifest record or None)``, the manifest
    check, the identifier (hashed if new/changed) and whether the store holds it already.

    Returns ``[(rel, identifier, hashed, state)]`` with state ``present`` /
    ``other_config`` / ``missing`` / ``unreadable`` / ``non_media`` (as single-host:
    media found by content, any decode error one file's failure)."""
    from ..connectors.corpus import Manifest
    from ..connectors.store import open_store

    store = open_store(store_url, create=False)
    lookup = Manifest(None, {})
    out = []
    try:
        for f, record in chunk:
            lookup.files = {f.rel: record} if record else {}
            ident = lookup.lookup(f)
            hashed = ident is None
            if hashed:
                ident = identify_or_mark(f, model, lora=lora, hash_algo=hash_algo,
                                         media_io_kwargs=media_io_kwargs)
            if ident.startswith(NON_MEDIA):
                out.append((f.rel, ident, hashed, "non_media"))
                continue
            if ident.startswith(UNREADABLE):
                out.append((f.rel, ident, hashed, "unreadable"))
                continue
            info = store.stat(ident)  # holds(): one header read
            if info is None:
                state = "missing"
            elif info.meta is not None and info.meta.encoder_config == digest:
                state = "present"
            else:
                state = "other_config"
            out.append((f.rel, ident, hashed, state))
    finally:
        store.close()
    return out


# --------------------------------------------------------------------------- encode

def read_batch(batch: dict) -> dict:
    """File bytes -> data URLs and media kinds (image_url or video_url), as single-host
    precompute builds them; a read error becomes that row's error.

    The engine actor calls this on its own batch rather than a separate Ray Data read stage:
    the pool's input (identifiers and paths) then exists in full before the first dispatch,
    so every free engine gets a batch at once. A read stage in front of a fast encoder
    trickles its blocks out, and whichever engine is free first takes them all."""
    from ..cli.precompute import _media_item
    from ..connectors.corpus import CorpusFile

    urls, kinds, errors = [], [], []
    for ident, rel, path in zip(batch["identifier"], batch["rel"], batch["path"]):
        item, error = _media_item(str(ident), CorpusFile(str(path), str(rel), 0, 0))
        urls.append(item[1] if item else "")
        kinds.append(item[2] if item else "image")
        errors.append(error or "")
    return {"identifier": list(batch["identifier"]), "rel": list(batch["rel"]),
            "url": urls, "kind": kinds, "error": errors}


class _EngineActor:
    """One in-process producer engine per Ray actor (Ray Data's actor pool holds N)."""

    def __init__(self, options: dict, cwd: str):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if os.path.isdir(cwd):
            os.chdir(cwd)  # a relative model path means what it means on the driver
        import ray

        from ..connectors.vllm.producer import EngineOptions, ProducerEngine
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.actor_id = ctx.get_actor_id() or ""
        self.pid = os.getpid()
        self.batches = 0
        self.engine = ProducerEngine(EngineOptions(**options))

    def __call__(self, batch: dict) -> dict:
        t0, wall0 = time.perf_counter(), time.time()
        batch = read_batch(batch)
        idents = list(batch["identifier"])
        errors = list(batch["error"])
        payload = [(i, u, str(k)) for i, u, k, e in zip(idents, batch["url"], batch["kind"],
                                                         errors) if not e]
        results = {r.identifier: r for r in (self.engine.encode(payload) if payload else [])}
        self.engine.wait_for_saves()  # a batch that says ok is written (atomically)
        save_errors = self.engine.save_errors()
        saved = self.engine.saved_identifiers()
        ok = []
        for n, ident in enumerate(idents):
            if errors[n]:
                ok.append(False)
                continue
            r = results.get(ident)
            if r is None or not r.ok:
                ok.append(False)
                errors[n] = (r.error if r else None) or "no result from the engine"
            elif ident in save_errors:
                ok.append(False)
                errors[n] = save_errors[ident]
            else:
                ok.append(True)
        seconds = time.perf_counter() - t0
        n = len(idents)
        self.batches += 1
        return {"identifier": idents, "rel": list(batch["rel"]), "ok": ok, "error": errors,
                "saved": [i in saved for i in idents],
                "batch_id": [f"{self.pid}-{self.batches}"] * n,
                "node_id": [self.node_id] * n, "engine": [self.actor_id] * n,
                "pid": [self.pid] * n, "batch_seconds": [seconds] * n,
                "t_start": [wall0] * n, "t_end": [wall0 + seconds] * n}


def encode_on_ray(ray, todo: dict, opts: dict, summary: RaySummary, *, engines: int,
                  batch: int, cpus_per_engine: float, gpus_per_engine: float,
                  max_restarts: int, resources_per_engine: dict | None,
                  start_timeout: float, progress) -> tuple[list, dict, set]:
    """Encode ``todo`` (identifier -> CorpusFile) on an actor pool; returns the identifiers
    the engines encoded, ``{identifier: error}`` for the rest, and the identifiers the
    engines' writers saved (to tell an evicted entry from a lost one, as single-host)."""
    # every engine starts before the first batch (so the work spreads over all of them),
    # and a pool the cluster cannot place fails after start_timeout instead of hanging
    ray.data.DataContext.get_current().wait_for_min_actors_s = int(start_timeout)
    rows = [{"identifier": i, "rel": f.rel, "path": f.path} for i, f in todo.items()]
    blocks = max(1, min(len(rows), -(-len(rows) // batch)))
    ds = ray.data.from_items(rows, override_num_blocks=blocks)
    # a died actor process is restarted and its batch retried (Ray 2.60 takes these two
    # through **ray_remote_args only, with a deprecation warning for Ray 2.64)
    remote = dict(max_restarts=max_restarts, max_task_retries=max(3, max_restarts))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        ds = ds.map_batches(_EngineActor,
                            fn_constructor_kwargs={"options": opts, "cwd": os.getcwd()},
                            batch_size=batch, num_cpus=cpus_per_engine,
                            # one batch in flight per engine: the next batch goes to
                            # whichever engine is free, so a slow node gets less work
                            compute=ray.data.ActorPoolStrategy(
                                size=engines, max_tasks_in_flight_per_actor=1),
                            num_gpus=gpus_per_engine or None, batch_format="numpy",
                            resources=dict(resources_per_engine or {}) or None, **remote)
    if progress:
        progress.start("encoding", len(rows))
    ok, failed, saved = [], {}, set()
    window = [float("inf"), 0.0]  # first batch start, last batch end (wall clock)
    per_engine: dict[str, dict] = {}
    seen_batches: set = set()
    try:
        for out in ds.iter_batches(batch_size=None, batch_format="numpy"):
            n = len(out["identifier"])
            for k in range(n):
                ident = str(out["identifier"][k])
                if bool(out["ok"][k]):
                    ok.append(ident)
                    if bool(out["saved"][k]):
                        saved.add(ident)
                else:
                    failed[ident] = str(out["error"][k]) or "failed"
                eng = per_engine.setdefault(str(out["engine"][k]), {
                    "engine": str(out["engine"][k])[:12], "node_id": str(out["node_id"][k]),
                    "pids": [], "batches": 0, "images": 0, "seconds": 0.0})
                pid = int(out["pid"][k])
                if pid not in eng["pids"]:
                    eng["pids"].append(pid)
                eng["images"] += 1
                key = str(out["batch_id"][k])
                if key not in seen_batches:  # one timing per batch
                    seen_batches.add(key)
                    window[0] = min(window[0], float(out["t_start"][k]))
                    window[1] = max(window[1], float(out["t_end"][k]))
                    eng["batches"] += 1
                    eng["seconds"] += float(out["batch_seconds"][k])
            if progress:
                progress.advance(n)
    except Exception as e:
        if isinstance(e, EncacheError):
            raise
        if isinstance(e, ray.exceptions.GetTimeoutError):
            raise EncacheError(
                f"{engines} engine(s) did not start within {int(start_timeout)} s: does the "
                f"cluster have {cpus_per_engine:g} CPU + {gpus_per_engine:g} GPU free for each?",
                EXIT_CLUSTER, hint="see `ray status`; lower --engines or the per-engine "
                                   "resources") from None
        text = str(e).strip().splitlines()
        raise EncacheError(f"the Ray encode stage failed: {type(e).__name__}: "
                           f"{(text[-1] if text else '')[:240]}", EXIT_ENGINE,
                           hint="set ENCACHE_DEBUG=1 and see `ray logs` / the dashboard") from e
    for eng in per_engine.values():
        eng["images_per_second"] = eng["images"] / eng["seconds"] if eng["seconds"] > 0 else 0.0
    summary.engines = sorted(per_engine.values(), key=lambda e: (e["node_id"], e["engine"]))
    summary.restarts = sum(max(0, len(e["pids"]) - 1) for e in summary.engines)
    # the encode stage as single-host counts it: from the first batch to the last, without
    # the engines' start-up (node clocks are assumed in sync, as Ray's own timeline does)
    summary.encode_seconds = max(0.0, window[1] - window[0]) if window[1] else 0.0
    return ok, failed, saved


# --------------------------------------------------------------------------- the job

def run_precompute_ray(corpus: str, model: str, store_url: str, *, address: str = "auto",
                       engines: int = 1, gpus_per_engine: float = 0.0,
                       cpus_per_engine: float | None = None,
                       max_restarts: int = 3, resources_per_engine: dict | None = None,
                       start_timeout: float = 900.0, lora: str | None = None, lora_path: str | None = None, batch: int = 16,
                       wait: float = 0.0, prune_missing: bool = False, shard: str | None = None,
                       use_manifest: bool = True, dry_run: bool = False,
                       max_model_len: int | None = None, dtype: str | None = None,
                       engine_args: dict | None = None, max_bytes: int | None = None,
                       hash_algo: str = "blake3", tag: str | None = None,
                       progress=None) -> RaySummary:
    """The precompute job on a Ray cluster; the same result as ``run_precompute``.

    ``cpus_per_engine`` defaults to 1 with GPUs, else 0.5 (fractional, so the identify
    tasks and other work on a small node still get CPU). ``resources_per_engine`` places engines by custom
    resources (e.g. ``{"encache_engine": 1}`` on nodes started with that resource)."""
    shard_spec = validate_args(corpus, batch, lora, lora_path, shard)
    if engines < 1:
        raise EncacheError("--engines must be at least 1", EXIT_USAGE)
    if gpus_per_engine < 0 or (cpus_per_engine is not None and cpus_per_engine <= 0):
        raise EncacheError("--gpus-per-engine must be >= 0 and --cpus-per-engine > 0", EXIT_USAGE)
    if cpus_per_engine is None:
        cpus_per_engine = 1.0 if gpus_per_engine else 0.5
    with contextlib.redirect_stdout(RayNotices()):  # stdout stays the summary's (--json)
        return _connect_and_run(address, dict(
                    corpus=corpus, model=model, store_url=store_url, engines=engines,
                    gpus_per_engine=gpus_per_engine, cpus_per_engine=cpus_per_engine,
                    max_restarts=max_restarts,
                    resources_per_engine=resources_per_engine, start_timeout=start_timeout,
                    lora=lora, lora_path=lora_path, batch=batch, wait=wait,
                    prune_missing=prune_missing, shard=shard, shard_spec=shard_spec,
                    use_manifest=use_manifest, dry_run=dry_run, max_model_len=max_model_len,
                    dtype=dtype, engine_args=engine_args, max_bytes=max_bytes,
                    hash_algo=hash_algo, tag=tag, progress=progress))


def _connect_and_run(address: str, kw: dict) -> RaySummary:
    from ..connectors.corpus import Manifest, shard_of, walk
    from ..connectors.store import open_store
    from ..connectors.store.url import is_redis_url

    ray, started = connect(address)
    try:
        return _run(ray, address=address, walk=walk, shard_of=shard_of, Manifest=Manifest,
                    open_store=open_store, is_redis_url=is_redis_url, **kw)
    finally:
        if started:
            ray.shutdown()


def _run(ray, *, corpus, model, store_url, address, engines, gpus_per_engine, cpus_per_engine,
         max_restarts, resources_per_engine, start_timeout, lora, lora_path, batch, wait,
         prune_missing, shard, shard_spec, use_manifest, dry_run, max_model_len, dtype,
         engine_args, max_bytes, hash_algo, tag, progress, walk, shard_of, Manifest,
         open_store, is_redis_url) -> RaySummary:
    store = open_store(store_url, create=True, **({"max_bytes": max_bytes} if max_bytes else {}))
    # what every node opens: the real URL for Redis (store.url is redacted), the absolute
    # path for a disk store
    node_url = store_url if is_redis_url(store_url) else str(store.url)
    summary = RaySummary(store=store.url, model=model, lora=lora, ray_address=address)
    engine_args = dict(engine_args or {})
    summary.encoder_config = engine_encoder_config(engine_args, tag)
    media_io_kwargs, hash_algo = hashing_settings(engine_args, hash_algo)
    t_start = time.perf_counter()
    with store.lock("precompute", wait=wait):
        files = walk(corpus)
        if shard_spec:
            files = [f for f in files if shard_of(f.rel, *shard_spec)]
        summary.files = len(files)
        if progress:
            progress.start("checking nodes", 1)
        summary.nodes = check_nodes(ray, store, node_url, files)
        if progress:
            progress.advance(1)
        key = manifest_key(corpus, model, lora, hash_algo, shard, media_io_kwargs)
        manifest = Manifest.load(Manifest.location(store, key), key)
        if not use_manifest:
            manifest.files = {}
        by_rel = {f.rel: f for f in files}
        # hashing is CPU-bound and each worker imports vLLM's hasher once: one CPU per
        # task, chunks of HASH_CHUNK files, fewer when that would leave CPUs idle
        identify = ray.remote(num_cpus=1, max_retries=3)(identify_chunk)
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        chunk_size = max(1, min(HASH_CHUNK, max(32, -(-len(files) // cpus))))
        refs = [identify.remote([(f, manifest.files.get(f.rel)) for f in files[i:i + chunk_size]],
                                node_url, model, lora, hash_algo, media_io_kwargs,
                                summary.encoder_config)
                for i in range(0, len(files), chunk_size)]
        if progress:
            progress.start("hashing", len(files))
        t_identify = time.perf_counter()
        todo: dict[str, object] = {}
        results: dict[str, tuple] = {}
        pending = list(refs)
        while pending:  # collect as they finish, for the progress bar
            done, pending = ray.wait(pending, num_returns=1)
            for rows in ray.get(done):
                for row in rows:
                    results[row[0]] = row
                    if progress:
                        progress.advance(1, failed=row[0] if row[3] == "unreadable" else None)
        summary.identify_seconds = time.perf_counter() - t_identify
        for f in files:  # in corpus order, as single-host (first file of an identifier wins)
            rel, ident, hashed, state = results[f.rel]
            if hashed:
                manifest.record(f, ident)
            if state == "non_media":  # remembered: an unchanged file is not sniffed again
                summary.skipped_non_media += 1
                summary.non_media.append({"path": rel, "reason": ident[len(NON_MEDIA):]})
                continue
            if hashed:
                summary.hashed += 1
            else:
                summary.from_manifest += 1
            if state == "unreadable":
                summary.failed += 1
                summary.failures.append({"path": rel, "error": ident[len(UNREADABLE):]})
            elif state == "present" and ident not in todo:
                summary.present += 1
            else:
                if state == "other_config" and ident not in todo:
                    summary.other_config += 1
                todo.setdefault(ident, f)
        if todo and not dry_run:
            _encode(ray, todo, model, node_url, store, summary, lora=lora, lora_path=lora_path,
                    batch=batch, max_model_len=max_model_len, dtype=dtype,
                    engine_args=engine_args, max_bytes=max_bytes, tag=tag, engines=engines,
                    cpus_per_engine=cpus_per_engine, gpus_per_engine=gpus_per_engine,
                    max_restarts=max_restarts,
                    resources_per_engine=resources_per_engine, start_timeout=start_timeout,
                    progress=progress)
        if prune_missing and not dry_run:  # as single-host (driver side)
            current = set(by_rel)
            gone = [rel for rel in list(manifest.files) if rel not in current]
            still_used = {manifest.files[r][2] for r in manifest.files if r in current}
            for rel in gone:
                ident = manifest.files[rel][2]
                if not ident.startswith(("!", UNREADABLE)) and ident not in still_used \
                        and store.delete(ident):
                    summary.pruned += 1
                manifest.drop(rel)
        if not dry_run:
            manifest.save()
    summary.seconds = time.perf_counter() - t_start
    return summary


def _encode(ray, todo, model, node_url, store, summary, *, lora, lora_path, batch,
            max_model_len, dtype, engine_args, max_bytes, tag, engines, cpus_per_engine,
            gpus_per_engine, max_restarts, resources_per_engine, start_timeout,
            progress) -> None:
    from ..connectors.media import sniff

    # the media kinds the engines must accept (a header read per file, as single-host)
    kinds = {sniff(f.path, name=f.rel).kind or "image" for f in todo.values()}
    opts = dict(model=model, store=node_url, max_model_len=max_model_len, dtype=dtype,
                lora_name=lora, lora_path=lora_path, extra=engine_args,
                store_options={**({"max_bytes": max_bytes} if max_bytes else {}),
                               **({"tag": tag} if tag else {})} or None,
                modalities=tuple(sorted(kinds)))
    summary.engine_started = True
    ok, failed, saved = encode_on_ray(ray, todo, opts, summary, engines=engines, batch=batch,
                               cpus_per_engine=cpus_per_engine, gpus_per_engine=gpus_per_engine,
                               max_restarts=max_restarts,
                               resources_per_engine=resources_per_engine,
                               start_timeout=start_timeout, progress=progress)
    for ident, err in failed.items():
        summary.failed += 1
        summary.failures.append({"path": todo[ident].rel, "error": err})
    for ident in ok:  # as single-host: the store is the truth
        info = store.stat(ident)
        if info is None and ident in saved:  # written, then evicted to honour max_bytes
            summary.encoded += 1
            summary.evicted += 1
        elif info is None:
            summary.failed += 1
            summary.failures.append({"path": todo[ident].rel, "error":
                                     "the engine stored no entry under the expected identifier"})
        else:
            summary.encoded += 1
            summary.bytes_written += info.size
