"""DiskStore: the embedded default — one safetensors file per entry, no server.

Layout (compatible with vLLM's ``ECExampleConnector`` both ways)::

    {root}/{name}/encoder_cache.safetensors   one entry; name = keys.to_name(identifier)
    {root}/.encache/config.json               store settings (capacity)
    {root}/.encache/counters.json             folded counter totals (flock-guarded)
    {root}/.encache/counters/*.cnt            one in-place counter file per running process
    {root}/.encache/header-index.pickle       parsed headers by file version (scan cache)
    {root}/.encache/summary.pickle            the summary under a generation (O(1) stats)
    {root}/.encache/accessed                  its mtime: the newest access (O(1) stats)
    {root}/.encache/*.lock                    exclusive locks (precompute)
    {root}/.encache/notes/NAME                notes (``put_note``: e.g. a Ray job's marker)
    {root}/.encache/journal/*.log             the change journal (:mod:`.disk_journal`)
    {root}/.encache/removals.log              entries a policy removed (:mod:`.removals`)

Crash safety: an entry is written to a temp file in its own directory, fsync'ed and
renamed over ``encoder_cache.safetensors`` — the rename is the commit point, so a reader
(or a writer killed with SIGKILL) never leaves a visible partial entry; stray
``.tmp-*`` files are invisible to readers and removed by ``encache verify --repair``.
A directory without the entry file (``ECExampleConnector.has_cache_item`` creates
those) is not an entry. A file that vanishes between lookup and read is a miss.

Capacity: with ``max_bytes`` set, a write that would exceed it first evicts entries by
policy (``lru``: oldest recorded access; ``fifo``: oldest creation) down to a low
watermark, so eviction cost is amortised over many writes. Access times are the file
atimes, which :meth:`DiskStore.get` refreshes (at most once per ``access_resolution_s``,
default a minute, per entry). That refresh keeps the file's mtime to the nanosecond (only
writers set it), so the version a reader verified — (device, inode, size, mtime_ns) — is
not changed by access tracking (it changes ctime, which the version leaves out).

Why one module of ~640 lines: writes, reads, eviction and the bookkeeping files share one
on-disk layout and its crash-safety rules, and read best together. What stands alone is
next door: header parsing (:mod:`.entry`), the scan cache (:mod:`.header_index`), reused
buffers of recently served versions (:mod:`.recent`), atomic files (:mod:`.files`),
per-process counters (:mod:`encache.connectors.counters`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from functools import partial
from pathlib import Path
from stat import S_ISREG

from . import header_index
from .. import read_ahead
from ..base import EntryInfo, LockBusy, Store, StoreError, StoreInfo, info_from_blob_header
from ..removals import EVICTED, RemovalLog
from ..removals import note_failure as note_removal_failure
from .journal import DiskJournal
from ..entry import (FILE_CHUNK, CorruptEntry, EntryMeta, byte_views, header_length,
                    parse_header, read_verified, validate_blob)
from ..files import (PREALLOCATE_FILESYSTEMS, READ_FLAGS, TEMP_PREFIX, NotAFile, ServedVersion,
                    atomic_write_json, file_version, filesystem_type, fsync_dir,
                    open_untracked, preallocate, read_json_object, uninitialized)
from .inotify import (IN_CLOSE_WRITE, IN_CREATE, IN_DELETE, IN_MODIFY, IN_MOVED_FROM,
                      IN_MOVED_TO, DirectoryWatch)
from ..keys import from_name, is_entry_name, name_for, to_name
from .recent import RecentBuffers
from ..throttle import ScanThrottle
from ..verified_log import VerifiedLog, boot_id, record_key

log = logging.getLogger(__name__)

ENTRY_FILE = "encoder_cache.safetensors"
META_DIR = ".encache"
GENERATION_MAX = 64 * 1024  # .encache/generation restarts from empty past this size
ACCESSED_FILE = "accessed"  # its mtime: the store's newest access time (_stamp_access)
ACCESS_RESOLUTION_S = 60.0
EVICTION_POLICIES = ("lru", "fifo")
LOAD_MODES = ("auto", "mmap", "read")
#: threads a checksummed read of one entry uses by default (read_ahead.py; 1 or 2)
READ_THREADS = 2
# Below this a read() into a fresh buffer beats mapping when nothing is kept: setting up
# and tearing down a mapping and faulting its pages in costs more than the copy for small
# entries (benchmarks/load.json, rows encache.repeat.noreuse and encache.repeat.mmap at
# 0.25 MB; level at 2.75 MB; mapping ahead at 10 MB; each with the engine's copy).
MMAP_MIN_BYTES = 1 << 20
# ... unless the store keeps the buffers it serves (recent.py, the default): a kept read
# buffer is fresh anonymous memory each first load (a page fault per 4 KiB, never reused),
# so mapping wins from 64 KiB (first loads with the copy at 0.25 MB measured several times
# faster mapped than read; level at 16 KiB; repeat loads level), and the kept memory is
# page cache, not the process's own
MMAP_MIN_BYTES_KEPT = 64 << 10
# A put reserves its file's blocks first (files.preallocate) from this size: the call
# costs ~20 us, no gain on a 256 KiB write here, far less than it saves from 2.75 MB
# (benchmarks/write.json, performance.md section 11)
PREALLOCATE_MIN_BYTES = 1 << 20
# Filesystems where a mapped file cannot vanish under a reader: a renamed-over or
# unlinked entry stays readable while mapped. Network filesystems (NFS, SMB, FUSE…) give
# no such promise (another client's delete can turn a page fault into SIGBUS), so
# ``load_mode: auto`` reads there instead.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs",
                               "overlay", "zfs", "f2fs", "bcachefs", "jfs", "reiserfs"})
_HEAD_READ = 4096
# A temp file older than this is not waited for even while its writer lives (a stuck
# write); one whose writer is gone is never in flight (``writer_alive``)
IN_FLIGHT_S = 10.0
# A reader waiting for an in-flight write wakes on its writer's steps (in_flight_wait);
# it looks again after this long even when none came (a writer that keeps no log)
IN_FLIGHT_WATCHED_S = 0.005


def writer_alive(path: str) -> bool:
    """Whether the process writing the temp file ``path`` still holds it open. A writer
    takes an exclusive ``flock`` on its temp file before anyone can be told of it and
    keeps it to its commit; the kernel drops it when the writer's file is closed,
    however the process ends (SIGKILL included). So a temp file nobody holds is a dead
    writer's leftover: not waited for, and a stray for ``encache verify --repair`` at
    once. False as well when the file is gone (committed or removed meanwhile)."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    else:
        return False  # (closing the descriptor releases the probe's shared lock)
    finally:
        os.close(fd)


def _indexed(rec, version: tuple) -> bool:
    """Whether the header index's record ``rec`` holds the header of this ``version`` of
    the file (a damaged index's record never does: the header is read again)."""
    return type(rec) is tuple and len(rec) == 2 and rec[0] == version and _well_formed(rec)


def _well_formed(rec) -> bool:
    """A header index record as the index writes it: ``(version, EntryInfo)``."""
    if type(rec) is not tuple or len(rec) != 2 or type(rec[0]) is not tuple:
        return False
    info = rec[1]
    return (type(info) is EntryInfo and type(info.size) is int
            and (info.meta is None or type(info.meta) is EntryMeta))


class DiskStore(Store):
    backend = "disk"
    local = True
    #: the class of the versions the serving path hands out (a local tier's store serves
    #: ``tiered.LocalVersion``: the tier tells its copies from the shared store's by it)
    version_type: type[ServedVersion] = ServedVersion
    supports_entry_path = True
    supports_used_bytes = True
    supports_live_counters = True
    supports_removal_records = True
    supports_verified_log = True
    supports_verified_reads = True
    supports_index_version = True
    supports_change_journal = True
    journal_complete = False  # records follow the commit; foreign writers are not journaled

    def __init__(self, root: str | os.PathLike, *, max_bytes: int | None = None,
                 create: bool = True, fsync: bool = True, eviction: str = "lru",
                 low_watermark: float = 0.9, load_mode: str = "auto",
                 access_resolution_s: float = ACCESS_RESOLUTION_S, reuse_buffers: bool = True,
                 preallocate: bool = True, read_threads: int = READ_THREADS):
        self.root = Path(os.path.abspath(os.path.expanduser(os.fspath(root))))
        #: the store's directory cannot be written (a read-only mount, a store synced
        #: without its .encache/): serving reads and read-only commands still work
        self.read_only = False
        if create:
            try:
                (self.root / META_DIR).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not self.root.is_dir():
                    raise StoreError(f"cannot create store at {self.root}: {e.strerror}") from None
                self.read_only = True
            else:
                self.read_only = not os.access(self.root / META_DIR, os.W_OK)
        elif not self.root.is_dir():
            raise StoreError(f"no store at {self.root} (directory not found)")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {EVICTION_POLICIES}")
        if load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}")
        if read_threads not in (1, 2):
            raise ValueError("read_threads must be 1 or 2")
        self.fsync = fsync
        #: threads a checksummed read of one entry may use (2: a helper reads part of an
        #: entry of 1 MiB or more while the load hashes, read_ahead.py; 1: the load alone)
        self.read_threads = read_threads
        self.access_resolution_s = float(access_resolution_s)
        self.load_mode = load_mode
        self.fs_type = filesystem_type(self.root)
        # serving loads map entry files (no copy) where that is safe; see read_entry.
        # "mmap" maps every entry, "auto" those of map_min_bytes+ on a local filesystem.
        self.mapped_loads = load_mode == "mmap" or (load_mode == "auto"
                                                    and self.fs_type in LOCAL_FILESYSTEMS)
        # in-flight writes (a temp file in the entry's directory) are seen by every reader
        # at once on a local filesystem; over a network filesystem a reader's cached
        # lookups could hide the commit that follows, so a write lands at its commit there
        self.supports_in_flight = self.fs_type in LOCAL_FILESYSTEMS
        #: puts reserve their blocks before writing (files.preallocate): faster writes,
        #: and a full disk fails a put before its entry is in flight
        self.preallocates = preallocate and self.fs_type in PREALLOCATE_FILESYSTEMS
        self._root_str = str(self.root)
        self._generation_path = os.path.join(self._root_str, META_DIR, "generation")
        self._journal = DiskJournal(os.path.join(self._root_str, META_DIR),
                                    read_only=self.read_only)
        # buffers of recently served versions (recent.py): mapped-load stores only, i.e.
        # local filesystems, where a stat sees a writer's rename at once
        self._recent = RecentBuffers() if self.mapped_loads and reuse_buffers else None
        #: entries of at least this many bytes are mapped (with ``mapped_loads``)
        self.map_min_bytes = 1 if load_mode == "mmap" else (
            MMAP_MIN_BYTES_KEPT if self._recent is not None else MMAP_MIN_BYTES)
        self.eviction = eviction
        self.low_watermark = low_watermark
        self._config = self._read_config()
        if max_bytes is not None and max_bytes != self._config.get("max_bytes"):
            before = self._config.get("max_bytes")
            self._config["max_bytes"] = int(max_bytes) if max_bytes > 0 else None
            if not self.read_only:
                self._write_config()
                if before is not None:
                    # the capacity is the store's, shared by every writer: one opener
                    # configured apart from the others changes it for all of them
                    log.warning("encache: %s's capacity (max_bytes) changed from %s bytes "
                                "to %s: it holds for every writer of the store", self.root,
                                f"{before:,}", f"{self.max_bytes:,} bytes" if self.max_bytes
                                else "no limit")
        self._lock = threading.Lock()
        self._written_log = None  # the verified log puts of encoded_here bytes go to
        self._used: int | None = None
        # _make_room re-reads the usage every 30 s, or at most ~5 % of a writer's time
        self._usage_reads = ScanThrottle(0.05, min_interval=30.0)
        self._access_stamped = 0  # ns: when _stamp_access last moved .encache/accessed

    # -- paths -----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return str(self.root)

    @property
    def max_bytes(self) -> int | None:
        return self._config.get("max_bytes")

    def reopen(self) -> DiskStore:
        return DiskStore(self.root, create=False, fsync=self.fsync, eviction=self.eviction,
                         low_watermark=self.low_watermark, load_mode=self.load_mode,
                         access_resolution_s=self.access_resolution_s,
                         reuse_buffers=self._recent is not None or not self.mapped_loads,
                         preallocate=self.preallocates, read_threads=self.read_threads)

    def file_store(self, version) -> DiskStore | None:
        return self if self.local else None

    def entry_path(self, identifier: str) -> Path:
        return self.root / to_name(identifier) / ENTRY_FILE

    def _entry_file(self, identifier: str) -> str:
        """:meth:`entry_path` as a string, built without a ``Path`` (the serving path: a
        ``Path`` costs more than the ``stat`` it is for; names never hold "/")."""
        return f"{self._root_str}/{name_for(identifier)}/{ENTRY_FILE}"

    # -- entries ---------------------------------------------------------------------
    def get(self, identifier: str):
        """The entry's bytes in a fresh writable buffer (a uint8 numpy array), or None."""
        got = self._open_entry(identifier, mapped=False)
        return None if got is None else got[0]

    def read_entry(self, identifier: str):
        """``(buffer, version)`` for the serving path, or None if the entry is absent.

        With ``mapped_loads`` an entry of at least ``map_min_bytes`` is memory-mapped
        copy-on-write instead of read: the tensor then *is* the page cache (no copy, like
        safetensors' own loader), and writes to it stay private. This is safe because
        encache never changes an entry file in place — writers rename a new file over it
        and deletes unlink it, and a mapping keeps the old inode readable — so a reader
        can never see a file shrink under its mapping. (A *foreign* program truncating an
        entry file in place could; use ``load_mode: read`` if anything does that.)
        ``version`` = (device, inode, size, mtime_ns): a replacement is a new inode and an
        in-place write sets mtime, so a reader that verified one version need not re-hash
        it. Access tracking (the atime refresh below) keeps mtime_ns exactly and only
        changes ctime, which is deliberately not part of the version — otherwise every
        entry would be re-hashed after each access-time update.
        """
        return self._open_entry(identifier, mapped=self.mapped_loads)

    def read_verified(self, identifier: str, checksum=lambda version: True, into=None):
        """An entry validated on the way in. Where :meth:`read_entry` would *read* it (not
        mapped: ``load_mode: read``, a network filesystem, an entry under
        ``map_min_bytes``), it is read into a private, uninitialised buffer and checked in
        the same pass (:func:`.entry.read_verified`: each chunk hashed while still in the
        CPU cache), where reading it and then hashing the buffer takes two passes. A
        mapped entry is mapped as :meth:`read_entry` does and hashed over the mapping,
        which faults its pages in: one pass too, and the staged bytes stay the page cache.
        Either is done on two threads from ``read_ahead.MIN_BYTES`` (``read_threads``).
        Reading a mapped-size entry into a private buffer instead measured slower on this
        machine: the engine keeps the tensor, so every load's buffer is fresh anonymous
        memory, and its zero-fill page faults cost more than the hash saves (performance.md
        section 1, rows ``readinto.fresh`` and ``onepass.fresh``). Where ``into.stages``
        (its buffers are a device copy's reused staging: the bytes are copied there
        anyway), every entry is read into one instead, hashed in that same single pass
        when it must be: a version that needs no hash (one a producer on this host
        vouched for, EPD on one host) is one read into staging, where a mapping would
        fault its pages in and the device copy's staging take a second copy.
        ``checksum(version)`` is asked once the file is open;
        a version that needs no checksum gets header and size checks only. ``into``: the
        buffer an entry that is read is read into (:meth:`Store.read_verified`)."""
        path = self._entry_file(identifier)
        try:
            fd = os.open(path, READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            st = os.fstat(fd)
            if not S_ISREG(st.st_mode):  # (no entry: see files.READ_FLAGS)
                return None
            version = self.version_type.of(st)
            hashing = checksum(version)
            if not getattr(into, "stages", False) and (
                    not hashing or (self.mapped_loads and st.st_size >= self.map_min_bytes)):
                # mapped (or kept) and validated over the mapping, from this open file
                got = self._serve_open(fd, st, path, version, self.mapped_loads)
                if got is None:
                    return None
                buf, version = got
                meta, offset = validate_blob(buf, identifier=identifier, verify=hashing,
                                             ahead=self._ahead(-1, st.st_size))
                return buf, version, meta, offset, hashing
            buf = uninitialized(st.st_size) if into is None else into(st.st_size)
            meta, offset = read_verified(lambda view: os.readv(fd, [view]), st.st_size, buf,
                                         chunk=FILE_CHUNK, identifier=identifier,
                                         verify=hashing,
                                         ahead=self._ahead(fd, st.st_size))
            version = self._touch(fd, st, version, time.time_ns())
            return buf, version, meta, offset, hashing
        finally:
            os.close(fd)

    def _ahead(self, fd: int, size: int):
        """How a load of the open entry ``fd`` starts its read-ahead job
        (:func:`.entry.read_verified`'s ``ahead``: a read, hashed or not; ``fd`` -1: a job
        that hashes the back of a mapping, :func:`.entry.validate_blob`'s), or None: one
        thread (``read_threads`` 1, an entry under ``read_ahead.MIN_BYTES``). A read that
        does not hash is split too: on this machine one thread's copy from the page cache
        is slower than two (performance.md section 1)."""
        if self.read_threads > 1 and size >= read_ahead.MIN_BYTES:
            return partial(read_ahead.start, fd)
        return None

    def _touch(self, fd: int, st: os.stat_result, version, now: int):
        """Refresh the entry's access time (the LRU clock) when it is older than
        ``access_resolution_s``; the version as served (mtime_ns is kept exactly, so it
        stays the same version; the moved ctime is recorded for the verified log)."""
        if now - st.st_atime_ns > self.access_resolution_s * 1e9:
            with contextlib.suppress(OSError):
                os.utime(fd, ns=(now, st.st_mtime_ns))
                version = self.version_type.of(st, os.fstat(fd))
            self._stamp_access(now)
        return version

    def _stamp_access(self, now: int) -> None:
        """Move ``.encache/accessed``'s mtime to the newest access time given (at most
        once a second per process): the store's last access without a ``stat`` of
        every entry (``summary_if_unchanged`` in O(1))."""
        if now - self._access_stamped < 1e9 or self.read_only:
            return
        self._access_stamped = now
        path = os.path.join(self._root_str, META_DIR, ACCESSED_FILE)
        try:
            os.utime(path, ns=(now, now))
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
                os.utime(path, ns=(now, now))
        except OSError:
            pass

    def unchanged(self, entries) -> list[bool]:
        """One ``stat`` per entry: its file version is the one held (``version``, as
        :meth:`read_entry` returned it); a header read where none was recorded."""
        out = []
        for identifier, version, meta in entries:
            if version is None:
                out.extend(Store.unchanged(self, [(identifier, version, meta)]))
                continue
            path = self._entry_file(identifier)
            try:
                out.append(file_version(os.stat(path)) == tuple(version))
            except (FileNotFoundError, NotADirectoryError):
                out.append(False)
        return out

    def _open_entry(self, identifier: str, mapped: bool):
        path = self._entry_file(identifier)
        recent = self._recent if mapped else None
        if recent is not None and len(recent):
            # a version served recently: one stat, no open / map / read (recent.py)
            try:
                st = os.stat(path)
            except (FileNotFoundError, NotADirectoryError):
                recent.discard(path)
                return None
            version = self.version_type.of(st)
            buf, touched = recent.get(path, version)
            if (buf is not None and time.time_ns() - max(st.st_atime_ns, touched)
                    <= self.access_resolution_s * 1e9):
                return buf, version
        try:
            fd = os.open(path, READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            if recent is not None:
                recent.discard(path)
            return None
        try:
            st = os.fstat(fd)
            if not S_ISREG(st.st_mode):  # (no entry: see files.READ_FLAGS)
                return None
            return self._serve_open(fd, st, path, self.version_type.of(st), mapped)
        finally:
            os.close(fd)

    def _serve_open(self, fd: int, st: os.stat_result, path: str, version, mapped: bool):
        """``(buffer, version)`` of the open entry file ``fd`` (``st``, ``version``: its
        ``fstat``): the buffer kept for this version, else a new mapping (``mapped``, from
        ``map_min_bytes``) or a read into a fresh buffer; the access time refreshed when
        due, the buffer kept (recent.py). None if the file shrank under the read."""
        recent = self._recent if mapped else None
        size = st.st_size
        buf = recent.get(path, version)[0] if recent is not None else None
        if buf is None:  # (else only the access time was due: refreshed below)
            if mapped and size >= self.map_min_bytes:
                buf = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            else:
                buf = uninitialized(size)
                view, got = memoryview(buf), 0
                while got < size:
                    n = os.readv(fd, [view[got:]])
                    if n == 0:  # shrank under us: impossible for renamed-in files; a miss
                        return None
                    got += n
        now = time.time_ns()
        version = self._touch(fd, st, version, now)
        if recent is not None:
            recent.put(path, version, buf, now)
        return buf, version

    def put(self, identifier: str, parts: bytes | Iterable, *, encoded_here: bool = False,
            on_visible=None, on_written=None) -> int:
        """``on_visible`` (``supports_in_flight``): called once the temp file exists,
        before any byte is in it; :meth:`in_flight` is True from then until the commit
        (a reader waits for the bytes). ``on_written``: called once the bytes are in the
        temp file, before the commit (its fsync when ``fsync`` is on, and the rename). It
        may block: the commit follows its return (a writer holds it while the engine
        answers the request)."""
        parts = byte_views(parts)
        total = sum(p.nbytes for p in parts)
        directory = self.root / to_name(identifier)
        reserved = self._make_room(total) if self.max_bytes else False
        if encoded_here and on_visible is not None and self.supports_in_flight:
            self._encoded_log()  # open before readers watch it (in_flight_wait)
        for attempt in range(3):  # a concurrent delete may rmdir the directory under us
            try:
                directory.mkdir(exist_ok=True)
                fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
                with contextlib.suppress(OSError):  # held to the commit: writer_alive
                    fcntl.flock(fd, fcntl.LOCK_EX)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
                self.root.mkdir(parents=True, exist_ok=True)
        written = None
        try:
            with os.fdopen(fd, "wb") as f:
                if self.preallocates and total >= PREALLOCATE_MIN_BYTES:
                    self.preallocates = preallocate(f.fileno(), total)  # False: not here
                if on_visible is not None and self.supports_in_flight:
                    on_visible()  # in flight: readers wait for the bytes
                for p in parts:
                    f.write(p)
                f.flush()
                if on_written is not None and self.supports_in_flight:
                    if encoded_here:  # whole and never changed again: vouch for it now
                        with contextlib.suppress(OSError):
                            whole = os.fstat(f.fileno())
                            self._note_encoded(identifier, ServedVersion.of(whole))
                    on_written()  # in flight: readers may take these bytes now
                if self.fsync:
                    os.fsync(f.fileno())
                os.replace(tmp, directory / ENTRY_FILE)  # the commit point
                if encoded_here:  # after the rename, which moves ctime
                    with contextlib.suppress(OSError):
                        written = os.fstat(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            with contextlib.suppress(OSError):
                os.rmdir(directory)  # only if empty: leave no trace of a failed put
            if reserved:
                with self._lock:
                    self._used -= total
            raise
        if self.fsync:
            fsync_dir(directory)
        self._changed((identifier,))
        if written is not None:
            self._note_encoded(identifier, ServedVersion.of(written))
        return total

    def _note_encoded(self, identifier: str, version: ServedVersion) -> None:
        """Record a version this process encoded (its bytes are the codec's own) in the
        verified log, so this host's consumers do not hash it again this boot."""
        log = self._encoded_log()
        if log is not None:
            log.append(record_key(identifier, version), version.ctime_ns)

    def _encoded_log(self):
        """The verified log this process's encoded puts go to (opened once); None if the
        store keeps none."""
        if self._written_log is None:
            self._written_log = self.verified_log() or False
            if self._written_log:
                self._written_log.open()
        return self._written_log or None

    def delete(self, identifier: str) -> bool:
        directory = self.root / to_name(identifier)
        if self._recent is not None:
            self._recent.discard(self._entry_file(identifier))
        try:
            os.unlink(directory / ENTRY_FILE)  # atomic: readers see all or nothing
            existed = True
        except (FileNotFoundError, NotADirectoryError):
            existed = False
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # fails harmlessly if a writer's temp file is there
        if existed:
            self._bump_generation()
        self._journal.append((identifier,))  # also when absent: a reader may hold a copy
        return existed

    def index_version(self) -> tuple | None:
        """Two ``stat`` calls instead of listing every entry (a consumer's index refresh,
        every few seconds: ~0.4 s of CPU per 100,000 entries). The token is the root
        directory's mtime (an entry directory created or removed by anyone, including a
        foreign writer) and the size and mtime of ``.encache/generation``, which this
        class appends a byte to after every put, delete and eviction (a put into an
        existing entry directory, or the rename that completes a new one, moves no
        directory's mtime). What it misses: an entry file removed by hand with its
        directory left behind, which a load then finds gone (a miss). None on a network
        filesystem, whose cached attributes can hide another host's change for a minute:
        consumers there list the entries at every refresh, as without a token."""
        if self.fs_type not in LOCAL_FILESYSTEMS:
            return None
        try:
            root = os.stat(self._root_str)
        except FileNotFoundError:
            return None
        try:
            gen = os.stat(self._generation_path)
            mark = (gen.st_size, gen.st_mtime_ns)
        except FileNotFoundError:
            mark = None
        return (root.st_ino, root.st_mtime_ns, mark)

    def changes_since(self, cursor):
        """The store's change journal (:mod:`.disk_journal`): one directory listing and
        an open of each segment still being written, O(writers + changes)."""
        return self._journal.read(cursor)

    def changed_outside(self, identifiers) -> None:
        """Entry files changed other than by :meth:`put` / :meth:`delete` (an eviction,
        a quarantine, a removal by raw directory name): recorded as a put's are; a None
        among ``identifiers`` (a hashed name) makes readers re-check all they hold."""
        self._changed(identifiers)

    def _changed(self, identifiers) -> None:
        """Move :meth:`index_version` and journal ``identifiers``."""
        self._bump_generation()
        self._journal.append(identifiers)

    def _bump_generation(self) -> None:
        """Move :meth:`index_version` (one ``O_APPEND`` write; restarted past 64 KiB)."""
        if self.read_only:
            return
        try:
            fd = os.open(self._generation_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            return  # the root's mtime still moves for new and removed entries
        try:
            if os.fstat(fd).st_size >= GENERATION_MAX:
                os.ftruncate(fd, 0)
            os.write(fd, b".")
        except OSError:
            pass
        finally:
            os.close(fd)

    def _fresh_temp_files(self, identifier: str) -> list[tuple[int, str]]:
        """``(mtime_ns, path)`` of the temp files in the entry's directory younger than
        ``IN_FLIGHT_S`` whose writer holds them (:func:`writer_alive`): writes in flight
        (one ``scandir`` of that directory, a probe per temp file found)."""
        directory = os.path.join(self._root_str, to_name(identifier))
        now, found = time.time(), []
        try:
            with os.scandir(directory) as names:
                for e in names:
                    if e.name.startswith(TEMP_PREFIX):
                        with contextlib.suppress(FileNotFoundError):  # renamed meanwhile
                            st = e.stat()
                            if now - st.st_mtime < IN_FLIGHT_S and writer_alive(e.path):
                                found.append((st.st_mtime_ns, e.path))
        except (FileNotFoundError, NotADirectoryError):
            pass
        return found

    def in_flight(self, identifier: str) -> bool:
        """A fresh temp file in the entry's directory that its writer holds: a write
        between its creation and its rename (local filesystems); a killed writer's is
        not."""
        return self.supports_in_flight and bool(self._fresh_temp_files(identifier))

    def in_flight_paths(self, identifier: str) -> list[str]:
        if not self.supports_in_flight:
            return []
        return [path for _, path in sorted(self._fresh_temp_files(identifier), reverse=True)]

    def read_in_flight(self, identifier: str, checksum=lambda version: True):
        """The bytes of a write in flight once all are written, checked in full
        (header, size, checksum unless ``checksum(version)`` says the verified log vouches
        for it: a producer on this host records its temp file once all its bytes are in):
        ``(buffer, version, meta, offset)``, or None (no fresh temp file holds a whole,
        valid entry yet). Mapped as :meth:`read_entry` maps a committed entry of its size
        (writers never change a temp file once written, and the rename keeps the inode;
        the hash faults the pages in), else read into a private buffer and checked in the
        same pass. A file not whole yet is told from its header (one ``pread``: the size
        the header promises), without mapping it. The version is the temp file's, which
        its rename keeps: committed, the entry is that same version (with a new ctime)."""
        for path in self.in_flight_paths(identifier):  # newest first
            try:
                fd = os.open(path, READ_FLAGS)
            except FileNotFoundError:  # committed or given up meanwhile
                continue
            try:
                st = os.fstat(fd)
                if not S_ISREG(st.st_mode):
                    continue
                version = ServedVersion.of(st)
                try:
                    head = os.pread(fd, min(st.st_size, _HEAD_READ), 0)
                    if header_length(head) <= len(head):  # not whole yet: no mapping, no hash
                        parse_header(head, total_size=st.st_size)
                    hashing = checksum(version)
                    if self.mapped_loads and st.st_size >= max(self.map_min_bytes, 8):
                        buf = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
                        meta, offset = validate_blob(buf, identifier=identifier, verify=hashing,
                                                     ahead=self._ahead(-1, st.st_size))
                    else:
                        buf = uninitialized(st.st_size)
                        meta, offset = read_verified(
                            lambda view: os.readv(fd, [view]), st.st_size, buf,
                            chunk=FILE_CHUNK, identifier=identifier, verify=hashing,
                            ahead=self._ahead(fd, st.st_size))
                except CorruptEntry:  # still being written (or its writer died since)
                    continue
                return buf, version, meta, offset
            finally:
                os.close(fd)
        return None

    @contextlib.contextmanager
    def in_flight_wait(self, identifier: str):
        """Wakes on the steps of a write on this host (:mod:`.inotify`): a record in
        the verified log (a producer appends one once all the temp file's bytes are in,
        before readers may take them), the rename that commits the entry, the temp file
        closed or removed (its writer gone), another write started; and after
        ``IN_FLIGHT_WATCHED_S`` in any case. Not on the temp file's own growth: a reader
        woken by its last byte would hash what the record vouches for a moment later.
        Where nothing can be watched, the default sleep."""
        watch = None
        if self.supports_in_flight:
            log_dir = self._meta("verified")  # (made by the first record: then its parent)
            watch = DirectoryWatch.open([
                (os.path.join(self._root_str, to_name(identifier)),
                 IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE | IN_CLOSE_WRITE | IN_CREATE),
                (str(log_dir if log_dir.is_dir() else log_dir.parent),
                 IN_MODIFY | IN_CREATE | IN_MOVED_TO)])
        if watch is None:
            with Store.in_flight_wait(self, identifier) as wait:
                yield wait
            return
        try:
            yield lambda: watch.wait(IN_FLIGHT_WATCHED_S)
        finally:
            watch.close()

    def keeps(self, identifier: str) -> bool:
        """Whether a mapping or buffer of a version of ``identifier`` served lately is kept
        (no system call; the next load checks its version). Entries this store deletes or
        evicts are dropped from it at once; one removed by another process stays until
        that load or the next ``maintain``."""
        return self._recent is not None and self._entry_file(identifier) in self._recent

    def contains(self, identifier: str) -> bool:
        return os.path.isfile(self._entry_file(identifier))  # (a tier asks per load)

    def _entry_dirs(self) -> Iterator[os.DirEntry]:
        try:
            it = os.scandir(self.root)
        except FileNotFoundError:  # removed since it was opened: say so (a consumer's
            # index refresh then warns and counts the store as down; it was every
            # request a silent miss)
            raise StoreError(f"the store directory {self.root} is gone") from None
        with it:
            for d in it:
                if is_entry_name(d.name) and d.is_dir(follow_symlinks=False):
                    yield d

    def identifiers(self, *, unreachable: list | None = None) -> Iterator[str]:
        for d in self._entry_dirs():
            if not os.path.isfile(os.path.join(d.path, ENTRY_FILE)):
                continue
            ident = from_name(d.name)
            if ident is None:  # hashed name: the identifier lives in the metadata
                info = self._stat_path(d.name, os.path.join(d.path, ENTRY_FILE))
                ident = info.identifier if info else None
            if ident is not None:
                yield ident

    def scan(self, use_index: bool = True, *,
             unreachable: list | None = None) -> Iterator[EntryInfo]:
        """Every entry's header info. With ``use_index`` (the default) headers of files
        unchanged since the last complete scan come from the header index
        (:mod:`.header_index`): one ``stat`` per entry instead of open + read + parse.
        Every entry file is still listed and stat'ed, so the result is the same as a full
        scan's; a complete scan that saw changes rewrites the index."""
        if not use_index:
            for d in self._entry_dirs():
                info = self._stat_path(d.name, os.path.join(d.path, ENTRY_FILE))
                if info is not None:
                    yield info
            return
        meta_dir = self.root / META_DIR
        token = self.index_version()  # before any entry is read: a change moves it
        started = time.time()
        known, current = header_index.load_records(
            meta_dir, token, self.SUMMARY_MAX_AGE_S, self._last_access_stamp())
        if current and all(map(_well_formed, known.values())):
            # the store has not changed since: no listing, no stat per entry
            for rec in known.values():
                yield rec[1]
            return
        fresh: dict = {}
        changed = False
        stat, tail = os.stat, "/" + ENTRY_FILE
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        try:
            for d in self._entry_dirs():
                name = d.name
                try:  # relative to the store's directory: a shorter path walk
                    st = stat(name + tail, dir_fd=root_fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                version = (st.st_ino, st.st_size, st.st_mtime_ns)
                rec = known.get(name)
                if _indexed(rec, version):
                    info = rec[1]
                    if info.accessed != st.st_atime:  # a load since: only atime moved
                        info = EntryInfo(info.identifier, info.size, info.meta, info.created,
                                         st.st_atime, info.error)
                        changed = True
                else:
                    got = self._stat_path(name, d.path + tail, with_version=True)
                    if got is None:
                        continue
                    info, version = got
                    changed = True
                    if info.identifier == name:
                        name = info.identifier  # one string object: pickled once
                fresh[name] = (version, info)
                yield info
        finally:
            os.close(root_fd)
        steady = token is not None and self.index_version() == token
        if changed or len(fresh) != len(known) or (steady and fresh):  # (current from now)
            header_index.save(meta_dir, fresh, token if steady else None, started)

    def _last_access_stamp(self) -> float:
        """The mtime of ``.encache/accessed`` (:meth:`_stamp_access`); 0.0 if none."""
        try:
            return os.stat(os.path.join(self._root_str, META_DIR, ACCESSED_FILE)).st_mtime
        except OSError:
            return 0.0

    #: the summary kept under the store's generation (``summary_if_unchanged`` in O(1))
    #: is trusted this long at most: a change the generation cannot see (another
    #: program rewriting an entry file in place, or removing one and leaving its
    #: directory) shows in ``stats`` within this time
    SUMMARY_MAX_AGE_S = 3600.0

    def _current_summary(self):
        """The summary saved under the store's current generation token, or None: O(1),
        a read of one small file and two ``stat`` calls, whatever the store's size."""
        from ..summary import Summary

        token = self.index_version()
        if token is None:  # a network filesystem: no token to trust
            return None
        meta_dir = self.root / META_DIR
        saved = header_index.load_current(meta_dir)
        if (saved is None or saved["token"] != token
                or not 0 <= time.time() - saved["saved"] < self.SUMMARY_MAX_AGE_S):
            return None
        try:
            summary = Summary.from_state(saved["summary"])
        except Exception:  # damaged: the caller scans, and the scan writes it again
            return None
        with contextlib.suppress(OSError):  # reads move atimes, not the generation
            accessed = os.stat(meta_dir / ACCESSED_FILE).st_mtime
            if summary.last_access is None or accessed > summary.last_access:
                summary.last_access = accessed
        return summary

    def summary_if_unchanged(self, stat_entries: bool = True):
        """The store's :class:`~.summary.Summary` without reading a header, or None
        (then the caller scans). First in O(1): the summary saved under the store's
        generation token, when the token has not moved since (no put, delete or
        eviction, no entry directory made or removed) and it is younger than
        ``SUMMARY_MAX_AGE_S``. Else, with ``stat_entries``, from the header index when
        every entry file still has the version the index recorded — one ``stat`` per
        entry, no header or record loaded — which saves it under the token again."""
        from ..summary import Summary

        summary = self._current_summary()
        if summary is not None or not stat_entries:
            return summary
        token = self.index_version()
        versions, state = header_index.load_summary(self.root / META_DIR)
        if state is None:
            return None
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        stat, tail, get = os.stat, "/" + ENTRY_FILE, versions.get
        n, last = 0, None
        try:
            for d in self._entry_dirs():
                try:
                    st = stat(d.name + tail, dir_fd=root_fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                if get(d.name) != (st.st_ino, st.st_size, st.st_mtime_ns):
                    return None
                n += 1
                if last is None or st.st_atime > last:
                    last = st.st_atime
        finally:
            os.close(root_fd)
        if n != len(versions):
            return None
        try:
            summary = Summary.from_state(state)
        except Exception:  # a damaged index: dropped, and the caller's scan rewrites it
            header_index.remove(self.root / META_DIR)
            return None
        summary.last_access = last  # atimes move without changing a version
        if token is not None and not self.read_only and self.index_version() == token:
            header_index.save_current(self.root / META_DIR, token, summary.to_state())
        return summary

    def stat(self, identifier: str) -> EntryInfo | None:
        name = to_name(identifier)
        return self._stat_path(name, str(self.root / name / ENTRY_FILE))

    def _stat_path(self, name: str, path: str, with_version: bool = False):
        ident = from_name(name) or name
        try:
            fd = open_untracked(path)  # listing is not a use: keep LRU access times
        except (FileNotFoundError, NotADirectoryError):
            return None
        except NotAFile:
            info = EntryInfo(ident, 0, None, None, None, "not-a-file")
            return (info, (0, 0, 0)) if with_version else info
        try:
            st = os.fstat(fd)
            head = os.pread(fd, _HEAD_READ, 0)
            try:
                need = header_length(head)
                if need > len(head):
                    head = os.pread(fd, need, 0)
            except ValueError:
                pass  # reported by info_from_blob_header
        finally:
            os.close(fd)
        info = info_from_blob_header(ident, st.st_size, head, st.st_mtime, st.st_atime)
        if from_name(name) is not None and info.identifier != ident:
            # the name is what consumers look up; keep it and flag the mismatch
            info = EntryInfo(ident, info.size, info.meta, info.created, info.accessed,
                             info.error or "wrong-identifier")
        if with_version:
            return info, (st.st_ino, st.st_size, st.st_mtime_ns)
        return info

    # -- maintenance helpers (verify --repair, capacity) ---------------------------------
    def stray_files(self, older_than: float = 0.0) -> list[Path]:
        """Leftover temp files and empty entry directories (never visible to readers):
        temp files at least ``older_than`` seconds old whose writer is gone (one a
        running writer holds is not a stray, however old: a slow write)."""
        found, now = [], time.time()
        for d in self._entry_dirs():
            try:
                names = os.listdir(d.path)
            except OSError:
                continue
            if not names:
                found.append(Path(d.path))
            for n in names:
                p = os.path.join(d.path, n)
                if n.startswith(TEMP_PREFIX):
                    with contextlib.suppress(OSError):
                        if now - os.stat(p).st_mtime >= older_than and not writer_alive(p):
                            found.append(Path(p))
        return found

    def used_bytes(self) -> int:
        total = 0
        for d in self._entry_dirs():
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(d.path, ENTRY_FILE)).st_size
        return total

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
