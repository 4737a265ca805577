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

Everything that is not Ray-specific -- the options, what a file's row means
(:func:`~encache.jobs.precompute.classify`), the counting (``account``), the store check of
encoded identifiers (``record_encoded``), prune and the manifest -- is the single-host job's
(:mod:`encache.jobs.precompute`): :class:`RayStage` is its ``Stage`` with identify as Ray
tasks and encode on an actor pool, run by :func:`precompute_corpus` itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from dataclasses import dataclass, field, replace

from .errors import EXIT_CLUSTER, EXIT_ENGINE, EXIT_USAGE, EncacheError
from .precompute import (Encoded, PrecomputeOptions, Summary, classify, engine_store_url,
                         media_item, nothing_fits, precompute_corpus, room_budget,
                         validate_args)
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


@dataclass(frozen=True)
class RayOptions:
    """Where and how the engines run. ``address``: ``auto`` or the head's ``host:port``;
    ``cpus_per_engine`` defaults to 1 with GPUs, else 0.5 (fractional, so the identify
    tasks and other work on a small node still get CPU); ``resources_per_engine`` places
    engines by custom resources (e.g. ``{"encache_engine": 1}`` on nodes started with
    that resource); a died actor is restarted up to ``max_restarts`` times; a pool the
    cluster cannot place fails after ``start_timeout`` seconds."""

    address: str = "auto"
    engines: int = 1
    gpus_per_engine: float = 0.0
    cpus_per_engine: float | None = None
    max_restarts: int = 3
    resources_per_engine: dict | None = None
    start_timeout: float = 900.0

    def check(self) -> RayOptions:
        """Usage checks (exit 2); returns the options with the CPU default filled in."""
        if self.engines < 1:
            raise EncacheError("--engines must be at least 1", EXIT_USAGE)
        if self.gpus_per_engine < 0 or (self.cpus_per_engine is not None
                                        and self.cpus_per_engine <= 0):
            raise EncacheError("--gpus-per-engine must be >= 0 and --cpus-per-engine > 0",
                               EXIT_USAGE)
        if self.cpus_per_engine is None:
            return replace(self, cpus_per_engine=1.0 if self.gpus_per_engine else 0.5)
        return self


# --------------------------------------------------------------------------- identify

def identify_chunk(chunk: list, store_url: str, options: PrecomputeOptions,
                   encoder_config: str, lora_digest: str) -> list:
    """Runs as a Ray task: for each ``(CorpusFile, manifest record or None)``, the
    single-host row (:func:`~encache.jobs.precompute.classify`: the manifest check, the
    identifier, hashed if new/changed, and what the store holds under it: one header
    read). Returns ``[(rel, identifier, hashed, state)]``."""
    from ..connectors.store import open_store

    store = open_store(store_url, create=False)
    try:
        return [(f.rel, *classify(f, record, store=store, options=options,
                                  encoder_config=encoder_config, lora_digest=lora_digest))
                for f, record in chunk]
    finally:
        store.close()


# --------------------------------------------------------------------------- encode

def read_batch(batch: dict) -> dict:
    """File bytes -> data URLs and media kinds (image_url or video_url), as single-host
    precompute builds them; a read error becomes that row's error.

    The engine actor calls this on its own batch rather than a separate Ray Data read stage:
    the pool's input (identifiers and paths) then exists in full before the first dispatch,
    so every free engine gets a batch at once. A read stage in front of a fast encoder
    trickles its blocks out, and whichever engine is free first takes them all."""
    from .corpus import CorpusFile

    urls, kinds, errors = [], [], []
    for ident, rel, path in zip(batch["identifier"], batch["rel"], batch["path"]):
        item, error = media_item(str(ident), CorpusFile(str(path), str(rel), 0, 0))
        urls.append(item[1] if item else "")
        kinds.append(item[2] if item else "image")
        errors.append(error or "")
    return {"identifier": list(batch["identifier"]), "rel": list(batch["rel"]),
            "url": urls, "kind": kinds, "error": errors}


class _EngineActor:
    """One in-process producer engine per Ray actor (Ray Data's actor pool holds N)."""

    def __init__(self, options: dict, cwd: str, room: dict | None = None):
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
        self.budget = None
        if room:  # --over-capacity skip: encode only into free room (see _room_for)
            from .precompute.capacity import RoomBudget
            from ..connectors.store import open_store
            self.budget = RoomBudget(open_store(options["store"], create=False), **room)

    def _room_for(self, idents: list) -> int:
        """How many of this batch fit without eviction: the store's free room under the
        low watermark, less what the other engines' batches in flight may add (each
        engine has one; a batch returns once written). The entry size is learned from
        this engine's first batch when the store held none."""
        return len(idents) if self.budget is None else self.budget.fits(len(idents))

    def _learn_entry_size(self, written: list) -> None:
        if self.budget is not None and self.budget.mean_bytes is None and written:
            from .precompute.capacity import mean_entry_bytes
            self.budget.mean_bytes = mean_entry_bytes(self.budget.store, written)

    def __call__(self, batch: dict) -> dict:
        t0, wall0 = time.perf_counter(), time.time()
        all_idents, all_rels = list(batch["identifier"]), list(batch["rel"])
        keep = self._room_for(all_idents)  # the rest is skipped: no room without eviction
        batch = read_batch({key: list(v)[:keep] for key, v in batch.items()})
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
        self._learn_entry_size([i for i, good in zip(idents, ok) if good and i in saved])
        skipped = len(all_idents) - keep
        ok += [False] * skipped
        errors += [""] * skipped
        seconds = time.perf_counter() - t0
        n = len(all_idents)
        self.batches += 1
        return {"identifier": all_idents, "rel": all_rels, "ok": ok, "error": errors,
                "saved": [i in saved for i in all_idents],
                "skipped": [k >= keep for k in range(n)],
                "batch_id": [f"{self.pid}-{self.batches}"] * n,
                "node_id": [self.node_id] * n, "engine": [self.actor_id] * n,
                "pid": [self.pid] * n, "batch_seconds": [seconds] * n,
                "t_start": [wall0] * n, "t_end": [wall0 + seconds] * n}


def encode_on_ray(ray, todo: dict, opts: dict, summary: RaySummary, *, engines: int,
                  batch: int, cpus_per_engine: float, gpus_per_engine: float,
                  max_restarts: int, resources_per_engine: dict | None,
                  start_timeout: float, progress,
                  room: dict | None = None) -> tuple[list, dict, set]:
    """Encode ``todo`` (identifier -> CorpusFile) on an actor pool; returns the identifiers
    the engines encoded, ``{identifier: error}`` for the rest, and the identifiers the
    engines' writers saved (to tell an evicted entry from a lost one, as single-host).
    ``room`` (``RoomBudget`` fields but the store; ``--over-capacity skip``): each engine
    encodes only what fits, and what it skips is counted in ``summary.skipped_capacity``."""
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
                            fn_constructor_kwargs={"options": opts, "cwd": os.getcwd(),
                                                   "room": room},
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
                if bool(out["skipped"][k]):
                    summary.skipped_capacity += 1
                elif bool(out["ok"][k]):
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

class RayStage:
    """The precompute job's ``Stage`` on a Ray cluster (see the module docstring)."""

    summary_class = RaySummary

    def __init__(self, ray, ray_options: RayOptions):
        self.ray = ray
        self.opts = ray_options

    def identify(self, files, records, store, options, summary, lora_digest, progress) -> list:
        ray = self.ray
        node_url = engine_store_url(options, store)
        summary.ray_address = self.opts.address
        if progress:
            progress.start("checking nodes", 1)
        summary.nodes = check_nodes(ray, store, node_url, files)
        if progress:
            progress.advance(1)
        # hashing is CPU-bound and each worker imports vLLM's hasher once: one CPU per
        # task, chunks of HASH_CHUNK files, fewer when that would leave CPUs idle
        identify = ray.remote(num_cpus=1, max_retries=3)(identify_chunk)
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        chunk_size = max(1, min(HASH_CHUNK, max(32, -(-len(files) // cpus))))
        refs = [identify.remote([(f, records.get(f.rel)) for f in files[i:i + chunk_size]],
                                node_url, options, summary.encoder_config, lora_digest)
                for i in range(0, len(files), chunk_size)]
        if progress:
            progress.start("hashing", len(files))
        t_identify = time.perf_counter()
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
        # in corpus order, as single-host (the first file of an identifier wins)
        return [(f, *results[f.rel][1:]) for f in files]

    def encode(self, todo, store, options, summary, progress) -> Encoded | None:
        from ..connectors.media import sniff

        todo = todo.drain()  # every row was identified before this stage encodes
        if not todo:
            return None
        room = None
        budget = room_budget(store, options)
        if budget is not None:
            if nothing_fits(budget, len(todo), summary):  # no engine starts, as single-host
                return None
            room = {"max_bytes": budget.max_bytes, "low_watermark": budget.low_watermark,
                    "mean_bytes": budget.mean_bytes,
                    "others_in_flight": (self.opts.engines - 1) * options.batch}
        # the media kinds the engines must accept (a header read per file, as single-host)
        kinds = {sniff(f.path, name=f.rel).kind or "image" for f in todo.values()}
        opts = options.engine_options(engine_store_url(options, store), kinds)
        summary.engine_started = True
        o = self.opts
        ok, failed, saved = encode_on_ray(
            self.ray, todo, opts, summary, engines=o.engines, batch=options.batch,
            cpus_per_engine=o.cpus_per_engine, gpus_per_engine=o.gpus_per_engine,
            max_restarts=o.max_restarts, resources_per_engine=o.resources_per_engine,
            start_timeout=o.start_timeout, progress=progress, room=room)
        return Encoded(ok=ok, failed=failed, saved=saved)


def precompute_on_ray(corpus: str, options: PrecomputeOptions,
                      ray_options: RayOptions = RayOptions(), *, shard: str | None = None,
                      use_manifest: bool = True, prune_missing: bool = False,
                      dry_run: bool = False, wait: float = 0.0, progress=None) -> RaySummary:
    """:func:`~encache.jobs.precompute.precompute_corpus` on a Ray cluster: the same
    result (identifiers, entries, ``Summary`` fields), plus where the work ran. With
    ``over_capacity="skip"`` each engine checks the room before each batch, holding back
    the other engines' batches in flight, so the store never evicts (the entry size is
    learned from the store, else from each engine's first batch, as single-host)."""
    validate_args(corpus, options.batch, options.lora, options.lora_path, shard)
    ray_options = ray_options.check()
    with contextlib.redirect_stdout(RayNotices()):  # stdout stays the summary's (--json)
        ray, started = connect(ray_options.address)
        try:
            return precompute_corpus(corpus, options, shard=shard, use_manifest=use_manifest,
                                     prune_missing=prune_missing, dry_run=dry_run, wait=wait,
                                     progress=progress, stage=RayStage(ray, ray_options))
        finally:
            if started:
                ray.shutdown()
