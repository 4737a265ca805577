"""`encache precompute` vs a bare vLLM ``ec_producer`` script (issue #11, item 5).

Same model (a SigLIP-base-sized CLIP tower: 224 px, patch 16, hidden 768, 12 layers,
built offline by scripts/build_tiny_model.py), same engine options, same images, same
chat prompt, one generated token, batches of ``--batch`` conversations:

  bare       LLM(..., ec_transfer_config=ECExampleConnector ec_producer) + LLM.chat over
             the images (vLLM decodes and hashes each image itself; the connector writes
             one safetensors file per item, synchronously in the worker)
  encache    ``encache.jobs.precompute.precompute_corpus`` (what ``encache precompute`` runs:
             identify the files on a background thread, start the producer engine at
             the first missing file and feed it batches as they are identified -- a
             reader thread reads and decodes batch k+1 while the engine encodes batch k
             -- wait for the background writes) into an empty store

The corpus is tests/demo_corpus.py's pages in its six formats: 96x128 by default,
``--page-size 1240x1754`` for real-sized document pages (A4 at 150 dpi), where decoding
an image costs what a scan costs and the overlap of decoding with the encoder shows.

Each run is a fresh process (one engine per process); the two alternate per repetition.
Two figures, both images / seconds:

* **job** (the headline, as before): the time outside the engine's start-up. bare: the
  chat loop (vLLM decodes and hashes inside it; its writes are synchronous inside it).
  encache: the time until the engine starts (walk, hashing until the first missing
  file) + from the engine being ready until every write is on disk
  (``wait_for_saves``); hashing that ran beside the engine's start-up is not in it.
* **end to end**: from before importing vLLM until every entry is written, start-up
  included for both (what a user waits; the engine's shutdown is not in it: bare exits
  without one).

Writes ``benchmarks/precompute.{json,png}``.

    .venv/bin/python scripts/bench/precompute_bench.py [--images 48] [--reps 2] [--batch 8,16]
                                                       [--page-size 1240x1754]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))  # demo_corpus: the corpus the tests build too
from demo_corpus import DEFAULT_SIZE, parse_size  # noqa: E402
from serving_common import BENCH_DIR, code_state, loadavg, machine, table, write_json  # noqa: E402

MODEL = ROOT / ".models" / "siglip-base-llava"
ENGINE = {"enforce_eager": True, "max_num_seqs": 16, "max_num_batched_tokens": 4096,
          "seed": 0}
MAX_MODEL_LEN = 512
DTYPE = "float32"
PROMPT = "Describe the image."

BARE = r"""
import json, os, sys, time, base64, mimetypes, glob
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
model, corpus, out_dir, batch, engine = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
llm = LLM(model=model, max_model_len=int(sys.argv[6]), dtype=sys.argv[7], limit_mm_per_prompt={"image": 1},
          ec_transfer_config={"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
                              "ec_connector_extra_config": {"shared_storage_path": out_dir}}, **engine)
sp = SamplingParams(max_tokens=1, temperature=0.0)
t1 = time.perf_counter()
files = sorted(glob.glob(os.path.join(corpus, "**", "*.*"), recursive=True))
for i in range(0, len(files), batch):
    convs = []
    for p in files[i:i + batch]:
        with open(p, "rb") as f:
            url = f"data:{mimetypes.guess_type(p)[0] or 'image/png'};base64," + base64.b64encode(f.read()).decode()
        convs.append([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": %r}]}])
    llm.chat(convs, sp, use_tqdm=False)
t2 = time.perf_counter()
n = len([d for d in os.listdir(out_dir) if os.path.exists(os.path.join(out_dir, d, "encoder_cache.safetensors"))])
print(json.dumps({"startup_s": t1 - t0, "job_s": t2 - t1, "to_stored_s": t2 - t0, "wall_s": t2 - t0, "images": len(files), "stored": n}))
os._exit(0)
""" % PROMPT

ENCACHE = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
t_import = time.perf_counter()
model, corpus, store, batch, engine = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
# what the hashing pass imports (vLLM's hasher and media loader) is start-up, as bare's
# `from vllm import LLM` is: measured outside the job time for both
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media.image import ImageMediaIO
from encache.connectors.vllm import hashing
from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
from encache.connectors.vllm import producer
import_s = time.perf_counter() - t_import
closing = []
_close = producer.ProducerEngine.close
def close(self):  # precompute calls this after wait_for_saves: every entry is written
    closing.append(time.perf_counter())
    return _close(self)
producer.ProducerEngine.close = close
marks = {}
class P:
    def start(self, phase, total):
        marks.setdefault(phase, time.perf_counter())
    def advance(self, n, failed=None, phase=None):
        if phase == "hashing":
            marks["hashed"] = time.perf_counter()
options = PrecomputeOptions(model=model, store=store, batch=batch, max_model_len=int(sys.argv[6]),
                            dtype=sys.argv[7], engine_args=engine)
t0 = time.perf_counter()
s = precompute_corpus(corpus, options, progress=P())
t_end = time.perf_counter()
# hashing runs on a thread beside the engine: the engine starts at the first missing file
before_engine = marks["starting engine"] - t0  # walking + hashing until the first missing file
startup = marks["encoding"] - marks["starting engine"]
encoding = closing[-1] - marks["encoding"]  # batches (hashing the rest beside) + the writes
print(json.dumps({"startup_s": startup + import_s, "job_s": before_engine + encoding,
                  "before_engine_s": before_engine, "hashing_s": marks["hashed"] - t0,
                  "encoding_s": encoding, "shutdown_and_report_s": t_end - closing[-1],
                  "to_stored_s": closing[-1] - t_import, "wall_s": t_end - t_import,
                  "encode_s": s.encode_seconds, "images": s.files, "stored": s.encoded,
                  "failed": s.failed}))
os._exit(0)
"""


def run_one(kind: str, corpus: Path, tmp: Path, batch: int) -> dict:
    out = tmp / f"{kind}-{time.monotonic_ns()}"
    out.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    script = BARE if kind == "bare" else ENCACHE
    p = subprocess.run([sys.executable, "-c", script, str(MODEL), str(corpus), str(out), str(batch),
                        json.dumps(ENGINE), str(MAX_MODEL_LEN), DTYPE],
                       capture_output=True, text=True, env=env)
    shutil.rmtree(out, ignore_errors=True)
    if p.returncode != 0:
        raise SystemExit(f"{kind} failed: {p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["images_per_s"] = res["images"] / res["job_s"]
    res["images_per_s_end_to_end"] = res["images"] / res["to_stored_s"]
    res["loadavg"] = loadavg()
    print(f"[precompute] {kind} batch {batch}: {res['images_per_s']:.2f} images/s "
          f"(job {res['job_s']:.1f} s, start-up {res['startup_s']:.1f} s, "
          f"stored after {res['to_stored_s']:.1f} s)", file=sys.stderr)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", default="16")
    ap.add_argument("--out", default="precompute")
    ap.add_argument("--page-size", type=parse_size, default=DEFAULT_SIZE, metavar="WxH",
                    help="corpus page size in pixels (default 96x128; 1240x1754: A4 at 150 dpi)")
    a = ap.parse_args(argv)
    if not (MODEL / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"),
                        "--image-size", "224", "--patch", "16", "--vision-hidden", "768",
                        "--vision-layers", "12", str(MODEL)], check=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    from demo_corpus import make_corpus

    tmp = Path(tempfile.mkdtemp(prefix="encache-bench-precompute-"))
    corpus = tmp / "corpus"
    make_corpus(str(corpus), pages=a.images, seed=11, size=a.page_size)
    res = {"benchmark": "encache precompute vs a bare vLLM ec_producer (issue #11)",
           "machine": machine(),
           "params": {"model": "SigLIP-base-sized CLIP tower (224 px, patch 16, hidden 768, "
                               "12 layers) + tiny Llama, random weights",
                      "images": a.images, "page_size": "%dx%d" % a.page_size,
                      "corpus_bytes": sum(p.stat().st_size for p in corpus.rglob("*")
                                          if p.is_file()),
                      "engine": ENGINE, "max_model_len": MAX_MODEL_LEN,
                      "dtype": DTYPE, "reps": a.reps, "code": code_state(),
                      "method": "runs alternate, medians; each run records its load average"},
           "batches": []}
    try:
        for batch in [int(b) for b in a.batch.split(",")]:
            runs = {"bare": [], "encache": []}
            for rep in range(a.reps):
                for kind in (("bare", "encache") if rep % 2 == 0 else ("encache", "bare")):
                    runs[kind].append(run_one(kind, corpus, tmp, batch))
            med = {k: statistics.median(r["images_per_s"] for r in v) for k, v in runs.items()}
            e2e = {k: statistics.median(r["images_per_s_end_to_end"] for r in v)
                   for k, v in runs.items()}
            # per repetition, the two runs side by side
            pairs = [e["images_per_s"] / b["images_per_s"]
                     for e, b in zip(runs["encache"], runs["bare"])]
            res["batches"].append({"batch": batch, "runs": runs,
                                   "images_per_s_median": med,
                                   "encache_vs_bare": med["encache"] / med["bare"],
                                   "encache_vs_bare_per_rep": pairs,
                                   "images_per_s_end_to_end_median": e2e,
                                   "encache_vs_bare_end_to_end": e2e["encache"] / e2e["bare"]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json(a.out + ".json", res)
    _plot(res, a.out + ".png")
    rows = [[b["batch"], f"{b['images_per_s_median']['bare']:.2f}",
             f"{b['images_per_s_median']['encache']:.2f}", f"{b['encache_vs_bare']:.2f}",
             " ".join(f"{r:.2f}" for r in b["encache_vs_bare_per_rep"]),
             f"{b['encache_vs_bare_end_to_end']:.2f}"]
            for b in res["batches"]]
    print(table(rows, ["batch", "bare images/s", "encache images/s", "encache / bare",
                       "per repetition", "end to end (start-up included)"]))
    return 0


def _plot(res: dict, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bs = [b["batch"] for b in res["batches"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(bs))
    ax.bar([i - 0.2 for i in x], [b["images_per_s_median"]["bare"] for b in res["batches"]], 0.4,
           label="bare vLLM ec_producer (ECExampleConnector)")
    ax.bar([i + 0.2 for i in x], [b["images_per_s_median"]["encache"] for b in res["batches"]],
           0.4, label="encache precompute")
    ax.set_xticks(list(x), [f"batch {b}" for b in bs])
    ax.set_ylabel("images/s (median, without engine start-up)")
    ax.set_title("Precompute vs a bare producer, SigLIP-base-sized tower, %s pages"
                 % res["params"]["page_size"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(BENCH_DIR / name, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
