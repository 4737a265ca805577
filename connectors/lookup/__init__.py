"""Serving-side lookups: a fresh index, background prefetch, and a staging area.

vLLM asks a connector two things on the scheduler's hot path: "is this item in the
store?" (``has_cache_item``, per item per step) and, before scheduling a request, "are its
items ready?" (``ensure_cache_available``). Answering either with I/O would stall every
engine step, and answering "yes" for an entry that then fails to load crashes the engine
(vLLM raises "Encoder cache miss" in the worker). So the engine-facing answer is always a
memory lookup, and "yes" is only ever said for bytes already read and verified.

One module per idea, composed by :class:`EntryLookup` (:mod:`.entry_lookup`): the index
(:mod:`.index`), the circuit breaker (:mod:`.breaker`), the load pool (:mod:`.loader`),
verify-once-per-version (:mod:`.verified`), the staging LRU (:mod:`.staging`), the
encoder-config / LoRA checks (:mod:`.checks`), miss reasons (:mod:`.misses`) and the
counters (:mod:`.metrics`). Pure Python (no vLLM, no torch): the vLLM adapter is a thin
layer over this.
"""

from ..ratelimit import RateLimitedLog
from .entry_lookup import EntryLookup
from .loader import INLINE_VERIFY_MAX, PREFAULT_AFTER_S, State
from .staging import Staged
from .verified import VERIFIED_VERSIONS, parse_verify

__all__ = ["EntryLookup", "INLINE_VERIFY_MAX", "PREFAULT_AFTER_S", "RateLimitedLog", "Staged",
           "State", "VERIFIED_VERSIONS", "parse_verify"]
