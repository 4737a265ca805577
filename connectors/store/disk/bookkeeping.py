"""The disk store's bookkeeping beside its entries: capacity and eviction, removal
records, notes, its settings file, usage counters, the verified log, locks.

Everything lives under ``{root}/.encache/`` (the layout: :mod:`.store`). Part of
:class:`~.store.DiskStore` (a mixin: the methods use its paths and settings).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from ..base import LockBusy, StoreInfo
from ..files import atomic_write_json, read_json_object
from ..keys import from_name
from ..removals import EVICTED, RemovalLog
from ..removals import note_failure as note_removal_failure
from ..verified_log import VerifiedLog, boot_id
from .layout import ENTRY_FILE, META_DIR, LOCAL_FILESYSTEMS

log = logging.getLogger(__name__)


class DiskBookkeeping:
    """A disk store's capacity, removal records, notes, settings, counters and locks."""

    def _eviction_candidates(self) -> list[tuple[float, int, str]]:
        """``(access or write time, size, entry name)`` of every entry (a stat each)."""
        candidates = []
        for d in self._entry_dirs():
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(d.path, ENTRY_FILE))
                key = st.st_atime if self.eviction == "lru" else st.st_mtime
                candidates.append((key, st.st_size, d.name))
        return candidates

    def _make_room(self, incoming: int) -> bool:
        """Reserve ``incoming`` bytes under the capacity, evicting first if needed.

        The usage figure is this process's running total, re-read from disk every 30 s,
        or every 20 × what reading it costs when that is longer (a stat per entry:
        seconds on a million-entry store), so writers in other processes can overshoot by
        what they wrote since."""
        limit = self.max_bytes
        evicted = 0
        with self._lock:
            if self._used is None or self._usage_reads.due():
                self._used = self._usage_reads.run(self.used_bytes)
            if self._used + incoming <= limit:
                self._used += incoming
                return True
            target = max(0, int(limit * self.low_watermark) - incoming)
            # a full walk too: it restarts the clock of the usage re-read
            candidates = sorted(self._usage_reads.run(self._eviction_candidates))
            used = sum(c[1] for c in candidates)
            gone: list[str | None] = []
            for _, size, name in candidates:
                if used <= target:
                    break
                path = self.root / name / ENTRY_FILE
                if self._recent is not None:  # do not hold an evicted file's blocks
                    self._recent.discard(str(path))
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    used -= size
                    evicted += 1
                    gone.append(from_name(name))
                with contextlib.suppress(OSError):
                    os.rmdir(self.root / name)
            self._used = used + incoming
        if evicted:
            self.changed_outside(gone)
            self.add_counters({"evictions": evicted})
            self.record_removals(gone, EVICTED)
        return True

    # -- bookkeeping ---------------------------------------------------------------
    def _removal_log(self) -> RemovalLog:
        return RemovalLog(self._meta(""))

    def record_removals(self, identifiers, reason: str) -> None:
        if self.read_only:
            return
        try:
            self._removal_log().record(identifiers, reason)
        except OSError as e:
            note_removal_failure(self.url, e)

    def removals(self) -> dict[str, str]:
        return self._removal_log().read()

    def forget_removals(self, identifiers) -> None:
        if self.read_only:
            return
        try:
            self._removal_log().forget(identifiers)
        except OSError as e:
            note_removal_failure(self.url, e)

    def removal_counts(self) -> dict[str, int]:
        return self._removal_log().counts()

    # -- bookkeeping ---------------------------------------------------------------
    def maintain(self) -> None:
        """Drop kept buffers (``recent.py``) of entries another process replaced, rewrote,
        purged or evicted since, so their blocks are freed within one refresh period."""
        if self._recent is not None:
            self._recent.sweep()

    def verified_log(self):
        """This boot's log of verified versions (``verified_log.py``); None on a network
        filesystem, a read-only store, or a system without a boot id."""
        boot = boot_id()
        if self.read_only or self.fs_type not in LOCAL_FILESYSTEMS or boot is None:
            return None
        return VerifiedLog(self._meta("verified"), boot)

    def _meta(self, name: str) -> Path:
        return self.root / META_DIR / name

    def put_note(self, name: str, text: str, ttl: float = 600.0) -> str:
        path = self._meta("notes") / name  # ttl: a note file is tiny; its writer removes it
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, text)
        return str(path)

    def get_note(self, name: str) -> str | None:
        """The note's text; None when there is none, or none that can be read (a damaged
        note is as good as none: its writer rewrites it)."""
        try:
            note = json.loads((self._meta("notes") / name).read_bytes())
        except (OSError, ValueError, RecursionError):
            return None
        return note if type(note) is str else None

    def delete_note(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            (self._meta("notes") / name).unlink()

    def _read_config(self) -> dict:
        """``config.json``: the store's capacity (``max_bytes``), a positive integer. A
        file that does not say one (damaged, or a value that is not a positive integer)
        sets none: a store without a limit evicts nothing, where a bad limit read as
        tiny would evict every entry."""
        config = read_json_object(self._meta("config.json"))
        limit = config.get("max_bytes")
        if limit is not None and not (type(limit) is int and limit > 0):
            log.warning("encache: %s holds max_bytes %.40r, not a positive integer: the "
                        "store has no capacity limit until one is set again",
                        self._meta("config.json"), limit)
            config.pop("max_bytes")
        return config

    def _write_config(self) -> None:
        atomic_write_json(self._meta("config.json"), self._config)

    @contextlib.contextmanager
    def _counters_locked(self, shared: bool = False):
        # (never parents: bookkeeping must not make a removed store's directory again,
        # empty, where a consumer would then miss everything without a word)
        self._meta("").mkdir(exist_ok=True)
        with open(self._meta("counters.lock"), "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lk, fcntl.LOCK_UN)

    def live_counters(self):
        """This process's in-place counter file (:mod:`encache.connectors.counters`):
        counts written there survive SIGKILL. Folds dead processes' files first."""
        from .. import counters

        with self._counters_locked():
            counters.compact(self._meta(""), atomic_write_json)
        return counters.live_counters(self._meta(""))

    def add_counters(self, deltas: dict[str, float]) -> None:
        deltas = {k: v for k, v in deltas.items() if v}
        if not deltas:
            return
        with self._counters_locked():
            from ..counters import read_json

            counters = read_json(self._meta("counters.json"))
            for k, v in deltas.items():
                counters[k] = counters.get(k, 0) + v
            counters["updated"] = time.time()
            atomic_write_json(self._meta("counters.json"), counters)

    def read_counters(self) -> dict[str, float]:
        """Folded totals + every running process's counter file. Folds the files of
        processes that are gone (when the store is writable), so the directory does not
        grow; a read-only store is read as it is."""
        from .. import counters

        meta = self._meta("")
        if not meta.is_dir():  # nothing has counted here: no bookkeeping to make for a read
            return counters.read_totals(meta)
        try:
            with self._counters_locked():
                counters.compact(meta, atomic_write_json)
                return counters.read_totals(meta)
        except OSError:  # read-only or foreign store: no lock, no compaction
            return counters.read_totals(meta)

    def reset_counters(self) -> None:
        from .. import counters

        with self._counters_locked():
            counters.reset(self._meta(""), atomic_write_json)

    def info(self) -> StoreInfo:
        extra = {"filesystem": self.fs_type,
                 # how a consumer with the default load_mode reads entries here
                 "serving_loads": (f"mmap (entries of {self.map_min_bytes >> 10} KiB+)"
                                   if self.mapped_loads else "read")}
        with contextlib.suppress(OSError):
            extra["filesystem_free_bytes"] = shutil.disk_usage(self.root).free
        return StoreInfo(url=self.url, backend=self.backend, max_bytes=self.max_bytes, extra=extra)

    @contextlib.contextmanager
    def lock(self, name: str, wait: float = 0.0):
        self._meta("").mkdir(parents=True, exist_ok=True)
        path = self._meta(f"{name}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + max(0.0, wait)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    if time.monotonic() >= deadline:
                        holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                        raise LockBusy(f"store {self.url} is locked by another {name} "
                                       f"({holder or 'unknown holder'})") from None
                    time.sleep(0.1)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
            yield
        finally:
            os.close(fd)  # closing releases the flock (also on crash)
