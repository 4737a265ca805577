"""Tiny random-weight LLaVA-NeXT (LLaVA-1.6: CLIP tower + Llama LM, anyres multi-crop).

Built offline with transformers' real ``LlavaNextForConditionalGeneration``,
``LlavaNextProcessor`` and ``LlavaNextImageProcessorPil``, ``<image>`` and the
llava-v1.6-vicuna chat template (``USER: <image>\\n... ASSISTANT:``), so vLLM's
``llava_next`` runs its own processor and placeholder layout: one ``<image>`` per feature
row of the base view + the best-fitting pinpoint grid of crops (unpadded, one newline row
per crop row). Small: 32 px tiles, patch 8 (16 tokens per tile after dropping CLS; real:
336 px, 576), pinpoints as the real 1x2 / 2x1 / 2x2 / 1x3 / 3x1 grids.
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<unk>", "<s>", "</s>", "<image>"]

# llava-hf/llava-v1.6-vicuna-*-hf's chat template, verbatim.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ message['content'][0]['text'] }}{% else %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build(out: str, image_size: int = 32, patch: int = 8, vision_hidden: int = 32,
          vision_layers: int = 2, seed: int = 0, max_len: int = 4096,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextProcessor,
    )
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    from tiny_common import hub_layout, text_width, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, bos_token="<s>", eos_token="</s>", pad_token="<unk>",
                extra_special_tokens={"image_token": "<image>"})
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    heads, _ = text_width(text_hidden)
    text = LlamaConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_len, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
        pad_token_id=ids["<unk>"], tie_word_embeddings=False)
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
        patch_size=patch, projection_dim=32)
    s = image_size
    pinpoints = [[s, 2 * s], [2 * s, s], [2 * s, 2 * s], [3 * s, s], [s, 3 * s]]
    cfg = LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_index=ids["<image>"],
        vision_feature_select_strategy="default", vision_feature_layer=-2,
        image_grid_pinpoints=pinpoints, tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = LlavaNextForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    hub_layout(out)

    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": s}, crop_size={"height": s, "width": s},
        image_grid_pinpoints=pinpoints)
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=patch,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE, image_token="<image>")
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "llava_next", "image_size": image_size, "patch": patch,
                   "vision_hidden": vision_hidden, "vision_layers": vision_layers,
                   "seed": seed, "max_len": max_len, "text_hidden": text_hidden}, f)
    return out
