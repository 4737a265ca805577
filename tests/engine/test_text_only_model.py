"""A model without a vision tower: a producer refuses it in one line, a consumer warns once.

vLLM runs a text-only model as an EC consumer (the connector would never be asked for an
item) but not as an ``ec_producer`` ("An EC producer-only instance requires a multimodal
model"); encache says both in one line, naming the architecture.
"""

from __future__ import annotations

import pytest

from encache.connectors.store import open_store
from engine_support import consumer_config, make_llm, shutdown
from served_support import draw_images

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
def text_only_model(tiny_model, tmp_path_factory) -> str:
    """A text-only Llama (the tiny LLaVA's language model config and tokenizer)."""
    import json

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with open(f"{tiny_model}/config.json") as f:
        cfg = json.load(f)["text_config"]
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id")
    model = str(tmp_path_factory.mktemp("text-only"))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: cfg[k] for k in keep})).save_pretrained(model)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(model)
    return model


def test_a_model_without_a_vision_tower_is_a_one_line_engine_error(text_only_model, tmp_path):
    """Precompute for a model vLLM cannot run as an EC producer (here a text-only Llama:
    "An EC producer-only instance requires a multimodal model") fails with one line
    naming the architecture and vLLM's reason -- not pydantic's "1 validation error for
    VllmConfig" header -- and the engine exit code; nothing is written."""
    from cli_support import invoke
    from encache.cli import errors

    model = text_only_model
    draw_images(tmp_path / "corpus", {"wide": (1000, 400)}, seed=3)
    store = tmp_path / "store"
    r = invoke("precompute", str(tmp_path / "corpus"), "-m", model, "-s", str(store),
               "--max-model-len", "256", "--dtype", "float32")
    assert r.exit_code == errors.EXIT_ENGINE, r.output
    [line] = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert "(LlamaForCausalLM): An EC producer-only instance requires a multimodal model" \
        in line, r.output
    assert "validation error" not in r.output
    assert not store.exists() or not list(open_store(str(store)).identifiers())


def test_a_consumer_of_a_model_without_a_vision_tower_warns_once(text_only_model, tmp_path,
                                                                 caplog):
    """A consumer engine of a text-only model starts (vLLM allows it) but would never read
    the store: one warning line naming the model's architecture and the store."""
    import logging

    store = str(tmp_path / "store")
    with caplog.at_level(logging.WARNING, logger="encache"):
        llm = make_llm(text_only_model, consumer_config(store))
    shutdown(llm)
    [line] = [r.getMessage() for r in caplog.records if "no multimodal encoder" in r.getMessage()]
    assert "(LlamaForCausalLM)" in line and store in line and "\n" not in line
