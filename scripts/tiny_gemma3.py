"""Tiny random-weight Gemma 3 (SigLIP tower + Gemma 3 LM), fully offline.

Built with transformers' real ``Gemma3ForConditionalGeneration``, ``Gemma3Processor`` and
``Gemma3ImageProcessorPil`` (pan-and-scan included), Gemma 3's special tokens
(``<start_of_image>``, ``<image_soft_token>``, ``<end_of_image>``, turn markers) and its
real chat template, so vLLM's ``gemma3_mm`` runs its own processor and placeholder layout:
``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` soft tokens + ``<end_of_image>\\n\\n``
per image (per crop with pan-and-scan). Small: 64 px tiles, patch 8, 16 tokens per tile
(real Gemma 3: 896 px, patch 14, 256 tokens), two-layer towers, 2048-token context
(two images with four pan-and-scan crops each fit easily).
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<unk>", "<pad>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
            "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# single tokens in Gemma's vocabulary; vLLM's gemma3_mm merges "\n\n" next to "\n" into them
NEWLINES = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]

# Gemma 3's chat template (google/gemma-3-*-it), verbatim.
CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)


def build(out: str, image_size: int = 64, patch: int = 8, tokens_per_image: int = 16,
          vision_hidden: int = 32, vision_layers: int = 2, seed: int = 0,
          max_len: int = 2048, text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from tiny_common import hub_layout, text_width, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, style="metaspace", plain_tokens=NEWLINES,
                bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                extra_special_tokens={"boi_token": "<start_of_image>",
                                      "eoi_token": "<end_of_image>",
                                      "image_token": "<image_soft_token>"})
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    heads, head_dim = text_width(text_hidden)
    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=1,
        head_dim=head_dim, query_pre_attn_scalar=head_dim, sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=max_len, bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"],
        pad_token_id=ids["<pad>"])
    vision = SiglipVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
        patch_size=patch, vision_use_head=False)
    cfg = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=tokens_per_image,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"])
    cfg.torch_dtype = torch.float32
    model = Gemma3ForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    hub_layout(out)

    image_processor = Gemma3ImageProcessorPil(
        size={"height": image_size, "width": image_size}, do_pan_and_scan=False,
        pan_and_scan_min_crop_size=256, pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tok,
                                chat_template=CHAT_TEMPLATE, image_seq_length=tokens_per_image)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "gemma3", "image_size": image_size, "patch": patch,
                   "image_tokens": tokens_per_image, "vision_hidden": vision_hidden,
                   "vision_layers": vision_layers, "seed": seed, "max_len": max_len,
                   "text_hidden": text_hidden}, f)
    return out
