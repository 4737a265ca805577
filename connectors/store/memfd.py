"""Entry bytes in anonymous shared memory that another local process can open (a memfd).

Why: a consumer whose workers are separate processes (vLLM's multiprocess executor: every
CPU engine, tensor parallelism on GPUs) hands each step's loads to them. A disk entry goes
as its open file, which each worker maps through ``/proc/<pid>/fd/<n>``. An entry
received from Redis or Redis Cluster, or read from a network filesystem, existed only as
private memory, so its bytes went in the step's metadata through vLLM's message queue: a
copy into the queue and one out of it per worker, on the step's critical path
(``benchmarks/tp.json``). Received into a memfd instead, such an entry travels as a file
as well: its bytes cross the socket once, into memory every worker maps.

A :class:`SharedBuffer` is a writable shared mapping of a memfd that keeps its descriptor
(``fd``) open while the mapping is referenced. :func:`seal` fixes its size before another
process maps it (a file that cannot shrink cannot turn a worker's page fault into
SIGBUS). Linux only: :func:`available` says whether this kernel and Python offer memfds.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import weakref

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SharedBuffer(mmap.mmap):
    """A writable ``MAP_SHARED`` mapping of a memfd; ``fd``: its descriptor, closed once
    the mapping is garbage (a pin holds a duplicate of its own)."""

    fd: int


def available() -> bool:
    """Whether memfds can be made here (Linux 3.17+, with sealing)."""
    if not hasattr(os, "memfd_create"):
        return False
    try:
        os.close(os.memfd_create("encache-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
    except OSError:
        return False
    return True


def shared_buffer(n: int) -> SharedBuffer:
    """A new, writable :class:`SharedBuffer` of ``n`` bytes (``n`` > 0)."""
    fd = os.memfd_create("encache-entry", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, n)
        buf = SharedBuffer(fd, n)
    except BaseException:
        os.close(fd)
        raise
    buf.fd = fd
    weakref.finalize(buf, os.close, fd)
    return buf


def seal(buf: SharedBuffer) -> None:
    """Fix the buffer's size for good (idempotent): before another process maps it."""
    if fcntl.fcntl(buf.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SEAL:
        return
    fcntl.fcntl(buf.fd, fcntl.F_ADD_SEALS, _SEALS)
