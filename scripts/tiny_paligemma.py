"""Tiny random-weight PaliGemma (SigLIP tower + linear projector + Gemma LM), fully offline.

Built with transformers' real ``PaliGemmaForConditionalGeneration``, ``PaliGemmaProcessor``
(which adds ``<image>`` and the 1024 ``<locNNNN>`` + 128 ``<segNNN>`` tokens, as in the
real vocabulary) and ``SiglipImageProcessorPil``. Like the real checkpoints it has no
chat template: vLLM serves chat requests with its fallback ``template_basic`` (the
message's text) and inserts ``<image>`` x ``image_seq_length`` + ``<bos>`` before the
prompt itself. Fixed resolution: every image is resized to one 32 px square (patch 8 ->
16 rows per entry; real: 224/448/896 px, 256-4096 rows).
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]


def build(out: str, image_size: int = 32, patch: int = 8, vision_hidden: int = 32,
          vision_layers: int = 2, seed: int = 0, max_len: int = 2048,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        GemmaConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipVisionConfig,
    )
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from tiny_common import hub_layout, text_width, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tokens = (image_size // patch) ** 2
    tok = train(SPECIALS, style="metaspace", bos_token="<bos>", eos_token="<eos>",
                pad_token="<pad>")
    image_processor = SiglipImageProcessorPil(
        size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3,
        image_std=[0.5] * 3)
    image_processor.image_seq_length = tokens
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tok)
    ids = {t: tok.convert_tokens_to_ids(t) for t in [*SPECIALS, "<image>"]}
    heads, head_dim = text_width(text_hidden)
    text = GemmaConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        max_position_embeddings=max_len, bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"])
    vision = SiglipVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
        patch_size=patch, projection_dim=text_hidden, vision_use_head=False)
    cfg = PaliGemmaConfig(vision_config=vision, text_config=text,
                          image_token_index=ids["<image>"], projection_dim=text_hidden,
                          hidden_size=text_hidden)
    cfg.torch_dtype = torch.float32
    model = PaliGemmaForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    hub_layout(out)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "paligemma", "image_size": image_size, "patch": patch,
                   "image_tokens": tokens, "vision_hidden": vision_hidden,
                   "vision_layers": vision_layers, "seed": seed, "max_len": max_len,
                   "text_hidden": text_hidden}, f)
    return out
