"""Tiny random-weight Qwen2-VL (ViT with 2-D RoPE + Qwen2 LM with M-RoPE), fully offline.

Built with transformers' real ``Qwen2VLForConditionalGeneration``, ``Qwen2VLProcessor``,
``Qwen2VLImageProcessorPil`` and Qwen's special tokens and chat template (Qwen2-VL's
template is the one Qwen2.5-VL kept: shared with scripts/tiny_qwen2_5_vl.py), so vLLM's
``qwen2_vl`` runs its own processor and placeholder layout: ``<|vision_start|>`` + one
``<|image_pad|>`` per merged 28x28 patch + ``<|vision_end|>``. Dynamic resolution: the
entry's row count follows the image's size, at most ``max_pixels / 28**2`` (256 here).
"""

from __future__ import annotations

import json
import os

from tiny_qwen2_5_vl import (CHAT_TEMPLATE, MAX_PIXELS, MIN_PIXELS, text_config,
                             train_tokenizer, vision_token_ids)


def build(out: str, vision_hidden: int = 64, vision_layers: int = 2, seed: int = 0,
          max_len: int = 4096, max_pixels: int = MAX_PIXELS, min_pixels: int = MIN_PIXELS,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.configuration_qwen2_vl import (
        Qwen2VLTextConfig,
        Qwen2VLVisionConfig,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )


    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok, ids = train_tokenizer()
    text = text_config(Qwen2VLTextConfig, tok, text_hidden, max_len)
    vision = Qwen2VLVisionConfig(
        depth=vision_layers, embed_dim=vision_hidden, hidden_size=text_hidden, mlp_ratio=2,
        num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    cfg = Qwen2VLConfig(
        text_config=text, vision_config=vision, **vision_token_ids(ids),
        tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = Qwen2VLForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=14, temporal_patch_size=2, merge_size=2)
    # the processor requires a video processor (torchvision: the encache shim on CPU)
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    video_processor = Qwen2VLVideoProcessor(
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        patch_size=14, temporal_patch_size=2, merge_size=2)
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tok,
                                 video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "qwen2_vl", "vision_hidden": vision_hidden,
                   "vision_layers": vision_layers, "seed": seed, "max_len": max_len,
                   "max_pixels": max_pixels, "min_pixels": min_pixels,
                   "text_hidden": text_hidden}, f)
    return out
