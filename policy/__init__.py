"""L1 encoder-cache policies for vLLM and the trace benchmark behind them (issue #6).

Modules (none imports vLLM at import time):

* :mod:`encache.policy.policies` -- eviction policies over one pin-aware interface: vLLM's
  release-FIFO, LRU, S3-FIFO, W-TinyLFU, encache's ``dlfu``, static oracle, Belady MIN;
* :mod:`encache.policy.workload` -- seeded RAG trace generator, JSONL trace read/write;
* :mod:`encache.policy.simulate` -- replay with reference holding, L2 tiers, upper bound;
* :mod:`encache.policy.online_bound` -- the best any online policy can expect (stationary);
* :mod:`encache.policy.vllm_adapter` -- drives a real vLLM manager class from a trace;
* :mod:`encache.policy.bench` -- the grid behind ``scripts/bench/policy``.

The engine-side manager is ``encache.connectors.vllm.manager.PolicyEncoderCacheManager``.
"""
