"""``wtinylfu``: W-TinyLFU (Einziger, Friedman & Manes, TOS'17) as in Caffeine, a reference
policy: 1% LRU window, segmented-LRU main (20% probation / 80% protected), count-min
sketch admission (4-bit counters, 4 rows, reset every 10x entries; :mod:`.sketch`).
"""

from __future__ import annotations

import random
from collections import OrderedDict

from .base import Key, Policy
from .sketch import CountMinSketch

__all__ = ["WTinyLFU"]


class WTinyLFU(Policy):
    """W-TinyLFU with Caffeine's structure and admission rule (static 1% window).

    * new entries enter the LRU *window* (``window_ratio`` of capacity, 1%);
    * the main region is a segmented LRU: *probation* and *protected* (80% of main); a hit
      in probation promotes to protected (the protected LRU overflows back to probation);
    * when room is needed and the window is over its share, the window's LRU entry (the
      *candidate*) competes with the main region's LRU victim: the candidate is admitted
      (the victim is evicted and the candidate joins probation) iff its sketch frequency
      is higher -- or, as Caffeine's hash-flooding guard, with probability 1/128 when the
      candidate's frequency is >= 6; otherwise the candidate is evicted;
    * before the first eviction, window overflow simply flows into probation (how
      Caffeine fills an empty main region);
    * every access (hit or miss) increments the count-min sketch (sized for
      ``capacity / mean_size`` entries, ``mean_size`` a hint defaulting to 1).

    Caffeine additionally adapts the window share by hill climbing; the reference here
    is the paper's static-window W-TinyLFU.  Pinned entries are skipped when looking for
    the LRU candidate or victim.
    """

    name = "wtinylfu"

    def __init__(self, capacity: int, window_ratio: float = 0.01,
                 protected_ratio: float = 0.80, mean_size: float = 1.0, seed: int = 0):
        super().__init__(capacity)
        self.window_ratio = window_ratio
        self.protected_ratio = protected_ratio
        self.mean_size = mean_size
        self.window_cap = max(1, int(capacity * window_ratio))
        self.protected_cap = int((capacity - self.window_cap) * protected_ratio)
        self.entries = max(1, int(capacity / max(mean_size, 1e-9)))
        self.seed = seed
        self.sketch = CountMinSketch(self.entries)
        self.clear()

    def clear(self):
        # The sketch is popularity history, not cache content: it survives clear().
        self._win: OrderedDict[Key, int] = OrderedDict()   # LRU first
        self._prob: OrderedDict[Key, int] = OrderedDict()
        self._prot: OrderedDict[Key, int] = OrderedDict()
        self._pinned: set[Key] = set()
        self.win_used = self.prob_used = self.prot_used = 0
        self._has_evicted = False
        self._rng = random.Random(self.seed)

    def describe(self):
        return {"policy": self.name, "window_ratio": self.window_ratio,
                "protected_ratio": self.protected_ratio, "sketch_entries": self.entries}

    def insert(self, key, size):
        self.sketch.increment(key)
        self._pinned.add(key)
        self._win[key] = size
        self.win_used += size
        if not self._has_evicted:
            while self.win_used > self.window_cap and len(self._win) > 1:
                k, s = self._win.popitem(last=False)
                self.win_used -= s
                self._prob[k] = s
                self.prob_used += s

    def hit(self, key):
        self.sketch.increment(key)
        if key in self._win:
            self._win.move_to_end(key)
        elif key in self._prot:
            self._prot.move_to_end(key)
        else:
            s = self._prob.pop(key)
            self.prob_used -= s
            self._prot[key] = s
            self.prot_used += s
            while self.prot_used > self.protected_cap and len(self._prot) > 1:
                k, s2 = self._prot.popitem(last=False)
                self.prot_used -= s2
                self._prob[k] = s2
                self.prob_used += s2

    def pin(self, key):
        self._pinned.add(key)

    def release(self, key):
        self._pinned.discard(key)

    def _lru_unpinned(self, region: OrderedDict):
        pinned = self._pinned
        for k in region:
            if k not in pinned:
                return k
        return None

    def _admit(self, candidate, victim) -> bool:
        cf = self.sketch.frequency(candidate)
        vf = self.sketch.frequency(victim)
        if cf > vf:
            return True
        if cf >= 6:
            return (self._rng.getrandbits(7)) == 0
        return False

    def _drop(self, key, region):
        s = region.pop(key)
        if region is self._win:
            self.win_used -= s
        elif region is self._prob:
            self.prob_used -= s
        else:
            self.prot_used -= s
        return key

    def evict(self):
        self._has_evicted = True
        while True:
            cand = (self._lru_unpinned(self._win)
                    if self.win_used > self.window_cap else None)
            region = self._prob
            victim = self._lru_unpinned(self._prob)
            if victim is None:
                region = self._prot
                victim = self._lru_unpinned(self._prot)
            if cand is None and victim is None:
                cand = self._lru_unpinned(self._win)
                if cand is None:
                    raise LookupError("no evictable entry")
                return self._drop(cand, self._win)
            if cand is None:
                return self._drop(victim, region)
            if victim is None:
                return self._drop(cand, self._win)
            if self._admit(cand, victim):
                s = self._win.pop(cand)
                self.win_used -= s
                self._prob[cand] = s
                self.prob_used += s
                return self._drop(victim, region)
            return self._drop(cand, self._win)
