"""Online encoder disaggregation (EPD) on this machine: encache vs vLLM's ECExampleConnector.

For each entry size an encoder instance (``ec_producer``, encode-only) and a prefill/decode
instance (``ec_consumer``) run as real ``python -m vllm.entrypoints.openai.api_server``
processes, one pair per variant, each pair alone on the machine in turn (four servers at
once on 2 cores measured mostly their contention), the encoder's worker and PD's bound to
different cores (``VLLM_CPU_OMP_THREADS_BIND``, as ``served_support.start_server`` assigns
them: with vLLM's auto binding both take the first core, where each worker's one-second
busy-wait after a step slowed the other's requests): encache with its defaults on a disk
store, encache with ``fsync: false``, encache on a password-protected Redis and on a
Redis Cluster (3 primaries + 3 replicas; both started here on loopback), and
ECExampleConnector, each pair sharing a disk store (encache), a Redis key prefix, or a
``shared_storage_path`` (ECExample) that starts with the same images precomputed. A
client does what vLLM's EPD proxy does: the request's images to the encoder, wait for its
200, then the original request to PD at once. Every variant gets the same images in the
same order, after one untimed warm-up request.

Sizes are set by the tiny LLaVA's language-model width (``build_tiny_model.py
--text-hidden``): 16 tokens x 64 fp32 (4 KB), 256 x 2688 fp32 (2.75 MB, Gemma 3 27B's
256 x 5376 fp16), 1024 x 2688 fp32 (11 MB, four such crops).

Reported per size and connector: PD hit ratio (requests whose PD tower stayed idle,
from the encoder probe), encoder request latency and PD time to first token (a
``max_tokens=1`` request: its whole latency) p50 / p99; and a mixed workload where 3 of
4 images were precomputed into the store beforehand (both connectors read the same
safetensors layout). The producer's per-request overhead is broken down in-process at
each size: checksum + header (``encode_parts``), the write (``DiskStore.put`` with and
without fsync), against ECExample's ``save_file``. JSON + PNG in benchmarks/epd.*.

    .venv/bin/python scripts/bench/epd_bench.py [--requests 24] [--sizes small,gemma,crops]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import (ROOT, code_state, finish_run, machine,  # noqa: E402
                            set_engine_env, summary, table)

SIZES = {  # name: (label, build args, image tokens, max_model_len)
    "small": ("4 KB", [], 16, 256),
    "gemma": ("2.75 MB", ["--image-size", "128", "--patch", "8", "--text-hidden", "2688"],
              256, 512),
    "crops": ("11 MB", ["--image-size", "256", "--patch", "8", "--text-hidden", "2688"],
              1024, 1536),
}


def model_for(name: str) -> str:
    label, args, _, _ = SIZES[name]
    path = ROOT / ".models" / ("tiny-llava" if not args else f"tiny-llava-epd-{name}")
    if name == "gemma":
        path = ROOT / ".models" / "tiny-llava-2688"  # the one the tests use
    if not (path / "encache_tiny_model.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), str(path),
                        *args], check=True, capture_output=True)
    return str(path)


def post(base: str, body: dict) -> float:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
        assert r.status == 200
    return time.perf_counter() - t0


def bodies(model: str, path: str) -> tuple[dict, dict]:
    from engine_support import data_url
    image = {"type": "image_url", "image_url": {"url": data_url(path)}}
    full = {"model": model, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "user", "content": [image, {"type": "text", "text": "What is on this page?"}]}]}
    return {"model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": [image]}]}, full


VARIANTS = ("encache", "encache-nofsync", "encache-redis", "encache-cluster", "ecexample")
SHARED = {"encache-redis": "redis", "encache-cluster": "cluster"}  # variant -> its server


def configs(kind: str, store: str) -> dict:
    from engine_support import consumer_config
    if kind.startswith("encache"):
        extra = {"fsync": False} if kind == "encache-nofsync" else {}
        return {role: consumer_config(store, role=role, **extra)
                for role in ("ec_producer", "ec_consumer")}
    return {role: {"ec_connector": "ECExampleConnector", "ec_role": role,
                   "ec_connector_extra_config": {"shared_storage_path": store}}
            for role in ("ec_producer", "ec_consumer")}


def producer_overhead(shape: tuple[int, int], root: Path, reps: int = 30) -> dict:
    """In-process: the producer's per-item write cost, its parts, vs ECExample's."""
    import torch
    from safetensors.torch import save_file

    from encache.connectors.store import open_store
    from encache.connectors.store.entry import encode_parts

    t = torch.randn(*shape)
    stores = {fs: open_store(str(root / f"ov-{fs}"), fsync=fs) for fs in (True, False)}
    times = {"encode_parts (checksum + header)": [], "put, fsync": [],
             "put, fsync: until it lands": [], "put, no fsync": [], "ECExample save_file": []}
    for i in range(reps):
        host = t.to("cpu").contiguous()
        data = host.reshape(-1).view(torch.uint8).numpy()
        t0 = time.perf_counter()
        parts = encode_parts(f"id{i}", data, "F32", tuple(host.shape), model="m")
        times["encode_parts (checksum + header)"].append(time.perf_counter() - t0)
        for fs, key in ((True, "put, fsync"), (False, "put, no fsync")):
            landed = []  # the writer reports the entry when its bytes are written
            t0 = time.perf_counter()
            stores[fs].put(f"id{i}", parts, encoded_here=True,
                           on_written=lambda: landed.append(time.perf_counter()))
            times[key].append(time.perf_counter() - t0)
            if fs:
                times["put, fsync: until it lands"].append(landed[0] - t0)
        d = root / "ov-ex" / f"id{i}"
        t0 = time.perf_counter()
        d.mkdir(parents=True, exist_ok=True)
        save_file({"ec_cache": t.detach().cpu()}, str(d / "encoder_cache.safetensors"))
        times["ECExample save_file"].append(time.perf_counter() - t0)
    return {k: summary(v, 1e3) for k, v in times.items()}


def run_size(name: str, n: int, root: Path, urls: dict[str, str]) -> dict:
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from engine_support import PRECOMPUTE_KW
    from served_support import draw_images, start_server

    label, _, tokens, max_len = SIZES[name]
    model = model_for(name)
    work = root / name
    sizes = {f"i{k}": (160 + 4 * k, 128 + 2 * k) for k in range(2 * n)}
    imgs = draw_images(work / "img", {**sizes, "warm": (150, 150)}, seed=31)
    online = [imgs[f"i{k}"] for k in range(n)]
    mixed = [imgs[f"i{k}"] for k in range(n, 2 * n)]
    pre_dir = work / "pre"
    pre_dir.mkdir(parents=True)
    precomputed = [p for k, p in enumerate(mixed) if k % 4]  # 3 of 4
    for p in precomputed:
        shutil.copy(p, pre_dir)
    stores = {"encache": str(work / "encache"), "ecexample": str(work / "ecexample")}
    pre = dict(PRECOMPUTE_KW, max_model_len=max_len,
               engine_args={**PRECOMPUTE_KW["engine_args"], "max_num_batched_tokens": max_len})
    s = precompute_corpus(str(pre_dir),
                          PrecomputeOptions(model=model, store=stores["encache"], **pre))
    assert s.encoded == len(precomputed), s
    fresh = work / "precomputed"  # each variant starts from the same precomputed store
    shutil.copytree(stores["encache"], fresh)
    out = {"online": {}, "mixed": {}}
    for kind in VARIANTS:
        if kind in SHARED:  # a key prefix of its own, the same images precomputed into it
            store = f"{urls[SHARED[kind]]}?prefix=epd-{name}:"
            s = precompute_corpus(str(pre_dir), PrecomputeOptions(model=model, store=store,
                                                                  **pre))
            assert s.encoded == len(precomputed), s
        else:
            store = str(work / f"store-{kind}")
            shutil.copytree(fresh, store, ignore=None if kind != "ecexample"
                            else shutil.ignore_patterns(".encache"))
        cfg = configs(kind, store)
        # one pair at a time: the other variants' servers do not compete for the CPU
        e = start_server(model, cfg["ec_producer"], work, max_model_len=max_len,
                         probe=f"{kind}-e")
        pd = start_server(model, cfg["ec_consumer"], work, max_model_len=max_len,
                          probe=f"{kind}-pd")
        try:
            e.wait_ready()
            pd.wait_ready()
            warm_body = bodies(model, imgs["warm"])  # first requests pay one-time costs
            post(e.base, warm_body[0])
            post(pd.base, warm_body[1])
            runs0 = e.encoder_log.count()
            for phase, paths in (("online", online), ("mixed", mixed)):
                res = {"encoder_s": [], "pd_s": [], "pd_tower_idle": 0}
                for path in paths:
                    enc_body, full = bodies(model, path)
                    before = pd.encoder_log.count()
                    res["encoder_s"].append(post(e.base, enc_body))  # the proxy waits...
                    res["pd_s"].append(post(pd.base, full))  # ...then forwards at once
                    res["pd_tower_idle"] += pd.encoder_log.count() == before
                runs = e.encoder_log.count()
                out[phase][kind] = {"requests": len(paths),
                                    "pd_hit_ratio": res["pd_tower_idle"] / len(paths),
                                    "encoder_ms": summary(res["encoder_s"], 1e3),
                                    "pd_ttft_ms": summary(res["pd_s"], 1e3),
                                    "encoder_tower_runs": runs - runs0}
                runs0 = runs
        finally:
            e.stop()
            pd.stop()
    return {"size": label, "tokens": tokens, "width": 64 if name == "small" else 2688,
            "entry_bytes": tokens * (64 if name == "small" else 2688) * 4,
            "precomputed_in_mixed": len(precomputed), **out,
            "producer_overhead_ms": producer_overhead((tokens, 64 if name == "small" else 2688),
                                                      work)}


def report(results: dict) -> str:
    rows = []
    for r in results["sizes"]:
        for phase in ("online", "mixed"):
            for k in VARIANTS:
                v = r[phase][k]
                rows.append([r["size"], phase, k, f"{v['pd_hit_ratio']:.2f}",
                             f"{v['encoder_ms']['p50']:.1f} / {v['encoder_ms']['p99']:.1f}",
                             f"{v['pd_ttft_ms']['p50']:.1f} / {v['pd_ttft_ms']['p99']:.1f}",
                             str(v["encoder_tower_runs"])])
    text = table(rows, ["size", "workload", "connector", "PD hits", "encoder ms p50/p99",
                        "PD TTFT ms p50/p99", "encoder tower runs"])
    rows = []
    for r in results["sizes"]:
        for k, v in r["producer_overhead_ms"].items():
            rows.append([r["size"], k, f"{v['p50']:.3f}", f"{v['p99']:.3f}"])
    return text + "\n\nproducer per-item write cost (in-process)\n" + table(
        rows, ["size", "step", "ms p50", "ms p99"])


def plot(results: dict, filename: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["size"] for r in results["sizes"]]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for ax, (key, title) in zip(axes, (("pd_hit_ratio", "PD hit ratio (online)"),
                                       ("encoder_ms", "encoder latency p50, ms (online)"),
                                       ("pd_ttft_ms", "PD time to first token p50, ms"))):
        width = 0.8 / len(VARIANTS)
        for j, k in enumerate(VARIANTS):
            vals = [r["online"][k][key] if key == "pd_hit_ratio" else r["online"][k][key]["p50"]
                    for r in results["sizes"]]
            off = (j - (len(VARIANTS) - 1) / 2) * width
            ax.bar([i + off for i in range(len(sizes))], vals, width=width, label=k)
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_title(title)
        ax.legend()
    fig.suptitle("EPD on one CPU host: encoder -> store -> PD (scripts/bench/epd_bench.py)")
    fig.tight_layout()
    fig.savefig(ROOT / "benchmarks" / filename, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12, help="images per workload and size")
    p.add_argument("--sizes", default="small,gemma,crops")
    p.add_argument("--out", default="epd")
    a = p.parse_args(argv)
    set_engine_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # servers as users run them
    code0 = code_state()
    root = Path(tempfile.mkdtemp(prefix="epd-bench-", dir=ROOT / ".venv"))
    from redis_cluster_fixture import LocalCluster
    from redis_fixture import RedisServer
    redis = RedisServer(password="epd-bench")
    cluster = None
    results = {"benchmark": "epd", "machine": machine(),
               "params": {"requests": a.requests, "sizes": a.sizes, "code": code0,
                          "servers": "python -m vllm.entrypoints.openai.api_server, worker "
                                     "processes, --enforce-eager, fp32, one encoder + one PD "
                                     "per variant, one pair on the machine at a time, the "
                                     "encoder's worker on the last core, PD's on the first "
                                     "(VLLM_CPU_OMP_THREADS_BIND)",
                          "redis": "redis-server on loopback, password; Redis Cluster: 3 "
                                   "primaries + 3 replicas on loopback, the consumer's URL "
                                   "naming 6 nodes"},
               "sizes": []}
    try:
        cluster = LocalCluster(3, 1)
        urls = {"redis": redis.url_for(db=0), "cluster": cluster.url_for(nodes=6)}
        for name in a.sizes.split(","):
            results["sizes"].append(run_size(name, a.requests, root, urls))
            print(f"[epd] {name} done", file=sys.stderr)
    finally:
        if cluster is not None:
            cluster.stop()
        redis.stop()
        shutil.rmtree(root, ignore_errors=True)
    finish_run(results, a.out, code0, plot)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
