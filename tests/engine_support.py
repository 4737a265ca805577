"""Helpers for tests that run real vLLM engines in-process.

vLLM keeps the worker-side EC connector in a process global, so engines with different
connector settings must not be alive at the same time: build one, use it, ``shutdown()``
it, then build the next (fixtures here are module- or session-scoped accordingly).
"""

from __future__ import annotations

import base64
import gc
import mimetypes
import os
import sys
from pathlib import Path

from encache.connectors.vllm import CONNECTOR_MODULE

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

ENGINE_KW = dict(enforce_eager=True, max_model_len=256, max_num_seqs=4,
                 max_num_batched_tokens=256, limit_mm_per_prompt={"image": 1},
                 dtype="float32", seed=0)
# the same settings as `encache precompute` options
PRECOMPUTE_KW = dict(max_model_len=256, dtype="float32",
                     engine_args={"enforce_eager": True, "max_num_seqs": 4,
                                  "max_num_batched_tokens": 256, "seed": 0})


def consumer_config(store: str, role: str = "ec_consumer", **extra) -> dict:
    return {"ec_connector": "EncacheConnector", "ec_role": role,
            "ec_connector_module_path": CONNECTOR_MODULE,
            "ec_connector_extra_config": {"store": store, "counters_flush_s": 0.2, **extra}}


def make_llm(model: str, ec_transfer_config: dict | None = None, **kw):
    from vllm import LLM
    args = dict(ENGINE_KW, **kw)
    if ec_transfer_config:
        args["ec_transfer_config"] = ec_transfer_config
    return LLM(model=model, **args)


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown
    ensure_ec_transfer_shutdown()
    del llm
    gc.collect()


def data_url(path: str | os.PathLike) -> str:
    mime = mimetypes.guess_type(str(path))[0] or "image/png"
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()


def conversation(path) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(path)}},
        {"type": "text", "text": "What is on this page?"}]}]


def chat_texts(llm, paths, max_tokens: int = 6) -> list[str]:
    from vllm import SamplingParams
    outs = llm.chat([conversation(p) for p in paths],
                    SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


class EncoderCounter:
    """Counts vision-encoder runs of the in-process LLaVA model (all engines)."""

    def __init__(self):
        from vllm.model_executor.models import llava
        cls = llava.LlavaForConditionalGeneration
        self.calls = 0
        self.items = 0
        if getattr(cls, "_encache_counter", None) is None:
            original = cls.embed_multimodal

            def counted(model_self, **kwargs):
                out = original(model_self, **kwargs)
                counter = type(model_self)._encache_counter
                counter.calls += 1
                if isinstance(out, (list, tuple)):
                    counter.items += len(out)
                else:  # one batched tensor (items, tokens, width) when images share a size
                    counter.items += out.shape[0] if out.dim() == 3 else 1
                return out
            cls.embed_multimodal = counted
        cls._encache_counter = self

    def reset(self) -> None:
        self.calls = 0
        self.items = 0
