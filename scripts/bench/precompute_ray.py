"""Precompute on Ray vs single-host, and the per-stage rates that bound a big run.

Side by side in one run, on the same corpus (demo pages) and the tiny LLaVA, each into a
fresh store, each the ``encache`` command in a fresh process:

* ``single``: ``encache precompute`` (one in-process engine);
* ``single-omp1``: the same with ``OMP_NUM_THREADS=1``, the thread count Ray gives a
  one-CPU actor (on an oversubscribed machine, fewer OpenMP threads can be much faster);
* ``ray-1`` / ``ray-2``: ``encache precompute --ray`` on a local one-node Ray cluster
  (tests/ray_local_cluster.py, 2 logical CPUs) with 1 and 2 engine actors.

Reported per configuration: wall seconds of the command (Ray start-up of workers, hashing,
engine start, encoding), encode-stage images/s (encoded / encode seconds, as the summary
prints it) and per-engine images/s. Then per-stage rates for docs/ray.md's estimate:
read + hash (``identify_file`` over the corpus in this process, one core), store writes
(``DiskStore.put`` of an entry the size of a LLaVA-1.5-7B image: 576 x 4096 bf16 = 4.5 MiB,
copied once from a preallocated buffer), and the encoder from the runs above.

This machine has 2 cores shared with other jobs: two engines cannot run faster than one
here; what the numbers show is the overhead of the Ray path and that the work spreads.
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
sys.path.insert(0, str(ROOT / "tests"))  # demo_corpus, ray_local_cluster (shared with the tests)
MODEL = str(ROOT / ".models" / "tiny-llava")
ENGINE = ["--max-model-len", "256", "--dtype", "float32",
          "--engine-arg", "enforce_eager=true", "--engine-arg", "max_num_seqs=4",
          "--engine-arg", "max_num_batched_tokens=256", "--engine-arg", "seed=0"]


def env(extra: dict | None = None) -> dict:
    e = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
             TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="ERROR")
    e.update(extra or {})
    return e


def run(args: list[str], environ: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "encache.cli", *args, "--json", "-q"],
                       capture_output=True, text=True, env=environ)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"encache failed ({r.returncode}): {r.stderr[-3000:]}")
    return dt, json.loads(r.stdout)


def read_hash_rate(corpus: Path) -> float:
    from encache.jobs.corpus import walk
    from encache.connectors.vllm.hashing import identify_file
    files = walk(corpus)
    identify_file(files[0].path, MODEL)  # import vLLM's hasher outside the timing
    t0 = time.perf_counter()
    for f in files:
        identify_file(f.path, MODEL)
    return len(files) / (time.perf_counter() - t0)


def read_hash_rate_photos(tmp: Path, n: int = 20) -> tuple[float, int]:
    """``identify_file`` on photo-sized JPEGs (1024 x 768, noise, quality 90): a decode and
    a blake3 over ~0.5-1 MB each, what a real corpus costs per file."""
    import numpy as np
    from PIL import Image

    from encache.connectors.vllm.hashing import identify_file
    d = tmp / "photos"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        px = rng.integers(0, 256, (768, 1024, 3), dtype=np.uint8)
        Image.fromarray(px).save(d / f"p{i}.jpg", quality=90)
    size = sum(p.stat().st_size for p in d.iterdir()) // n
    t0 = time.perf_counter()
    for p in sorted(d.iterdir()):
        identify_file(p, MODEL)
    return n / (time.perf_counter() - t0), size


def store_write_rate(tmp: Path, n: int = 24) -> tuple[float, int]:
    import numpy as np

    from encache.connectors.store import encode_parts, open_store
    store = open_store(str(tmp / "writes"), create=True)
    arr = np.ones((576, 4096), np.uint16)  # bf16 bits
    t0 = time.perf_counter()
    size = 0
    for i in range(n):
        parts = encode_parts(f"bench-{i}", arr.view(np.uint8), "BF16", arr.shape, model="bench")
        size = store.put(f"bench-{i}", parts) or size
    dt = time.perf_counter() - t0
    return n / dt, int(size or arr.nbytes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--batch", type=int, default=4)
    a = ap.parse_args()
    from demo_corpus import make_corpus
    from ray_local_cluster import LocalRayCluster

    results: dict = {"images": a.images, "batch": a.batch, "cpus": os.cpu_count(),
                     "load_avg_at_start": os.getloadavg()[0], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="encache-rayb-") as tmp:
        tmp = Path(tmp)
        make_corpus(str(tmp / "corpus"), pages=a.images, seed=11)
        common = ["--batch", str(a.batch), *ENGINE]
        dt, s = run(["precompute", str(tmp / "corpus"), "-m", MODEL, "-s", str(tmp / "single"),
                     *common], env())
        results["runs"]["single"] = {"wall_seconds": dt, "encoded": s["encoded"],
                                     "encode_seconds": s["encode_seconds"],
                                     "images_per_second": s["images_per_second"]}
        print(f"single: {dt:.1f}s wall, {s['images_per_second']:.1f} images/s", file=sys.stderr)
        # Ray sets OMP_NUM_THREADS to an actor's CPUs (1 here); the same for single-host,
        # to tell Ray's effect from the thread count's on an oversubscribed machine
        dt, s = run(["precompute", str(tmp / "corpus"), "-m", MODEL, "-s", str(tmp / "single1"),
                     *common], env({"OMP_NUM_THREADS": "1"}))
        results["runs"]["single-omp1"] = {"wall_seconds": dt, "encoded": s["encoded"],
                                          "encode_seconds": s["encode_seconds"],
                                          "images_per_second": s["images_per_second"]}
        print(f"single-omp1: {dt:.1f}s wall, {s['images_per_second']:.1f} images/s",
              file=sys.stderr)
        with LocalRayCluster([{"num_cpus": 2}]) as cluster:
            for engines, cpus in ((1, 1.0), (2, 0.75)):
                name = f"ray-{engines}"
                dt, s = run(["precompute", str(tmp / "corpus"), "-m", MODEL, "-s",
                             str(tmp / name), "--ray", cluster.address, "--engines", str(engines),
                             "--cpus-per-engine", str(cpus), *common], env(cluster.env()))
                results["runs"][name] = {
                    "wall_seconds": dt, "encoded": s["encoded"],
                    "encode_seconds": s["encode_seconds"],
                    "identify_seconds": s["identify_seconds"],
                    "images_per_second": s["images_per_second"],
                    "per_engine_images_per_second": [e["images_per_second"] for e in s["engines"]],
                    "per_engine_images": [e["images"] for e in s["engines"]]}
                print(f"{name}: {dt:.1f}s wall, {s['images_per_second']:.1f} images/s, engines "
                      f"{[round(e['images_per_second'], 1) for e in s['engines']]}", file=sys.stderr)
        base = results["runs"]["single"]["images_per_second"]
        for r in results["runs"].values():
            r["images_per_second_vs_single"] = r["images_per_second"] / base if base else None
        results["stages"] = {"read_hash_files_per_second_one_core": read_hash_rate(tmp / "corpus")}
        rate, size = read_hash_rate_photos(tmp)
        results["stages"]["read_hash_photos_per_second_one_core"] = rate
        results["stages"]["photo_bytes"] = size
        rate, size = store_write_rate(tmp)
        results["stages"]["disk_put_entries_per_second_4_5MiB"] = rate
        results["stages"]["entry_bytes_llava_1_5_7b"] = size
    results["load_avg_at_end"] = os.getloadavg()[0]
    out = ROOT / "benchmarks" / "precompute_ray.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    plot(results, ROOT / "benchmarks" / "precompute_ray.png")
    return 0


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["runs"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    ax1.bar(names, [results["runs"][n]["images_per_second"] for n in names], color="#4c72b0")
    ax1.set_ylabel("images/s (encode stage)")
    ax1.set_title("encode throughput")
    ax2.bar(names, [results["runs"][n]["wall_seconds"] for n in names], color="#dd8452")
    ax2.set_ylabel("seconds (whole command)")
    ax2.set_title(f"{results['images']} images, wall time")
    fig.suptitle(f"precompute: single-host vs Ray ({results['cpus']} shared cores, tiny LLaVA)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
