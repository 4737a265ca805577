"""Small file primitives the store and its bookkeeping share.

:func:`atomic_write_json` — a JSON file replaced whole or not at all (temp file in the
same directory, then ``os.replace``): a reader or a crash never sees half a file. Used for
precompute manifests (:mod:`encache.connectors.corpus`) and the disk store's bookkeeping
(config, counters, notes). Reading without touching the access time is
:func:`encache.connectors.store.disk.open_untracked`. :func:`file_version` is what a
served entry file's version is (verify-once, kept buffers, pinned files).
"""

from __future__ import annotations

import contextlib
import json
import os
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

    @classmethod
    def of(cls, st: os.stat_result, touched: os.stat_result | None = None) -> ServedVersion:
        v = cls(file_version(st))
        v.ctime_ns = st.st_ctime_ns
        v.touched_ctime_ns = st.st_ctime_ns if touched is None else touched.st_ctime_ns
        return v
