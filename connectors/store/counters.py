"""Per-process counter files that survive SIGKILL: a small fixed-layout mapped file.

What: each process serving from a disk store keeps its counters (hits, misses, load
seconds…) in ``{root}/.encache/counters/{host}.{pidns}-{pid}-{start}.cnt``, a 2 KiB file mapped
``MAP_SHARED`` and updated *in place* on every count (a few microseconds: a lock and one
``struct.pack_into`` into the mapping, no system call). :func:`read_totals` adds the
folded totals (``counters.json``) and every live file; :func:`compact` folds the files of
processes that are gone into ``counters.json`` and deletes them, under the store's
counters lock, so the directory holds one file per *running* process.

Why: ``python -m vllm.entrypoints.openai.api_server`` stops its engine process with
SIGKILL by default (``--shutdown-timeout 0``), so nothing at exit runs there: counters
batched in memory and flushed every few seconds lose the last interval on every server
stop. A write into a shared file mapping is in the page cache the moment it is made and
outlives the process (the kernel writes it back even after SIGKILL); only a machine crash
loses it. Redis stores keep the batched ``HINCRBYFLOAT`` pipeline (a network round trip
per count would cost the scheduler), flushed every ``counters_flush_s`` (0.5 s).

Layout (little endian)::

    0   8s   magic b"ENCCNT01"
    8   Q    pid
    16  Q    process start time (clock ticks since boot, /proc/PID/stat field 22)
    24  d    created (epoch seconds)
    32  32x  reserved
    64  SLOTS x (24s name, d value)     a slot is used once its name is set

A slot's value is written before its name, so a reader never sees a named slot with a
garbage value; an aligned 8-byte store is not torn on the platforms vLLM runs on.
``updated`` is a slot like the others (epoch seconds of the last count) and aggregates
by max, not sum.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import socket
import struct
import threading
import time
from pathlib import Path

from .files import read_json_object

__all__ = ["LiveCounters", "live_counters", "read_file", "read_totals", "compact", "DIR",
           "SUFFIX"]

DIR = "counters"
SUFFIX = ".cnt"
MAGIC = b"ENCCNT01"
_HEAD = struct.Struct("<8sQQd32x")
_SLOT = struct.Struct("<24sd")
SLOTS = 62
SIZE = _HEAD.size + SLOTS * _SLOT.size  # 2048
MAX_KEYS = ("updated",)  # aggregate by max, not sum


def _start_ticks(pid: int | str = "self") -> int | None:
    """The process's start time in clock ticks since boot (pid reuse guard), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:  # the command name may hold spaces and parentheses: split after the last ")"
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def _host() -> str:
    """Host name plus PID namespace: pids are only comparable inside one namespace
    (containers on one host may share a store directory and a host name)."""
    host = "".join(c if c.isalnum() or c in "_." else "_" for c in socket.gethostname())[:64]
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{host}.{ns}"


class LiveCounters:
    """This process's counter file (one writer; many readers in other processes)."""

    def __init__(self, directory: Path):
        directory.parent.mkdir(exist_ok=True)  # (.encache: never the store's own directory)
        directory.mkdir(exist_ok=True)
        pid, start = os.getpid(), _start_ticks() or 0
        self.path = directory / f"{_host()}-{pid}-{start}{SUFFIX}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != SIZE:
                os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _HEAD.pack_into(self._map, 0, MAGIC, pid, start, time.time())
        self._values = memoryview(self._map).cast("d")  # slot values are 8-byte aligned
        self._lock = threading.Lock()
        self._offsets: dict[str, int] = {}
        for i in range(SLOTS):  # reopened by the same process (a second store object)
            off = _HEAD.size + i * _SLOT.size
            raw, _ = _SLOT.unpack_from(self._map, off)
            name = raw.rstrip(b"\0").decode("ascii", "replace")
            if name:
                self._offsets[name] = off
        self._next = len(self._offsets)

    def _slot(self, name: str) -> int | None:
        """Index of ``name``'s value in the file seen as float64s (claims a slot)."""
        off = self._offsets.get(name)
        if off is None:
            if self._next >= SLOTS:
                return None
            off = _HEAD.size + self._next * _SLOT.size
            self._next += 1
            struct.pack_into("<d", self._map, off + 24, 0.0)  # value first, then the name
            struct.pack_into("<24s", self._map, off, name.encode("ascii")[:24])
            self._offsets[name] = off
        return (off + 24) // 8

    def add(self, name: str, value: float = 1) -> None:
        """Add ``value`` to counter ``name`` in place (and stamp ``updated``)."""
        with self._lock:
            i = self._slot(name)
            if i is not None:
                self._values[i] += value
            up = self._slot("updated")
            if up is not None:
                self._values[up] = time.time()

    def add_many(self, deltas: dict[str, float]) -> None:
        for k, v in deltas.items():
            if v and k not in MAX_KEYS:
                self.add(k, v)

    def values(self) -> dict[str, float]:
        return _parse(self._map)


_LIVE: dict[tuple[str, int], LiveCounters] = {}
_LIVE_LOCK = threading.Lock()


def live_counters(meta_dir: Path) -> LiveCounters:
    """This process's counter file under ``meta_dir`` (one per process and store)."""
    key = (str(meta_dir), os.getpid())  # a forked child gets its own file
    with _LIVE_LOCK:
        live = _LIVE.get(key)
        if live is None:
            live = _LIVE[key] = LiveCounters(Path(meta_dir) / DIR)
        return live


def _parse(buf) -> dict[str, float]:
    out: dict[str, float] = {}
    if len(buf) < SIZE or bytes(buf[:8]) != MAGIC:
        return out
    for i in range(SLOTS):
        raw, value = _SLOT.unpack_from(buf, _HEAD.size + i * _SLOT.size)
        name = raw.rstrip(b"\0").decode("ascii", "replace")
        if name and value == value:  # skip NaN
            out[name] = value
    return out


def read_file(path) -> dict[str, float]:
    try:
        with open(path, "rb") as f:
            return _parse(f.read(SIZE))
    except OSError:
        return {}


def merge(total: dict, add: dict) -> None:
    for k, v in add.items():
        if not isinstance(v, (int, float)):
            continue
        if k in MAX_KEYS:
            total[k] = max(total.get(k) or 0, v)
        else:
            total[k] = total.get(k, 0) + v


def _files(meta_dir: Path) -> list[Path]:
    try:
        return [p for p in (meta_dir / DIR).iterdir() if p.name.endswith(SUFFIX)]
    except OSError:
        return []


def _dead(path: Path) -> bool:
    """A file of a process on this host that is no longer running (pid gone or reused)."""
    try:
        host, pid, start = path.name[:-len(SUFFIX)].rsplit("-", 2)
        pid_i, start_i = int(pid), int(start)
    except ValueError:
        return False
    if host != _host():
        return False  # another machine's process: only it (or its host's tools) can tell
    if pid_i == os.getpid():
        return False
    now = _start_ticks(pid_i)
    return now is None or (start_i != 0 and now != start_i)


def read_json(path: Path) -> dict[str, float]:
    """The counters in ``path`` (``counters.json``): its finite numbers; anything else a
    damaged or hand-edited file holds is dropped (and gone at the next write)."""
    return {k: v for k, v in read_json_object(path).items()
            if type(v) in (int, float) and math.isfinite(v)}


def read_totals(meta_dir: Path) -> dict[str, float]:
    """Folded totals plus every live file (callers hold the counters lock if they can)."""
    totals = dict(read_json(meta_dir / "counters.json"))
    for p in _files(meta_dir):
        merge(totals, read_file(p))
    return totals


def _newer(path: Path) -> bool:
    """A counter file of another layout (another ``ENCCNT`` magic): a newer encache's,
    which this one cannot read, so must not fold (nor delete)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(MAGIC))
    except OSError:
        return False
    return magic.startswith(MAGIC[:6]) and magic != MAGIC and len(magic) == len(MAGIC)


def compact(meta_dir: Path, write_json) -> int:
    """Fold dead processes' files into ``counters.json`` and delete them (caller holds
    the counters lock). Returns how many were folded; read-only stores fold nothing.
    A file of a newer encache's layout (:func:`_newer`) is left for it to fold."""
    dead = [p for p in _files(meta_dir) if _dead(p) and not _newer(p)]
    if not dead:
        return 0
    totals = read_json(meta_dir / "counters.json")
    for p in dead:
        merge(totals, read_file(p))
    write_json(meta_dir / "counters.json", totals)
    for p in dead:
        with contextlib.suppress(OSError):
            p.unlink()
    return len(dead)


def reset(meta_dir: Path, write_json) -> None:
    """Zero the totals without touching live processes' files: the folded totals become
    minus what the live files hold now (caller holds the counters lock)."""
    compact(meta_dir, write_json)
    base: dict[str, float] = {}
    for p in _files(meta_dir):
        for k, v in read_file(p).items():
            if k not in MAX_KEYS:
                base[k] = base.get(k, 0) - v
    if base:
        write_json(meta_dir / "counters.json", base)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(meta_dir / "counters.json")


def open_live_counters(store, warn):
    """The store's in-place per-process counters (this module), or None: the store
    has none (Redis: batched flushes) or cannot be written (a read-only mount)."""
    if not store.supports_live_counters or store.read_only:
        return None
    try:
        return store.live_counters()
    except OSError as e:
        warn.warning("counters", "encache: cannot keep counters in %s (%s); they are only "
                     "reported in the engine's metrics", store.url, e)
        return None
