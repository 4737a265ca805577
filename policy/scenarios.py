"""The named workloads the L1 policy benchmark (``scripts/bench/policy``) and the policy
tests replay: each scenario's workload parameters (without ``alpha`` and ``seed``), its
replay settings and whether its popularity is stationary; the smaller ``--quick`` scale;
the policies the benchmark compares, in its order; and how a capacity fraction becomes
tokens (:func:`capacity`). Data only: no vLLM, nothing of encache beyond this package.
"""

from __future__ import annotations

from typing import Any

#: the policies the benchmark compares, in its tables' order
POLICY_ORDER = ["vllm", "lru", "s3fifo", "wtinylfu", "dlfu", "static", "belady"]

RAG_DOCS = dict(num_docs=3000, num_queries=12000, docs_per_query=3, max_pages=4,
                token_choices=(256, 576, 1024, 2304), token_weights=(0.25, 0.4, 0.2, 0.15),
                arrival_rate=20.0, mean_duration=0.4)

#: name -> (workload parameters without alpha/seed, replay parameters, stationary?)
SCENARIOS: dict[str, dict[str, Any]] = {
    "zipf": {
        "title": "unit size, stationary (issue setup)",
        "workload": dict(num_docs=20000, num_queries=30000, docs_per_query=4, max_pages=1,
                         token_choices=(1,)),
        "replay": dict(concurrency=8),
        "stationary": True,
    },
    "rag": {
        "title": "RAG pages, variable tokens, stationary",
        "workload": dict(RAG_DOCS),
        "replay": dict(hold_seconds="trace"),
        "stationary": True,
    },
    "rag-drift": {
        "title": "RAG pages, variable tokens, popularity drift",
        "workload": dict(RAG_DOCS, drift_interval=250, drift_swaps=25, hot_ranks=300),
        "replay": dict(hold_seconds="trace"),
        "stationary": False,
    },
}

QUICK_SCALE = dict(zipf=dict(num_docs=2000, num_queries=3000),
                   rag=dict(num_docs=400, num_queries=1500),
                   **{"rag-drift": dict(num_docs=400, num_queries=1500, hot_ranks=40,
                                        drift_interval=100, drift_swaps=10)})


def capacity(frac: float, base: int, summary: dict) -> int:
    """``frac`` of ``base`` tokens, but at least twice the largest request (so that
    concurrent requests can make progress)."""
    return max(int(round(frac * base)), 2 * summary["max_request_tokens"])
