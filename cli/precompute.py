"""``encache precompute CORPUS``: fill a store with a real vLLM ec_producer engine.

Walks the corpus, computes each file's served identifier (vLLM's own hasher, bytes as a
``vllm serve`` consumer hashes them), skips what the store already holds *without starting
the engine*, then encodes only the missing images in batches. Cron-safe: one run per store
at a time (exclusive lock), a manifest so unchanged files are not read again, ``--quiet``
for cron mail, ``--prune-missing`` to drop entries whose source images left the corpus.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated

import typer

from .errors import EXIT_ENGINE, EXIT_OK, EXIT_PARTIAL, EXIT_STORE, EXIT_USAGE, EncacheError
from .options import JsonOpt, LoraOpt, ModelOpt, QuietOpt, StoreOpt, TagOpt


@dataclass
class Summary:
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


def _clean_error(e: BaseException) -> str:
    import re
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"\s*<_io\.\w+ object at 0x[0-9a-f]+>", "", text)
    return (text if text.startswith("not a") else f"not a readable image ({text})")[:300]


def identify_or_mark(f, model: str, *, lora: str | None, hash_algo: str,
                     media_io_kwargs: dict | None, mm_processor_kwargs: dict | None = None) -> str:
    """``f``'s served identifier, or a marker: :data:`NON_MEDIA` + reason for a file that
    is not media (no media suffix, and its header is no image or video), or
    :data:`UNREADABLE` + error for media that cannot be read or decoded -- whatever the
    error (a decompression bomb, truncated data, …): one file never stops a run."""
    from ..connectors.corpus import non_media_reason

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
        return UNREADABLE + _clean_error(e)


def _parse_engine_args(pairs: list[str]) -> dict:
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


def hashing_settings(engine_args: dict | None, hash_algo: str = "blake3") -> tuple[dict | None, str]:
    """``(media_io_kwargs, hash_algo)`` the server will hash with, from the engine arguments
    that also go to the producer (``--engine-arg media_io_kwargs=… mm_hasher_algorithm=…``).

    The server's media_io_kwargs change how an image is loaded and are a hash factor on the
    OpenAI path; the producer's own ``LLM.chat`` path stores the precomputed uuid as given.
    """
    engine_args = engine_args or {}
    return (engine_args.get("media_io_kwargs") or None,
            engine_args.get("mm_hasher_algorithm") or hash_algo)


def engine_encoder_config(engine_args: dict | None, tag: str | None) -> str:
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
    if not isinstance(request_mm_processor_kwargs, dict):
        raise EncacheError("--request-mm-processor-kwargs expects a JSON object, e.g. "
                           "'{\"max_pixels\": 200704}'", EXIT_USAGE)
    if media_io_kwargs:
        raise EncacheError("--request-mm-processor-kwargs cannot be combined with "
                           "--engine-arg media_io_kwargs yet", EXIT_USAGE)
    return dict(request_mm_processor_kwargs)


def validate_args(corpus: str, batch: int, lora: str | None, lora_path: str | None,
                  shard: str | None) -> tuple[int, int] | None:
    """Usage checks, before any work starts; returns the parsed shard."""
    from ..connectors.corpus import parse_shard

    if not os.path.exists(corpus):
        raise EncacheError(f"corpus not found: {corpus}", EXIT_USAGE)
    if batch < 1:
        raise EncacheError("--batch must be at least 1", EXIT_USAGE)
    if lora_path and not lora:
        raise EncacheError("--lora-path needs --lora NAME", EXIT_USAGE)
    if lora and not lora_path:
        raise EncacheError("--lora NAME needs --lora-path DIR: the producer must run the adapter "
                           "the consumer serves (tower-connector LoRA changes the encoder output)",
                           EXIT_USAGE)
    if not shard:
        return None
    try:
        return parse_shard(shard)
    except ValueError as e:
        raise EncacheError(str(e), EXIT_USAGE) from None


def run_precompute(corpus: str, model: str, store_url: str, *, lora: str | None = None,
                   lora_path: str | None = None, batch: int = 16, wait: float = 0.0,
                   prune_missing: bool = False, shard: str | None = None,
                   use_manifest: bool = True, dry_run: bool = False,
                   max_model_len: int | None = None, dtype: str | None = None,
                   engine_args: dict | None = None, max_bytes: int | None = None,
                   hash_algo: str = "blake3", tag: str | None = None,
                   over_capacity: str = "keep-served",
                   request_mm_processor_kwargs: dict | None = None,
                   progress=None) -> Summary:
    """The precompute job (no printing: ``progress`` is an optional callback object)."""
    from ..connectors.corpus import Manifest, shard_of, walk
    from ..connectors.store import open_store

    from ..connectors.capacity import OVER_CAPACITY

    shard_spec = validate_args(corpus, batch, lora, lora_path, shard)
    if over_capacity not in OVER_CAPACITY:
        raise EncacheError(f"--over-capacity must be one of {', '.join(OVER_CAPACITY)}",
                           EXIT_USAGE)
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if not isinstance((engine_args or {}).get(name) or {}, dict):
            example = ('{"max_pixels": 1003520}' if name == "mm_processor_kwargs"
                       else '{"image": {"rgba_background_color": [0, 0, 0]}}')
            raise EncacheError(f"--engine-arg {name}= expects a JSON object, e.g. "
                               f"{name}='{example}'", EXIT_USAGE)
    request_kwargs = check_request_kwargs(request_mm_processor_kwargs,
                                          hashing_settings(engine_args)[0])
    store = open_store(store_url, create=True, **({"max_bytes": max_bytes} if max_bytes else {}))
    summary = Summary(store=store.url, model=model, lora=lora, over_capacity=over_capacity)
    engine_args = dict(engine_args or {})
    summary.encoder_config = engine_encoder_config(engine_args, tag)
    from ..connectors.lora_stamp import adapter_digest
    lora_digest = adapter_digest(lora_path) if lora else ""
    media_io_kwargs, hash_algo = hashing_settings(engine_args, hash_algo)
    t_start = time.perf_counter()
    with store.lock("precompute", wait=wait):
        files = walk(corpus)
        if shard_spec:
            files = [f for f in files if shard_of(f.rel, *shard_spec)]
        summary.files = len(files)
        key = manifest_key(corpus, model, lora, hash_algo, shard, media_io_kwargs, request_kwargs)
        manifest = Manifest.load(Manifest.location(store, key), key)
        if not use_manifest:
            manifest.files = {}
        todo = _hash_phase(files, manifest, store, summary, model=model, lora=lora,
                           hash_algo=hash_algo, media_io_kwargs=media_io_kwargs,
                           lora_digest=lora_digest, mm_processor_kwargs=request_kwargs,
                           progress=progress)
        wanted = summary.present + len(todo)  # distinct identifiers the corpus needs
        if todo and not dry_run:
            evictions_before = store.read_counters().get("evictions", 0)
            _encode_missing(todo, model, store, store_url, summary, lora=lora, lora_path=lora_path,
                            batch=batch, max_model_len=max_model_len, dtype=dtype,
                            engine_args=engine_args, max_bytes=max_bytes, tag=tag,
                            over_capacity=over_capacity, request_kwargs=request_kwargs,
                            progress=progress)
            summary.evicted = max(summary.evicted_own, int(
                store.read_counters().get("evictions", 0) - evictions_before))
        _check_capacity(store, summary, todo, wanted)
        if prune_missing and not dry_run:
            current = {f.rel for f in files}
            gone = [rel for rel in list(manifest.files) if rel not in current]
            still_used = {manifest.files[r][2] for r in manifest.files if r in current}
            for rel in gone:
                ident = manifest.files[rel][2]
                if ident.startswith("!"):  # a marker (unreadable / not media)
                    manifest.drop(rel)
                    continue
                if ident not in still_used and store.delete(ident):
                    summary.pruned += 1
                manifest.drop(rel)
        if not dry_run:
            manifest.save()
    summary.seconds = time.perf_counter() - t_start
    return summary


def _stored_state(store, ident: str, encoder_config: str, lora_digest: str) -> str:
    """``ok`` (usable as is), ``config`` (another encoder config), ``lora`` (made with
    another adapter under this LoRA name, or unstamped) or ``absent``."""
    info = store.stat(ident)
    if info is None:
        return "absent"
    if info.meta is None or info.meta.encoder_config != encoder_config:
        return "config"
    if lora_digest and info.meta.lora_digest != lora_digest:
        return "lora"
    return "ok"


_FULL = tuple(os.strerror(e) for e in (errno.ENOSPC, errno.EDQUOT, errno.EROFS))


def _store_full(save_errors: dict[str, str]) -> str | None:
    """The reason when writes failed because the store cannot take more (no space,
    quota, read-only filesystem): no later write can succeed, so the run stops."""
    for err in save_errors.values():
        for reason in _FULL:
            if reason in err:
                return reason
    return None


def _check_capacity(store, summary: Summary, todo: dict, wanted: int) -> None:
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


def _hash_phase(files, manifest, store, summary: Summary, *, model: str, lora: str | None,
                hash_algo: str, media_io_kwargs: dict | None, progress,
                lora_digest: str = "", mm_processor_kwargs: dict | None = None) -> dict:
    """Identifier of every file (manifest first, else read and hashed), counted into
    ``summary``; returns ``identifier -> CorpusFile`` of what must be encoded (first
    file wins)."""
    present = set(store.identifiers())
    todo: dict[str, object] = {}
    if progress:
        progress.start("hashing", len(files))
    for f in files:
        ident = manifest.lookup(f)
        if ident is None:
            ident = identify_or_mark(f, model, lora=lora, hash_algo=hash_algo,
                                     media_io_kwargs=media_io_kwargs,
                                     mm_processor_kwargs=mm_processor_kwargs)
            manifest.record(f, ident)
            if not ident.startswith(NON_MEDIA):
                summary.hashed += 1
        elif not ident.startswith(NON_MEDIA):
            summary.from_manifest += 1
        if ident.startswith(NON_MEDIA):  # remembered: an unchanged file is not sniffed again
            summary.skipped_non_media += 1
            summary.non_media.append({"path": f.rel, "reason": ident[len(NON_MEDIA):]})
        elif ident.startswith(UNREADABLE):  # remembered: an unchanged bad file is not re-read
            summary.failed += 1
            summary.failures.append({"path": f.rel, "error": ident[len(UNREADABLE):]})
            if progress:
                progress.advance(1, failed=f"{f.rel}: {ident[len(UNREADABLE):]}")
            continue
        else:
            why = _stored_state(store, ident, summary.encoder_config, lora_digest) \
                if ident in present else "absent"
            if why == "ok":
                summary.present += 1
            else:
                if why == "config" and ident not in todo:
                    summary.other_config += 1
                elif why == "lora" and ident not in todo:
                    summary.stale_lora += 1
                todo.setdefault(ident, f)
        if progress:
            progress.advance(1)
    return todo


def _encode_missing(todo: dict, model: str, store, store_url: str, summary: Summary, *, lora,
                    lora_path, batch, max_model_len, dtype, engine_args, max_bytes, tag,
                    over_capacity="keep-served", progress=None, request_kwargs=None) -> None:
    from ..connectors.media import sniff
    from ..connectors.vllm.producer import EngineOptions, ProducerEngine

    budget = None
    if over_capacity == "skip" and store.max_bytes:
        from ..connectors.capacity import RoomBudget, mean_entry_bytes
        budget = RoomBudget(store, store.max_bytes, store.low_watermark,
                            mean_entry_bytes(store, store.identifiers()))
        if budget.fits(len(todo)) == 0:  # nothing fits: do not even start the engine
            summary.skipped_capacity += len(todo)
            return
    # the kind of each item routes it to an image_url or a video_url part (a header read)
    kinds = {ident: sniff(f.path, name=f.rel).kind or "image" for ident, f in todo.items()}
    # the engine's connector opens the store itself: give it the real URL (store.url is
    # redacted for display and would fail AUTH)
    opts = EngineOptions(model=model, store=store_url if _is_url(store_url) else store.url, max_model_len=max_model_len, dtype=dtype,
                         lora_name=lora, lora_path=lora_path, extra=engine_args,
                         store_options={**({"max_bytes": max_bytes} if max_bytes else {}),
                                        **({"tag": tag} if tag else {})} or None,
                         modalities=tuple(sorted(set(kinds.values()))),
                         request_mm_processor_kwargs=request_kwargs)
    if progress:
        progress.start("starting engine", None)
    try:
        engine = ProducerEngine(opts)
    except Exception as e:
        raise EncacheError(f"vLLM engine failed to start for {model!r}: "
                           f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}",
                           EXIT_ENGINE, hint="set ENCACHE_DEBUG=1 for vLLM's traceback") from e
    summary.engine_started = True
    items = list(todo.items())
    t0 = time.perf_counter()
    ok: list[str] = []
    try:
        if progress:
            progress.start("encoding", len(items))
        for i in range(0, len(items), batch):
            chunk = items[i:i + batch]
            if budget is not None:
                if ok and budget.mean_bytes is None:
                    engine.wait_for_saves()
                    budget.mean_bytes = mean_entry_bytes(store, ok)
                elif ok:
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
                item, error = _media_item(ident, f)
                if item is None:
                    summary.failed += 1
                    summary.failures.append({"path": f.rel, "error": error})
                else:
                    payload.append(item)
            for res in engine.encode(payload) if payload else []:
                if res.ok:
                    ok.append(res.identifier)
                else:
                    summary.failed += 1
                    summary.failures.append({"path": todo[res.identifier].rel, "error": res.error})
            if progress:
                progress.advance(len(chunk))
            if _store_full(engine.save_errors()):
                break  # the store's filesystem is full: stop encoding, report below
        engine.wait_for_saves()
        save_errors = engine.save_errors()
        saved = engine.saved_identifiers()
    finally:
        engine.close()
    summary.encode_seconds = time.perf_counter() - t0
    full = _store_full(save_errors)
    if full:
        written = sum(1 for ident in ok if ident in saved)
        raise EncacheError(
            f"the store's filesystem is full ({full}): {len(todo) - written:,} of "
            f"{len(todo):,} entries were not written to {store.url}; every entry written is "
            f"whole", EXIT_STORE,
            hint="free space or set --max-bytes below the free space, then rerun: it "
                 "encodes only what is missing")
    for ident in ok:
        info = store.stat(ident)
        if info is None and ident in saved:  # written, then evicted to honour max_bytes
            summary.encoded += 1
            summary.evicted_own += 1
        elif info is None:
            summary.failed += 1
            err = save_errors.get(ident) or "the engine stored no entry under the expected identifier"
            summary.failures.append({"path": todo[ident].rel, "error": err})
        else:
            summary.encoded += 1
            summary.bytes_written += info.size


def _media_item(ident: str, f) -> tuple[tuple | None, str | None]:
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


def _is_url(text: str) -> bool:
    from ..connectors.store.url import is_redis_url
    return is_redis_url(text)


class _RichProgress:
    """Progress on stderr (Rich); silent when ``--quiet``."""

    def __init__(self, console):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)
        self.progress = Progress(TextColumn("{task.description:>15}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                 transient=False)
        self.task = None
        self.console = console

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def start(self, phase: str, total: int | None):
        self.task = self.progress.add_task(phase, total=total)

    def advance(self, n: int, failed: str | None = None):
        self.progress.advance(self.task, n)
        if failed:
            self.console.print(f"[yellow]failed[/] {failed}")


def _render(summary: Summary, as_json: bool) -> None:
    if as_json:
        data = asdict(summary)
        data["images_per_second"] = summary.images_per_second
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"precompute → {summary.store}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    rows = [("files", summary.files), ("hashed (new/changed)", summary.hashed),
            ("unchanged (manifest)", summary.from_manifest),
            ("already in store", summary.present),
            *([("other encoder config", summary.other_config)] if summary.other_config else []),
            *([("stale LoRA (other adapter)", summary.stale_lora)] if summary.stale_lora else []),
            ("encoded", summary.encoded),
            ("failed", summary.failed),
            *([("not media (skipped)", summary.skipped_non_media)]
              if summary.skipped_non_media else []),
            ("pruned", summary.pruned),
            ("evicted (capacity)", summary.evicted),
            *([("skipped (capacity)", summary.skipped_capacity)]
              if summary.skipped_capacity else []),
            ("bytes written", f"{summary.bytes_written:,}"),
            ("images/s", f"{summary.images_per_second:.1f}"),
            ("seconds", f"{summary.seconds:.2f}")]
    for k, v in rows:
        t.add_row(k, str(v))
    console = Console()
    console.print(t)
    if summary.capacity:
        console.print(f"[yellow]over capacity:[/] {summary.capacity['message']}")
    for fail in summary.failures[:20]:
        console.print(f"[red]failed[/] {fail['path']}: {fail['error']}")
    if len(summary.failures) > 20:
        console.print(f"… and {len(summary.failures) - 20} more (see --json)")
    if summary.non_media:
        shown = ", ".join(n["path"] for n in summary.non_media[:5])
        more = f" and {len(summary.non_media) - 5} more" if len(summary.non_media) > 5 else ""
        console.print(f"[dim]not images or videos, skipped: {shown}{more} (reasons: --json)[/]")


def register(app: typer.Typer) -> None:
    @app.command("precompute")
    def precompute(
        corpus: Annotated[str, typer.Argument(help="Image/video file or directory (searched recursively; media found by content).")],
        model: ModelOpt,
        store: StoreOpt,
        lora: LoraOpt = None,
        lora_path: Annotated[str | None, typer.Option(help="LoRA adapter to load in the producer (tower-connector LoRA).")] = None,
        batch: Annotated[int, typer.Option(help="Images per engine call.")] = 16,
        wait: Annotated[float, typer.Option(help="Seconds to wait for another run's lock before giving up.")] = 0.0,
        prune_missing: Annotated[bool, typer.Option("--prune-missing", help="Delete entries whose source images left the corpus.")] = False,
        shard: Annotated[str | None, typer.Option(help="Process only shard i of N (i/N), for multi-host runs.")] = None,
        no_manifest: Annotated[bool, typer.Option("--no-manifest", help="Re-read and re-hash every file.")] = False,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Hash and count, but do not encode or prune.")] = False,
        max_model_len: Annotated[int | None, typer.Option(help="Engine max_model_len.")] = None,
        dtype: Annotated[str | None, typer.Option(help="Engine dtype (auto, float16, bfloat16, float32).")] = None,
        engine_arg: Annotated[list[str] | None, typer.Option("--engine-arg", help="Extra vllm.LLM argument KEY=VALUE (JSON value); repeatable.")] = None,
        max_bytes: Annotated[int | None, typer.Option(help="Store capacity in bytes (disk: LRU eviction past it).")] = None,
        tag: TagOpt = None,
        over_capacity: Annotated[str, typer.Option(
            "--over-capacity", metavar="keep-served|skip",
            help="When the corpus needs more than the store's capacity: keep-served (encode "
                 "every missing image; the least recently served entries are evicted) or "
                 "skip (encode only into free room; evict nothing).")] = "keep-served",
        request_mm_processor_kwargs: Annotated[str | None, typer.Option(help="JSON object: the mm_processor_kwargs the served requests carry (hashed into each identifier and applied by the producer), e.g. '{\"max_pixels\": 200704}'.")] = None,
        quiet: QuietOpt = False,
        as_json: JsonOpt = False,
        ray: Annotated[str | None, typer.Option("--ray", metavar="auto|ADDRESS", help="Run on a Ray cluster (auto, or the head's host:port); needs the ray extra (pip install encache\\[ray]). See docs/ray.md.")] = None,
        engines: Annotated[int, typer.Option(help="With --ray: number of engine actors.")] = 1,
        gpus_per_engine: Annotated[float, typer.Option(help="With --ray: GPUs per engine actor.")] = 0.0,
        cpus_per_engine: Annotated[float | None, typer.Option(help="With --ray: CPUs per engine actor (default 1 with GPUs, else 0.5).")] = None,
    ) -> None:
        """Encode a corpus of images and videos with a real vLLM engine into the store."""
        from rich.console import Console

        if not os.environ.get("ENCACHE_DEBUG"):
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's start-up chatter

        engine_args = _parse_engine_args(engine_arg or [])
        validate_args(corpus, batch, lora, lora_path, shard)
        console = Console(stderr=True, quiet=quiet)
        progress = None if quiet else _RichProgress(console)
        ctx = progress if progress else _Null()
        with ctx:
            job = run_precompute
            single_host_only = dict(
                over_capacity=over_capacity,
                request_mm_processor_kwargs=_request_kwargs(request_mm_processor_kwargs))
            if ray:  # the Ray job (encache.jobs.ray_precompute); no Ray import otherwise
                from . import precompute_ray
                if over_capacity != "keep-served" or request_mm_processor_kwargs:
                    raise EncacheError("--ray does not take --over-capacity skip or "
                                       "--request-mm-processor-kwargs yet", EXIT_USAGE)
                single_host_only = {}
                job = functools.partial(precompute_ray.run, address=ray, engines=engines,
                                        gpus_per_engine=gpus_per_engine,
                                        cpus_per_engine=cpus_per_engine)
            summary = job(
                corpus, model, store, lora=lora, lora_path=lora_path, batch=batch, wait=wait,
                prune_missing=prune_missing, shard=shard, use_manifest=not no_manifest,
                dry_run=dry_run, max_model_len=max_model_len, dtype=dtype,
                engine_args=engine_args, max_bytes=max_bytes, tag=tag,
                progress=progress, **single_host_only)
        if not quiet or summary.failed or as_json:
            _render(summary, as_json)
            if ray and not as_json:
                precompute_ray.render_engines(summary)
        raise typer.Exit(EXIT_PARTIAL if summary.failed else EXIT_OK)


def _request_kwargs(text: str | None) -> dict | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise EncacheError(f"--request-mm-processor-kwargs is not JSON: {e.msg}", EXIT_USAGE) from None
    return check_request_kwargs(value, None)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None
