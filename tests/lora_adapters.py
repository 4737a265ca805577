"""Tiny PEFT-format LoRA adapters for the tiny test models: one on the multimodal projector
(tower-connector LoRA: it changes the encoder outputs) and one on the language model (it
does not). The tests build their adapters with these; ``scripts/build_tiny_model.py
--lora / --text-lora`` (run by scripts/setup) writes them beside a model.
"""

from __future__ import annotations

import json
import os


def _save_adapter(weights: dict, out: str, model_dir: str, rank: int, targets: list) -> str:
    """Write ``weights`` as a PEFT LoRA adapter directory ``out`` on ``targets``."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    save_file(weights, os.path.join(out, "adapter_model.safetensors"))
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
                   "lora_dropout": 0.0, "bias": "none", "target_modules": targets,
                   "base_model_name_or_path": os.path.abspath(model_dir),
                   "fan_in_fan_out": False, "inference_mode": True}, f, indent=1)
    return out


def build_lora(model_dir: str, out: str, rank: int = 8, seed: int = 1, scale: float = 0.5) -> str:
    """A PEFT-format LoRA adapter on the multimodal projector (tower-connector LoRA).

    With vLLM's ``enable_tower_connector_lora`` the adapter changes the encoder outputs,
    so vLLM keys them ``{lora_name}:{hash}`` — what ``precompute --lora`` must reproduce.
    """
    import torch

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    vis = cfg["vision_config"]["hidden_size"]
    txt = cfg["text_config"]["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, (d_in, d_out) in {"linear_1": (vis, txt), "linear_2": (txt, txt)}.items():
        prefix = f"base_model.model.multi_modal_projector.{name}"
        weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * scale
        weights[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * scale
    return _save_adapter(weights, out, model_dir, rank, ["linear_1", "linear_2"])


def build_text_lora(model_dir: str, out: str, rank: int = 8, seed: int = 1,
                    scale: float = 0.5) -> str:
    """A PEFT-format LoRA adapter on the language model's ``q_proj`` / ``v_proj`` (what
    most adapters of Gemma 3 or Qwen2.5-VL are), for any family's tiny model.

    It changes the text, not the vision encoder's outputs: for a model without
    tower-connector LoRA, LoRA requests use the same encoder entries as the base model.
    Module names are the checkpoint's, as PEFT names them from the Hugging Face model.
    """
    import torch
    from safetensors import safe_open

    g = torch.Generator().manual_seed(seed)
    weights = {}
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        for key in f.keys():
            if not key.endswith(("self_attn.q_proj.weight", "self_attn.v_proj.weight")):
                continue
            if "vision" in key or "visual" in key:
                continue
            d_out, d_in = f.get_slice(key).get_shape()
            prefix = "base_model.model." + key[: -len(".weight")]
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) * scale
            weights[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=g) * scale
    if not weights:
        raise SystemExit(f"no language-model q_proj/v_proj in {model_dir}")
    return _save_adapter(weights, out, model_dir, rank, ["q_proj", "v_proj"])
