"""``s3fifo``: S3-FIFO (Yang et al., SOSP'23), a reference policy after libCacheSim's
``S3FIFO.c``: 10% small FIFO, main FIFO with a 2-bit clock, ghost FIFO.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import Key, Policy

__all__ = ["S3FIFO"]


class S3FIFO(Policy):
    """S3-FIFO, following libCacheSim ``S3FIFO.c`` (sizes in tokens).

    * new entries go to the small FIFO ``S`` (10% of capacity) unless their key is in the
      ghost FIFO ``G``, in which case they go to the main FIFO ``M``; before the first
      eviction an entry that finds ``S`` full goes to ``M`` (libCacheSim's warm-up rule);
    * a hit increments a counter capped at 3;
    * eviction: from ``M`` when ``M`` is over its 90% share or ``S`` is empty, else from
      ``S``.  The tail of ``S`` moves to ``M`` when its counter reached
      ``move_to_main_threshold`` (libCacheSim's current default is 2; the paper's text and
      the pre-2024 default say 1), otherwise it is evicted and its key enters ``G``
      (``G`` holds keys whose sizes sum to <= 90% of capacity).  The tail of ``M`` is
      reinserted with counter-1 when its counter is > 0 (a 2-bit CLOCK), else evicted.

    Adaptation to pinning: a pinned entry met at a queue tail is rotated to the head of
    the same queue with its counter unchanged; it cannot be evicted now.
    """

    name = "s3fifo"

    def __init__(self, capacity: int, small_ratio: float = 0.10, ghost_ratio: float = 0.90,
                 move_to_main_threshold: int = 1):
        super().__init__(capacity)
        self.small_ratio = small_ratio
        self.ghost_ratio = ghost_ratio
        self.threshold = move_to_main_threshold
        self.small_cap = max(1, int(capacity * small_ratio))
        self.main_cap = capacity - self.small_cap
        self.ghost_cap = int(capacity * ghost_ratio)
        self.clear()

    def clear(self):
        self._S: OrderedDict[Key, int] = OrderedDict()  # key -> freq; head = last item
        self._M: OrderedDict[Key, int] = OrderedDict()
        self._G: OrderedDict[Key, int] = OrderedDict()  # key -> size
        self._size: dict[Key, int] = {}
        self._pinned: set[Key] = set()
        self.s_used = self.m_used = self.g_used = 0
        self._has_evicted = False

    def describe(self):
        return {"policy": self.name, "small_ratio": self.small_ratio,
                "ghost_ratio": self.ghost_ratio, "move_to_main_threshold": self.threshold}

    def insert(self, key, size):
        self._size[key] = size
        self._pinned.add(key)
        if key in self._G:
            self.g_used -= self._G.pop(key)
            self._M[key] = 0
            self.m_used += size
        elif not self._has_evicted and self.s_used >= self.small_cap:
            self._M[key] = 0
            self.m_used += size
        else:
            self._S[key] = 0
            self.s_used += size

    def hit(self, key):
        if key in self._S:
            f = self._S[key]
            if f < 3:
                self._S[key] = f + 1
        else:
            f = self._M[key]
            if f < 3:
                self._M[key] = f + 1

    def pin(self, key):
        self._pinned.add(key)

    def release(self, key):
        self._pinned.discard(key)

    def _ghost_add(self, key, size):
        self._G[key] = size
        self.g_used += size
        while self.g_used > self.ghost_cap and self._G:
            _, s = self._G.popitem(last=False)
            self.g_used -= s

    def _evict_small(self):
        S, pinned = self._S, self._pinned
        for _ in range(len(S)):
            key, freq = S.popitem(last=False)
            size = self._size[key]
            if key in pinned:
                S[key] = freq  # rotate; cannot evict now
                continue
            self.s_used -= size
            if freq >= self.threshold:
                self._M[key] = 0  # "its access bits are cleared during the move"
                self.m_used += size
                continue
            del self._size[key]
            self._ghost_add(key, size)
            return key
        return None

    def _evict_main(self):
        M, pinned = self._M, self._pinned
        # Each entry is seen at most 4 times (counter <= 3) plus pinned rotations.
        for _ in range(4 * len(M) + 1):
            if not M:
                break
            key, freq = M.popitem(last=False)
            if key in pinned:
                M[key] = freq
                continue
            if freq > 0:
                M[key] = freq - 1
                continue
            self.m_used -= self._size.pop(key)
            return key
        return None

    def evict(self):
        self._has_evicted = True
        for _ in range(3):
            if self.m_used > self.main_cap or self.s_used == 0:
                key = self._evict_main()
                if key is None:
                    key = self._evict_small()
            else:
                key = self._evict_small()
                if key is None:
                    key = self._evict_main()
            if key is not None:
                return key
        raise LookupError("no evictable entry")
