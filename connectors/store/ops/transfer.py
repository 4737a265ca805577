"""Moving entries between stores, warming a disk store, and sharding work.

* :func:`copy_entries` — copy/promote entries from one store to another (disk → Redis to
  share a precomputed cache, Redis → disk for a local copy). Each entry is validated on
  the way (``verify``: header, size and checksum); a corrupt source entry is
  reported, never copied. The bytes are copied verbatim (same codec on every backend).
* :func:`warm_page_cache` — read a disk store's entry files once so they sit in the OS
  page cache (after a reboot or a fresh mount), without marking them as accessed.
* :func:`shard_of` — deterministic partition of identifiers or corpus paths for
  ``encache precompute --shard i/N``: every string lands in exactly one of N shards, the
  same on every machine and Python run (sha256, not ``hash()``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..base import Store, StoreError
from ..files import NotAFile, open_untracked
from ..entry import CorruptEntry, decode, parse_header
from ..keys import split_lora

#: ``progress(identifier, outcome, nbytes)``; outcome is "copied", "skipped" or "failed"
Progress = Callable[[str, str, int], None]


@dataclass
class TransferReport:
    copied: int = 0
    skipped: int = 0
    failed: int = 0
    bytes: int = 0  # bytes written to the destination
    errors: list[tuple[str, str]] = field(default_factory=list)  # (identifier, reason)

    @property
    def ok(self) -> bool:
        return self.failed == 0

    def to_dict(self) -> dict:
        return {"copied": self.copied, "skipped": self.skipped, "failed": self.failed,
                "bytes": self.bytes, "errors": [{"identifier": i, "reason": r} for i, r in self.errors]}


class TransferAborted(StoreError):
    """A store failed mid-copy (unreachable, full); ``report`` holds what was done."""

    def __init__(self, message: str, report: TransferReport):
        super().__init__(message)
        self.report = report


def _lora_matches(identifier: str, lora: str | None) -> bool:
    return lora is None or split_lora(identifier)[0] == lora


def copy_entries(src: Store, dst: Store, identifiers: Iterable[str] | None = None, *,
                 lora: str | None = None, skip_existing: bool = True, verify: bool = True,
                 progress: Progress | None = None) -> TransferReport:
    """Copy entries from ``src`` to ``dst``; returns a :class:`TransferReport`.

    ``identifiers``: which entries (default: all of ``src``); ``lora``: only identifiers
    of that LoRA adapter (``{lora}:{hash}``); ``skip_existing``: leave entries ``dst``
    already has; ``verify``: decode each entry (header, size, checksum) and refuse corrupt
    ones (``errors`` gets ``(identifier, reason)`` — e.g. ``checksum``, ``truncated``,
    ``missing``). With ``verify=False`` only the header is checked.

    A :class:`.base.StoreError` from either store (unreachable, out of memory) stops the
    copy: :class:`TransferAborted` is raised with the partial report attached.
    """
    report = TransferReport()
    explicit = identifiers is not None
    source = src.identifiers() if identifiers is None else identifiers

    def done(ident: str, outcome: str, nbytes: int = 0, reason: str | None = None):
        if outcome == "copied":
            report.copied += 1
            report.bytes += nbytes
        elif outcome == "skipped":
            report.skipped += 1
        else:
            report.failed += 1
            report.errors.append((ident, reason or "error"))
        if progress is not None:
            progress(ident, outcome, nbytes)

    current = None
    try:
        for ident in source:
            current = ident
            if not _lora_matches(ident, lora):
                continue
            if skip_existing and dst.contains(ident):
                done(ident, "skipped")
                continue
            blob = src.get(ident)
            if blob is None:  # deleted meanwhile (or never there)
                if explicit:
                    done(ident, "failed", reason="missing")
                continue
            try:
                if verify:
                    decode(blob, identifier=ident, verify=True)
                else:
                    view = memoryview(blob)
                    parse_header(view, total_size=view.nbytes)
            except CorruptEntry as e:
                done(ident, "failed", reason=e.reason)
                continue
            n = dst.put(ident, blob)
            done(ident, "copied", n)
            del blob
    except StoreError as e:
        where = f" at {current!r}" if current is not None else ""
        raise TransferAborted(f"copy stopped{where} after {report.copied} copied: {e}",
                              report) from None
    return report


@dataclass
class WarmReport:
    entries: int = 0
    bytes: int = 0
    seconds: float = 0.0
    missing: int = 0  # identifiers asked for that have no entry file

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"entries": self.entries, "bytes": self.bytes, "seconds": self.seconds,
                "missing": self.missing}


_CHUNK = 8 << 20
def warm_page_cache(store, identifiers: Iterable[str] | None = None, *,
                    lora: str | None = None,
                    progress: Callable[[str, int], None] | None = None) -> WarmReport:
    """Read entry files of a disk store so the OS keeps them in its page cache.

    ``store``: a :class:`.disk.DiskStore` (anything with ``entry_path(identifier)``);
    ``identifiers``: which entries (default all, optionally only one ``lora``).
    Each file gets ``posix_fadvise(WILLNEED)`` and is then read through once in 8 MiB
    chunks (the read is what guarantees residency; the hint lets the kernel read ahead).
    Files are opened with ``O_NOATIME`` where allowed, so warming does not make every
    entry look recently used to LRU eviction. ``progress(identifier, nbytes)`` is called
    per entry. Returns a :class:`WarmReport` (entries, bytes, seconds, missing).
    """
    if not store.supports_entry_path:
        raise StoreError(f"warming the page cache needs a disk store, not {store.backend} "
                         f"({store.url})")
    entry_path = store.entry_path
    report = WarmReport()
    start = time.perf_counter()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    source = store.identifiers() if identifiers is None else identifiers
    for ident in source:
        if not _lora_matches(ident, lora):
            continue
        try:
            fd = open_untracked(entry_path(ident))
        except (FileNotFoundError, NotADirectoryError, NotAFile):
            report.missing += 1
            continue
        except ValueError:  # invalid identifier
            report.missing += 1
            continue
        n = 0
        try:
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            while True:
                got = os.readv(fd, [view])
                if not got:
                    break
                n += got
        finally:
            os.close(fd)
        report.entries += 1
        report.bytes += n
        if progress is not None:
            progress(ident, n)
    report.seconds = time.perf_counter() - start
    return report


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/N"`` (0-based ``i``) -> ``(i, N)``; raises ValueError when malformed."""
    try:
        i_s, n_s = text.split("/")
        i, n = int(i_s), int(n_s)
    except ValueError:
        raise ValueError(f"--shard must look like i/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= i < N")
    return i, n


def _check_shard(i: int, n: int) -> None:
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard {i}/{n}: need N >= 1 and 0 <= i < N")


def shard_of(identifier_or_path: str, i: int, n: int) -> bool:
    """True when the string belongs to shard ``i`` of ``n`` (0-based).

    ``int(sha256(utf-8 bytes)[:8], big-endian) % n == i``: stable across machines,
    processes and Python versions, and uniform, so N workers given the same corpus list
    split it with no overlap and no gap. Shard on the same string on every worker (e.g.
    the path *relative to the corpus root*, or the identifier), not on absolute paths
    that differ between machines.
    """
    _check_shard(i, n)
    digest = hashlib.sha256(identifier_or_path.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") % n == i
