"""EncacheSchedulerConnector: the scheduler-side half of :class:`EncacheConnector`.

A consumer's scheduler answers "is this item stored?" from memory and prefetches
verified entries in the background (:class:`~encache.connectors.lookup.EntryLookup`):

``ensure_cache_available`` requests the request's items (inline within a per-step budget
or on the load threads; the request is deferred while reads run) ->
``has_cache_item`` says yes only for a staged entry and pins it for this step ->
``update_state_after_alloc`` counts the hit (or the miss and its reason) and queues the
pinned entry -> ``build_connector_meta`` ships the queued entries to the worker as
:class:`~.loads.LoadItem` (bytes, or a pinned file for large disk entries and
workers in other processes).

A producer's scheduler keeps the adapter digest of each LoRA name it serves (sent to the
worker in the metadata, stamped into entries) and reports each finished request's items
(``request_finished``: the metadata vLLM's EPD proxy reads). An encoder-only producer
also reads the store: ``has_cache_item`` says yes for an item the store already holds for
it (same encoder config and adapter), so vLLM does not run the tower for it -- what was
precomputed, or encoded by another encoder instance, is not encoded again.

Entries are bound to their inputs (:mod:`.binding`, docs/security.md): a producer's
scheduler digests the processed inputs of each item it encodes and ships the digest to
its worker, which stamps it into the entry; a consumer's ``has_cache_item`` digests the
inputs a request carries for a staged entry and refuses one bound to other inputs
(another client's pixels under the same client ``uuid``: the request encodes its own
pixels, counted ``binding_mismatches`` / ``misses_binding``). A miss costs no digest, nor
does an entry whose writer keyed it by its content (``keyed_by``: precompute computes
each identifier from the item's bytes; an online producer's vLLM hashed it from them,
client uuids being namespaced apart, :mod:`.uuids`). An encoder-only producer skips only
an item whose entry is bound to its own inputs.

A consumer item that arrives *metadata-only* (vLLM's EPD proxy rewrites media into
``image_embeds`` references: no pixels) cannot be encoded here. Such an item's entry is
waited for up to ``load_timeout_s``; when it is absent, corrupt, stamped for another
config or late past that bound, the request is failed (``take_unavailable_requests``,
a request-level error the proxy retries) and counted (``unavailable_<reason>``) instead
of reaching a tower with nothing to encode.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from .diagnosis import MissDiagnosis
from ..encoder_config import holds
from ..lookup import EntryLookup, State
from ..store.lora_stamp import adapter_digest
from ..ratelimit import RateLimitedLog
from ..store import memfd
from ..store.keys import split_lora
from .binding import binding_to_check, item_binding
from .uuids import applies, is_content_hash
from .config import ConnectorConfig
from .device_copy import HostStaging
from .metadata import EncacheConnectorMetadata
from .loads import WORKER_READS_MIN_BYTES, LoadItem
from .metrics import EncacheStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("encache.connector")


class EncacheSchedulerConnector:
    PIN_STEPS = 16  # a pinned entry stays open this many scheduler steps…
    PIN_SECONDS = 1.0  # …and at least this long (workers read it within their step)
    PIN_MAX_FDS = 1024  # more pinned at once: ship bytes (never crowd the fd limit)

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig, store, *,
                 is_producer: bool, is_consumer: bool, encoder_config: str):
        self.config, self.store = config, store
        self.is_producer, self.is_consumer = is_producer, is_consumer
        model_config = vllm_config.model_config
        self.model_id = model_config.model
        # named in diagnostics: entry shapes are family-specific (crops, dynamic resolution)
        self.architecture = getattr(model_config, "architecture", None) or "this model"
        self.lookup: EntryLookup | None = None
        self.diagnosis: MissDiagnosis | None = None
        self._pinned: dict[str, Any] = {}  # staged entries has_cache_item said yes to
        self._need_loads: dict[str, Any] = {}  # ...and that were allocated: ship them
        self._inline_budget = config.inline_wait_s
        # LoRA name -> digest of the adapter served under it (stale-LoRA guard)
        self._lora_digests: dict[str, str] = {}
        self._lora_checked: dict[tuple[str, str], float] = {}
        # workers in other local processes open what they load themselves: a disk entry's
        # pinned file, or the shared memory a received entry was put in
        self._worker_procs = is_consumer and self._choose_worker_procs(vllm_config)
        if is_consumer:
            # (from 1 MiB whatever worker_loads says: a staged memfd holds a descriptor)
            shared_from = (WORKER_READS_MIN_BYTES if self._worker_procs and memfd.available()
                           else None)
            self.lookup = EntryLookup(
                store, **config.lookup_options(), model=self.model_id,
                encoder_config=encoder_config if config.check_encoder_config else None,
                shared_from=shared_from, host_staging=self._host_staging(vllm_config))
            self.lookup.lora_digests = self._lora_digests  # shared: kept up to date below
            self.diagnosis = MissDiagnosis(store, self.model_id)
            self.diagnosis.start()
        from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver
        # the placeholder-metadata fields per modality (what a metadata-only item carries)
        self._resolver = PlaceholderMetadataResolver(model_config)
        self.encoder_config = encoder_config
        #: encoder-only producers answer has_cache_item from the store (skip_existing)
        self._reads_store = is_producer and not is_consumer and config.skip_existing
        self._stored: dict[tuple[str, str], bool] = {}  # this step's answers (producers)
        self._unavailable: set[str] = set()  # request ids to fail (metadata-only items)
        self._waiting: dict[tuple[str, str], float] = {}  # (request, item) -> first seen
        self.warn = RateLimitedLog(log)
        self._step = 0
        self._pins: collections.deque = collections.deque()
        self._pinned_fds = 0
        # Bindings (.binding): identifier -> digest of the inputs of the request asked
        # about last (ensure_cache_available precedes has_cache_item for its items); per
        # (request, item) the digest once computed; producers: this step's encoded items
        # and, for resaves, the inputs vLLM's encoder cache holds each identifier from
        self._expect: dict[str, str] = {}
        self._request_bindings: dict[tuple[str, int], str | None] = {}
        # consumers: identifier -> ((request, item), inputs) of this step's requests
        self._inputs: dict[str, tuple[tuple[str, int], Any]] = {}
        self._step_bindings: dict[str, str] = {}
        self._encoded_bindings: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._binding_warned: set[str] = set()
        self._refused: set[str] = set()  # refused this step (a miss of reason "binding")
        # client uuids are namespaced here (.uuids): producers key content hashes by content
        self._content_hashes_keyed = applies(vllm_config)
        self._check_capacity()

    def _check_capacity(self) -> None:
        """Warn at start-up when the store can fill up badly (Redis maxmemory/policy)."""
        check = self.store.capacity_warnings
        if check is None:
            return
        try:
            for warning in check():
                log.warning("encache: %s: %s", self.store.url, warning)
        except Exception as e:  # unreachable now: lookups will be misses until it is back
            log.warning("encache: cannot check %s at start-up: %s", self.store.url, e)

    # -- lookups -------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        """Consumers, memory-speed: yes only for an entry already read and verified
        (staged) and bound to the request's own inputs where it has them. Encoder-only
        producers: yes when the store holds a usable entry bound to those inputs."""
        if self.lookup is None:
            return self._reads_store and self._holds(identifier, self._expect.get(identifier, ""))
        staged = self.lookup.get_staged(identifier)
        if staged is None:
            return False
        want = binding_to_check(staged.meta, lambda: self._binding_for(identifier))
        if want and staged.meta.binding != want and (
                staged.meta.binding or self.config.require_binding):
            self._refuse(identifier, staged.meta.binding)
            return False
        self._pinned[identifier] = staged  # survives staging eviction until this step ships
        return True

    def _refuse(self, identifier: str, stored: str) -> None:
        """An entry bound to other inputs than the request's (another client's pixels
        stored under this identifier: a client-chosen uuid), or unbound where
        ``require_binding`` is set: a miss, counted ``binding_mismatches`` (reason
        ``binding``), logged once per identifier; the request encodes its own inputs."""
        self.lookup.refuse(identifier)
        self._refused.add(identifier)
        self.lookup.count("binding_mismatches")
        if identifier in self._binding_warned:
            return
        if len(self._binding_warned) >= 10_000:
            self._binding_warned.clear()
        self._binding_warned.add(identifier)
        log.warning("encache: entry %s in %s was computed from other inputs than this "
                    "request's (%s); encoding the request's own", identifier, self.store.url,
                    "a client-chosen uuid?" if stored else "unbound entry, require_binding set")

    def _note_inputs(self, request: Request) -> None:
        """Consumers: remember, for this step, which inputs each of ``request``'s items
        carries (:meth:`_binding_for` digests them only when a stored entry must be
        compared with them: a miss, or an entry keyed by its content, costs no digest)."""
        rid = request.request_id
        for i, feature in enumerate(request.mm_features or ()):
            if feature.data is None or self._metadata_only(feature):
                self._inputs.pop(feature.identifier, None)  # nothing here to compare
            else:
                self._inputs[feature.identifier] = ((rid, i), feature.data)

    def _binding_for(self, identifier: str) -> str | None:
        """The binding of the inputs this step's request carries for ``identifier``
        (:meth:`_note_inputs`), digested once per request item; None without inputs."""
        noted = self._inputs.get(identifier)
        if noted is None:
            return None
        key, data = noted
        if key not in self._request_bindings:
            self._request_bindings[key] = item_binding(data)
            self.lookup.count("inputs_digested")
        return self._request_bindings[key]

    def _bindings_of(self, request: Request) -> None:
        """Note the binding of each of ``request``'s items that carries its processed
        inputs (:attr:`_expect`); an item without them (a processor-cache hit restored in
        the worker, a metadata-only reference) is left out: nothing here to compare."""
        rid = request.request_id
        for i, feature in enumerate(request.mm_features or ()):
            key = (rid, i)
            if key in self._request_bindings:
                binding = self._request_bindings[key]
            else:
                binding = None if self._metadata_only(feature) else item_binding(feature.data)
                self._request_bindings[key] = binding
            if binding:
                self._expect[feature.identifier] = binding
            else:
                self._expect.pop(feature.identifier, None)

    def _lost_from_store(self, scheduler_output: SchedulerOutput) -> list[str]:
        """Producers: items of this step's new requests that run no tower and are not
        loaded -- vLLM's own encoder cache answered them, so no ``save_caches`` comes --
        and that the store does not hold (purged or evicted since they were encoded):
        the worker saves them again from that cache (EPD: PD looks for them)."""
        new = [(req, getattr(req, "mm_features", None) or ())
               for req in scheduler_output.scheduled_new_reqs]
        encoding = {features[i].identifier for req, features in new
                    for i in scheduler_output.scheduled_encoder_inputs.get(req.req_id, ())
                    if i < len(features)}  # (saved by save_caches once encoded)
        out = []
        for req, features in new:
            for feature in features:
                identifier = feature.identifier
                if identifier in encoding or identifier in self._need_loads or identifier in out:
                    continue
                self._note_lora(req)
                # bound to the inputs vLLM's encoder cache holds it from (as encoded
                # here); unknown (encoded without inputs to digest): resaved unbound
                binding = self._encoded_bindings.get(identifier, "")
                if not self._holds(identifier, binding):
                    out.append(identifier)
                    if binding:
                        self._step_bindings[identifier] = binding
        return out

    def _holds(self, identifier: str, binding: str = "") -> bool:
        """Producers: does the store hold a usable entry for this engine, bound to
        ``binding`` when given (one header read, remembered for the step)? A store error
        is a no: the tower runs."""
        key = (identifier, binding)
        known = self._stored.get(key)
        if known is not None:
            return known
        lora = split_lora(identifier)[0]
        lora_digest = self._lora_digests.get(lora, "") if lora else ""
        try:
            found = holds(self.store, identifier, self.encoder_config, lora_digest, binding)
        except Exception as e:
            self.warn.warning("holds", "encache: cannot check %s for stored entries: %s; "
                              "encoding", self.store.url, e)
            found = False
        self._stored[key] = found
        return found

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Start background reads for this request's stored items; defer it while they run."""
        if self.lookup is None:
            if self._reads_store:
                self._note_lora(request)  # before has_cache_item checks the adapter's stamp
                self._bindings_of(request)
            return True
        self._note_lora(request)
        self._note_inputs(request)
        pending = self._start_loads(request, num_computed_tokens)
        if pending and self._inline_budget > 0:
            # an EPD encoder's write in flight under a client uuid (not stored yet, and
            # not a content hash its producer keys by content): digest the inputs its
            # entry will be compared with meanwhile
            for identifier in pending:
                if not (self.lookup.probably_stored(identifier)
                        or (self._content_hashes_keyed and is_content_hash(identifier))):
                    self._binding_for(identifier)
            # Most loads take well under a millisecond: wait for them here (a bounded
            # budget per scheduler step) rather than deferring the request by a whole step.
            t0 = time.perf_counter()
            self.lookup.wait(pending, self._inline_budget)
            self._inline_budget -= time.perf_counter() - t0
            pending = self._start_loads(request, num_computed_tokens)
        return not pending

    def _start_loads(self, request: Request, num_computed_tokens: int) -> list[str]:
        """Request every stored item the request still needs; return those in flight."""
        pending = []
        for i, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # already consumed into the KV cache
            metadata_only = self._metadata_only(feature)
            if metadata_only:  # its wait for the store starts when it is first seen
                self._waiting.setdefault((request.request_id, feature.identifier),
                                         time.monotonic())
            if self._inline_budget > 0:
                # a local read inline (budgeted per step) beats a thread hand-off
                t0 = time.perf_counter()
                state = self.lookup.request(feature.identifier, inline=True)
                self._inline_budget -= time.perf_counter() - t0
            else:
                state = self.lookup.request(feature.identifier)
            if state is State.MISS and metadata_only:
                state = self._cannot_encode(request, feature.identifier)
            if state is State.PENDING:
                pending.append(feature.identifier)
            elif state is State.READY:
                staged = self.lookup.get_staged(feature.identifier)
                want = request.get_num_encoder_embeds(i)
                if staged is not None and len(staged.meta.shape) == 2 and staged.meta.shape[0] != want:
                    self.lookup.reject(feature.identifier,
                                       f"{staged.meta.shape[0]} embeddings stored, {want} expected "
                                       f"by {self.architecture}")
        return pending

    def _metadata_only(self, feature) -> bool:
        """An item sent without its media (only the placeholder metadata, e.g. the image
        grid): the tower has nothing to encode, the entry must come from the store."""
        data = feature.data
        if data is None:  # a processor-cache hit: the media are restored later
            return False
        wanted = self._resolver.fields_for(feature.modality)
        return bool(wanted) and set(data.keys()) <= wanted

    def _cannot_encode(self, request: Request, identifier: str) -> State:
        """A metadata-only item the store did not deliver: wait for it (PENDING) up to
        ``load_timeout_s``, then fail the request (still PENDING: never scheduled)."""
        key = (request.request_id, identifier)
        now = time.monotonic()
        since = self._waiting.get(key, now)
        reason = self.lookup.miss_reason(identifier)
        if reason == "absent" and now - since < self.lookup.load_timeout_s:
            self.lookup.recheck(identifier)  # written by now? look again next step
            return State.PENDING
        self._waiting.pop(key, None)
        if request.request_id not in self._unavailable:
            self._unavailable.add(request.request_id)
            late = reason == "absent"
            self.lookup.count("unavailable")
            self.lookup.count("unavailable_" + ("late" if late else reason))
            self.warn.warning(
                "unavailable", "encache: request %s sent %s without its media and the store %s "
                "%s; failing the request (retry it through the encoder)", request.request_id,
                identifier, self.store.url,
                f"did not deliver it within {self.lookup.load_timeout_s:g} s" if late
                else f"holds no usable entry ({reason})")
        return State.PENDING

    def take_unavailable_requests(self) -> set[str]:
        """Requests to fail: a metadata-only item the store cannot deliver."""
        out, self._unavailable = self._unavailable, set()
        return out

    def _note_lora(self, request: Request) -> None:
        """Remember the digest of the adapter this request's LoRA name stands for (files
        re-checked at most every 10 s per name and path; hashed only when they change)."""
        lr = getattr(request, "lora_request", None)
        if lr is None:
            return
        name, path = lr.lora_name, getattr(lr, "lora_path", "") or ""
        now = time.monotonic()
        key = (name, path)
        if now - self._lora_checked.get(key, -1e9) < 10.0 and name in self._lora_digests:
            return
        self._lora_checked[key] = now
        digest = adapter_digest(path)
        if digest:
            self._lora_digests[name] = digest
        else:
            self._lora_digests.pop(name, None)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self.is_producer:
            self._note_lora(request)
            self._note_encoded(request, index)
        if self.lookup is None:
            return
        identifier = request.mm_features[index].identifier
        # Only what has_cache_item said yes to this step is an external load; an entry that
        # became ready after that answer was already scheduled for encoding.
        staged = self._pinned.get(identifier)
        if staged is None:
            self.lookup.count("misses")
            reason = ("binding" if identifier in self._refused
                      else self.lookup.miss_reason(identifier))
            if self.diagnosis is not None:
                reason = self.diagnosis.classify(reason)
            self.lookup.count("misses_" + reason)
            return
        self._need_loads[identifier] = staged
        self.lookup.count("hits")
        if staged.source is not None:  # a local tier: which one served it
            self.lookup.count("hits_" + staged.source)
        self.lookup.count("bytes_loaded", staged.meta.data_bytes)
        self.lookup.count("load_seconds", staged.load_seconds)
        self.lookup.observe_load(staged.load_seconds)

    def _note_encoded(self, request: Request, index: int) -> None:
        """Producers: the binding of an item this step allocates (encodes, or loads on a
        producer that also consumes), for its worker to stamp into the entry, and kept
        for a later resave of what vLLM's encoder cache then holds."""
        feature = request.mm_features[index]
        key = (request.request_id, index)
        binding = self._request_bindings.get(key)
        if key not in self._request_bindings:
            binding = None if self._metadata_only(feature) else item_binding(feature.data)
            self._request_bindings[key] = binding
        identifier = feature.identifier
        if not binding or self._stored.get((identifier, binding)) or identifier in self._pinned:
            return  # nothing to bind, or held by the store / loaded from it: not encoded here
        self._step_bindings[identifier] = binding
        self._encoded_bindings[identifier] = binding
        self._encoded_bindings.move_to_end(identifier)
        if len(self._encoded_bindings) > 200_000:
            self._encoded_bindings.popitem(last=False)

    # -- the step's metadata -------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> EncacheConnectorMetadata:
        meta = EncacheConnectorMetadata()
        if self.is_producer:
            meta.resave = self._lost_from_store(scheduler_output)
        if self.is_producer and self._lora_digests:
            meta.lora_digests = dict(self._lora_digests)
        if self._step_bindings:
            meta.bindings, self._step_bindings = self._step_bindings, {}
        self._step += 1
        fds = []
        for identifier, st in self._need_loads.items():
            ref = None
            # workers in other processes read a pinned file for large entries; small ones
            # ride in the metadata (cheaper than a file open per worker: benchmarks/tp.json)
            if self._worker_procs and self._pinned_fds + len(fds) < self.PIN_MAX_FDS and (
                    self.config.worker_loads == "files"
                    or st.meta.data_bytes >= WORKER_READS_MIN_BYTES):
                # (a file on this host: a local store's entry, a local tier's copy; or the
                # shared memory it was received into)
                pinned = None if st.pin is None else st.pin()
                if pinned is not None:
                    fds.append(pinned[0])
                    ref = pinned[1]
            meta.loads.append(LoadItem(identifier, st.blob, st.offset, st.meta.dtype,
                                       st.meta.shape, ref))
        if fds:
            self._pins.append((self._step, time.monotonic(), fds))
            self._pinned_fds += len(fds)
        self._release_pins()
        self._need_loads.clear()
        self._pinned.clear()
        self._stored.clear()
        self._expect.clear()
        self._inputs.clear()
        self._refused.clear()
        self._inline_budget = self.config.inline_wait_s  # a new scheduler step begins
        return meta

    def _release_pins(self, everything: bool = False) -> None:
        now = time.monotonic()
        while self._pins and (everything or (self._step - self._pins[0][0] > self.PIN_STEPS
                                             and now - self._pins[0][1] > self.PIN_SECONDS)):
            fds = self._pins.popleft()[2]
            self._pinned_fds -= len(fds)
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _host_staging(self, vllm_config) -> HostStaging | None:
        """Page-locked buffers for the lookup's reads (device_copy.HostStaging) when the
        worker runs in this process (the uniprocess executor: one accelerator per
        engine) and copies entries to an accelerator: the read or receive is then the
        one pass over the bytes on the host. Not for workers in other processes (they
        get pinned files or shared memory) nor on a CPU engine (vLLM keeps its view)."""
        if self._worker_procs or vllm_config.parallel_config.distributed_executor_backend != "uni":
            return None
        import torch
        from vllm.platforms import current_platform
        device = current_platform.device_type
        return HostStaging(torch.device(device)) if device != "cpu" else None

    def _choose_worker_procs(self, vllm_config) -> bool:
        """Workers open large entries themselves (the metadata carries a pinned file, not
        the bytes) when they are separate local processes: the multiprocess executor on
        one node, and /proc/<pid>/fd usable (benchmarks/tp.json: several times less
        per-step time than shipping the bytes at 2.75-10 MB). A local disk entry is
        pinned as its file; an entry received from Redis or read from a network
        filesystem is received into shared memory and pinned as that (memfd.py)."""
        mode = self.config.worker_loads
        if mode == "bytes":
            return False
        pc = vllm_config.parallel_config
        if mode == "auto" and (pc.distributed_executor_backend != "mp"
                               or getattr(pc, "nnodes", 1) > 1):
            return False
        try:  # the descriptor path workers will open
            fd = os.open("/", os.O_RDONLY)
            try:
                os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDONLY))
            finally:
                os.close(fd)
        except OSError:
            return False
        return True

    # -- metrics and request end ---------------------------------------------------
    def get_ec_connector_stats(self):
        if self.lookup is None:
            return None
        data = self.lookup.take_interval()
        return EncacheStats(data=data) if data else None

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self._waiting:
            for key in [k for k in self._waiting if k[0] == request.request_id]:
                del self._waiting[key]
        for i in range(len(request.mm_features or ())):
            self._request_bindings.pop((request.request_id, i), None)
        if not self.is_producer:
            return False, None
        from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata
        items = collect_ec_item_metadata(request.mm_features, self._resolver)
        return False, (items or None)

    def shutdown(self) -> None:
        if self.lookup is not None:
            self.lookup.close()
            self.lookup = None
        self._pinned.clear()
        self._need_loads.clear()
        self._release_pins(everything=True)
