#!/usr/bin/env python
"""Demo consumer: send every corpus image to an ``ec_consumer`` engine, as a served
request would (base64 ``image_url`` in a chat message), and count vision-encoder runs.

    python scripts/demo_consume.py CORPUS MODEL STORE

Self-contained (library code and vLLM only): the engine settings match the demo's
``encache precompute`` options, so the consumer computes the same identifiers.
"""

from __future__ import annotations

import base64
import mimetypes
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

#: the demo model's engine settings (scripts/demo precomputes with the same ones)
ENGINE_KW = dict(enforce_eager=True, max_model_len=256, max_num_seqs=4,
                 max_num_batched_tokens=256, limit_mm_per_prompt={"image": 1},
                 dtype="float32", seed=0)


def conversation(path: str) -> list[dict]:
    """One chat request for an image, sent as a server would get it (a data URL)."""
    mime = mimetypes.guess_type(path)[0] or "image/png"
    url = f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is on this page?"}]}]


def count_encoder_items() -> list[int]:
    """Count items the in-process LLaVA vision encoder embeds: ``[n]``, updated live."""
    from vllm.model_executor.models import llava

    cls = llava.LlavaForConditionalGeneration
    original = cls.embed_multimodal
    seen = [0]

    def counted(model_self, **kwargs):
        out = original(model_self, **kwargs)
        if isinstance(out, (list, tuple)):
            seen[0] += len(out)
        else:  # one batched tensor (items, tokens, width) when images share a size
            seen[0] += out.shape[0] if out.dim() == 3 else 1
        return out

    cls.embed_multimodal = counted
    return seen


def main() -> int:
    corpus, model, store = sys.argv[1:4]
    from vllm import LLM, SamplingParams
    from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown

    from encache.connectors.vllm import transfer_config
    from encache.jobs.corpus import non_media_reason, walk

    paths = [f.path for f in walk(corpus) if non_media_reason(f) is None]
    encoded = count_encoder_items()
    llm = LLM(model=model, **ENGINE_KW,
              ec_transfer_config=transfer_config(store, "ec_consumer", {"counters_flush_s": 0.5}))
    t0 = time.perf_counter()
    llm.chat([conversation(p) for p in paths], SamplingParams(max_tokens=4, temperature=0),
             use_tqdm=False)
    dt = time.perf_counter() - t0
    try:
        llm.llm_engine.engine_core.shutdown()  # flushes the connector's counters
    except Exception:
        pass
    ensure_ec_transfer_shutdown()
    print(f"consumer: {len(paths)} requests in {dt:.2f}s, vision encoder ran "
          f"{encoded[0]} times (0 = every image came from the store)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
