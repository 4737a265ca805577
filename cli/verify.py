"""``encache verify [--repair]``: read every entry and check it.

Per entry: header (parses, sizes add up: truncation, trailing bytes, shape × dtype = byte
count), checksum of the tensor bytes, identifier (the metadata names the entry it is
stored under), LoRA (metadata vs identifier prefix) and, with ``--model``, the model the
entry was made for. Legacy entries (written by vLLM's ECExampleConnector, no metadata)
are size-checked and reported as unverifiable: a warning, not a failure. Stray temp
files left by crashed writers are warnings too (invisible to readers).

Exit codes: 0 clean (warnings allowed), 4 problems found (also when ``--repair`` fixed
them all), 3 ``--repair`` could not fix every problem, 2 usage, 7 store unreachable.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Optional

import typer

from encache.cli.options import JsonOpt, ModelOpt, StoreOpt

DEFAULT_GRACE = 3600.0  # temp files younger than this may belong to a running writer
CHUNK = 64


@dataclass(frozen=True)
class Finding:
    identifier: str
    severity: str  # "problem" | "warning" | "info"
    reason: str  # short tag: truncated, checksum, wrong-shape, legacy, stray, …
    detail: str = ""
    size: int = 0

    def to_dict(self) -> dict:
        return {"identifier": self.identifier, "severity": self.severity,
                "reason": self.reason, "detail": self.detail, "size": self.size}


@dataclass
class VerifyReport:
    store: str
    model: str | None = None
    checked: int = 0
    bytes_checked: int = 0
    vanished: int = 0  # deleted while we were reading (not a problem)
    problems: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    info: list[Finding] = field(default_factory=list)
    models: Counter = field(default_factory=Counter)
    bad: list = field(default_factory=list)  # (EntryInfo, reason) for a repair plan
    strays: list = field(default_factory=list)  # Paths

    @property
    def clean(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "store": self.store, "model": self.model, "clean": self.clean,
            "checked": self.checked, "bytes_checked": self.bytes_checked,
            "vanished": self.vanished,
            "problems": [f.to_dict() for f in self.problems],
            "warnings": [f.to_dict() for f in self.warnings],
            "info": [f.to_dict() for f in self.info],
            "models": {("" if k is None else k): v for k, v in self.models.items()},
        }


def check_entry(store, e, model: str | None = None) -> tuple[list[Finding], str | None, bool]:
    """Read and check one entry (from a scan). Returns ``(findings, model, vanished)``."""
    from encache.connectors.store import CorruptEntry, decode
    from encache.connectors.store.keys import split_lora

    out: list[Finding] = []
    ident = e.identifier
    blob = read_untracked(store, ident) if _gettable(ident) else None
    if blob is None:
        if e.error is not None:  # unreadable by name (hashed directory): the scan's verdict
            return [Finding(ident, "problem", e.error, "", e.size)], None, False
        return [], None, True
    try:
        meta, _ = decode(blob, identifier=ident, verify=True)
    except CorruptEntry as err:
        return [Finding(ident, "problem", err.reason, err.detail, len(blob))], None, False
    if e.error is not None:  # the scan saw something the full read did not
        out.append(Finding(ident, "problem", e.error, "reported by the store's scan", len(blob)))
    if meta.legacy:
        out.append(Finding(ident, "warning", "legacy",
                           "no metadata or checksum (written by ECExampleConnector): "
                           "size checked only", len(blob)))
        return out, None, False
    prefix = split_lora(ident)[0]
    if prefix and meta.lora and meta.lora != prefix:
        out.append(Finding(ident, "problem", "wrong-lora",
                           f"metadata names LoRA {meta.lora!r}, identifier {prefix!r}", len(blob)))
    if model is not None:
        if meta.model is None:
            out.append(Finding(ident, "warning", "unknown-model",
                               "no model recorded in the metadata", len(blob)))
        elif meta.model != model:
            out.append(Finding(ident, "problem", "wrong-model",
                               f"made for {meta.model!r}, not {model!r}", len(blob)))
    return out, meta.model, False


def read_untracked(store, identifier: str):
    """Read a whole entry without recording it as a use.

    A disk store's ``get`` refreshes the file's access time (its LRU clock, and what
    ``--older-than`` looks at), so a weekly verify would make every entry look fresh.
    On disk we read the entry file with ``O_NOATIME`` instead (falling back to a plain
    read where the kernel refuses it); other backends go through ``store.get``.
    """
    if not store.supports_entry_path:
        return store.get(identifier)
    from encache.connectors.store.disk import open_untracked

    try:
        fd = open_untracked(store.entry_path(identifier))
    except (FileNotFoundError, NotADirectoryError):
        return None
    with os.fdopen(fd, "rb", buffering=0) as f:
        return f.read()


def _gettable(ident: str) -> bool:
    from encache.connectors.store.keys import InvalidIdentifier, validate

    try:
        validate(ident)
    except InvalidIdentifier:
        return False
    return True


def default_threads() -> int:
    return max(2, min(8, (os.cpu_count() or 1) * 2))


def verify_store(store, url: str, *, model: str | None = None, threads: int | None = None,
                 grace: float = DEFAULT_GRACE,
                 progress: Callable[[int], None] | None = None) -> VerifyReport:
    """The ``verify`` data builder: reads every entry (threads overlap I/O and hashing)."""
    rep = VerifyReport(url, model)
    threads = threads or default_threads()

    def check_chunk(chunk):
        return [(e, *check_entry(store, e, model)) for e in chunk]

    def chunks():
        buf = []
        for e in store.scan():
            buf.append(e)
            if len(buf) >= CHUNK:
                yield buf
                buf = []
        if buf:
            yield buf

    done = 0
    for results in _pipelined(check_chunk, chunks(), threads):
        for e, findings, m, vanished in results:
            done += 1
            if vanished:
                rep.vanished += 1
                continue
            rep.checked += 1
            rep.bytes_checked += e.size
            for f in findings:
                {"problem": rep.problems, "warning": rep.warnings,
                 "info": rep.info}[f.severity].append(f)
            bad = [f for f in findings if f.severity == "problem"]
            if bad:
                rep.bad.append((e, bad[0].reason))
            if m is not None:
                rep.models[m] += 1
        if progress is not None:
            progress(done)
    if model is None and len([k for k in rep.models if k is not None]) > 1:
        mix = ", ".join(f"{k!r} ({n:,})" for k, n in rep.models.most_common() if k is not None)
        rep.info.append(Finding("", "info", "mixed-models",
                                f"entries for {len(rep.models)} models: {mix}"))
    for p in store.stray_files(older_than=grace):
        rep.strays.append(p)
        kind = "empty directory" if p.is_dir() else "temp file from an interrupted write"
        rep.warnings.append(Finding(str(p), "warning", "stray", kind))
    rep.problems.sort(key=lambda f: (f.reason, f.identifier))
    rep.warnings.sort(key=lambda f: (f.reason, f.identifier))
    return rep


def _pipelined(fn, items, threads: int):
    """``map(fn, items)`` on a thread pool, in order, with at most ``2 * threads`` items
    in flight (``Executor.map`` would read the whole scan into memory first)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def still_bad(store, model: str | None):
    """For the repair plan: re-check one entry right before it is removed."""

    def check(identifier: str) -> bool:
        if not _gettable(identifier):
            return True
        e = store.stat(identifier)
        if e is None:
            # gone, or a disk entry reported by its hashed directory name (``~h…``),
            # which a lookup by identifier cannot find: trust the scan for those
            return identifier.startswith("~")
        findings, _, vanished = check_entry(store, e, model)
        return not vanished and any(f.severity == "problem" for f in findings)

    return check


# -- rendering -----------------------------------------------------------------------

def render_table(rep: VerifyReport, repair: dict | None) -> None:
    from encache.cli.render import emit, human_bytes, print_renderables, table

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
    if items:
        print_renderables(*items)
    for f in rep.info:
        emit(f"Note: {f.detail}")
    verdict = "clean" if rep.clean else f"{len(rep.problems):,} problem(s)"
    emit(f"Checked {rep.checked:,} entries ({human_bytes(rep.bytes_checked)}) in {rep.store}: "
         f"{verdict}, {len(rep.warnings):,} warning(s).")
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
            "--grace", metavar="AGE", parser=lambda v: _parse_age(v),
            help="Temp files younger than AGE are left alone (a writer may be using "
                 "them). Default 1h.")] = None,
        threads: Annotated[Optional[int], typer.Option(
            "--threads", "-j", min=1, metavar="N", help="Reader threads.")] = None,
        json_: JsonOpt = False,
        quiet: Annotated[bool, typer.Option(
            "--quiet", "-q", help="No progress; print nothing when the store is clean (cron).")
        ] = False,
    ) -> None:
        """Read every entry; check header, checksum, shape/dtype, identifier and model.

        Exit 0 when clean, 4 when problems were found, 3 when --repair could not fix them
        all."""
        from encache.cli import errors
        from encache.cli.common import display_url, opened
        from encache.cli.render import emit_json, progress

        with opened(store) as st:
            url = display_url(store, st)
            with progress("Verifying", quiet=quiet or json_) as tick:
                rep = verify_store(st, url, model=model, threads=threads,
                                   grace=DEFAULT_GRACE if grace is None else grace,
                                   progress=tick)
            result = None
            if repair and (rep.bad or rep.strays):
                from encache.connectors.store.plan import build_repair_plan, execute

                plan = build_repair_plan(st, rep.bad, rep.strays, display_url=url,
                                         quarantine=quarantine)
                with progress("Repairing", plan.count, quiet=quiet or json_) as tick:
                    result = execute(plan, st, progress=tick, still_bad=still_bad(st, model))
        repair_data = result.to_dict() if result is not None else (
            {"deleted": 0, "quarantined": 0, "removed_stray": 0, "missing": 0, "skipped": 0,
             "freed_bytes": 0, "quarantine_dir": None, "failed": []} if repair else None)
        if json_:
            emit_json({**rep.to_dict(), "repair": repair_data})
        elif not (quiet and rep.clean and not (result and result.failed)):
            render_table(rep, repair_data)
        if result is not None and result.failed:
            raise typer.Exit(errors.EXIT_PARTIAL)
        if not rep.clean:
            raise typer.Exit(errors.EXIT_PROBLEMS)


def _parse_age(value: str) -> float:
    from encache.connectors.store.scanning import parse_age

    return parse_age(value)
