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
