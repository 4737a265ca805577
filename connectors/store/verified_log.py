"""VerifiedLog: the entry versions this host checksummed since it booted, kept on disk.

Why: a consumer verifies each stored version once (``lookup/verified.py``), but kept that
knowledge only in memory. vLLM stops its engine with SIGKILL, so every restart forgot it,
and an entry outside the start-up pass's budget paid the checksum on the request path at
its first load after the restart: a second full pass over its bytes before the engine's
copy, about half the speed of a plain ``readinto`` (benchmarks/load.json). A checksum is
evidence about a file's bytes, not about the process that computed it, so a restarted
consumer can take over its predecessor's evidence. A producer's bytes are evidence too
(the codec made them and their checksum in that process): a producer records each entry
it encodes, once all its bytes are in its temp file (a reader may take them in flight)
and at its commit; a running consumer reads what others append (:meth:`VerifiedLog.read_new`),
so in encoder disaggregation on one host the prefill instance does not hash what its
encoder just wrote.

Why this is safe: a record names an identifier, the file version that passed,
``(device, inode, size, mtime_ns)`` (``files.file_version``), and the inode's change time
(ctime). encache never changes an entry file in place (writers rename a new file over
it), and anything else that writes, truncates or even ``touch``es the file moves its
ctime, which user space cannot set back (mtime it can): the record then no longer
applies and the entry is hashed again. The store's own access-time refresh (the LRU
clock) moves ctime too, so the consumer that refreshed it records the new ctime of the
version it trusts (``files.ServedVersion``). The records are scoped to one boot of the
kernel (``/proc/sys/kernel/random/boot_id`` names the log): after a crash a file's
unflushed blocks may read back differently, so a reboot starts from nothing. Only local
filesystems keep a log (on a network filesystem another host's clock and page cache are
not this host's). Like verifying once per process, this does not catch a disk that
returns different bytes for an unchanged file (``encache verify`` does).

Format: ``<store>/.encache/verified/<boot id>``, a flat array of 16-byte records,
``(xxh3_64(identifier, version), ctime_ns)`` little-endian, appended with ``O_APPEND`` (one
``write``: atomic between processes on a local filesystem); for a key the last record
wins (an access-time refresh appends the new ctime of the same version; a commit's rename
the committed file's). Readers load it into sorted arrays (1M versions = 16 MB, tens of
ms), then read only what is appended (whole records). Logs of earlier boots are removed
when a log is opened; one holding more than ``MAX_VERSIONS`` versions is started afresh
(those entries are verified once more), and one mostly made of superseded records is
compacted.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import numpy as np
import xxhash

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
MAX_VERSIONS = 4 << 20  # distinct (identifier, version) pairs: more than a store holds
RECORD = np.dtype([("key", "<u8"), ("ctime", "<i8")])


def boot_id() -> str | None:
    """This boot's id (Linux), or None where there is none to scope a log to."""
    try:
        with open(BOOT_ID_PATH, encoding="ascii") as f:
            value = f.read().strip()
    except OSError:
        return None
    return value if value and all(c in "0123456789abcdef-" for c in value) else None


def record_key(identifier: str, version) -> int:
    """The 64-bit key of ``identifier`` stored as ``version``."""
    text = f"{identifier}\0{tuple(version)!r}"
    return xxhash.xxh3_64_intdigest(text.encode("utf-8", "surrogatepass"))


class VerifiedTable:
    """What a log held when read: per key, the ctime of its last record."""

    def __init__(self, keys: np.ndarray | None = None, ctimes: np.ndarray | None = None):
        self.keys = np.empty(0, np.uint64) if keys is None else keys
        self.ctimes = np.empty(0, np.int64) if ctimes is None else ctimes

    def __len__(self) -> int:
        return len(self.keys)

    def holds(self, key: int, ctime_ns: int) -> bool:
        """A record of ``key`` whose inode has not changed since (same ctime)."""
        keys = self.keys
        if not len(keys):
            return False
        i = int(np.searchsorted(keys, np.uint64(key)))
        return i < len(keys) and int(keys[i]) == key and int(self.ctimes[i]) == ctime_ns

    def merged(self, keys: np.ndarray, ctimes: np.ndarray) -> VerifiedTable:
        """This table with newer records (``keys``/``ctimes`` in log order) folded in: for
        a key, the last record wins."""
        all_keys = np.concatenate([self.keys, keys.astype(np.uint64)])[::-1]
        all_ctimes = np.concatenate([self.ctimes, ctimes.astype(np.int64)])[::-1]
        out, first = np.unique(all_keys, return_index=True)
        return VerifiedTable(out.astype(np.uint64), all_ctimes[first].astype(np.int64))


class VerifiedLog:
    def __init__(self, directory: str | os.PathLike, boot: str):
        self.directory = Path(directory)
        self.path = self.directory / boot
        self._fd: int | None = None
        self._lock = threading.Lock()
        #: (inode, bytes read) of the log :meth:`load` and :meth:`read_new` have read
        self._read: tuple[int | None, int] = (None, 0)

    def load(self) -> VerifiedTable:
        """The versions recorded this boot (removes earlier boots' logs, compacts or
        restarts an oversized log)."""
        with contextlib.suppress(OSError):
            for old in os.scandir(self.directory):
                if old.name != self.path.name and not old.name.startswith("."):
                    with contextlib.suppress(OSError):
                        os.unlink(old.path)
        try:
            with open(self.path, "rb") as f:
                data = f.read()
                self._read = (os.fstat(f.fileno()).st_ino, len(data) - len(data) % RECORD.itemsize)
        except OSError:
            self._read = (None, 0)  # none yet: the first one created is read from its start
            return VerifiedTable()
        n = len(data) // RECORD.itemsize  # a tail shorter than a record (a full disk): ignored
        records = np.frombuffer(data, RECORD, count=n)
        table = VerifiedTable().merged(records["key"], records["ctime"])
        if len(table) > MAX_VERSIONS:
            self._replace(b"")
            return VerifiedTable()
        if n > 2 * len(table) + 1024:  # mostly superseded records: keep the last of each
            out = np.empty(len(table), RECORD)
            out["key"], out["ctime"] = table.keys, table.ctimes
            self._replace(out.tobytes())
        return table

    def read_new(self) -> tuple[np.ndarray, np.ndarray] | None:
        """``(keys, ctimes)`` of the records appended since :meth:`load` or the last call,
        in log order: what other processes verified or encoded while this one runs (EPD: an
        encoder on this host records each entry it commits, so the prefill instance's first
        load of it need not hash it again). One ``stat`` when nothing is new. None when the
        log was replaced since (compacted or restarted by a process that loaded it): the
        caller loads it again (:meth:`load`)."""
        inode, done = self._read
        try:
            st = os.stat(self.path)
        except OSError:
            return _NOTHING
        if inode is None and done == 0:
            inode = st.st_ino  # created after load(): read from its start
        if st.st_ino != inode:
            return None
        end = st.st_size - st.st_size % RECORD.itemsize
        if end <= done:
            return _NOTHING
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return _NOTHING
        try:
            if os.fstat(fd).st_ino != inode:
                return None
            data = os.pread(fd, end - done, done)
        except OSError:
            return _NOTHING
        finally:
            os.close(fd)
        n = len(data) // RECORD.itemsize
        self._read = (inode, done + n * RECORD.itemsize)
        records = np.frombuffer(data, RECORD, count=n)
        return records["key"].astype(np.uint64), records["ctime"].astype(np.int64)

    def _replace(self, data: bytes) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with contextlib.suppress(OSError):
            tmp.write_bytes(data)
            os.replace(tmp, self.path)  # appenders holding the old file lose records: a re-verify
            self._read = (_inode(self.path), len(data))  # what load() just read
        with contextlib.suppress(OSError):
            tmp.unlink()

    def append(self, key: int, ctime_ns: int) -> None:
        """Record one verified version as of ``ctime_ns`` (best effort: a failed write
        is a re-verify). Follows a log another process replaced meanwhile."""
        record = int(key).to_bytes(8, "little") + int(ctime_ns).to_bytes(8, "little", signed=True)
        with self._lock:
            try:
                os.write(self._open_locked(), record)
            except OSError:
                pass

    def open(self) -> None:
        """Have the log open for appending (created if need be) now, not at the first
        record: a producer does this before its write is in flight, so a reader that
        watches the log's directory (``DiskStore.in_flight_wait``) wakes at its record,
        not at the file's creation a moment before it (best effort)."""
        with self._lock, contextlib.suppress(OSError):
            self._open_locked()

    def _open_locked(self) -> int:
        if self._fd is not None and os.fstat(self._fd).st_ino != _inode(self.path):
            self._close()
        if self._fd is None:
            self.directory.parent.mkdir(exist_ok=True)  # (.encache, never the store itself)
            self.directory.mkdir(exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT
                               | os.O_CLOEXEC, 0o644)
        return self._fd

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


_NOTHING = (np.empty(0, np.uint64), np.empty(0, np.int64))


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None
