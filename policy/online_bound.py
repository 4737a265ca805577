"""The best hit ratio any *online* policy can expect on a stationary trace.

What: :func:`online_bound` replays a trace and, before each request, lets an idealised
cache hold the items of the requests still in flight (every cache must) and fill the
rest of its ``capacity`` tokens with the items of the highest request counts *so far* --
placed freely (no demand paging, no compulsory misses; the boundary group of equal
counts is filled fractionally, its hit credited pro rata).  It returns that idealised
cache's token hit ratio per capacity.

Why: issue #6 compares online policies with the *static oracle*, which knows each item's
true popularity.  An online policy only sees the requests so far, and when popularity is
flat (Zipf alpha 0.6) and the trace short, the counts it sees rank items poorly -- no
policy can close that gap.  This function measures the gap, so a shortfall against the
static oracle can be told apart from a policy defect.

Why it is an upper bound (in expectation) on stationary traces of the generator in
:mod:`encache.policy.workload`: there every request draws documents from one fixed
popularity vector whose weights are assigned to documents by a uniformly random
permutation, independent of page counts and token sizes.  For independent draws, pairing
every assignment with the one that swaps the weights of two documents with counts
``n_a > n_b`` multiplies the likelihood by ``(w_x / w_y) ** (n_a - n_b)`` in favour of
``a`` holding the larger weight, so ``a`` is at least as likely as ``b`` to be in the
next request, whatever else the history says.  So the expected token hits of *any* cache
content chosen from the history (any online policy, whatever it remembers) are at most
those of filling ``capacity`` tokens in descending count order -- fractionally, which
relaxes the knapsack; in-flight items are resident for every policy alike, so they
are held and the rest is ranked.  Items of one document always share a count, so ranking items is
ranking documents.  The generator's rejection of a repeated document within one query
is a small correction to "independent" (the top weight is under 2% at alpha 0.6).  The
relaxations (free placement, no compulsory misses) only raise the bound.  It
is an expectation: a policy can beat it on one trace by luck, by about the sampling
noise of the hit ratio (~0.002 on the benchmark's traces).  Under popularity drift the
premise fails and the function does not apply.  Only the *token* hit ratio is bounded
(for unit sizes, the hit ratio): with variable sizes the best object hit ratio ranks by
count per token, which this does not.

Unseen items: the catalogue's unseen items form the count-0 group; ``catalog_tokens``
(all pages of all documents, :attr:`RagWorkload.catalog_tokens`) sizes it, so early in the
trace spare capacity is credited to unseen items too (generous, like the rest).
"""

from __future__ import annotations

from collections.abc import Sequence

from .simulate import InFlight, _distinct
from .workload import Request

__all__ = ["online_bound"]


class _Fenwick:
    """Prefix sums of token mass by request count (counts 0..n)."""

    def __init__(self, n: int):
        self.n = n + 1
        self.tree = [0] * (self.n + 1)

    def add(self, i: int, v: int) -> None:
        i += 1
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += v
            i += i & -i

    def below(self, i: int) -> int:
        """Token mass of items with count < ``i``."""
        s = 0
        tree = self.tree
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s


def online_bound(trace: Sequence[Request], capacities: Sequence[int],
                 catalog_tokens: int | None = None, *, concurrency: int = 8,
                 hold_seconds: float | str | None = None) -> list[dict]:
    """Token hit ratio of the count-ranked idealised cache, per capacity.

    ``concurrency``/``hold_seconds`` are :func:`encache.policy.simulate.simulate`'s: the
    items of in-flight requests are resident in every cache (hits for any policy), so the
    idealised cache holds them and fills only the rest of ``capacity`` by count; when
    they leave no room for a new request the oldest in-flight request finishes early, as
    the simulator's stall does.  ``catalog_tokens`` defaults to the trace's unique
    tokens.  Returns one dict per capacity: ``{"capacity", "token_hit_ratio"}``.  A
    repeated identifier within one request counts once, as in the simulator.
    """
    InFlight.check(concurrency, hold_seconds, trace)
    requests = [_distinct(r.items) for r in trace]
    sizes = dict(kv for items in requests for kv in items)
    seen_tokens = sum(sizes.values())
    catalog = seen_tokens if catalog_tokens is None else int(catalog_tokens)
    if catalog < seen_tokens:
        raise ValueError(f"catalog_tokens {catalog} < unique tokens of the trace "
                         f"{seen_tokens}")
    return [{"capacity": int(c),
             "token_hit_ratio": _replay(trace, requests, int(c), catalog,
                                        concurrency, hold_seconds)}
            for c in capacities]


def _replay(trace, requests, capacity: int, catalog: int, concurrency: int,
            hold_seconds) -> float:
    fen = _Fenwick(len(requests) + 1)   # token mass of *unpinned* items by count
    group = {0: catalog}                # count -> unpinned token mass with that count
    fen.add(0, catalog)
    count: dict[str, int] = {}
    pins: dict[str, int] = {}           # in-flight references per item
    pinned_tokens = 0
    hit_tokens = 0.0
    tokens = 0

    def release(items) -> None:
        nonlocal pinned_tokens
        for k, s in items:
            left = pins[k] - 1
            if left:
                pins[k] = left
                continue
            del pins[k]
            pinned_tokens -= s
            n = count[k]
            group[n] = group.get(n, 0) + s
            fen.add(n, s)

    inflight = InFlight(release, concurrency, hold_seconds)
    for req, items in zip(trace, requests):
        inflight.arrive(req)
        new_tokens = sum(s for k, s in items if k not in pins)
        while pinned_tokens + new_tokens > capacity and inflight.finish_oldest():
            new_tokens = sum(s for k, s in items if k not in pins)
        free = capacity - pinned_tokens
        for k, s in items:
            tokens += s
            if k in pins:
                hit_tokens += s
                continue
            n = count.get(k, 0)
            g = group[n]
            above = catalog - pinned_tokens - fen.below(n + 1)
            hit_tokens += s * min(1.0, max(0.0, (free - above) / g))
        for k, s in items:
            n = count.get(k, 0)
            count[k] = n + 1
            if k in pins:
                pins[k] += 1
                continue
            pins[k] = 1
            pinned_tokens += s
            group[n] -= s
            fen.add(n, -s)
        inflight.add(req, items)
    return hit_tokens / tokens if tokens else 0.0
