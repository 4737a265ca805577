"""Policies by name: the table the simulator, the benchmark and the vLLM manager use.

``fifo``  (:class:`~.fifo.FifoRelease`)  -- exactly vLLM 0.32's rule: unreferenced entries
          in the order they were *released*, oldest first.
``lru``   (:class:`~.lru.LRU`)           -- least recently *accessed* unreferenced entry.
``s3fifo`` (:class:`~.s3fifo.S3FIFO`)    -- S3-FIFO (Yang et al., SOSP'23), after
          libCacheSim's ``S3FIFO.c``: 10% small FIFO, main FIFO with a 2-bit clock, ghost FIFO.
``wtinylfu`` (:class:`~.tinylfu.WTinyLFU`) -- W-TinyLFU (Einziger, Friedman & Manes,
          TOS'17) as in Caffeine: 1% LRU window, segmented-LRU main (20% probation / 80%
          protected), count-min sketch (4-bit counters, 4 rows, reset every 10x entries)
          admission.
``dlfu``  (:class:`~.dlfu.DecayedLFU`)    -- this project's policy, see its docstring.
``static`` (:class:`~.static.StaticOracle`) -- offline: ranks by true whole-trace frequency.
``belady`` (:class:`~.belady.Belady`)    -- offline: evicts the entry re-used furthest in
          future.
"""

from __future__ import annotations

from .base import Policy
from .belady import Belady
from .dlfu import DecayedLFU
from .fifo import FifoRelease
from .lru import LRU
from .s3fifo import S3FIFO
from .static import StaticOracle
from .tinylfu import WTinyLFU

__all__ = ["POLICIES", "ONLINE_POLICIES", "make_policy"]

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FifoRelease, LRU, S3FIFO, WTinyLFU, DecayedLFU, StaticOracle,
                              Belady)
}
ONLINE_POLICIES = [n for n, c in POLICIES.items() if not c.needs_future]


def make_policy(name: str, capacity: int, **params) -> Policy:
    """Build a policy by name (``fifo``, ``lru``, ``s3fifo``, ``wtinylfu``, ``dlfu``,
    ``static``, ``belady``); ``params`` go to its constructor."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(capacity, **params)
