"""Tiny random-weight Qwen3-VL (ViT with DeepStack + Qwen3 LM with interleaved M-RoPE).

Built offline with transformers' real ``Qwen3VLForConditionalGeneration``,
``Qwen3VLProcessor``, ``Qwen2VLImageProcessorPil`` (16 px patches, 2x2 merge: one token
per 32x32 pixels) and ``Qwen3VLVideoProcessor``, Qwen's special tokens and Qwen3-VL's chat
template (its vision and turn layout; the tool-calling branches are left out), so vLLM's
``qwen3_vl`` runs its own processor and placeholder layout: ``<|vision_start|>`` + one
``<|image_pad|>`` per merged patch + ``<|vision_end|>``. DeepStack: the tower's output
for one image is its merged patches concatenated with one deep-layer feature per
``deepstack_visual_indexes`` entry, so a stored entry is ``(1 + len(indexes)) x`` the LM
width wide (128 columns here for a 64-wide LM) -- what vLLM caches and what encache stores.
"""

from __future__ import annotations

import json
import os

from tiny_qwen2_5_vl import train_tokenizer, vision_token_ids

# Qwen3-VL-*-Instruct's chat template without the tool-calling branches.
CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' -%}"
    "{%- if messages[0].content is string -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- else -%}{{- '<|im_start|>system\\n' -}}{%- for content in messages[0].content -%}"
    "{%- if 'text' in content -%}{{- content.text -}}{%- endif -%}{%- endfor -%}"
    "{{- '<|im_end|>\\n' }}{%- endif -%}{%- endif -%}"
    "{%- set image_count = namespace(value=0) -%}{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or message.role == 'assistant' -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}"
    "{%- if message.content is string -%}{{- message.content -}}{%- else -%}"
    "{%- for content in message.content -%}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content -%}{{- content.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

MAX_PIXELS = 32 * 32 * 256
MIN_PIXELS = 64 * 64


def build(out: str, vision_hidden: int = 64, vision_layers: int = 2, seed: int = 0,
          max_len: int = 4096, max_pixels: int = MAX_PIXELS, min_pixels: int = MIN_PIXELS,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen3_vl.configuration_qwen3_vl import (
        Qwen3VLTextConfig,
        Qwen3VLVisionConfig,
    )

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    from tiny_common import mrope_sections, text_width

    tok, ids = train_tokenizer()
    heads, head_dim = text_width(text_hidden)
    text = Qwen3VLTextConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=1,
        head_dim=head_dim, max_position_embeddings=max_len,
        rope_parameters={"rope_type": "default",
                         "mrope_section": mrope_sections((6, 5, 5), head_dim),
                         "mrope_interleaved": True, "rope_theta": 5000000.0},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"])
    vision = Qwen3VLVisionConfig(
        depth=vision_layers, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_heads=2, out_hidden_size=text_hidden, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=256, deepstack_visual_indexes=[0])
    cfg = Qwen3VLConfig(
        text_config=text, vision_config=vision, **vision_token_ids(ids),
        tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = Qwen3VLForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)

    save_processor(out, tok, max_pixels, min_pixels, CHAT_TEMPLATE)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "qwen3_vl", "vision_hidden": vision_hidden,
                   "vision_layers": vision_layers, "seed": seed, "max_len": max_len,
                   "max_pixels": max_pixels, "min_pixels": min_pixels,
                   "text_hidden": text_hidden}, f)
    return out


def save_processor(out: str, tok, max_pixels: int, min_pixels: int, chat_template: str) -> None:
    """Qwen3-VL's processor (16 px patches, 2x2 merge, images and videos within
    ``[min_pixels, max_pixels]``) with ``tok`` and ``chat_template``, saved in ``out``
    (Qwen 3.5 uses the same processor)."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = Qwen2VLImageProcessorPil(
        size=size, patch_size=16, temporal_patch_size=2, merge_size=2,
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = Qwen3VLVideoProcessor(
        size=size, patch_size=16, temporal_patch_size=2, merge_size=2,
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok,
                                 video_processor=video_processor, chat_template=chat_template)
    processor.save_pretrained(out)
