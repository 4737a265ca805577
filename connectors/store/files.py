"""Small file primitives the store and its bookkeeping share.

:func:`atomic_write_json` — a JSON file replaced whole or not at all (temp file in the
same directory, then ``os.replace``): a reader or a crash never sees half a file. Used for
precompute manifests (:mod:`encache.jobs.corpus`) and the disk store's bookkeeping
(config, counters, notes), which :func:`read_json_object` reads back (a damaged file as
none). :func:`file_version` is what a served entry file's version is (verify-once, kept
buffers, pinned files). And what every file-backed reader shares: entry files opened
never blocking (:data:`READ_FLAGS`; anything but a regular file is :class:`NotAFile`),
reading without touching the access time (:func:`open_untracked`), buffers that are not
zero-filled first, page-cache hints for mapped entries (:func:`prefault`,
:func:`populate`), disk blocks reserved before a write (:func:`preallocate`), a
directory's fsync, and which filesystem holds a path.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import stat
import tempfile
from pathlib import Path

#: temp files start with this (the disk store's stray-file sweep knows the prefix)
TEMP_PREFIX = ".tmp-"


def atomic_write_json(path: str | os.PathLike, data, *, prefix: str = TEMP_PREFIX,
                      **dump_kwargs) -> None:
    """Write ``data`` as JSON to ``path`` atomically (parents created); ``dump_kwargs``
    go to :func:`json.dump`. The temp file is removed when anything fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, **dump_kwargs)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json_object(path: str | os.PathLike) -> dict:
    """The JSON object in the bookkeeping file ``path``; ``{}`` when it is missing,
    unreadable, not JSON (or not UTF-8), or not an object. A damaged bookkeeping file is
    ignored and rewritten by its next writer, never an error: its readers check each
    value they use."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if type(data) is dict else {}


#: filesystems where reserving a new file's blocks first makes the write faster: each
#: page written otherwise reserves its block as it is copied (ext4's delayed allocation;
#: measured on ext4, ``benchmarks/write.json``; XFS reserves unwritten extents the same
#: way). Not tmpfs, where a reservation is zeroed pages the write then overwrites
PREALLOCATE_FILESYSTEMS = frozenset({"ext4", "xfs"})
_FALLOC_FL_KEEP_SIZE = 0x01
_libc_fallocate = None


def preallocate(fd: int, nbytes: int) -> bool:
    """Reserve the blocks of the ``nbytes`` about to be written to the new file ``fd``
    (``fallocate(2)`` with ``FALLOC_FL_KEEP_SIZE``: its size does not move, so a reader
    sees the file grow as the bytes go in, as without it). False where the kernel or the
    filesystem cannot (nothing reserved: the write allocates as it goes). Raises
    ``OSError`` when the space is not there (``ENOSPC``, ``EDQUOT``): before a byte is
    written, where a write would fail part-way."""
    global _libc_fallocate
    if _libc_fallocate is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).fallocate
        except (OSError, AttributeError):
            _libc_fallocate = False
            return False
        fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
        fn.restype = ctypes.c_int
        _libc_fallocate = fn
    if _libc_fallocate is False or nbytes <= 0:
        return False
    while _libc_fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes) != 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise OSError(err, os.strerror(err))
        return False  # EOPNOTSUPP, ENOSYS, EINVAL, ...: not here
    return True


def file_version(st: os.stat_result) -> tuple[int, int, int, int]:
    """A served entry file's version: (device, inode, size, mtime_ns). A replacement is a
    new inode and an in-place write sets mtime; access tracking changes neither (it keeps
    mtime_ns exactly and moves only atime/ctime), so a verified version stays verified."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ServedVersion(tuple):
    """:func:`file_version` as a disk store serves it (equal to and hashed as that tuple),
    carrying the inode's change time for the verified log (``verified_log.py``), which
    trusts a version only while nothing changed the inode: ``ctime_ns`` as the store
    found it, ``touched_ctime_ns`` after the store's own access-time refresh (which moves
    ctime and nothing else; equal to ``ctime_ns`` when there was none). ctime cannot be
    set from user space: an in-place write whose mtime was put back still moves it."""

    ctime_ns: int
    touched_ctime_ns: int
    #: a copy a node's local tier served (:mod:`.tiered`): its file version means nothing
    #: to the shared store, which checks it by its header instead
    tier_copy: bool = False

    @classmethod
    def of(cls, st: os.stat_result, touched: os.stat_result | None = None) -> ServedVersion:
        v = cls(file_version(st))
        v.ctime_ns = st.st_ctime_ns
        v.touched_ctime_ns = st.st_ctime_ns if touched is None else touched.st_ctime_ns
        return v


def uninitialized(n: int):
    """A writable buffer of ``n`` bytes that is not zero-filled first (``bytearray(n)``
    memsets, which halves load throughput on large entries)."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with every supported install
        return bytearray(n)
    return numpy.empty(n, numpy.uint8)


def prefault(buf) -> None:
    """Start reading a mapped entry's pages from disk now (``MADV_WILLNEED``: kernel
    readahead, returns at once; ~0.1 ms for 10 MB already cached), so a cold entry's I/O
    overlaps the scheduler's work instead of stalling the model step that first touches
    it. No-op for buffers that are not mappings."""
    if isinstance(buf, mmap.mmap):
        with contextlib.suppress(OSError, ValueError):
            buf.madvise(mmap.MADV_WILLNEED)


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+


def populate(buf) -> None:
    """Map every page of a mapped entry now (``MADV_POPULATE_READ``: the page-table work
    the engine's first copy would otherwise do, page fault by page fault). For background
    passes that skip the checksum (a version verified earlier this boot), whose hash would
    have touched every page; on the request path it saves nothing. No-op for buffers
    that are not mappings, or where the kernel lacks it."""
    if isinstance(buf, mmap.mmap):
        with contextlib.suppress(OSError, ValueError):
            buf.madvise(MADV_POPULATE_READ)


def filesystem_type(path) -> str | None:
    """The type of the filesystem holding ``path`` (``ext4``, ``nfs4``…) from
    /proc/self/mountinfo (longest mount point that contains it); None if unknown."""
    try:
        real = os.path.realpath(path)
        best, best_type = "", None
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mount = fields[4].replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, best_type = mount, right.split()[0]
        return best_type
    except OSError:
        return None


#: how every reader opens an entry file: never blocking, so a FIFO (or a device) put
#: where an entry belongs cannot hang a load or a scan (O_NONBLOCK changes nothing for a
#: regular file); the reader's ``fstat`` then tells it is not one
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK


class NotAFile(OSError):
    """Something other than a regular file (a directory, a FIFO…) where an entry file
    belongs: unreadable as an entry, reported as one (``not-a-file``), never waited on."""

    def __init__(self, path):
        super().__init__(errno.EINVAL, "not a regular file", os.fspath(path))


def regular(st: os.stat_result, path) -> None:
    """Raise :class:`NotAFile` unless ``st`` (an open entry file's ``fstat``) is a
    regular file's."""
    if not stat.S_ISREG(st.st_mode):
        raise NotAFile(path)


def open_untracked(path) -> int:
    """Open an entry file for reading without touching the access time (O_NOATIME where
    permitted: the file's owner or root), so scans, verify and warm never count as a
    use. Raises :class:`NotAFile` for anything but a regular file."""
    flags = READ_FLAGS | getattr(os, "O_NOATIME", 0)
    try:
        fd = os.open(path, flags)
    except PermissionError:
        fd = os.open(path, READ_FLAGS)
    try:
        regular(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
