"""Small file primitives the store and its bookkeeping share.

:func:`atomic_write_json` — a JSON file replaced whole or not at all (temp file in the
same directory, then ``os.replace``): a reader or a crash never sees half a file. Used for
precompute manifests (:mod:`encache.connectors.corpus`) and the disk store's bookkeeping
(config, counters, notes). Reading without touching the access time is
:func:`encache.connectors.store.disk.open_untracked`.
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
