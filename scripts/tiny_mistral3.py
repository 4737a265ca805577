"""Tiny random-weight Mistral3 (Pixtral tower with 2-D RoPE + patch merger + Mistral LM).

Built offline with transformers' real ``Mistral3ForConditionalGeneration``,
``PixtralProcessor`` and ``PixtralImageProcessorPil`` (the HF-format layout of
Mistral-Small-3.1 / Pixtral-HF checkpoints), Mistral's control tokens (``[INST]``,
``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]``) and pixtral-12b's chat template, so vLLM's
``mistral3`` runs its own processor and placeholder layout: per row of merged patches,
``[IMG]`` tokens then ``[IMG_BREAK]`` (the last row ends with ``[IMG_END]``). Only the
``[IMG]`` positions take embeddings (vLLM's ``is_embed`` mask), so an entry has one row
per merged patch, fewer than the placeholder's length. Native resolution: the image keeps
its aspect ratio up to ``longest_edge`` (128 px here: at most 16x16 patches of 8 px merged
2x2 -> 64 rows; real: 1540 px, patch 14).
"""

from __future__ import annotations

import json
import os

SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]

# mistral-community/pixtral-12b's chat template, verbatim.
CHAT_TEMPLATE = (
    "{%- if messages[0][\"role\"] == \"system\" %}\n"
    "    {%- set system_message = messages[0][\"content\"] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message[\"role\"] == \"user\" %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- \"[INST]\" + system_message + \"\\n\\n\" }}\n"
    "        {%- else %}\n"
    "            {{- \"[INST]\" }}\n"
    "        {%- endif %}\n"
    "        {%- if message[\"content\"] is not string %}\n"
    "            {%- for chunk in message[\"content\"] %}\n"
    "                {%- if chunk[\"type\"] == \"text\" %}\n"
    "                    {{- chunk[\"text\"] }}\n"
    "                {%- elif chunk[\"type\"] == \"image\" %}\n"
    "                    {{- \"[IMG]\" }}\n"
    "                {%- else %}\n"
    "                    {{- raise_exception(\"Unrecognized content type!\") }}\n"
    "                {%- endif %}\n"
    "            {%- endfor %}\n"
    "        {%- else %}\n"
    "            {{- message[\"content\"] }}\n"
    "        {%- endif %}\n"
    "        {{- \"[/INST]\" }}\n"
    "    {%- elif message[\"role\"] == \"assistant\" %}\n"
    "        {{- message[\"content\"] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception(\"Only user and assistant roles are supported, with the "
    "exception of an initial optional system message!\") }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)


def build(out: str, image_size: int = 128, patch: int = 8, vision_hidden: int = 64,
          vision_layers: int = 2, seed: int = 0, max_len: int = 4096,
          text_hidden: int = 64) -> str:
    import torch
    from transformers import (
        MistralConfig,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralProcessor,
        PixtralVisionConfig,
    )
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    from tiny_common import text_width, train

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    tok = train(SPECIALS, bos_token="<s>", eos_token="</s>", pad_token="<unk>")
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    heads, head_dim = text_width(text_hidden)
    text = MistralConfig(
        vocab_size=len(tok), hidden_size=text_hidden, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        max_position_embeddings=max_len, sliding_window=None, bos_token_id=ids["<s>"],
        eos_token_id=ids["</s>"], pad_token_id=ids["<unk>"], tie_word_embeddings=False)
    vision = PixtralVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
        patch_size=patch, head_dim=vision_hidden // 2)
    cfg = Mistral3Config(vision_config=vision, text_config=text,
                         image_token_index=ids["[IMG]"], spatial_merge_size=2,
                         vision_feature_layer=-1, tie_word_embeddings=False)
    cfg.torch_dtype = torch.float32
    model = Mistral3ForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)

    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": image_size}, patch_size={"height": patch, "width": patch})
    processor = PixtralProcessor(image_processor=image_processor, tokenizer=tok,
                                 patch_size=patch, spatial_merge_size=2,
                                 chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"arch": "mistral3", "image_size": image_size, "patch": patch,
                   "vision_hidden": vision_hidden, "vision_layers": vision_layers,
                   "seed": seed, "max_len": max_len, "text_hidden": text_hidden}, f)
    return out
