"""Tiny random-weight Gemma 4 (Gemma 4 vision tower + Gemma 4 LM), fully offline.

Built with transformers' real ``Gemma4ForConditionalGeneration``, ``Gemma4Processor``,
``Gemma4ImageProcessorPil`` (aspect-ratio-preserving resize to a patch budget, patches
pooled 3 x 3), ``Gemma4VideoProcessor`` and ``Gemma4AudioFeatureExtractor`` (the processor
needs them; the model has no audio tower, as Gemma 4 26B/31B), Gemma 4's special tokens
(``<|turn>`` / ``<turn|>``, ``<|image>`` + ``<|image|>`` + ``<image|>``, the audio, video
and thinking markers) and a chat template like the real one (``<bos>``, an optional
system turn, ``\\n\\n<|image|>\\n\\n`` per image, ``<|turn>model\\n``), so vLLM's
``gemma4_mm`` runs its own processor and placeholder layout: ``<|image>`` + N soft tokens
+ ``<image|>`` per image, N following the image's aspect ratio (at most
``max_soft_tokens``). Small: patch 16 as the real model, the smallest supported budget of
70 soft tokens per image (real: 280), two-layer 32-wide tower, 2048-token context. Like
the real checkpoints: a standardized tower output, vision tokens attending bidirectionally,
a final-logit soft cap, no per-layer embeddings (26B/31B).
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>",
            "<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>",
            "<|video|>", "<|channel>", "<channel|>", "<|think|>"]
NEWLINES = ["\n", "\n\n"]

# Gemma 4's chat template (google/gemma-4-*-it), without tool calling: the same turns,
# system block, image / audio / video markers and generation prompt.
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- macro render_content(content) -%}\n"
    "    {%- if content is string -%}\n"
    "        {{- content | trim -}}\n"
    "    {%- elif content is sequence -%}\n"
    "        {%- for item in content -%}\n"
    "            {%- if item['type'] == 'text' -%}\n"
    "                {{- item['text'] | trim -}}\n"
    "            {%- elif item['type'] == 'image' -%}\n"
    "                {{- '\\n\\n<|image|>\\n\\n' -}}\n"
    "            {%- elif item['type'] == 'video' -%}\n"
    "                {{- '\\n\\n<|video|>\\n\\n' -}}\n"
    "            {%- elif item['type'] == 'audio' -%}\n"
    "                {{- '<|audio|>' -}}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- if enable_thinking or (messages and messages[0]['role'] in ['system', 'developer']) -%}\n"
    "    {{- '<|turn>system\\n' -}}\n"
    "    {%- if enable_thinking -%}\n"
    "        {{- '<|think|>\\n' -}}\n"
    "    {%- endif -%}\n"
    "    {%- if messages[0]['role'] in ['system', 'developer'] -%}\n"
    "        {{- render_content(messages[0]['content']) -}}\n"
    "        {%- set loop_messages = messages[1:] -%}\n"
    "    {%- else -%}\n"
    "        {%- set loop_messages = messages -%}\n"
    "    {%- endif -%}\n"
    "    {{- '<turn|>\\n' -}}\n"
    "{%- else -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "    {{- '<|turn>' + role + '\\n' -}}\n"
    "    {{- render_content(message['content']) -}}\n"
    "    {{- '<turn|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{- '<|turn>model\\n' -}}\n"
    "    {%- if not enable_thinking | default(false) -%}\n"
    "        {{- '<|channel>thought\\n<channel|>' -}}\n"
    "    {%- endif -%}\n"
    "{%- endif -%}\n"
)


def build(out: str, patch: int = 16, soft_tokens: int = 70, pooling: int = 3,
          vision_hidden: int = 32, vision_layers: int = 2, seed: int = 0,
          max_len: int = 2048, text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        Gemma4AudioFeatureExtractor,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4Processor,
        Gemma4TextConfig,
        Gemma4VisionConfig,
    )
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.models.gemma4.video_processing_gemma4 import Gemma4VideoProcessor

    from tiny_common import text_width, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, style="metaspace", plain_tokens=NEWLINES,
                bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                extra_special_tokens={"image_token": "<|image|>", "boi_token": "<|image>",
                                      "eoi_token": "<image|>", "audio_token": "<|audio|>",
                                      "boa_token": "<|audio>", "eoa_token": "<audio|>"})
    image_processor = Gemma4ImageProcessorPil(patch_size=patch, max_soft_tokens=soft_tokens,
                                              pooling_kernel_size=pooling)
    video_processor = Gemma4VideoProcessor(patch_size=patch, pooling_kernel_size=pooling)
    processor = Gemma4Processor(
        feature_extractor=Gemma4AudioFeatureExtractor(), image_processor=image_processor,
        tokenizer=tok, video_processor=video_processor, chat_template=CHAT_TEMPLATE,
        image_seq_length=soft_tokens)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    heads, head_dim = text_width(text_hidden)
    text = Gemma4TextConfig(
        vocab_size=len(tok), vocab_size_per_layer_input=len(tok), hidden_size=text_hidden,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=1, head_dim=head_dim, global_head_dim=head_dim,
        hidden_size_per_layer_input=0, sliding_window=512,
        layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0,
        use_bidirectional_attention="vision", max_position_embeddings=max_len,
        bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<turn|>"]],
        pad_token_id=ids["<pad>"])
    vision = Gemma4VisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_layers, num_attention_heads=2, num_key_value_heads=2,
        head_dim=vision_hidden // 2, patch_size=patch, pooling_kernel_size=pooling,
        position_embedding_size=256, standardize=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0})
    vision.default_output_length = soft_tokens  # read by vLLM (the real configs carry it)
    cfg = Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None,
        boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"],
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
        audio_token_id=ids["<|audio|>"])
    cfg.torch_dtype = torch.float32
    model = Gemma4ForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "gemma4", "patch": patch, "image_tokens": soft_tokens,
                   "pooling": pooling, "vision_hidden": vision_hidden,
                   "vision_layers": vision_layers, "seed": seed, "max_len": max_len,
                   "text_hidden": text_hidden}, f)
    return out
