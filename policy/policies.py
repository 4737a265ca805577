"""Compatibility re-export: every policy name that used to live in this one module.

The policies now live one per module (:mod:`.base`, :mod:`.fifo`, :mod:`.lru`,
:mod:`.s3fifo`, :mod:`.tinylfu`, :mod:`.sketch`, :mod:`.shadow`, :mod:`.dlfu`,
:mod:`.static`, :mod:`.belady`) and are looked up by name in :mod:`.registry`.  Configs,
tests and scripts that import from ``encache.policy.policies`` keep working.
"""

from __future__ import annotations

from .base import Key, Policy, ReleaseHeap
from .belady import Belady
from .dlfu import DecayedLFU
from .fifo import FifoRelease
from .lru import LRU
from .registry import ONLINE_POLICIES, POLICIES, make_policy
from .s3fifo import S3FIFO
from .shadow import Shadow
from .sketch import CountMinSketch, stable_hash
from .static import StaticOracle
from .tinylfu import WTinyLFU

__all__ = [
    "Policy", "FifoRelease", "LRU", "S3FIFO", "WTinyLFU", "DecayedLFU", "StaticOracle",
    "Belady", "POLICIES", "ONLINE_POLICIES", "make_policy",
]

# Former private names, for pickles and scripts that reached into the old module.
_Shadow = Shadow
_ReleaseHeap = ReleaseHeap
