"""The disk store's layout and settings: file names, thresholds, and who writes a temp file.

Shared by :mod:`.store` and the parts of the disk store beside it (:mod:`.catalogue`,
:mod:`.in_flight`, :mod:`.bookkeeping`).
"""

from __future__ import annotations

import errno
import fcntl
import os

from ..files import READ_FLAGS


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
