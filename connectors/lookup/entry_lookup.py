"""EntryLookup: the consumer scheduler's view of the store, composed of its parts.

One object per scheduler-side connector (:mod:`encache.connectors.vllm.scheduler`). It
wires the parts together and runs their background thread; each part is its own module:

* :mod:`.index` — what the store holds (``StoreIndex``);
* :mod:`.breaker` — store down: every lookup a miss for a while (``CircuitBreaker``); of a
  store whose parts fail apart (a Redis Cluster), only the lookups the failed part serves;
* :mod:`.loader` — the load pool, in-flight reads, inline loads, verify ahead;
* :mod:`.verified` — verify once per stored version (``VerifiedVersions``);
* :mod:`.staging` — validated bytes waiting for the worker (``StagingArea``);
* :mod:`.checks` — encoder-config and LoRA stamps (``EntryChecks``);
* :mod:`.misses` — why an item was a miss, unusable entries skipped (``MissReasons``);
* :mod:`.metrics` — counters to the store and to vLLM's metrics (``LookupMetrics``).

The background thread (``encache-index``) refreshes the index every ``index_refresh_s``
(and queues verify-ahead passes for new entries; probes the parts of the store whose
breaker is open), samples store-wide facts every
``store_stats_s`` and flushes counters every ``counters_flush_s``. Once, after the first
refresh, a thread (``encache-verify-start``) verifies the most recently used entries this
engine can use, up to ``verify_ahead_start_bytes``: a restarted consumer forgot which
versions it had verified, and its hot set would otherwise pay the checksum on the request
path. Before that pass it reads the store's log of versions verified since the host booted
(``remember_verified``; local disk stores), so what an earlier consumer verified is not
hashed again, inside the budget or beyond it.
"""

from __future__ import annotations

import logging
import threading
import time

from ..ratelimit import RateLimitedLog
from ..store.base import JOURNAL_FULL_CHECK_S, Store, StoreError
from ..store.throttle import ScanThrottle
from .breaker import CircuitBreaker
from .checks import EntryChecks
from .index import StoreIndex
from .loader import DEFER, VERIFY_AHEAD_START_BYTES, Loader, State
from .metrics import LookupMetrics
from .misses import MissReasons
from .staging import Staged, StagingArea
from .verified import VerifiedVersions

log = logging.getLogger("encache.lookup")


class EntryLookup:
    def __init__(self, store: Store, *, load_threads: int = 4, staging_bytes: int = 512 << 20,
                 load_timeout_s: float = 5.0, index_refresh_s: float = 5.0,
                 verify: bool | str = True, counters_flush_s: float = 0.5,
                 store_stats_s: float = 30.0, encoder_config: str | None = None,
                 verify_ahead: bool = True,
                 verify_ahead_start_bytes: int = VERIFY_AHEAD_START_BYTES,
                 model: str | None = None, remember_verified: bool = True,
                 shared_from: int | None = None, host_staging=None):
        """``shared_from``: entries of at least this many bytes that a load receives or
        reads (Redis, Redis Cluster, a network filesystem) go into shared memory that a
        worker process maps (``store/memfd.py``); None: private memory.
        ``host_staging(n)``: instead, the buffer such a load goes into when a worker in
        this process copies entries to an accelerator from it (page-locked staging,
        ``vllm/device_copy.py``); with ``host_staging.stages`` a first load of a disk entry
        reads into it too (hashed in the same pass when it must be) where the store would
        otherwise map the entry."""
        self.store = store
        self.model = model  # the engine's model id: start-up verify-ahead skips other models'
        self.verify_ahead_start_bytes = max(0, int(verify_ahead_start_bytes))
        #: entries the start-up verify-ahead pass verified (None until it finished)
        self.verified_at_start: int | None = None
        self.start_verify_done = threading.Event()
        self.store_stats_s = store_stats_s
        self.index_refresh_s = index_refresh_s
        self.counters_flush_s = counters_flush_s
        self.warn = RateLimitedLog(log)
        self.verified = VerifiedVersions(
            verify, log=store.verified_log() if remember_verified else None)
        self.verify, self.verify_always = self.verified.verify, self.verified.verify_always
        # versions only help when checksums run once: nothing to do ahead otherwise
        # (and only a local store has versions: Redis values are verified on every load)
        self.verify_ahead = (verify_ahead and self.verify and not self.verify_always
                             and store.local)
        self.breaker = CircuitBreaker()
        self.index = StoreIndex(store, index_refresh_s)
        self.staging = StagingArea(staging_bytes)
        self.misses = MissReasons()
        # counts go straight into a per-process file where the store offers one (disk):
        # they survive the engine's SIGKILL; otherwise they are batched and flushed
        self.metrics = LookupMetrics(store, self.warn, counters_flush_s)
        self.checks = EntryChecks(store.url, encoder_config, self.misses, self.metrics,
                                  self.warn)
        self.loader = Loader(store, threads=load_threads, timeout_s=load_timeout_s,
                             index=self.index, verified=self.verified, staging=self.staging,
                             checks=self.checks, misses=self.misses, metrics=self.metrics,
                             breaker=self.breaker, warn=self.warn, shared_from=shared_from,
                             host_staging=host_staging)
        self._journal_cursor = None  # the store's change journal, read up to here
        #: staged entries checked in full while the journal's part of the store is down
        self._unjournaled_checks = ScanThrottle(0.05)
        self._next_full_check = 0.0  # an incomplete journal: all staged re-checked then
        self._closed = threading.Event()
        self._background = threading.Thread(target=self._background_loop, name="encache-index",
                                             daemon=True)
        self._background.start()

    # -- settings the connector shares ---------------------------------------------
    @property
    def encoder_config(self) -> str | None:
        """The engine's encoder-config digest (None: accept any entry)."""
        return self.checks.encoder_config

    @property
    def lora_digests(self) -> dict[str, str]:
        """LoRA name -> adapter digest this engine serves (the connector keeps it)."""
        return self.checks.lora_digests

    @lora_digests.setter
    def lora_digests(self, value: dict[str, str]) -> None:
        self.checks.lora_digests = value

    @property
    def load_timeout_s(self) -> float:
        return self.loader.timeout_s

    @property
    def staging_bytes(self) -> int:
        return self.staging.max_bytes

    # -- background ----------------------------------------------------------------
    def _background_loop(self) -> None:
        """Refresh the index and persist counters, each on its own period."""
        next_index = 0.0
        next_stats = 0.0
        tick = max(0.05, min(self.index_refresh_s, self.counters_flush_s, self.store_stats_s))
        while not self._closed.is_set():
            now = time.monotonic()
            if now >= next_index:
                down: dict[str, str] = {}  # parts of the store this refresh found down
                try:
                    new = self.index.refresh()
                    down.update(self.index.down)
                    if self.verify_ahead and self.index.is_ready() and new:
                        self.loader.verify_ahead(new, self._closed)
                    self._revalidate_staged(down)
                    self.breaker.reset()
                except Exception as e:  # store down: keep the old index, retry later
                    # (one part of it down: only that part's lookups miss meanwhile)
                    part = getattr(e, "domain", None)
                    if part is None:
                        self.breaker.trip()
                        self.warn.warning("index", "encache: cannot refresh the index of "
                                          "%s: %s", self.store.url, e)
                    else:
                        down[part] = getattr(e, "reason", str(e))
                for part, reason in down.items():  # the others were refreshed
                    self.breaker.trip(part)
                    self.warn.warning("index:" + part, "encache: %s: %s does not answer "
                                      "(%s): its entries are not loaded from it until it does",
                                      self.store.url, part, reason)
                self._probe_domains(skip=down)
                try:  # e.g. drop kept buffers of entries other processes removed
                    self.store.maintain()
                except Exception as e:
                    self.warn.warning("maintain", "encache: housekeeping of %s failed: %s",
                                      self.store.url, e)
                if not self.index.is_ready():
                    self.index.mark_ready()
                    self._start_verify_recent()
                next_index = now + self.index_refresh_s
            try:  # (nothing a store holds may stop this thread: it is the index's only one)
                if now >= next_stats and not self.breaker.is_open():
                    next_stats = now + self.store_stats_s
                    self.metrics.sample_store(len(self.index))
                self.metrics.maybe_flush()
            except Exception as e:
                self.warn.warning("stats", "encache: cannot update the metrics of %s: %s",
                                  self.store.url, e)
            self._closed.wait(tick)

    def _probe_domains(self, skip) -> None:
        """Ask each part of the store whose breaker is open whether it serves again
        (``Store.probe_domain``; ``skip``: those this refresh just found down): the
        first answer closes that part's breaker, as the refresh does the store's."""
        for domain in self.breaker.tripped_domains():
            if domain in skip:
                continue
            try:
                self.store.probe_domain(domain)
            except Exception as e:
                self.breaker.trip(domain)
                self.warn.warning("probe", "encache: %s: %s still fails: %s",
                                  self.store.url, domain, e)
            else:
                self.breaker.reset(domain)

    def _unchanged(self, entries) -> list[bool | None]:
        """``Store.unchanged`` per failure domain of a store whose parts fail apart
        (``Store.unchanged_by_part``): a part that cannot answer trips its breaker and its
        entries stay unknown (None: kept, checked again next time) while the other parts'
        are checked."""
        failed: dict = {}
        out = self.store.unchanged_by_part(entries, failed)
        for domain, e in failed.items():
            self.breaker.trip(domain)
            self.warn.warning("probe", "encache: %s: %s fails: %s", self.store.url,
                              domain, e)
        return out

    def _revalidate_staged(self, down: dict) -> None:
        """What a purge, a quarantine or a rewrite elsewhere changed is no longer served
        from memory: staged entries the store's journal names as changed are checked
        against it, and those staged since the last check, every refresh. All of them
        are checked when the journal cannot tell, every ``JOURNAL_FULL_CHECK_S`` when it
        can miss a change (a writer killed between its commit and its record, a program
        other than encache), and without a journal whenever the store changed. A local
        disk store's version token sees every change, even one made by hand, for two
        ``stat`` calls: there it is used instead of the journal. Where the journal's
        part of the store does not answer (named in ``down``) but the others do, all of
        them are checked against the others (paced to 5 % of the time): a purge there
        still reaches this engine."""
        if self.store.supports_change_journal and not (self.store.local
                                                       and self.index.versioned):
            try:
                self._journal_cursor, changed = self.store.changes_since(self._journal_cursor)
            except StoreError as e:
                if e.domain is None:
                    raise
                down[e.domain] = e.reason
                if not self._unjournaled_checks.due():
                    return
                self._unjournaled_checks.run(
                    lambda: self._drop_changed(self.staging.revalidate(
                        self._unchanged, everything=True)))
                return
            everything = changed is None
            now = time.monotonic()
            if not self.store.journal_complete and now >= self._next_full_check:
                everything = True
            if everything:
                self._next_full_check = now + JOURNAL_FULL_CHECK_S
            dropped = self.staging.revalidate(self._unchanged, everything=everything,
                                              also=changed)
        else:
            dropped = self.staging.revalidate(self._unchanged,
                                              everything=self.index.changed)
        self._drop_changed(dropped)

    def _drop_changed(self, dropped: list[str]) -> None:
        """Staged entries a revalidation dropped: forgotten by the index, counted."""
        if dropped:
            for identifier in dropped:
                self.index.forget(identifier)
            self.metrics.count("staged_invalidated", len(dropped))
            log.info("encache: %d staged entr%s changed or removed in %s: no longer served",
                     len(dropped), "y" if len(dropped) == 1 else "ies", self.store.url)

    def _start_verify_recent(self) -> None:
        start_pass = self.verify_ahead and self.verify_ahead_start_bytes
        if not (start_pass or self.verified.log is not None):
            self.start_verify_done.set()
            return

        def run():
            try:
                self.verified.load_log()
                if start_pass:
                    self.verified_at_start = self.loader.verify_recent(
                        self.verify_ahead_start_bytes, self._closed, model=self.model,
                        encoder_config=self.checks.encoder_config)
            except Exception as e:  # store down: the request path verifies instead
                self.warn.warning("verify-start", "encache: start-up verify-ahead of %s "
                                  "stopped: %s", self.store.url, e)
            finally:
                self.start_verify_done.set()

        threading.Thread(target=run, name="encache-verify-start", daemon=True).start()

    def wait_index(self, timeout: float | None = None) -> bool:
        """Block until the first index refresh finished (or failed)."""
        return self.index.wait_ready(timeout)

    # -- the scheduler's questions -------------------------------------------------
    def probably_stored(self, identifier: str, now: float | None = None) -> bool:
        """Is ``identifier`` worth a read? False when the entry was rejected lately, or
        while the breaker is open (unless a local tier holds a current copy: a stat);
        else what the index says (memory speed, may be stale)."""
        now = time.monotonic() if now is None else now
        if self.misses.is_rejected(identifier, now):
            return False
        if self.store_down(identifier, now):  # what this node holds is still served
            return self.store.holds_locally(identifier)
        try:
            return self.index.holds(identifier, now)
        except Exception as e:
            self.breaker.trip(self.store.failure_domain(identifier))
            self.warn.warning("load", "encache: cannot reach %s: %s; re-encoding", self.store.url, e)
            return False

    def store_down(self, identifier: str, now: float) -> bool:
        """Is the breaker open for ``identifier``: the store's, or that of the part of
        the store serving it (a failure domain is looked up only once one tripped)."""
        breaker = self.breaker
        return breaker.is_open(now) or (breaker.has_tripped_domains() and breaker.is_open(
            now, self.store.failure_domain(identifier)))

    def request(self, identifier: str, inline: bool = False) -> State:
        """Where an item stands; starts a background read for a stored, unstaged item.

        ``inline`` (a disk store on a local filesystem, or a local tier's copy): load it
        here and now when that is cheap — mapping a file, or reading one under ``map_min_bytes``, takes tens of
        microseconds, less than handing it to a thread and waiting for the answer. A large
        entry whose stored version is not verified yet (a checksum pass over every page,
        possibly from a cold disk) still goes to the background threads. The caller bounds
        how much inline work it allows per step."""
        now = time.monotonic()
        if self.staging.touch(identifier):
            return State.READY
        state = self.loader.inflight_state(identifier, now)
        if state is not None:
            return state
        if not self.probably_stored(identifier, now):
            if self._write_in_flight(identifier, now):
                return self.loader.start(identifier, now, committing=True)
            return State.MISS
        if inline and self.store.mapped_loads and (self.store.local
                                                   or self.store.holds_locally(identifier)):
            staged = self.loader.load(identifier, inline=True)
            if staged is not DEFER:
                return State.READY if staged is not None else State.MISS
        return self.loader.start(identifier, now)

    def _write_in_flight(self, identifier: str, now: float) -> bool:
        """An encoder's write of ``identifier`` is under way (``Store.in_flight``; EPD:
        the encoder's request finished once its write was visible): load it like a
        stored entry (its bytes once whole, or the committed entry), rather than encode
        it again."""
        if not self.store.supports_in_flight or self.misses.is_rejected(identifier, now) \
                or self.store_down(identifier, now) \
                or not self.loader.waits_for_commit(identifier, now):
            return False
        try:
            # the commit may land between the index's look and this one: then the entry
            # is there (in this order, no moment of the write answers neither)
            return self.store.in_flight(identifier) or self.store.contains(identifier)
        except Exception:  # noqa: BLE001 - cannot tell: a miss, as before
            return False

    def wait(self, identifiers, timeout: float) -> None:
        """Block up to ``timeout`` s for the in-flight reads of ``identifiers``."""
        self.loader.wait(identifiers, timeout)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Block until no read is in flight (tests, benchmarks)."""
        self.loader.wait_idle(timeout)

    def is_ready(self, identifier: str) -> bool:
        return identifier in self.staging

    def get_staged(self, identifier: str) -> Staged | None:
        return self.staging.get(identifier)

    def load_now(self, identifier: str) -> Staged | None:
        """Synchronous read + verify, not staged (tools, tests, benchmarks)."""
        return self.loader.load(identifier, register=False)

    def recheck(self, identifier: str) -> None:
        """Look ``identifier`` up in the store again at its next request, even if it was
        found absent a moment ago (a metadata-only item waits for its entry)."""
        self.index.recheck(identifier)

    def reject(self, identifier: str, reason: str) -> None:
        """Drop a staged entry the engine cannot use (e.g. wrong token count)."""
        self.staging.discard(identifier)
        self.misses.reject(identifier, "corrupt")
        self.metrics.count("load_errors")
        self.warn.warning("reject:" + reason, "encache: entry %s unusable (%s); re-encoding",
                          identifier, reason)

    def refuse(self, identifier: str) -> None:
        """Drop a staged entry one request must not be served (bound to other inputs than
        the request's): not skipped for other requests, whose inputs may match it, and a
        version written since (an encoder replacing a planted entry) is read at the next
        request; the caller counts and reports the miss."""
        self.staging.discard(identifier)

    def miss_reason(self, identifier: str) -> str:
        """Why ``identifier`` was a miss: ``config``, ``lora_stale``, ``corrupt`` (an
        entry was found but not usable), else ``absent``."""
        return self.misses.reason(identifier)

    # -- verified versions ---------------------------------------------------------
    def verified_count(self, identifiers) -> int:
        """How many of ``identifiers`` have a verified version on record (tests, benchmarks)."""
        return self.verified.count(identifiers)

    def forget_verified(self) -> None:
        """Verify every stored version again on its next load (tests, benchmarks)."""
        self.verified.forget_all()

    # -- counters ------------------------------------------------------------------
    def count(self, name: str, value: float = 1) -> None:
        self.metrics.count(name, value)

    def observe_load(self, seconds: float) -> None:
        self.metrics.observe_load(seconds)

    def take_interval(self) -> dict:
        """Counter deltas and load latencies since the last call (for vLLM's metrics),
        with the breaker's state: is the store down, and how many of its parts."""
        data = self.metrics.take_interval(self.staging.nbytes)
        if data:
            now = time.monotonic()
            data["store_down"] = int(self.breaker.is_open(now))
            data["store_parts_down"] = self.breaker.open_domains(now)
        return data

    def maybe_flush(self, force: bool = False) -> None:
        """Persist counter deltas to the store (called by the background thread)."""
        self.metrics.maybe_flush(force)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.metrics.maybe_flush(force=True)
        self.loader.shutdown()
        if self.verified.log is not None:
            self.verified.log.close()
