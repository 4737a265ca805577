"""A real tensor-parallel-2 CPU engine (multiprocess executor) consuming a disk store:
proof that ``worker_loads`` (workers read pinned entries) and ``bytes`` both serve hits
with the same output as encoding, on vLLM's CPU build (issue #11, item 6).

1. ``encache precompute`` (the library job, an in-process TP=1 producer) fills a store for
   6 pages of the demo corpus;
2. for each of ``--modes`` (default: none, files, bytes) a TP=2 engine
   (``distributed_executor_backend="mp"``, ``VLLM_CPU_OMP_THREADS_BIND=0|1``: the CPU
   build needs one NUMA node per worker otherwise) chats over the pages twice; "none" has
   no connector (it encodes), the others must hit every page and produce its text.

Writes ``benchmarks/tp_engine.json``. Each engine takes minutes to start on a busy 2-vCPU
machine; this is a correctness run with timings, not a throughput benchmark.

    .venv/bin/python scripts/bench/tp_engine.py [--modes none,files,bytes]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(mode: str, store: str, corpus: str, out: str) -> None:
    """One TP=2 engine (a fresh process: vLLM keeps connector state per process)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from engine_support import chat_texts, consumer_config, make_llm, shutdown

    from encache.connectors.store import open_store

    files = sorted(str(p) for p in Path(corpus).rglob("*") if p.is_file())
    cfg = None if mode == "none" else consumer_config(store, worker_loads=mode)
    t0 = time.time()
    llm = make_llm(str(ROOT / ".models" / "tiny-llava"), cfg, tensor_parallel_size=2,
                   distributed_executor_backend="mp")
    started = time.time() - t0
    before = open_store(store).read_counters()
    rounds = []
    for _ in range(2):
        t = time.time()
        texts = chat_texts(llm, files)
        rounds.append({"seconds": time.time() - t, "texts": texts})
    time.sleep(1.0)  # counters flush every 0.2 s
    after = open_store(store).read_counters()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("hits", "misses", "load_errors")}
    Path(out).write_text(json.dumps({"mode": mode, "startup_s": started, "rounds": rounds,
                                     "counters": delta, "files": len(files)}))
    shutdown(llm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="none,files,bytes")
    ap.add_argument("--child", nargs=4, metavar=("MODE", "STORE", "CORPUS", "OUT"))
    a = ap.parse_args(argv)
    if a.child:
        child(*a.child)
        return 0
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    sys.path.insert(0, str(ROOT / "tests"))
    from demo_corpus import make_corpus
    from engine_support import PRECOMPUTE_KW

    tmp = Path(tempfile.mkdtemp(prefix="encache-tp-engine-"))
    make_corpus(str(tmp / "corpus"), pages=6, seed=7)
    store = str(tmp / "store")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    pre = subprocess.run([sys.executable, "-c", (
        "import sys; sys.path.insert(0, %r); from engine_support import PRECOMPUTE_KW; "
        "from encache.jobs.precompute import PrecomputeOptions, precompute_corpus; "
        "s = precompute_corpus(%r, PrecomputeOptions(model=%r, store=%r, **PRECOMPUTE_KW)); "
        "print(s.encoded)")
        % (str(ROOT / "tests"), str(tmp / "corpus"), str(ROOT / ".models" / "tiny-llava"), store)],
        env=env, capture_output=True, text=True)
    assert pre.returncode == 0, pre.stderr[-2000:]
    del PRECOMPUTE_KW
    results = {"benchmark": "TP=2 CPU engine consuming a disk store (issue #11)",
               "precomputed": int(pre.stdout.split()[-1]), "runs": []}
    for mode in a.modes.split(","):
        out = tmp / f"{mode}.json"
        t = time.time()
        p = subprocess.run([sys.executable, __file__, "--child", mode, store,
                            str(tmp / "corpus"), str(out)], env=dict(os.environ),
                           capture_output=True, text=True)
        if p.returncode != 0 or not out.exists():
            results["runs"].append({"mode": mode, "error": p.stderr[-3000:]})
        else:
            results["runs"].append(json.loads(out.read_text()))
        print(f"[tp-engine] {mode}: {time.time() - t:.0f} s", file=sys.stderr)
    texts = {r["mode"]: r["rounds"][-1]["texts"] for r in results["runs"] if "rounds" in r}
    results["same_text_as_encoding"] = {m: t == texts.get("none") for m, t in texts.items()}
    (ROOT / "benchmarks" / "tp_engine.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({r["mode"]: r.get("counters", r.get("error", "")[-300:])
                      for r in results["runs"]}, indent=1))
    print(results["same_text_as_encoding"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
