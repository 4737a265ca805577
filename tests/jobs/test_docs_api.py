"""docs/api.md's examples run as written: every ```python block, in order, in one fresh
Python process (a real producer engine with the tiny model, a private real redis-server), in a
directory holding a small ``corpus/``. Only the model id, the Redis URL and the engine's
max_model_len are swapped for the test's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_every_entry_point_has_an_example():
    text = "\n".join(blocks())
    for name in ("precompute_corpus(", "precompute_files(", "open_store(", "identify_file(",
                 "verify_store(", "promote(", "read_into_page_cache(", "warm("):
        assert name in text, name


def test_examples_run(tmp_path, tiny_model, redis_factory):
    redis_server = redis_factory()  # private: the example writes un-namespaced keys
    from demo_corpus import make_corpus

    make_corpus(str(tmp_path / "corpus"), pages=4, seed=5)
    swaps = {'"llava-hf/llava-1.5-7b-hf"': repr(tiny_model),
             '"redis://localhost:6379/0"': repr(redis_server.url),
             "max_model_len=4096": "max_model_len=256, dtype='float32', "
                                   "engine_args={'enforce_eager': True}"}
    script = []
    for n, block in enumerate(blocks()):
        for old, new in swaps.items():
            block = block.replace(old, new)
        script.append(f"print('--- block {n}', flush=True)\n{block}")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    r = subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert out.count("--- block") == len(blocks())
    assert "4 files: 4 encoded, 0 already there, 0 failed" in out
    assert "4 from the manifest, 4 present, False" in out  # dry run: no file read, no engine
    assert "2 given: 2 encoded, 2 re-encoded for the new tag, 0 failed" in out
    assert "2 present under the tag" in out
    assert "clean in 4 entries" in out
    assert "4 copied, 0 already there, []" in out
    assert "4 entry files," in out
    # warm --compute-missing as a library call: the 2 re-tagged entries are not usable
    # under the default config, so they are encoded into Redis; the 2 others were copied
    assert "4 requested: 2 computed, 0 copied, 2 already there, 0 failed" in out
