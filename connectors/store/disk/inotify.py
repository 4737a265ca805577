"""DirectoryWatch: wake when directories change, instead of polling them (Linux inotify).

Why: in encoder disaggregation a PD instance often looks an entry up while the encoder's
write is still going into the temp file (docs/epd.md). It then waits for the bytes, and
looking every millisecond costs up to a millisecond of that request's latency, and a
``scandir`` + ``open`` + ``mmap`` of the growing file per look, on a CPU the writer
needs. The writer's steps that matter to such a reader are all directory events: a
record appended to the store's log of verified versions (the moment a producer on this
host has all the bytes in and vouches for them), the rename that commits the entry, the
temp file closed or removed (its writer gone). A reader that watches those directories
wakes at those moments and looks only then.

A watch is an inotify instance (``inotify_init1``) with a watch per directory, read
through ``select.poll``; ``wait(timeout)`` returns True on an event (the queued events
are drained: the caller looks again), False after ``timeout``. Closing an inotify
instance waits for the kernel's SRCU grace period (6-20 ms measured here while a writer
was busy), so a closed watch's instance is not closed but kept for the next watch (its
watches removed, its queue drained; at most ``POOL`` per process, never shared with a
forked child). A directory that cannot be watched (gone, no inotify, the per-user
instance limit, ``fs.inotify.max_user_*``) leaves :meth:`DirectoryWatch.open` returning
None: the caller polls as before. Events are delivered for changes made by any process
on this kernel, so this is for local filesystems only (a network filesystem's other
clients raise none).
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import threading

IN_MODIFY = 0x00000002
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_ONLYDIR = 0x01000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC

POOL = 8  # idle inotify instances kept per process

_libc = None
_pool: list[int] = []  # idle instances: no watches, queue drained
_pool_pid = os.getpid()
_pool_lock = threading.Lock()


def _lib():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.inotify_init1.argtypes = (ctypes.c_int,)
            lib.inotify_add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
            lib.inotify_rm_watch.argtypes = (ctypes.c_int, ctypes.c_int)
            _libc = lib
        except (OSError, AttributeError):
            _libc = False
    return _libc


def _take() -> int:
    """An idle instance of this process, or a new one (-1: none to be had)."""
    global _pool_pid
    with _pool_lock:
        if _pool_pid != os.getpid():  # a forked child: the parent's are not ours
            _pool.clear()
            _pool_pid = os.getpid()
        if _pool:
            return _pool.pop()
    return _lib().inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)


def _drain(fd: int) -> None:
    while True:
        try:
            if len(os.read(fd, 65536)) < 65536:
                return
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno != errno.EINTR:
                return


class DirectoryWatch:
    """Directories watched through an inotify instance (see the module). Close it when
    done (a context manager)."""

    def __init__(self, fd: int, wds: list[int]):
        self.fd, self._wds = fd, wds
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        #: events seen (each ``wait`` that returned True)
        self.wakes = 0

    @classmethod
    def open(cls, watches: list[tuple[str, int]]) -> DirectoryWatch | None:
        """A watch of each ``(directory, mask)``; None when the first cannot be watched
        (later ones that cannot are skipped: the caller's timeout covers them)."""
        lib = _lib()
        if not lib:
            return None
        fd = _take()
        if fd < 0:
            return None
        wds = []
        for k, (path, mask) in enumerate(watches):
            wd = lib.inotify_add_watch(fd, os.fsencode(path), mask | IN_ONLYDIR)
            if wd >= 0:
                wds.append(wd)
            elif k == 0:
                cls(fd, wds).close()
                return None
        return cls(fd, wds)

    def wait(self, timeout: float) -> bool:
        """Block until an event or ``timeout`` s; True on an event (all queued events
        read, so the next wait waits for a new one)."""
        if not self._poll.poll(max(0, int(timeout * 1000 + 0.999))):
            return False
        _drain(self.fd)
        self.wakes += 1
        return True

    def close(self) -> None:
        """Remove the watches; the instance, its queue drained, goes back to the pool."""
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        for wd in self._wds:  # (EINVAL for one whose directory is gone: removed already)
            _lib().inotify_rm_watch(fd, wd)
        _drain(fd)
        with _pool_lock:
            if _pool_pid == os.getpid() and len(_pool) < POOL:
                _pool.append(fd)
                return
        os.close(fd)

    def __enter__(self) -> DirectoryWatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
