"""Tiny random-weight GLM-4.1V (Glm4v: ViT with 2-D RoPE + GLM-4 LM with M-RoPE), offline.

Built with transformers' real ``Glm4vForConditionalGeneration``, ``Glm4vProcessor``,
``Glm4vImageProcessorPil`` and ``Glm4vVideoProcessor``, GLM's special tokens
(``[gMASK]``, ``<sop>``, role tokens, ``<|begin_of_image|>``, ``<|image|>``...) and
GLM-4.1V-Thinking's chat template (its vision and turn layout; the thinking/assistant
history branches are left out), so vLLM's ``glm4_1v`` runs its own processor and
placeholder layout: ``<|begin_of_image|>`` + one ``<|image|>`` per merged 28x28 patch +
``<|end_of_image|>``. Dynamic resolution as in Qwen2-VL: the entry's row count follows
the image's size, at most ``max_pixels / 28**2`` (256 here).
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
            "<|user|>", "<|assistant|>", "<|observation|>", "<|begin_of_image|>",
            "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|image|>",
            "<|video|>"]

# GLM-4.1V-9B-Thinking's chat template, system/user turns and generation prompt.
CHAT_TEMPLATE = (
    "[gMASK]<sop>{%- for msg in messages %}{%- if msg.role == 'system' %}<|system|>\n"
    "{{ msg.content }}{%- elif msg.role == 'user' %}<|user|>{{ '\\n' }}"
    "{%- if msg.content is string %}{{ msg.content }}{%- else %}"
    "{%- for item in msg.content %}"
    "{%- if item.type == 'video' or 'video' in item %}"
    "<|begin_of_video|><|video|><|end_of_video|>"
    "{%- elif item.type == 'image' or 'image' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- elif msg.role == 'assistant' %}<|assistant|>\n{{ msg.content }}{%- endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

MAX_PIXELS = 28 * 28 * 256
MIN_PIXELS = 56 * 56


def build(out: str, vision_hidden: int = 64, vision_layers: int = 2, seed: int = 0,
          max_len: int = 4096, max_pixels: int = MAX_PIXELS, min_pixels: int = MIN_PIXELS,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration, Glm4vProcessor
    from transformers.models.glm4v.configuration_glm4v import Glm4vTextConfig, Glm4vVisionConfig
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    from tiny_common import mrope_sections, text_width, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"})
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    heads, head_dim = text_width(text_hidden)
    text = Glm4vTextConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=1,
        max_position_embeddings=max_len,
        rope_parameters={"rope_type": "default",
                         "mrope_section": mrope_sections((2, 3, 3), head_dim),
                         "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
        pad_token_id=ids["<|endoftext|>"])
    vision = Glm4vVisionConfig(
        depth=vision_layers, hidden_size=vision_hidden, intermediate_size=128, num_heads=2,
        image_size=112, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
        out_hidden_size=text_hidden)
    cfg = Glm4vConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"], tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = Glm4vForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids["<|endoftext|>"], ids["<|user|>"],
                                    ids["<|observation|>"]],
                   "pad_token_id": ids["<|endoftext|>"]}, f)

    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    image_processor = Glm4vImageProcessorPil(size=size, patch_size=14, temporal_patch_size=2,
                                             merge_size=2)
    video_processor = Glm4vVideoProcessor(size=size, patch_size=14, temporal_patch_size=2,
                                          merge_size=2)
    processor = Glm4vProcessor(image_processor=image_processor, tokenizer=tok,
                               video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "glm4v", "vision_hidden": vision_hidden,
                   "vision_layers": vision_layers, "seed": seed, "max_len": max_len,
                   "max_pixels": max_pixels, "min_pixels": min_pixels,
                   "text_hidden": text_hidden}, f)
    return out
