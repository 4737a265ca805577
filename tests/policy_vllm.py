"""Drive a real vLLM encoder-cache manager class from a trace.

What: :class:`VllmManagerCache` is a cache core for :func:`encache.policy.simulate.simulate`
that forwards every step to an instance of a vLLM manager class -- by default vLLM's own
``vllm.v1.core.encoder_cache_manager.EncoderCacheManager`` imported from the installed
vLLM (not a copy) -- using :class:`FakeRequest` objects that carry exactly what the
manager reads: ``request_id``, ``mm_features[i].identifier`` and
``get_num_encoder_embeds(i)``.  The call order is the scheduler's:
``get_cached_num_encoder_embeds`` + ``check_and_update_cache`` (hit), else
``can_allocate`` (may evict) and ``allocate``; ``free`` when the request finishes;
``get_freed_mm_hashes`` for evictions.

Why: the simulator's baseline must be vLLM's behaviour, not our reading of it, and the
same adapter replays a trace through ``PolicyEncoderCacheManager`` to show that the
engine-side manager makes the same decisions as the simulator's pure-Python core.

It lives in tests/ (the policy tests and ``scripts/bench/policy_bench.py`` share it), not
in ``encache.policy``, which never imports vLLM; vLLM is imported only when a class is
loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encache.policy.workload import Request

__all__ = ["FakeFeature", "FakeRequest", "load_manager_class", "VllmManagerCache",
           "VLLM_MANAGER", "ENCACHE_MANAGER"]

VLLM_MANAGER = "vllm.v1.core.encoder_cache_manager.EncoderCacheManager"
ENCACHE_MANAGER = "encache.connectors.vllm.manager.PolicyEncoderCacheManager"


@dataclass
class FakeFeature:
    identifier: str
    num_embeds: int


class FakeRequest:
    """The slice of ``vllm.v1.request.Request`` the encoder cache manager uses."""

    def __init__(self, request_id: str, items: list[tuple[str, int]]):
        self.request_id = request_id
        self.mm_features = [FakeFeature(k, n) for k, n in items]

    def get_num_encoder_embeds(self, input_id: int) -> int:
        return self.mm_features[input_id].num_embeds

    @property
    def has_encoder_inputs(self) -> bool:
        return bool(self.mm_features)


def load_manager_class(path: str = VLLM_MANAGER):
    """Import a manager class by dotted path (vLLM's resolver when available)."""
    module, _, name = path.rpartition(".")
    import importlib

    return getattr(importlib.import_module(module), name)


class VllmManagerCache:
    """Cache core backed by a vLLM manager instance (``simulate(core=...)``)."""

    def __init__(self, capacity: int, manager_cls: str | type = VLLM_MANAGER,
                 manager_kwargs: dict[str, Any] | None = None):
        cls = load_manager_class(manager_cls) if isinstance(manager_cls, str) else manager_cls
        self.manager = cls(cache_size=capacity, **(manager_kwargs or {}))
        self.capacity = capacity
        self._budget = 1 << 62
        self._sizes: dict[str, int] = {}

    def begin(self, req: Request):
        seen: dict[str, int] = {}
        for it in req.items:
            seen.setdefault(it.identifier, it.num_tokens)
        fr = FakeRequest(req.request_id, list(seen.items()))
        fr._index = {k: i for i, k in enumerate(seen)}
        return fr

    def lookup(self, fr: FakeRequest, key: str, size: int) -> bool:
        i = fr._index[key]
        cached = self.manager.get_cached_num_encoder_embeds(fr, i)
        if cached is not None and cached != size:
            raise ValueError(f"{key}: cached with {cached} embeddings, trace says {size}")
        return self.manager.check_and_update_cache(fr, i)

    def can_allocate(self, fr: FakeRequest, key: str, size: int) -> bool:
        return self.manager.can_allocate(fr, fr._index[key], self._budget, 0)

    def allocate(self, fr: FakeRequest, key: str, size: int) -> None:
        self.manager.allocate(fr, fr._index[key])
        self._sizes[key] = size

    def finish(self, fr: FakeRequest) -> None:
        self.manager.free(fr)

    def pop_evicted(self) -> list[tuple[str, int]]:
        # The simulator drains after every can_allocate, so nothing is re-cached between
        # eviction and this call.
        return [(h, self._sizes[h]) for h in self.manager.get_freed_mm_hashes()]
