"""PolicyEncoderCacheManager inside a real (tiny, CPU) vLLM engine.

One in-process engine is started with ``ec_manager_config`` pointing at encache's
manager.  The test checks that vLLM actually uses it (its counters move and the vision
encoder runs exactly once per counted miss), that its eviction choice saves encoder
runs on a "hot images + one-off scan" stream where vLLM's release-FIFO saves none, and
that generated text is identical to the same engine running vLLM's own
``EncoderCacheManager`` (swapped into the scheduler) with greedy sampling.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

MANAGER = "encache.connectors.vllm.manager.PolicyEncoderCacheManager"
HOT = 4
ROUNDS = 3
SCAN = 16  # one-off images per round: with the other hot ones, more releases than 16 slots


def _image(seed: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8))


def _stream() -> list[int]:
    """Image ids: each round reads the HOT images, then SCAN images never seen again."""
    ids, fresh = [], 1000
    for _ in range(ROUNDS):
        ids.extend(range(HOT))
        ids.extend(range(fresh, fresh + SCAN))
        fresh += SCAN
    return ids


@pytest.fixture(scope="module")
def engine(tiny_model):
    from vllm import LLM

    llm = LLM(model=tiny_model, enforce_eager=True, max_model_len=256, max_num_seqs=4,
              max_num_batched_tokens=256, limit_mm_per_prompt={"image": 1}, dtype="float32",
              distributed_executor_backend="uni", seed=0,
              # KV prefix hits would skip the encoder entirely; keep the encoder cache the
              # only source of reuse.
              enable_prefix_caching=False,
              ec_manager_config={"encoder_cache_manager_cls": MANAGER,
                                 "manager_config": {"policy": "dlfu"}})
    yield llm
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass


def _core(llm):
    return llm.llm_engine.engine_core.engine_core


class _EncoderCount:
    """Counts items the model's vision encoder embeds (patched on the model instance)."""

    def __init__(self, llm):
        model = _core(llm).model_executor.driver_worker.worker.model_runner.model
        self.items = 0
        original = model.embed_multimodal

        def counted(**kwargs):
            out = original(**kwargs)
            if isinstance(out, (list, tuple)):
                self.items += len(out)
            else:
                self.items += out.shape[0] if out.dim() == 3 else 1
            return out

        model.embed_multimodal = counted


def _run(llm, ids, images):
    from vllm import SamplingParams

    prompts = [{"prompt": f"USER: <image>\nWhat is shown in picture {n}? ASSISTANT:",
                "multi_modal_data": {"image": images[i]}} for n, i in enumerate(ids)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def test_policy_manager_is_used_saves_encoder_runs_and_matches_default_output(engine):
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    from encache.connectors.vllm.manager import PolicyEncoderCacheManager

    sched = _core(engine).scheduler
    mgr = sched.encoder_cache_manager
    assert isinstance(mgr, PolicyEncoderCacheManager) and mgr.policy.name == "dlfu"
    assert mgr.cache_size == 256  # 16 images of 16 embeddings

    ids = _stream()
    images = {i: _image(i) for i in set(ids)}
    counter = _EncoderCount(engine)

    texts = _run(engine, ids, images)
    st = dict(mgr.stats)
    distinct = len(set(ids))
    assert st["misses"] + st["hits"] == len(ids)          # one access per request
    assert st["misses"] >= distinct and st["evictions"] > 0
    assert counter.items == st["misses"]                  # vLLM computed what we missed
    assert st["hits"] >= HOT * (ROUNDS - 2)               # hot images survive the scans
    assert not mgr.cached or all(not refs for refs in mgr.cached.values())
    ours = counter.items

    # Same engine, vLLM's own manager: same text, more encoder runs.
    sched.encoder_cache_manager = EncoderCacheManager(cache_size=mgr.cache_size)
    try:
        counter.items = 0
        default_texts = _run(engine, ids, images)
        assert default_texts == texts
        assert any(t.strip() for t in texts)
        assert counter.items == len(ids) > ours   # FIFO-release: every read recomputes
    finally:
        sched.encoder_cache_manager = mgr
