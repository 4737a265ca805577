"""The disk store's writes in flight: how a reader finds a write between its first byte
and its commit, takes its bytes once whole, and waits for its writer's next step.

A writer holds an exclusive ``flock`` on its temp file from before anyone is told of it
to its commit (:func:`.layout.writer_alive`); the commit is a rename, which keeps the
inode, so bytes read and checked from the temp file are the committed entry's version.
Part of :class:`~.store.DiskStore` (a mixin: the methods use its paths and settings).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from stat import S_ISREG

from ..base import Store
from ..entry import (FILE_CHUNK, CorruptEntry, header_length, parse_header, read_verified,
                     validate_blob)
from ..files import READ_FLAGS, TEMP_PREFIX, ServedVersion, uninitialized
from ..keys import to_name
from .inotify import (IN_CLOSE_WRITE, IN_CREATE, IN_DELETE, IN_MODIFY, IN_MOVED_FROM,
                      IN_MOVED_TO, DirectoryWatch)
from .layout import _HEAD_READ, IN_FLIGHT_S, IN_FLIGHT_WATCHED_S, writer_alive


class DiskInFlight:
    """A disk store's writes in flight, as readers see them (``supports_in_flight``)."""

    def _fresh_temp_files(self, identifier: str) -> list[tuple[int, str]]:
        """``(mtime_ns, path)`` of the temp files in the entry's directory younger than
        ``IN_FLIGHT_S`` whose writer holds them (:func:`writer_alive`): writes in flight
        (one ``scandir`` of that directory, a probe per temp file found)."""
        directory = os.path.join(self._root_str, to_name(identifier))
        now, found = time.time(), []
        try:
            with os.scandir(directory) as names:
                for e in names:
                    if e.name.startswith(TEMP_PREFIX):
                        with contextlib.suppress(FileNotFoundError):  # renamed meanwhile
                            st = e.stat()
                            if now - st.st_mtime < IN_FLIGHT_S and writer_alive(e.path):
                                found.append((st.st_mtime_ns, e.path))
        except (FileNotFoundError, NotADirectoryError):
            pass
        return found

    def in_flight(self, identifier: str) -> bool:
        """A fresh temp file in the entry's directory that its writer holds: a write
        between its creation and its rename (local filesystems); a killed writer's is
        not."""
        return self.supports_in_flight and bool(self._fresh_temp_files(identifier))

    def in_flight_paths(self, identifier: str) -> list[str]:
        if not self.supports_in_flight:
            return []
        return [path for _, path in sorted(self._fresh_temp_files(identifier), reverse=True)]

    def read_in_flight(self, identifier: str, checksum=lambda version: True):
        """The bytes of a write in flight once all are written, checked in full
        (header, size, checksum unless ``checksum(version)`` says the verified log vouches
        for it: a producer on this host records its temp file once all its bytes are in):
        ``(buffer, version, meta, offset)`` (a :class:`~..loaded.Loaded`), or None (no fresh temp file holds a whole,
        valid entry yet). Mapped as :meth:`read_entry` maps a committed entry of its size
        (writers never change a temp file once written, and the rename keeps the inode;
        the hash faults the pages in), else read into a private buffer and checked in the
        same pass. A file not whole yet is told from its header (one ``pread``: the size
        the header promises), without mapping it. The version is the temp file's, which
        its rename keeps: committed, the entry is that same version (with a new ctime)."""
        for path in self.in_flight_paths(identifier):  # newest first
            try:
                fd = os.open(path, READ_FLAGS)
            except FileNotFoundError:  # committed or given up meanwhile
                continue
            try:
                st = os.fstat(fd)
                if not S_ISREG(st.st_mode):
                    continue
                version = ServedVersion.of(st)
                try:
                    head = os.pread(fd, min(st.st_size, _HEAD_READ), 0)
                    if header_length(head) <= len(head):  # not whole yet: no mapping, no hash
                        parse_header(head, total_size=st.st_size)
                    hashing = checksum(version)
                    if self.mapped_loads and st.st_size >= max(self.map_min_bytes, 8):
                        buf = mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
                        meta, offset = validate_blob(buf, identifier=identifier, verify=hashing,
                                                     ahead=self._ahead(-1, st.st_size))
                    else:
                        buf = uninitialized(st.st_size)
                        meta, offset = read_verified(
                            lambda view: os.readv(fd, [view]), st.st_size, buf,
                            chunk=FILE_CHUNK, identifier=identifier, verify=hashing,
                            ahead=self._ahead(fd, st.st_size))
                except CorruptEntry:  # still being written (or its writer died since)
                    continue
                return self._loaded((buf, version, meta, offset), identifier)
            finally:
                os.close(fd)
        return None

    @contextlib.contextmanager
    def in_flight_wait(self, identifier: str):
        """Wakes on the steps of a write on this host (:mod:`.inotify`): a record in
        the verified log (a producer appends one once all the temp file's bytes are in,
        before readers may take them), the rename that commits the entry, the temp file
        closed or removed (its writer gone), another write started; and after
        ``IN_FLIGHT_WATCHED_S`` in any case. Not on the temp file's own growth: a reader
        woken by its last byte would hash what the record vouches for a moment later.
        Where nothing can be watched, the default sleep."""
        watch = None
        if self.supports_in_flight:
            log_dir = self._meta("verified")  # (made by the first record: then its parent)
            watch = DirectoryWatch.open([
                (os.path.join(self._root_str, to_name(identifier)),
                 IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE | IN_CLOSE_WRITE | IN_CREATE),
                (str(log_dir if log_dir.is_dir() else log_dir.parent),
                 IN_MODIFY | IN_CREATE | IN_MOVED_TO)])
        if watch is None:
            with Store.in_flight_wait(self, identifier) as wait:
                yield wait
            return
        try:
            yield lambda: watch.wait(IN_FLIGHT_WATCHED_S)
        finally:
            watch.close()
