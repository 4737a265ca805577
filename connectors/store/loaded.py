"""A read of a stored entry that says where it came from, and how to pin what it read.

Every serving read (``Store.read_entry``, ``read_verified``, ``read_in_flight``) returns
a :class:`Loaded`: the bytes, the stored version they are, the header once checked, the
tier that served them (``source``) and :meth:`Loaded.pin`, which keeps exactly those bytes
open for a worker in another process on this host. So the lookup stages a load, and the
vLLM adapter ships it, without asking the store afterwards what it read.

A pin is ``(fd, ref)``: ``fd`` is a descriptor the pinning process keeps open until the
workers have opened it; ``ref`` = ``(pid, fd, version, path or None)`` travels to them and
:func:`open_ref` opens it through ``/proc/<pid>/fd/<n>``, so the very inode that was
verified is read even if the entry was replaced or purged since. A disk entry is pinned as
its file (:mod:`.disk.pins`); an entry received into shared memory (:mod:`.memfd`: Redis,
a network filesystem) as that memory; anything else cannot be pinned (None: ship bytes).
"""

from __future__ import annotations

import os

from . import memfd
from .files import READ_FLAGS, file_version


class Loaded(tuple):
    """One read of an entry. It unpacks as the reading method's tuple (``read_entry``:
    ``(blob, version)``; ``read_in_flight``: ``(blob, version, meta, offset)``;
    ``read_verified``: ``(blob, version, meta, offset, checksummed)``), and names them:

    ``blob``: the whole entry (a private buffer, a read-only-backed mapping, shared
    memory); ``version``: the stored copy it is (a file's identity; None where the
    backend cannot tell); ``meta``/``offset``: its checked header and where the tensor
    starts (None before a check); ``checksummed``: its bytes were hashed on the way in;
    ``source``: the tier that served it (a tiered store's ``"local"`` or ``"remote"``;
    None: a store without tiers)."""

    #: the tier that served the read (a tiered store sets it on the record its tier
    #: returned: each record is its read's own); None for a store without tiers
    source: str | None = None
    #: ``pinner(identifier, version) -> (fd, ref) | None``: how the backend pins a read of
    #: its own files (the disk store's), None where it keeps none
    pinner = None
    #: the entry read (set with ``pinner``)
    identifier: str | None = None

    @property
    def blob(self):
        return self[0]

    @property
    def version(self):
        return self[1]

    @property
    def meta(self):
        return self[2] if len(self) > 2 else None

    @property
    def offset(self):
        return self[3] if len(self) > 3 else None

    @property
    def checksummed(self) -> bool | None:
        return self[4] if len(self) > 4 else None

    def pin(self) -> tuple[int, tuple] | None:
        """Keep these bytes where a worker process on this host can open them itself:
        ``(fd, ref)`` (the caller closes ``fd`` once the workers opened ``ref``,
        :func:`open_ref`), or None (not pinnable: the entry was replaced since, or its
        bytes are private memory; ship them instead)."""
        blob = self[0]
        if isinstance(blob, memfd.SharedBuffer):
            return pin_shared(blob)
        if self.pinner is not None:
            return self.pinner(self.identifier, self[1])
        return None


def pin_shared(buf: memfd.SharedBuffer) -> tuple[int, tuple] | None:
    """An entry received into shared memory, sealed (its size fixed) and pinned:
    ``(fd, ref)`` as :meth:`Loaded.pin`; None when it cannot be (no descriptor left: ship
    the bytes). The buffer may be dropped meanwhile: the duplicate descriptor keeps the
    memory."""
    try:
        memfd.seal(buf)
        fd = os.dup(buf.fd)
    except OSError:
        return None
    try:
        return fd, (os.getpid(), fd, file_version(os.fstat(fd)), None)
    except OSError:
        os.close(fd)
        return None


def open_ref(ref) -> tuple[int, os.stat_result]:
    """``(fd, stat)`` of a pinned entry (a pin's ``ref``), opened through the pinning
    process's own descriptor (``/proc/<pid>/fd/<n>``), so the very inode it verified is
    read even if the entry was replaced or purged since; the version is checked again (no
    checksum: the pinning process hashed this exact version). Falls back to the entry's
    path when /proc is not reachable, with the same version check (shared memory has no
    path). The caller closes ``fd``."""
    pid, fd, version, path = ref
    try:
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    except OSError:
        if path is None:
            raise
        f = os.open(path, READ_FLAGS)
    try:
        st = os.fstat(f)
        if file_version(st) != tuple(version):
            raise RuntimeError(f"encache: pinned entry {path or '(shared memory)'} changed "
                               "under the worker")
    except BaseException:
        os.close(f)
        raise
    return f, st
