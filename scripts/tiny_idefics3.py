"""Tiny random-weight Idefics3 (SigLIP-style tower + pixel-shuffle connector + Llama LM).

Built offline with transformers' real ``Idefics3ForConditionalGeneration``,
``Idefics3Processor`` and ``Idefics3ImageProcessorPil`` (image splitting on), Idefics3's
special tokens (``<fake_token_around_image>``, ``<image>``, ``<global-img>``,
``<row_i_col_j>``, ``<end_of_utterance>``) and Idefics3-8B-Llama3's chat template, so
vLLM's ``idefics3`` runs its own processor and placeholder layout: the image is resized
(longest edge ``4 x`` the tile), split into a grid of tiles plus a global view, each
``<fake_token_around_image><row_i_col_j>`` + ``image_seq_len`` ``<image>`` tokens. The
whole grid is one multimodal item: one entry, ``(tiles + 1) x image_seq_len`` rows, whose
count follows the image's aspect ratio. SmolVLM uses the same classes and layout. Small:
32 px tiles, patch 8, scale factor 2 -> 4 tokens per tile (real: 364 px, 169 tokens).
"""

from __future__ import annotations

import json
import os

GRID = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
SPECIALS = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<fake_token_around_image>",
            "<image>", "<end_of_utterance>", "<global-img>", *GRID]

# HuggingFaceM4/Idefics3-8B-Llama3's chat template, verbatim.
CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def build(out: str, image_size: int = 32, patch: int = 8, scale_factor: int = 2,
          vision_hidden: int = 32, vision_layers: int = 2, seed: int = 0,
          max_len: int = 4096, text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        Idefics3VisionConfig,
        LlamaConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    from tiny_common import text_width, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, bos_token="<|begin_of_text|>", eos_token="<end_of_utterance>",
                pad_token="<unk>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    heads, _ = text_width(text_hidden)
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_len, bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=ids["<end_of_utterance>"], pad_token_id=ids["<unk>"],
        tie_word_embeddings=False)
    vision = Idefics3VisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
        patch_size=patch)
    cfg = Idefics3Config(vision_config=vision, text_config=text, image_token_id=ids["<image>"],
                         scale_factor=scale_factor, pad_token_id=ids["<unk>"],
                         tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = Idefics3ForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)

    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 4 * image_size}, max_image_size={"longest_edge": image_size},
        do_image_splitting=True, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    seq_len = (image_size // patch) ** 2 // scale_factor ** 2
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok,
                                  image_seq_len=seq_len, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "idefics3", "image_size": image_size, "patch": patch,
                   "image_tokens": seq_len, "vision_hidden": vision_hidden,
                   "vision_layers": vision_layers, "seed": seed, "max_len": max_len,
                   "text_hidden": text_hidden}, f)
    return out
