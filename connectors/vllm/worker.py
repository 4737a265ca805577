"""EncacheWorkerConnector: the worker-side half of :class:`EncacheConnector`.

A consumer's worker turns the step's :class:`~.loads.LoadItem` list into tensors in
vLLM's encoder cache (``start_load_caches``): on CPU a view over the staged buffer (no
copy), or over a pinned file the worker opens itself (another process); on an
accelerator one pass into page-locked staging and an asynchronous device copy
(:mod:`.device_copy`). No store I/O is left on this path, so it cannot fail for a stored
entry's sake.

A producer's worker hands each encoder output to a background writer
(:class:`~encache.connectors.vllm.writer.EntryWriter`) with the stamps that make it a valid
entry for consumers (model id, vLLM version, hash algorithm, encoder config, LoRA
adapter digest learned from the scheduler's metadata). The writes of one step run in
parallel while the step goes on; at the step's end (vLLM calls ``get_finished`` before
the step's output leaves the worker) the worker waits until they are readable, at most
``save_wait_s``: stored, or on a local disk visible as in flight (a reader waits for the
bytes, which are written while the answer goes out). So an encoder instance's request
finishes only once its entries are readable: a prefill/decode instance that the EPD proxy
sends the request to next finds them (read-after-write). A write that fails or is late
is logged here, on the encoder, and counted (``save_errors``, ``save_timeouts``).
"""

from __future__ import annotations

import logging
import time

import torch

from ..store.keys import split_lora
from .uuids import content_keying, keyed_by
from .writer import EntryWriter
from .config import ConnectorConfig
from .device_copy import DeviceCopier
from .metadata import EncacheConnectorMetadata
from .loads import DTYPE_CODES, TORCH_DTYPES, LoadItem, open_pinned, tensor_over

log = logging.getLogger("encache.connector")


class EncacheWorkerConnector:
    _warned_dtype = False  # one warning per worker when stored dtypes are cast
    _device: torch.device | None = None
    _copier: DeviceCopier | None = None  # host/accelerator copies (device_copy)

    def __init__(self, vllm_config, config: ConnectorConfig, store, *, is_producer: bool,
                 encoder_config: str):
        model_config = vllm_config.model_config
        self.store = store
        self.model_id = model_config.model
        self.model_dtype = model_config.dtype
        mm_config = getattr(model_config, "multimodal_config", None)
        self.hash_algo = getattr(mm_config, "mm_hasher_algorithm", None) or "blake3"
        self.encoder_config = encoder_config
        self.writer: EntryWriter | None = None
        self.save_wait_s = config.save_wait_s
        #: every entry written here is keyed by its content (precompute's own identifiers)
        self.content_keyed = config.content_keyed
        #: ... or those whose identifier vLLM hashed from the item's bytes, where client
        #: uuids are namespaced apart (.uuids: decided here as in the API server)
        self.content_hashes_keyed = (is_producer and not config.content_keyed
                                     and content_keying(vllm_config))
        self.counters_flush_s = config.counters_flush_s
        self._flushed_at = time.monotonic()
        self._step_saves: list = []  # (identifier, future) of this step's writes
        if is_producer:
            self.writer = EntryWriter(store, **config.writer_options(),
                                      encoder_config=encoder_config)
        self.stats = {"load_calls": 0, "load_block_seconds": 0.0, "loaded": 0}
        # LoRA name -> adapter digest, learned from the scheduler's metadata (producers)
        self._lora_digests: dict[str, str] = {}
        # identifier -> binding of the inputs this step encodes (producers; .binding)
        self._bindings: dict[str, str] = {}

    # -- consumer: loads -----------------------------------------------------------
    def start_load_caches(self, metadata, encoder_cache: dict[str, torch.Tensor]) -> None:
        if not isinstance(metadata, EncacheConnectorMetadata) or not metadata.loads:
            return
        t0 = time.perf_counter()
        for item in metadata.loads:
            if item.identifier in encoder_cache:
                continue
            encoder_cache[item.identifier] = self._to_tensor(item)
            self.stats["loaded"] += 1
        self.stats["load_calls"] += 1
        self.stats["load_block_seconds"] += time.perf_counter() - t0

    def _to_tensor(self, item: LoadItem) -> torch.Tensor:
        dtype = TORCH_DTYPES[item.dtype]
        cast_to = None
        if dtype.is_floating_point and self.model_dtype is not None and dtype != self.model_dtype:
            if not self._warned_dtype:  # hits, but not what this engine's tower computes
                self._warned_dtype = True
                log.warning("encache: entries stored as %s are cast to this engine's %s: outputs "
                            "differ slightly from encoding here; precompute with --dtype %s",
                            dtype, self.model_dtype, str(self.model_dtype).replace("torch.", ""))
            cast_to = self.model_dtype
        device = self._device or self._target_device()
        if device.type != "cpu":  # one pass into page-locked staging, then an async copy
            return self._device_copier(device).load(item, cast_to)
        blob = item.blob
        if blob is None:  # a pinned disk entry: read it here (another process)
            item.blob = blob = open_pinned(item.ref, self._mmap_min())
        t = tensor_over(blob, item.offset, item.dtype, item.shape)
        return t if cast_to is None else t.to(cast_to)

    def _device_copier(self, device: torch.device) -> DeviceCopier:
        if self._copier is None or self._copier.device != device:
            self._copier = DeviceCopier(device)
        return self._copier

    def _mmap_min(self) -> int:
        from ..store.disk.store import MMAP_MIN_BYTES
        return MMAP_MIN_BYTES

    def _target_device(self) -> torch.device:
        if self._device is None:
            from vllm.platforms import current_platform
            name = current_platform.device_type
            if current_platform.is_cuda_alike():
                name = f"{name}:{current_platform.current_device()}"
            self._device = torch.device(name)
        return self._device

    # -- producer: saves -----------------------------------------------------------
    def start_save_caches(self, metadata, encoder_cache: dict | None = None) -> None:
        """Producers: learn the adapter digests of this step's LoRA requests, and save the
        items vLLM's encoder cache answered whose entries the store lost (``resave``:
        vLLM passes the cache here for this)."""
        if not isinstance(metadata, EncacheConnectorMetadata):
            return
        if metadata.lora_digests:
            self._lora_digests.update(metadata.lora_digests)
        if metadata.bindings:
            if len(self._bindings) > 100_000:  # items scheduled but never saved (aborted)
                self._bindings.clear()
            self._bindings.update(metadata.bindings)
        if metadata.resave and encoder_cache is not None and self.writer is not None:
            for mm_hash in metadata.resave:
                if mm_hash in encoder_cache:
                    self.save_caches(encoder_cache, mm_hash)
                    self.writer.count("resaves")

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        if self.writer is None:
            return
        tensor = encoder_cache[mm_hash].detach()
        code = DTYPE_CODES.get(tensor.dtype)
        if code is None:
            self.writer.warn.warning("dtype", "encache: cannot store dtype %s", tensor.dtype)
            return

        # a device tensor's host copy queued on this step's stream; a CPU tensor as is
        host, copied = self._device_copier(tensor.device).to_host(tensor)

        def data():  # runs in the writer thread: the copy's end, then a byte view
            if copied is not None:
                copied.synchronize()
            flat = host.contiguous()
            return flat.reshape(-1).view(torch.uint8).numpy(), code, tuple(flat.shape)

        from vllm import __version__ as vllm_version
        lora_name = split_lora(mm_hash)[0]
        future = self.writer.submit(
            mm_hash, data, tensor.numel() * tensor.element_size(),
            model=self.model_id, vllm_version=vllm_version, hash_algo=self.hash_algo,
            encoder_config=self.encoder_config,
            lora_digest=self._lora_digests.get(lora_name, "") if lora_name else "",
            binding=self._bindings.pop(mm_hash, ""),
            keyed_by=keyed_by(mm_hash, content_keyed=self.content_keyed,
                              content_hashes_keyed=self.content_hashes_keyed))
        if self.save_wait_s > 0:
            self._step_saves.append((mm_hash, future))

    def end_step(self) -> None:
        """The step's end (vLLM's ``get_finished``): wait until this step's writes are in
        the store, at most ``save_wait_s``, and say so on this side when one is not; then
        hand batched counters to the store when they are due."""
        if self.writer is None:
            return
        if self._step_saves:
            self._wait_step_saves()
        now = time.monotonic()
        if now - self._flushed_at >= self.counters_flush_s:
            self._flushed_at = now
            self._flush_writer_counters()

    def _wait_step_saves(self) -> None:
        saves, self._step_saves = self._step_saves, []
        failed, late = self.writer.wait([f for _, f in saves], self.save_wait_s)
        if late:
            self.writer.count("save_timeouts", late)
            pending = [i for i, f in saves if not f.done()]
            self.writer.warn.warning(
                "save-late", "encache: %d entr%s not in %s after %.1f s (%s...): the request "
                "finishes without them; consumers encode them themselves", late,
                "y" if late == 1 else "ies", self.store.url, self.save_wait_s, pending[0])
        if failed:
            self.writer.warn.warning(
                "save-failed", "encache: %d of this step's %d entr%s could not be written to "
                "%s: consumers encode them themselves", failed, len(saves),
                "y" if len(saves) == 1 else "ies", self.store.url)

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

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self._flush_writer_counters()
            self.writer = None
