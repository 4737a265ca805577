"""Models for the serving benchmarks, built offline and cached under ``.models/``.

    tiny              scripts/build_tiny_model.py defaults: 32 px, patch 8, 2-layer 32-wide
                      CLIP tower, 64-wide LM -> 16 x 64 F32 entries (4 KiB)
    siglip-base       the SigLIP-base-sized tower (224 px, patch 16, 768 wide, 12 layers)
                      exactly as ``build_tiny_model.py`` builds it -> 196 x 64 F32 (49 KiB)
    siglip-base-wide  the same tower in front of a 2048-wide LM (PaliGemma-3B's width;
                      2 layers, 16 heads of 128) -> 196 x 2048 F32 entries (1.53 MiB),
                      so the engine benchmark sees entries of a realistic size

The wide variant is built by ``build_tiny_model.py`` at 64 wide (tokenizer, processor,
chat template) and its LM then re-initialised here with a wider text config (same
weight-name fix-up as the script): an MLP 512 wide, where the script's ``--text-hidden``
keeps it at 128, so the recorded serving benchmarks keep measuring the same model.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = ROOT / ".models"

SPECS = {
    "tiny": dict(image_size=32, patch=8, vision_hidden=32, vision_layers=2, text_hidden=64),
    "siglip-base": dict(image_size=224, patch=16, vision_hidden=768, vision_layers=12,
                        text_hidden=64),
    "siglip-base-wide": dict(image_size=224, patch=16, vision_hidden=768, vision_layers=12,
                             text_hidden=2048),
}
DIRS = {"tiny": "tiny-llava", "siglip-base": "bench-siglip-base",
        "siglip-base-wide": "bench-siglip-base-w2048"}


def model_path(kind: str) -> Path:
    return MODELS_DIR / DIRS[kind]


def ensure_model(kind: str) -> str:
    """Path of the model, building it (once, ~seconds to a minute) if missing."""
    spec = SPECS[kind]
    out = model_path(kind)
    marker = out / "encache_bench_model.json"
    want = dict(spec, version=1)
    if kind == "tiny" and (out / "config.json").exists():
        return str(out)
    if marker.exists() and json.loads(marker.read_text()) == want:
        return str(out)
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_tiny_model import build
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    build(str(tmp), spec["image_size"], spec["patch"], spec["vision_hidden"],
          spec["vision_layers"])
    if spec["text_hidden"] != 64:
        _widen_lm(tmp, spec["text_hidden"])
    (tmp / "encache_bench_model.json").write_text(json.dumps(want))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return str(out)


def _widen_lm(out: Path, hidden: int, seed: int = 0) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    cfg = LlavaConfig.from_pretrained(str(out))
    tc = cfg.text_config
    tc.hidden_size = hidden
    tc.intermediate_size = 512
    tc.num_attention_heads = hidden // 128  # head_dim 128: supported by CPU attention
    tc.num_key_value_heads = hidden // 128
    tc.head_dim = 128
    cfg.torch_dtype = torch.float32
    model = LlavaForConditionalGeneration(cfg).to(torch.float32).eval()
    model.save_pretrained(str(out), safe_serialization=True)
    weights = out / "model.safetensors"
    state = load_file(str(weights))
    renamed = {}
    for key, value in state.items():
        if key.startswith("vision_tower.") and not key.startswith("vision_tower.vision_model."):
            key = "vision_tower.vision_model." + key[len("vision_tower."):]
        renamed[key] = value
    save_file(renamed, str(weights), metadata={"format": "pt"})


def model_info(path: str) -> dict:
    """Image tokens, LM width and tower size as the engine will see them."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    vc, tc = cfg["vision_config"], cfg["text_config"]
    tokens = (vc["image_size"] // vc["patch_size"]) ** 2
    return {"image_tokens": tokens, "text_hidden": tc["hidden_size"],
            "image_size": vc["image_size"], "patch": vc["patch_size"],
            "vision_hidden": vc["hidden_size"], "vision_layers": vc["num_hidden_layers"]}


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="Build (once) and describe the benchmark models.")
    ap.add_argument("models", nargs="*", metavar="MODEL",
                    help=f"any of {', '.join(SPECS)} (default: all)")
    wanted = ap.parse_args().models or list(SPECS)
    if unknown := [k for k in wanted if k not in SPECS]:
        ap.error(f"unknown model {unknown[0]!r} (choose from {', '.join(SPECS)})")
    for k in wanted:
        print(k, ensure_model(k), model_info(model_path(k)))
