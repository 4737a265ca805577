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
    {root}/.encache/journal/*.log             the change journal (:mod:`.journal`)
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

Here: reads and writes. Beside it, by concept: the catalogue (listing, headers, summary,
change tracking: :mod:`.catalogue`), the bookkeeping (capacity and eviction, notes,
counters, locks: :mod:`.bookkeeping`), writes in flight (:mod:`.in_flight`), pinning a
read's file (:mod:`.pins`), the layout's names and settings (:mod:`.layout`); the scan
cache (:mod:`.header_index`), reused buffers of recently served versions (:mod:`.recent`),
the change journal (:mod:`.journal`); header parsing (:mod:`..entry`), atomic files
(:mod:`..files`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import tempfile
import threading
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path
from stat import S_ISREG

from .. import read_ahead
from ..base import Store, StoreError
from .journal import DiskJournal
from ..loaded import Loaded
from .pins import pin_file
from ..entry import FILE_CHUNK, byte_views, read_verified, validate_blob
from ..files import (PREALLOCATE_FILESYSTEMS, READ_FLAGS, TEMP_PREFIX, ServedVersion,
                     file_version, filesystem_type, fsync_dir, preallocate, uninitialized)
from ..keys import name_for, to_name
from .bookkeeping import DiskBookkeeping
from .catalogue import DiskCatalogue
from .in_flight import DiskInFlight
from .recent import RecentBuffers
from .layout import (ENTRY_FILE, META_DIR, ACCESSED_FILE, ACCESS_RESOLUTION_S,
                     EVICTION_POLICIES, LOAD_MODES, READ_THREADS, MMAP_MIN_BYTES,
                     MMAP_MIN_BYTES_KEPT, PREALLOCATE_MIN_BYTES, LOCAL_FILESYSTEMS)
from ..throttle import ScanThrottle
from ..verified_log import record_key

log = logging.getLogger(__name__)

class DiskStore(DiskCatalogue, DiskInFlight, DiskBookkeeping, Store):
    backend = "disk"
    local = True
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
        self._pin = partial(pin_file, self)  # how a read of this store's files pins it

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
        got = self._open_entry(identifier, mapped=self.mapped_loads)
        return None if got is None else self._loaded(got, identifier)

    def _loaded(self, items, identifier: str) -> Loaded:
        """A read's record: pinned as this store's file (:mod:`.pins`)."""
        out = Loaded(items)
        out.pinner, out.identifier = self._pin, identifier
        return out

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
            version = ServedVersion.of(st)
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
                return self._loaded((buf, version, meta, offset, hashing), identifier)
            buf = uninitialized(st.st_size) if into is None else into(st.st_size)
            meta, offset = read_verified(lambda view: os.readv(fd, [view]), st.st_size, buf,
                                         chunk=FILE_CHUNK, identifier=identifier,
                                         verify=hashing,
                                         ahead=self._ahead(fd, st.st_size))
            version = self._touch(fd, st, version, time.time_ns())
            return self._loaded((buf, version, meta, offset, hashing), identifier)
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
                version = ServedVersion.of(st, os.fstat(fd))
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
            version = ServedVersion.of(st)
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
            return self._serve_open(fd, st, path, ServedVersion.of(st), mapped)
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

    def keeps(self, identifier: str) -> bool:
        """Whether a mapping or buffer of a version of ``identifier`` served lately is kept
        (no system call; the next load checks its version). Entries this store deletes or
        evicts are dropped from it at once; one removed by another process stays until
        that load or the next ``maintain``."""
        return self._recent is not None and self._entry_file(identifier) in self._recent

    def contains(self, identifier: str) -> bool:
        return os.path.isfile(self._entry_file(identifier))  # (a tier asks per load)

