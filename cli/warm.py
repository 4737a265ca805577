"""``encache warm``: get entries where serving engines read them fast.

Two jobs, one command:

* **Promote** (``--from DISK --store redis://…``): copy entries from a disk store into
  another store (typically the shared Redis) — all of them, one LoRA's (``--lora``), or
  those of given images or videos (``IMAGE…``, hashed with ``--model`` exactly as
  ``vllm serve`` hashes them; directories searched for media by content, other files
  skipped and listed) or identifiers (``--identifier``). Entries the destination already has
  are skipped (``--overwrite`` to rewrite them); every entry is verified on the way
  (header, size, checksum) and a corrupt one is reported, never copied.
  ``--compute-missing`` encodes the given images that neither store has with a real
  vLLM producer engine (``encache precompute`` for just those files) into the
  destination.
* **Local tier** (``--store SHARED --local-tier DIR``): copy entries from the shared store
  into this node's local tier (``docs/local-tier.md``), verified on the way, so a
  consumer configured with the same ``local_tier`` serves them locally from its first
  request (it checks them against the shared store at its first sync).
* **Page cache** (``--store DISK`` without ``--from``): read the chosen entry files of a
  disk store once so they sit in the OS page cache — after a reboot or a fresh volume
  mount — without marking them as recently used.

Progress goes to stderr (on a terminal); the summary to stdout (a table, or ``--json``
with raw bytes and seconds). Exit code 3 when some items failed (unreadable images,
corrupt or missing entries), 7 when a store is unreachable.

vLLM is imported only to hash IMAGE arguments or to compute missing entries.

The job is library code: :func:`encache.jobs.warm.warm` (options checked, stores opened,
``--compute-missing`` through :func:`encache.jobs.precompute.precompute_files`) over the
parts in the same module; this module parses options into its
:class:`~encache.jobs.warm.WarmOptions`, draws progress and renders the
:class:`WarmSummary`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from encache.cli import errors
from encache.cli.common import quiet_engine_start
from encache.cli.options import (DtypeOpt, EngineArgOpt, JsonOpt, LocalTierMaxOpt,
                                LocalTierOpt, LoraOpt, LoraPathOpt, MaxModelLenOpt, ModelOpt,
                                QuietOpt, StoreOpt, TagOpt)

if TYPE_CHECKING:
    from encache.jobs.warm import WarmOptions, WarmSummary

#: failures shown in the table (all of them are in --json)
SHOW_FAILURES = 20


# -- rendering -----------------------------------------------------------------------

def render(summary: WarmSummary, as_json: bool, *, hint: str | None = None) -> None:
    from encache.cli.render import emit, emit_json, human_duration, print_renderables, table
    from encache.connectors.store.units import human_bytes

    if as_json:
        emit_json(summary.to_dict())
        return
    rate = f"{human_bytes(summary.bytes_per_second)}/s" if summary.seconds > 0 else "-"
    if summary.mode == "copy":
        title = "warm: copy entries"
        rows = [("from", summary.source), ("to", summary.store)]
        if summary.lora:
            rows.append(("LoRA", summary.lora))
        if summary.requested is not None:
            rows.append(("requested", f"{summary.requested:,}"))
        rows.append(("copied", f"{summary.copied:,}"))
        if summary.evicted:
            rows.append(("evicted again (capacity)", f"{summary.evicted:,}"))
        rows.append(("already there (skipped)", f"{summary.skipped:,}"))
        if summary.computed:
            rows.append(("computed (engine)", f"{summary.computed:,}"))
        rows += [("failed", f"{summary.failed:,}"), ("bytes written", human_bytes(summary.bytes))]
        if summary.skipped_non_media:
            rows.append(("not media (skipped)", f"{summary.skipped_non_media:,}"))
    else:
        title = "warm: page cache"
        rows = [("store", summary.store)]
        if summary.lora:
            rows.append(("LoRA", summary.lora))
        if summary.requested is not None:
            rows.append(("requested", f"{summary.requested:,}"))
        rows.append(("entries read", f"{summary.entries:,}"))
        if summary.computed:
            rows.append(("computed (engine)", f"{summary.computed:,}"))
        rows += [("failed", f"{summary.failed:,}"), ("bytes read", human_bytes(summary.bytes))]
        if summary.skipped_non_media:
            rows.append(("not media (skipped)", f"{summary.skipped_non_media:,}"))
    rows += [("time", human_duration(summary.seconds)), ("throughput", rate)]
    if summary.hashed or summary.computed:
        rows.append(("total (with hashing/encoding)", human_duration(summary.total_seconds)))
    t = table(["", ("", {"overflow": "fold"})], rows, title=title)
    t.show_header = False
    items = [t]
    if summary.failures:
        shown = summary.failures[:SHOW_FAILURES]
        items.append(table([("Failed", {"overflow": "fold"}), ("File", {"overflow": "fold"}),
                            "Reason"],
                           [(f["identifier"] or "-", f["path"] or "-", f["reason"]) for f in shown]))
    print_renderables(*items)
    if summary.failed > SHOW_FAILURES:
        emit(f"… and {summary.failed - SHOW_FAILURES} more (see --json)")
    if hint:
        emit(hint)


# -- the command ---------------------------------------------------------------------

def run_warm(options: WarmOptions, *, quiet: bool = False) -> WarmSummary:
    """:func:`encache.jobs.warm.warm` with this command's progress on stderr (unless
    ``quiet``)."""
    from encache.cli.render import PhaseProgress, note
    from encache.jobs.warm import warm

    if options.compute:
        quiet_engine_start()
    with PhaseProgress(quiet) as progress:
        return warm(options, progress=progress, note=None if quiet else note)


def register(app: typer.Typer) -> None:
    @app.command("warm")
    def warm(
        store: StoreOpt,
        images: Annotated[Optional[list[Path]], typer.Argument(
            metavar="IMAGE", show_default=False,  # a missing one is its own failure
            help="Only the entries of these images or videos (directories are searched "
                 "recursively, media found by content); needs --model.")] = None,
        source: Annotated[Optional[str], typer.Option(
            "--from", metavar="DISK_STORE",
            help="Copy entries from this disk store into --store (without it: read "
                 "--store's entry files into the OS page cache).")] = None,
        identifier: Annotated[Optional[list[str]], typer.Option(
            "--identifier", "-i", metavar="ID",
            help="Only this entry (repeatable).")] = None,
        lora: LoraOpt = None,
        model: ModelOpt = None,
        compute: Annotated[bool, typer.Option(
            "--compute-missing",
            help="Encode IMAGEs that no store has with a vLLM producer engine, into "
                 "--store (needs --model).")] = False,
        overwrite: Annotated[bool, typer.Option(
            "--overwrite", help="Rewrite entries --store already has.")] = False,
        lora_path: LoraPathOpt = None,
        max_model_len: MaxModelLenOpt = None,
        dtype: DtypeOpt = None,
        engine_arg: EngineArgOpt = None,
        tag: TagOpt = None,
        local_tier: LocalTierOpt = None,
        local_tier_max_bytes: LocalTierMaxOpt = None,
        quiet: QuietOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Promote entries from a disk store into Redis (--from), fill this node's local
        tier from the shared store (--local-tier DIR), or read a disk store into the OS
        page cache; all entries, --lora NAME, --identifier ID, or IMAGEs."""
        from encache.connectors.store.ops.transfer import TransferAborted
        from encache.jobs.precompute import parse_engine_args
        from encache.jobs.warm import WarmOptions

        options = WarmOptions(
            store, source=source, images=tuple(str(p) for p in images or []),
            identifiers=tuple(identifier or ()), lora=lora, model=model, compute=compute,
            overwrite=overwrite, lora_path=lora_path, max_model_len=max_model_len,
            dtype=dtype, engine_args=parse_engine_args(engine_arg or []), tag=tag,
            local_tier=local_tier, local_tier_max_bytes=local_tier_max_bytes)
        try:
            summary = run_warm(options, quiet=quiet or json_)
        except TransferAborted as e:
            partial = getattr(e, "summary", None)
            if partial is not None and (json_ or not quiet):
                render(partial, json_)
            raise
        hint = None
        if any(f["reason"] == "missing" and f["path"] for f in summary.failures) and not compute:
            hint = ("Some images have no entry in the source: add --compute-missing to "
                    "encode them.")
        if summary.evicted:
            from encache.connectors.store.units import human_bytes
            cap = f" ({human_bytes(summary.capacity)})" if summary.capacity else ""
            hint = ((hint + "\n") if hint else "") + (
                f"{summary.evicted:,} of the entries copied were evicted again by later ones: "
                f"the destination's capacity{cap} is below the selection (raise "
                f"{'--local-tier-max-bytes' if local_tier else 'its max_bytes'}, or warm less).")
        if json_ or not quiet or summary.failed:
            render(summary, json_, hint=hint)
        raise typer.Exit(errors.EXIT_PARTIAL if summary.failed else errors.EXIT_OK)
