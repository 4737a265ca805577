"""Tiny random-weight Llama 4 (Llama 4 vision tower + pixel-shuffle adapter + Llama 4 MoE LM).

Built offline with transformers' real ``Llama4ForConditionalGeneration``,
``Llama4Processor`` and ``Llama4ImageProcessor`` (tiling: the image is resized without
distortion to the best canvas of at most ``max_patches`` square tiles, padded, split into
tiles, plus a global tile when there is more than one), Llama 4's special tokens
(``<|header_start|>`` / ``<|header_end|>`` / ``<|eot|>``, ``<|image_start|>``,
``<|image|>``, ``<|patch|>``, ``<|tile_x_separator|>``, ``<|tile_y_separator|>``,
``<|image_end|>``) and the real checkpoints' chat template (the processor's default, the
one Llama-4-Scout/Maverick-Instruct ship), so vLLM's ``mllama4`` runs its own processor and
placeholder layout: per tile ``<|patch|>`` x N with separators, then ``<|image|>`` and the
global tile's N ``<|patch|>``; only the ``<|patch|>`` positions take embeddings (vLLM's
``is_embed`` mask), so an entry has (tiles [+ 1 global]) x N rows. Small: 64 px tiles of
8 px patches pixel-shuffled 2 x 2 -> N = 16 tokens per tile (real: 336 px, patch 14,
144 per tile), at most 16 tiles as the real processor; a two-layer 32-wide tower; a
two-layer LM as Maverick interleaves it (layer 0 dense, layer 1 MoE: 4 experts, top-1, a
shared expert) with a chunked-attention RoPE layer and a NoPE global layer (real: every 4th
layer is NoPE); a 2048-token context.
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<|finetune_right_pad|>", "<|begin_of_text|>", "<|end_of_text|>",
            "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>",
            "<|python_start|>", "<|python_end|>", "<|image_start|>", "<|image_end|>",
            "<|image|>", "<|patch|>", "<|tile_x_separator|>", "<|tile_y_separator|>"]


def build(out: str, image_size: int = 64, patch: int = 8, max_tiles: int = 16,
          vision_hidden: int = 32, vision_layers: int = 2, experts: int = 4, seed: int = 0,
          max_len: int = 2048, text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        Llama4Config,
        Llama4ForConditionalGeneration,
        Llama4Processor,
        Llama4TextConfig,
        Llama4VisionConfig,
    )
    from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor
    from transformers.models.llama4.processing_llama4 import chat_template

    from tiny_common import text_width, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, bos_token="<|begin_of_text|>", eos_token="<|eot|>",
                pad_token="<|finetune_right_pad|>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    heads, head_dim = text_width(text_hidden)
    text = Llama4TextConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=64,
        intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=1, head_dim=head_dim, num_local_experts=experts,
        num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layer_interval=2,
        attention_chunk_size=8192, use_qk_norm=True, max_position_embeddings=max_len,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=[ids["<|end_of_text|>"], ids["<|eom|>"], ids["<|eot|>"]],
        pad_token_id=ids["<|finetune_right_pad|>"], tie_word_embeddings=False)
    # the adapter's fc1 takes the pixel-shuffled patches (4 x hidden = intermediate_size)
    vision = Llama4VisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 4,
        num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
        patch_size=patch, pixel_shuffle_ratio=0.5, projector_input_dim=64,
        projector_output_dim=64, vision_output_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg = Llama4Config(vision_config=vision, text_config=text,
                       boi_token_index=ids["<|image_start|>"],
                       eoi_token_index=ids["<|image_end|>"],
                       image_token_index=ids["<|image|>"], tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = Llama4ForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)

    image_processor = Llama4ImageProcessor(
        size={"height": image_size, "width": image_size}, max_patches=max_tiles,
        resize_to_max_canvas=False)
    processor = Llama4Processor(image_processor=image_processor, tokenizer=tok,
                                patch_size=patch, pixel_shuffle_ratio=0.5,
                                chat_template=chat_template)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "llama4", "image_size": image_size, "patch": patch,
                   "max_tiles": max_tiles, "image_tokens": (image_size // patch) ** 2 // 4,
                   "vision_hidden": vision_hidden, "vision_layers": vision_layers,
                   "experts": experts, "seed": seed, "max_len": max_len,
                   "text_hidden": text_hidden}, f)
    return out
