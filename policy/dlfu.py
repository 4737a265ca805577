"""``dlfu``: this project's L1 policy -- cost-aware LFU with exponentially decayed counts,
ghost history, and a half-life chosen online by shadow caches (:mod:`.shadow`).

How it decides and how it compares is in docs/policy.md; the class docstring states the
mechanism, every parameter and why the defaults are what they are.
"""

from __future__ import annotations

import heapq
import math

from .base import Key, Policy, ReleaseHeap
from .shadow import Shadow
from .sketch import stable_hash

__all__ = ["DecayedLFU"]

_SQRT2 = math.sqrt(2.0)


class DecayedLFU(ReleaseHeap, Policy):
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
    ``halflife`` disables all of this.  Shadows measure the objective itself (voting on
    single eviction decisions was biased toward short memory), and evidence is not kept
    across a switch (old evidence is stale under drift).  A finer sqrt(2) ladder
    (``level_factor``) is about as good once the short levels are capped and costs ~2x
    the CPU.

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
    others; one float per level and key.  Why 32 and no frequency sketch: unbounded exact
    history (``ghost_factor=1e9``) changes no benchmark cell measurably (8 costs up to
    0.0002 hit ratio at alpha 0.6).  Why a switch margin of 8: smaller margins let
    stationary traffic wander to short levels early, costing up to 0.001 hit ratio.
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
        self._shadows: list[Shadow] = (
            [Shadow(j, self.capacity) for j in range(self._nl)] if self.adaptive else [])
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
