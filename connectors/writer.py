"""Background entry writer for producers: the engine step never waits for a disk or Redis.

``save_caches`` hands a tensor's bytes here and returns; a small thread pool encodes
(checksum) and stores them. Pending bytes are bounded: past ``max_pending_bytes`` the
caller blocks briefly (back-pressure) rather than letting memory grow without limit.
Failures are counted and logged (rate-limited) — a producer whose store is down keeps
serving. ``flush()`` waits for everything submitted so far (precompute, shutdown).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .encoder_config import holds
from .ratelimit import RateLimitedLog
from .store.base import Store
from .store.entry import encode_parts

log = logging.getLogger("encache.writer")


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
        self.counters: dict[str, float] = {}
        from .lookup.metrics import open_live_counters
        self._live = open_live_counters(store, self.warn)  # survives SIGKILL (disk)
        self.saved: list[str] = []  # identifiers written by this writer (bounded)
        self.errors: dict[str, str] = {}

    def submit(self, identifier: str, data_fn: Callable[[], tuple[object, str, tuple]],
               nbytes: int, **meta) -> None:
        """Queue one entry. ``data_fn`` returns ``(buffer, dtype_code, shape)`` when run
        in the writer thread (e.g. a device-to-host copy happens there, not in the step)."""
        with self._cond:
            while self._pending and self._pending_bytes + nbytes > self.max_pending_bytes:
                self._cond.wait(1.0)
            self._pending_bytes += nbytes
            self._pending += 1
        self._pool.submit(self._write, identifier, data_fn, nbytes, meta)

    def _current(self, identifier: str, lora_digest: str = "") -> bool:
        """Whether the store already holds a usable entry for this producer (same encoder
        config and, for a stamped LoRA entry, the same adapter digest)."""
        if lora_digest:
            info = self.store.stat(identifier)
            return (info is not None and info.meta is not None
                    and (self.encoder_config is None
                         or info.meta.encoder_config == self.encoder_config)
                    and info.meta.lora_digest == lora_digest)
        if self.encoder_config is None:
            return self.store.contains(identifier)
        return holds(self.store, identifier, self.encoder_config)

    def _write(self, identifier, data_fn, nbytes, meta) -> None:
        try:
            if self.skip_existing and self._current(identifier, meta.get("lora_digest") or ""):
                self._count("skipped_existing")
                return
            data, dtype, shape = data_fn()
            written = self.store.put(identifier, encode_parts(identifier, data, dtype, shape, **meta),
                                     encoded_here=True)
            self._count("saves")
            self._count("bytes_saved", written)
            with self._cond:
                if len(self.saved) < 1_000_000:
                    self.saved.append(identifier)
            if self.on_saved:
                self.on_saved(identifier)
        except Exception as e:  # never propagate into the engine
            self._count("save_errors")
            with self._cond:
                if len(self.errors) < 10_000:
                    self.errors[identifier] = str(e)
            self.warn.warning("save", "encache: cannot save %s to %s: %s",
                              identifier, self.store.url, e)
        finally:
            with self._cond:
                self._pending_bytes -= nbytes
                self._pending -= 1
                self._cond.notify_all()

    def _count(self, name: str, value: float = 1) -> None:
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
        """Wait until every submitted entry is written (or failed). True if drained."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        self.flush(timeout)
        self._pool.shutdown(wait=False)
