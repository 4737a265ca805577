#!/usr/bin/env python
"""Demo consumer: send every corpus image to an ``ec_consumer`` engine, as a served
request would (base64 ``image_url`` in a chat message), and count vision-encoder runs.

    python scripts/demo_consume.py CORPUS MODEL STORE
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def main() -> int:
    corpus, model, store = sys.argv[1:4]
    from encache.cli.connector_config import build_config
    from encache.connectors.corpus import non_media_reason, walk
    from engine_support import EncoderCounter, chat_texts, make_llm, shutdown

    paths = [f.path for f in walk(corpus) if non_media_reason(f) is None]
    counter = EncoderCounter()
    llm = make_llm(model, build_config(store, "ec_consumer", {"counters_flush_s": 0.5}))
    t0 = time.perf_counter()
    chat_texts(llm, paths, max_tokens=4)
    dt = time.perf_counter() - t0
    shutdown(llm)
    print(f"consumer: {len(paths)} requests in {dt:.2f}s, vision encoder ran "
          f"{counter.items} times (0 = every image came from the store)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
