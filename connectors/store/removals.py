"""Removal records: entries a policy removed, so a refresh does not encode them again.

What: a bounded record, per store, of identifiers removed by a *policy* -- the store's
capacity eviction (``evicted``) and ``encache purge --older-than`` (``older-than``) --
with the reason and the time. ``encache precompute`` reads it and leaves those
identifiers out of a refresh (``--refill-removed`` encodes them again, and forgets
their records once they are stored); ``encache stats`` counts it.

Why: without it the cron jobs undo each other. ``purge --older-than 30d`` removes what
nobody served for a month, the next ``precompute`` finds those images missing and
encodes them again (an engine start and a re-encode for entries the store just chose to
drop); an eviction under ``max_bytes`` likewise brought back, at every refresh, what the
previous one evicted. An explicit delete (``purge --lora/--model/--all``,
``--prune-missing``, ``verify --repair``) is not a policy and is not recorded: the next
refresh encodes again what the corpus still holds (for a LoRA: with the adapter given).

The disk store keeps :class:`RemovalLog` (``{root}/.encache/removals.log``, one JSON
line ``[reason, time, identifier]`` per record, ``""`` as the reason of a forget);
``removals.counts`` keeps the count per reason under the log's version; the Redis
stores keep one sorted set per reason (``P removed:{reason}``, scored by
time). Both hold at most :data:`LIMIT` identifiers: past it the oldest records go
(those identifiers are encoded again by a later refresh, as before records existed).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

log = logging.getLogger(__name__)

#: why an entry was removed by a policy
EVICTED = "evicted"
OLDER_THAN = "older-than"
REASONS = (EVICTED, OLDER_THAN)

#: identifiers a store remembers (the oldest records beyond it are dropped)
LIMIT = 1_000_000


class RemovalLog:
    """The disk store's removal records: an append-only log of JSON lines beside the
    entries, folded into a dict when read (the last line of an identifier wins) and
    rewritten with its newest ``limit`` records once it holds twice that many lines.
    Appends and the rewrite hold ``removals.lock`` (``flock``); a damaged line is read
    past."""

    def __init__(self, meta_dir: str | os.PathLike, *, limit: int = LIMIT):
        self.meta = Path(meta_dir)
        self.path = self.meta / "removals.log"
        self.limit = limit

    @contextlib.contextmanager
    def _locked(self, shared: bool = False):
        with open(self.meta / "removals.lock", "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lk, fcntl.LOCK_UN)

    def _append(self, reason: str, identifiers: Iterable[str | None]) -> None:
        now = time.time()
        lines = b"".join(msgspec.json.encode([reason, now, i]) + b"\n"
                         for i in identifiers if i)
        if not lines:
            return
        with self._locked():
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, lines)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            # (a line is ~70-110 bytes: rewrite once it may hold 2 x limit lines)
            if size > 2 * self.limit * 64:
                self._rewrite()

    def record(self, identifiers: Iterable[str | None], reason: str) -> None:
        """Remember ``identifiers`` as removed for ``reason`` (one of :data:`REASONS`)."""
        self._append(reason, identifiers)

    def forget(self, identifiers: Iterable[str]) -> None:
        """Drop the records of ``identifiers`` (they are stored again)."""
        self._append("", identifiers)

    def _fold(self) -> dict[str, tuple[str, float]]:
        try:
            data = self.path.read_bytes()
        except OSError:  # none yet; or damaged past reading (then a refresh encodes them)
            return {}
        decode = msgspec.json.Decoder(tuple[str, float, str]).decode
        out: dict[str, tuple[str, float]] = {}
        for line in data.splitlines():
            try:
                reason, when, ident = decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue  # a torn or hand-edited line: as if it were not there
            if reason:
                out[ident] = (reason, when)
            else:
                out.pop(ident, None)
        if len(out) > self.limit:  # the newest records win
            keep = sorted(out.items(), key=lambda kv: kv[1][1])[-self.limit:]
            out = dict(keep)
        return out

    def _rewrite(self) -> None:
        """The newest ``limit`` records in a new file, renamed over the log (caller
        holds the lock)."""
        records = self._fold()
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(msgspec.json.encode([r, t, i]) + b"\n"
                             for i, (r, t) in records.items()))
        os.replace(tmp, self.path)

    def read(self) -> dict[str, str]:
        """Identifier -> reason of every record kept."""
        try:
            with self._locked(shared=True):
                records = self._fold()
        except OSError:  # a read-only store: read as it is
            records = self._fold()
        return {i: r for i, (r, _) in records.items()}

    def counts(self) -> dict[str, int]:
        """Records per reason. Kept in ``removals.counts`` under the log's version
        (inode, size, mtime): ``encache stats`` of a store whose log did not change reads
        one small file, not the whole log."""
        cache = self.meta / "removals.counts"
        try:
            st = os.stat(self.path)
            version = [st.st_ino, st.st_size, st.st_mtime_ns]
        except OSError:
            return dict.fromkeys(REASONS, 0)
        try:
            kept = msgspec.json.decode(cache.read_bytes())
            if kept["version"] == version and all(type(n) is int for n in kept["counts"].values()):
                return {**dict.fromkeys(REASONS, 0), **kept["counts"]}
        except (OSError, msgspec.DecodeError, KeyError, TypeError, AttributeError):
            pass  # none yet, or damaged: counted again below
        out = dict.fromkeys(REASONS, 0)
        for reason in self.read().values():
            out[reason] = out.get(reason, 0) + 1
        with contextlib.suppress(OSError):  # (a read-only store: counted every time)
            tmp = cache.with_suffix(".tmp")
            tmp.write_bytes(msgspec.json.encode({"version": version, "counts": out}))
            os.replace(tmp, cache)
        return out


def note_failure(url: str, e: BaseException) -> None:
    """A removal record that could not be written is worth a warning, never a failed
    write or purge: the cost is one re-encode by a later refresh."""
    log.warning("encache: could not record removed entries in %s (%s); a refresh may "
                "encode them again", url, e)
