"""Read a file entry on two threads while one of them hashes it.

A checksummed first load of a file entry (:func:`.entry.read_verified`) reads each step
and hashes it while it is still in the CPU cache. On one thread those are two costs in
a row: a file's read is a synchronous copy from the page cache, and the hash (xxh3, a
third to a half of the read here) waits for it. With a helper thread, the caller reads
and hashes the entry's front part (:data:`FRONT` of it) while the helper reads the back
part, then hashes the back part's steps in order as they land. Both threads release the
GIL for the copy and the hash. The split is chosen so that both finish together: the
caller's read of the front and the whole hash take about as long as the helper's read
of the back.

The back part is read in :data:`CHUNK` steps with ``preadv`` (the caller's own file
position is never touched), each by whichever thread claims it first: the helper in
order from the start of the part; the caller, once it has hashed its front, each step
the helper has not started, and from the end of the part while the helper reads (a
helper whose CPU is busy costs the load at most the step it is reading). The helper
signals each step's end by releasing a lock the caller waits on. The caller always ends a job
(:meth:`Job.close`) before it closes the descriptor or hands the buffer on, even when it
stops early (a bad header, a checksum mismatch): the helper never writes into a buffer
or reads a descriptor that is no longer the job's.

The helpers are a small process-wide pool (:data:`HELPERS`: one per CPU beyond the
first, at most 4; none on one CPU). When every helper is busy, :func:`start` returns
None and the caller reads on its own: a load never queues behind another load's read.
Entries under :data:`MIN_BYTES` are read on the caller's thread too: handing a job over
costs a thread wake-up (tens of microseconds here), more than it saves on a quarter
megabyte.
"""

from __future__ import annotations

import os
import threading
from collections import deque

#: bytes per step of the back part. Measured here in the load benchmark before the
#: caller took steps itself (two runs each, the first load into staging, x a plain
#: one-thread ``readinto``, 2.75 / 10 MB): 1 MiB 0.66-0.73 / 0.85-0.90, 256 KiB
#: 0.40-0.65 / 0.76-0.77 (one thread: 0.63-0.66 / 0.58-0.61).
CHUNK = 1 << 20
#: the caller's share of the entry (the front; the back part is the job's). Measured in a
#: scratch loop (x ``readinto``, three runs, 2.75 / 10 MB): 0.30 0.90-1.00 / 1.08-1.16,
#: 0.35 0.99-1.04 / 1.06-1.17, 0.40 0.95-1.00 / 1.00-1.06, 0.45 0.90-0.92 / 0.89-1.06;
#: the whole entry read by the helper and only hashed by the caller 0.74-0.78 /
#: 0.76-0.81; one thread 0.70-0.75 / 0.59-0.63.
FRONT = 0.35
#: entries smaller than this are read on the caller's thread (a hand-over costs more).
MIN_BYTES = 1 << 20
#: helper threads in the process.
HELPERS = max(0, min(4, (os.cpu_count() or 1) - 1))
_ALIGN = 64 << 10  # the front part ends on a multiple of this


class Job:
    """The back part of a file, read in steps by a helper and by the caller: each step is
    read by whichever thread claims it first. The helper claims the steps in order from
    :attr:`begin`; :meth:`landed` (the caller) takes them in order too, reading each one
    the helper has not started, and while the helper reads one it reads the last steps
    nobody has claimed. So a helper that is slow (its CPU busy) costs the load at most
    the step it is reading: the caller reads the rest."""

    __slots__ = ("begin", "_fd", "_view", "_bounds", "_claims", "_landed", "_ok",
                 "_settled", "_stop", "_error", "_helper")

    def __init__(self, fd: int, view: memoryview, start: int, end: int, chunk: int):
        self.begin = start  # the job's part: bytes [begin, end)
        self._fd, self._view = fd, view
        self._bounds = [(s, min(end, s + chunk)) for s in range(start, end, chunk)]
        self._claims = [threading.Lock() for _ in self._bounds]  # held by the step's reader
        self._landed = []  # released once the helper is done with a step it claimed
        for _ in self._bounds:
            lock = threading.Lock()
            lock.acquire()
            self._landed.append(lock)
        self._ok = [False] * len(self._bounds)  # the helper read the step whole
        self._settled = [False] * len(self._bounds)  # the caller is done with the step
        self._stop = False
        self._error: BaseException | None = None
        self._helper: _Helper | None = None  # handed back to the pool by close()

    def _read(self, i: int) -> None:
        s, e = self._bounds[i]
        fd, view = self._fd, self._view
        while s < e:
            n = os.preadv(fd, [view[s:e]], s)
            if not n:
                raise EOFError(s)
            s += n

    def _run(self) -> None:
        """On the helper: read each step not claimed yet, releasing its lock; on an error
        or a short file, record it and stop (the caller raises it)."""
        for i in range(len(self._bounds)):
            if self._stop:
                return
            if not self._claims[i].acquire(blocking=False):
                continue  # the caller reads it
            try:
                self._read(i)
                self._ok[i] = True
            except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
                self._error = e
                self._stop = True
            finally:
                self._landed[i].release()

    def landed(self):
        """Each step's ``(start, end)`` once its bytes are in, in file order. A step the
        helper has not started is read here; while the helper reads the next step, this
        thread reads the last step nobody has claimed (the two meet in the middle), so
        a slow helper leaves it the rest of the part. Raises the helper's or this
        thread's ``OSError``, or ``EOFError(offset)`` where the file ended early."""
        claims, settled = self._claims, self._settled
        last = len(self._bounds) - 1  # steps after this one are claimed (by someone)
        for i, bounds in enumerate(self._bounds):
            while not settled[i]:
                if claims[i].acquire(blocking=False):
                    settled[i] = True
                    self._read(i)
                elif last > i and claims[last].acquire(blocking=False):
                    settled[last] = True  # the helper reads step i: take one from the end
                    self._read(last)
                    last -= 1
                elif last > i:
                    last -= 1  # (the helper has it)
                else:
                    self._landed[i].acquire()
                    settled[i] = True
                    if not self._ok[i]:
                        raise self._error if self._error is not None else RuntimeError(
                            "read stopped")
            yield bounds

    def close(self) -> None:
        """End the job: claim every step nobody has, and wait for the one the helper is
        reading, if any. After this the helper touches neither the descriptor nor the
        buffer (a helper not scheduled yet finds every step taken), and it is free for
        the next load at once: it leaves this job's loop on its own (only finding its
        steps taken), then takes the next job it is given. Were it to free itself after
        that loop, a load right after this one (a step's next item) would often find no
        helper free and read on one thread. Closing a closed job does nothing."""
        self._stop = True
        for i, settled in enumerate(self._settled):
            if not settled:
                if not self._claims[i].acquire(blocking=False):
                    self._landed[i].acquire()  # the helper's: read, or being read
                self._settled[i] = True  # (so a second close waits for nothing)
        self._view = None  # (a job still queued on the helper keeps no buffer alive)
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.free()


class _Helper:
    """A thread that runs the jobs it is given, in order. It is given the next one as
    soon as the last one is closed, maybe before it left that job's loop (or, when it
    was slow to be scheduled, before it even started it: a closed job's steps are all
    taken, so running it is a no-op); hence a queue, not a single slot."""

    def __init__(self, pool: "_Pool"):
        self._pool = pool
        self._jobs: deque[Job] = deque()
        self._go = threading.Semaphore(0)  # one release per job queued
        threading.Thread(target=self._loop, name="encache-read-ahead", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            self._jobs.popleft()._run()  # (never raises: an error is the job's)

    def run(self, job: Job) -> None:
        job._helper = self
        self._jobs.append(job)
        self._go.release()

    def free(self) -> None:
        """Back to the pool (by :meth:`Job.close`: the job needs it no more)."""
        self._pool.free(self)


class _Pool:
    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._free: deque[_Helper] = deque()
        self._made = 0

    def take(self) -> _Helper | None:
        with self._lock:
            if self._free:
                return self._free.pop()
            if self._made >= self.size:
                return None
            self._made += 1
        return _Helper(self)

    def free(self, helper: _Helper) -> None:
        with self._lock:
            self._free.append(helper)


_pool = _Pool(HELPERS)


def _after_fork() -> None:  # a child has none of the parent's threads
    global _pool
    _pool = _Pool(HELPERS)


os.register_at_fork(after_in_child=_after_fork)


def split(size: int, front: float = FRONT) -> int:
    """Where the helper's part of a ``size``-byte entry begins: ``front`` of it, in whole
    64 KiB, at least one."""
    return min(size, max(_ALIGN, int(size * front) // _ALIGN * _ALIGN))


def start(fd: int, view: memoryview, size: int, *, chunk: int = CHUNK,
          front: float = FRONT) -> Job | None:
    """Read the back part of the ``size``-byte file ``fd`` (from ``Job.begin``: ``front``
    of it left to the caller, in whole 64 KiB) into ``view`` on a helper thread, in
    ``chunk`` steps; None when the entry is under :data:`MIN_BYTES` or no helper is free
    (then the caller reads it all). The caller must :meth:`Job.close` the job before
    closing ``fd`` or handing ``view``'s buffer on."""
    if size < MIN_BYTES:
        return None
    helper = _pool.take()
    if helper is None:
        return None
    job = Job(fd, view, split(size, front), size, chunk)
    helper.run(job)
    return job
