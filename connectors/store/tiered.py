"""TieredStore: a node-local disk tier in front of a shared store.

A fleet shares entries through Redis, Redis Cluster or a network filesystem, and every
load of a shared entry crosses the network again, although a serving node mostly reloads
what it loaded before (RAG pages all day). The tier keeps those copies on the node's own
disk (a :class:`~.disk.DiskStore` directory with its own capacity, evicted by use):

* **reads** look locally first; a remote hit is served and written behind into the tier
  (one background thread, at most ``WRITE_BEHIND_BYTES`` queued; a full local disk turns
  the write-behind off for ``WRITE_BEHIND_RETRY_S`` with one warning: remote-only);
* **writes** (producers) go to the shared store; the node's own copy is dropped;
* **everything else** (listing, stats, counters, locks, notes) is the shared store's: it is
  the truth, the tier only holds copies (:mod:`.tier_shared`).

Never stale: a local copy is served only while it is the shared store's current version.
:meth:`sync` (run by the consumer's index refresh, every ``index_refresh_s``) asks the
shared store's change journal what was put or deleted since its cursor
(:meth:`~.base.Store.changes_since`: O(changes)) and drops those local copies; when the
journal cannot tell (first start, the journal trimmed past the cursor, the store lost its
data) it checks every local copy with :meth:`~.base.Store.unchanged` (one round trip per
batch). A store whose journal record is not atomic with the write (Redis Cluster; a
network filesystem's directory, :mod:`.disk.journal`) also gets that full check every
``JOURNAL_FULL_CHECK_S``. A write-behind racing a change (the read's sync epoch is
compared with the epoch of the sync that named the identifier, or checked everything,
before and after the write) is written but not served until the next sync checked it.

Through an outage: copies current at the last successful sync keep being served (the
consumer's circuit breaker only misses what is not local, :meth:`holds_locally`); when
the store is back, the next sync applies what changed meanwhile. Where the shared store's
parts fail apart (a Redis Cluster's primaries), an outage of one part is that part's
alone: its copies are served unchecked, the others are kept current; if the dead part
holds the change journal, every copy is checked against the other parts instead (a full
check, paced to ``ScanThrottle``'s 5 % of the time), so a purge elsewhere still reaches
the tier. The cursor and the time
of the last sync are kept in the tier (a note), so a restarted consumer resumes from its
cursor; copies written after that sync (a crash between a write-behind and its check) are
not served until checked.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Iterator

from .base import JOURNAL_FULL_CHECK_S, Store, StoreError, StoreInfo
from .disk.store import DiskStore
from .entry import CorruptEntry, NewerFormat
from .files import ServedVersion
from .throttle import ScanThrottle
from .tier_shared import SharedStoreAnswers

log = logging.getLogger(__name__)

WRITE_BEHIND_BYTES = 256 << 20  # bytes of remote reads queued for the local tier, at most
WRITE_BEHIND_RETRY_S = 300.0  # a full local disk: remote-only for this long, then retry
TIER_USAGE_S = 5.0  # the tier's size for metrics: re-summed at most this often
JOURNAL_MEMO_S = 1.0  # a journal answer read for the consumer is reused by the sync this long
CHECK_BATCH = 500  # local copies per ``unchanged`` call of a full check
STATE_NOTE = "tier-sync"  # the tier's note: remote URL, journal cursor, last sync time


def sync_state(tier) -> dict | None:
    """The tier's note (:data:`STATE_NOTE`) as its last writer left it: ``remote`` (the
    shared store's URL ``#`` prefix), ``cursor`` (its journal's) and ``synced`` (epoch
    seconds of that sync); None when there is none, or it is damaged (then the tier
    starts as one that never synced)."""
    try:
        state = json.loads(tier.get_note(STATE_NOTE) or "null")
    except (ValueError, RecursionError):
        return None
    if type(state) is not dict:
        return None
    remote, synced = state.get("remote"), state.get("synced", 0)
    if type(remote) is not str or type(synced) not in (int, float) or synced != synced:
        return None
    return {"remote": remote, "cursor": state.get("cursor"), "synced": synced}
SUSPECT_MARGIN_S = 0.05  # file times vs the clock: copies this close are checked at start
_FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


class TieredStore(SharedStoreAnswers, Store):
    """``remote`` (the shared store) with ``local`` (this node's disk tier) in front."""

    local = False  # membership questions go to the shared store

    def __init__(self, remote: Store, local: DiskStore, *,
                 write_behind_bytes: int = WRITE_BEHIND_BYTES,
                 full_check_s: float = JOURNAL_FULL_CHECK_S):
        if isinstance(remote, TieredStore):
            raise StoreError("a local tier cannot front another tiered store")
        if remote.root is not None and os.path.realpath(remote.root) == os.path.realpath(local.root):
            raise StoreError(f"the local tier {local.root} is the shared store itself")
        if local.read_only:
            raise StoreError(f"the local tier {local.root} is not writable")
        self.remote, self.tier = remote, local
        self.backend = remote.backend
        for flag in ("supports_used_bytes", "supports_batch", "supports_index_version",
                     "supports_capacity_warnings", "supports_live_counters",
                     "supports_change_journal", "journal_complete", "max_bytes",
                     "low_watermark", "read_only", "supports_failure_domains",
                     "supports_removal_records"):
            setattr(self, flag, getattr(remote, flag))
        self.supports_verified_reads = True
        self.supports_verified_log = local.supports_verified_log
        self.mapped_loads = local.mapped_loads  # local copies may be mappings
        self.write_behind_bytes = int(write_behind_bytes)
        self.full_check_s = float(full_check_s)
        #: tier events: copies served, remote reads, written behind (of which raced a
        #: change: held back until a sync checked them), dropped (queue full, disk
        #: full), invalidated by a sync, full checks, syncs failed, syncs that reached
        #: only part of the shared store
        self.stats = dict.fromkeys(("local_reads", "remote_reads", "written_behind",
                                    "written_unchecked", "write_behind_dropped",
                                    "invalidated", "full_checks", "sync_failures",
                                    "partial_syncs"), 0)
        self._cursor = None
        self._tier_bytes: int | None = None
        self._tier_usage = ScanThrottle(0.05, min_interval=TIER_USAGE_S)
        self._journal_memo = None  # (cursor asked, answered, changed, when): changes_since
        self._trusted = False  # local copies may be served (a sync succeeded, or at start)
        self._suspect: set[str] = set()  # local copies not served until a sync checks them
        self._outage = False
        self._parts_down: dict[str, str] = {}  # part -> why (_note_parts_down)
        self._journal_down: str | None = None  # the journal's part, while it does not answer
        #: full checks while the change journal's part does not answer: paced
        self._unjournaled_checks = ScanThrottle(0.05)
        self._next_full = 0.0
        self._epoch = 0  # twice the syncs done (+1 while one runs): write-behind race marks
        self._dropped_at: dict[str, int] = {}  # identifier -> epoch of the sync that dropped it
        self._checked_all_at = -1  # epoch of the last full check (changes unknown: all raced)
        self._saved = (None, 0.0)  # (cursor, monotonic time) of the last saved state
        self._sync_lock = threading.Lock()
        self._wb_lock = threading.Lock()
        self._wb_pending = 0
        self._wb_off_until = 0.0
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_behind_loop,
                                        name="encache-tier-write", daemon=True)
        self._writer.start()
        self._resume()

    # -- identity ------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.remote.url

    def __repr__(self) -> str:
        return f"TieredStore({self.remote!r}, local={str(self.tier.root)!r})"

    def reopen(self) -> TieredStore:
        return TieredStore(self.remote.reopen(), self.tier.reopen(),
                           write_behind_bytes=self.write_behind_bytes,
                           full_check_s=self.full_check_s)

    # -- which copy to serve -----------------------------------------------------------
    def holds_locally(self, identifier: str) -> bool:
        # (a copy served lately is still kept: no stat on a tier hit's path; a copy that
        # another process removed meanwhile is found missing by the load itself)
        if not self._trusted or identifier in self._suspect:  # not servable from the tier
            return False
        tier = self.tier
        return tier.keeps(identifier) or tier.contains(identifier)

    def _read(self, identifier: str, local, remote, *args):
        """``local(identifier, *args)`` from the tier when its copy may be served, else
        ``remote(...)``, written behind into the tier. A tier copy that cannot be read is
        a tier miss: dropped (kept when a newer encache wrote it), the remote serves.
        (Bound methods, no lambda: a tier hit's whole cost is a few calls.)"""
        if self._trusted and identifier not in self._suspect:
            try:
                got = local(identifier, *args)
            except (OSError, StoreError, CorruptEntry) as e:
                log.warning("encache: local tier %s: cannot read %s: %s", self.tier.root,
                            identifier, e)
                if not isinstance(e, NewerFormat):  # (a newer encache's copy is kept)
                    with contextlib.suppress(OSError, StoreError):
                        self.tier.delete(identifier)
                got = None
            if got is not None:
                self.stats["local_reads"] += 1
                got.source = "local"  # (the record and its version are this read's own)
                got[1].tier_copy = True
                return got
        epoch = self._epoch
        got = remote(identifier, *args)
        if got is not None:
            self.stats["remote_reads"] += 1
            self._write_behind(identifier, got[0], epoch)
            got.source = "remote"
            return got
        return None

    def read_entry(self, identifier: str):
        return self._read(identifier, self.tier.read_entry, self.remote.read_entry)

    def read_verified(self, identifier: str, checksum=lambda version: True, into=None):
        return self._read(identifier, self.tier.read_verified, self.remote.read_verified,
                          checksum, into)

    def get(self, identifier: str):
        return self.remote.get(identifier)

    def get_many(self, identifiers: list[str]):
        return self.remote.get_many(identifiers)

    # -- write-behind ----------------------------------------------------------------
    def _write_behind(self, identifier: str, blob, epoch: int) -> None:
        n = memoryview(blob).nbytes
        with self._wb_lock:
            if (self._closed or time.monotonic() < self._wb_off_until
                    or self._wb_pending + n > self.write_behind_bytes):
                self.stats["write_behind_dropped"] += 1
                return
            self._wb_pending += n
        self._queue.put((identifier, blob, epoch, n))

    def _raced(self, identifier: str, epoch: int) -> bool:
        """A sync that started at or after the read dropped this identifier: the bytes
        read may predate the change."""
        return max(self._dropped_at.get(identifier, -1), self._checked_all_at) >= epoch

    def _write_behind_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            identifier, blob, epoch, n = item
            try:
                self._write_local(identifier, blob, epoch)
            finally:
                del blob
                with self._wb_lock:
                    self._wb_pending -= n
                self._queue.task_done()

    def _write_local(self, identifier: str, blob, epoch: int) -> None:
        """Write a remote read's bytes into the tier. When a sync that started at or
        after the read named the identifier (or checked everything), the bytes may
        predate that change: the copy is written all the same but not served until the
        next sync has checked it against the shared store (a suspect)."""
        if time.monotonic() < self._wb_off_until:
            self.stats["write_behind_dropped"] += 1
            return
        held_back = identifier in self._suspect  # (e.g. written before a restart, unchecked)
        self._suspect.add(identifier)  # not served while it is being written
        try:
            self.tier.put(identifier, blob)
        except OSError as e:
            self.stats["write_behind_dropped"] += 1
            if e.errno in _FULL_DISK:
                self._wb_off_until = time.monotonic() + WRITE_BEHIND_RETRY_S
                log.warning("encache: local tier %s is full or unwritable (%s): serving "
                            "remote-only, retrying in %.0f s", self.tier.root,
                            e.strerror or e, WRITE_BEHIND_RETRY_S)
            else:
                log.warning("encache: local tier %s: cannot write %s: %s", self.tier.root,
                            identifier, e)
            return
        except Exception as e:  # noqa: BLE001 - the tier is an optimisation
            self.stats["write_behind_dropped"] += 1
            log.warning("encache: local tier %s: cannot write %s: %s", self.tier.root,
                        identifier, e)
            return
        if held_back or self._raced(identifier, epoch):  # a sync named it since the read
            self._suspect.add(identifier)  # (again: a sync may have checked the old file)
            self.stats["written_unchecked"] += 1
        else:
            self._suspect.discard(identifier)
        self.stats["written_behind"] += 1

    def flush(self, timeout: float = 30.0) -> None:
        """Block until queued write-behinds are on the tier (tests, ``warm``, close)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    # -- keeping copies current ------------------------------------------------------
    def _resume(self) -> None:
        """Pick up the state of an earlier process on this tier: its cursor, and which
        copies were current at its last sync (served through an outage at start)."""
        state = sync_state(self.tier)
        if state is not None and state["remote"] == self._remote_key():
            self._cursor = state["cursor"]  # (the remote's journal checks it)
            synced = state["synced"]
            self._suspect = {i for i, mtime in self._tier_files() if mtime >= synced - SUSPECT_MARGIN_S}
            self._trusted = True
        with contextlib.suppress(Exception):
            self.sync()

    def _remote_key(self) -> str:
        return f"{self.remote.url}#{getattr(self.remote, 'prefix', '')}"

    def _tier_files(self) -> Iterator[tuple[str, float]]:
        for identifier in self.tier.identifiers():
            with contextlib.suppress(OSError):
                yield identifier, os.stat(self.tier.entry_path(identifier)).st_mtime

    def sync(self) -> bool:
        """Drop local copies the shared store changed since the last sync (O(changes)
        through its journal; every copy checked when the journal cannot tell). True when
        the store answered; False in an outage (copies current at the last successful
        sync stay served)."""
        with self._sync_lock:
            self._epoch += 1  # odd while a sync runs: a read meanwhile counts as before it
            epoch = self._epoch
            try:
                return self._sync(epoch)
            finally:
                self._epoch += 1

    def _sync(self, epoch: int) -> bool:
        started = time.time()  # copies written after this are not covered by this sync
        down: dict[str, str] = {}  # parts of the shared store that did not answer
        journal_part = None  # the part holding the change journal, if it did not answer
        try:
            suspects = set(self._suspect)  # added from now on: checked by the next sync
            try:
                cursor, changed = self._journal_since(self._cursor)
            except StoreError as e:
                if e.domain is None:  # (the store as a whole)
                    raise
                # the journal's part is down and the others may answer: check every copy
                # against them, paced (the journal cannot say what changed meanwhile)
                if not self._unjournaled_checks.due():
                    return False
                down[e.domain] = e.reason
                journal_part = e.domain
                cursor, changed = self._cursor, None
            now = time.monotonic()
            full = changed is None or (not self.remote.journal_complete
                                       and now >= self._next_full)
            unchecked: set[str] = set()
            if changed is not None:
                unchecked = self._check_changed(changed, epoch, down)
            if full:
                self._checked_all_at = epoch
                if journal_part is not None:  # (paced; the periodic one stays due)
                    unchecked |= self._unjournaled_checks.run(
                        lambda: self._full_check(epoch, down))
                else:
                    unchecked |= self._full_check(epoch, down)
                    self._next_full = now + self.full_check_s
            elif suspects:
                unchecked |= self._check(sorted(suspects), epoch, down)
            self._suspect -= suspects - unchecked
            self._cursor = cursor
        except Exception as e:  # noqa: BLE001 - the store is down: serve what is local
            self.stats["sync_failures"] += 1
            if not self._outage:
                self._outage = True
                log.warning("encache: cannot sync the local tier %s with %s (%s): "
                            "serving %s local copies until it is back", self.tier.root,
                            self.remote.url, e,
                            "its" if self._trusted else "no (none checked yet)")
            return False
        self._note_parts_down(down, journal_part, asked_all=full)
        if self._outage:
            self._outage = False
            log.warning("encache: %s is back; the local tier %s is in sync",
                        self.remote.url, self.tier.root)
        self._trusted = True
        self._save_state(started)
        self._prune_dropped()
        return True

    def _drop(self, identifiers: Iterable[str], epoch: int) -> None:
        for identifier in identifiers:
            self._dropped_at[identifier] = epoch
            try:
                if self.tier.delete(identifier):
                    self.stats["invalidated"] += 1
            except (OSError, StoreError) as e:
                log.warning("encache: local tier %s: cannot drop %s: %s", self.tier.root,
                            identifier, e)

    def _check_changed(self, changed: set[str], epoch: int, down: dict) -> set[str]:
        """The journal's changes: a local copy is kept if it is the version now stored
        (a copy of an entry written just before it was read), else dropped; a
        write-behind still queued for any of them is discarded (its read may predate
        the change). Returns the copies left unchecked (:meth:`_check`)."""
        held = [i for i in changed if self.tier.contains(i)]
        for identifier in changed:
            self._dropped_at[identifier] = epoch
        return self._check(held, epoch, down)

    def _check(self, identifiers: list[str], epoch: int, down: dict) -> set[str]:
        """Drop those of ``identifiers`` whose local copy is not the remote's version.
        Where the shared store's parts fail apart (``supports_failure_domains``), a
        batch that fails is checked again part by part: copies on a part that does not
        answer are left as they are (served as through an outage) and returned, the
        part named in ``down``; other failures raise."""
        held = []
        for identifier in identifiers:
            info = self.tier.stat(identifier)
            if info is None:
                continue
            if info.meta is None:
                self._drop([identifier], epoch)
                continue
            held.append((identifier, None, info.meta))
        unchecked: set[str] = set()
        for start in range(0, len(held), CHECK_BATCH):
            batch = held[start:start + CHECK_BATCH]
            try:
                current = self.remote.unchanged(batch)
            except StoreError:
                if not self.remote.supports_failure_domains:
                    raise
                failed: dict = {}
                current = self.remote.unchanged_by_part(batch, failed)
                down.update((part, e.reason) for part, e in failed.items())
                if failed and all(ok is None for ok in current):  # no part answers
                    raise list(failed.values())[-1] from None
            self._drop([i for (i, _, _), ok in zip(batch, current)
                        if ok is not None and not ok], epoch)
            unchecked.update(i for (i, _, _), ok in zip(batch, current) if ok is None)
        return unchecked

    def _full_check(self, epoch: int, down: dict) -> set[str]:
        self.stats["full_checks"] += 1
        return self._check(list(self.tier.identifiers()), epoch, down)

    def _note_parts_down(self, down: dict, journal_part: str | None, *,
                         asked_all: bool) -> None:
        """Keep which parts of the shared store do not answer, saying once when one stops
        (its copies are served unchecked, as through an outage) and when it answers
        again; count the syncs that reached only part of the store. A sync that checked
        only some copies may not have asked a part: a part is back once a full check
        (``asked_all``) did not find it down, or, for the journal's part, once the journal
        answered."""
        if asked_all:
            now = dict(down)
        else:
            now = {**self._parts_down, **down}
            if self._journal_down is not None and journal_part is None:
                now.pop(self._journal_down, None)
        self._journal_down = journal_part
        for part in sorted(set(now) - set(self._parts_down)):
            log.warning("encache: part %s of %s does not answer (%s): the local tier %s "
                        "serves its copies of that part unchecked until it is back%s",
                        part, self.remote.url, now[part], self.tier.root,
                        "; it holds the change journal, so meanwhile every copy is checked "
                        "against the other parts" if part == journal_part else "")
        for part in sorted(set(self._parts_down) - set(now)):
            log.warning("encache: part %s of %s answers again; the local tier %s is in sync",
                        part, self.remote.url, self.tier.root)
        if down:
            self.stats["partial_syncs"] += 1
        self._parts_down = now

    def _save_state(self, started: float) -> None:
        """Keep the cursor for a restart: when it moved, else once a minute (copies
        written since the saved time are checked at start, so a late save is safe)."""
        now = time.monotonic()
        if self._saved[0] == self._cursor and now - self._saved[1] < 60.0:
            return
        self._saved = (self._cursor, now)
        with contextlib.suppress(OSError, TypeError, ValueError):
            self.tier.put_note(STATE_NOTE, json.dumps(
                {"remote": self._remote_key(), "cursor": self._cursor, "synced": started}))

    def _prune_dropped(self) -> None:
        """Forget drop marks no queued write-behind can race any more."""
        if len(self._dropped_at) > 10_000 and not self._queue.unfinished_tasks:
            self._dropped_at.clear()

    def local_tier_usage(self) -> tuple[int, int | None]:
        """The tier's bytes (a ``stat`` per copy, re-summed at most every
        ``TIER_USAGE_S`` and within 5 % of the time: other processes on the node write
        into the same tier) and its capacity."""
        if self._tier_bytes is None or self._tier_usage.due():
            self._tier_bytes = self._tier_usage.run(self.tier.used_bytes)
        return self._tier_bytes, self.tier.max_bytes

    def tier_info(self) -> dict:
        """The tier for ``stats``: where, entries, bytes, capacity, and its events."""
        return {"path": str(self.tier.root), "entries": self.tier.count(),
                "bytes": self.tier.used_bytes(), "max_bytes": self.tier.max_bytes,
                "in_sync": self._trusted and not self._outage and not self._parts_down,
                "parts_down": sorted(self._parts_down), **self.stats}

    # -- writes go to the shared store ------------------------------------------------
    def put(self, identifier: str, parts, *, encoded_here: bool = False) -> int:
        n = self.remote.put(identifier, parts, encoded_here=encoded_here)
        self._drop_own(identifier)
        return n

    def delete(self, identifier: str) -> bool:
        existed = self.remote.delete(identifier)
        self._drop_own(identifier)
        return existed

    def delete_many(self, identifiers: Iterable[str], *, per_item: bool = False):
        identifiers = list(identifiers)
        out = self.remote.delete_many(identifiers, per_item=per_item)
        for identifier in identifiers:
            self._drop_own(identifier)
        return out

    def _drop_own(self, identifier: str) -> None:
        self._dropped_at[identifier] = self._epoch
        with contextlib.suppress(OSError, StoreError):
            self.tier.delete(identifier)

    def unchanged(self, entries) -> list[bool]:
        # a local copy's file version means nothing to the remote: compare headers
        return self.remote.unchanged([(i, None if isinstance(v, ServedVersion) and v.tier_copy
                                       else v, m)
                                      for i, v, m in entries])

    def changes_since(self, cursor):
        """The shared store's journal since ``cursor`` (read each call). A consumer asks
        at each index refresh, right before this tier's sync, from the same cursor once
        both caught up: the sync takes that answer instead of reading the journal again
        (:meth:`_journal_since`)."""
        out, changed = self.remote.changes_since(cursor)
        self._journal_memo = (cursor, out, changed, time.monotonic())
        return out, changed

    def _journal_since(self, cursor):
        """For the sync: the answer a caller of :meth:`changes_since` just got from the
        same cursor (at most ``JOURNAL_MEMO_S`` old; taken once), else a fresh read. An
        older answer only means changes after its cursor come at the next sync."""
        memo, self._journal_memo = self._journal_memo, None
        if (memo is not None and cursor is not None and memo[0] == cursor
                and time.monotonic() - memo[3] <= JOURNAL_MEMO_S):
            return memo[1], memo[2]
        return self.remote.changes_since(cursor)

    def maintain(self) -> None:
        self.tier.maintain()
        self.remote.maintain()
        self.sync()

    def info(self) -> StoreInfo:
        info = self.remote.info()
        return StoreInfo(info.url, info.backend, info.max_bytes,
                         {**info.extra, "local_tier": self.tier_info()})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush(timeout=5.0)
        self._queue.put(None)
        self.remote.close()
        self.tier.close()
