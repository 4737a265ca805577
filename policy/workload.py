"""RAG request traces: a seeded generator and a JSONL reader/writer.

What: a *trace* is a list of :class:`Request` -- arrival time, request id and the
multimodal items it carries (``identifier`` = vLLM's ``mm_hash``/UUID, ``num_tokens`` =
encoder embeddings the item occupies in vLLM's encoder cache).

Why a RAG model: retrieval-augmented multimodal serving re-reads document page images.
Which documents come back is skewed (a few are relevant to many questions), changes
slowly as interests drift, and each document contributes every one of its pages, at a
resolution-dependent token count.  :class:`RagWorkload` generates that:

* ``num_docs`` documents; document ``d`` has ``1..max_pages`` page images (uniform) and
  one token count per document drawn from ``token_choices``/``token_weights`` (pages of a
  PDF share a resolution; e.g. 576 = LLaVA-1.5 at 336 px, larger = tiled/dynamic
  resolution models).  ``token_choices=(1,)`` with ``max_pages=1`` gives the unit-size
  "one image per document" setting.
* each query retrieves ``docs_per_query`` *distinct* documents; document popularity
  follows Zipf(``alpha``) over ranks (``p(rank r) ~ 1/r**alpha``) and ranks are mapped to
  documents by a random permutation.
* popularity drift: every ``drift_interval`` queries, ``drift_swaps`` random ranks among
  the ``hot_ranks`` most popular swap their document with a uniformly random rank, so
  hot documents go cold and cold ones (anywhere in the tail) become hot.
  ``drift_interval=0`` gives a stationary trace.
* arrivals are Poisson at ``arrival_rate`` requests/s (``t`` in seconds); when
  ``mean_duration`` is set each request also gets a lognormal (sigma 1) ``duration``, the
  time it holds its items -- requests then finish out of arrival order, as with varying
  output lengths, and ``arrival_rate * mean_duration`` requests are in flight on average.

Real traces: :func:`read_trace`/:func:`write_trace` use JSONL, one request per line:
``{"t": 0.12, "request_id": "r42", "items": [{"identifier": "doc7/p0", "num_tokens": 576}]}``
(an optional ``"duration"`` in seconds is kept).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Item", "Request", "RagWorkload", "read_trace", "write_trace", "trace_summary"]


@dataclass(frozen=True, slots=True)
class Item:
    identifier: str
    num_tokens: int


@dataclass(slots=True)
class Request:
    t: float
    request_id: str
    items: list[Item]
    #: seconds the request holds its items (prefill + decode); optional
    duration: float | None = None


@dataclass
class RagWorkload:
    """Seeded RAG trace generator; see the module docstring for the model."""

    num_docs: int = 20_000
    num_queries: int = 30_000
    docs_per_query: int = 4
    alpha: float = 0.8
    max_pages: int = 1
    token_choices: Sequence[int] = (1,)
    token_weights: Sequence[float] | None = None
    drift_interval: int = 0
    drift_swaps: int = 0
    hot_ranks: int = 0
    arrival_rate: float = 20.0
    mean_duration: float | None = None
    seed: int = 0
    name: str = field(default="rag")

    def __post_init__(self):
        if self.docs_per_query > self.num_docs:
            raise ValueError("docs_per_query must be <= num_docs")
        if self.max_pages < 1 or self.num_docs < 1 or self.alpha < 0:
            raise ValueError("bad workload parameters")

    def params(self) -> dict:
        d = asdict(self)
        d["token_choices"] = list(self.token_choices)
        d["token_weights"] = None if self.token_weights is None else list(self.token_weights)
        return d

    def documents(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(pages per document, tokens per page of each document)."""
        pages = rng.integers(1, self.max_pages + 1, size=self.num_docs)
        w = None
        if self.token_weights is not None:
            w = np.asarray(self.token_weights, dtype=float)
            w = w / w.sum()
        tokens = rng.choice(np.asarray(self.token_choices, dtype=np.int64),
                            size=self.num_docs, p=w)
        return pages, tokens

    def generate(self) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        pages, tokens = self.documents(rng)
        ranks = np.arange(1, self.num_docs + 1, dtype=float)
        cdf = np.cumsum(ranks ** -self.alpha)
        cdf /= cdf[-1]
        rank_to_doc = rng.permutation(self.num_docs)
        hot = self.hot_ranks or max(1, self.num_docs // 10)
        k = self.docs_per_query
        times = np.cumsum(rng.exponential(1.0 / self.arrival_rate, size=self.num_queries))
        durations = None
        if self.mean_duration:
            # lognormal(mu, 1) has mean exp(mu + 1/2)
            durations = rng.lognormal(np.log(self.mean_duration) - 0.5, 1.0,
                                      size=self.num_queries)
        page_ids = [[f"doc{d}/p{j}" for j in range(int(pages[d]))]
                    for d in range(self.num_docs)]

        # Draw ranks in batches (with replacement); reject duplicates within a query.
        pool = np.searchsorted(cdf, rng.random(4 * k * self.num_queries + 64))
        pi = 0
        out: list[Request] = []
        pmf = np.diff(cdf, prepend=0.0)
        # True popularity: expected draw probability of each document, averaged over the
        # trace (accumulated per drift epoch).
        mass = np.zeros(self.num_docs)
        epoch_start = 0
        for q in range(self.num_queries):
            if self.drift_interval and q and q % self.drift_interval == 0:
                mass[rank_to_doc] += pmf * (q - epoch_start)
                epoch_start = q
                a = rng.integers(0, hot, size=self.drift_swaps)
                b = rng.integers(0, self.num_docs, size=self.drift_swaps)
                for x, y in zip(a, b):
                    rank_to_doc[x], rank_to_doc[y] = rank_to_doc[y], rank_to_doc[x]
            chosen: list[int] = []
            while len(chosen) < k:
                if pi >= len(pool):
                    pool = np.searchsorted(cdf, rng.random(4 * k * 1024))
                    pi = 0
                r = int(pool[pi])
                pi += 1
                d = int(rank_to_doc[r])
                if d not in chosen:
                    chosen.append(d)
            items = [Item(pid, int(tokens[d])) for d in chosen for pid in page_ids[d]]
            out.append(Request(float(times[q]), f"q{q}", items,
                               None if durations is None else float(durations[q])))
        mass[rank_to_doc] += pmf * (self.num_queries - epoch_start)
        mass /= max(1, self.num_queries)
        #: tokens of the whole catalogue (every page of every document), seen or not
        self.catalog_tokens = int((pages * tokens).sum())
        #: item identifier -> true (time-averaged) per-query draw probability of its
        #: document; what the static oracle ranks by.
        self.popularity = {pid: float(mass[d]) for d in range(self.num_docs)
                           for pid in page_ids[d]}
        return out


def write_trace(requests: Iterable[Request], path: str | Path) -> None:
    """Write a JSONL trace (one request per line)."""
    with open(path, "w") as f:
        for r in requests:
            obj = {"t": r.t, "request_id": r.request_id,
                   "items": [{"identifier": i.identifier, "num_tokens": i.num_tokens}
                             for i in r.items]}
            if r.duration is not None:
                obj["duration"] = r.duration
            f.write(json.dumps(obj) + "\n")


def read_trace(path: str | Path) -> list[Request]:
    """Read a JSONL trace of ``{t, request_id, items: [{identifier, num_tokens}]}``.

    Requests are replayed in file order (stable-sorted by ``t`` when times are given).
    Missing ``t`` defaults to the line number; missing ``request_id`` to ``line<n>``.
    """
    out: list[Request] = []
    with open(path) as f:
        for n, line in enumerate(f):
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            items = [Item(str(i["identifier"]), int(i["num_tokens"]))
                     for i in obj.get("items", [])]
            if any(i.num_tokens <= 0 for i in items):
                raise ValueError(f"line {n + 1}: num_tokens must be positive")
            dur = obj.get("duration")
            out.append(Request(float(obj.get("t", n)), str(obj.get("request_id", f"line{n}")),
                               items, None if dur is None else float(dur)))
    out.sort(key=lambda r: r.t)
    return out


def trace_summary(requests: Sequence[Request]) -> dict:
    """Sizes of a trace: requests, item references, unique items, tokens."""
    sizes: dict[str, int] = {}
    refs = tokens = 0
    for r in requests:
        for i in r.items:
            sizes[i.identifier] = i.num_tokens
            refs += 1
            tokens += i.num_tokens
    return {
        "requests": len(requests), "item_refs": refs, "token_refs": tokens,
        "unique_items": len(sizes), "unique_tokens": int(sum(sizes.values())),
        "max_request_tokens": max((sum(i.num_tokens for i in {x.identifier: x for x in r.items}
                                       .values()) for r in requests), default=0),
    }
