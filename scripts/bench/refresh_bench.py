"""Refresh benchmark: re-running `encache precompute` over an unchanged corpus.

A cron job re-runs precompute over the corpus; almost nothing changed. With the manifest
(path, size, mtime -> identifier) no file is read, decoded or hashed and vLLM is never
imported; without it (``--no-manifest``) every file is read, decoded and hashed with vLLM's
hasher. Both are timed as a user runs them: the ``encache`` command in a fresh process.
The store is pre-filled with (small) entries under the right identifiers, so neither run
starts the engine — the benchmark isolates the refresh overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENCACHE = str(ROOT / ".venv" / "bin" / "encache")
MODEL = "org/bench-model"


def make_corpus(root: Path, n: int) -> None:
    from PIL import Image
    for i in range(n):
        d = root / f"d{i // 500:03d}"
        d.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (48, 64), ((i * 7) % 256, (i * 13) % 256, (i // 256) % 256)).save(d / f"p{i}.png")


def timed(args: list[str]) -> tuple[float, dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    t0 = time.perf_counter()
    r = subprocess.run([ENCACHE, *args, "--json", "--quiet"], capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"encache failed ({r.returncode}): {r.stderr[-2000:]}")
    return dt, json.loads(r.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory(prefix="encache-refresh-") as tmp:
        corpus, store = Path(tmp) / "corpus", Path(tmp) / "store"
        t = time.perf_counter()
        make_corpus(corpus, a.images)
        print(f"corpus: {a.images} images in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        # fill the store under the served identifiers (what a first precompute leaves)
        import numpy as np
        from encache.jobs.corpus import walk
        from encache.connectors.store import encode, open_store
        from encache.connectors.vllm.hashing import identify_file
        s = open_store(str(store))
        arr = np.zeros((4, 4), np.float16)
        for f in walk(corpus):
            ident = identify_file(f.path, MODEL).identifier
            s.put(ident, encode(ident, arr.view(np.uint8), "F16", arr.shape, model=MODEL))
        base = ["precompute", str(corpus), "-m", MODEL, "-s", str(store)]
        first, summary = timed(base)  # hashes everything, writes the manifest
        assert summary["present"] == a.images and summary["engine_started"] is False
        with_manifest, without = [], []
        for _ in range(a.repeats):
            dt, sm = timed(base)
            assert sm["hashed"] == 0 and sm["from_manifest"] == a.images
            with_manifest.append(dt)
            dt, sm = timed(base + ["--no-manifest"])
            assert sm["hashed"] == a.images
            without.append(dt)
    result = {
        "images": a.images, "repeats": a.repeats,
        "first_run_s": first,
        "with_manifest_s": statistics.median(with_manifest),
        "without_manifest_s": statistics.median(without),
        "speedup": statistics.median(without) / statistics.median(with_manifest),
        "samples": {"with_manifest": with_manifest, "without_manifest": without},
        "machine": {"cpus": os.cpu_count()},
    }
    out = ROOT / "benchmarks"
    out.mkdir(exist_ok=True)
    (out / "refresh.json").write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = ["manifest\n(unchanged files skipped)", "--no-manifest\n(read + hash every file)"]
    vals = [result["with_manifest_s"], result["without_manifest_s"]]
    bars = ax.barh(labels, vals, color=["#2a9d8f", "#e76f51"])
    ax.bar_label(bars, labels=[f"{v:.2f} s" for v in vals], padding=3)
    ax.set_xlabel(f"seconds for `encache precompute` over {a.images:,} unchanged images")
    ax.set_title(f"cron refresh: {result['speedup']:.0f}x faster with the manifest")
    ax.set_xlim(0, max(vals) * 1.25)
    fig.tight_layout()
    fig.savefig(out / "refresh.png", dpi=120)
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
