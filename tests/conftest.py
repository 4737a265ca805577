"""Shared fixtures: the tiny offline model, and process-wide settings for real engines.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` + the ``uni`` executor): they
start in seconds and let tests observe the model directly (e.g. count encoder calls).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["redis_fixture", "redis_cluster_fixture"]  # real redis-server(s) / a real local Redis Cluster

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(ROOT / ".vllm-cache"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Path of the tiny random-weight LLaVA (built by scripts/setup; built here if missing)."""
    from engine_support import built_model
    return built_model("tiny-llava")


@pytest.fixture(scope="session")
def tiny_lora_model() -> tuple[str, str]:
    """(model, adapter): a tiny LLaVA keeping the CLS token plus a projector LoRA adapter.

    vLLM 0.32's CPU tower-connector LoRA mapping counts one tower token per embedding, so
    the test model keeps CLS ("full" feature strategy) to make the counts agree.
    """
    model = ROOT / ".models" / "tiny-llava-full"
    adapter = ROOT / ".models" / "tiny-lora-full"
    if not (adapter / "adapter_config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), str(model),
                        "--feature-strategy", "full", "--lora", str(adapter)],
                       check=True, capture_output=True)
    return str(model), str(adapter)


def _tiny_family(arch: str, text_hidden: int = 64, image_size: int | None = None) -> str:
    """The tiny model of ``arch``; ``text_hidden`` (the entry width) and ``image_size``
    (gemma3's tile) as ``build_tiny_model.py`` takes them, for entries of realistic size."""
    args = ["--arch", arch]
    name = f"tiny-{arch}"
    if text_hidden != 64:
        args += ["--text-hidden", str(text_hidden)]
        name += f"-{text_hidden}"
    if image_size is not None:
        args += ["--image-size", str(image_size)]
        name += f"-{image_size}px"
    from engine_support import built_model
    return built_model(name, *args)


@pytest.fixture(scope="session")
def tiny_gemma3() -> str:
    """Path of the tiny random-weight Gemma 3 (SigLIP 64 px tiles, 16 tokens per tile)."""
    return _tiny_family("gemma3")


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl() -> str:
    """Path of the tiny random-weight Qwen2.5-VL (dynamic resolution, max 256 tokens/image)."""
    return _tiny_family("qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_family():
    """``tiny_family(arch, text_hidden=64, image_size=None)``: path of the tiny model of
    ``arch`` (scripts/tiny_<arch>.py), built here if scripts/setup did not."""
    return _tiny_family
