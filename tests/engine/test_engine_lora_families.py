"""LoRA on the families users serve, end to end in-process.

A language-model adapter (``q_proj`` / ``v_proj``: what most Gemma 3 and Qwen2.5-VL
adapters are) served with ``--enable-lora`` alone: vLLM keys a LoRA request's images by
their bare hash and the tower runs the base weights, so the base entries (``precompute``
without ``--lora``) serve every adapter. Proven by a consumer answering LoRA requests
with the vision tower idle and the adapter's own greedy text.

A model whose LoRA cannot reach its encoder (``supports_tower_connector_lora`` False in
vLLM: Mistral 3, LLaVA-OneVision): ``precompute --lora`` still stores ``{lora}:`` entries
(what a server started with ``--enable-tower-connector-lora`` looks up, since vLLM
prefixes the hash whenever that flag is on) and says which server they serve.
"""

from __future__ import annotations

import pytest

from encache.connectors.store import open_store
from encache.connectors.vllm.hashing import identify_file
from engine_support import PRECOMPUTE_KW, TowerTap, consumer_config, make_llm, shutdown

pytestmark = pytest.mark.engine

ENGINE = dict(max_model_len=2048, limit_mm_per_prompt={"image": 1}, max_num_batched_tokens=2048,
              enable_lora=True, max_lora_rank=8)
PRECOMPUTE = dict(PRECOMPUTE_KW, max_model_len=2048,
                  engine_args=dict(PRECOMPUTE_KW["engine_args"], max_num_batched_tokens=2048,
                                   max_lora_rank=8))


def texts(llm, paths, lora=None):
    from vllm import SamplingParams

    from engine_support import conversation
    outs = llm.chat([conversation(p) for p in paths], SamplingParams(max_tokens=6, temperature=0),
                    use_tqdm=False, lora_request=lora)
    return [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_5_vl"])
def test_a_language_model_lora_is_served_from_the_base_entries(arch, tiny_family, tmp_path):
    from vllm.lora.request import LoRARequest

    from lora_adapters import build_text_lora
    from demo_corpus import make_corpus

    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    model = tiny_family(arch)
    adapter = build_text_lora(model, str(tmp_path / "adapter"))
    paths = make_corpus(str(tmp_path / "corpus"), pages=2, seed=5)
    lora = LoRARequest("adB", 1, adapter)

    ref = make_llm(model, **ENGINE)
    try:
        reference = {"lora": texts(ref, paths, lora), "base": texts(ref, paths)}
    finally:
        shutdown(ref)
    assert reference["lora"] != reference["base"], "the adapter must change the text"

    store = str(tmp_path / "store")
    summary = precompute_corpus(str(tmp_path / "corpus"),
                                PrecomputeOptions(model=model, store=store, **PRECOMPUTE))
    assert summary.encoded == 2 and summary.failed == 0
    expected = {identify_file(p, model).identifier for p in paths}
    assert set(open_store(store).identifiers()) == expected

    tap = TowerTap(model)
    llm = make_llm(model, consumer_config(store), **ENGINE)
    try:
        tap.on = True
        assert texts(llm, paths, lora) == reference["lora"]
        assert tap.take() == [], "a LoRA request's images must come from the base entries"
        assert texts(llm, paths) == reference["base"]
        assert tap.take() == []
    finally:
        tap.close()
        shutdown(llm)


def test_lora_that_cannot_reach_the_encoder_is_stored_and_explained(tiny_family, tmp_path):
    from lora_adapters import build_text_lora
    from demo_corpus import make_corpus

    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    model = tiny_family("mistral3")
    adapter = build_text_lora(model, str(tmp_path / "adapter"))
    paths = make_corpus(str(tmp_path / "corpus"), pages=2, seed=5)
    store = str(tmp_path / "store")
    options = PrecomputeOptions(model=model, store=store, lora="adB", lora_path=adapter,
                                **PRECOMPUTE)
    summary = precompute_corpus(str(tmp_path / "corpus"), options)
    assert summary.encoded == 2 and summary.failed == 0
    assert set(open_store(store).identifiers()) == \
        {identify_file(p, model, lora="adB").identifier for p in paths}
    [note] = summary.notes
    assert note.startswith("Mistral3ForConditionalGeneration does not apply LoRA to its vision")
    assert "--enable-tower-connector-lora" in note and "--enable-lora alone" in note
