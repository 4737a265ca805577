"""A vLLM encoder-cache manager whose eviction order comes from an encache policy.

Use it with vLLM's pluggable manager hook::

    vllm serve MODEL --ec-manager-config '{
        "encoder_cache_manager_cls":
            "encache.connectors.vllm.manager.PolicyEncoderCacheManager",
        "manager_config": {"policy": "dlfu"}}'

``manager_config`` keys: ``policy`` (``dlfu`` -- the default --, ``lru``, ``s3fifo``,
``wtinylfu``, ``fifo``; the offline ``static``/``belady`` need the future and are refused)
and ``policy_params`` (constructor arguments of that policy, e.g.
``{"halflife": 32}``; see ``encache.policy.registry``).

What it changes, and what it keeps.  The class subclasses vLLM's
``EncoderCacheManager`` and keeps its whole contract and state: the ``cached`` reference
sets, ``num_embeds_by_hash``, ``request_cached_ids``, the ``freeable`` map of unreferenced
entries, ``num_free_slots``/``num_freeable_slots`` (so ``can_allocate`` refuses exactly
when vLLM's would), the ``freed`` list and ``get_freed_mm_hashes``, ``reset``.  The only
decision that differs is *which* unreferenced entry ``can_allocate`` evicts: vLLM pops the
least recently released one, this class asks the policy.  The policy code is the same
pure-Python object the trace simulator (``encache.policy.simulate``) runs, fed the same
events: a new reference of a request to a cached item (``hit``), an allocation
(``insert``), a first reference to an unreferenced entry (``pin``), the last reference
dropped (``release``).  The scheduler may re-check an item of a request it already
counted (chunked prefill, or a request "untouched" and retried when KV blocks ran out);
such repeats are not counted again as accesses.

``stats`` counts hits, misses, evictions (entries and embeddings) and resets, so a
deployment -- and the tests -- can see that the manager is active.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from encache.policy.registry import POLICIES, make_policy

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["PolicyEncoderCacheManager", "live_managers"]

_LIVE: "weakref.WeakSet[PolicyEncoderCacheManager]" = weakref.WeakSet()


def live_managers() -> list["PolicyEncoderCacheManager"]:
    """Managers created in this process (for introspection and tests)."""
    return list(_LIVE)


class PolicyManagerMixin:
    """The policy's part of :class:`PolicyEncoderCacheManager`, over any release's
    ``EncoderCacheManager`` (the class puts it in front of the installed one; the release
    tests put it in front of each checked release's recorded one)."""

    #: how many (request, item) first-touches are remembered to dedupe access counting
    TOUCH_MEMORY = 1 << 16

    @classmethod
    def create_manager(cls, *, cache_size: int,
                       vllm_config: "VllmConfig") -> "PolicyEncoderCacheManager":
        cfg: dict[str, Any] = {}
        ec = getattr(vllm_config, "ec_manager_config", None)
        if ec is not None and ec.manager_config:
            cfg = dict(ec.manager_config)
        return cls(cache_size=cache_size, **cfg)

    def __init__(self, cache_size: int, policy: str = "dlfu",
                 policy_params: dict[str, Any] | None = None):
        super().__init__(cache_size)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
        if POLICIES[policy].needs_future:
            raise ValueError(f"policy {policy!r} is an offline reference (needs the future)")
        self.policy_name = policy
        self.policy_params = dict(policy_params or {})
        # A zero-size cache (no multimodal inputs) never evicts; keep a valid policy.
        self.policy = make_policy(policy, max(1, cache_size), **self.policy_params)
        self._touched: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.stats = {"hits": 0, "hit_embeds": 0, "misses": 0, "miss_embeds": 0,
                      "evictions": 0, "evicted_embeds": 0, "resets": 0}
        _LIVE.add(self)
        logger.info("encache PolicyEncoderCacheManager: policy=%s params=%s cache_size=%d",
                    policy, self.policy_params, cache_size)

    # -- helpers ----------------------------------------------------------------------
    def _first_touch(self, request_id: str, mm_hash: str) -> bool:
        key = (request_id, mm_hash)
        if key in self._touched:
            return False
        self._touched[key] = None
        if len(self._touched) > self.TOUCH_MEMORY:
            self._touched.popitem(last=False)
        return True

    def describe(self) -> dict[str, Any]:
        return {"cache_size": self.cache_size, **self.policy.describe(), **self.stats}

    # -- EncoderCacheManager interface --------------------------------------------------
    def reset(self) -> None:
        super().reset()
        self.policy.clear()
        self._touched.clear()
        self.stats["resets"] += 1

    def check_and_update_cache(self, request: "Request", input_id: int) -> bool:
        mm_hash = request.mm_features[input_id].identifier
        refs = self.cached.get(mm_hash)
        if refs is None:
            return False
        request_id = request.request_id
        was_unreferenced, new_reference = not refs, request_id not in refs
        # vLLM's own bookkeeping, whatever the release keeps (0.34 added per-request
        # reference counts by hash, which free_encoder_input relies on)
        super().check_and_update_cache(request, input_id)
        if was_unreferenced:
            self.policy.pin(mm_hash)
        if new_reference and self._first_touch(request_id, mm_hash):
            self.policy.hit(mm_hash)
            self.stats["hits"] += 1
            self.stats["hit_embeds"] += self.num_embeds_by_hash[mm_hash]
        return True

    def can_allocate(self, request: "Request", input_id: int, encoder_compute_budget: int,
                     num_embeds_to_schedule: int) -> bool:
        num_embeds = request.get_num_encoder_embeds(input_id)
        if num_embeds > encoder_compute_budget:
            return False
        num_embeds += num_embeds_to_schedule
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        # Same accounting as vLLM; only the victim order is the policy's.
        while num_embeds > self.num_free_slots:
            mm_hash = self.policy.evict()
            try:
                num_free_embeds = self.freeable.pop(mm_hash)
            except KeyError:
                raise AssertionError(
                    f"policy {self.policy_name} chose {mm_hash!r}, which is not evictable"
                ) from None
            del self.cached[mm_hash]
            del self.num_embeds_by_hash[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += num_free_embeds
            self.stats["evictions"] += 1
            self.stats["evicted_embeds"] += num_free_embeds
        return True

    def allocate(self, request: "Request", input_id: int) -> None:
        mm_hash = request.mm_features[input_id].identifier
        refs = self.cached.get(mm_hash)
        if refs is not None:
            # The scheduler allocates only after check_and_update_cache() said "not
            # cached", so this is unreachable from vLLM; treat it as a reference instead
            # of reserving the same entry twice.
            self.check_and_update_cache(request, input_id)
            return
        super().allocate(request, input_id)
        num_encoder_embeds = self.num_embeds_by_hash[mm_hash]
        self.policy.insert(mm_hash, num_encoder_embeds)
        self._first_touch(request.request_id, mm_hash)
        self.stats["misses"] += 1
        self.stats["miss_embeds"] += num_encoder_embeds

    def free_encoder_input(self, request: "Request", input_id: int) -> None:
        mm_hash = request.mm_features[input_id].identifier
        was_referenced = bool(self.cached.get(mm_hash))
        super().free_encoder_input(request, input_id)
        if was_referenced and mm_hash in self.freeable:
            self.policy.release(mm_hash)


class PolicyEncoderCacheManager(PolicyManagerMixin, EncoderCacheManager):
    """``EncoderCacheManager`` with a pluggable eviction policy (default ``dlfu``)."""
