"""L1 encoder-cache policies for vLLM and the trace simulator behind them (issue #6).

One idea per module; none imports vLLM:

* :mod:`.base` -- the pin-aware policy interface (the call protocol a cache core follows);
* the policies: :mod:`.fifo` (vLLM's release-FIFO), :mod:`.lru`, :mod:`.s3fifo`,
  :mod:`.tinylfu` (W-TinyLFU, with :mod:`.sketch`), :mod:`.dlfu` (encache's policy, with
  its :mod:`.shadow` caches), the offline :mod:`.static` oracle and :mod:`.belady` MIN;
* :mod:`.registry` -- policies by name (``make_policy``);
* :mod:`.workload` -- seeded RAG trace generator, JSONL trace read/write;
* :mod:`.simulate` -- replay with reference holding, L2 tiers, upper bound;
* :mod:`.online_bound` -- the best any online policy can expect (stationary).
* :mod:`.scenarios` -- the named workloads the benchmark and its tests replay.

The engine-side manager is ``encache.connectors.vllm.manager.PolicyEncoderCacheManager``;
the benchmark grid (``scripts/bench/policy``) lives in ``scripts/bench/policy_bench.py``,
the driver of vLLM's real manager class in ``tests/policy_vllm.py`` (the tests use it too).
How dlfu decides, and the results: docs/policy.md.
"""
