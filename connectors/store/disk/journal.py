"""DiskJournal: the change journal of a disk store, local or on a network filesystem.

A reader that holds copies of entries (a node-local tier, a consumer's staged buffers)
must learn what was put or deleted since it last looked, at a cost of O(changes), not a
``stat`` of every copy: on a network filesystem each ``stat`` is a round trip, and a
tier holds hundreds of thousands of copies. Redis keeps its journal as a stream written
with the entry. A shared directory has no append that is atomic across NFS clients, so
each writer appends only to files of its own:

    {root}/.encache/journal/id                               the journal's identity
    {root}/.encache/journal/{created}-{host}-{pid}-{rand}.log  one writer's segment

* **Writers** (a :class:`~.disk.DiskStore` handle in one process) append one line per
  changed identifier (its JSON string) right after the change commits: open with
  ``O_APPEND``, one ``write``, close. The close sends the bytes to an NFS server, and
  close-to-open consistency gives the next reader that opens the file its new size.
  After ``SEGMENT_BYTES`` or ``ROTATE_S`` a writer starts a new segment and seals the
  old one with a last line ``-NAME`` naming the new one, and removes segments nobody
  has appended to for ``KEEP_S``; a process that exits, or drops the handle, seals its
  segment with ``-`` (one that is killed cannot). A change this module cannot name (a
  removal by raw directory name) is a line ``*``: readers re-check everything.
* **Readers** keep a cursor: per segment, the offset read up to (None once a sealed
  segment is read to its end), when it last moved, and the journal's ``id``. A refresh
  lists the directory and opens each segment not yet sealed, and the successors seals
  name (an NFS client's cached listing can hide a new file for up to ``acdirmax``):
  O(writers + changes). A segment that is gone was removed ``KEEP_S`` after its last
  line, so held nothing a cursor younger than ``KEEP_S - SKEW_S`` has not read.

"Cannot tell" (the reader re-checks every copy it holds, as without a journal) when the
journal was recreated (a wiped store: another ``id``), a segment shrank, a line is torn
or is not an identifier, a ``*`` line, or the reader last looked more than
``KEEP_S - SKEW_S`` ago (a segment created and removed since could have escaped it; a
cursor's ``t`` is when it was last taken, renewed by a look that finds nothing new once
it is half that old, so a quiet store's reader keeps following without re-checking).

What no journal of this kind sees: a change by a writer killed between its commit and
its record (microseconds), and changes by programs other than encache (an ``rm`` or an
``rsync`` into the store). Disk stores therefore declare ``journal_complete = False``:
readers also re-check every copy now and then (``base.JOURNAL_FULL_CHECK_S``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref

log = logging.getLogger(__name__)

JOURNAL_DIR = "journal"  # under the store's .encache/
ID_FILE = "id"
SUFFIX = ".log"
SEAL = "-"  # starts a segment's last line (then its successor's name): no more appends
EVERYTHING = "*"  # a change the journal cannot name: readers re-check all they hold
SEGMENT_BYTES = 4 << 20  # a writer starts a new segment past this size ...
ROTATE_S = 600.0  # ... or this age, so no segment is appended to after ROTATE_S
KEEP_S = 3600.0  # segments untouched this long are removed (>> ROTATE_S + clock skew)
SKEW_S = 600.0  # clock differences between hosts (and the NFS server) tolerated
_GONE = object()  # a segment removed since it was listed or named
_TAIL = 1 << 16  # bytes read from a segment's end: more than its longest line


class DiskJournal:
    """The journal directory of one disk store: :meth:`append` for writers,
    :meth:`read` for readers (see the module docstring)."""

    def __init__(self, meta_dir: str, *, read_only: bool = False):
        self.dir = os.path.join(meta_dir, JOURNAL_DIR)
        self.read_only = read_only
        self._lock = threading.Lock()
        self._segment: str | None = None  # this writer's current segment (a path)
        self._pid = 0
        self._size = 0
        self._opened = 0.0
        self._warned = False
        self._sealer: weakref.finalize | None = None  # seals the segment at exit or GC

    # -- writers --------------------------------------------------------------------
    def append(self, identifiers) -> None:
        """Record that ``identifiers`` changed (put, deleted, evicted, quarantined); a
        None among them (an entry whose identifier is unknown) is a ``*`` line: readers
        re-check everything. Never raises: a record that cannot be written is a change
        readers find at their next full check (one warning per handle)."""
        if self.read_only:
            return
        data = "".join(EVERYTHING + "\n" if i is None else json.dumps(i) + "\n"
                       for i in identifiers).encode()
        if not data:
            return
        with self._lock:
            try:
                self._write(data)
            except OSError as e:
                if not self._warned:
                    self._warned = True
                    log.warning("encache: cannot write the change journal in %s (%s): "
                                "readers holding copies find changes at their next full "
                                "check", self.dir, e.strerror or e)

    def _write(self, data: bytes) -> None:
        if (self._segment is None or self._pid != os.getpid() or self._size >= SEGMENT_BYTES
                or time.monotonic() - self._opened >= ROTATE_S):
            self._rotate()
        try:
            fd = os.open(self._segment, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:  # removed under us (a wiped store): a new journal
            self._segment = None
            self._rotate()
            fd = os.open(self._segment, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        self._size += len(data)

    def _rotate(self) -> None:
        """Start a new segment, seal this writer's old one with the new one's name (a
        reader follows it there without waiting for a directory listing that a network
        filesystem may cache), remove segments long untouched."""
        os.makedirs(self.dir, exist_ok=True)
        self._ensure_id()
        name = (f"{time.time_ns():020d}-{socket.gethostname()[:40]}-{os.getpid()}-"
                f"{uuid.uuid4().hex[:8]}{SUFFIX}")
        path = os.path.join(self.dir, name)
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        if self._sealer is not None:
            self._sealer.detach()
        if self._segment is not None and self._pid == os.getpid():
            _seal(self._segment, os.getpid(), name)
        self._segment, self._pid, self._size, self._opened = path, os.getpid(), 0, time.monotonic()
        # a process that exits (or drops this handle) seals its segment, so readers stop
        # opening it; one killed cannot, and readers open it until it is removed
        self._sealer = weakref.finalize(self, _seal, path, os.getpid())
        self._trim()

    def _ensure_id(self) -> None:
        path = os.path.join(self.dir, ID_FILE)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return
        try:
            os.write(fd, uuid.uuid4().hex.encode())
        finally:
            os.close(fd)

    def _trim(self) -> None:
        horizon = time.time() - KEEP_S
        with contextlib.suppress(OSError), os.scandir(self.dir) as it:
            for e in it:
                if e.name.endswith(SUFFIX) and e.path != self._segment:
                    with contextlib.suppress(OSError):
                        if e.stat().st_mtime < horizon:
                            os.unlink(e.path)

    # -- readers --------------------------------------------------------------------
    def read(self, cursor) -> tuple[dict, set[str] | None]:
        """``(cursor, identifiers changed since cursor)``; None: cannot tell (the caller
        re-checks all it holds). A None cursor starts at the journal's current end."""
        now = time.time()
        token = self._read_id()
        names = self._segments()
        if (not _well_formed(cursor) or cursor.get("id") not in (token, None)
                or now - cursor.get("t", 0.0) > KEEP_S - SKEW_S):
            return self._at_end(names, token, now), None
        # (a cursor taken before the journal existed reads every segment from its start)
        known: dict = cursor.get("s", {})
        changed: set[str] = set()
        offsets: dict = {}
        # listed, still being read, or named by a seal: a network filesystem's cached
        # listing may not show a segment yet; one that is gone was removed after KEEP_S,
        # which the age check above says cannot have held anything this cursor missed
        visit = sorted(set(names) | {n for n, off in known.items() if off is not None})
        seen = set(visit)
        while visit:
            name = visit.pop(0)
            offset = known.get(name, 0)
            if offset is None:  # sealed, read to its end
                offsets[name] = None
                continue
            got = self._read_segment(name, offset)
            if got is None:
                return self._at_end(names, token, now), None
            if got is _GONE:
                continue
            offsets[name], ids, successor = got
            changed |= ids
            if successor and successor not in seen:
                seen.add(successor)
                visit.append(successor)
        if (offsets == known and cursor.get("id") == token
                and now - cursor.get("t", 0.0) < (KEEP_S - SKEW_S) / 2):
            return cursor, changed  # nothing moved: the same cursor (kept as it is)
        # this look saw every segment: a segment made after it is kept KEEP_S past its
        # last line, so the new cursor's age bounds what can escape it
        return {"id": token, "t": now, "s": offsets}, changed

    def _read_id(self) -> str | None:
        try:
            with open(os.path.join(self.dir, ID_FILE), "rb") as f:
                return f.read(64).decode("ascii", "replace") or None
        except OSError:
            return None

    def _segments(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.dir) if n.endswith(SUFFIX))
        except OSError:
            return []

    def _read_segment(self, name: str, offset: int):
        """``(new offset or None when sealed, identifiers, successor)`` of the whole
        lines after ``offset``; ``_GONE`` when the file is gone; None when it cannot be
        followed (shrunk, torn, a line that is not an identifier)."""
        if "/" in name or not name.endswith(SUFFIX):
            return None
        try:
            fd = os.open(os.path.join(self.dir, name), os.O_RDONLY)
        except FileNotFoundError:
            return _GONE
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < offset:
                return None
            if size == offset:
                return offset, set(), None
            start = offset - 1 if offset else 0  # the byte before must end a line
            os.lseek(fd, start, os.SEEK_SET)
            data = _read_all(fd, size - start)
        except OSError:  # (a directory by a segment's name, say)
            return None
        finally:
            os.close(fd)
        if offset:
            if data[:1] != b"\n":
                return None
            data = data[1:]
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        ids: set[str] = set()
        for line in data[:end].splitlines():
            try:
                text = line.decode("utf-8", "surrogatepass")
            except ValueError:  # not a line this journal writes
                return None
            if text.startswith(SEAL):
                return None if end != len(data) else (None, ids, text[len(SEAL):])
            if text == EVERYTHING:
                return None
            try:
                ident = json.loads(text)
            except (ValueError, RecursionError):
                return None
            if not isinstance(ident, str):
                return None
            ids.add(ident)
        return offset + end, ids, None

    def _at_end(self, names: list[str], token: str | None, now: float) -> dict:
        """A cursor at the end of every segment (the last whole line of each)."""
        offsets: dict = {}
        for name in names:
            try:
                fd = os.open(os.path.join(self.dir, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                size = os.fstat(fd).st_size
                start = max(0, size - _TAIL)
                os.lseek(fd, start, os.SEEK_SET)
                tail = _read_all(fd, size - start)
            except OSError:
                continue
            finally:
                os.close(fd)
            end = tail.rfind(b"\n", 0, len(tail) - 1) + 1  # the last line's start
            if tail.endswith(b"\n") and tail[end:end + 1] == SEAL.encode():
                offsets[name] = None
            else:
                offsets[name] = start + tail.rfind(b"\n") + 1
        return {"id": token, "t": now, "s": offsets}


def _well_formed(cursor) -> bool:
    """Whether ``cursor`` is one :meth:`DiskJournal.read` returns (a caller may keep it
    where anyone can damage it: the local tier's note in its store)."""
    if type(cursor) is not dict:
        return False
    t = cursor.get("t", 0.0)
    if type(t) not in (int, float) or t != t:
        return False
    segments = cursor.get("s", {})
    return (type(segments) is dict
            and all(type(k) is str and (v is None or (type(v) is int and v >= 0))
                    for k, v in segments.items()))


def _seal(path: str, pid: int, successor: str = "") -> None:
    """Append the seal line (naming the successor, if any) to a segment, from the process
    that wrote it only (a forked child inherits the finalizer, not the segment)."""
    if os.getpid() != pid:
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, f"{SEAL}{successor}\n".encode())
        finally:
            os.close(fd)


def _read_all(fd: int, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)
