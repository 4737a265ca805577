"""Checking a store: read every entry, report what is wrong, optionally repair it.

The job behind ``encache verify [--repair]``, as library code (like diskcache's
``Cache.check(fix=)`` or huggingface_hub's ``verify_repo_checksums``)::

    from encache.connectors.store import open_store
    from encache.connectors.store.ops.verify import verify_store

    with open_store("/data/encache", create=False) as st:
        report = verify_store(st, model="llava-hf/llava-1.5-7b-hf", repair=True)
    print(report.clean, report.checked, [f.reason for f in report.problems])

Per entry: header (parses, sizes add up: truncation, trailing bytes, shape × dtype = byte
count), checksum of the tensor bytes, identifier (the metadata names the entry it is
stored under), LoRA (metadata vs identifier prefix) and, with ``model``, the model the
entry was made for. Legacy entries (written by vLLM's ECExampleConnector, no metadata)
are size-checked and reported as unverifiable: a warning, not a failure. Stray temp
files left by crashed writers are warnings too (invisible to readers). An entry written by
a newer encache (a format or checksum this build does not know: ``entry.NewerFormat``) is
neither: it is listed in ``report.newer``, never in the problems, and a repair leaves it.

On a local disk store each entry that passes is recorded in the store's log of versions
verified this boot (``verified_log.py``): run after a reboot, ``encache verify`` spares
this host's consumers the checksum of every first load.

A repair is a :mod:`.plan` delete plan (quarantine on disk stores, delete elsewhere, plus
stray files); each entry is re-checked right before it goes, so one a producer rewrote
since the check is left alone. Reads never count as a use (no access-time update on disk).
"""

from __future__ import annotations

import os
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..base import EntryInfo, Store
from ..entry import NEWER_FORMAT, CorruptEntry, NewerFormat, decode
from ..keys import InvalidIdentifier, split_lora, validate
from .plan import DeletePlan, PlanResult, build_repair_plan, execute
from ..units import batched
from .scanning import parts_dicts

DEFAULT_GRACE = 3600.0  # temp files younger than this are not strays (nor any a writer holds)
CHUNK = 64  # entries per unit of work on the reader threads


@dataclass(frozen=True)
class Finding:
    identifier: str
    severity: str  # "problem" | "warning" | "info" | "newer" (a newer encache's entry)
    reason: str  # short tag: truncated, checksum, wrong-shape, legacy, stray, …
    detail: str = ""
    size: int = 0

    def to_dict(self) -> dict:
        return {"identifier": self.identifier, "severity": self.severity,
                "reason": self.reason, "detail": self.detail, "size": self.size}


@dataclass
class VerifyReport:
    """What :func:`verify_store` found (and, with ``repair``, what it did in ``repair``)."""

    store: str
    model: str | None = None
    checked: int = 0
    bytes_checked: int = 0
    vanished: int = 0  # deleted while we were reading (not a problem)
    problems: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    info: list[Finding] = field(default_factory=list)
    #: entries written by a newer encache: not checked, never repaired
    newer: list[Finding] = field(default_factory=list)
    models: Counter = field(default_factory=Counter)
    bad: list = field(default_factory=list)  # (EntryInfo, reason) for a repair plan
    strays: list = field(default_factory=list)  # Paths
    repair: PlanResult | None = None  # set by a repair (None: no repair was run)
    #: parts of the store not reached, ``(part, reason)``: their entries went unchecked
    unreachable: list = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems

    @property
    def repairable(self) -> bool:
        """Something for a repair to do (bad entries or stray files)."""
        return bool(self.bad or self.strays)

    def to_dict(self) -> dict:
        return {
            "store": self.store, "model": self.model, "clean": self.clean,
            "checked": self.checked, "bytes_checked": self.bytes_checked,
            "vanished": self.vanished,
            "problems": [f.to_dict() for f in self.problems],
            "warnings": [f.to_dict() for f in self.warnings],
            "info": [f.to_dict() for f in self.info],
            "newer_format": [f.to_dict() for f in self.newer],
            "models": {("" if k is None else k): v for k, v in self.models.items()},
            "unreachable": parts_dicts(self.unreachable),
        }


def check_entry(store: Store, e: EntryInfo, model: str | None = None, *,
                log=None) -> tuple[list[Finding], str | None, bool]:
    """Read and check one entry (from a scan). Returns ``(findings, model, vanished)``.
    ``log``: the store's verified log (``verified_log.py``); an entry whose checksum
    passed, and whose file did not change while it was read, is recorded there, so this
    host's consumers load it without hashing it again this boot."""
    out: list[Finding] = []
    ident = e.identifier
    blob, st = read_untracked_with_stat(store, ident) if _gettable(ident) else (None, None)
    if blob is None:
        if e.error is not None:  # unreadable by name (hashed directory): the scan's verdict
            severity = "newer" if e.error == NEWER_FORMAT else "problem"
            return [Finding(ident, severity, e.error, "", e.size)], None, False
        return [], None, True
    try:
        meta, _ = decode(blob, identifier=ident, verify=True)
    except NewerFormat as err:  # not this build's to judge: reported, left as it is
        return [Finding(ident, "newer", err.reason, err.detail, len(blob))], None, False
    except CorruptEntry as err:
        return [Finding(ident, "problem", err.reason, err.detail, len(blob))], None, False
    if log is not None and st is not None and meta.checksum is not None:
        from ..files import ServedVersion
        from ..verified_log import record_key
        log.append(record_key(ident, ServedVersion.of(st)), st.st_ctime_ns)
    if e.error is not None and e.error != NEWER_FORMAT:  # the scan saw what the read did not
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


def read_untracked(store: Store, identifier: str):
    """Read a whole entry without recording it as a use.

    A disk store's ``get`` refreshes the file's access time (its LRU clock, and what
    ``--older-than`` looks at), so a weekly verify would make every entry look fresh.
    On disk we read the entry file with ``O_NOATIME`` instead (falling back to a plain
    read where the kernel refuses it); other backends go through ``store.get``.
    """
    return read_untracked_with_stat(store, identifier)[0]


def read_untracked_with_stat(store: Store, identifier: str):
    """:func:`read_untracked`, and the file's ``stat`` for the verified log: ``(bytes,
    stat)``; ``stat`` is None when the file changed while it was read (its ctime moved)
    or the store has no entry files."""
    if not store.supports_entry_path:
        return store.get(identifier), None
    from ..files import NotAFile, open_untracked

    try:
        fd = open_untracked(store.entry_path(identifier))
    except (FileNotFoundError, NotADirectoryError, NotAFile):  # (the scan says which)
        return None, None
    with os.fdopen(fd, "rb", buffering=0) as f:
        before = os.fstat(fd)
        data = f.read()
        after = os.fstat(fd)
    same = (after.st_ctime_ns, after.st_mtime_ns, after.st_size) == (
        before.st_ctime_ns, before.st_mtime_ns, before.st_size)
    return data, (before if same else None)


def _gettable(ident: str) -> bool:
    try:
        validate(ident)
    except InvalidIdentifier:
        return False
    return True


def default_threads() -> int:
    return max(2, min(8, (os.cpu_count() or 1) * 2))


def verify_store(store: Store, *, model: str | None = None, threads: int | None = None,
                 grace: float = DEFAULT_GRACE, repair: bool = False, quarantine: bool = True,
                 display_url: str | None = None,
                 progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Read every entry of ``store`` and check it; returns a :class:`VerifyReport`.

    ``model``: also flag entries made for another model; ``threads``: reader threads
    (they overlap I/O and hashing); ``grace``: temp files younger than this many
    seconds are left out (and any a running writer holds: ``DiskStore.stray_files``); ``repair``: then remove what
    was found (:func:`repair_store`; ``quarantine`` on disk stores), the outcome in
    ``report.repair``; ``display_url``: the store name in the report (default
    ``store.url``); ``progress(done)``: entries checked so far. Parts of the store that
    do not answer (a Redis Cluster's dead primary) are in ``report.unreachable``, the
    others checked.
    """
    rep = VerifyReport(store.url if display_url is None else display_url, model)
    threads = threads or default_threads()
    log = store.verified_log()  # what passes is trusted by this host's consumers

    def check_chunk(chunk):
        return [(e, *check_entry(store, e, model, log=log)) for e in chunk]

    done = 0
    chunks = batched(store.scan(unreachable=rep.unreachable), CHUNK)
    for results in _pipelined(check_chunk, chunks, threads):
        for e, findings, m, vanished in results:
            done += 1
            if vanished:
                rep.vanished += 1
                continue
            rep.checked += 1
            rep.bytes_checked += e.size
            for f in findings:
                {"problem": rep.problems, "warning": rep.warnings,
                 "info": rep.info, "newer": rep.newer}[f.severity].append(f)
            bad = [f for f in findings if f.severity == "problem"]
            if bad:
                rep.bad.append((e, bad[0].reason))
            if m is not None:
                rep.models[m] += 1
        if progress is not None:
            progress(done)
    if model is not None and not rep.models.get(model):
        # no entry at all was made for ``model``: a mistyped name (or an empty one from a
        # cron job's unset variable), not a store of wrong entries; a repair keeps them
        others = [b for b in rep.bad if b[1] == "wrong-model"]
        if others:
            rep.bad = [b for b in rep.bad if b[1] != "wrong-model"]
            rep.warnings.append(Finding(
                "", "warning", "no-entry-for-model",
                f"no entry was made for {model!r}: the {len(others):,} made for other "
                f"models are not repaired (remove them with encache purge --model NAME)"))
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
    rep.newer.sort(key=lambda f: f.identifier)
    if log is not None:
        log.close()
    if repair:
        repair_store(store, rep, quarantine=quarantine)
    return rep


def repair_plan(store: Store, report: VerifyReport, *, quarantine: bool = True) -> DeletePlan:
    """The delete plan a repair of ``report``'s findings carries out (to show or count)."""
    return build_repair_plan(store, report.bad, report.strays, display_url=report.store,
                             quarantine=quarantine)


def repair_store(store: Store, report: VerifyReport, *, quarantine: bool = True,
                 plan: DeletePlan | None = None,
                 progress: Callable[[int], None] | None = None) -> PlanResult:
    """Remove the bad entries and stray files ``report`` found (``plan``: one already
    built with :func:`repair_plan`). Each entry is re-checked just before it goes.
    Sets and returns ``report.repair``; ``report.repair.failed`` lists what could not be
    fixed."""
    if not report.repairable:
        report.repair = PlanResult()
        return report.repair
    if plan is None:
        plan = repair_plan(store, report, quarantine=quarantine)
    report.repair = execute(plan, store, progress=progress,
                            still_bad=still_bad(store, report.model))
    return report.repair


def _pipelined(fn, items, threads: int):
    """``map(fn, items)`` on a thread pool, in order, with at most ``2 * threads`` items
    in flight (``Executor.map`` would read the whole scan into memory first)."""
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def still_bad(store: Store, model: str | None) -> Callable[[str], bool]:
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
