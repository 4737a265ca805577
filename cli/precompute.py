"""``encache precompute CORPUS``: fill a store with a real vLLM ec_producer engine.

Walks the corpus, computes each file's served identifier (vLLM's own hasher, bytes as a
``vllm serve`` consumer hashes them), skips what the store already holds *without starting
the engine*, then encodes only the missing images in batches. Cron-safe: one run per store
at a time (exclusive lock), a manifest so unchanged files are not read again, ``--quiet``
for cron mail, ``--prune-missing`` to drop entries whose source images left the corpus.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated

import typer

from .errors import EXIT_ENGINE, EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, EncacheError
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
    encoder_config: str = ""  # this run's encoder-config digest ("" = default)
    encoded: int = 0
    failed: int = 0
    pruned: int = 0
    evicted: int = 0  # encoded and written, then evicted by the store's capacity this run
    bytes_written: int = 0
    engine_started: bool = False
    seconds: float = 0.0
    encode_seconds: float = 0.0
    failures: list = field(default_factory=list)  # [{path, error}]

    @property
    def images_per_second(self) -> float:
        return self.encoded / self.encode_seconds if self.encode_seconds > 0 else 0.0


UNREADABLE = "!unreadable:"  # manifest marker: not an identifier (identifiers never contain "!")


def _clean_error(e: BaseException) -> str:
    import re
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"\s*<_io\.\w+ object at 0x[0-9a-f]+>", "", text)
    return f"not a readable image ({text})"[:300]


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
                 shard: str | None, media_io_kwargs: dict | None) -> dict:
    """What a manifest's identifiers depend on (a different key: a different manifest)."""
    key = {"corpus": os.path.abspath(corpus), "model": model, "lora": lora or "",
           "hash_algo": hash_algo, "shard": shard or ""}
    if media_io_kwargs:  # absent by default, so existing manifests keep their location
        key["media_io_kwargs"] = media_io_kwargs
    return key


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
                   progress=None) -> Summary:
    """The precompute job (no printing: ``progress`` is an optional callback object)."""
    from ..connectors.corpus import Manifest, shard_of, walk
    from ..connectors.encoder_config import holds
    from ..connectors.store import open_store

    shard_spec = validate_args(corpus, batch, lora, lora_path, shard)
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if not isinstance((engine_args or {}).get(name) or {}, dict):
            example = ('{"max_pixels": 1003520}' if name == "mm_processor_kwargs"
                       else '{"image": {"rgba_background_color": [0, 0, 0]}}')
            raise EncacheError(f"--engine-arg {name}= expects a JSON object, e.g. "
                               f"{name}='{example}'", EXIT_USAGE)
    store = open_store(store_url, create=True, **({"max_bytes": max_bytes} if max_bytes else {}))
    summary = Summary(store=store.url, model=model, lora=lora)
    engine_args = dict(engine_args or {})
    summary.encoder_config = engine_encoder_config(engine_args, tag)
    media_io_kwargs, hash_algo = hashing_settings(engine_args, hash_algo)
    t_start = time.perf_counter()
    with store.lock("precompute", wait=wait):
        files = walk(corpus)
        if shard_spec:
            files = [f for f in files if shard_of(f.rel, *shard_spec)]
        summary.files = len(files)
        key = manifest_key(corpus, model, lora, hash_algo, shard, media_io_kwargs)
        manifest = Manifest.load(Manifest.location(store, key), key)
        if not use_manifest:
            manifest.files = {}
        present = set(store.identifiers())
        todo: dict[str, object] = {}  # identifier -> CorpusFile (first file wins)
        if progress:
            progress.start("hashing", len(files))
        for f in files:
            ident = manifest.lookup(f)
            if ident is None:
                from ..connectors.vllm.hashing import identify_file
                try:
                    ident = identify_file(f.path, model, lora=lora, hash_algo=hash_algo,
                                          media_io_kwargs=media_io_kwargs).identifier
                except (ValueError, OSError) as e:
                    ident = UNREADABLE + _clean_error(e)
                manifest.record(f, ident)
                summary.hashed += 1
            else:
                summary.from_manifest += 1
            if ident.startswith(UNREADABLE):  # remembered, so an unchanged bad file is not re-read
                summary.failed += 1
                summary.failures.append({"path": f.rel, "error": ident[len(UNREADABLE):]})
                if progress:
                    progress.advance(1, failed=f.rel)
                continue
            if ident in present and holds(store, ident, summary.encoder_config):
                summary.present += 1
            else:
                if ident in present and ident not in todo:
                    summary.other_config += 1
                todo.setdefault(ident, f)
            if progress:
                progress.advance(1)
        if todo and not dry_run:
            _encode_missing(todo, model, store, store_url, summary, lora=lora, lora_path=lora_path,
                            batch=batch, max_model_len=max_model_len, dtype=dtype,
                            engine_args=engine_args, max_bytes=max_bytes, tag=tag,
                            progress=progress)
        if prune_missing and not dry_run:
            current = {f.rel for f in files}
            gone = [rel for rel in list(manifest.files) if rel not in current]
            still_used = {manifest.files[r][2] for r in manifest.files if r in current}
            for rel in gone:
                ident = manifest.files[rel][2]
                if ident.startswith(UNREADABLE):
                    manifest.drop(rel)
                    continue
                if ident not in still_used and store.delete(ident):
                    summary.pruned += 1
                manifest.drop(rel)
        if not dry_run:
            manifest.save()
    summary.seconds = time.perf_counter() - t_start
    return summary


def _encode_missing(todo: dict, model: str, store, store_url: str, summary: Summary, *, lora,
                    lora_path, batch, max_model_len, dtype, engine_args, max_bytes, tag,
                    progress) -> None:
    from ..connectors.vllm.producer import EngineOptions, ProducerEngine, data_url

    # the engine's connector opens the store itself: give it the real URL (store.url is
    # redacted for display and would fail AUTH)
    opts = EngineOptions(model=model, store=store_url if _is_url(store_url) else store.url, max_model_len=max_model_len, dtype=dtype,
                         lora_name=lora, lora_path=lora_path, extra=engine_args,
                         store_options={**({"max_bytes": max_bytes} if max_bytes else {}),
                                        **({"tag": tag} if tag else {})} or None)
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
            payload = []
            for ident, f in chunk:
                try:
                    with open(f.path, "rb") as fh:
                        payload.append((ident, data_url(fh.read(), f.path)))
                except OSError as e:
                    summary.failed += 1
                    summary.failures.append({"path": f.rel, "error": f"cannot read: {e.strerror}"})
            for res in engine.encode(payload) if payload else []:
                if res.ok:
                    ok.append(res.identifier)
                else:
                    summary.failed += 1
                    summary.failures.append({"path": todo[res.identifier].rel, "error": res.error})
            if progress:
                progress.advance(len(chunk))
        engine.wait_for_saves()
        save_errors = engine.save_errors()
        saved = engine.saved_identifiers()
    finally:
        engine.close()
    summary.encode_seconds = time.perf_counter() - t0
    for ident in ok:
        info = store.stat(ident)
        if info is None and ident in saved:  # written, then evicted to honour max_bytes
            summary.encoded += 1
            summary.evicted += 1
        elif info is None:
            summary.failed += 1
            err = save_errors.get(ident) or "the engine stored no entry under the expected identifier"
            summary.failures.append({"path": todo[ident].rel, "error": err})
        else:
            summary.encoded += 1
            summary.bytes_written += info.size


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
            self.console.print(f"[yellow]skipped[/] {failed}: not a readable image")


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
            ("encoded", summary.encoded),
            ("failed", summary.failed), ("pruned", summary.pruned),
            ("evicted (capacity)", summary.evicted),
            ("bytes written", f"{summary.bytes_written:,}"),
            ("images/s", f"{summary.images_per_second:.1f}"),
            ("seconds", f"{summary.seconds:.2f}")]
    for k, v in rows:
        t.add_row(k, str(v))
    console = Console()
    console.print(t)
    for fail in summary.failures[:20]:
        console.print(f"[red]failed[/] {fail['path']}: {fail['error']}")
    if len(summary.failures) > 20:
        console.print(f"… and {len(summary.failures) - 20} more (see --json)")


def register(app: typer.Typer) -> None:
    @app.command("precompute")
    def precompute(
        corpus: Annotated[str, typer.Argument(help="Image file or directory (searched recursively).")],
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
        quiet: QuietOpt = False,
        as_json: JsonOpt = False,
        ray: Annotated[str | None, typer.Option("--ray", metavar="auto|ADDRESS", help="Run on a Ray cluster (auto, or the head's host:port); needs the ray extra (pip install encache\\[ray]). See docs/ray.md.")] = None,
        engines: Annotated[int, typer.Option(help="With --ray: number of engine actors.")] = 1,
        gpus_per_engine: Annotated[float, typer.Option(help="With --ray: GPUs per engine actor.")] = 0.0,
        cpus_per_engine: Annotated[float | None, typer.Option(help="With --ray: CPUs per engine actor (default 1 with GPUs, else 0.5).")] = None,
    ) -> None:
        """Encode an image corpus with a real vLLM engine into the store."""
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
            if ray:  # the Ray job (encache.jobs.ray_precompute); no Ray import otherwise
                from . import precompute_ray
                job = functools.partial(precompute_ray.run, address=ray, engines=engines,
                                        gpus_per_engine=gpus_per_engine,
                                        cpus_per_engine=cpus_per_engine)
            summary = job(
                corpus, model, store, lora=lora, lora_path=lora_path, batch=batch, wait=wait,
                prune_missing=prune_missing, shard=shard, use_manifest=not no_manifest,
                dry_run=dry_run, max_model_len=max_model_len, dtype=dtype,
                engine_args=engine_args, max_bytes=max_bytes, tag=tag, progress=progress)
        if not quiet or summary.failed or as_json:
            _render(summary, as_json)
            if ray and not as_json:
                precompute_ray.render_engines(summary)
        raise typer.Exit(EXIT_PARTIAL if summary.failed else EXIT_OK)


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None
