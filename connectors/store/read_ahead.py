"""Read a file entry on two threads, and hash it on both.

A checksummed first load of a file entry (:func:`.entry.read_verified`) reads each step
and hashes it while it is still in the CPU cache. On one thread those are two costs in
a row: a file's read is a synchronous copy from the page cache, and the hash (xxh3, a
third to a half of the read here) waits for it. With a helper thread, the caller reads
the entry's front part while the helper reads the back part. An entry checksummed in
pieces (``xxh3_128x512k``, every entry encache writes now) is hashed by both too: the
helper hashes each piece it reads (one step per piece), the caller the front's, and the
caller joins the digests (:data:`.entry.HASHED_FRONT` of the pieces are the caller's).
An entry with one hash over all its bytes (``xxh3_128``, written before) can only be
hashed in order on one thread: the caller hashes the front (:data:`FRONT` of the entry),
then the back part's steps as they land, so that both threads finish together.

A read that does not hash (a version verified before, read into a device copy's
staging) is split the same way, the helper only reading: on this machine one thread's
copy from the page cache is slower than two. A mapped entry's first load (a CPU
engine's) is hashed on two threads too: a job with no descriptor only hashes its pieces
of the mapping (faulting their pages in), while the caller hashes the front's
(:func:`.entry.validate_blob`).

The back part is read in :data:`CHUNK` steps with ``pread`` (the caller's own file
position is never touched), each by whichever thread claims it first: the helper in
order from the start of the part; the caller, once it has hashed its front, each step
the helper has not started, and from the end of the part while the helper reads (a
helper whose CPU is busy costs the load at most the step it is reading). The caller
always ends a job (``Job.close``) before it closes the descriptor or hands the buffer
on, even when it stops early (a bad header, a checksum mismatch): no helper writes into
a buffer or reads a descriptor that is no longer the job's.

The helpers and the job are C (``_readpool.c``): a helper never holds the GIL, so it
neither waits for the caller's hashing nor for the interpreter to wake it. They are a
small process-wide pool (:data:`HELPERS`: one per CPU beyond the first, at most 4; none
on one CPU). The extension is optional: where it was not built (installed with no C
compiler) or ``ENCACHE_PURE_PYTHON=1`` is set, there are no helpers, every load reads
and hashes on its own thread (the same bytes and checks, the ``read_threads=1`` path),
and the first load of an entry that a helper would have shared logs one warning saying
so (:data:`BUILT`). When every helper is busy, :func:`start` returns None and the caller reads
on its own: a load never queues behind another load's read. Entries under
:data:`MIN_BYTES` are read on the caller's thread too: handing a job over costs a thread
wake-up, more than it saves on a quarter megabyte.
"""

from __future__ import annotations

import logging
import os

try:
    if os.environ.get("ENCACHE_PURE_PYTHON", "") not in ("", "0"):
        raise ImportError("ENCACHE_PURE_PYTHON is set")
    from . import _readpool
    from ._readpool import Job
except ImportError as _why:  # built without a compiler: one thread per load, same results
    _readpool, Job, _MISSING = None, None, str(_why)
else:
    _MISSING = ""

#: whether the C helpers (``_readpool``) are there
BUILT = _readpool is not None

#: bytes per step of the back part. Measured here in the load benchmark with the earlier
#: Python helpers, before the caller took steps itself (two runs each, the first load
#: into staging, x a plain one-thread ``readinto``, 2.75 / 10 MB): 1 MiB 0.66-0.73 /
#: 0.85-0.90, 256 KiB 0.40-0.65 / 0.76-0.77 (one thread: 0.63-0.66 / 0.58-0.61). With
#: the C helpers, in scratch runs interleaved per load (2.75 MB, into staging): steps of
#: 128 KiB to 1 MiB all gave 0.65-0.90, varying more from run to run than between sizes.
CHUNK = 1 << 20
#: the caller's share of the entry (the front; the back part is the job's). Measured in a
#: scratch loop with the Python helpers (x ``readinto``, three runs, 2.75 / 10 MB): 0.30
#: 0.90-1.00 / 1.08-1.16, 0.35 0.99-1.04 / 1.06-1.17, 0.40 0.95-1.00 / 1.00-1.06, 0.45
#: 0.90-0.92 / 0.89-1.06; the whole entry read by the helper and only hashed by the
#: caller 0.74-0.78 / 0.76-0.81; one thread 0.70-0.75 / 0.59-0.63.
FRONT = 0.35
#: entries smaller than this are read on the caller's thread (a hand-over costs more).
MIN_BYTES = 1 << 20
#: helper threads in the process (none without the extension).
HELPERS = max(0, min(4, (os.cpu_count() or 1) - 1)) if BUILT else 0
_ALIGN = 64 << 10  # the front part ends on a multiple of this
_warned = False

if BUILT:
    _readpool.set_helpers(HELPERS)


def split(size: int, front: float = FRONT) -> int:
    """Where the helper's part of a ``size``-byte entry begins: ``front`` of it, in whole
    64 KiB, at least one."""
    return min(size, max(_ALIGN, int(size * front) // _ALIGN * _ALIGN))


def start(fd: int, view: memoryview, size: int, *, begin: int | None = None,
          chunk: int | None = None, front: float = FRONT, hash: bool = False) -> Job | None:
    """Read the back part of the ``size``-byte file ``fd`` (from ``begin``; by default
    ``front`` of it is left to the caller, in whole 64 KiB) into ``view`` on a helper
    thread, in ``chunk`` steps (default :data:`CHUNK`); ``hash``: each step is hashed
    too, by the thread that read it (``Job.digests()``: an entry checksummed in pieces,
    a step per piece). ``fd`` -1: the bytes are in ``view`` already (an entry's
    mapping): the job only hashes them (``hash`` must be set). None when the entry is
    under :data:`MIN_BYTES` or no helper is free (then the caller reads it all). The
    caller must :meth:`Job.close` the job before closing ``fd`` or handing ``view``'s
    buffer on."""
    if size < MIN_BYTES:
        return None
    if not BUILT:
        _warn_unbuilt()
        return None
    return _readpool.start(fd, view, split(size, front) if begin is None else begin, size,
                           chunk or CHUNK, hash)


def _warn_unbuilt() -> None:
    """Say once per process what the missing extension costs (docs/install.md)."""
    global _warned
    if not _warned:
        _warned = True
        logging.getLogger("encache").warning(
            "encache: the C read-ahead helper is not built (%s): first loads of entries of "
            "1 MiB or more are read and checksummed on one thread, 1.3x slower at 2.75 MB "
            "and 1.8x at 11 MB on a GPU host (docs/performance.md section 1); install "
            "encache where a C compiler is to build it", _MISSING or "disabled")
