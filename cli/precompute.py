"""``encache precompute CORPUS``: fill a store with a real vLLM ec_producer engine.

Walks the corpus, computes each file's served identifier (vLLM's own hasher, bytes as a
``vllm serve`` consumer hashes them), skips what the store already holds *without starting
the engine*, then encodes only the missing images in batches. Cron-safe: one run per store
at a time (exclusive lock: a second run exits 5, silently with ``--quiet``), a manifest so
unchanged files are not read again, ``--quiet`` for cron mail, ``--prune-missing`` to drop
entries whose source images left the corpus; what a policy removed (capacity eviction,
``purge --older-than``) is not encoded again unless ``--refill-removed``.

This module parses options, builds :class:`~encache.jobs.precompute.PrecomputeOptions`,
calls the job (:func:`encache.jobs.precompute.precompute_corpus`, or the Ray job with
``--ray``) and renders its ``Summary``.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

import typer

from ..jobs.precompute import (PrecomputeOptions, Summary, check_request_kwargs,
                               parse_engine_args, precompute_corpus, validate_args)
from .common import quiet_engine_start, quiet_when_locked
from .errors import EXIT_OK, EXIT_PARTIAL, EXIT_USAGE, EncacheError
from .options import (DtypeOpt, EngineArgOpt, JsonOpt, LoraOpt, LoraPathOpt, MaxModelLenOpt,
                      ModelOpt, QuietOpt, StoreOpt, TagOpt, not_negative, parse_json,
                      parse_size)


def _render(summary: Summary, as_json: bool) -> None:
    if as_json:
        from .render import emit_json

        data = asdict(summary)
        data["images_per_second"] = summary.images_per_second
        emit_json(data, indent=2, ascii=True)
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .render import literal

    def line(tag: str, style: str, text: str) -> Text:  # data (paths, errors) printed as is
        return Text.assemble((tag, style), " ", text)

    t = Table(title=literal(f"precompute → {summary.store}", "table.title"), show_header=False,
              title_justify="left")
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
            *([("skipped (removed by policy)", summary.skipped_removed)]
              if summary.skipped_removed else []),
            *([("refilled (removed by policy)", summary.refilled_removed)]
              if summary.refilled_removed else []),
            ("bytes written", f"{summary.bytes_written:,}"),
            ("images/s", f"{summary.images_per_second:.1f}"),
            ("seconds", f"{summary.seconds:.2f}")]
    for k, v in rows:
        t.add_row(k, str(v))
    console = Console()
    console.print(t)
    if summary.capacity:
        console.print(line("over capacity:", "yellow", summary.capacity["message"]))
    for note in summary.notes:
        console.print(line("note:", "yellow", note))
    for fail in summary.failures[:20]:
        console.print(line("failed", "red", f"{fail['path']}: {fail['error']}"))
    if len(summary.failures) > 20:
        console.print(f"… and {len(summary.failures) - 20} more (see --json)")
    if summary.non_media:
        shown = ", ".join(n["path"] for n in summary.non_media[:5])
        more = f" and {len(summary.non_media) - 5} more" if len(summary.non_media) > 5 else ""
        console.print(Text(f"not images or videos, skipped: {shown}{more} (reasons: --json)",
                           style="dim"))


def register(app: typer.Typer) -> None:
    @app.command("precompute")
    def precompute(
        corpus: Annotated[str, typer.Argument(help="Image/video file or directory (searched recursively; media found by content).")],
        model: ModelOpt,
        store: StoreOpt,
        lora: LoraOpt = None,
        lora_path: LoraPathOpt = None,
        batch: Annotated[int, typer.Option(help="Images per engine call.")] = 16,
        wait: Annotated[float, typer.Option(
            callback=not_negative,
            help="Seconds to wait for another run's lock before giving up.")] = 0.0,
        prune_missing: Annotated[bool, typer.Option("--prune-missing", help="Delete entries whose source images left the corpus.")] = False,
        shard: Annotated[str | None, typer.Option(help="Process only shard i of N (i/N), for multi-host runs.")] = None,
        no_manifest: Annotated[bool, typer.Option("--no-manifest", help="Re-read and re-hash every file.")] = False,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Hash and count, but do not encode or prune.")] = False,
        max_model_len: MaxModelLenOpt = None,
        dtype: DtypeOpt = None,
        engine_arg: EngineArgOpt = None,
        max_bytes: Annotated[int | None, typer.Option(
            metavar="SIZE", parser=parse_size,
            help="Store capacity (bytes, or 500M, 50G…; disk: LRU eviction past it).")] = None,
        tag: TagOpt = None,
        over_capacity: Annotated[str, typer.Option(
            "--over-capacity", metavar="keep-served|skip",
            help="When the corpus needs more than the store's capacity: keep-served (encode "
                 "every missing image; the least recently served entries are evicted) or "
                 "skip (encode only into free room; evict nothing).")] = "keep-served",
        refill_removed: Annotated[bool, typer.Option(
            "--refill-removed",
            help="Also encode images whose entries a policy removed (capacity eviction, "
                 "purge --older-than); by default a refresh leaves them out, so it does "
                 "not undo the policy.")] = False,
        request_mm_processor_kwargs: Annotated[str | None, typer.Option(help="JSON object: the mm_processor_kwargs the served requests carry (hashed into each identifier and applied by the producer), e.g. '{\"max_pixels\": 200704}'.")] = None,
        quiet: QuietOpt = False,
        as_json: JsonOpt = False,
        ray: Annotated[str | None, typer.Option("--ray", metavar="auto|ADDRESS", help="Run on a Ray cluster (auto, or the head's host:port); needs the ray extra (pip install encache-vllm\\[ray]). See docs/ray.md.")] = None,
        engines: Annotated[int, typer.Option(
            min=1, help="With --ray: number of engine actors.")] = 1,
        gpus_per_engine: Annotated[float, typer.Option(
            callback=not_negative, help="With --ray: GPUs per engine actor.")] = 0.0,
        cpus_per_engine: Annotated[float | None, typer.Option(help="With --ray: CPUs per engine actor (default 1 with GPUs, else 0.5).")] = None,
    ) -> None:
        """Encode a corpus of images and videos with a real vLLM engine into the store."""
        from .render import PhaseProgress

        quiet_engine_start()

        engine_args = parse_engine_args(engine_arg or [])
        validate_args(corpus, batch, lora, lora_path, shard)
        with PhaseProgress(quiet, width=15, transient=False, show_failures=True,
                           terminal_only=False) as progress:
            options = PrecomputeOptions(
                model=model, store=store, lora=lora, lora_path=lora_path, batch=batch,
                max_model_len=max_model_len, dtype=dtype, engine_args=engine_args,
                max_bytes=max_bytes, tag=tag, over_capacity=over_capacity,
                request_mm_processor_kwargs=_request_kwargs(request_mm_processor_kwargs),
                refill_removed=refill_removed)
            run = dict(shard=shard, use_manifest=not no_manifest, prune_missing=prune_missing,
                       dry_run=dry_run, wait=wait, progress=progress)
            with quiet_when_locked(quiet):
                if ray:  # the Ray job (encache.jobs.ray_precompute); no Ray import otherwise
                    from . import precompute_ray
                    summary = precompute_ray.run(corpus, options, address=ray, engines=engines,
                                                 gpus_per_engine=gpus_per_engine,
                                                 cpus_per_engine=cpus_per_engine, **run)
                else:
                    summary = precompute_corpus(corpus, options, **run)
        if not quiet or summary.failed or as_json:
            _render(summary, as_json)
            if ray and not as_json:
                precompute_ray.render_engines(summary)
        raise typer.Exit(EXIT_PARTIAL if summary.failed else EXIT_OK)


def _request_kwargs(text: str | None) -> dict | None:
    if not text:
        return None
    try:
        value = parse_json(text)
    except ValueError as e:
        raise EncacheError(f"--request-mm-processor-kwargs is not JSON: {e}",
                           EXIT_USAGE) from None
    return check_request_kwargs(value, None)

