"""The disk store's catalogue: what entries there are, their headers, and what changed.

Listing walks the entry directories; headers come from the header index
(:mod:`.header_index`) where a file's version is unchanged, else from the file; the
store's summary (:mod:`..summary`) is kept under a generation bumped by every change,
and the change journal (:mod:`.journal`) names what changed since a cursor. Part of
:class:`~.store.DiskStore` (a mixin: the methods use its paths and settings).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ..base import EntryInfo, StoreError, info_from_blob_header
from ..entry import EntryMeta, header_length
from ..files import TEMP_PREFIX, NotAFile, open_untracked
from ..keys import from_name, is_entry_name, to_name
from . import header_index
from .layout import (ENTRY_FILE, META_DIR, GENERATION_MAX, ACCESSED_FILE, LOCAL_FILESYSTEMS,
                     _HEAD_READ, writer_alive)


def _indexed(rec, version: tuple) -> bool:
    """Whether the header index's record ``rec`` holds the header of this ``version`` of
    the file (a damaged index's record never does: the header is read again)."""
    return type(rec) is tuple and len(rec) == 2 and rec[0] == version and _well_formed(rec)


def _well_formed(rec) -> bool:
    """A header index record as the index writes it: ``(version, EntryInfo)``."""
    if type(rec) is not tuple or len(rec) != 2 or type(rec[0]) is not tuple:
        return False
    info = rec[1]
    return (type(info) is EntryInfo and type(info.size) is int
            and (info.meta is None or type(info.meta) is EntryMeta))


class DiskCatalogue:
    """A disk store's listing, headers, summary and change tracking."""

    def index_version(self) -> tuple | None:
        """Two ``stat`` calls instead of listing every entry (a consumer's index refresh,
        every few seconds: ~0.4 s of CPU per 100,000 entries). The token is the root
        directory's mtime (an entry directory created or removed by anyone, including a
        foreign writer) and the size and mtime of ``.encache/generation``, which this
        class appends a byte to after every put, delete and eviction (a put into an
        existing entry directory, or the rename that completes a new one, moves no
        directory's mtime). What it misses: an entry file removed by hand with its
        directory left behind, which a load then finds gone (a miss). None on a network
        filesystem, whose cached attributes can hide another host's change for a minute:
        consumers there list the entries at every refresh, as without a token."""
        if self.fs_type not in LOCAL_FILESYSTEMS:
            return None
        try:
            root = os.stat(self._root_str)
        except FileNotFoundError:
            return None
        try:
            gen = os.stat(self._generation_path)
            mark = (gen.st_size, gen.st_mtime_ns)
        except FileNotFoundError:
            mark = None
        return (root.st_ino, root.st_mtime_ns, mark)

    def changes_since(self, cursor):
        """The store's change journal (:mod:`.journal`): one directory listing and
        an open of each segment still being written, O(writers + changes)."""
        return self._journal.read(cursor)

    def changed_outside(self, identifiers) -> None:
        """Entry files changed other than by :meth:`put` / :meth:`delete` (an eviction,
        a quarantine, a removal by raw directory name): recorded as a put's are; a None
        among ``identifiers`` (a hashed name) makes readers re-check all they hold."""
        self._changed(identifiers)

    def _changed(self, identifiers) -> None:
        """Move :meth:`index_version` and journal ``identifiers``."""
        self._bump_generation()
        self._journal.append(identifiers)

    def _bump_generation(self) -> None:
        """Move :meth:`index_version` (one ``O_APPEND`` write; restarted past 64 KiB)."""
        if self.read_only:
            return
        try:
            fd = os.open(self._generation_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError:
            return  # the root's mtime still moves for new and removed entries
        try:
            if os.fstat(fd).st_size >= GENERATION_MAX:
                os.ftruncate(fd, 0)
            os.write(fd, b".")
        except OSError:
            pass
        finally:
            os.close(fd)

    def _entry_dirs(self) -> Iterator[os.DirEntry]:
        try:
            it = os.scandir(self.root)
        except FileNotFoundError:  # removed since it was opened: say so (a consumer's
            # index refresh then warns and counts the store as down; it was every
            # request a silent miss)
            raise StoreError(f"the store directory {self.root} is gone") from None
        with it:
            for d in it:
                if is_entry_name(d.name) and d.is_dir(follow_symlinks=False):
                    yield d

    def identifiers(self, *, unreachable: list | None = None,
                    hint: bool = False) -> Iterator[str]:
        if hint:  # the names alone: no stat of a million entry files (seconds, cold)
            try:
                names = os.listdir(self.root)
            except FileNotFoundError:
                raise StoreError(f"the store directory {self.root} is gone") from None
            for name in names:
                if name[:1] != "~":
                    if name[:1] != ".":  # (dot names: bookkeeping, temp files)
                        yield name
                    continue
                ident = self._identifier(name, os.path.join(self.root, name, ENTRY_FILE))
                if ident is not None:
                    yield ident
            return
        for d in self._entry_dirs():
            if not os.path.isfile(os.path.join(d.path, ENTRY_FILE)):
                continue
            ident = self._identifier(d.name, os.path.join(d.path, ENTRY_FILE))
            if ident is not None:
                yield ident

    def _identifier(self, name: str, path: str) -> str | None:
        """The identifier of the entry directory ``name`` (its entry file at ``path``)."""
        ident = from_name(name)
        if ident is None:  # hashed name: the identifier lives in the metadata
            info = self._stat_path(name, path)
            ident = info.identifier if info else None
        return ident

    def scan(self, use_index: bool = True, *,
             unreachable: list | None = None) -> Iterator[EntryInfo]:
        """Every entry's header info. With ``use_index`` (the default) headers of files
        unchanged since the last complete scan come from the header index
        (:mod:`.header_index`): one ``stat`` per entry instead of open + read + parse.
        Every entry file is still listed and stat'ed, so the result is the same as a full
        scan's; a complete scan that saw changes rewrites the index."""
        if not use_index:
            for d in self._entry_dirs():
                info = self._stat_path(d.name, os.path.join(d.path, ENTRY_FILE))
                if info is not None:
                    yield info
            return
        meta_dir = self.root / META_DIR
        token = self.index_version()  # before any entry is read: a change moves it
        started = time.time()
        known, current = header_index.load_records(
            meta_dir, token, self.SUMMARY_MAX_AGE_S, self._last_access_stamp())
        if current:  # (records that pass the index's digest are well-formed)
            # the store has not changed since: no listing, no stat per entry
            for rec in known.values():
                yield rec[1]
            return
        fresh: dict = {}
        changed = False
        stat, tail = os.stat, "/" + ENTRY_FILE
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return
        try:
            for d in self._entry_dirs():
                name = d.name
                try:  # relative to the store's directory: a shorter path walk
                    st = stat(name + tail, dir_fd=root_fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                version = (st.st_ino, st.st_size, st.st_mtime_ns)
                rec = known.get(name)
                if _indexed(rec, version):
                    info = rec[1]
                    if info.accessed != st.st_atime:  # a load since: only atime moved
                        info = EntryInfo(info.identifier, info.size, info.meta, info.created,
                                         st.st_atime, info.error)
                        changed = True
                else:
                    got = self._stat_path(name, d.path + tail, with_version=True)
                    if got is None:
                        continue
                    info, version = got
                    changed = True
                    if info.identifier == name:
                        name = info.identifier  # one string object: pickled once
                fresh[name] = (version, info)
                yield info
        finally:
            os.close(root_fd)
        steady = token is not None and self.index_version() == token
        if changed or len(fresh) != len(known) or (steady and fresh):  # (current from now)
            header_index.save(meta_dir, fresh, token if steady else None, started)

    def _last_access_stamp(self) -> float:
        """The mtime of ``.encache/accessed`` (:meth:`_stamp_access`); 0.0 if none."""
        try:
            return os.stat(os.path.join(self._root_str, META_DIR, ACCESSED_FILE)).st_mtime
        except OSError:
            return 0.0

    #: the summary kept under the store's generation (``summary_if_unchanged`` in O(1))
    #: is trusted this long at most: a change the generation cannot see (another
    #: program rewriting an entry file in place, or removing one and leaving its
    #: directory) shows in ``stats`` within this time
    SUMMARY_MAX_AGE_S = 3600.0

    def _current_summary(self):
        """The summary saved under the store's current generation token, or None: O(1),
        a read of one small file and two ``stat`` calls, whatever the store's size."""
        from ..summary import Summary

        token = self.index_version()
        if token is None:  # a network filesystem: no token to trust
            return None
        meta_dir = self.root / META_DIR
        saved = header_index.load_current(meta_dir)
        if (saved is None or saved["token"] != token
                or not 0 <= time.time() - saved["saved"] < self.SUMMARY_MAX_AGE_S):
            return None
        try:
            summary = Summary.from_state(saved["summary"])
        except Exception:  # damaged: the caller scans, and the scan writes it again
            return None
        with contextlib.suppress(OSError):  # reads move atimes, not the generation
            accessed = os.stat(meta_dir / ACCESSED_FILE).st_mtime
            if summary.last_access is None or accessed > summary.last_access:
                summary.last_access = accessed
        return summary

    def summary_if_unchanged(self, stat_entries: bool = True):
        """The store's :class:`~.summary.Summary` without reading a header, or None
        (then the caller scans). First in O(1): the summary saved under the store's
        generation token, when the token has not moved since (no put, delete or
        eviction, no entry directory made or removed) and it is younger than
        ``SUMMARY_MAX_AGE_S``. Else, with ``stat_entries``, from the header index when
        every entry file still has the version the index recorded — one ``stat`` per
        entry, no header or record loaded — which saves it under the token again."""
        from ..summary import Summary

        summary = self._current_summary()
        if summary is not None or not stat_entries:
            return summary
        token = self.index_version()
        versions, state = header_index.load_summary(self.root / META_DIR)
        if state is None:
            return None
        try:
            root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return None
        stat, tail, get = os.stat, "/" + ENTRY_FILE, versions.get
        n, last = 0, None
        try:
            for d in self._entry_dirs():
                try:
                    st = stat(d.name + tail, dir_fd=root_fd)
                except (FileNotFoundError, NotADirectoryError):
                    continue
                if get(d.name) != (st.st_ino, st.st_size, st.st_mtime_ns):
                    return None
                n += 1
                if last is None or st.st_atime > last:
                    last = st.st_atime
        finally:
            os.close(root_fd)
        if n != len(versions):
            return None
        try:
            summary = Summary.from_state(state)
        except Exception:  # a damaged index: dropped, and the caller's scan rewrites it
            header_index.remove(self.root / META_DIR)
            return None
        summary.last_access = last  # atimes move without changing a version
        if token is not None and not self.read_only and self.index_version() == token:
            header_index.save_current(self.root / META_DIR, token, summary.to_state())
        return summary

    def stat(self, identifier: str) -> EntryInfo | None:
        name = to_name(identifier)
        return self._stat_path(name, str(self.root / name / ENTRY_FILE))

    def _stat_path(self, name: str, path: str, with_version: bool = False):
        ident = from_name(name) or name
        try:
            fd = open_untracked(path)  # listing is not a use: keep LRU access times
        except (FileNotFoundError, NotADirectoryError):
            return None
        except NotAFile:
            info = EntryInfo(ident, 0, None, None, None, "not-a-file")
            return (info, (0, 0, 0)) if with_version else info
        try:
            st = os.fstat(fd)
            head = os.pread(fd, _HEAD_READ, 0)
            try:
                need = header_length(head)
                if need > len(head):
                    head = os.pread(fd, need, 0)
            except ValueError:
                pass  # reported by info_from_blob_header
        finally:
            os.close(fd)
        info = info_from_blob_header(ident, st.st_size, head, st.st_mtime, st.st_atime)
        if from_name(name) is not None and info.identifier != ident:
            # the name is what consumers look up; keep it and flag the mismatch
            info = EntryInfo(ident, info.size, info.meta, info.created, info.accessed,
                             info.error or "wrong-identifier")
        if with_version:
            return info, (st.st_ino, st.st_size, st.st_mtime_ns)
        return info

    # -- maintenance helpers (verify --repair, capacity) ---------------------------------
    def stray_files(self, older_than: float = 0.0) -> list[Path]:
        """Leftover temp files and empty entry directories (never visible to readers):
        temp files at least ``older_than`` seconds old whose writer is gone (one a
        running writer holds is not a stray, however old: a slow write)."""
        found, now = [], time.time()
        for d in self._entry_dirs():
            try:
                names = os.listdir(d.path)
            except OSError:
                continue
            if not names:
                found.append(Path(d.path))
            for n in names:
                p = os.path.join(d.path, n)
                if n.startswith(TEMP_PREFIX):
                    with contextlib.suppress(OSError):
                        if now - os.stat(p).st_mtime >= older_than and not writer_alive(p):
                            found.append(Path(p))
        return found

    def used_bytes(self) -> int:
        total = 0
        for d in self._entry_dirs():
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(d.path, ENTRY_FILE)).st_size
        return total
