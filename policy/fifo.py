"""``fifo``: vLLM 0.32's own eviction rule, as a pure-Python twin of its manager.

Why: the simulator's grid runs vLLM's *real* manager class (``tests/policy_vllm.py``);
this twin is the same rule behind the :class:`~encache.policy.base.Policy` interface, so
``PolicyEncoderCacheManager`` can run it (``"policy": "fifo"``) and a test can prove the twin
and the real class make identical decisions.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import Key, Policy

__all__ = ["FifoRelease"]


class FifoRelease(Policy):
    """vLLM 0.32 ``EncoderCacheManager``: evict the least recently *released* entry.

    Entries sit in an ``OrderedDict`` from the moment their last reference is dropped; a
    re-reference removes them; eviction pops the oldest.  Hits while referenced do not
    reorder anything, so a hot entry that is continuously shared is treated as "new" only
    when its last user finishes.
    """

    name = "fifo"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._free: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key, size):
        pass

    def hit(self, key):
        pass

    def pin(self, key):
        del self._free[key]

    def release(self, key):
        self._free[key] = None

    def evict(self):
        return self._free.popitem(last=False)[0]

    def clear(self):
        self._free.clear()
