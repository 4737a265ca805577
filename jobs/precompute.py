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
   the ``todo`` (identifier -> file, first file wins). No engine starts when nothing is
   missing.
2. **encode** ``todo`` with a pluggable stage: :class:`LocalStage` (an in-process
   :class:`~encache.connectors.vllm.producer.ProducerEngine`, batch by batch, with the
   ``--over-capacity skip`` room budget and the store-full stop) or the Ray stage of
   :mod:`encache.jobs.ray_precompute` (identify tasks and an actor pool of engines).
3. **finish** (:func:`record_encoded`): every identifier an engine reported is checked in
   the store (the store is the truth: evicted-after-write is told from lost), evictions
   and the capacity note counted, then (corpus only) prune and save the manifest.

Why: the CLI, warm and Ray used to call (or re-implement) CLI code; now each parses its own
options and calls this. Errors are :class:`~encache.cli.errors.EncacheError` with the CLI's
exit codes (usage 2, store 7, engine 8); no printing here: ``progress`` is an optional
object with ``start(phase, total)`` / ``advance(n, failed=None)``.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ..cli.errors import EXIT_ENGINE, EXIT_STORE, EXIT_USAGE, EncacheError


@dataclass
class Summary:
    """What a precompute run did (``dataclasses.asdict`` + ``images_per_second`` is the
    ``--json`` output; the field names are part of the interface)."""

    store: str
    model: str
    lora: str | None
    files: int = 0
    hashed: int = 0  # read and hashed this run (new or changed files)
    from_manifest: int = 0  # identifier taken from the manifest, file not read
    present: int = 0  # already in the store: skipped
    other_config: int = 0  # in the store, but stamped with another encoder config: re-encoded
    stale_lora: int = 0  # in the store, but made with another adapter under this LoRA name: replaced
    encoder_config: str = ""  # this run's encoder-config digest ("" = default)
    encoded: int = 0
    failed: int = 0
    pruned: int = 0
    evicted: int = 0  # entries the store evicted for capacity during this run (any entry)
    evicted_own: int = 0  # of those, entries this run wrote (encoded, then evicted)
    skipped_capacity: int = 0  # missing, not encoded: no room without eviction (--over-capacity skip)
    over_capacity: str = "keep-served"
    capacity: dict | None = None  # the corpus needs more than max_bytes: numbers + message
    skipped_non_media: int = 0  # files that are not images or videos (listed in non_media)
    bytes_written: int = 0
    engine_started: bool = False
    seconds: float = 0.0
    encode_seconds: float = 0.0
    failures: list = field(default_factory=list)  # [{path, error}]
    non_media: list = field(default_factory=list)  # [{path, reason}]: skipped, not failed

    @property
    def images_per_second(self) -> float:
        return self.encoded / self.encode_seconds if self.encode_seconds > 0 else 0.0


# manifest markers, not identifiers (identifiers never contain "!"): an unchanged file
# carrying one is reported again without being read again
UNREADABLE = "!unreadable:"  # media (by suffix or content) that does not decode: a failure
NON_MEDIA = "!skip:"  # not an image or video: skipped and counted


# --------------------------------------------------------------------------- options

@dataclass(frozen=True)
class PrecomputeOptions:
    """Everything that decides what a precompute writes, and how the engine runs.

    ``model`` is the id exactly as given to ``vllm serve --model``; ``store`` the store URL
    or path (the real URL: the engine's connector opens it itself). ``engine_args`` are
    extra ``vllm.LLM`` arguments; the server settings among them (``media_io_kwargs``,
    ``mm_hasher_algorithm``, ``mm_processor_kwargs``, ``revision``) are hash or
    encoder-config factors, as on the server. ``request_mm_processor_kwargs``: the
    per-request kwargs the served requests carry (hashed into each identifier)."""

    model: str
    store: str
    lora: str | None = None
    lora_path: str | None = None
    batch: int = 16
    max_model_len: int | None = None
    dtype: str | None = None
    engine_args: Mapping = field(default_factory=dict)
    max_bytes: int | None = None
    hash_algo: str = "blake3"
    tag: str | None = None
    over_capacity: str = "keep-served"  # or "skip": encode only into free room
    request_mm_processor_kwargs: Mapping | None = None

    def check(self) -> None:
        """Usage checks (exit 2), before anything is opened or started."""
        from ..connectors.capacity import OVER_CAPACITY

        check_common(self.batch, self.lora, self.lora_path)
        if self.over_capacity not in OVER_CAPACITY:
            raise EncacheError(f"--over-capacity must be one of {', '.join(OVER_CAPACITY)}",
                               EXIT_USAGE)
        for name in ("mm_processor_kwargs", "media_io_kwargs"):
            if not isinstance((self.engine_args or {}).get(name) or {}, dict):
                example = ('{"max_pixels": 1003520}' if name == "mm_processor_kwargs"
                           else '{"image": {"rgba_background_color": [0, 0, 0]}}')
                raise EncacheError(f"--engine-arg {name}= expects a JSON object, e.g. "
                                   f"{name}='{example}'", EXIT_USAGE)
        check_request_kwargs(self.request_mm_processor_kwargs, self.media_io_kwargs)

    @property
    def media_io_kwargs(self) -> dict | None:
        return hashing_settings(self.engine_args, self.hash_algo)[0]

    @property
    def effective_hash_algo(self) -> str:
        """The algorithm the server hashes with (``mm_hasher_algorithm`` wins)."""
        return hashing_settings(self.engine_args, self.hash_algo)[1]

    @property
    def request_kwargs(self) -> dict | None:
        return dict(self.request_mm_processor_kwargs) if self.request_mm_processor_kwargs else None

    @property
    def encoder_config(self) -> str:
        return engine_encoder_config(self.engine_args, self.tag)

    def store_options(self) -> dict | None:
        """What the engine's connector is given besides the URL."""
        return {**({"max_bytes": self.max_bytes} if self.max_bytes else {}),
                **({"tag": self.tag} if self.tag else {})} or None

    def engine_options(self, store_url: str, modalities: Iterable[str]) -> dict:
        """Keyword arguments of :class:`~encache.connectors.vllm.producer.EngineOptions`
        (a plain dict: Ray ships it to the actors)."""
        return dict(model=self.model, store=store_url, max_model_len=self.max_model_len,
                    dtype=self.dtype, lora_name=self.lora, lora_path=self.lora_path,
                    extra=dict(self.engine_args or {}), store_options=self.store_options(),
                    modalities=tuple(sorted(set(modalities))),
                    request_mm_processor_kwargs=self.request_kwargs)


def parse_engine_args(pairs: list[str] | None) -> dict:
    """``--engine-arg KEY=VALUE`` pairs -> a dict (JSON values, else strings)."""
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise EncacheError(f"--engine-arg expects KEY=VALUE, got {pair!r}", EXIT_USAGE)
        k, v = pair.split("=", 1)
        try:
            out[k.strip().replace("-", "_")] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip().replace("-", "_")] = v
    return out


def hashing_settings(engine_args: Mapping | None, hash_algo: str = "blake3") -> tuple[dict | None, str]:
    """``(media_io_kwargs, hash_algo)`` the server will hash with, from the engine arguments
    that also go to the producer (``--engine-arg media_io_kwargs=… mm_hasher_algorithm=…``).

    The server's media_io_kwargs change how an image is loaded and are a hash factor on the
    OpenAI path; the producer's own ``LLM.chat`` path stores the precomputed uuid as given.
    """
    engine_args = engine_args or {}
    return (engine_args.get("media_io_kwargs") or None,
            engine_args.get("mm_hasher_algorithm") or hash_algo)


def engine_encoder_config(engine_args: Mapping | None, tag: str | None) -> str:
    """The encoder-config digest the producer connector will stamp, from the same engine
    arguments (``mm_processor_kwargs``, ``revision``) and ``--tag``."""
    from ..connectors.encoder_config import encoder_config_digest

    engine_args = engine_args or {}
    return encoder_config_digest(engine_args.get("mm_processor_kwargs"),
                                 engine_args.get("revision"), tag)


def manifest_key(corpus: str, model: str, lora: str | None, hash_algo: str,
                 shard: str | None, media_io_kwargs: dict | None,
                 request_mm_processor_kwargs: dict | None = None) -> dict:
    """What a manifest's identifiers depend on (a different key: a different manifest)."""
    key = {"corpus": os.path.abspath(corpus), "model": model, "lora": lora or "",
           "hash_algo": hash_algo, "shard": shard or ""}
    if media_io_kwargs:  # absent by default, so existing manifests keep their location
        key["media_io_kwargs"] = media_io_kwargs
    if request_mm_processor_kwargs:
        key["request_mm_processor_kwargs"] = request_mm_processor_kwargs
    return key


def check_request_kwargs(request_mm_processor_kwargs, media_io_kwargs) -> dict | None:
    """Validate ``--request-mm-processor-kwargs`` (a JSON object, not combinable yet with
    server media_io_kwargs: LLM.chat does not hash those the way the server does)."""
    if not request_mm_processor_kwargs:
        return None
    if not isinstance(request_mm_processor_kwargs, Mapping):
        raise EncacheError("--request-mm-processor-kwargs expects a JSON object, e.g. "
                           "'{\"max_pixels\": 200704}'", EXIT_USAGE)
    if media_io_kwargs:
        raise EncacheError("--request-mm-processor-kwargs cannot be combined with "
                           "--engine-arg media_io_kwargs yet", EXIT_USAGE)
    return dict(request_mm_processor_kwargs)


def check_common(batch: int, lora: str | None, lora_path: str | None) -> None:
    if batch < 1:
        raise EncacheError("--batch must be at least 1", EXIT_USAGE)
    if lora_path and not lora:
        raise EncacheError("--lora-path needs --lora NAME", EXIT_USAGE)
    if lora and not lora_path:
        raise EncacheError("--lora NAME needs --lora-path DIR: the producer must run the adapter "
                           "the consumer serves (tower-connector LoRA changes the encoder output)",
                           EXIT_USAGE)


def validate_args(corpus: str, batch: int, lora: str | None, lora_path: str | None,
                  shard: str | None) -> tuple[int, int] | None:
    """Usage checks of a corpus run, before any work starts; returns the parsed shard."""
    from ..connectors.corpus import parse_shard

    if not os.path.exists(corpus):
        raise EncacheError(f"corpus not found: {corpus}", EXIT_USAGE)
    check_common(batch, lora, lora_path)
    if not shard:
        return None
    try:
        return parse_shard(shard)
    except ValueError as e:
        raise EncacheError(str(e), EXIT_USAGE) from None


# --------------------------------------------------------------------------- identify

def identify_or_mark(f, model: str, *, lora: str | None, hash_algo: str,
                     media_io_kwargs: dict | None, mm_processor_kwargs: dict | None = None) -> str:
    """``f``'s served identifier, or a marker: :data:`NON_MEDIA` + reason for a file that
    is not media (no media suffix, and its header is no image or video), or
    :data:`UNREADABLE` + error for media that cannot be read or decoded -- whatever the
    error (a decompression bomb, truncated data, …): one file never stops a run."""
    from ..connectors.corpus import non_media_reason
    from ..connectors.media import unreadable_reason

    reason = non_media_reason(f)
    if reason is not None:
        return NON_MEDIA + reason
    from ..connectors.vllm.hashing import identify_file
    try:
        return identify_file(f.path, model, lora=lora, hash_algo=hash_algo,
                             media_io_kwargs=media_io_kwargs,
                             mm_processor_kwargs=mm_processor_kwargs).identifier
    except ImportError:
        raise
    except Exception as e:  # MediaError, OSError, and anything a decoder raises
        return UNREADABLE + unreadable_reason(e)


def stored_state(store, ident: str, encoder_config: str, lora_digest: str) -> str:
    """``present`` (usable as is), ``other_config`` (another encoder config),
    ``stale_lora`` (made with another adapter under this LoRA name, or unstamped) or
    ``missing``: one header read (``holds()`` semantics)."""
    info = store.stat(ident)
    if info is None:
        return "missing"
    if info.meta is None or info.meta.encoder_config != encoder_config:
        return "other_config"
    if lora_digest and info.meta.lora_digest != lora_digest:
        return "stale_lora"
    return "present"


def classify(f, record, *, store, options: PrecomputeOptions, encoder_config: str,
             lora_digest: str, present: set | None = None) -> tuple[str, bool, str]:
    """One file's row: ``(identifier or marker, hashed, state)``. ``record`` is the file's
    manifest record (None: read and hash it); ``present``, when given, is the store's
    identifier listing (no header read for what it lacks). States: those of
    :func:`stored_state`, ``unreadable`` and ``non_media``."""
    unchanged = record and record[0] == f.size and record[1] == f.mtime_ns  # Manifest.lookup
    ident = record[2] if unchanged else None
    hashed = ident is None
    if hashed:
        ident = identify_or_mark(f, options.model, lora=options.lora,
                                 hash_algo=options.effective_hash_algo,
                                 media_io_kwargs=options.media_io_kwargs,
                                 mm_processor_kwargs=options.request_kwargs)
    if ident.startswith(NON_MEDIA):
        return ident, hashed, "non_media"
    if ident.startswith(UNREADABLE):
        return ident, hashed, "unreadable"
    if present is not None and ident not in present:
        return ident, hashed, "missing"
    return ident, hashed, stored_state(store, ident, encoder_config, lora_digest)


def account(rows: Iterable[tuple], summary: Summary, manifest=None) -> dict:
    """Count identify rows ``(CorpusFile, identifier, hashed, state)`` (in corpus order)
    into ``summary`` and record hashed ones in ``manifest``; returns ``identifier ->
    CorpusFile`` of what must be encoded (the first file of an identifier wins)."""
    todo: dict[str, object] = {}
    for f, ident, hashed, state in rows:
        if hashed and manifest is not None:
            manifest.record(f, ident)
        if state == "non_media":  # remembered: an unchanged file is not sniffed again
            summary.skipped_non_media += 1
            summary.non_media.append({"path": f.rel, "reason": ident[len(NON_MEDIA):]})
            continue
        if hashed:
            summary.hashed += 1
        else:
            summary.from_manifest += 1
        if state == "unreadable":  # remembered: an unchanged bad file is not re-read
            summary.failed += 1
            summary.failures.append({"path": f.rel, "error": ident[len(UNREADABLE):]})
        elif state == "present":
            summary.present += 1
        else:
            if ident not in todo:
                if state == "other_config":
                    summary.other_config += 1
                elif state == "stale_lora":
                    summary.stale_lora += 1
            todo.setdefault(ident, f)
    return todo


# --------------------------------------------------------------------------- encode

@dataclass
class Encoded:
    """What an encode stage reports: identifiers the engines encoded (``ok``), the rest
    with their error (``failed``), the identifiers the engines' writers saved (to tell an
    entry evicted after its write from a lost one) and write errors by identifier."""

    ok: list = field(default_factory=list)
    failed: dict = field(default_factory=dict)
    saved: set = field(default_factory=set)
    save_errors: dict = field(default_factory=dict)


class Stage(Protocol):
    """The pluggable part of the job: how files are identified and how ``todo`` is
    encoded. :class:`LocalStage` runs both in this process; the Ray stage on a cluster."""

    summary_class: type

    def identify(self, files: list, records: dict, store, options: PrecomputeOptions,
                 summary: Summary, lora_digest: str, progress) -> list: ...

    def encode(self, todo: dict, store, options: PrecomputeOptions, summary: Summary,
               progress) -> Encoded | None: ...


_FULL = tuple(os.strerror(e) for e in (errno.ENOSPC, errno.EDQUOT, errno.EROFS))


def store_full(save_errors: dict[str, str]) -> str | None:
    """The reason when writes failed because the store cannot take more (no space,
    quota, read-only filesystem): no later write can succeed, so the run stops."""
    for err in save_errors.values():
        for reason in _FULL:
            if reason in err:
                return reason
    return None


def media_item(ident: str, f) -> tuple[tuple | None, str | None]:
    """``((identifier, data URL, kind), None)`` for the engine, or ``(None, error)`` when
    the file cannot be read or is no longer media (changed since it was hashed)."""
    from ..connectors.media import mime_type, sniff
    from ..connectors.vllm.producer import data_url

    try:
        with open(f.path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        return None, f"cannot read: {e.strerror}"
    found = sniff(data, name=f.rel)
    if not found:
        return None, f"not a readable image or video ({found.reason})"
    return (ident, data_url(data, mime=mime_type(found)), found.kind), None


def engine_store_url(options: PrecomputeOptions, store) -> str:
    """The URL the engine's connector opens: the real one for Redis (``store.url`` is
    redacted for display and would fail AUTH), the absolute path for a disk store."""
    from ..connectors.store.url import is_redis_url

    return options.store if is_redis_url(options.store) else str(store.url)


def engine_error(model: str, e: BaseException) -> EncacheError:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return EncacheError(f"vLLM engine failed to start for {model!r}: {text}", EXIT_ENGINE,
                        hint="set ENCACHE_DEBUG=1 for vLLM's traceback")


class LocalStage:
    """Identify in this process; encode with one in-process producer engine, ``batch``
    files per engine call, with the ``--over-capacity skip`` room budget and a stop when
    the store's filesystem is full."""

    summary_class = Summary

    def identify(self, files, records, store, options, summary, lora_digest, progress) -> list:
        present = set(store.identifiers())
        encoder_config = summary.encoder_config
        rows = []
        if progress:
            progress.start("hashing", len(files))
        for f in files:
            ident, hashed, state = classify(f, records.get(f.rel), store=store, options=options,
                                            encoder_config=encoder_config,
                                            lora_digest=lora_digest, present=present)
            rows.append((f, ident, hashed, state))
            if progress:
                progress.advance(1, failed=f"{f.rel}: {ident[len(UNREADABLE):]}"
                                 if state == "unreadable" else None)
        return rows

    def encode(self, todo, store, options, summary, progress) -> Encoded | None:
        from ..connectors.media import sniff
        from ..connectors.vllm.producer import EngineOptions, ProducerEngine

        budget = None
        if options.over_capacity == "skip" and store.max_bytes:
            from ..connectors.capacity import RoomBudget, mean_entry_bytes
            budget = RoomBudget(store, store.max_bytes, store.low_watermark,
                                mean_entry_bytes(store, store.identifiers()))
            if budget.fits(len(todo)) == 0:  # nothing fits: do not even start the engine
                summary.skipped_capacity += len(todo)
                return None
        # the kind of each item routes it to an image_url or a video_url part (a header read)
        kinds = {ident: sniff(f.path, name=f.rel).kind or "image" for ident, f in todo.items()}
        opts = EngineOptions(**options.engine_options(engine_store_url(options, store),
                                                      kinds.values()))
        if progress:
            progress.start("starting engine", None)
        try:
            engine = ProducerEngine(opts)
        except Exception as e:
            raise engine_error(options.model, e) from e
        summary.engine_started = True
        items = list(todo.items())
        t0 = time.perf_counter()
        out = Encoded()
        try:
            if progress:
                progress.start("encoding", len(items))
            for i in range(0, len(items), options.batch):
                chunk = items[i:i + options.batch]
                if budget is not None:
                    if out.ok and budget.mean_bytes is None:
                        engine.wait_for_saves()
                        budget.mean_bytes = mean_entry_bytes(store, out.ok)
                    elif out.ok:
                        engine.wait_for_saves()  # the store's usage must include what is queued
                    n = budget.fits(len(chunk))
                    summary.skipped_capacity += len(chunk) - n
                    if progress and n < len(chunk):
                        progress.advance(len(chunk) - n)
                    chunk = chunk[:n]
                    if not chunk:
                        continue
                payload = []
                for ident, f in chunk:
                    item, error = media_item(ident, f)
                    if item is None:
                        out.failed[ident] = error
                    else:
                        payload.append(item)
                for res in engine.encode(payload) if payload else []:
                    if res.ok:
                        out.ok.append(res.identifier)
                    else:
                        out.failed[res.identifier] = res.error
                if progress:
                    progress.advance(len(chunk))
                if store_full(engine.save_errors()):
                    break  # the store's filesystem is full: stop encoding, report below
            engine.wait_for_saves()
            out.save_errors = engine.save_errors()
            out.saved = engine.saved_identifiers()
        finally:
            engine.close()
        summary.encode_seconds = time.perf_counter() - t0
        full = store_full(out.save_errors)
        if full:
            written = sum(1 for ident in out.ok if ident in out.saved)
            raise EncacheError(
                f"the store's filesystem is full ({full}): {len(todo) - written:,} of "
                f"{len(todo):,} entries were not written to {store.url}; every entry written is "
                f"whole", EXIT_STORE,
                hint="free space or set --max-bytes below the free space, then rerun: it "
                     "encodes only what is missing")
        return out


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


def check_capacity(store, summary: Summary, wanted: int) -> None:
    """Compare what the corpus needs with the store's capacity; note it once (numbers)."""
    from ..connectors.capacity import capacity_note, mean_entry_bytes

    cap = store.max_bytes
    if not cap or not wanted:
        return
    if summary.encoded > summary.evicted_own and summary.bytes_written:
        mean = summary.bytes_written / (summary.encoded - summary.evicted_own)
    else:
        mean = mean_entry_bytes(store, store.identifiers())
    summary.capacity = capacity_note(wanted, mean, cap, summary.over_capacity)


def _run_phases(files: list, records: dict, store, options: PrecomputeOptions, summary: Summary,
                stage: Stage, *, manifest, dry_run: bool, progress) -> None:
    """identify -> account -> encode -> record, the part every entry point shares."""
    from ..connectors.lora_stamp import adapter_digest

    lora_digest = adapter_digest(options.lora_path) if options.lora else ""
    rows = stage.identify(files, records, store, options, summary, lora_digest, progress)
    todo = account(rows, summary, manifest)
    wanted = summary.present + len(todo)  # distinct identifiers the files need
    if todo and not dry_run:
        evictions_before = store.read_counters().get("evictions", 0)
        result = stage.encode(todo, store, options, summary, progress)
        if result is not None:
            record_encoded(store, todo, result, summary)
        summary.evicted = max(summary.evicted_own, int(
            store.read_counters().get("evictions", 0) - evictions_before))
    check_capacity(store, summary, wanted)


def _open(options: PrecomputeOptions, stage: Stage):
    from ..connectors.store import open_store

    store = open_store(options.store, create=True,
                       **({"max_bytes": options.max_bytes} if options.max_bytes else {}))
    summary = stage.summary_class(store=store.url, model=options.model, lora=options.lora,
                                  over_capacity=options.over_capacity)
    summary.encoder_config = options.encoder_config
    return store, summary


def _as_corpus_files(files) -> list:
    from ..connectors.corpus import CorpusFile

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
                     stage: Stage | None = None) -> Summary:
    """Encode the given files (paths or ``CorpusFile``) that the store lacks; no manifest,
    no walk. A failure's ``path`` is the path as given. Holds the store's precompute lock
    (``wait`` seconds for another run's)."""
    options.check()
    stage = stage or LocalStage()
    files = _as_corpus_files(files)
    store, summary = _open(options, stage)
    t_start = time.perf_counter()
    try:
        with store.lock("precompute", wait=wait):
            summary.files = len(files)
            _run_phases(files, {}, store, options, summary, stage, manifest=None,
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
    from ..connectors.corpus import Manifest, shard_of, walk

    shard_spec = validate_args(corpus, options.batch, options.lora, options.lora_path, shard)
    options.check()
    stage = stage or LocalStage()
    store, summary = _open(options, stage)
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


def run_precompute(corpus: str, model: str, store_url: str, *, shard: str | None = None,
                   use_manifest: bool = True, prune_missing: bool = False,
                   dry_run: bool = False, wait: float = 0.0, progress=None,
                   engine_args: dict | None = None, **option_kwargs) -> Summary:
    """:func:`precompute_corpus` with the options as keyword arguments (the older call
    form, kept for scripts): ``run_precompute(corpus, model, store, batch=4, …)``."""
    options = PrecomputeOptions(model=model, store=store_url,
                                engine_args=dict(engine_args or {}), **option_kwargs)
    return precompute_corpus(corpus, options, shard=shard, use_manifest=use_manifest,
                             prune_missing=prune_missing, dry_run=dry_run, wait=wait,
                             progress=progress)


__all__ = ["PrecomputeOptions", "Summary", "Encoded", "LocalStage", "precompute_files",
           "precompute_corpus", "run_precompute", "parse_engine_args", "hashing_settings",
           "engine_encoder_config", "manifest_key", "validate_args", "identify_or_mark",
           "stored_state", "classify", "account", "record_encoded"]
