"""Tiny random-weight InternVL in the HF-native layout (InternViT + pixel shuffle + Qwen2 LM).

Built offline with transformers' real ``InternVLForConditionalGeneration`` (the ``-hf``
checkpoints such as OpenGVLab/InternVL3-1B-hf; vLLM serves them with its ``interns1``
model), ``InternVLProcessor``, ``GotOcr2ImageProcessorPil`` (dynamic crop to tiles +
thumbnail) and ``InternVLVideoProcessor``, InternVL's special tokens (``<img>``,
``</img>``, ``<IMG_CONTEXT>``, ``<video>``) and the -hf chat template's layout (Qwen turns,
``<IMG_CONTEXT>\\n`` per image; the default Chinese system prompt is left out), so vLLM
runs its own processor and placeholder layout: ``<img>`` + ``image_seq_length``
``<IMG_CONTEXT>`` per tile + ``</img>``; the whole tile set is one item (one entry whose
row count follows the image's aspect ratio). Small: 32 px tiles, patch 8, downsample 0.5
-> 4 tokens per tile, at most 6 tiles + thumbnail (real: 448 px, 256 tokens, 12 tiles).
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>",
            "<IMG_CONTEXT>", "<video>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\\n' }}{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)


def build(out: str, image_size: int = 32, patch: int = 8, vision_hidden: int = 32,
          vision_layers: int = 2, max_tiles: int = 6, seed: int = 0,
          max_len: int = 4096, text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        InternVLConfig,
        InternVLForConditionalGeneration,
        InternVLProcessor,
        InternVLVisionConfig,
    )
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        GotOcr2ImageProcessorPil,
    )
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    from tiny_common import qwen2_text, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                extra_special_tokens={"start_image_token": "<img>",
                                      "end_image_token": "</img>",
                                      "context_image_token": "<IMG_CONTEXT>",
                                      "video_token": "<video>"})
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = qwen2_text(tok, text_hidden, max_len, tie_word_embeddings=False)
    vision = InternVLVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_layers, num_attention_heads=2,
        image_size=[image_size, image_size], patch_size=[patch, patch])
    seq_len = (image_size // patch) ** 2 // 4  # downsample_ratio 0.5 (pixel shuffle)
    cfg = InternVLConfig(vision_config=vision, text_config=text,
                         image_token_id=ids["<IMG_CONTEXT>"], image_seq_length=seq_len,
                         downsample_ratio=0.5, vision_feature_layer=-1,
                         tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = InternVLForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)

    size = {"height": image_size, "width": image_size}
    image_processor = GotOcr2ImageProcessorPil(
        size=size, crop_to_patches=True, min_patches=1, max_patches=max_tiles,
        image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])
    video_processor = InternVLVideoProcessor(size=size)
    processor = InternVLProcessor(image_processor=image_processor, tokenizer=tok,
                                  video_processor=video_processor, image_seq_length=seq_len,
                                  chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "internvl", "image_size": image_size, "patch": patch,
                   "image_tokens": seq_len, "max_tiles": max_tiles,
                   "vision_hidden": vision_hidden, "vision_layers": vision_layers,
                   "seed": seed, "max_len": max_len, "text_hidden": text_hidden}, f)
    return out
