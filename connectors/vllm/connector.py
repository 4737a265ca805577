"""EncacheConnector: vLLM's ECConnector API over an encache store (disk or Redis).

Load it out of tree::

    --ec-transfer-config '{"ec_connector": "EncacheConnector", "ec_role": "ec_consumer",
        "ec_connector_module_path": "encache.connectors.vllm.connector",
        "ec_connector_extra_config": {"store": "/var/cache/encache"}}'

(or, with the plugin registered, just ``"ec_connector": "EncacheConnector"``).
``encache connector-config`` prints this for a given store.

vLLM builds one connector per role. This front class (vLLM's mooncake pattern) parses the
settings, opens the store and hands the role to one of two classes, delegating each
ECConnectorBase method to it:

* :class:`~.scheduler.EncacheSchedulerConnector` answers lookups from memory and
  prefetches verified entries in the background (:mod:`encache.connectors.lookup`); it
  ships the bytes to the worker inside the step's connector metadata (:mod:`.metadata`),
  so a worker load never does I/O and can never fail;
* :class:`~.worker.EncacheWorkerConnector` turns those bytes into tensors (no copy on
  CPU) and, for producers, hands encoder outputs to a background writer
  (:mod:`encache.connectors.vllm.writer`).

A corrupt, truncated, wrong-shape or vanished entry is therefore a miss: the engine
re-encodes and one warning is logged per interval.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from ..encoder_config import encoder_config_digest
from ..store import open_store
from .compat import version_warning
from .config import ConnectorConfig
from .metadata import EncacheConnectorMetadata
from .metrics import EncachePromMetrics, EncacheStats
from .scheduler import EncacheSchedulerConnector
from .worker import EncacheWorkerConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("encache.connector")

__all__ = ["EncacheConnector", "EncacheDisk", "EncacheRedis"]

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


def _warn_if_no_encoder(model_config, store: str) -> None:
    """One line when vLLM runs the model without a multimodal encoder (a text-only model,
    or a multimodal family vLLM serves text-only): the engine never asks the connector
    for anything, so the store would be silently unused -- "working, just slower"."""
    if model_config is None or getattr(model_config, "is_multimodal_model", True):
        return
    arch = getattr(model_config, "architecture", None) or "?"
    log.warning("encache: %r (%s) has no multimodal encoder in vLLM: no request will read "
                "the store %s (serve a vision-language model, or drop --ec-transfer-config)",
                model_config.model, arch, store)


@atexit.register
def _shutdown_live_connectors() -> None:
    for connector in list(_LIVE):
        connector.shutdown()


class EncacheConnector(ECConnectorBase):
    """The front class vLLM names: settings, store, and one role object."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        _warn_if_unchecked_vllm()
        tc = vllm_config.ec_transfer_config
        self.config = ConnectorConfig.from_extra(tc.ec_connector_extra_config or {})
        if self.config.local_tier and not self.is_consumer:
            log.warning("encache connector: local_tier %s is left unused: an ec_producer "
                        "loads no entries (a tier serves consumers)", self.config.local_tier)
        self.store = open_store(self.config.store,
                                **self.config.store_options(loads=self.is_consumer))
        model_config = vllm_config.model_config
        mm_config = getattr(model_config, "multimodal_config", None)
        # what vLLM's identifier leaves out but the encoder output depends on
        self.encoder_config = encoder_config_digest(
            getattr(mm_config, "mm_processor_kwargs", None),
            getattr(model_config, "revision", None), self.config.tag)
        self.scheduler: EncacheSchedulerConnector | None = None
        self.worker: EncacheWorkerConnector | None = None
        if role == ECConnectorRole.SCHEDULER:
            _warn_if_no_encoder(model_config, self.config.store)
            self.scheduler = EncacheSchedulerConnector(
                vllm_config, self.config, self.store, is_producer=self.is_producer,
                is_consumer=self.is_consumer, encoder_config=self.encoder_config)
        elif role == ECConnectorRole.WORKER:
            self.worker = EncacheWorkerConnector(
                vllm_config, self.config, self.store, is_producer=self.is_producer,
                encoder_config=self.encoder_config)
        _LIVE.add(self)
        log.info("encache connector (%s, %s) on %s%s", role.name.lower(), tc.ec_role,
                 self.store.url,
                 f", encoder config {self.encoder_config}" if self.encoder_config else "")

    # -- what tools, benchmarks and precompute reach for ---------------------------
    @property
    def lookup(self):
        """The scheduler's :class:`~encache.connectors.lookup.EntryLookup` (consumers)."""
        return self.scheduler.lookup if self.scheduler is not None else None

    @property
    def writer(self):
        """The worker's :class:`~encache.connectors.vllm.writer.EntryWriter` (producers)."""
        return self.worker.writer if self.worker is not None else None

    def wait_for_saves(self, timeout: float | None = None) -> bool:
        """Block until queued saves are written (precompute calls this before exiting)."""
        return self.worker.wait_for_saves(timeout) if self.worker is not None else True

    # ============================== scheduler side ==============================
    def has_cache_item(self, identifier: str) -> bool:
        return self.scheduler is not None and self.scheduler.has_cache_item(identifier)

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        if self.scheduler is None:
            return True
        return self.scheduler.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        if self.scheduler is not None:
            self.scheduler.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        if self.scheduler is None:
            return EncacheConnectorMetadata()
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.request_finished(request)

    def take_unavailable_requests(self) -> set[str]:
        if self.scheduler is None:
            return set()
        return self.scheduler.take_unavailable_requests()

    # ============================== metrics =====================================
    def get_ec_connector_stats(self):
        return self.scheduler.get_ec_connector_stats() if self.scheduler is not None else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None):
        return EncacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return EncachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ============================== worker side =================================
    def start_save_caches(self, encoder_cache: dict[str, torch.Tensor] | None = None,
                          **kwargs) -> None:
        if self.worker is not None:
            self.worker.start_save_caches(self._get_connector_metadata(), encoder_cache)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        if self.worker is not None:
            self.worker.start_load_caches(self._get_connector_metadata(), encoder_cache)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        if self.worker is not None:
            self.worker.save_caches(encoder_cache, mm_hash)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # vLLM calls this at the end of every step, before the step's output leaves the
        # worker: a producer's step ends once its entries are in the store
        if self.worker is not None:
            self.worker.end_step()
        return None, None

    # ============================== lifecycle ===================================
    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()


# Aliases so a module-path config can name the backend it means.
EncacheDisk = EncacheConnector
EncacheRedis = EncacheConnector
