"""``encache purge``: delete entries by LoRA, model, age, or all of them.

Always builds a plan first and prints what will go and how many bytes that frees;
``--dry-run`` stops there; otherwise it asks (on a terminal) unless ``--yes``. Without a
terminal and without ``--yes`` it refuses (exit 6) rather than guess. Each entry is
removed with one atomic operation (``store.delete``), so a concurrent reader sees it
whole or not at all. A part of the store that does not answer (a Redis Cluster's dead
primary) is named, the others' entries are purged, and the exit code is 3: purge again
once it is back. One purge deletes from a store at a time (its ``purge`` lock: a second
exits 5, silently with ``--quiet``).

What ``--older-than`` deletes is a policy's removal: it is recorded in the store
(:mod:`encache.connectors.store.removals`) and ``precompute`` does not encode it again
unless ``--refill-removed``. The other selections (``--lora``, ``--model``, ``--all``) are
an operator's explicit deletes and are not recorded: a refresh encodes again what its
corpus still holds (for a LoRA: with the adapter it is given).
"""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from encache.cli.options import (DryRunOpt, JsonOpt, LoraOpt, ModelOpt, OlderThanOpt, StoreOpt,
                                 YesOpt)

#: rows of the plan shown to people (the summary line always counts everything)
SHOW_ROWS = 25


def render_plan(plan, rows: int = SHOW_ROWS) -> None:
    import time

    from encache.cli.render import emit, human_ago, or_dash, print_table
    from encache.connectors.store.units import human_bytes

    if not plan.items:
        return
    now = time.time()
    shown = plan.items[:rows] if rows else plan.items
    print_table([("Identifier", {"overflow": "fold"}), "LoRA", "Model", "Size>", "Created",
                 "Accessed"],
                [(i.identifier, or_dash(i.lora), or_dash(i.model), human_bytes(i.size),
                  human_ago(i.created, now), human_ago(i.accessed, now)) for i in shown])
    if len(plan.items) > len(shown):
        emit(f"… and {len(plan.items) - len(shown):,} more (-v or --json to see them all)")


def plan_line(plan, dry_run: bool) -> str:
    from encache.connectors.store.units import human_bytes

    verb = "Would delete" if dry_run else "Will delete"
    return (f"{verb} {plan.entries:,} entries ({plan.selection}) from {plan.store}, "
            f"freeing {human_bytes(plan.bytes)}.")


def purge_lock(store):
    """The store's ``purge`` lock (:class:`~encache.connectors.store.LockBusy` when another
    purge holds it). Where the part of the store that keeps the lock does not answer (a
    Redis Cluster's dead primary) the purge goes on without it: it deletes what the parts
    that answer hold, as a partial purge does."""
    from encache.connectors.store import LockBusy, StoreError

    stack = contextlib.ExitStack()
    try:
        stack.enter_context(store.lock("purge"))
    except LockBusy:
        raise
    except StoreError:
        if not store.supports_failure_domains:
            raise
        # (a part is down: the plan named it already, and the exit code will be 3)
    return stack


def register(app: typer.Typer) -> None:
    @app.command("purge")
    def purge(
        store: StoreOpt,
        lora: LoraOpt = None,
        model: ModelOpt = None,
        older_than: OlderThanOpt = None,
        all_: Annotated[bool, typer.Option("--all", help="Every entry in the store.")] = False,
        stale: Annotated[bool, typer.Option(
            "--stale", help="With --lora NAME: only entries made with another adapter than "
                            "the newest one written under NAME (or than --lora-path).")] = False,
        lora_path: Annotated[str | None, typer.Option(
            "--lora-path", metavar="DIR",
            help="With --stale: the adapter now served under NAME; entries made with any "
                 "other are stale.")] = None,
        dry_run: DryRunOpt = False,
        yes: YesOpt = False,
        verbose: Annotated[bool, typer.Option(
            "--verbose", "-v", help=f"Show every planned entry (default: the first {SHOW_ROWS}).")
        ] = False,
        json_: JsonOpt = False,
        quiet: Annotated[bool, typer.Option(
            "--quiet", "-q", help="Print nothing but errors (for cron; needs --yes).")] = False,
    ) -> None:
        """Delete entries by --lora, --model, --older-than, or --all (plan, confirm, delete).

        --lora NAME matches identifiers NAME:<hash> and entries whose metadata names that
        LoRA (--stale: only those made with an older adapter under NAME); --older-than matches entries not written or read for that long. Filters
        combine (AND)."""
        from encache.cli import errors
        from encache.cli.common import (display_url, make_filter, no_gc, opened,
                                        quiet_when_locked, usage)
        from encache.connectors.store.removals import OLDER_THAN
        from encache.cli.render import (confirm, emit, emit_json, note, partial_exit,
                                        partial_note, progress)
        from encache.connectors.store.units import human_bytes
        from encache.connectors.store.ops.scanning import parts_dicts
        from encache.connectors.store.ops.plan import build_purge_plan, execute

        flt = make_filter(lora=lora, model=model, older_than=older_than)
        if stale and not lora:
            raise usage("--stale needs --lora NAME", hint="e.g. purge --lora NAME --stale")
        if lora_path and not stale:
            raise usage("--lora-path is only used with --stale")
        current = None
        if lora_path:
            from encache.connectors.store.lora_stamp import adapter_digest
            current = adapter_digest(lora_path)
            if not current:
                raise usage(f"no LoRA adapter files in {lora_path}")
        if all_ and flt.active:
            raise usage("--all cannot be combined with --lora, --model or --older-than")
        if not all_ and not flt.active:
            raise usage("nothing selected",
                        hint="give --lora NAME, --model M, --older-than AGE, or --all")
        with opened(store) as st:
            url = display_url(store, st)
            with progress("Planning", quiet=quiet or json_) as tick, no_gc():
                if stale:
                    from encache.connectors.store.ops.plan import build_stale_lora_plan
                    plan = build_stale_lora_plan(st, flt, display_url=url, current=current,
                                                 progress=tick)
                else:
                    plan = build_purge_plan(st, flt, display_url=url, everything=all_,
                                            progress=tick)
            parts = parts_dicts(plan.unreachable)  # (their entries cannot be planned)
            if not json_ and not quiet:
                render_plan(plan, 0 if verbose else SHOW_ROWS)
                if plan.count:
                    emit(plan_line(plan, dry_run))
                else:
                    emit(f"Nothing to purge ({plan.selection}) in {plan.store}.")
            if dry_run or not plan.count:
                if json_:
                    emit_json({"plan": plan.to_dict(), "dry_run": dry_run, "result": None})
                partial_exit(parts, "this plan")
                return
            if parts:  # said before the question (and with -q: exit 3 needs a reason)
                partial_note(parts, "this plan")
            if not yes:
                confirm(f"Delete {plan.entries:,} entries ({human_bytes(plan.bytes)})?",
                        refusal=f"refusing to delete {plan.entries:,} entries "
                                f"({human_bytes(plan.bytes)}) without confirmation: not on a "
                                f"terminal",
                        hint="pass --yes to confirm, or --dry-run to look",
                        declined="aborted; nothing was deleted")
            with quiet_when_locked(quiet), purge_lock(st), \
                    progress("Deleting", plan.count, quiet=quiet or json_) as tick:
                result = execute(plan, st, progress=tick)
            if older_than:  # a policy's removal: a refresh does not encode these again
                st.record_removals(result.deleted, OLDER_THAN)
        if json_:
            emit_json({"plan": plan.to_dict(), "dry_run": False, "result": result.to_dict()})
        else:
            gone = f", {len(result.missing):,} were already gone" if result.missing else ""
            if not quiet:
                emit(f"Deleted {len(result.deleted):,} entries, freed "
                     f"{human_bytes(result.freed_bytes)}{gone}.")
            for ident, err in result.failed:
                note(f"Could not delete {ident}: {err}")
        if result.failed:
            raise typer.Exit(errors.EXIT_PARTIAL)
        partial_exit(parts, "this purge", quiet=True)  # (said before the deletes)
