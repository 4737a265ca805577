"""Background entry writer for producers: the engine step never waits for a disk or Redis.

``save_caches`` hands a tensor's bytes here and returns; a small thread pool encodes
(checksum) and stores them. Pending bytes are bounded: past ``max_pending_bytes`` the
caller blocks briefly (back-pressure) rather than letting memory grow without limit.
Failures are counted and logged (rate-limited) — a producer whose store is down keeps
serving. ``flush()`` waits for everything submitted so far (precompute, shutdown);
``wait()`` for given submissions (an encoder instance's step: its request must not finish
before its entries are readable, see :mod:`encache.connectors.vllm.worker`). On a store
with in-flight writes (``supports_in_flight``: disk on a local filesystem) an entry is
readable once its write is visible (its temp file created): a reader that finds it in
flight waits for its bytes and reads them (checked in full) or the commit, so neither the
copy into the file nor the fsync holds the encoder's request. The bytes are written while
the engine answers and the proxy forwards the request; PD waits only for what is left.

The commit itself (fsync, rename, the journal and verified-log records) is then held for
up to ``COMMIT_HOLD_S``, while no other write waits for a thread: it would otherwise run
while the engine turns the step into the request's answer and compete with it for the
CPU and the GIL (on a 2-vCPU machine that shows in an encode-only server's request
latency; docs/performance.md section 5 has the benchmark).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from ..encoder_config import holds
from ..ratelimit import RateLimitedLog
from ..store.base import Store
from ..store.counters import open_live_counters
from ..store.entry import encode_parts

log = logging.getLogger("encache.writer")

#: how long a landed entry's commit waits (the engine answering the request meanwhile)
#: unless a write waits for a thread or the writer is flushed (or closed)
COMMIT_HOLD_S = 0.02


class EntryWriter:
    def __init__(self, store: Store, *, threads: int = 2, max_pending_bytes: int = 1 << 30,
                 skip_existing: bool = True, on_saved: Callable[[str], None] | None = None,
                 encoder_config: str | None = None):
        self.store = store
        self.skip_existing = skip_existing
        #: this producer's encoder-config digest; an existing entry stamped otherwise is
        #: overwritten, not skipped (None: any existing entry counts)
        self.encoder_config = encoder_config
        self.on_saved = on_saved
        self.max_pending_bytes = max_pending_bytes
        self.warn = RateLimitedLog(log)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="encache-save")
        self._cond = threading.Condition()
        self._pending_bytes = 0
        self._pending = 0
        self._threads = threads
        self._flushing = 0  # flush() calls waiting: held commits go now
        self.counters: dict[str, float] = {}
        self._live = open_live_counters(store, self.warn)  # survives SIGKILL (disk)
        self.saved: list[str] = []  # identifiers written by this writer (bounded)
        self.errors: dict[str, str] = {}

    def submit(self, identifier: str, data_fn: Callable[[], tuple[object, str, tuple]],
               nbytes: int, **meta) -> Future:
        """Queue one entry. ``data_fn`` returns ``(buffer, dtype_code, shape)`` when run
        in the writer thread (e.g. it waits there for the device-to-host copy the step queued).
        The future's result is True once every reader can have the entry (written, or
        already there; on a ``supports_in_flight`` store: its write visible, its bytes
        and commit under way), False when the write failed (counted and logged here, also
        when it fails after the future said True). :meth:`flush` waits for the commits."""
        landed: Future = Future()
        with self._cond:
            while self._pending and self._pending_bytes + nbytes > self.max_pending_bytes:
                self._cond.wait(1.0)
            self._pending_bytes += nbytes
            self._pending += 1
            self._cond.notify_all()  # (held commits go if it finds no idle thread)
        self._pool.submit(self._write, identifier, data_fn, nbytes, meta, landed)
        return landed

    def _hold_commit(self) -> None:
        """After an entry's bytes are written: let the step's answer go out before its
        commit runs (``COMMIT_HOLD_S`` at most; not while a write waits for a thread)."""
        with self._cond:  # more writes pending than threads: one waits for a thread
            self._cond.wait_for(lambda: self._pending > self._threads or self._flushing,
                                COMMIT_HOLD_S)

    def wait(self, futures: list[Future], timeout: float | None) -> tuple[int, int]:
        """Block until ``futures`` (from :meth:`submit`) are done or ``timeout`` s passed;
        ``(failed, late)``: how many writes failed and how many are still running."""
        if not futures:
            return 0, 0
        done, late = wait_futures(futures, timeout=timeout)
        failed = sum(1 for f in done if f.result() is False)
        return failed, len(late)

    def _current(self, identifier: str, lora_digest: str = "", binding: str = "") -> bool:
        """Whether the store already holds a usable entry for this producer (same encoder
        config, for a stamped LoRA entry the same adapter digest, for a bound one the
        same inputs: an entry bound to other inputs is overwritten with what was just
        encoded from these)."""
        return holds(self.store, identifier, self.encoder_config, lora_digest, binding)

    def _write(self, identifier, data_fn, nbytes, meta, landed: Future) -> None:
        def land(ok: bool) -> None:  # only this thread sets it
            if not landed.done():
                landed.set_result(ok)

        def visible() -> None:  # readers wait for the bytes now (in flight)
            land(True)

        try:
            if self.skip_existing and self._current(identifier, meta.get("lora_digest") or "",
                                                    meta.get("binding") or ""):
                self.count("skipped_existing")
                land(True)
                return
            data, dtype, shape = data_fn()
            parts = encode_parts(identifier, data, dtype, shape, **meta)
            if self.store.supports_in_flight:
                written = self.store.put(identifier, parts, encoded_here=True,
                                         on_visible=visible, on_written=self._hold_commit)
            else:
                written = self.store.put(identifier, parts, encoded_here=True)
            self.count("saves")
            self.count("bytes_saved", written)
            with self._cond:
                if len(self.saved) < 1_000_000:
                    self.saved.append(identifier)
            if self.on_saved:
                self.on_saved(identifier)
            land(True)
        except Exception as e:  # never propagate into the engine
            self.count("save_errors")
            with self._cond:
                if len(self.errors) < 10_000:
                    self.errors[identifier] = str(e)
            self.warn.warning("save", "encache: cannot save %s to %s: %s",
                              identifier, self.store.url, e)
            land(False)
        finally:
            with self._cond:
                self._pending_bytes -= nbytes
                self._pending -= 1
                self._cond.notify_all()

    def count(self, name: str, value: float = 1) -> None:
        if self._live is not None:
            self._live.add(name, value)
        with self._cond:
            self.counters[name] = self.counters.get(name, 0) + value

    def take_counters(self) -> dict[str, float]:
        """Counter deltas the store has not recorded yet (none with live counters)."""
        with self._cond:
            out, self.counters = self.counters, {}
        return {} if self._live is not None else out

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted entry is written (or failed) and committed (held
        commits go at once). True if drained."""
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._pending == 0, timeout)
            finally:
                self._flushing -= 1

    def close(self, timeout: float | None = 60.0) -> None:
        self.flush(timeout)
        self._pool.shutdown(wait=False)
