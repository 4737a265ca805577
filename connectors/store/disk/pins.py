"""Pinning a disk entry's file for a worker process on this host (:meth:`.loaded.Loaded.pin`).

The serving process keeps the verified file open; a worker opens it through
``/proc/<pid>/fd/<n>`` (:func:`..loaded.open_ref`), so it reads the very inode that was
verified even if the entry is replaced or purged meanwhile.
"""

from __future__ import annotations

import os

from ..files import READ_FLAGS, file_version


def pin_file(store, identifier: str, version) -> tuple[int, tuple] | None:
    """Open ``store``'s entry file of ``identifier`` and check it is still ``version``:
    ``(fd, ref)`` (:meth:`..loaded.Loaded.pin`), or None (replaced, purged: ship the
    bytes). A version verified from a write still in flight (EPD: PD loads what the
    encoder wrote before its commit) is pinned through that write's temp file: the commit
    renames it, keeping the inode, so the worker reads the verified bytes either way
    (shipping them in the step's metadata instead delays PD's step: docs/performance.md,
    EPD). The caller keeps ``fd`` open until the workers have read it."""
    if version is None:
        return None
    version = tuple(version)
    path = store._entry_file(identifier)

    def candidates():  # the committed file; else a write's temp file (listed only then);
        yield path     # else the committed file again (renamed meanwhile)
        yield from store.in_flight_paths(identifier)
        yield path

    for candidate in candidates():
        try:
            fd = os.open(candidate, READ_FLAGS)
        except OSError:
            continue
        try:
            if file_version(os.fstat(fd)) == version:
                return fd, (os.getpid(), fd, version, path)
        except OSError:
            pass
        os.close(fd)
    return None
