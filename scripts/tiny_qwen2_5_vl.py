"""Tiny random-weight Qwen2.5-VL (windowed ViT + Qwen2 LM with M-RoPE), fully offline.

Built with transformers' real ``Qwen2_5_VLForConditionalGeneration``,
``Qwen2_5_VLProcessor``, ``Qwen2VLImageProcessorPil`` and ``Qwen2VLVideoProcessor``,
Qwen's special tokens (``<|im_start|>``, ``<|vision_start|>``, ``<|image_pad|>``,
``<|video_pad|>``...) and Qwen2.5-VL's real chat template, so vLLM's ``qwen2_5_vl`` runs
its own processor and placeholder layout: ``<|vision_start|>`` + one ``<|image_pad|>`` per
merged 28x28 patch + ``<|vision_end|>``. Dynamic resolution as in the real model: the
token count (and so the stored entry's row count) depends on the image's size. The
processor's default ``max_pixels`` is small (``28*28*256``: at most 256 tokens per image,
real default 1280*28*28) so two ~1000 px images fit the 4096-token context of a CPU test.
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
            "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
            "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
            "<|image_pad|>", "<|video_pad|>"]

# Qwen2.5-VL's chat template (Qwen/Qwen2.5-VL-*-Instruct), verbatim.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MAX_PIXELS = 28 * 28 * 256
MIN_PIXELS = 56 * 56


def train_tokenizer():
    """Qwen's tokenizer (its special tokens, the vision ones named as the processors
    expect) and the special tokens' ids: shared by the Qwen2-VL, 2.5-VL and 3-VL builders."""
    from tiny_common import train

    tok = train(SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                extra_special_tokens={"image_token": "<|image_pad|>",
                                      "video_token": "<|video_pad|>",
                                      "vision_bos_token": "<|vision_start|>",
                                      "vision_eos_token": "<|vision_end|>"})
    return tok, {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}


def text_config(config_class, tok, text_hidden: int, max_len: int):
    """The tiny Qwen2 language model with M-RoPE, as ``config_class`` (Qwen2-VL's and
    Qwen2.5-VL's text configs take the same fields)."""
    from tiny_common import mrope_sections, qwen2_text, text_width

    _, head_dim = text_width(text_hidden)
    return qwen2_text(tok, text_hidden, max_len, config_class, max_window_layers=2,
                      rope_parameters={"rope_type": "default",
                                       "mrope_section": mrope_sections((4, 6, 6), head_dim),
                                       "rope_theta": 1000000.0})


def vision_token_ids(ids: dict) -> dict:
    """The placeholder token ids every Qwen-VL config takes, under the same names."""
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"]}


def build(out: str, vision_hidden: int = 64, vision_layers: int = 2, seed: int = 0,
          max_len: int = 4096, max_pixels: int = MAX_PIXELS, min_pixels: int = MIN_PIXELS,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
    )
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLVisionConfig,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )


    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok, ids = train_tokenizer()
    text = text_config(Qwen2_5_VLTextConfig, tok, text_hidden, max_len)
    vision = Qwen2_5_VLVisionConfig(
        depth=vision_layers, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_heads=2, out_hidden_size=text_hidden, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, window_size=112,
        fullatt_block_indexes=[vision_layers - 1])
    cfg = Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, **vision_token_ids(ids),
        tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=14, temporal_patch_size=2, merge_size=2)
    video_processor = None
    try:  # the video processor needs torchvision (the encache shim provides it on CPU)
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
        video_processor = Qwen2VLVideoProcessor(
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
            patch_size=14, temporal_patch_size=2, merge_size=2)
    except Exception:  # pragma: no cover - images still work
        pass
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok,
                                    video_processor=video_processor,
                                    chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "qwen2_5_vl", "vision_hidden": vision_hidden,
                   "vision_layers": vision_layers, "seed": seed, "max_len": max_len,
                   "max_pixels": max_pixels, "min_pixels": min_pixels,
                   "text_hidden": text_hidden}, f)
    return out
