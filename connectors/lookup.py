"""Serving-side lookups: a fresh index, background prefetch, and a staging area.

vLLM asks a connector two things on the scheduler's hot path: "is this item in the
store?" (``has_cache_item``, per item per step) and, before scheduling a request, "are its
items ready?" (``ensure_cache_available``). Answering either with I/O would stall every
engine step, and answering "yes" for an entry that then fails to load crashes the engine
(vLLM raises "Encoder cache miss" in the worker). So the engine-facing answer is always a
memory lookup, and "yes" is only ever said for bytes already read and verified:

* **Index** — the set of identifiers in the store, scanned at start and refreshed every
  ``index_refresh_s`` in a background thread (for a local disk store an unknown
  identifier is also checked with one ``stat``, negative-cached, so new entries are seen
  at once). A stale index entry costs one background read that finds nothing: a miss.
* **Prefetch** — when a request with a known item is about to be scheduled, the entry is
  read and fully validated (header, size, checksum) by a thread pool while the engine keeps
  stepping; the request waits (is deferred) at most ``load_timeout_s``, then the item is
  treated as a miss and re-encoded. A local store's entry may instead be read inline, in
  the caller's thread, within a per-step time budget the caller keeps.
* **Verify once per stored version** — the checksum is computed on the first load of
  each stored copy (for a disk file: device, inode, size, mtime_ns — access tracking
  leaves these alone); later loads of
  the same unchanged file reuse the parsed header and skip the hash. Any rewrite or
  replacement changes the version and is verified again. ``verify="always"`` hashes
  every load; Redis values carry no version and are always verified.
* **Verify ahead** — an entry that appears while the engine runs (a producer wrote it) is
  verified by the background threads as soon as the index refresh sees it, so its first
  request-path load already finds a verified version (no checksum on the request path).
  Entries present at start are not hashed ahead (that would read the whole store).
* **Staging** — validated payloads wait in a byte-bounded LRU until the scheduler hands them
  to the worker, and stay there as a small hot tier for popular images.

Pure Python (no vLLM, no torch): the vLLM adapter is a thin layer over this.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum

from .store.base import Store
from .store.disk import prefault
from .store.entry import CorruptEntry, EntryMeta, validate_blob

log = logging.getLogger("encache.lookup")


class State(Enum):
    READY = "ready"  # verified bytes are staged: say yes
    PENDING = "pending"  # a read is in flight: defer the request
    MISS = "miss"  # not in the store, unreadable, or too slow: encode


@dataclass(frozen=True)
class Staged:
    """A verified entry in memory: ``blob[offset:offset+meta.data_bytes]`` is the tensor."""

    identifier: str
    meta: EntryMeta
    blob: bytearray | bytes
    offset: int
    load_seconds: float
    #: the stored version these bytes were verified as (a disk file's identity), or None
    version: object = None

    @property
    def nbytes(self) -> int:
        return len(self.blob)


class RateLimitedLog:
    """One warning per key per interval, with a count of what was suppressed."""

    def __init__(self, logger: logging.Logger, interval_s: float = 30.0):
        self.logger, self.interval = logger, interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, msg: str, *args) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e18) < self.interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            n = self._suppressed.pop(key, 0)
            self._last[key] = now
        suffix = f" ({n} similar suppressed)" if n else ""
        self.logger.warning(msg + suffix, *args)
        return True


VERIFIED_VERSIONS = 1 << 16  # remembered (version -> parsed header) pairs, LRU
INLINE_VERIFY_MAX = 1 << 20  # larger unverified entries are checked in the background
PREFAULT_AFTER_S = 10.0  # a verified mapping not loaded for this long gets readahead
_DEFER = object()


def parse_verify(value) -> tuple[bool, bool]:
    """``verify`` setting -> (checksum at all, checksum every load)."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "always":
            return True, True
        if v in ("true", "yes", "1", "once", "on"):
            return True, False
        if v in ("false", "no", "0", "off", "never"):
            return False, False
        raise ValueError(f"verify must be true, false or 'always', not {value!r}")
    return bool(value), False


def open_live_counters(store: Store, warn: RateLimitedLog):
    """The store's in-place per-process counters (:mod:`.counters`), or None: the store
    has none (Redis: batched flushes) or cannot be written (a read-only mount)."""
    if not store.supports_live_counters or store.read_only:
        return None
    try:
        return store.live_counters()
    except OSError as e:
        warn.warning("counters", "encache: cannot keep counters in %s (%s); they are only "
                     "reported in the engine's metrics", store.url, e)
        return None


class EntryLookup:
    def __init__(self, store: Store, *, load_threads: int = 4, staging_bytes: int = 512 << 20,
                 load_timeout_s: float = 5.0, index_refresh_s: float = 5.0,
                 verify: bool | str = True, counters_flush_s: float = 5.0,
                 store_stats_s: float = 30.0, encoder_config: str | None = None,
                 verify_ahead: bool = True):
        self.store = store
        # the engine's encoder-config digest: entries stamped otherwise are misses
        # (None: accept any; :mod:`encache.connectors.encoder_config`)
        self.encoder_config = encoder_config
        self.store_stats_s = store_stats_s
        self._store_gauges: dict[str, float] = {}  # latest store-wide facts (metrics)
        self._store_totals: dict[str, float] | None = None  # last seen store counters
        self.verify, self.verify_always = parse_verify(verify)
        # versions only help when checksums run once: nothing to do ahead otherwise
        # (and only a local store has versions: Redis values are verified on every load)
        self.verify_ahead = (verify_ahead and self.verify and not self.verify_always
                             and store.local)
        # stored version -> (identifier, meta, offset) of a copy already validated
        self._verified: OrderedDict[object, list] = OrderedDict()
        self.load_timeout_s = load_timeout_s
        self.index_refresh_s = index_refresh_s
        self.staging_bytes = staging_bytes
        self.counters_flush_s = counters_flush_s
        self.warn = RateLimitedLog(log)
        self._lock = threading.Lock()
        self._index: set[str] = set()
        self._index_ready = threading.Event()
        self._absent: dict[str, float] = {}  # identifier -> expiry (local stores)
        self._bad: dict[str, float] = {}  # identifier -> expiry (corrupt / rejected)
        self._staged: OrderedDict[str, Staged] = OrderedDict()
        self._staged_bytes = 0
        self._inflight: dict[str, tuple[Future, float]] = {}
        self._counters: dict[str, float] = {}
        #: LoRA name -> digest of the adapter this engine serves under it (kept by the
        #: connector from its requests); a stamped entry with another digest is a miss
        self.lora_digests: dict[str, str] = {}
        self._reasons: dict[str, str] = {}  # identifier -> why it was last a miss
        # counts go straight into a per-process file where the store offers one (disk):
        # they survive the engine's SIGKILL; otherwise they are batched and flushed
        self._live = open_live_counters(store, self.warn)
        self._interval: dict[str, float] = {}  # since the last take_interval() (engine metrics)
        self._latencies: list[float] = []
        self._last_flush = time.monotonic()
        self._down_until = 0.0  # store unreachable: everything is a miss until then
        self._backoff = 0.0
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=load_threads, thread_name_prefix="encache-load")
        self._indexer = threading.Thread(target=self._index_loop, name="encache-index", daemon=True)
        self._indexer.start()

    # -- index ---------------------------------------------------------------------
    def _index_loop(self) -> None:
        """Background: refresh the index and persist counters, each on its own period."""
        next_index = 0.0
        next_stats = 0.0
        last_version = None
        tick = max(0.05, min(self.index_refresh_s, self.counters_flush_s, self.store_stats_s))
        while not self._closed.is_set():
            now = time.monotonic()
            if now >= next_index:
                try:
                    version = self.store.index_version()
                    if version is None or version != last_version:
                        ids = set(self.store.identifiers())
                        with self._lock:
                            old, self._index = self._index, ids
                        if self.verify_ahead and self._index_ready.is_set():
                            self._verify_new(ids - old)
                        last_version = version
                    self._store_up()
                except Exception as e:  # store down: keep the old index, retry later
                    self._store_down()
                    self.warn.warning("index", "encache: cannot refresh the index of %s: %s",
                                      self.store.url, e)
                self._index_ready.set()
                next_index = now + self.index_refresh_s
            if now >= next_stats and time.monotonic() >= self._down_until:
                self._sample_store()
                next_stats = now + self.store_stats_s
            self.maybe_flush()
            self._closed.wait(tick)

    VERIFY_AHEAD_MAX = 1024  # per index refresh; the rest is verified on first load

    def _verify_new(self, identifiers) -> None:
        """Queue checksum passes for entries that appeared since the last refresh."""
        for n, identifier in enumerate(identifiers):
            if n >= self.VERIFY_AHEAD_MAX or self._closed.is_set():
                break
            try:
                self._pool.submit(self._verify_one, identifier)
            except RuntimeError:  # the pool was shut down (close() raced us)
                break

    def _verify_one(self, identifier: str) -> None:
        """Background: validate the stored version (remembered, not staged). Errors are
        left to the request-path load, which counts and reports them."""
        try:
            got = self.store.read_entry(identifier)
            if got is None:
                return
            blob, version = got
            if version is not None and self._known(identifier, version) is None:
                self._validate(identifier, blob, version)
            del blob
        except Exception:
            return

    def verified_count(self, identifiers) -> int:
        """How many of ``identifiers`` have a verified version on record (tests, benchmarks)."""
        with self._lock:
            seen = {rec[0] for rec in self._verified.values()}
        return sum(1 for i in identifiers if i in seen)

    STORE_COUNTERS = ("evictions", "bytes_saved")  # exported as store_* counters

    def _sample_store(self) -> None:
        """Store-wide facts for the engine's metrics (background, every ``store_stats_s``):
        entries (the index), bytes used and capacity (disk), and the growth of the
        store's shared counters (evictions and saves by every writer on this store)."""
        gauges: dict[str, float] = {}
        with self._lock:
            gauges["store_entries"] = len(self._index)
        try:
            max_bytes = self.store.max_bytes
            if max_bytes:
                gauges["store_capacity_bytes"] = max_bytes
            used = self.store.used_bytes if self.store.supports_used_bytes else None
            if used is not None:
                gauges["store_bytes"] = used()
            totals = self.store.read_counters()
        except Exception as e:
            self.warn.warning("store-stats", "encache: cannot read the state of %s: %s",
                              self.store.url, e)
            return
        with self._lock:
            self._store_gauges = gauges
            if self._store_totals is not None:  # the first sample is the baseline
                for k in self.STORE_COUNTERS:
                    delta = totals.get(k, 0) - self._store_totals.get(k, 0)
                    if delta > 0:  # a reset (encache stats --reset) is not negative growth
                        self._interval["store_" + k] = self._interval.get("store_" + k, 0) + delta
            self._store_totals = {k: totals.get(k, 0) for k in self.STORE_COUNTERS}

    def wait_index(self, timeout: float | None = None) -> bool:
        return self._index_ready.wait(timeout)

    def _store_down(self) -> None:
        """Circuit breaker: after a store error every lookup is a miss (no waiting, no
        retries per request) for a backoff that grows from 1 s to 30 s; the background
        index refresh probes the store, and the first success closes the breaker."""
        with self._lock:
            self._backoff = min(30.0, max(1.0, self._backoff * 2))
            self._down_until = time.monotonic() + self._backoff

    def _store_up(self) -> None:
        with self._lock:
            self._backoff = 0.0
            self._down_until = 0.0

    def known(self, identifier: str) -> bool:
        """Is the identifier (probably) in the store? Memory speed; may be stale."""
        now = time.monotonic()
        with self._lock:
            if now < self._down_until:
                return False
            if self._bad.get(identifier, 0) > now:
                return False
            if identifier in self._index:
                return True
            if not self.store.local:
                return False
            if self._absent.get(identifier, 0) > now:
                return False
        try:
            found = self.store.contains(identifier)  # one stat on a local disk
        except Exception as e:
            self._store_down()
            self.warn.warning("load", "encache: cannot reach %s: %s; re-encoding", self.store.url, e)
            return False
        with self._lock:
            if found:
                self._index.add(identifier)
            else:
                self._absent[identifier] = now + self.index_refresh_s
                if len(self._absent) > 100_000:
                    self._absent.clear()
        return found

    # -- prefetch ------------------------------------------------------------------
    def request(self, identifier: str, inline: bool = False) -> State:
        """Where an item stands; starts a background read for a known, unstaged item.

        ``inline`` (a disk store on a local filesystem): load it here and now when that
        is cheap — mapping a file, or reading one under ``MMAP_MIN_BYTES``, takes tens of
        microseconds, less than handing it to a thread and waiting for the answer. A large
        entry whose stored version is not verified yet (a checksum pass over every page,
        possibly from a cold disk) still goes to the background threads. The caller bounds
        how much inline work it allows per step."""
        now = time.monotonic()
        with self._lock:
            if identifier in self._staged:
                self._staged.move_to_end(identifier)
                return State.READY
            inflight = self._inflight.get(identifier)
        if inflight is not None:
            return State.PENDING if now - inflight[1] < self.load_timeout_s else State.MISS
        if not self.known(identifier):
            return State.MISS
        if inline and self.store.mapped_loads:
            staged = self._load(identifier, inline=True)
            if staged is not _DEFER:
                return State.READY if staged is not None else State.MISS
        with self._lock:
            if identifier in self._inflight or identifier in self._staged:
                return State.PENDING if identifier in self._inflight else State.READY
            fut = self._pool.submit(self._load, identifier)
            self._inflight[identifier] = (fut, now)
        return State.PENDING

    def wait(self, identifiers, timeout: float) -> None:
        """Block up to ``timeout`` s for the in-flight reads of ``identifiers`` (the
        waiting releases the GIL, so the load threads run at full speed meanwhile)."""
        from concurrent.futures import wait as wait_futures

        with self._lock:
            futs = [self._inflight[i][0] for i in identifiers if i in self._inflight]
        if futs and timeout > 0:
            wait_futures(futs, timeout=timeout)

    def is_ready(self, identifier: str) -> bool:
        with self._lock:
            return identifier in self._staged

    def get_staged(self, identifier: str) -> Staged | None:
        with self._lock:
            return self._staged.get(identifier)

    def reject(self, identifier: str, reason: str) -> None:
        """Drop a staged entry the engine cannot use (e.g. wrong token count)."""
        with self._lock:
            st = self._staged.pop(identifier, None)
            if st is not None:
                self._staged_bytes -= st.nbytes
            self._bad[identifier] = time.monotonic() + 60.0
            self._note_reason(identifier, "corrupt")
        self.count("load_errors")
        self.warn.warning("reject:" + reason, "encache: entry %s unusable (%s); re-encoding",
                          identifier, reason)

    def load_now(self, identifier: str) -> Staged | None:
        """Synchronous read + verify (tools, tests, and the worker-side fallback)."""
        return self._load(identifier, register=False)

    def _load(self, identifier: str, register: bool = True, inline: bool = False):
        """Read + validate one entry; stage it (``register``). Returns the Staged entry,
        None for a miss, or ``_DEFER`` (``inline`` only) when the work is too big to do
        in the caller's thread."""
        t0 = time.perf_counter()
        staged = None
        try:
            got = self.store.read_entry(identifier)
            if got is None:
                with self._lock:
                    self._index.discard(identifier)
                    self._absent[identifier] = time.monotonic() + self.index_refresh_s
            else:
                blob, version = got
                known = self._known(identifier, version)
                if inline and len(blob) > INLINE_VERIFY_MAX and known is None:
                    return _DEFER
                if known is None:
                    meta, offset = self._validate(identifier, blob, version)
                else:
                    meta, offset = known[1], known[2]
                    now = time.monotonic()
                    if now - known[3] > PREFAULT_AFTER_S:
                        # not read for a while: its pages may have left the page cache;
                        # start fetching them now rather than in the model step
                        prefault(blob)
                    known[3] = now
                if self.encoder_config is not None and meta.encoder_config != self.encoder_config:
                    self._mismatch(identifier, meta.encoder_config)
                elif self.lora_digests and self._lora_stale(identifier, meta):
                    pass
                else:
                    staged = Staged(identifier, meta, blob, offset, time.perf_counter() - t0,
                                    version)
        except CorruptEntry as e:
            with self._lock:
                self._bad[identifier] = time.monotonic() + 60.0
                self._note_reason(identifier, "corrupt")
            self.count("load_errors")
            self.warn.warning("corrupt", "encache: entry %s in %s is corrupt (%s); re-encoding",
                              identifier, self.store.url, e)
        except Exception as e:  # store unreachable, I/O error: a miss, never an outage
            self._store_down()
            self.count("load_errors")
            self.warn.warning("load", "encache: cannot load %s from %s: %s; re-encoding",
                              identifier, self.store.url, e)
        if register:
            with self._lock:
                self._inflight.pop(identifier, None)
                if staged is not None:
                    self._stage(staged)
        return staged

    def _mismatch(self, identifier: str, stamped: str) -> None:
        """An entry produced under another encoder config: a miss (the engine re-encodes;
        a producer on this config overwrites it), retried after a minute."""
        with self._lock:
            self._bad[identifier] = time.monotonic() + 60.0
            self._note_reason(identifier, "config")
        self.count("config_mismatches")
        self.warn.warning("encoder-config",
                          "encache: entry %s in %s was produced under encoder config %r, this "
                          "engine's is %r (server mm_processor_kwargs / revision / tag "
                          "differ); re-encoding", identifier, self.store.url,
                          stamped or "default", self.encoder_config or "default")

    def _lora_stale(self, identifier: str, meta: EntryMeta) -> bool:
        """A LoRA entry stamped with another adapter digest than the one this engine
        serves under that name (a retrained adapter): a miss, counted ``lora_stale``."""
        if not meta.lora_digest:
            return False  # unstamped (older entries, hub adapters): nothing to compare
        name = meta.lora or identifier.rpartition(":")[0]
        want = self.lora_digests.get(name)
        if not want or want == meta.lora_digest:
            return False
        with self._lock:
            self._bad[identifier] = time.monotonic() + 60.0
            self._note_reason(identifier, "lora_stale")
        self.count("lora_stale")
        self.warn.warning("lora-stale:" + name,
                          "encache: entries for LoRA %r in %s were produced with adapter "
                          "digest %s, this engine serves %s under that name (retrained?); "
                          "re-encoding. Refresh them with `encache precompute --lora %s "
                          "--lora-path DIR` or remove them with `encache purge --lora %s "
                          "--stale`", name, self.store.url, meta.lora_digest, want, name, name)
        return True

    def _note_reason(self, identifier: str, reason: str) -> None:  # caller holds the lock
        if len(self._reasons) > 100_000:
            self._reasons.clear()
        self._reasons[identifier] = reason

    def miss_reason(self, identifier: str) -> str:
        """Why ``identifier`` was a miss: ``config``, ``lora_stale``, ``corrupt`` (an
        entry was found but not usable), else ``absent``."""
        with self._lock:
            if self._bad.get(identifier, 0) > time.monotonic():
                return self._reasons.get(identifier, "corrupt")
        return "absent"

    def _known(self, identifier: str, version) -> list | None:
        """The record ``[identifier, meta, offset, last_load]`` of an already validated
        stored version, or None (unversioned, ``verify="always"``, or not seen yet)."""
        if version is None or self.verify_always:
            return None
        with self._lock:
            known = self._verified.get(version)
            if known is None or known[0] != identifier:
                return None
            self._verified.move_to_end(version)
            return known

    def _validate(self, identifier: str, blob, version) -> tuple[EntryMeta, int]:
        """Header, size and (per ``verify``) checksum checks; remembered per version."""
        meta, offset = validate_blob(blob, identifier=identifier, verify=self.verify)
        if version is not None and not self.verify_always:
            with self._lock:
                self._verified[version] = [identifier, meta, offset, time.monotonic()]
                if len(self._verified) > VERIFIED_VERSIONS:
                    self._verified.popitem(last=False)
        return meta, offset

    def forget_verified(self) -> None:
        """Verify every stored version again on its next load (tests, benchmarks)."""
        with self._lock:
            self._verified.clear()

    def _stage(self, staged: Staged) -> None:  # caller holds the lock
        old = self._staged.pop(staged.identifier, None)
        if old is not None:
            self._staged_bytes -= old.nbytes
        self._staged[staged.identifier] = staged
        self._staged_bytes += staged.nbytes
        while self._staged_bytes > self.staging_bytes and len(self._staged) > 1:
            _, evicted = self._staged.popitem(last=False)
            self._staged_bytes -= evicted.nbytes

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                futs = [f for f, _ in self._inflight.values()]
            if not futs:
                return
            for f in futs:
                f.exception(timeout=max(0.0, deadline - time.monotonic()))

    # -- counters ------------------------------------------------------------------
    def count(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + value
            self._interval[name] = self._interval.get(name, 0) + value
        if self._live is not None:
            self._live.add(name, value)

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            if len(self._latencies) < 10_000:
                self._latencies.append(seconds)

    def take_interval(self) -> dict:
        """Counter deltas and load latencies since the last call (for vLLM's metrics)."""
        with self._lock:
            data, self._interval = self._interval, {}
            lat, self._latencies = self._latencies, []
            if lat:
                data["load_latencies"] = lat
            if data or self._store_gauges:
                data["staged_bytes"] = self._staged_bytes
                data.update(self._store_gauges)
                self._store_gauges = {}  # report each sample once
        return data

    def maybe_flush(self, force: bool = False) -> None:
        """Persist counter deltas to the store (called by the background thread)."""
        now = time.monotonic()
        if not force and now - self._last_flush < self.counters_flush_s:
            return
        with self._lock:
            deltas, self._counters = self._counters, {}
            self._last_flush = now
        if not deltas or self._live is not None or self.store.read_only:
            # recorded in place already, or a read-only store that records nothing (the
            # engine's metrics still do)
            return
        self._flush(deltas)

    def _flush(self, deltas: dict[str, float]) -> None:
        try:
            self.store.add_counters(deltas)
        except Exception as e:
            with self._lock:  # keep them for the next flush
                for k, v in deltas.items():
                    self._counters[k] = self._counters.get(k, 0) + v
            self.warn.warning("counters", "encache: cannot record counters in %s: %s",
                              self.store.url, e)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.maybe_flush(force=True)
        self._pool.shutdown(wait=False, cancel_futures=True)
