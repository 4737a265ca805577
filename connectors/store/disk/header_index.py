"""A disk store's header index: parsed entry headers cached by file version.

``encache list`` / ``stats`` / ``verify`` scan every entry's header. Reading and parsing
100,000 headers costs seconds (an open, a read and a JSON parse each); the headers rarely
change. The index keeps, per entry directory name, the parsed header together with the
version of the file it was read from — (inode, size, mtime_ns), the same version the
serving lookup trusts to skip re-hashing (:mod:`..lookup`): a replacement is a new inode
(writers rename a new file over the entry), an in-place write sets mtime, and access-time
tracking keeps mtime exactly. It also keeps the store's summary (``encache stats``) as of
that index, used only when every entry still has its recorded version.

It is a cache, never the source of truth: a scan lists the directories and stats every
entry file, and uses a record only when the file's version matches it — so a concurrent
writer, a purge or an eviction between two index updates can never make a scan wrong (a
replaced file does not match and is re-read; a removed one is not listed). One
exception, the summary's trust model: an index saved under the store's generation token
(``DiskStore.index_version``) that has not moved since, younger than ``DiskStore.
SUMMARY_MAX_AGE_S``, and saved by a scan begun after the store's last access stamp, is
the store: a scan yields its records without a listing or a ``stat`` (``list``,
``purge`` plans and ``verify`` over a million unchanged entries: no million ``stat``
calls). What it cannot see is what the summary cannot: another program rewriting an
entry file in place, or reading it (the access time the kernel moves), for at most
``SUMMARY_MAX_AGE_S``. A
missing, unreadable or foreign-version index file is simply rebuilt by the next full scan,
and so is one written by an encache that reads other entry formats or checksums
(:data:`READS`): its verdicts (``newer-format`` for an entry this build reads) are not
this build's.
Concurrent scans each write a complete index atomically (temp file + rename): the last one
wins, and either is valid.

Beside it, ``{root}/.encache/summary.pickle`` (:func:`save_current`): the same summary
keyed by the store's generation token (``DiskStore.index_version``) taken before the scan
that made it. While the token is unchanged and the file is young (``DiskStore.
SUMMARY_MAX_AGE_S``), ``stats`` and ``size`` answer from it in O(1) -- no listing, no
``stat`` per entry -- and a store that changed costs the scan it cost before.

File: ``{root}/.encache/header-index.pickle``, written mode 0600, with a digest of each
of its blobs (a damaged one is rebuilt, never trusted). It is read with a
restricted unpickler that builds nothing but builtin values and the two record classes
(:class:`~.base.EntryInfo`, :class:`~.entry.EntryMeta`), and only if the current user owns
it — another user's index file of a shared store is ignored (this scan then reads every
header, as without an index).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import tempfile
import time
from pathlib import Path

from ..entry import CHECKSUM_ALGOS, READ_FORMATS

INDEX_FILE = "header-index.pickle"
FORMAT = 8
#: the disk store stamps its last access (``.encache/accessed``) at most this often per
#: process: an index saved by a scan that began later than this after the stamp holds
#: every access time encache recorded
ACCESS_STAMP_S = 1.0

#: the entry formats and checksum algorithms of the encache that wrote an index
READS = [sorted(READ_FORMATS), list(CHECKSUM_ALGOS)]


class _Unpickler(pickle.Unpickler):
    """Only the record classes may be named by the file (no other global, no code)."""

    def find_class(self, module, name):
        from ..base import EntryInfo
        from ..entry import EntryMeta

        allowed = {(EntryInfo.__module__, "EntryInfo"): EntryInfo,
                   (EntryMeta.__module__, "EntryMeta"): EntryMeta}
        try:
            return allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed here") from None


def _digest(blob: bytes) -> str:
    """What the index records of each blob it holds: a damaged blob (a torn write on a
    filesystem without atomic rename, a bit flip, an edit) is then rebuilt rather than
    trusted, and records that pass were written by :func:`save` -- well-formed, so a
    scan of a million of them checks none one by one."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(blob)


def _blob(data: dict, key: str):
    """``data[key]`` unpickled, if its digest matches; else None."""
    blob = data.get(key)
    digests = data.get("digests")
    if (type(blob) is not bytes or type(digests) is not dict
            or digests.get(key) != _digest(blob)):
        return None
    try:
        return _Unpickler(io.BytesIO(blob)).load()
    except Exception:
        return None


def _read(meta_dir: Path) -> dict | None:
    try:
        with open(meta_dir / INDEX_FILE, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.geteuid():
                return None
            data = _Unpickler(f).load()
    except FileNotFoundError:
        return None
    except Exception:  # truncated, corrupt, or from an incompatible version: rebuild
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("reads") != READS:
        return None
    return data


def load(meta_dir: Path) -> dict:
    """``name -> (file_version, EntryInfo)``; {} when absent, unreadable or written by
    another format."""
    return load_records(meta_dir)[0]


def load_records(meta_dir: Path, token=None, max_age: float = 0.0,
                 accessed: float = 0.0) -> tuple[dict, bool]:
    """``(records as load() gives them, current)``. ``current``: the records are the
    whole store as it is now, no entry needs a ``stat`` -- the index was saved under the
    generation ``token`` (not None) by a scan that started less than ``max_age`` seconds
    ago and more than ``ACCESS_STAMP_S`` after ``accessed`` (the store's last access
    stamp: a load since then could have moved an entry's access time unrecorded)."""
    data = _read(meta_dir)
    if data is None:
        return {}, False
    records = _blob(data, "records")
    if not isinstance(records, dict):
        return {}, False
    started = data.get("started")
    current = (token is not None and data.get("token") == token
               and isinstance(started, float)
               and 0 <= time.time() - started < max_age
               and accessed < started - ACCESS_STAMP_S)
    return records, current


def load_summary(meta_dir: Path) -> tuple[dict, dict | None]:
    """``(name -> file_version, summary state)`` without building the records."""
    data = _read(meta_dir)
    if data is None:
        return {}, None
    versions = _blob(data, "versions")
    if not isinstance(versions, dict):
        return {}, None
    return versions, data.get("summary")


def save(meta_dir: Path, records: dict, token=None, started: float | None = None) -> bool:
    """Write the index atomically (records, versions, summary); False (and nothing
    changed) if the store's metadata directory is not writable. ``token``: the store's
    generation the records are current under (taken before they were read, and still
    the same after): the summary is also saved under it (:func:`save_current`), and a
    scan may then take the records as the store (:func:`load_records`). ``started``:
    when the scan that read them began (``time.time()``)."""
    from ..summary import summarize_entries

    state = summarize_entries(rec[1] for rec in records.values()).to_state()
    # in name order: a listing sorted by identifier (``list``'s default) then finds
    # them sorted, and sorts in one pass
    records = dict(sorted(records.items()))
    blob = pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)
    # (its own blob, as the records: a scan of an unchanged store reads neither's
    # counterpart -- a million versions cost a second to unpickle)
    versions = pickle.dumps({name: rec[0] for name, rec in records.items()},
                            protocol=pickle.HIGHEST_PROTOCOL)
    try:
        meta_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    if not _write(meta_dir, INDEX_FILE, {"format": FORMAT, "reads": READS,
                                         "versions": versions, "summary": state,
                                         "records": blob, "token": token,
                                         "digests": {"records": _digest(blob),
                                                     "versions": _digest(versions)},
                                         "started": started}):
        return False
    if token is not None:
        save_current(meta_dir, token, state)
    return True


def _write(meta_dir: Path, name: str, data: dict) -> bool:
    """Pickle ``data`` to ``meta_dir/name`` atomically (a temp file renamed over it);
    False, and nothing changed, where the directory is not writable."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-" + name.split(".")[0] + "-", dir=meta_dir)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(data, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, meta_dir / name)
        return True
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return False


SUMMARY_FILE = "summary.pickle"


def save_current(meta_dir: Path, token, state: dict) -> bool:
    """Write the summary ``state`` keyed by the generation ``token`` it was made under
    (atomically; False if the metadata directory is not writable)."""
    return _write(meta_dir, SUMMARY_FILE, {"format": FORMAT, "token": token,
                                           "saved": time.time(), "summary": state})


def load_current(meta_dir: Path) -> dict | None:
    """``{"token", "saved", "summary"}`` of :func:`save_current`, or None (absent,
    unreadable, another user's, another format)."""
    try:
        with open(meta_dir / SUMMARY_FILE, "rb") as f:
            if os.fstat(f.fileno()).st_uid != os.geteuid():
                return None
            data = _Unpickler(f).load()
    except Exception:  # absent, truncated, corrupt: the caller scans
        return None
    if (not isinstance(data, dict) or data.get("format") != FORMAT
            or not isinstance(data.get("summary"), dict)
            or not isinstance(data.get("saved"), float)):
        return None
    return data


def remove(meta_dir: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(meta_dir / INDEX_FILE)
