"""Tiny random-weight Qwen 3.5 VL (Qwen3-VL's ViT without DeepStack + a hybrid LM of gated
delta net linear-attention layers and gated full-attention layers, interleaved M-RoPE).

Built offline with transformers' real ``Qwen3_5ForConditionalGeneration`` (what vLLM's
registry resolves ``Qwen3_5ForConditionalGeneration`` to), ``Qwen3VLProcessor`` (the
processor ``qwen3_5`` maps to), ``Qwen2VLImageProcessorPil`` (16 px patches, 2x2 merge:
one token per 32x32 pixels) and ``Qwen3VLVideoProcessor``, Qwen's special tokens plus
``<think>`` / ``</think>``, and a chat template with Qwen 3.5's vision and turn layout and
its thinking generation prompt (``<think>\\n``; the tool-calling branches are left out).
vLLM's ``qwen3_5`` runs its own processor and placeholder layout: ``<|vision_start|>`` +
one ``<|image_pad|>`` per merged patch + ``<|vision_end|>``. The language model keeps the
real hybrid layout (``layer_types``: linear attention, then full attention; the real
models have three linear layers per full one) and partial rotary (a quarter of each head).
No DeepStack: an entry is (merged patches) x the LM width (64 columns by default).
vLLM's CPU gated delta net kernel runs in bf16 (or fp16) only: serve this model with
``dtype=bfloat16`` (in float32 it fails with "CPU GDN attention requires BF16.").
"""

from __future__ import annotations

import json
import os

from tiny_qwen2_5_vl import SPECIALS, vision_token_ids
from tiny_qwen3_vl import save_processor

# Qwen3.5's chat template without the tool-calling branches (thinking by default:
# the generation prompt opens a <think> block; enable_thinking=false closes it empty).
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{- content -}}{%- else -%}"
    "{%- for item in content -%}"
    "{%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}"
    "{%- set image_count.value = image_count.value + 1 -%}"
    "{%- if add_vision_id -%}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'video' or 'video' in item -%}"
    "{%- set video_count.value = video_count.value + 1 -%}"
    "{%- if add_vision_id -%}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in item -%}{{- item.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set image_count = namespace(value=0) -%}{%- set video_count = namespace(value=0) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role in ('system', 'user') -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + "
    "'<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set content = render_content(message.content) -%}"
    "{%- if '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

MAX_PIXELS = 32 * 32 * 256
MIN_PIXELS = 64 * 64


def train_tokenizer():
    """Qwen's tokenizer (as Qwen2.5-VL's builder trains it) with ``<think>`` and
    ``</think>`` as single, non-special tokens (as in Qwen 3.5's vocabulary)."""
    from tiny_common import train

    tok = train(SPECIALS, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                plain_tokens=["<think>", "</think>"],
                extra_special_tokens={"image_token": "<|image_pad|>",
                                      "video_token": "<|video_pad|>",
                                      "vision_bos_token": "<|vision_start|>",
                                      "vision_eos_token": "<|vision_end|>"})
    return tok, {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}


def rope_sections(rotary_half: int) -> list[int]:
    """(t, h, w) M-RoPE sections over ``rotary_half`` frequencies, split as Qwen 3.5's
    ``[11, 11, 10]`` splits 32."""
    base, rem = divmod(rotary_half, 3)
    return [base + (i < rem) for i in range(3)]


def build(out: str, vision_hidden: int = 64, vision_layers: int = 2, seed: int = 0,
          max_len: int = 4096, max_pixels: int = MAX_PIXELS, min_pixels: int = MIN_PIXELS,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.configuration_qwen3_5 import (
        Qwen3_5TextConfig,
        Qwen3_5VisionConfig,
    )

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    from tiny_common import text_width

    tok, ids = train_tokenizer()
    heads, head_dim = text_width(text_hidden)
    partial = 0.25
    text = Qwen3_5TextConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=128,
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        # gated delta net heads of 64 (vLLM's CPU kernel takes 64 or 128, in bf16/fp16 only)
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4,
        max_position_embeddings=max_len,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": partial,
                         "mrope_section": rope_sections(int(head_dim * partial) // 2),
                         "mrope_interleaved": True},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"])
    vision = Qwen3_5VisionConfig(
        depth=vision_layers, hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_heads=2, out_hidden_size=text_hidden, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, num_position_embeddings=256)
    cfg = Qwen3_5Config(
        text_config=text, vision_config=vision, **vision_token_ids(ids),
        tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = Qwen3_5ForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)

    save_processor(out, tok, max_pixels, min_pixels, CHAT_TEMPLATE)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "qwen3_5", "vision_hidden": vision_hidden,
                   "vision_layers": vision_layers, "seed": seed, "max_len": max_len,
                   "max_pixels": max_pixels, "min_pixels": min_pixels,
                   "text_hidden": text_hidden}, f)
    return out
