"""EncacheConnector: vLLM's ECConnector API over an encache store (disk or Redis).

Load it out of tree::

    --ec-transfer-config '{"ec_connector": "EncacheConnector", "ec_role": "ec_consumer",
        "ec_connector_module_path": "encache.connectors.vllm.connector",
        "ec_connector_extra_config": {"store": "/var/cache/encache"}}'

(or, with the plugin registered, just ``"ec_connector": "EncacheConnector"``).
``encache connector-config`` prints this for a given store.

Roles: the *scheduler-side* instance answers lookups from memory and prefetches verified
entries in the background (:mod:`encache.connectors.lookup`); it ships the bytes to the
worker inside the step's connector metadata, so a worker load never does I/O and can
never fail. The *worker-side* instance turns those bytes into tensors (no copy on CPU)
and, for producers, hands encoder outputs to a background writer
(:mod:`encache.connectors.writer`). A corrupt, truncated, wrong-shape or vanished entry
is therefore a miss: the engine re-encodes and one warning is logged per interval.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import pickle
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from ..diagnosis import MissDiagnosis
from ..encoder_config import encoder_config_digest
from ..lora_stamp import adapter_digest
from ..lookup import EntryLookup, State
from ..store import open_store
from ..store.keys import split_lora
from ..writer import EntryWriter
from .compat import version_warning
from .config import ConnectorConfig
from .metrics import EncachePromMetrics, EncacheStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("encache.connector")

# Connectors still alive at interpreter exit flush their writes and counters; a weak set
# (not one atexit entry per instance) so engines built and dropped in one process are freed.
_LIVE: weakref.WeakSet = weakref.WeakSet()


_VERSION_CHECKED = False


def _warn_if_unchecked_vllm() -> None:
    """Once per process: a clear warning (not a failure) on an unchecked vLLM release."""
    global _VERSION_CHECKED
    if not _VERSION_CHECKED:
        _VERSION_CHECKED = True
        from vllm import __version__

        message = version_warning(__version__)
        if message:
            log.warning(message)


@atexit.register
def _shutdown_live_connectors() -> None:
    for connector in list(_LIVE):
        connector.shutdown()

TORCH_DTYPES = {
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool,
}
DTYPE_CODES = {v: k for k, v in TORCH_DTYPES.items()}
DTYPE_BYTES = {k: torch.empty(0, dtype=v).element_size() for k, v in TORCH_DTYPES.items()}


#: entries at least this big reach multiprocess workers as pinned files (worker_loads auto)
WORKER_READS_MIN_BYTES = 1 << 20


@dataclass
class LoadItem:
    identifier: str
    blob: Any  # any buffer holding the whole entry (bytes, bytearray, uint8 array)
    offset: int
    dtype: str
    shape: tuple[int, ...]
    #: (scheduler pid, open fd, verified version, path) of a disk entry the scheduler
    #: pinned: a worker in another process opens it itself instead of receiving the bytes
    ref: tuple | None = None

    def __reduce_ex__(self, protocol):
        if self.ref is not None:  # the worker reads the pinned file (see open_pinned)
            return (_rebuild_load_item_ref, (self.identifier, self.offset, self.dtype,
                                             tuple(self.shape), self.ref))
        # Shipped to worker processes only with a multiprocess executor: send just the
        # tensor bytes. With pickle protocol 5 (vLLM's shared-memory message queue) they
        # go as an out-of-band PickleBuffer: written once from the staged buffer (often the
        # page cache itself) into the queue, instead of a tobytes() copy that the pickler
        # then copies again into its stream (tests/test_connector_pickle.py, issue #11).
        view = memoryview(self.blob).cast("B")
        nbytes = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            nbytes *= s
        part = view[self.offset:self.offset + nbytes]
        payload = pickle.PickleBuffer(part) if protocol >= 5 else part.tobytes()
        return (_rebuild_load_item, (self.identifier, payload, self.dtype, tuple(self.shape)))


def pin_entry(store, identifier: str, version) -> tuple[int, tuple] | None:
    """Scheduler side: open a verified disk entry and check it is still that version;
    ``(fd, ref)`` for a :class:`LoadItem`, or None (replaced, purged: ship the bytes).
    The caller keeps ``fd`` open until the workers have read it."""
    path = str(store.entry_path(identifier))
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if version is None or (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != tuple(version):
        os.close(fd)
        return None
    return fd, (os.getpid(), fd, tuple(version), path)


def _rebuild_load_item_ref(identifier, offset, dtype, shape, ref) -> LoadItem:
    return LoadItem(identifier, None, offset, dtype, shape, ref)


def open_pinned(ref, mmap_min: int):
    """A worker process's view of an entry the scheduler verified and pinned: opened
    through the scheduler's own descriptor (``/proc/<pid>/fd/<n>``), so the very inode it
    verified is read even if the entry was replaced or purged since; the version is
    checked again (no checksum: the scheduler hashed this exact version). Falls back to
    the entry's path when /proc is not reachable, with the same version check."""
    import mmap

    pid, fd, version, path = ref
    try:
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    except OSError:
        f = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(f)
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != tuple(version):
            raise RuntimeError(f"encache: pinned entry {path} changed under the worker")
        if st.st_size >= mmap_min:
            return mmap.mmap(f, st.st_size, access=mmap.ACCESS_COPY)
        buf = bytearray(st.st_size)
        view, got = memoryview(buf), 0
        while got < st.st_size:
            n = os.readv(f, [view[got:]])
            if n == 0:
                raise RuntimeError(f"encache: pinned entry {path} is shorter than verified")
            got += n
        return buf
    finally:
        os.close(f)


def _rebuild_load_item(identifier, payload, dtype, shape) -> LoadItem:
    if not isinstance(payload, (bytes, bytearray)):
        payload = memoryview(payload)  # an out-of-band buffer (a zmq frame, a PickleBuffer)
    return LoadItem(identifier, payload, 0, dtype, shape)


@dataclass
class EncacheConnectorMetadata(ECConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)
    #: LoRA name -> adapter digest of the requests scheduled so far (producers stamp it)
    lora_digests: dict[str, str] = field(default_factory=dict)


class EncacheConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        _warn_if_unchecked_vllm()
        tc = vllm_config.ec_transfer_config
        self.config = ConnectorConfig.from_extra(tc.ec_connector_extra_config or {})
        self.store = open_store(self.config.store, **self.config.store_options())
        model_config = vllm_config.model_config
        self.model_id = model_config.model
        self.model_dtype = model_config.dtype
        # named in diagnostics: entry shapes are family-specific (crops, dynamic resolution)
        self.architecture = getattr(model_config, "architecture", None) or "this model"
        mm_config = getattr(model_config, "multimodal_config", None)
        self.hash_algo = getattr(mm_config, "mm_hasher_algorithm", None) or "blake3"
        # what vLLM's identifier leaves out but the encoder output depends on
        self.encoder_config = encoder_config_digest(
            getattr(mm_config, "mm_processor_kwargs", None),
            getattr(model_config, "revision", None), self.config.tag)
        self.lookup: EntryLookup | None = None
        self.writer: EntryWriter | None = None
        self._pinned: dict[str, Any] = {}
        self._inline_budget = self.config.inline_wait_s
        self._need_loads: dict[str, Any] = {}
        self._worker_stats = {"load_calls": 0, "load_block_seconds": 0.0, "loaded": 0}
        # LoRA name -> digest of the adapter served under it (stale-LoRA guard)
        self._lora_digests: dict[str, str] = {}
        self._lora_checked: dict[tuple[str, str], float] = {}
        self.diagnosis: MissDiagnosis | None = None
        if role == ECConnectorRole.SCHEDULER and self.is_consumer:
            self.lookup = EntryLookup(
                self.store, **self.config.lookup_options(),
                encoder_config=self.encoder_config if self.config.check_encoder_config else None)
            self.lookup.lora_digests = self._lora_digests  # shared: kept up to date below
            self.diagnosis = MissDiagnosis(self.store, self.model_id)
            self.diagnosis.start()
        if role == ECConnectorRole.WORKER and self.is_producer:
            self.writer = EntryWriter(self.store, **self.config.writer_options(),
                                      encoder_config=self.encoder_config)
        if role == ECConnectorRole.SCHEDULER and self.is_producer:
            from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver
            self._resolver = PlaceholderMetadataResolver(model_config)
        self._device = None
        self._warned_dtype = False
        self._step = 0
        self._pins: collections.deque = collections.deque()
        self._pinned_fds = 0
        self._worker_reads = False
        if role == ECConnectorRole.SCHEDULER:
            self._check_capacity()
            self._worker_reads = self._choose_worker_reads(vllm_config)
        _LIVE.add(self)
        log.info("encache connector (%s, %s) on %s%s", role.name.lower(), tc.ec_role,
                 self.store.url,
                 f", encoder config {self.encoder_config}" if self.encoder_config else "")

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

    # ============================== scheduler side ==============================
    def has_cache_item(self, identifier: str) -> bool:
        """Memory-speed: yes only for an entry already read and verified (staged)."""
        if self.lookup is None:
            return False
        staged = self.lookup.get_staged(identifier)
        if staged is None:
            return False
        self._pinned[identifier] = staged  # survives staging eviction until this step ships
        return True

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Start background reads for this request's stored items; defer it while they run."""
        if self.lookup is None:
            return True
        self._note_lora(request)
        pending = self._start_loads(request, num_computed_tokens)
        if pending and self._inline_budget > 0:
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
            if self._inline_budget > 0:
                # a local read inline (budgeted per step) beats a thread hand-off
                t0 = time.perf_counter()
                state = self.lookup.request(feature.identifier, inline=True)
                self._inline_budget -= time.perf_counter() - t0
            else:
                state = self.lookup.request(feature.identifier)
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
        if self.lookup is None:
            return
        identifier = request.mm_features[index].identifier
        # Only what has_cache_item said yes to this step is an external load; an entry that
        # became ready after that answer was already scheduled for encoding.
        staged = self._pinned.get(identifier)
        if staged is None:
            self.lookup.count("misses")
            reason = self.lookup.miss_reason(identifier)
            if self.diagnosis is not None:
                reason = self.diagnosis.classify(reason)
            self.lookup.count("misses_" + reason)
            return
        self._need_loads[identifier] = staged
        self.lookup.count("hits")
        self.lookup.count("bytes_loaded", staged.meta.data_bytes)
        self.lookup.count("load_seconds", staged.load_seconds)
        self.lookup.observe_load(staged.load_seconds)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = EncacheConnectorMetadata()
        if self.is_producer and self._lora_digests:
            meta.lora_digests = dict(self._lora_digests)
        self._step += 1
        fds = []
        for identifier, st in self._need_loads.items():
            ref = None
            # workers in other processes read a pinned file for large entries; small ones
            # ride in the metadata (cheaper than a file open per worker: benchmarks/tp.json)
            if self._worker_reads and self._pinned_fds + len(fds) < self.PIN_MAX_FDS and (
                    self.config.worker_loads == "files"
                    or st.meta.data_bytes >= WORKER_READS_MIN_BYTES):
                pinned = pin_entry(self.store, identifier, st.version)
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
        self._inline_budget = self.config.inline_wait_s  # a new scheduler step begins
        return meta

    PIN_STEPS = 16  # a pinned entry stays open this many scheduler steps…
    PIN_SECONDS = 1.0  # …and at least this long (workers read it within their step)
    PIN_MAX_FDS = 1024  # more pinned at once: ship bytes (never crowd the fd limit)

    def _release_pins(self, everything: bool = False) -> None:
        now = time.monotonic()
        while self._pins and (everything or (self._step - self._pins[0][0] > self.PIN_STEPS
                                             and now - self._pins[0][1] > self.PIN_SECONDS)):
            fds = self._pins.popleft()[2]
            self._pinned_fds -= len(fds)
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _choose_worker_reads(self, vllm_config) -> bool:
        """Workers read disk entries themselves (the metadata carries a pinned file, not
        the bytes) when they are separate local processes: the multiprocess executor on
        one node, a local disk store, and /proc/<pid>/fd usable (benchmarks/tp.json:
        2.9-8x less per-step time than shipping the bytes at 2.75-10 MB)."""
        mode = self.config.worker_loads
        if mode == "bytes" or self.lookup is None:
            return False
        if getattr(self.store, "backend", None) != "disk" or not self.store.local:
            return False
        pc = vllm_config.parallel_config
        if mode == "auto" and (pc.distributed_executor_backend != "mp"
                               or getattr(pc, "nnodes", 1) > 1):
            return False
        try:  # the descriptor path workers will open
            fd = os.open(self.store.root, os.O_RDONLY)
            try:
                os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDONLY))
            finally:
                os.close(fd)
        except OSError:
            return False
        return True

    # ============================== metrics =====================================
    def get_ec_connector_stats(self):
        if self.lookup is None:
            return None
        data = self.lookup.take_interval()
        return EncacheStats(data=data) if data else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None):
        return EncacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return EncachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if not self.is_producer or self.role != ECConnectorRole.SCHEDULER:
            return False, None
        from vllm.distributed.ec_transfer.ec_connector.utils import collect_ec_item_metadata
        items = collect_ec_item_metadata(request.mm_features, self._resolver)
        return False, (items or None)

    # ============================== worker side =================================
    def start_save_caches(self, **kwargs) -> None:
        """Producers: learn the adapter digests of this step's LoRA requests."""
        metadata = self._get_connector_metadata()
        if isinstance(metadata, EncacheConnectorMetadata) and metadata.lora_digests:
            self._lora_digests.update(metadata.lora_digests)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, EncacheConnectorMetadata) or not metadata.loads:
            return
        t0 = time.perf_counter()
        for item in metadata.loads:
            if item.identifier in encoder_cache:
                continue
            encoder_cache[item.identifier] = self._to_tensor(item)
            self._worker_stats["loaded"] += 1
        self._worker_stats["load_calls"] += 1
        self._worker_stats["load_block_seconds"] += time.perf_counter() - t0

    def _to_tensor(self, item: LoadItem) -> torch.Tensor:
        dtype = TORCH_DTYPES[item.dtype]
        numel = 1
        for s in item.shape:
            numel *= s
        blob = item.blob
        if blob is None:  # a pinned disk entry: read it here (another process)
            item.blob = blob = open_pinned(item.ref, self._mmap_min())
        if isinstance(blob, bytes) or (isinstance(blob, memoryview) and blob.readonly):
            # read-only (Redis, a worker process's copy)
            with warnings.catch_warnings():  # the cache never writes to it
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(item.blob, dtype=dtype, count=numel, offset=item.offset)
        else:  # writable: a copy-on-write mapping or a buffer read into
            t = torch.frombuffer(item.blob, dtype=dtype, count=numel, offset=item.offset)
        t = t.view(item.shape)
        if t.is_floating_point() and self.model_dtype is not None and t.dtype != self.model_dtype:
            if not self._warned_dtype:  # hits, but not what this engine's tower computes
                self._warned_dtype = True
                log.warning("encache: entries stored as %s are cast to this engine's %s: outputs "
                            "differ slightly from encoding here; precompute with --dtype %s",
                            t.dtype, self.model_dtype, str(self.model_dtype).replace("torch.", ""))
            t = t.to(self.model_dtype)
        device = self._target_device()
        if device.type != "cpu":
            t = t.to(device, non_blocking=False)
        return t

    def _mmap_min(self) -> int:
        from ..store.disk import MMAP_MIN_BYTES
        return MMAP_MIN_BYTES

    def _target_device(self) -> torch.device:
        if self._device is None:
            from vllm.platforms import current_platform
            name = current_platform.device_type
            if current_platform.is_cuda_alike():
                name = f"{name}:{current_platform.current_device()}"
            self._device = torch.device(name)
        return self._device

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        if self.writer is None:
            return
        tensor = encoder_cache[mm_hash].detach()
        code = DTYPE_CODES.get(tensor.dtype)
        if code is None:
            self.writer.warn.warning("dtype", "encache: cannot store dtype %s", tensor.dtype)
            return

        def data():  # runs in the writer thread: device->host copy and byte view
            host = tensor.to("cpu").contiguous()
            return host.reshape(-1).view(torch.uint8).numpy(), code, tuple(host.shape)

        from vllm import __version__ as vllm_version
        lora_name = split_lora(mm_hash)[0]
        self.writer.submit(mm_hash, data, tensor.numel() * tensor.element_size(),
                           model=self.model_id, vllm_version=vllm_version,
                           hash_algo=self.hash_algo, encoder_config=self.encoder_config,
                           lora_digest=self._lora_digests.get(lora_name, "") if lora_name else "")

    def wait_for_saves(self, timeout: float | None = None) -> bool:
        """Block until queued saves are written (precompute calls this before exiting)."""
        if self.writer is None:
            return True
        done = self.writer.flush(timeout)
        self._flush_writer_counters()
        return done

    def _flush_writer_counters(self) -> None:
        if self.writer is None:
            return
        deltas = self.writer.take_counters()
        if deltas:
            try:
                self.store.add_counters(deltas)
            except Exception as e:
                self.writer.warn.warning("counters", "encache: cannot record counters: %s", e)

    # ============================== lifecycle ===================================
    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self._flush_writer_counters()
            self.writer = None
        if self.lookup is not None:
            self.lookup.close()
            self.lookup = None
        self._pinned.clear()
        self._need_loads.clear()
        self._release_pins(everything=True)


# Aliases so a module-path config can name the backend it means.
EncacheDisk = EncacheConnector
EncacheRedis = EncacheConnector
