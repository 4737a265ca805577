"""Refresh benchmark with non-media and hostile files beside the images.

Since media are found by content, the walk lists every file, not only image suffixes.
This measures what that costs a cron refresh over an unchanged corpus, side by side in
one run: corpus A holds N images; corpus B holds the same N images plus N non-media
sidecars (captions .txt / metadata .json, no media suffix: sniffed on the first run) and
a few hostile files (a decompression bomb, truncated and mislabelled files). Both are
refreshed with ``encache precompute`` in a fresh process (as cron runs it), store
pre-filled, so no engine starts. Reported: the median refresh time of each and B/A.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
from refresh_bench import ENCACHE, MODEL, make_corpus  # noqa: E402


def timed(args: list[str], ok=(0,)) -> tuple[float, dict]:
    """``encache ARGS --json --quiet`` in a fresh process: (seconds, summary)."""
    import subprocess
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="ERROR")
    t0 = time.perf_counter()
    r = subprocess.run([ENCACHE, *args, "--json", "--quiet"], capture_output=True, text=True,
                       env=env)
    dt = time.perf_counter() - t0
    if r.returncode not in ok:
        raise SystemExit(f"encache failed ({r.returncode}): {r.stderr[-2000:]}")
    return dt, json.loads(r.stdout)


def add_sidecars_and_hostile(root: Path) -> int:
    from media_files import make_bomb, noisy_jpeg

    n = 0
    for png in sorted(root.rglob("*.png")):
        png.with_suffix(".txt").write_text(f"caption for {png.name}\n")
        n += 1
    make_bomb(root / "bomb.png")
    jpeg = noisy_jpeg((64, 48))
    (root / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (root / "text.jpg").write_bytes(b"not a picture")
    (root / "empty.png").write_bytes(b"")
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from encache.connectors.store import encode, open_store
    from encache.connectors.vllm.hashing import identify_file

    with tempfile.TemporaryDirectory(prefix="encache-refresh-media-") as tmp:
        a_dir, b_dir = Path(tmp) / "A", Path(tmp) / "B"
        make_corpus(a_dir, a.images)
        make_corpus(b_dir, a.images)
        sidecars = add_sidecars_and_hostile(b_dir)
        store = Path(tmp) / "store"
        s = open_store(str(store))
        arr = np.zeros((4, 4), np.float16)
        for png in sorted(a_dir.rglob("*.png")):  # B's images are the same bytes
            ident = identify_file(png, MODEL).identifier
            s.put(ident, encode(ident, arr.view(np.uint8), "F16", arr.shape, model=MODEL))
        runs = {}
        bases = {name: ["precompute", str(corpus), "-m", MODEL, "-s", str(store)]
                 for name, corpus in (("A", a_dir), ("B", b_dir))}
        for name, base in bases.items():
            first, sm = timed(base, ok=(0, 3))
            assert sm["present"] == a.images and sm["engine_started"] is False
            runs[name] = {"first_run_s": first, "samples": []}
        for _ in range(a.repeats):  # interleaved: both see the same machine load
            for name, base in bases.items():
                dt, sm = timed(base, ok=(0, 3))
                assert sm["hashed"] == 0, sm  # nothing read again
                runs[name]["samples"].append(dt)
                runs[name].update(files=sm["files"], skipped_non_media=sm["skipped_non_media"],
                                  failed=sm["failed"])
        for r in runs.values():
            r["refresh_s"] = statistics.median(r["samples"])
            r["refresh_us_per_file"] = r["refresh_s"] / r["files"] * 1e6
    result = {
        "images": a.images, "non_media_sidecars": sidecars, "hostile_files": 4,
        "repeats": a.repeats, "A_images_only": runs["A"], "B_with_non_media": runs["B"],
        "refresh_ratio_B_over_A": runs["B"]["refresh_s"] / runs["A"]["refresh_s"],
        "first_run_ratio_B_over_A": runs["B"]["first_run_s"] / runs["A"]["first_run_s"],
        "machine": {"cpus": os.cpu_count(), "note": "shared machine; ratios from one run"},
    }
    out = ROOT / "benchmarks"
    out.mkdir(exist_ok=True)
    (out / "refresh_media.json").write_text(json.dumps(result, indent=2) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    labels = [f"A: {a.images:,} images", f"B: + {sidecars:,} non-media\n+ 4 hostile files"]
    vals = [runs["A"]["refresh_s"], runs["B"]["refresh_s"]]
    bars = ax.barh(labels, vals, color=["#2a9d8f", "#e9c46a"])
    ax.bar_label(bars, labels=[f"{v:.2f} s" for v in vals], padding=3)
    ax.set_xlabel("seconds, unchanged-corpus precompute (cron refresh)")
    ax.set_title(f"refresh with non-media beside the images: "
                 f"{result['refresh_ratio_B_over_A']:.2f}x")
    ax.set_xlim(0, max(vals) * 1.3)
    fig.tight_layout()
    fig.savefig(out / "refresh_media.png", dpi=120)
    print(json.dumps({k: v for k, v in result.items()}, indent=2))
    return 0


if __name__ == "__main__":
    t = time.perf_counter()
    rc = main()
    print(f"total {time.perf_counter() - t:.0f}s", file=sys.stderr)
    sys.exit(rc)
