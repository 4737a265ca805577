"""``encache verify [--repair]``: read every entry and check it.

Per entry: header (parses, sizes add up: truncation, trailing bytes, shape × dtype = byte
count), checksum of the tensor bytes, identifier (the metadata names the entry it is
stored under), LoRA (metadata vs identifier prefix) and, with ``--model``, the model the
entry was made for. Legacy entries (written by vLLM's ECExampleConnector, no metadata)
are size-checked and reported as unverifiable: a warning, not a failure. Stray temp
files left by crashed writers are warnings too (invisible to readers). An entry written by
a newer encache (a format or checksum algorithm this build does not know) is reported as
such, apart from the problems, and ``--repair`` leaves it (docs/upgrading.md).

Exit codes: 0 clean (warnings allowed), 4 problems found (also when ``--repair`` fixed
them all), 3 ``--repair`` could not fix every problem, or no problem found but a part of
the store did not answer (a Redis Cluster's dead primary: its entries went unchecked),
10 no problem found but entries written by a newer encache (not checked, left as they
are), 2 usage, 7 store unreachable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from encache.cli.options import MAX_JOBS, JsonOpt, ModelOpt, StoreOpt, parse_age

if TYPE_CHECKING:  # the job is library code, loaded on first use (``--help`` imports none)
    from encache.connectors.store.ops.verify import Finding, VerifyReport

# -- rendering -----------------------------------------------------------------------

def render_table(rep: VerifyReport, repair: dict | None) -> None:
    from encache.cli.render import emit, print_renderables, table
    from encache.connectors.store.units import human_bytes

    items = []
    if rep.problems:
        rows = [(f.identifier, f.reason, f.detail, human_bytes(f.size)) for f in rep.problems]
        items.append(table([("Identifier", {"overflow": "fold"}), "Problem", "Detail",
                            "Size>"], rows, title=f"Problems ({len(rep.problems):,})"))
    if rep.warnings:
        groups: dict[tuple[str, str], list[Finding]] = {}
        for f in rep.warnings:
            groups.setdefault((f.reason, f.detail), []).append(f)
        rows = []
        for (reason, detail), fs in groups.items():
            examples = ", ".join(f.identifier for f in fs[:3]) + (" …" if len(fs) > 3 else "")
            rows.append((reason, f"{len(fs):,}", detail, examples))
        items.append(table(["Warning", "Count>", "Meaning", ("Examples", {"overflow": "fold"})],
                           rows, title=f"Warnings ({len(rep.warnings):,})"))
    if rep.newer:
        rows = [(f.identifier, f.detail, human_bytes(f.size)) for f in rep.newer]
        items.append(table([("Identifier", {"overflow": "fold"}), "Written by a newer encache",
                            "Size>"], rows,
                           title=f"Newer format, left as they are ({len(rep.newer):,})"))
    if items:
        print_renderables(*items)
    for f in rep.info:
        emit(f"Note: {f.detail}")
    verdict = "clean" if rep.clean else f"{len(rep.problems):,} problem(s)"
    newer = (f", {len(rep.newer):,} written by a newer encache (not checked: upgrade this "
             "host to check them)" if rep.newer else "")
    emit(f"Checked {rep.checked:,} entries ({human_bytes(rep.bytes_checked)}) in {rep.store}: "
         f"{verdict}, {len(rep.warnings):,} warning(s){newer}.")
    if repair is not None:
        parts = []
        if repair["quarantined"]:
            parts.append(f"quarantined {repair['quarantined']:,} entries in {repair['quarantine_dir']}")
        if repair["deleted"]:
            parts.append(f"deleted {repair['deleted']:,} entries")
        if repair["removed_stray"]:
            parts.append(f"removed {repair['removed_stray']:,} stray file(s)")
        if repair["skipped"]:
            parts.append(f"left {repair['skipped']:,} that changed since the check")
        text = ", ".join(parts) or "nothing to do"
        emit(f"Repair: {text}; freed {human_bytes(repair['freed_bytes'])}.")
        for fail in repair["failed"]:
            emit(f"Repair failed for {fail['identifier']}: {fail['error']}")


def register(app: typer.Typer) -> None:
    @app.command("verify")
    def verify(
        store: StoreOpt,
        repair: Annotated[bool, typer.Option(
            "--repair", help="Remove bad entries (quarantined on disk stores) and stray "
                             "temp files, and report what was done.")] = False,
        quarantine: Annotated[bool, typer.Option(
            "--quarantine/--delete",
            help="With --repair on a disk store: move bad entries to "
                 "{store}/.encache/quarantine/ (default) or delete them.")] = True,
        model: ModelOpt = None,
        grace: Annotated[Optional[float], typer.Option(
            "--grace", metavar="AGE", parser=parse_age,
            help="Temp files younger than AGE are left alone, and any a running writer "
                 "holds. Default 1h.")] = None,
        threads: Annotated[Optional[int], typer.Option(
            "--threads", "-j", min=1, max=MAX_JOBS, metavar="N",
            help=f"Reader threads, at most {MAX_JOBS}.")] = None,
        json_: JsonOpt = False,
        quiet: Annotated[bool, typer.Option(
            "--quiet", "-q", help="No progress; print nothing when the store is clean (cron).")
        ] = False,
    ) -> None:
        """Read every entry; check header, checksum, shape/dtype, identifier and model.

        Exit 0 when clean, 4 when problems were found, 3 when --repair could not fix them
        all or a part of the store did not answer, 10 when entries were written by a
        newer encache (left as they are)."""
        from encache.cli import errors
        from encache.cli.common import display_url, opened
        from encache.cli.render import emit_json, partial_exit, partial_note, progress
        from encache.connectors.store.ops.scanning import parts_dicts
        from encache.connectors.store.ops.verify import (DEFAULT_GRACE, repair_plan, repair_store,
                                                     verify_store)

        with opened(store) as st:
            url = display_url(store, st)
            with progress("Verifying", quiet=quiet or json_) as tick:
                rep = verify_store(st, display_url=url, model=model, threads=threads,
                                   grace=DEFAULT_GRACE if grace is None else grace,
                                   progress=tick)
            if repair and rep.repairable:
                plan = repair_plan(st, rep, quarantine=quarantine)
                with progress("Repairing", plan.count, quiet=quiet or json_) as tick:
                    repair_store(st, rep, plan=plan, progress=tick)
            elif repair:
                repair_store(st, rep)  # nothing to do: an empty result
        result = rep.repair
        repair_data = result.to_dict() if result is not None else None
        if json_:
            emit_json({**rep.to_dict(), "repair": repair_data})
        elif not (quiet and rep.clean and not rep.newer and not (result and result.failed)):
            render_table(rep, repair_data)
        if result is not None and result.failed:
            raise typer.Exit(errors.EXIT_PARTIAL)
        parts = parts_dicts(rep.unreachable)
        if not rep.clean:  # (the problems decide the code; the note still goes out)
            partial_note(parts, "this check")
            raise typer.Exit(errors.EXIT_PROBLEMS)
        partial_exit(parts, "this check")
        if rep.newer:
            raise typer.Exit(errors.EXIT_NEWER)

