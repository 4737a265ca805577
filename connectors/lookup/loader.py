"""Reading entries: the load pool, in-flight reads, inline loads, verify ahead.

A request's stored item is read and fully validated (header, size, checksum — once per
stored version, :mod:`.verified`) by a thread pool while the engine keeps stepping; the
request is deferred at most ``load_timeout_s``, then the item is a miss and re-encoded.
A local store's entry may instead be read inline, in the caller's thread, when that is
cheaper than a thread hand-off (the caller budgets inline work per step). A valid entry
is checked for this engine (:mod:`.checks`) and staged (:mod:`.staging`). A corrupt
entry is rejected for a while (:mod:`.misses`); a store error trips the breaker
(:mod:`.breaker`): both are misses, never an outage.

*Verify ahead*: an entry that appears while the engine runs (a producer wrote it) is
validated by the same threads as soon as the index refresh sees it, so its first
request-path load already finds a verified version. At start (a restart forgets every
verified version) the most recently used entries this engine can use are validated the
same way, newest first, up to a byte budget (:meth:`Loader.verify_recent`), before the
requests that will want them arrive.

The read and the validation of one entry are :func:`read_entry` and :func:`validate`:
the one place to change how the lookup reads or checks a stored entry.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from enum import Enum

from ..ratelimit import RateLimitedLog
from ..store.base import Store
from ..store.files import populate, prefault, uninitialized
from ..store.memfd import shared_buffer
from ..store.entry import CorruptEntry, EntryMeta, NewerFormat, validate_blob
from .breaker import CircuitBreaker
from .checks import EntryChecks
from .index import StoreIndex
from .metrics import LookupMetrics
from .misses import MissReasons
from .staging import Staged, StagingArea
from .verified import VerifiedVersions

log = logging.getLogger("encache.lookup")

INLINE_VERIFY_MAX = 1 << 20  # larger unverified entries are checked in the background
PREFAULT_AFTER_S = 10.0  # a verified mapping not loaded for this long gets readahead
VERIFY_AHEAD_MAX = 1024  # per index refresh; the rest is verified on first load
#: start-up verify-ahead budget: the store's budget of kept mappings (disk/recent.py), so what is
#: verified at start can still be mapped when its first request comes soon after
VERIFY_AHEAD_START_BYTES = 2 << 30
DEFER = object()  # load(inline=True): too big to do in the caller's thread
SHUTDOWN_WAIT_S = 2.0  # how long closing waits for the loads running at the time
COMMIT_GIVE_UP_S = 10.0  # a write that did not commit in time is not waited for again this long


class _Deferred(Exception):
    """Raised inside a first load that turned out too big to check inline."""


class State(Enum):
    READY = "ready"  # verified bytes are staged: say yes
    PENDING = "pending"  # a read is in flight: defer the request
    MISS = "miss"  # not in the store, unreadable, or too slow: encode


def read_entry(store: Store, identifier: str):
    """``(blob, version)`` of the stored entry (a :class:`~..store.loaded.Loaded`: it
    says which tier served it and pins it), or None (not there)."""
    return store.read_entry(identifier)


def validate(verified: VerifiedVersions, identifier: str, blob, version,
             metrics: LookupMetrics | None = None) -> tuple[EntryMeta, int]:
    """Header, size and (per ``verify``) checksum checks; remembered per version. A
    version verified (or encoded by a producer on this host) earlier this boot (the
    store's log) skips the checksum. Counted
    (``metrics``): ``checksums`` run, ``checksums_skipped`` thanks to the log."""
    hashing = needs_checksum(verified, identifier, version)
    meta, offset = validate_blob(blob, identifier=identifier, verify=hashing)
    validated(verified, identifier, version, meta, offset, hashing, metrics)
    return meta, offset


def needs_checksum(verified: VerifiedVersions, identifier: str, version) -> bool:
    """Whether a load of this stored version hashes its bytes (``verify``, and not a
    version verified earlier this boot)."""
    return verified.verify and not verified.trusted(identifier, version)


def validated(verified: VerifiedVersions, identifier: str, version, meta: EntryMeta,
              offset: int, hashed: bool, metrics: LookupMetrics | None) -> None:
    """Remember a version that passed validation, and count how (:func:`validate`)."""
    trusted = verified.verify and not hashed
    if trusted:
        verified.trusted_loads += 1
    verified.remember(identifier, version, meta, offset, checksummed=hashed)
    if metrics is not None and verified.verify:
        metrics.count("checksums_skipped" if trusted else "checksums")


class Loader:
    def __init__(self, store: Store, *, threads: int, timeout_s: float, index: StoreIndex,
                 verified: VerifiedVersions, staging: StagingArea, checks: EntryChecks,
                 misses: MissReasons, metrics: LookupMetrics, breaker: CircuitBreaker,
                 warn: RateLimitedLog, shared_from: int | None = None, host_staging=None):
        self.store, self.timeout_s = store, timeout_s
        #: entries of at least this many bytes that a load receives or reads go into
        #: shared memory a worker process can map (memfd.py); None: private memory
        self.shared_from = shared_from
        #: ``host_staging(n)``: the buffer a load reads or receives an entry into when a
        #: worker in this process copies it to an accelerator from there (page-locked
        #: staging; ``host_staging.stages``: a first load of a disk entry reads into it
        #: too, hashed in the same pass when it must be)
        self.host_staging = host_staging
        self.index, self.verified, self.staging = index, verified, staging
        self.checks, self.misses, self.metrics = checks, misses, metrics
        self.breaker, self.warn = breaker, warn
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[Future, float]] = {}
        self._uncommitted: dict[str, float] = {}  # identifier -> until when not to wait
        self._closing = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="encache-load")

    # -- background reads ----------------------------------------------------------
    def inflight_state(self, identifier: str, now: float) -> State | None:
        """PENDING while a read of ``identifier`` runs, MISS once it ran longer than
        ``load_timeout_s``; None when no read is in flight."""
        inflight = self._inflight.get(identifier)  # one dict read: atomic under the GIL
        if inflight is None:
            return None
        return State.PENDING if now - inflight[1] < self.timeout_s else State.MISS

    def start(self, identifier: str, now: float, committing: bool = False) -> State:
        """Start a background read (unless one runs or the entry is staged already);
        ``committing``: a write of it is in flight (``Store.in_flight``): the read takes
        its bytes once whole, or the committed entry."""
        with self._lock:
            if identifier in self._inflight:
                return State.PENDING
            if identifier in self.staging:
                return State.READY
            fut = self._pool.submit(self.load, identifier, committing=committing)
            self._inflight[identifier] = (fut, now)
        return State.PENDING

    def wait(self, identifiers, timeout: float) -> None:
        """Block up to ``timeout`` s for the in-flight reads of ``identifiers`` (the
        waiting releases the GIL, so the load threads run at full speed meanwhile)."""
        with self._lock:
            futs = [self._inflight[i][0] for i in identifiers if i in self._inflight]
        if futs and timeout > 0:
            wait_futures(futs, timeout=timeout)

    def wait_idle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                futs = [f for f, _ in self._inflight.values()]
            if not futs:
                return
            for f in futs:
                f.exception(timeout=max(0.0, deadline - time.monotonic()))

    def waits_for_commit(self, identifier: str, now: float) -> bool:
        """Whether an in-flight write of ``identifier`` is worth waiting for: not when
        a wait for it ran out lately (a writer that lives but does not finish: a stopped
        or hung process; a killed writer's write is not in flight at all)."""
        return self._uncommitted.get(identifier, 0) <= now  # one dict read: atomic

    def _in_flight_load(self, identifier: str):
        """A write of ``identifier`` was in flight (``Store.in_flight``; EPD: the encoder
        answered once its write was visible): ``(read, meta, offset)`` of its
        bytes from the temp file once all are written (checked in full), or None once it
        is committed, gone, or not whole within ``load_timeout_s`` (the caller then loads
        the stored entry as usual). Counted as ``in_flight_loads``, the time it took as
        ``in_flight_wait_seconds`` (what PD spent waiting for encoders' writes)."""
        self.metrics.count("in_flight_loads")
        start = time.monotonic()
        try:
            return self._wait_in_flight(identifier, start + self.timeout_s)
        finally:
            self.metrics.count("in_flight_wait_seconds", time.monotonic() - start)

    def _wait_in_flight(self, identifier: str, deadline: float):
        hashed = []  # per look: whether its checksum ran

        def checksum(version) -> bool:  # (a producer on this host vouched for its bytes)
            hashed.append(needs_checksum(self.verified, identifier, version))
            return hashed[-1]

        with self.store.in_flight_wait(identifier) as wait:  # (set up before the first look)
            while not self._closing.is_set() and not self.store.contains(identifier):
                got = self.store.read_in_flight(identifier, checksum)
                if got is not None:
                    _, version, meta, offset = got
                    validated(self.verified, identifier, version, meta, offset, hashed[-1],
                              self.metrics)
                    return got, meta, offset
                if not self.store.in_flight(identifier):
                    break
                if time.monotonic() >= deadline:
                    with self._lock:
                        if len(self._uncommitted) > 10_000:
                            self._uncommitted.clear()
                        self._uncommitted[identifier] = time.monotonic() + COMMIT_GIVE_UP_S
                    break
                wait()
        return None

    def _being_written(self, identifier: str) -> bool:
        try:
            return (self.store.supports_in_flight and self.waits_for_commit(
                identifier, time.monotonic()) and self.store.in_flight(identifier))
        except Exception:  # noqa: BLE001 - cannot tell: the miss it was
            return False

    # -- one load ------------------------------------------------------------------
    def load(self, identifier: str, register: bool = True, inline: bool = False,
             committing: bool = False):
        """Read + validate one entry; stage it (``register``). Returns the Staged entry,
        None for a miss, or ``DEFER`` (``inline`` only) when the work is too big to do
        in the caller's thread. ``committing``: a write of it is in flight."""
        t0 = time.perf_counter()
        staged = None
        try:
            got = self._in_flight_load(identifier) if committing else None
            if got is None:
                if self.store.supports_verified_reads and (
                        not self.verified.seen(identifier) or self._reads_bytes(identifier)):
                    got = self._first_load(identifier, inline)  # one pass: read and check
                else:
                    got = self._load(identifier, inline)
            if got is None and not committing and self._being_written(identifier):
                # the index named it while its write was in flight (a disk store's
                # listing is a hint: directories, no stat): take that write's bytes
                if inline:
                    return DEFER  # (a wait: not in the scheduler's thread)
                got = self._in_flight_load(identifier) or self._load(identifier, inline)
            if got is DEFER:
                return DEFER
            if got is None:
                self.index.forget(identifier)
            elif self.checks.usable(identifier, got[1]):
                read, meta, offset = got  # (the read says where it came from)
                staged = Staged(identifier, meta, read[0], offset, time.perf_counter() - t0,
                                read[1], read.source, read.pin)
        except NewerFormat as e:  # a newer encache's entry: a miss here, left as it is
            self.misses.reject(identifier, "newer_format")
            self.warn.warning("newer", "encache: entry %s in %s was %s; re-encoding (an "
                              "upgraded encache serves it)", identifier, self.store.url,
                              e.detail)
        except CorruptEntry as e:
            self.misses.reject(identifier, "corrupt")
            self.metrics.count("load_errors")
            self.warn.warning("corrupt", "encache: entry %s in %s is corrupt (%s); re-encoding",
                              identifier, self.store.url, e)
        except Exception as e:  # store unreachable, I/O error: a miss, never an outage
            # (the part of the store that failed, if it names one: else the entry's part,
            # or the store as a whole)
            self.breaker.trip(getattr(e, "domain", None) or self.store.failure_domain(identifier))
            self.metrics.count("load_errors")
            self.warn.warning("load", "encache: cannot load %s from %s: %s; re-encoding",
                              identifier, self.store.url, e)
        if register:
            if staged is not None:
                self.staging.add(staged)  # before the read stops being in flight
            with self._lock:
                self._inflight.pop(identifier, None)
        return staged

    def _reads_bytes(self, identifier: str) -> bool:
        """Whether a load of ``identifier`` reads its bytes whatever was verified before
        (no kept mapping for :meth:`_load` to reuse): a store that reads every load
        (Redis, Redis Cluster, a network filesystem), or a local tier without a copy of
        it (the load goes to the shared store)."""
        store = self.store
        return not store.mapped_loads or not (store.local or store.holds_locally(identifier))

    def _first_load(self, identifier: str, inline: bool):
        """A version of ``identifier`` never validated here (every load of an entry an
        encoder instance just wrote, EPD), or any load that reads the bytes anyway
        (:meth:`_reads_bytes`): read and checked by
        ``Store.read_verified`` (one pass where the entry is read or received; a mapped
        entry is hashed over its mapping).
        A version validated here before (a store that reads every load: ``load_mode:
        read``, a network filesystem) is read with header checks only, as :meth:`_load`
        serves one: the checksum runs once per stored version.
        ``(read, meta, offset)`` (``read``: the store's record), None (absent) or
        ``DEFER``."""
        known = []  # the version was validated here before

        def checksum(version) -> bool:
            if self.verified.find(identifier, version) is not None:
                known.append(version)
                return False
            hashing = needs_checksum(self.verified, identifier, version)
            if inline and hashing and version is not None and version[2] > INLINE_VERIFY_MAX:
                raise _Deferred
            return hashing

        into = self._into if self.host_staging is None else self.host_staging
        try:
            got = self.store.read_verified(identifier, checksum, into=into)
        except _Deferred:
            return DEFER
        if got is None:
            return None
        _, version, meta, offset, hashed = got
        if not (known and known[-1] == version):  # (else remembered and counted already)
            validated(self.verified, identifier, version, meta, offset, hashed, self.metrics)
        return got, meta, offset

    def _into(self, n: int):
        """The buffer a load receives an entry of ``n`` bytes into (``shared_from``);
        private memory when no memfd can be had (descriptors or memory exhausted): the
        entry then reaches the workers as bytes, still a hit."""
        if self.shared_from is not None and n >= self.shared_from:
            try:
                return shared_buffer(n)
            except OSError as e:
                self.warn.warning("memfd", "encache: no shared memory for a load (%s): "
                                  "entries reach worker processes as bytes", e)
        return uninitialized(n)

    def _load(self, identifier: str, inline: bool):
        """A load that may reuse an earlier validation of the same stored version (the
        file mapped, or its recently served buffer: no copy, no hash): ``(read, meta,
        offset)``, None (absent) or ``DEFER``."""
        got = read_entry(self.store, identifier)
        if got is None:
            return None
        blob, version = got
        record = self.verified.find(identifier, version)
        if (inline and len(blob) > INLINE_VERIFY_MAX and record is None
                and not self.verified.trusted(identifier, version)):
            return DEFER
        if record is None:
            meta, offset = validate(self.verified, identifier, blob, version, self.metrics)
        else:
            meta, offset = record.meta, record.offset
            now = time.monotonic()
            if now - record.last_load > PREFAULT_AFTER_S:
                # not read for a while: its pages may have left the page cache;
                # start fetching them now rather than in the model step
                prefault(blob)
            record.last_load = now
        return got, meta, offset

    # -- verify ahead --------------------------------------------------------------
    def verify_ahead(self, identifiers, closed: threading.Event) -> None:
        """Queue checksum passes for entries that appeared since the last refresh."""
        for n, identifier in enumerate(identifiers):
            if n >= VERIFY_AHEAD_MAX or closed.is_set():
                break
            try:
                self._pool.submit(self._verify_one, identifier)
            except RuntimeError:  # the pool was shut down (close() raced us)
                break

    def verify_recent(self, budget_bytes: int, closed: threading.Event, *,
                      model: str | None = None, encoder_config: str | None = None) -> int:
        """Start-up: validate the entries used most recently (the store's access clock,
        else their creation time), newest first, until ``budget_bytes`` of them are
        verified; only entries of ``model`` and ``encoder_config`` when given (what this
        engine can use). Runs in the caller's thread, one entry at a time, so request
        loads never queue behind it. Returns how many entries it verified."""
        candidates = []
        for info in self.store.scan():
            if closed.is_set():
                return 0
            meta = info.meta
            if info.error is not None or meta is None or info.size > budget_bytes:
                continue
            if (model is not None and meta.model != model) or (
                    encoder_config is not None and meta.encoder_config != encoder_config):
                continue
            candidates.append((info.accessed or info.created or 0.0, info.size, info.identifier))
        candidates.sort(reverse=True)
        spent = done = 0
        for _, size, identifier in candidates:
            if closed.is_set() or spent + size > budget_bytes:
                break
            spent += size
            done += self._verify_one(identifier)
        return done

    def _verify_one(self, identifier: str) -> bool:
        """Background: validate the stored version (remembered, not staged); True when it
        is verified now. Errors are left to the request-path load, which counts and
        reports them."""
        try:
            got = read_entry(self.store, identifier)
            if got is None:
                return False
            blob, version = got
            if version is not None and self.verified.find(identifier, version) is None:
                if self.verified.trusted(identifier, version):
                    populate(blob)  # what the skipped checksum pass would have faulted in
                validate(self.verified, identifier, blob, version, self.metrics)
            del blob
            return version is not None
        except Exception:
            return False

    def shutdown(self) -> None:
        """Cancel the queued loads and wait (up to ``SHUTDOWN_WAIT_S``) for the running
        ones; one waiting for a write in flight stops at its next look. So a closed lookup
        leaves no thread reading the store or appending to its verified log."""
        self._closing.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            futs = [f for f, _ in self._inflight.values()]
        wait_futures(futs, timeout=SHUTDOWN_WAIT_S)
