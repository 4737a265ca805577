"""Tiny random-weight LFM2-VL (SigLIP2 NaFlex tower + pixel-unshuffle projector + LFM2,
a hybrid language model of gated short-convolution and grouped-query attention layers).

Built offline with transformers' real ``Lfm2VlForConditionalGeneration`` (what vLLM's
registry resolves ``Lfm2VlForConditionalGeneration`` to), ``Lfm2VlProcessor`` and
``Lfm2VlImageProcessor`` (smart resize to a token budget; an image too large for one
tile is split into a grid of tiles, 2 to 10, plus a thumbnail), LFM2-VL's special tokens
(``<|startoftext|>``, ``<|im_start|>`` / ``<|im_end|>``, ``<image>``,
``<|image_start|>`` / ``<|image_end|>``, ``<|img_row_R_col_C|>``, ``<|img_thumbnail|>``)
and LFM2-VL's chat template, so vLLM's ``lfm2_vl`` runs its own processor and placeholder
layout: ``<|image_start|>`` + per tile ``<|img_row_R_col_C|>`` + its tokens, then
``<|img_thumbnail|>`` + the thumbnail's tokens, + ``<|image_end|>`` (a small image: one
resized view, no markers inside). The whole image is one multimodal item: one entry, the
tiles' and the thumbnail's rows in order, their count following the image's size and
aspect ratio. Small: patch 8, 64 px tiles -> 16 tokens per tile (2 x 2 unshuffle; real:
patch 16, 512 px, 256 tokens), 4 to 16 tokens for a single view or thumbnail (real: 64 to
256). An image is split above 128 K pixels (``max_pixels_tolerance`` 32: at the tiny token
budget the real 2.0 would split every image; real: above 512 K pixels), so a corpus of
everyday sizes has both layouts: small images one view, large ones tiles + thumbnail. Like the real checkpoints: no pooling head on the tower (``vision_use_head``
false), tied embeddings, the hub weight layout (``model.vision_tower.vision_model.``) and
LFM2's config names vLLM reads (``block_dim``, ``conv_dim``).
"""

from __future__ import annotations

import json
import os

GRID = [f"<|img_row_{i + 1}_col_{j + 1}|>" for i in range(10) for j in range(10)]
SPECIALS = ["<|pad|>", "<|startoftext|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
            "<image>", *GRID, "<|img_thumbnail|>", "<|image_start|>", "<|image_end|>"]

# LiquidAI/LFM2-VL's chat template (without tool calling): <|startoftext|>, an optional
# system turn, ChatML turns, "<image>" per image, "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build(out: str, tile_size: int = 64, patch: int = 8, downsample: int = 2,
          min_image_tokens: int = 4, max_image_tokens: int = 16, tolerance: float = 32.0,
          vision_hidden: int = 32,
          vision_layers: int = 2, seed: int = 0, max_len: int = 4096,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        Lfm2Config,
        Lfm2VlConfig,
        Lfm2VlForConditionalGeneration,
        Lfm2VlProcessor,
        Siglip2VisionConfig,
    )
    from transformers.models.lfm2_vl.image_processing_lfm2_vl import Lfm2VlImageProcessor

    from tiny_common import hub_layout, text_width, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, vocab_size=500, bos_token="<|startoftext|>", eos_token="<|im_end|>",
                pad_token="<|pad|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    heads, _ = text_width(text_hidden)
    text = Lfm2Config(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=192,
        block_multiple_of=32, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), layer_types=["conv", "full_attention"],
        max_position_embeddings=max_len, bos_token_id=ids["<|startoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|pad|>"],
        tie_word_embeddings=True)
    text.block_dim = text.conv_dim = text.conv_dim_out = text_hidden  # as the hub configs
    vision = Siglip2VisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_layers, num_attention_heads=2, patch_size=patch,
        num_patches=(tile_size // patch) ** 2)
    vision.vision_use_head = False
    cfg = Lfm2VlConfig(vision_config=vision, text_config=text, image_token_id=ids["<image>"],
                       downsample_factor=downsample, projector_hidden_size=64,
                       tie_word_embeddings=True)
    cfg.torch_dtype = torch.float32
    model = Lfm2VlForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 saves the tower as "model.vision_tower.<...>"; the hub checkpoints
    # (and vLLM's loader) have "model.vision_tower.vision_model.<...>"
    hub_layout(out, tower="model.vision_tower.")

    image_processor = Lfm2VlImageProcessor(
        tile_size=tile_size, encoder_patch_size=patch, downsample_factor=downsample,
        min_image_tokens=min_image_tokens, max_image_tokens=max_image_tokens,
        max_pixels_tolerance=tolerance, min_tiles=2, max_tiles=10, use_thumbnail=True,
        do_image_splitting=True,
        size={"height": tile_size, "width": tile_size},
        image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Lfm2VlProcessor(image_processor=image_processor, tokenizer=tok,
                                chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "lfm2_vl", "tile_size": tile_size, "patch": patch,
                   "downsample": downsample,
                   "image_tokens": (tile_size // patch // downsample) ** 2,
                   "min_image_tokens": min_image_tokens, "max_image_tokens": max_image_tokens,
                   "max_pixels_tolerance": tolerance,
                   "vision_hidden": vision_hidden, "vision_layers": vision_layers,
                   "seed": seed, "max_len": max_len, "text_hidden": text_hidden}, f)
    return out
