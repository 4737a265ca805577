"""Tiny random-weight LLaVA-OneVision (SigLIP tower + Qwen2 LM, anyres multi-crop), offline.

Built with transformers' real ``LlavaOnevisionForConditionalGeneration``,
``LlavaOnevisionProcessor``, ``LlavaOnevisionImageProcessorPil`` and
``LlavaOnevisionVideoProcessor``, Qwen's turn markers plus ``<image>``/``<video>`` and the
llava-onevision-qwen2 chat template (images first, then the text), so vLLM's
``llava_onevision`` runs its own processor and placeholder layout: one ``<image>`` per
feature row of the base view + the anyres crops (unpadded, one newline row per crop row,
``anyres_max_9``). Small: 32 px tiles, patch 8 (16 tokens per tile, real: 384 px, 729),
pinpoints up to 3x3 tiles, so the entry's row count follows the image's aspect ratio.
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]

# llava-hf/llava-onevision-qwen2-*-ov-hf's chat template, verbatim.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + ' '}}"
    "{# Render all images first #}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{# Render all video then #}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{# Render all text next #}{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ '\\n' + content['text'] }}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ '\\n' + content['text'] }}{% endgeneration %}{% endfor %}{% endif %}"
    "{{'<|im_end|>'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build(out: str, image_size: int = 32, patch: int = 8, vision_hidden: int = 32,
          vision_layers: int = 2, seed: int = 0, max_len: int = 4096,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        LlavaOnevisionConfig,
        LlavaOnevisionForConditionalGeneration,
        LlavaOnevisionProcessor,
        SiglipVisionConfig,
    )
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.llava_onevision.video_processing_llava_onevision import (
        LlavaOnevisionVideoProcessor,
    )

    from tiny_common import hub_layout, qwen2_text, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                extra_special_tokens={"image_token": "<image>", "video_token": "<video>"})
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = qwen2_text(tok, text_hidden, max_len, tie_word_embeddings=False)
    vision = SiglipVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
        patch_size=patch, vision_use_head=False)
    tiles = [[image_size * h, image_size * w] for h in (1, 2, 3) for w in (1, 2, 3)]
    cfg = LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_token_index=ids["<image>"],
        video_token_index=ids["<video>"], vision_feature_select_strategy="full",
        vision_feature_layer=-1, image_grid_pinpoints=tiles,
        vision_aspect_ratio="anyres_max_9", tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = LlavaOnevisionForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    hub_layout(out)

    image_processor = LlavaOnevisionImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_grid_pinpoints=tiles,
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = LlavaOnevisionVideoProcessor(
        size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3)
    processor = LlavaOnevisionProcessor(
        image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
        num_image_tokens=(image_size // patch) ** 2, vision_feature_select_strategy="full",
        chat_template=CHAT_TEMPLATE, image_token="<image>", video_token="<video>",
        vision_aspect_ratio="anyres_max_9")
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "llava_onevision", "image_size": image_size, "patch": patch,
                   "vision_hidden": vision_hidden, "vision_layers": vision_layers,
                   "seed": seed, "max_len": max_len, "text_hidden": text_hidden}, f)
    return out
