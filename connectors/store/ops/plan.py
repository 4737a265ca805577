"""Delete plans: build -> show -> execute (``encache purge``, ``encache verify --repair``).

A plan is plain data (what goes, why, how many bytes it frees), so the CLI can print it,
stop there (``--dry-run``), ask, and only then execute it. Executing goes through the
Store interface (``store.delete``, or a backend's bulk ``delete_many`` when it has one),
so each entry disappears whole or not at all for a concurrent reader.

Actions:

``delete``      remove the entry (``store.delete``)
``quarantine``  disk stores only: move the entry file to ``{root}/.encache/quarantine/``
                (one ``rename``: atomic for readers; kept for inspection). Other backends
                delete instead.
``remove``      a stray file or empty directory left by a crashed writer (disk only;
                never visible to readers)
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..base import EntryInfo, Store, StoreError
from ..keys import from_name
from .scanning import EntryFilter, parts_dicts, scan

QUARANTINE_DIR = (".encache", "quarantine")  # under the store root (a dot-dir: not an entry)
DELETE_BATCH = 500


@dataclass(frozen=True)
class PlanItem:
    identifier: str  # the entry, or the stray path for action "remove"
    size: int
    action: str  # "delete" | "quarantine" | "remove"
    reason: str  # why it is in the plan ("purge", a verify problem tag, "stray")
    model: str | None = None
    lora: str | None = None
    created: float | None = None
    accessed: float | None = None

    def to_dict(self) -> dict:
        return {"identifier": self.identifier, "size": self.size, "action": self.action,
                "reason": self.reason, "model": self.model, "lora": self.lora,
                "created": self.created, "accessed": self.accessed}

    @classmethod
    def for_entry(cls, e: EntryInfo, action: str, reason: str) -> PlanItem:
        return cls(e.identifier, e.size, action, reason, e.model, e.lora, e.created, e.accessed)


@dataclass(frozen=True)
class DeletePlan:
    store: str  # display URL (redacted)
    items: tuple[PlanItem, ...]
    selection: str = ""  # human description of what was selected
    #: parts of the store the walk could not reach, ``(part, reason)``: their entries
    #: are not in the plan (a Redis Cluster's dead primary)
    unreachable: tuple[tuple[str, str], ...] = ()

    @property
    def count(self) -> int:
        return len(self.items)

    @property
    def entries(self) -> int:
        return sum(1 for i in self.items if i.action != "remove")

    @property
    def bytes(self) -> int:
        return sum(i.size for i in self.items)

    def to_dict(self) -> dict:
        return {"store": self.store, "selection": self.selection, "entries": self.entries,
                "stray_files": self.count - self.entries, "bytes": self.bytes,
                "unreachable": parts_dicts(self.unreachable),
                "items": [i.to_dict() for i in self.items]}


@dataclass
class PlanResult:
    deleted: list[str] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # stray files
    missing: list[str] = field(default_factory=list)  # already gone when executed
    skipped: list[str] = field(default_factory=list)  # changed since planned (e.g. rewritten)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (identifier, error)
    freed_bytes: int = 0
    quarantine_dir: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict:
        return {"deleted": len(self.deleted), "quarantined": len(self.quarantined),
                "removed_stray": len(self.removed), "missing": len(self.missing),
                "skipped": len(self.skipped), "freed_bytes": self.freed_bytes,
                "quarantine_dir": self.quarantine_dir,
                "failed": [{"identifier": i, "error": err} for i, err in self.failed]}


# -- build ---------------------------------------------------------------------------

def build_purge_plan(store: Store, flt: EntryFilter | None, *, display_url: str,
                     everything: bool = False,
                     progress: Callable[[int], None] | None = None) -> DeletePlan:
    """Entries matching ``flt`` (every entry with ``everything``), to delete."""
    if not everything and (flt is None or not flt.active):
        raise ValueError("a purge needs a selection (a filter, or everything=True)")
    unreachable: list = []  # (a part that does not answer: the rest is planned)
    items = tuple(PlanItem.for_entry(e, "delete", "purge")
                  for e in scan(store, None if everything else flt, progress, unreachable))
    items = tuple(sorted(items, key=lambda i: i.identifier))
    return DeletePlan(display_url, items, "all entries" if everything else flt.describe(),
                      tuple(unreachable))


def build_stale_lora_plan(store: Store, flt: EntryFilter, *, display_url: str,
                          current: str | None = None,
                          progress: Callable[[int], None] | None = None) -> DeletePlan:
    """Entries of ``flt.lora`` stamped with another adapter digest than ``current`` (by
    default: the digest of the LoRA's most recently written entries), i.e. made with an
    adapter since retrained under the same name. Unstamped entries are never selected.
    A part of the store that does not answer leaves its entries out of the plan (named in
    ``unreachable``); without ``current`` that raises instead, since the newest adapter
    may be on it."""
    from ..lora_stamp import is_stale, newest_digests

    unreachable: list = []
    entries = list(scan(store, flt, progress, unreachable))
    if unreachable and not current:  # (its newest entries may be on the missing part)
        part, reason = unreachable[0]
        raise StoreError(f"{part} did not answer ({reason}): the newest adapter under "
                         f"{flt.lora!r} cannot be told from the other parts; name it (its "
                         "files: --lora-path) to purge the entries of the others", domain=part)
    digests = {flt.lora: current} if current else newest_digests(entries)
    items = tuple(sorted((PlanItem.for_entry(e, "delete", "stale-lora") for e in entries
                          if is_stale(e, digests)), key=lambda i: i.identifier))
    what = f"adapter digest {current}" if current else "the newest adapter"
    return DeletePlan(display_url, items, f"{flt.describe()}, made with another adapter than "
                                          f"{what}", tuple(unreachable))


def build_repair_plan(store: Store, bad: Iterable[tuple[EntryInfo, str]],
                      strays: Iterable[Path] = (), *, display_url: str,
                      quarantine: bool = True) -> DeletePlan:
    """Bad entries (``(entry, reason)``) to quarantine or delete, plus stray files."""
    action = "quarantine" if quarantine and can_quarantine(store) else "delete"
    items = []
    for p in strays:  # first: an entry's directory can go only once its temp files have
        with contextlib.suppress(OSError):
            size = p.stat().st_size if p.is_file() else 0
            items.append(PlanItem(str(p), size, "remove", "stray"))
    items += [PlanItem.for_entry(e, action, reason) for e, reason in bad]
    return DeletePlan(display_url, tuple(items), "problems found by verify")


# -- execute -------------------------------------------------------------------------

def can_quarantine(store: Store) -> bool:
    return store.supports_entry_path


def quarantine_dir(store: Store) -> Path:
    return Path(store.root).joinpath(*QUARANTINE_DIR)


def execute(plan: DeletePlan, store: Store, *,
            progress: Callable[[int], None] | None = None,
            still_bad: Callable[[str], bool] | None = None) -> PlanResult:
    """Carry out a plan. ``still_bad(identifier)`` (repair) re-checks an entry right
    before it goes, so one rewritten since the plan was made is left alone."""
    res = PlanResult()
    done = 0

    def tick(n: int = 1) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done)

    deletes = []
    for item in plan.items:
        if item.action == "remove":
            _remove_stray(item, res)
            tick()
            continue
        if still_bad is not None:
            try:
                bad = still_bad(item.identifier)
            except Exception as e:  # a failed re-check is not a reason to delete
                res.failed.append((item.identifier, f"re-check failed: {e}"))
                tick()
                continue
            if not bad:
                (res.missing if not store.contains(item.identifier) else res.skipped).append(
                    item.identifier)
                tick()
                continue
        if item.action == "quarantine":
            _quarantine(store, item, res)
            tick()
        else:
            deletes.append(item)
    for i in range(0, len(deletes), DELETE_BATCH):
        batch = deletes[i:i + DELETE_BATCH]
        _delete_batch(store, batch, res)
        tick(len(batch))
    return res


def _delete_batch(store: Store, batch: list[PlanItem], res: PlanResult) -> None:
    if store.supports_batch and len(batch) > 1:
        try:
            out = store.delete_many([i.identifier for i in batch], per_item=True)
        except Exception as e:
            for i in batch:
                res.failed.append((i.identifier, str(e) or type(e).__name__))
            return
        for item, existed in zip(batch, out):
            _record_delete(item, bool(existed), res)
        return
    for item in batch:
        try:
            existed = store.delete(item.identifier)
            if not existed and _raw_disk_name(store, item.identifier):
                existed = _delete_raw_disk_name(store, item.identifier)
        except Exception as e:
            res.failed.append((item.identifier, str(e) or type(e).__name__))
            continue
        _record_delete(item, existed, res)


def _record_delete(item: PlanItem, existed: bool, res: PlanResult) -> None:
    if existed:
        res.deleted.append(item.identifier)
        res.freed_bytes += item.size
    else:
        res.missing.append(item.identifier)


def _raw_disk_name(store: Store, identifier: str) -> bool:
    """A disk scan reports an unreadable entry in a hashed directory (``~h…``) by its
    directory name; ``store.delete`` would look for a different name."""
    return can_quarantine(store) and identifier.startswith("~") and "/" not in identifier


def _entry_file(store: Store, identifier: str) -> Path:
    path = Path(store.entry_path(identifier))
    if not path.exists() and _raw_disk_name(store, identifier):
        raw = Path(store.root) / identifier / path.name
        if raw.exists():
            return raw
    return path


def _delete_raw_disk_name(store: Store, name: str) -> bool:
    path = _entry_file(store, name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    with contextlib.suppress(OSError):
        os.rmdir(path.parent)
    _changed_outside(store, name)
    return True


def _changed_outside(store: Store, identifier: str) -> None:
    """A quarantine or a removal by raw name bypasses ``store.delete``: tell the store
    (its change journal), naming the identifier a raw directory name stands for."""
    if _raw_disk_name(store, identifier):
        store.changed_outside([identifier, from_name(identifier)])
    else:
        store.changed_outside([identifier])


def _quarantine(store: Store, item: PlanItem, res: PlanResult) -> None:
    src = _entry_file(store, item.identifier)
    qdir = quarantine_dir(store)
    res.quarantine_dir = str(qdir)
    try:
        qdir.mkdir(parents=True, exist_ok=True)
        dest = qdir / f"{src.parent.name}.{int(time.time())}.{src.name}"
        n = 0
        while dest.exists():
            n += 1
            dest = qdir / f"{src.parent.name}.{int(time.time())}-{n}.{src.name}"
        os.rename(src, dest)  # atomic: a reader sees the entry whole, or a miss
    except FileNotFoundError:
        res.missing.append(item.identifier)
        return
    except OSError as e:
        res.failed.append((item.identifier, f"{e.strerror or e}"))
        return
    _changed_outside(store, item.identifier)
    with contextlib.suppress(OSError):
        os.rmdir(src.parent)
    res.quarantined.append(item.identifier)
    res.freed_bytes += item.size


def _remove_stray(item: PlanItem, res: PlanResult) -> None:
    p = Path(item.identifier)
    is_dir = p.is_dir()
    try:
        if is_dir:
            os.rmdir(p)  # only ever empty directories; a refilled one is in use again
        else:
            os.unlink(p)
    except FileNotFoundError:
        res.missing.append(item.identifier)
        return
    except OSError as e:
        if is_dir:  # refilled since the plan (a writer started): leave it
            res.skipped.append(item.identifier)
        else:
            res.failed.append((item.identifier, f"{e.strerror or e}"))
        return
    res.removed.append(item.identifier)
    res.freed_bytes += item.size
    if not is_dir:  # a temp file in an otherwise empty entry directory: tidy that too
        with contextlib.suppress(OSError):
            os.rmdir(p.parent)
