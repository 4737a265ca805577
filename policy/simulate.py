"""Trace replay through an L1 encoder cache (and optional L2 tiers) with pinning.

What: :func:`simulate` replays a trace (:mod:`encache.policy.workload`) through a cache
*core* that has vLLM ``EncoderCacheManager``'s contract -- a hit adds a reference, a miss
must find room (``can_allocate``: evict unreferenced entries, chosen by the policy) and is
then inserted referenced, a finished request drops its references -- and reports hits,
encoder tokens computed, evictions, and for each L2 tier the loads and bytes moved.

Two cores share one call sequence, so the same replay drives:

* :class:`PolicyCache` -- the pure-Python twin of the manager's bookkeeping around any
  :mod:`encache.policy` policy (fast; used for the grid);
* ``VllmManagerCache`` (``tests/policy_vllm.py``) -- a real vLLM manager class (vLLM's own
  ``EncoderCacheManager`` or ``encache.connectors.vllm.manager.PolicyEncoderCacheManager``)
  driven with fake requests.

Concurrency, as in a serving engine, in one of three modes: ``concurrency=N`` -- up to N
requests hold references at once, finishing in arrival order (request *i* releases its
items when request *i + N* starts); ``hold_seconds=S`` -- request *i* releases when the
trace time passes ``t_i + S``; ``hold_seconds="trace"`` -- it releases at
``t_i + duration_i`` from the trace (out-of-order completion, as with varying output
lengths).  If the
unreferenced space cannot make room for a miss, the oldest in-flight request is finished
early (the engine would make the new request wait) and a *stall* is counted.  A repeated
identifier inside one request is a hit without a new reference, as in vLLM's scheduler.

L2 (:class:`L2Tier`): a second, larger tier behind L1 (disk or Redis in encache).  An L1
miss that the L2 holds is a *load* (no encoder compute, ``num_tokens * bytes_per_token``
read); otherwise the encoder runs and the result is written to L2 (``write="compute"``,
what an ECConnector's ``save_caches`` does) or only when L1 evicts it
(``write="evict"``).  L2 never changes L1's decisions, so every L2 variant is observed in
the same replay.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from .base import Policy
from .registry import POLICIES, make_policy
from .workload import Request

__all__ = ["PolicyCache", "L2Tier", "access_sequence", "simulate", "space_time_bound",
           "DEFAULT_BYTES_PER_TOKEN"]

# One embedding of a 4096-wide LLM in bf16.
DEFAULT_BYTES_PER_TOKEN = 4096 * 2


class PolicyCache:
    """Pure-Python twin of ``EncoderCacheManager`` bookkeeping around a :class:`Policy`.

    ``free = capacity - used``; ``freeable = free + size of unreferenced entries``; a miss
    that exceeds ``free`` evicts policy-chosen unreferenced entries (``can_allocate``);
    refusing only when ``freeable`` is too small.
    """

    def __init__(self, capacity: int, policy: Policy):
        self.capacity = capacity
        self.policy = policy
        self.used = 0
        self.pinned_used = 0
        self.refs: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        self.evicted: list[tuple[str, int]] = []

    # request-level protocol shared with the vLLM adapter ------------------------------
    def begin(self, req: Request):
        return [req.request_id, []]  # id, keys referenced

    def lookup(self, handle, key: str, size: int) -> bool:
        r = self.refs.get(key)
        if r is None:
            return False
        if r == 0:
            self.pinned_used += self.sizes[key]
            self.policy.pin(key)
        self.refs[key] = r + 1
        handle[1].append(key)
        self.policy.hit(key)
        return True

    def can_allocate(self, handle, key: str, size: int) -> bool:
        if size <= self.capacity - self.used:
            return True
        if size > self.capacity - self.pinned_used:
            return False
        policy, sizes, refs = self.policy, self.sizes, self.refs
        while size > self.capacity - self.used:
            k = policy.evict()
            if refs.pop(k) != 0:
                raise AssertionError(f"policy {policy.name} evicted referenced {k!r}")
            s = sizes.pop(k)
            self.used -= s
            self.evicted.append((k, s))
        return True

    def allocate(self, handle, key: str, size: int) -> None:
        self.refs[key] = 1
        self.sizes[key] = size
        self.used += size
        self.pinned_used += size
        handle[1].append(key)
        self.policy.insert(key, size)

    def finish(self, handle) -> None:
        refs, policy = self.refs, self.policy
        for key in handle[1]:
            r = refs[key] - 1
            refs[key] = r
            if r == 0:
                self.pinned_used -= self.sizes[key]
                policy.release(key)
        handle[1] = []

    def pop_evicted(self) -> list[tuple[str, int]]:
        ev, self.evicted = self.evicted, []
        return ev


class L2Tier:
    """An LRU second tier of ``capacity`` tokens (``None``: unbounded)."""

    def __init__(self, name: str = "l2", capacity: int | None = None, write: str = "compute",
                 bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN):
        if write not in ("compute", "evict"):
            raise ValueError("write must be 'compute' or 'evict'")
        self.name, self.capacity, self.write = name, capacity, write
        self.bytes_per_token = bytes_per_token
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.used = 0
        self.loads = self.load_tokens = self.writes = self.write_tokens = 0
        self.computed = self.computed_tokens = 0

    def reset_counters(self):
        self.loads = self.load_tokens = self.writes = self.write_tokens = 0
        self.computed = self.computed_tokens = 0

    def _put(self, key, size):
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        if self.capacity is not None and size > self.capacity:
            return
        self._lru[key] = size
        self.used += size
        self.writes += 1
        self.write_tokens += size
        if self.capacity is not None:
            while self.used > self.capacity:
                _, s = self._lru.popitem(last=False)
                self.used -= s

    def on_l1_miss(self, key, size):
        if key in self._lru:
            self._lru.move_to_end(key)
            self.loads += 1
            self.load_tokens += size
            return
        self.computed += 1
        self.computed_tokens += size
        if self.write == "compute":
            self._put(key, size)

    def on_l1_evict(self, key, size):
        if self.write == "evict":
            self._put(key, size)

    def report(self) -> dict:
        bpt = self.bytes_per_token
        return {
            "name": self.name, "capacity": self.capacity, "write": self.write,
            "encoder_tokens": self.computed_tokens, "encoder_items": self.computed,
            "l2_loads": self.loads, "l2_load_tokens": self.load_tokens,
            "l2_writes": self.writes,
            "bytes_read": self.load_tokens * bpt, "bytes_written": self.write_tokens * bpt,
            "bytes_moved": (self.load_tokens + self.write_tokens) * bpt,
        }


class InFlight:
    """The requests holding references, and when they let go (the replay's concurrency).

    ``concurrency=N``: request *i* finishes when request *i + N* starts;
    ``hold_seconds=S`` / ``"trace"``: when the trace time passes ``t_i + S`` /
    ``t_i + duration_i``. ``finish(handle)`` is called for each finished request.
    Shared by :func:`simulate` and :func:`encache.policy.online_bound.online_bound`, so
    the bound holds exactly the references the simulated caches hold.
    """

    def __init__(self, finish, concurrency: int = 8, hold_seconds: float | str | None = None,
                 trace: Sequence[Request] = ()):
        self.check(concurrency, hold_seconds, trace)
        self.finish = finish
        self.concurrency = concurrency
        self.hold_seconds = hold_seconds
        self._queue: deque = deque()  # concurrency mode, arrival order
        self._timed: list[tuple[float, int, Any]] = []  # hold mode: (until, seq, handle)
        self._seq = 0

    @staticmethod
    def check(concurrency: int, hold_seconds: float | str | None,
              trace: Sequence[Request]) -> None:
        """ValueError for settings the replay cannot follow."""
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if hold_seconds == "trace" and any(r.duration is None for r in trace):
            raise ValueError('hold_seconds="trace" needs a duration on every request')

    def arrive(self, req: Request) -> None:
        """Finish what is due before ``req`` starts."""
        if self.hold_seconds is not None:
            timed = self._timed
            while timed and timed[0][0] <= req.t:
                self.finish(heapq.heappop(timed)[2])
        else:
            while len(self._queue) >= self.concurrency:
                self.finish(self._queue.popleft())

    def add(self, req: Request, handle) -> None:
        """``req`` (now started, as ``handle``) holds its references until it is due."""
        if self.hold_seconds is not None:
            self._seq += 1
            hold = req.duration if self.hold_seconds == "trace" else self.hold_seconds
            heapq.heappush(self._timed, (req.t + hold, self._seq, handle))
        else:
            self._queue.append(handle)

    def finish_oldest(self) -> bool:
        """Finish the request due first, early (a stall); False if none is in flight."""
        if self.hold_seconds is not None:
            if not self._timed:
                return False
            self.finish(heapq.heappop(self._timed)[2])
        else:
            if not self._queue:
                return False
            self.finish(self._queue.popleft())
        return True

    def drain(self) -> None:
        while self.finish_oldest():
            pass


def _distinct(items) -> list[tuple[str, int]]:
    seen: dict[str, int] = {}
    for it in items:
        if it.identifier not in seen:
            seen[it.identifier] = it.num_tokens
    return list(seen.items())


def access_sequence(trace: Sequence[Request]) -> list[str]:
    """The key of every ``hit``/``insert`` call :func:`simulate` makes, in order
    (each request's distinct identifiers, first occurrence order).  Offline policies
    (static oracle, Belady) are built from it."""
    out: list[str] = []
    for r in trace:
        out.extend(k for k, _ in _distinct(r.items))
    return out


def simulate(trace: Sequence[Request], capacity: int, policy: str | Policy = "dlfu", *,
             core=None, concurrency: int = 8, hold_seconds: float | str | None = None,
             l2: Sequence[L2Tier] = (), policy_params: dict | None = None,
             accesses: list[str] | None = None, warmup: int = 0) -> dict:
    """Replay ``trace`` through an L1 of ``capacity`` tokens; return counters.

    ``policy`` is a policy name (offline ones get the future from ``accesses`` or the
    trace) or an instance; ``core`` overrides the cache core (e.g. a vLLM manager
    adapter), in which case ``policy`` is only a label.  The first ``warmup`` requests
    are replayed but not counted (hits, misses, evictions, L2 traffic).
    """
    if core is None:
        params = dict(policy_params or {})
        if isinstance(policy, str):
            if POLICIES[policy].needs_future and "weights" not in params:
                params["accesses"] = accesses if accesses is not None else access_sequence(trace)
            pol = make_policy(policy, capacity, **params)
        else:
            pol = policy
        core = PolicyCache(capacity, pol)
        label = pol.name
    else:
        label = policy if isinstance(policy, str) else policy.name
    inflight = InFlight(core.finish, concurrency, hold_seconds, trace)
    hits = hit_tokens = dup_hits = misses = miss_tokens = refs = tokens = 0
    evictions = stalls = 0
    lookup, can_allocate, allocate = core.lookup, core.can_allocate, core.allocate
    pop_evicted = core.pop_evicted

    l2_all = l2
    for n_req, req in enumerate(trace):
        if n_req == warmup and warmup:
            hits = hit_tokens = dup_hits = misses = miss_tokens = refs = tokens = 0
            evictions = stalls = 0
            for tier in l2_all:
                tier.reset_counters()
        inflight.arrive(req)
        handle = core.begin(req)
        distinct = _distinct(req.items)
        dup_hits += len(req.items) - len(distinct)
        for key, size in distinct:
            refs += 1
            tokens += size
            if lookup(handle, key, size):
                hits += 1
                hit_tokens += size
                continue
            while not can_allocate(handle, key, size):
                stalls += 1
                if not inflight.finish_oldest():
                    raise ValueError(
                        f"request {req.request_id}: item {key} ({size} tokens) does not fit "
                        f"in an L1 of {capacity} tokens next to the request's other items")
            ev = pop_evicted()
            if ev:
                evictions += len(ev)
                for tier in l2:
                    for k, s in ev:
                        tier.on_l1_evict(k, s)
            allocate(handle, key, size)
            misses += 1
            miss_tokens += size
            for tier in l2:
                tier.on_l1_miss(key, size)
        inflight.add(req, handle)
    inflight.drain()

    return {
        "policy": label, "capacity": capacity,
        "concurrency": concurrency if hold_seconds is None else None,
        "hold_seconds": hold_seconds,
        "requests": len(trace) - warmup, "warmup_requests": warmup,
        "item_refs": refs, "token_refs": tokens,
        "hits": hits, "hit_tokens": hit_tokens, "duplicate_hits": dup_hits,
        "misses": misses, "encoder_tokens": miss_tokens,
        "hit_ratio": hits / refs if refs else 0.0,
        "token_hit_ratio": hit_tokens / tokens if tokens else 0.0,
        "evictions": evictions, "stalls": stalls,
        "l2": [t.report() for t in l2],
    }


def space_time_bound(trace: Sequence[Request], capacity: int) -> dict:
    """Upper bounds on any policy's hit ratios at ``capacity`` (sizes may vary).

    A hit on an access of key ``k`` needs ``k`` resident since its previous access:
    ``size * gap`` token-steps of a total of ``capacity * n_accesses``.  Taking the
    cheapest hits first (fractional knapsack) bounds every schedule, Belady included --
    the PFOO-U bound of Berger et al. (SIGMETRICS'18).  Token hit ratio: value ``size``,
    cost ``size * gap`` (shortest gaps first); object hit ratio: value 1.
    """
    import numpy as np

    last: dict[str, int] = {}
    gaps: list[int] = []
    gsizes: list[int] = []
    n = 0
    total_tokens = 0
    for r in trace:
        for k, s in _distinct(r.items):
            total_tokens += s
            p = last.get(k)
            if p is not None:
                gaps.append(n - p)
                gsizes.append(s)
            last[k] = n
            n += 1
    if n == 0:
        return {"token_hit_ratio": 0.0, "hit_ratio": 0.0}
    budget = float(capacity) * n
    g = np.asarray(gaps, dtype=float)
    s = np.asarray(gsizes, dtype=float)

    def bound(order_key, value):
        order = np.argsort(order_key, kind="stable")
        cost = np.cumsum((s * g)[order])
        val = np.cumsum(value[order])
        i = int(np.searchsorted(cost, budget, side="right"))
        got = val[i - 1] if i > 0 else 0.0
        if i < len(order):
            prev_cost = cost[i - 1] if i > 0 else 0.0
            j = order[i]
            got += value[j] * (budget - prev_cost) / (s[j] * g[j])
        return float(got)

    return {"token_hit_ratio": bound(g, s) / total_tokens if len(g) else 0.0,
            "hit_ratio": bound(s * g, np.ones_like(s)) / n if len(g) else 0.0}
