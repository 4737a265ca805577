"""Eviction policies for an encoder cache whose entries can be *pinned*.

What: pure-Python replacement policies (no vLLM import) behind one small interface, so the
trace simulator (:mod:`encache.policy.simulate`) and the vLLM manager
(``encache.connectors.vllm.manager``) run exactly the same decision code.

Why the interface looks like this: vLLM's ``EncoderCacheManager`` is a *demand* cache with
reference counts.  Every item a scheduled request needs must be resident while the request
holds a reference to it (the encoder output is read from the cache by the model runner),
and only unreferenced entries may be evicted, lazily, when space is needed.  So a policy
never decides *whether* to insert; it only decides *which unreferenced entry to drop* when
the manager needs room.  Admission-style policies (TinyLFU, S3-FIFO's small queue) express
"do not admit" as "evict first once released".

The caller (a cache core) guarantees the call protocol:

* ``insert(key, size)``  -- a miss: ``key`` becomes resident *and pinned*;
* ``hit(key)``           -- a new reference to a resident ``key`` (called after ``pin``
  when the entry was unreferenced);
* ``pin(key)``           -- a resident, unreferenced entry gets a reference again;
* ``release(key)``       -- the last reference was dropped; the entry is now evictable;
* ``evict() -> key``     -- remove and return one evictable entry (the caller guarantees
  one exists);
* ``clear()``            -- forget all resident entries (``EncoderCacheManager.reset``).

``hit``/``insert`` are the *accesses* (one per request and item); evictions triggered by
a miss happen before its ``insert``, as in vLLM (``can_allocate`` evicts, ``allocate``
inserts).  Sizes are in encoder embeddings ("tokens"), the unit of vLLM's cache budget.

Policies:

``fifo``  (:class:`FifoRelease`)  -- exactly vLLM 0.32's rule: unreferenced entries in the
          order they were *released*, oldest first.
``lru``   (:class:`LRU`)          -- least recently *accessed* unreferenced entry.
``s3fifo`` (:class:`S3FIFO`)      -- S3-FIFO (Yang et al., SOSP'23), after libCacheSim's
          ``S3FIFO.c``: 10% small FIFO, main FIFO with a 2-bit clock, ghost FIFO.
``wtinylfu`` (:class:`WTinyLFU`)  -- W-TinyLFU (Einziger, Friedman & Manes, TOS'17) as in
          Caffeine: 1% LRU window, segmented-LRU main (20% probation / 80% protected),
          count-min sketch (4-bit counters, 4 rows, reset every 10x entries) admission.
``dlfu``  (:class:`DecayedLFU`)   -- this project's policy, see its docstring.
``static`` (:class:`StaticOracle`) -- offline: ranks by true whole-trace frequency.
``belady`` (:class:`Belady`)      -- offline: evicts the entry re-used furthest in future.

The offline policies need the future: pass ``accesses=[key, ...]`` -- the exact sequence of
``hit``/``insert`` keys the caller will produce (see ``simulate.access_sequence``).
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

__all__ = [
    "Policy", "FifoRelease", "LRU", "S3FIFO", "WTinyLFU", "DecayedLFU", "StaticOracle",
    "Belady", "POLICIES", "ONLINE_POLICIES", "make_policy",
]

Key = Hashable
_SQRT2 = math.sqrt(2.0)


class Policy:
    """Common interface (see the module docstring for the call protocol)."""

    name = "base"
    needs_future = False

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = int(capacity)

    def insert(self, key: Key, size: int) -> None:
        raise NotImplementedError

    def hit(self, key: Key) -> None:
        raise NotImplementedError

    def pin(self, key: Key) -> None:
        raise NotImplementedError

    def release(self, key: Key) -> None:
        raise NotImplementedError

    def evict(self) -> Key:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """Parameters, for reports."""
        return {"policy": self.name}


# --------------------------------------------------------------------------------------
# vLLM's rule and plain LRU
# --------------------------------------------------------------------------------------


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


class LRU(Policy):
    """True LRU: evict the unreferenced entry whose last access is oldest."""

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest access first
        self._pinned: set[Key] = set()

    def insert(self, key, size):
        self._order[key] = None
        self._pinned.add(key)

    def hit(self, key):
        self._order.move_to_end(key)

    def pin(self, key):
        self._pinned.add(key)

    def release(self, key):
        self._pinned.discard(key)

    def evict(self):
        # Pinned entries were accessed recently (their request is in flight), so they sit
        # near the young end; the scan stops at the first unpinned one.
        for key in self._order:
            if key not in self._pinned:
                del self._order[key]
                return key
        raise LookupError("no evictable entry")

    def clear(self):
        self._order.clear()
        self._pinned.clear()


# --------------------------------------------------------------------------------------
# S3-FIFO (reference)
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# W-TinyLFU (reference)
# --------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_SEEDS = (0x97CB3127, 0xC2B2AE3D27D4EB4F, 0x9E3779B97F4A7C15, 0x165667B19E3779F9)


def stable_hash(key: Key) -> int:
    """A process-independent 64-bit hash (Python's ``hash`` of ``str`` is salted)."""
    if isinstance(key, int):
        h = key & _MASK64
    else:
        data = key.encode() if isinstance(key, str) else repr(key).encode()
        h = zlib.crc32(data) | (zlib.crc32(data, 0x5BD1E995) << 32)
    h = ((h ^ (h >> 33)) * 0xFF51AFD7ED558CCD) & _MASK64
    h = ((h ^ (h >> 33)) * 0xC4CEB9FE1A85EC53) & _MASK64
    return h ^ (h >> 33)


class CountMinSketch:
    """Caffeine-style frequency sketch: 4 rows of 4-bit counters with periodic halving.

    ``width`` is a power of two >= the expected number of cache entries; after
    ``10 * entries`` counted increments every counter is halved ("reset"), which ages the
    history.  ``frequency`` returns the minimum over rows (0..15).
    """

    def __init__(self, entries: int, sample_factor: int = 10):
        self.width = 1 << max(4, (max(1, entries) - 1).bit_length())
        self.mask = self.width - 1
        self.rows = [[0] * self.width for _ in range(4)]
        self.sample_size = sample_factor * max(1, entries)
        self.additions = 0
        self._idx: dict = {}  # memo of key -> counter indexes (pure speed-up)

    def _indexes(self, key):
        idx = self._idx.get(key)
        if idx is None:
            h = stable_hash(key)
            m = self.mask
            idx = [((h * s) & _MASK64) >> 40 & m for s in _SEEDS]
            if len(self._idx) >= 1 << 17:
                self._idx.clear()
            self._idx[key] = idx
        return idx

    def increment(self, key) -> None:
        added = False
        for row, i in zip(self.rows, self._indexes(key)):
            if row[i] < 15:
                row[i] += 1
                added = True
        if added:
            self.additions += 1
            if self.additions >= self.sample_size:
                self.reset()

    def frequency(self, key) -> int:
        return min(row[i] for row, i in zip(self.rows, self._indexes(key)))

    def reset(self) -> None:
        odd = 0
        for row in self.rows:
            for i, v in enumerate(row):
                odd += v & 1
                row[i] = v >> 1
        self.additions = max(0, self.additions - (odd >> 2)) >> 1


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


# --------------------------------------------------------------------------------------
# This project's policy
# --------------------------------------------------------------------------------------


class _Shadow:
    """A metadata-only cache that evicts by one ladder level's score (no pinning; a new
    key with the lowest score is simply not kept).  Used to measure, on the live stream,
    how many hits another half-life would have produced.

    Its heap holds ``(score, seq, key)``; scores only grow between rebases, so an entry
    whose key has a higher score now is re-pushed when popped (lazy increase-key)."""

    __slots__ = ("j", "cap", "used", "res", "heap", "seq")

    def __init__(self, j: int, cap: float):
        self.j, self.cap, self.used = j, cap, 0
        self.res: dict[Key, int] = {}
        self.heap: list[tuple[float, int, Key]] = []
        self.seq = 0

    def rebuild(self, hist: dict) -> None:
        j = self.j
        self.heap = [(hist[k][j], i, k) for i, k in enumerate(self.res)]
        heapq.heapify(self.heap)
        self.seq = len(self.heap)

    def downsample(self, mask: int, sample: dict, hist: dict) -> None:
        """Keep only keys in the halved sample (``hash & mask == 0``); halve capacity."""
        self.res = {k: s for k, s in self.res.items() if not (sample[k] & mask)}
        self.used = sum(self.res.values())
        self.cap /= 2
        self.rebuild(hist)

    def miss(self, key, size, hist) -> bool:
        """Insert ``key`` (not resident) and evict down to capacity; returns False."""
        res = self.res
        j = self.j
        res[key] = size
        self.used += size
        heap = self.heap
        self.seq += 1
        heapq.heappush(heap, (hist[key][j], self.seq, key))
        while self.used > self.cap and heap:
            prio, _, k = heapq.heappop(heap)
            if k not in res:
                continue
            cur = hist[k][j]
            if cur != prio:
                self.seq += 1
                heapq.heappush(heap, (cur, self.seq, k))
                continue
            self.used -= res.pop(k)
        return False

    def access(self, key, size, hist) -> bool:
        """Return True on a hit; on a miss insert and evict down to capacity."""
        return key in self.res or self.miss(key, size, hist)


class _ReleaseHeap:
    """Pinning for score-ranked policies: a released entry is pushed on a min-heap with
    its current ``_prio`` (ties: oldest release first); ``evict`` pops lazily, skipping
    entries that are pinned, gone, or re-released since (each class checks staleness)."""

    def pin(self, key):
        self._pinned.add(key)

    def release(self, key):
        self._pinned.discard(key)
        self._seq += 1
        heapq.heappush(self._heap, (self._prio(key), self._seq, key))


class DecayedLFU(_ReleaseHeap, Policy):
    """``dlfu``: cost-aware LFU with exponentially decayed counts, ghost history, and a
    half-life chosen online by shadow caches.

    Scores.  Every access adds ``2**(t/H)`` to the key's score, ``t`` a virtual clock that
    advances by ``size / capacity`` per access (so ``H`` is measured in "cache-fills of
    traffic" and means the same at every cache size).  Because every increment grows by
    the same factor over time, the order of two stored scores is the order of their
    decayed counts ``score * 2**(-t/H)`` at any later time: scores never need refreshing,
    and a long-ago burst loses to recent steady use.  (All scores are rescaled together,
    rarely, before the increments overflow.)  Eviction takes the unreferenced entry with
    the lowest ``score * size**(cost_exponent - 1)``; with the default
    ``cost_exponent=1`` (encoder compute proportional to tokens) that is the lowest
    decayed count: the policy maximises saved encoder tokens per cached token.

    History.  Scores of evicted keys are kept, bounded to ``ghost_factor`` x the largest
    number of resident entries (lowest scores pruned), so an item re-read every now and
    then builds up a count although it keeps getting evicted; a new item starts at one
    access and is the first candidate once released -- TinyLFU-like admission without a
    separate filter.

    Adaptive half-life (``halflife="auto"``, the default).  Stationary skewed traffic
    wants a long memory (LFU converges to the static oracle), drifting popularity a short
    one.  Each key carries a score for every half-life on a ladder (``level_factor``
    steps from ``min_level`` to ``max_level`` fills, default 2, 4, ..., 512;
    ``level_factor=sqrt(2)`` gives a finer ladder of 17 levels at ~2x the CPU); the
    cache evicts by the *active* level, initially ``start_level`` = the longest, i.e.
    plain LFU until the shadows show that shorter memory pays.  One metadata-only shadow
    cache per level replays the same accesses, evicting by that level; whenever a level's
    shadow has produced clearly more hits than the active level's shadow -- paired
    difference, exponentially forgotten over ``~vote_memory`` disagreements, above
    ``switch_sigmas * sqrt(disagreements) + switch_margin`` -- the cache switches to it
    (the evidence is then collected afresh against the new level).  Shadows are kept
    small by spatial sampling, as in SHARDS (Waldspurger et al., FAST'15): they see only
    keys whose stable hash is in a 1/R sample and have 1/R of the capacity, R doubling
    whenever a shadow would hold more than ``shadow_entries`` entries.  A fixed numeric
    ``halflife`` disables all of this.  (An earlier variant voted on single eviction
    decisions -- which of two candidate victims is re-used first -- and was biased toward
    short memory; shadows measure the objective itself.  Keeping the pairwise evidence
    across switches was tried too and adapted worse under drift: old evidence is stale.)

    Capped short levels.  On levels whose half-life is <= ``max_count_below`` fills
    (default 8: the levels 8, 4, 2 of the default ladder) the decayed count is capped at
    ``max_count`` (default 4) -- as S3-FIFO caps its counter at 3 -- so an item that was
    very hot before a popularity shift cannot outweigh the new favourites for long.  The
    long levels, which stationary traffic selects, are uncapped (a cap there hurts LFU's
    ranking); under drift the shadows pick the capped short levels.  ``max_count=None``
    (or ``max_count_below=0``) turns the cap off, ``max_count_below=math.inf`` caps every
    level; a fixed ``halflife`` <= ``max_count_below`` is capped like that ladder level.

    Cost and memory.  Per access: one score update per level (9 levels: one power and
    eight squarings) and, for the sampled keys only, one step in each shadow.  Memory:
    once it passes ``2 * (ghost_factor + 1) * max_resident + 64`` keys, the history is
    pruned (at the next eviction) to the resident keys, the keys the shadows hold (<=
    ``shadow_entries`` + 1 per level) and the ``ghost_factor * max_resident`` best-scored
    others; one float per level and key.  A compact frequency sketch for the evicted keys
    was considered and not needed: with ``ghost_factor=32`` (the default; 8 cost up to
    0.0002 hit ratio at alpha 0.6) unbounded exact history (``ghost_factor=1e9``) changes
    no benchmark cell measurably -- the remaining shortfall against the static oracle at
    alpha 0.6 is the cost of learning a flat ranking from few accesses, which
    perfect-history LFU (``halflife=1e9, ghost_factor=1e9``) pays as well, and which
    :func:`encache.policy.online_bound.online_bound` measures for any online policy.
    The switch margin of 8 disagreements (was 4) avoids early excursions of stationary
    traffic to short levels, which cost up to 0.001 hit ratio.
    """

    name = "dlfu"
    _REBASE = 960.0  # rescale when the largest exponent passes this (2**1023 overflows)

    def __init__(self, capacity: int, halflife: float | str = "auto",
                 ghost_factor: float = 32.0, cost_exponent: float = 1.0,
                 min_level: float = 2.0, max_level: float = 512.0,
                 level_factor: float = 2.0, start_level: float = 512.0,
                 vote_memory: int = 2000, shadow_entries: int = 512,
                 switch_margin: float = 8.0, switch_sigmas: float = 1.5,
                 max_count: float | None = 4.0, max_count_below: float = 8.0):
        super().__init__(capacity)
        if halflife == "auto":
            f = float(level_factor)
            if math.isclose(f, _SQRT2, rel_tol=1e-3):
                chains, sq = 2, 1     # two interleaved squaring chains: 1 and sqrt(2)
            elif f in (2.0, 4.0, 16.0):
                chains, sq = 1, int(math.log2(f))
            else:
                raise ValueError("level_factor must be sqrt(2), 2, 4 or 16")
            n = max(1, round(math.log(max_level / min_level) / math.log(f)) + 1)
            # ladder ordered from the *longest* half-life: level j = max_level / m_j with
            # exponent multiplier m_j = f**j.  Levels j and j + chains differ by 2**sq, so
            # level j's increment is level (j - chains)'s squared sq times; each chain
            # starts with one power of two (chain c: 2**(now * f**c)).
            self._mult = tuple(f ** (j % chains) * 2.0 ** (sq * (j // chains))
                               for j in range(n))
            self.levels = tuple(max_level / m for m in self._mult)
            self._chains, self._sq = chains, sq
            self.active = min(range(n),
                              key=lambda j: abs(math.log2(self.levels[j] / start_level)))
            self.adaptive = True
        else:
            if float(halflife) <= 0:
                raise ValueError("halflife must be positive")
            self.levels = (float(halflife),)
            self._mult = (1.0,)
            self.active = 0
            self.adaptive = False
            self._chains, self._sq = 1, 1
        self.level_factor = float(level_factor)
        self.ghost_factor = float(ghost_factor)
        self.cost_exponent = float(cost_exponent)
        self.vote_decay = 1.0 - 1.0 / max(1, vote_memory)
        self.shadow_entries = int(shadow_entries)
        self.switch_margin = float(switch_margin)
        self.switch_sigmas = float(switch_sigmas)
        self.max_count = None if max_count is None else float(max_count)
        self.max_count_below = float(max_count_below)
        self._smask = 0                  # sample keys with hash & _smask == 0 (R = mask+1)
        self._sample: dict[Key, int] = {}  # key -> stable hash (keys seen by shadows)
        self._nl = len(self.levels)
        # exponent of the longest level per token of traffic
        self._rate = 1.0 / (self.levels[0] * self.capacity)
        self._max_mult = max(self._mult)
        # levels are ordered longest first: the capped ones (half-life <= max_count_below)
        # are levels _first_capped.. (none when _first_capped == number of levels)
        self._first_capped = next(
            (j for j, h in enumerate(self.levels)
             if self.max_count is not None and h <= self.max_count_below), len(self.levels))
        self.now = 0.0      # exponent of the longest level since the last rebase
        self._hist: dict[Key, list[float]] = {}     # every known key -> score per level
        self._size: dict[Key, int] = {}             # resident key -> size
        self._pinned: set[Key] = set()
        self._heap: list[tuple[float, int, Key]] = []  # unpinned residents, active level
        self._seq = 0
        self._max_resident = 1
        self.moves = 0
        self._shadows: list[_Shadow] = (
            [_Shadow(j, self.capacity) for j in range(self._nl)] if self.adaptive else [])
        self._reset_votes()

    # -- bookkeeping ------------------------------------------------------------------
    def describe(self):
        d = {"policy": self.name, "ghost_factor": self.ghost_factor,
             "cost_exponent": self.cost_exponent, "max_count": self.max_count,
             "max_count_below": self.max_count_below}
        if self.adaptive:
            d.update(halflife="auto", levels=list(self.levels),
                     active_halflife=self.halflife, level_moves=self.moves,
                     shadow_sampling=1.0 / (self._smask + 1))
        else:
            d["halflife"] = self.levels[0]
        return d

    @property
    def halflife(self) -> float:
        return self.levels[self.active]

    def _reset_votes(self):
        # per level: forgotten sum of (hit_j - hit_active) and of |hit_j - hit_active|
        self._net = [0.0] * self._nl
        self._n = [0.0] * self._nl

    def _prio(self, key):
        p = self._hist[key][self.active]
        if self.cost_exponent != 1.0:
            p *= self._size[key] ** (self.cost_exponent - 1.0)
        return p

    def _rebuild_heap(self):
        self._heap = []
        for k in self._size:
            if k not in self._pinned:
                self._seq += 1
                self._heap.append((self._prio(k), self._seq, k))
        heapq.heapify(self._heap)

    def clear(self):
        # Keep popularity history and shadows: a reset invalidates embeddings, not what
        # users ask for.
        self._size.clear()
        self._pinned.clear()
        self._heap.clear()

    # -- accesses ---------------------------------------------------------------------
    def _access(self, key, size):
        sc = self._hist.get(key)
        if sc is None:
            sc = self._hist[key] = [0.0] * self._nl
        self.now += size * self._rate
        if self.now * self._max_mult > self._REBASE:
            self._rebase()
        now = self.now
        nl = self._nl
        u = self._first_capped
        if self._sq == 1 and self._chains == 1:
            # common case, unrolled: level j's increment is level j-1's squared
            inc = 2.0 ** now
            for j in range(u):
                sc[j] += inc
                inc *= inc
            if u < nl:
                cap = self.max_count
                for j in range(u, nl):
                    x = sc[j] + inc
                    c = cap * inc
                    sc[j] = x if x < c else c
                    inc *= inc
        else:
            cap = self.max_count
            for j, inc in enumerate(self._increments(now)):
                x = sc[j] + inc
                if j >= u and x > cap * inc:
                    x = cap * inc
                sc[j] = x
        if self.adaptive:
            self._observe(key, size)

    def _increments(self, now: float) -> list[float]:
        """``2**(now * m_j)`` for every level, computed exactly as ``_access`` does."""
        out = [0.0] * self._nl
        for c in range(self._chains):
            inc = 2.0 ** (now * self._mult[c]) if c else 2.0 ** now
            for j in range(c, self._nl, self._chains):
                if j >= self._chains:
                    for _ in range(self._sq):
                        inc *= inc
                out[j] = inc
        return out

    def _rebase(self):
        """Divide every level-j score by the current level-j increment; heaps rebuilt."""
        factors = self._increments(-self.now)
        for sc in self._hist.values():
            for j in range(self._nl):
                sc[j] *= factors[j]
        self.now = 0.0
        self._rebuild_heap()
        for s in self._shadows:
            s.rebuild(self._hist)

    def _observe(self, key, size):
        hb = self._sample.get(key)
        if hb is None:
            hb = stable_hash(key)
            if hb & self._smask:
                return
            self._sample[key] = hb
        elif hb & self._smask:
            return
        hist = self._hist
        hits = [key in sh.res or sh.miss(key, size, hist) for sh in self._shadows]
        a = self.active
        ha = hits[a]
        net, n, decay = self._net, self._n, self.vote_decay
        best = -1
        best_margin = 0.0
        for j, hj in enumerate(hits):
            if hj != ha:
                net[j] = net[j] * decay + (1.0 if hj else -1.0)
                n[j] = n[j] * decay + 1.0
                margin = net[j] - self.switch_sigmas * math.sqrt(n[j]) - self.switch_margin
                if margin > best_margin:
                    best, best_margin = j, margin
        if best >= 0:
            self._switch(best)
        if len(self._shadows[a].res) > self.shadow_entries:
            self._downsample()

    def _downsample(self):
        mask = 2 * self._smask + 1
        for sh in self._shadows:
            sh.downsample(mask, self._sample, self._hist)
        self._smask = mask
        self._sample = {k: h for k, h in self._sample.items() if not (h & mask)}
        self._reset_votes()

    def _switch(self, j):
        self.active = j
        self.moves += 1
        self._reset_votes()
        self._rebuild_heap()

    def insert(self, key, size):
        self._access(key, size)
        self._size[key] = size
        self._pinned.add(key)
        n = len(self._size)
        if n > self._max_resident:
            self._max_resident = n

    def hit(self, key):
        self._access(key, self._size[key])


    # -- eviction ---------------------------------------------------------------------
    def evict(self):
        heap, pinned, size = self._heap, self._pinned, self._size
        while heap:
            prio, _, key = heapq.heappop(heap)
            if key not in size or key in pinned or self._prio(key) != prio:
                continue  # stale: evicted, re-pinned, or re-released with a new score
            del size[key]
            if len(self._hist) > 2 * self._hist_limit() + 64:
                self._prune_history()
            return key
        raise LookupError("no evictable entry")

    def _hist_limit(self) -> int:
        return int((self.ghost_factor + 1) * self._max_resident)

    def _prune_history(self):
        """Keep the ``ghost_factor * max_resident`` best-scored non-resident keys (and
        every key the cache or a shadow still holds)."""
        a = self.active
        keep = set(self._size)
        for s in self._shadows:
            keep.update(s.res)
        ghosts = [(sc[a], k) for k, sc in self._hist.items() if k not in keep]
        n_ghost = int(self.ghost_factor * self._max_resident)
        if len(ghosts) > n_ghost:
            drop = heapq.nsmallest(len(ghosts) - n_ghost, ghosts, key=lambda x: x[0])
            for _, k in drop:
                del self._hist[k]
                self._sample.pop(k, None)


# --------------------------------------------------------------------------------------
# Offline references
# --------------------------------------------------------------------------------------


class StaticOracle(_ReleaseHeap, Policy):
    """Offline static oracle: the best *fixed* ranking, by true popularity.

    Evicts the unreferenced entry with the lowest ``weight * cost(size) / size`` (with the
    default cost exponent 1: the lowest weight), ties broken oldest-release first.  In
    steady state it keeps the top-C items by true frequency -- the classic IRM benchmark
    for online policies -- while still paying compulsory misses.

    ``weights`` is the true popularity (the generator's ``RagWorkload.popularity``).  For a
    replayed trace, whose true popularity is unknown, pass ``accesses`` instead: the
    realised whole-trace counts are used, a *hindsight* ranking that also exploits the
    trace's sampling noise and is therefore a stronger (less attainable) reference.
    """

    name = "static"
    needs_future = True

    def __init__(self, capacity: int, accesses: Sequence[Key] | None = None,
                 weights: dict | None = None, cost_exponent: float = 1.0):
        super().__init__(capacity)
        if weights is None:
            if accesses is None:
                raise ValueError("static oracle needs weights or accesses")
            counts: dict[Key, float] = {}
            for k in accesses:
                counts[k] = counts.get(k, 0) + 1
            weights = counts
        self.source = "popularity" if accesses is None else "hindsight-counts"
        self._counts = weights
        self.cost_exponent = cost_exponent
        self.clear()

    def describe(self):
        return {"policy": self.name, "ranking": self.source}

    def clear(self):
        self._heap: list[tuple[float, int, Key]] = []
        self._pinned: set[Key] = set()
        self._size: dict[Key, int] = {}
        self._seq = 0

    def _prio(self, key):
        c = float(self._counts.get(key, 0))
        if self.cost_exponent != 1.0:
            c *= self._size[key] ** (self.cost_exponent - 1.0)
        return c

    def insert(self, key, size):
        self._size[key] = size
        self._pinned.add(key)

    def hit(self, key):
        pass


    def evict(self):
        heap, pinned = self._heap, self._pinned
        while heap:
            _, _, key = heapq.heappop(heap)
            if key in pinned or key not in self._size:
                continue
            del self._size[key]
            return key
        raise LookupError("no evictable entry")


class Belady(Policy):
    """Belady's MIN: evict the unreferenced entry whose next access is furthest away.

    ``accesses`` must be the exact key sequence of the caller's ``hit``/``insert`` calls.
    Exactly optimal for unit-size entries (also with pinning: pinned sets do not depend on
    the policy); with variable sizes it is the standard offline reference but not a proof
    of optimality (the variable-size problem is NP-hard) -- ``simulate.space_time_bound``
    gives a true upper bound for that case.
    """

    name = "belady"
    needs_future = True

    def __init__(self, capacity: int, accesses: Sequence[Key]):
        super().__init__(capacity)
        n = len(accesses)
        nxt = [n + 1] * n
        last: dict[Key, int] = {}
        for i in range(n - 1, -1, -1):
            k = accesses[i]
            nxt[i] = last.get(k, n + 1 + i)  # never again: further than anything (by age)
            last[k] = i
        self._keys = accesses
        self._next_use = nxt
        self.clear()

    def clear(self):
        self._pos = 0
        self._next: dict[Key, int] = {}
        self._pinned: set[Key] = set()
        self._heap: list[tuple[int, Key]] = []

    def _advance(self, key):
        pos = self._pos
        if pos >= len(self._keys) or self._keys[pos] != key:
            raise RuntimeError(f"access #{pos} ({key!r}) does not match the future trace")
        self._next[key] = self._next_use[pos]
        self._pos = pos + 1

    def insert(self, key, size):
        self._advance(key)
        self._pinned.add(key)

    def hit(self, key):
        self._advance(key)

    def pin(self, key):
        self._pinned.add(key)

    def release(self, key):
        self._pinned.discard(key)
        heapq.heappush(self._heap, (-self._next[key], key))

    def evict(self):
        heap, pinned, nxt = self._heap, self._pinned, self._next
        while heap:
            neg, key = heapq.heappop(heap)
            if key in pinned or nxt.get(key) != -neg:
                continue
            del nxt[key]
            return key
        raise LookupError("no evictable entry")


# --------------------------------------------------------------------------------------

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
