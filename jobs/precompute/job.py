"""The precompute job as library code: identify -> encode what is missing -> finish.

What: fill a store with the encoder outputs a ``vllm serve`` consumer will look up, under
the identifiers it will compute. Two entry points around one core:

* :func:`precompute_files` -- an explicit list of files (paths or ``CorpusFile``), no
  manifest, no corpus walk: what ``encache warm --compute-missing`` and Python users call.
* :func:`precompute_corpus` -- a corpus directory: walk (and ``shard``), the manifest (an
  unchanged file is not read again), ``prune_missing``, ``dry_run``; what
  ``encache precompute`` calls.

Both run the same three phases, written once here:

1. **identify** every file (manifest record, else vLLM's hasher over the served bytes:
   :func:`identify_or_mark`) and classify what the store holds under it
   (:func:`stored_state`); :func:`account` turns those rows into the ``Summary`` counts and
   the ``todo`` (identifier -> file, first file wins). What a policy removed (capacity
   eviction, ``purge --older-than``: ``store.removals()``) is left out and counted
   (``skipped_removed``) unless ``refill_removed``: a refresh does not undo the policy.
   No engine starts when nothing is missing.
2. **encode** ``todo`` with a pluggable stage: :class:`LocalStage` (an in-process
   :class:`~encache.connectors.vllm.producer.ProducerEngine`, batch by batch, with the
   ``--over-capacity skip`` room budget and the store-full stop; it identifies on a
   background thread and starts the engine at the first missing file, so hashing
   overlaps the engine's start-up and encoding) or the Ray stage of
   :mod:`encache.jobs.ray_precompute` (identify tasks and an actor pool of engines).
3. **finish** (:func:`record_encoded`): every identifier an engine reported is checked in
   the store (the store is the truth: evicted-after-write is told from lost), evictions
   and the capacity note counted, then (corpus only) prune and save the manifest.

Why: one implementation of the job for the CLI, ``warm`` and Ray; each parses its own
options and calls this. Errors are :class:`~encache.jobs.errors.EncacheError` with the CLI's
exit codes (usage 2, store 7, engine 8); no printing here: ``progress`` is an optional
:class:`encache.jobs.progress.Progress` (``start(phase, total)`` /
``advance(n, failed=None, phase=None)``).

The package's other modules: :mod:`.options` (``PrecomputeOptions``, ``Summary``,
argument checks), :mod:`.identify` (``classify``, ``account``), :mod:`.encode`
(``LocalStage``); this module is the flow and the finish. The package's face
(``encache.jobs.precompute``) exports the public names of all four.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Protocol

from .encode import Encoded, LocalStage
from .identify import Todo, account, classify, identify_or_mark, stored_state
from .options import (PrecomputeOptions, Summary, engine_encoder_config, hashing_settings,
                      manifest_key, parse_engine_args, validate_args)


class Stage(Protocol):
    """The pluggable part of the job: how files are identified and how ``todo`` is
    encoded. :class:`LocalStage` runs both in this process (rows stream from a background
    thread into the engine); the Ray stage on a cluster (every row first)."""

    summary_class: type

    def identify(self, files: list, records: dict, store, options: PrecomputeOptions,
                 summary: Summary, lora_digest: str, progress) -> Iterable[tuple]:
        """Rows ``(file, identifier or marker, hashed, state)`` in corpus order: a list,
        or a :class:`~.identify.RowStream` still being computed."""

    def encode(self, todo: Todo, store, options: PrecomputeOptions, summary: Summary,
               progress) -> Encoded | None:
        """Encode what ``todo`` yields (``(identifier, file)`` as found; ``todo.drain()``
        waits for the whole dict); None when no engine ran (nothing was missing, no room)."""


# --------------------------------------------------------------------------- finish

def record_encoded(store, todo: dict, result: Encoded, summary: Summary) -> None:
    """Count an encode stage's result: failures as reported, and every identifier an
    engine encoded checked in the store (the store is the truth)."""
    for ident, err in result.failed.items():
        summary.failed += 1
        summary.failures.append({"path": todo[ident].rel, "error": err})
    for ident in result.ok:
        info = store.stat(ident)
        if info is None and ident in result.saved:  # written, then evicted to honour max_bytes
            summary.encoded += 1
            summary.evicted_own += 1
        elif info is None:
            summary.failed += 1
            err = (result.save_errors.get(ident)
                   or "the engine stored no entry under the expected identifier")
            summary.failures.append({"path": todo[ident].rel, "error": err})
        else:
            summary.encoded += 1
            summary.bytes_written += info.size


def refill_removed(store, removed: Mapping[str, str], result: Encoded,
                   summary: Summary) -> None:
    """Entries a policy had removed and this run stored again (``refill_removed``): count
    them and drop their removal records (one evicted again meanwhile keeps its new one)."""
    back = [i for i in result.ok if i in removed and store.contains(i)]
    if back:
        summary.refilled_removed += len(back)
        store.forget_removals(back)


def check_capacity(store, summary: Summary, wanted: int, cap: int | None) -> None:
    """Compare what the corpus needs with the capacity ``cap``; note it once (numbers)."""
    from .capacity import capacity_note, mean_entry_bytes

    if not cap or not wanted:
        return
    if summary.encoded > summary.evicted_own and summary.bytes_written:
        mean = summary.bytes_written / (summary.encoded - summary.evicted_own)
    else:
        mean = mean_entry_bytes(store, store.identifiers())
    summary.capacity = capacity_note(wanted, mean, cap, summary.over_capacity)


def _run_phases(files: list, records: dict, store, options: PrecomputeOptions, summary: Summary,
                stage: Stage, *, manifest, dry_run: bool, progress) -> None:
    """identify -> encode -> record, the part every entry point shares. The stage's rows
    may still be coming (``LocalStage``: a :class:`~.identify.RowStream`): the :class:`Todo` counts
    them as the encode stage takes them, and the rest once it is done."""
    from ...connectors.store.lora_stamp import adapter_digest

    lora_digest = adapter_digest(options.lora_path) if options.lora else ""
    removed = store.removals()  # what a policy removed: left out unless refilled
    rows = stage.identify(files, records, store, options, summary, lora_digest, progress)
    todo = Todo(rows, summary, manifest, None if options.refill_removed else removed)
    try:
        if dry_run:
            todo.drain()
        else:
            evictions_before = store.read_counters().get("evictions", 0)
            result = stage.encode(todo, store, options, summary, progress)
            todo.drain()  # rows the stage did not take (it stopped early, or nothing was missing)
            if result is not None:
                record_encoded(store, todo.files, result, summary)
                refill_removed(store, removed, result, summary)
            if summary.engine_started:
                summary.evicted = max(summary.evicted_own, int(
                    store.read_counters().get("evictions", 0) - evictions_before))
    finally:
        todo.close()
    check_capacity(store, summary, summary.present + len(todo.files),
                   options.max_bytes or store.max_bytes)


def _open(options: PrecomputeOptions, stage: Stage, *, dry_run: bool = False):
    """The store, with the capacity ``options.max_bytes`` set (kept in the store) unless
    this is a dry run, which changes nothing (its capacity note uses the option)."""
    from ...connectors.store import open_store

    store = open_store(options.store, create=True,
                       **({"max_bytes": options.max_bytes}
                          if options.max_bytes and not dry_run else {}))
    summary = stage.summary_class(store=store.url, model=options.model, lora=options.lora,
                                  over_capacity=options.over_capacity)
    summary.encoder_config = options.encoder_config
    return store, summary


def _as_corpus_files(files) -> list:
    from ..corpus import CorpusFile

    out = []
    for f in files:
        if isinstance(f, CorpusFile):
            out.append(f)
            continue
        path = os.fspath(f)
        try:
            st = os.stat(path)
            size, mtime = st.st_size, st.st_mtime_ns
        except OSError:
            size = mtime = 0  # reported as that file's failure when it is read
        out.append(CorpusFile(os.path.abspath(path), path, size, mtime))
    return out


def precompute_files(files, options: PrecomputeOptions, *, progress=None, wait: float = 0.0,
                     stage: Stage | None = None,
                     identifiers: Mapping[str, str] | None = None) -> Summary:
    """Encode the given files (paths or ``CorpusFile``) that the store lacks; no manifest,
    no walk. A failure's ``path`` is the path as given. Holds the store's precompute lock
    (``wait`` seconds for another run's). ``identifiers`` (path as given -> identifier):
    what the caller already hashed with these options (``warm --compute-missing``); those
    files are not read and hashed a second time."""
    options.check()
    stage = stage or LocalStage()
    files = _as_corpus_files(files)
    known = identifiers or {}
    records = {f.rel: (f.size, f.mtime_ns, known[f.rel]) for f in files if f.rel in known}
    store, summary = _open(options, stage)
    t_start = time.perf_counter()
    try:
        with store.lock("precompute", wait=wait):
            summary.files = len(files)
            _run_phases(files, records, store, options, summary, stage, manifest=None,
                        dry_run=False, progress=progress)
    finally:
        store.close()
    summary.seconds = time.perf_counter() - t_start
    return summary


def precompute_corpus(corpus: str, options: PrecomputeOptions, *, shard: str | None = None,
                      use_manifest: bool = True, prune_missing: bool = False,
                      dry_run: bool = False, wait: float = 0.0, progress=None,
                      stage: Stage | None = None) -> Summary:
    """Walk ``corpus`` (file or directory; media found by content), only shard ``i/N`` if
    given, and encode what the store lacks. The manifest (kept in the store) remembers each
    file's identifier so unchanged files are not read again; ``prune_missing`` deletes
    entries whose files left the corpus; ``dry_run`` identifies and counts only."""
    from ..corpus import Manifest, walk
    from ...connectors.store.ops.transfer import shard_of

    shard_spec = validate_args(corpus, options.batch, options.lora, options.lora_path, shard)
    options.check()
    stage = stage or LocalStage()
    store, summary = _open(options, stage, dry_run=dry_run)
    t_start = time.perf_counter()
    try:
        with store.lock("precompute", wait=wait):
            files = walk(corpus)
            if shard_spec:
                files = [f for f in files if shard_of(f.rel, *shard_spec)]
            summary.files = len(files)
            key = manifest_key(corpus, options.model, options.lora, options.effective_hash_algo,
                               shard, options.media_io_kwargs, options.request_kwargs)
            manifest = Manifest.load(Manifest.location(store, key), key)
            if not use_manifest:
                manifest.files = {}
            records = {f.rel: manifest.files[f.rel] for f in files if f.rel in manifest.files}
            _run_phases(files, records, store, options, summary, stage, manifest=manifest,
                        dry_run=dry_run, progress=progress)
            if prune_missing and not dry_run:
                summary.pruned += prune(store, manifest, {f.rel for f in files})
            if not dry_run:
                manifest.save()
    finally:
        store.close()
    summary.seconds = time.perf_counter() - t_start
    return summary


def prune(store, manifest, current: set) -> int:
    """Drop manifest records of files no longer in the corpus and delete their entries
    (unless another current file still uses the identifier); returns entries deleted."""
    gone = [rel for rel in list(manifest.files) if rel not in current]
    still_used = {manifest.files[r][2] for r in manifest.files if r in current}
    pruned = 0
    for rel in gone:
        ident = manifest.files[rel][2]
        if ident.startswith("!"):  # a marker (unreadable / not media)
            manifest.drop(rel)
            continue
        if ident not in still_used and store.delete(ident):
            pruned += 1
        manifest.drop(rel)
    return pruned


__all__ = ["PrecomputeOptions", "Summary", "Encoded", "LocalStage", "precompute_files",
           "precompute_corpus", "parse_engine_args", "hashing_settings", "engine_encoder_config",
           "manifest_key", "validate_args", "identify_or_mark", "stored_state", "classify",
           "account", "record_encoded"]
