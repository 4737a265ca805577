#!/usr/bin/env python
"""Build a tiny random-weight multimodal model of one family fully offline.

    python scripts/build_tiny_model.py OUT_DIR [--arch llava|gemma3|qwen2_5_vl|qwen2_vl|...]
    python scripts/build_tiny_model.py OUT_DIR [--image-size 32 --patch 8 ...]   # LLaVA

``--arch llava`` (the default) builds a CLIP vision tower + Llama LM, described below;
every other ``--arch X`` (see ``ARCHS``) is built by scripts/tiny_X.py (the family's real
classes, processors, special tokens and chat template; see its docstring). LLaVA:

Everything vLLM and transformers need is written (config, safetensors weights, a BPE
tokenizer trained here on a few sentences, image processor, chat template); nothing is
downloaded. Deterministic: the same arguments give byte-identical weights. The default
(32 px, patch 8 -> 16 image tokens, 2-layer towers) starts in seconds on a CPU; larger
towers (e.g. ``--image-size 224 --patch 16 --vision-hidden 768 --vision-layers 12``, a
SigLIP-base-sized encoder) are for benchmarks.

An entry is (image tokens) x (the language model's hidden size) x (dtype bytes), so
``--text-hidden`` sizes the entries, for every family: ``--image-size 128 --patch 8
--text-hidden 2688`` gives 256 tokens x 2688 fp32 = 2.75 MB per image (Gemma 3 27B's
256 x 5376 fp16); ``--image-size 256`` gives 1024 tokens, 11 MB (four such crops).
``--arch gemma3 --image-size 256 --text-hidden 2688`` gives Gemma 3's real 256 tokens per
tile at that width (pan-and-scan: one entry of 2.75 MB per tile, the global view and each
crop). Other families keep their tiny towers (their token counts follow the image), so
``--text-hidden`` alone scales their entries (Qwen3-VL's are twice as wide: DeepStack).
Where the token count follows the image's size (a token per 28 x 28 pixels), ``--max-pixels``
and ``--min-pixels`` bound it: ``--arch qwen2_5_vl --text-hidden 2688 --max-pixels 802816
--min-pixels 784`` gives entries of 1 to 1024 tokens, 11 KB to 11 MB, on one model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ARCHS = ("llava", "gemma3", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "llava_next",
         "llava_onevision", "idefics3", "mistral3", "internvl", "paligemma", "glm4v",
         "qwen3_5", "gemma4", "llama4", "lfm2_vl")
#: the families whose token count follows the image's size (``--max-pixels``)
PIXEL_ARCHS = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "glm4v", "qwen3_5")
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
CORPUS = [
    "USER: What is shown in this image? ASSISTANT: A picture of a cat.",
    "Describe the image in detail. The quick brown fox jumps over the lazy dog.",
    "red green blue yellow square circle triangle color shape number one two three",
] * 50
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}USER: "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url', 'image_pil') %}<image>\n"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %} "
    "{% else %}ASSISTANT: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build(out: str, image_size: int = 32, patch: int = 8, vision_hidden: int = 32,
          vision_layers: int = 2, seed: int = 0, feature_strategy: str = "default",
          text_hidden: int = 64) -> str:
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from tiny_common import text_width

    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})
    image_token_id = hf_tok.convert_tokens_to_ids("<image>")
    vocab_size = (len(hf_tok) + 63) // 64 * 64

    heads = max(2, vision_hidden // 64)
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden, intermediate_size=vision_hidden * 4 if vision_hidden > 32 else 64,
        num_hidden_layers=vision_layers, num_attention_heads=heads,
        image_size=image_size, patch_size=patch, projection_dim=32)
    text_heads, _ = text_width(text_hidden)
    text = LlamaConfig(
        vocab_size=vocab_size, hidden_size=text_hidden, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=text_heads, num_key_value_heads=text_heads,
        max_position_embeddings=max(1024, (image_size // patch) ** 2 + 512),
        bos_token_id=hf_tok.bos_token_id,
        eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
        tie_word_embeddings=False)
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_token_id,
        vision_feature_select_strategy=feature_strategy, vision_feature_layer=-2,
        projector_hidden_act="gelu")
    cfg.torch_dtype = torch.float32
    model = LlavaForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)

    # transformers 5 saves the tower as "vision_tower.<...>"; vLLM's LLaVA loader expects
    # the hub layout "vision_tower.vision_model.<...>" that real checkpoints use.
    weights_path = os.path.join(out, "model.safetensors")
    state = load_file(weights_path)
    renamed = {}
    for key, value in state.items():
        if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
            key = "vision_tower.vision_model." + key[len("vision_tower."):]
        renamed[key] = value
    save_file(renamed, weights_path, metadata={"format": "pt"})

    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": image_size},
            crop_size={"height": image_size, "width": image_size},
            do_center_crop=True, do_resize=True),
        tokenizer=hf_tok, patch_size=patch, vision_feature_select_strategy=feature_strategy,
        num_additional_image_tokens=1, image_token="<image>", chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)
    with open(os.path.join(out, "encache_tiny_model.json"), "w") as f:
        json.dump({"image_size": image_size, "patch": patch, "vision_hidden": vision_hidden,
                   "text_hidden": text_hidden,
                   "vision_layers": vision_layers, "seed": seed,
                   "feature_strategy": feature_strategy,
                   "image_tokens": (image_size // patch) ** 2 + (feature_strategy == "full")}, f)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--arch", choices=ARCHS, default="llava",
                   help="model family (the tower options below are for llava; --image-size "
                        "and --patch for gemma3 too)")
    p.add_argument("--image-size", type=int, default=None,
                   help="tile size in pixels (llava: 32; gemma3: 64, and a tile's tokens "
                        "are its patches pooled 2 x 2)")
    p.add_argument("--patch", type=int, default=None, help="patch size in pixels (8)")
    p.add_argument("--vision-hidden", type=int, default=None, help="tower width (llava: 32)")
    p.add_argument("--vision-layers", type=int, default=None, help="tower depth (llava: 2)")
    p.add_argument("--text-hidden", type=int, default=64,
                   help="the language model's hidden size: the entry width (every family)")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="largest image after resizing, in pixels (the dynamic-resolution "
                        "families: %s; a token per 28 x 28, so this caps an entry's rows)"
                        % ", ".join(PIXEL_ARCHS))
    p.add_argument("--min-pixels", type=int, default=None,
                   help="smallest image after resizing, in pixels (the same families)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-strategy", choices=("default", "full"), default="default",
                   help="'full' keeps the CLS token (vLLM's CPU tower-LoRA mapping needs it)")
    p.add_argument("--lora", metavar="DIR", help="also write a projector LoRA adapter to DIR")
    p.add_argument("--text-lora", metavar="DIR",
                   help="also write a language-model (q_proj/v_proj) LoRA adapter to DIR")
    a = p.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    sys.path.insert(0, os.path.join(os.path.dirname(here), "tests"))  # the LoRA builders
    from lora_adapters import build_lora, build_text_lora
    from tiny_common import text_width
    try:
        text_width(a.text_hidden)
    except ValueError as e:
        p.error(str(e))
    for flag, value, archs in (("--lora", a.lora, ("llava",)),
                               ("--vision-hidden", a.vision_hidden, ("llava",)),
                               ("--vision-layers", a.vision_layers, ("llava",)),
                               ("--image-size", a.image_size, ("llava", "gemma3")),
                               ("--patch", a.patch, ("llava", "gemma3")),
                               ("--max-pixels", a.max_pixels, PIXEL_ARCHS),
                               ("--min-pixels", a.min_pixels, PIXEL_ARCHS)):
        if value is not None and a.arch not in archs:
            p.error(f"{flag} is for --arch " + " and ".join(
                filter(None, (", ".join(archs[:-1]), archs[-1]))))
    if a.arch != "llava":
        module = __import__(f"tiny_{a.arch}")
        size = {}
        if a.image_size is not None or a.patch is not None:  # gemma3
            image_size, patch = a.image_size or 64, a.patch or 8
            size = dict(image_size=image_size, patch=patch,
                        tokens_per_image=(image_size // patch // 2) ** 2)
        size.update({k: v for k, v in (("max_pixels", a.max_pixels),
                                       ("min_pixels", a.min_pixels)) if v is not None})
        module.build(a.out, seed=a.seed, text_hidden=a.text_hidden, **size)
        if a.text_lora:
            build_text_lora(a.out, a.text_lora)
        print(a.out)
        return 0
    build(a.out, a.image_size or 32, a.patch or 8, a.vision_hidden or 32, a.vision_layers or 2,
          a.seed, a.feature_strategy, a.text_hidden)
    if a.lora:
        build_lora(a.out, a.lora)
    if a.text_lora:
        build_text_lora(a.out, a.text_lora)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
