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
without fsync), against ECExample's ``save_file``.

The *paired* section compares encache (disk, defaults) with ECExample where one pair at a
time cannot: two server processes of the same model differ by several percent in how
fast they run it, and the machine drifts between variants. Both pairs are up at once,
every request (one new image; ``--images N``: N) goes to both with the order alternating
and a quiet pause before each, and the figures are per-request ratios; inside the servers a probe (``epd_probe/``) times each
request's connector calls and its vision tower, so the connector's own cost is stated
apart from the model's. JSON + PNG in benchmarks/epd.*. ``--pair`` pairs two other
variants: ``encache-redis,encache-redis-bytes`` compares PD's loads from Redis reaching
its worker process through the shared memory they were received into (the default) with
the same loads shipped in the step's metadata (``worker_loads: bytes``), as
``benchmarks/epd_shared.*`` records; ``encache,encache-hashed`` compares PD trusting what
the encoder on the same host recorded in the store's log of verified versions (the
default) with PD hashing every entry again, as ``benchmarks/epd_trust.*`` records.

    .venv/bin/python scripts/bench/epd_bench.py [--requests 12] [--sizes small,gemma,crops]
        [--sections sequential,paired] [--paired-requests 24] [--pair encache,ecexample]
        [--images 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import (ROOT, code_state, finish_run, machine,  # noqa: E402
                            pct, set_engine_env, summary, table)

SIZES = {  # name: (label, the tests' model of that entry size, image tokens, max_model_len)
    "small": ("4 KB", "tiny_model", 16, 256),
    "gemma": ("2.75 MB", "wide_model", 256, 512),
    "crops": ("11 MB", "crops_model", 1024, 1536),
}


def model_for(name: str) -> str:
    """The tests' tiny LLaVA of that entry size (built if missing)."""
    import served_support
    from engine_support import built_model
    builder = SIZES[name][1]
    return built_model("tiny-llava") if builder == "tiny_model" else \
        getattr(served_support, builder)()


def post(base: str, body: dict) -> float:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
        assert r.status == 200
    return time.perf_counter() - t0


def bodies(model: str, paths) -> tuple[dict, dict]:
    """(the encoder's request, PD's request) for an image file or a list of them."""
    from engine_support import data_url
    images = [{"type": "image_url", "image_url": {"url": data_url(p)}}
              for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    full = {"model": model, "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "user", "content": [*images, {"type": "text", "text": "What is on this page?"}]}]}
    return {"model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": images}]}, full


VARIANTS = ("encache", "encache-nofsync", "encache-redis", "encache-cluster", "ecexample")
#: variant -> its server; the -bytes variants ship PD's loads to its worker process in the
#: step's metadata (``worker_loads: bytes``), as every Redis load did before store/memfd.py
SHARED = {"encache-redis": "redis", "encache-cluster": "cluster",
          "encache-redis-bytes": "redis", "encache-cluster-bytes": "cluster"}
#: what --pair may name; encache-hashed: a PD that keeps no log of verified versions
#: (``remember_verified: false``), so it hashes every entry the encoder wrote
KINDS = VARIANTS + ("encache-redis-bytes", "encache-cluster-bytes", "encache-hashed")


def configs(kind: str, store: str) -> dict:
    from engine_support import consumer_config
    if kind.startswith("encache"):
        extra = {"fsync": False} if kind == "encache-nofsync" else {}
        if kind.endswith("-bytes"):
            extra["worker_loads"] = "bytes"
        if kind == "encache-hashed":
            extra["remember_verified"] = False
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
             "put, fsync: until it lands (visible)": [],
             "put, fsync: until its bytes are written": [],
             "put, no fsync": [], "ECExample save_file": []}
    for i in range(reps):
        host = t.to("cpu").contiguous()
        data = host.reshape(-1).view(torch.uint8).numpy()
        t0 = time.perf_counter()
        parts = encode_parts(f"id{i}", data, "F32", tuple(host.shape), model="m")
        times["encode_parts (checksum + header)"].append(time.perf_counter() - t0)
        for fs, key in ((True, "put, fsync"), (False, "put, no fsync")):
            marks = []  # the writer reports the entry when its write is visible
            t0 = time.perf_counter()
            stores[fs].put(f"id{i}", parts, encoded_here=True,
                           on_visible=lambda: marks.append(time.perf_counter()),
                           on_written=lambda: marks.append(time.perf_counter()))
            times[key].append(time.perf_counter() - t0)
            if fs:
                times["put, fsync: until it lands (visible)"].append(marks[0] - t0)
                times["put, fsync: until its bytes are written"].append(marks[1] - t0)
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


PAIRED = ("encache", "ecexample")  # the encoder-cost comparison (issue #23 item 5)
SETTLE_S = 1.5  # > a vLLM CPU worker's one-second busy-wait after a step
CALL_PROBE = Path(__file__).resolve().parent / "epd_probe"


def _start_timed(model: str, config: dict, work: Path, tag: str, max_len: int,
                 images: int = 1):
    """A server with the call probe (``epd_probe``: its connector's calls and the tower
    timed, ``probe-<tag>/calls.jsonl``) and the tests' encoder probe (tower runs)."""
    from served_support import EncoderLog, start_server

    probe = work / f"probe-{tag}"
    probe.mkdir(parents=True)
    server = start_server(model, config, work, max_model_len=max_len, images=images, extra_env={
        "PYTHONPATH": os.pathsep.join([str(CALL_PROBE),
                                       *filter(None, [os.environ.get("PYTHONPATH")])]),
        "ENCACHE_BENCH_CALL_LOG": str(probe / "calls.jsonl"),
        "ENCACHE_TEST_ENCODER_LOG": str(probe / "encoder.jsonl")})
    server.encoder_log = EncoderLog(probe / "encoder.jsonl")
    server.call_log = probe / "calls.jsonl"
    return server


def _calls_within(server, windows: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Per request window: ms spent in each timed function (calls starting inside it),
    and ``handoff``: from the scheduler's first ``build_connector_meta`` to the worker's
    first ``execute_model`` after it (the step's metadata reaching the worker)."""
    calls = [json.loads(line) for line in server.call_log.read_text().splitlines()]
    out = []
    for t0, t1 in windows:
        spent: dict[str, float] = {}
        within = [c for c in calls if t0 <= c["t0"] <= t1]
        for c in within:
            if not c["f"].endswith(".execute_model"):
                spent[c["f"]] = spent.get(c["f"], 0.0) + c["dt"] * 1e3
        built = [c["t0"] for c in within if c["f"].endswith(".build_connector_meta")]
        ran = [c["t0"] for c in within if c["f"].endswith(".execute_model")
               and built and c["t0"] >= built[0]]
        if built and ran:
            spent["handoff"] = (min(ran) - built[0]) * 1e3
        out.append(spent)
    return out


def _split(spent: list[dict[str, float]]) -> dict:
    """The connector's share, the metadata hand-off and the tower's, p50 / p99 over
    requests, and the connector's per call. ``tower_ms`` is vLLM's
    ``_execute_mm_encoder``, which calls ``save_caches`` from inside (ECExample's
    ``save_file`` is in it; encache's ``save_caches`` only queues the write)."""
    connector = [sum(v for f, v in s.items() if "Connector." in f) for s in spent]
    tower = [s.get("GPUModelRunner._execute_mm_encoder", 0.0) for s in spent]
    calls = sorted({f for s in spent for f in s if "Connector." in f})
    return {"connector_ms": summary(connector), "tower_ms": summary(tower),
            "handoff_ms": summary([s["handoff"] for s in spent if "handoff" in s]),
            "connector_calls_ms_p50": {f.split(".", 1)[1]: pct([s.get(f, 0.0) for s in spent],
                                                                50) for f in calls}}


def run_paired(name: str, n: int, root: Path, pair: tuple[str, str] = PAIRED,
               urls: dict[str, str] | None = None, images: int = 1) -> dict:
    """Latencies of two variants paired per request (default: encache's defaults vs
    ECExample): both variants' encoder + PD servers up at once (encoders on one core, PDs
    on the other), every request sent to both, the order alternating per request and
    ``SETTLE_S`` of quiet before each request pair, so both see the same machine; the
    figure is the median per-request ratio, first / second. Inside the servers, each
    request's time in the connector's calls and in the vision tower is measured too
    (``epd_probe``): what the connector itself costs, apart from how fast each server
    process happens to run the same model. ``urls``: the Redis servers' (``SHARED``);
    ``images``: new images per request (a step's loads of several entries)."""
    from served_support import draw_images

    _, _, tokens, max_len = SIZES[name]
    if images > 1:
        max_len = tokens * images + 128
    model = model_for(name)
    work = root / f"paired-{name}"
    imgs = draw_images(work / "img", {**{f"p{k}-{j}": (170 + 3 * k, 140 + k + 41 * j)
                                         for k in range(n) for j in range(images)},
                                      "warm": (150, 150)}, seed=47)
    servers = {}
    windows = {k: {"e": [], "pd": []} for k in pair}
    try:
        for kind in pair:  # empty stores: every image is new to both
            store = (f"{urls[SHARED[kind]]}?prefix=paired-{name}-{kind}:" if kind in SHARED
                     else str(work / f"store-{kind}"))
            cfg = configs(kind, store)
            servers[kind] = tuple(_start_timed(model, cfg[role], work, f"{kind}-{role}", max_len,
                                               images)
                                  for role in ("ec_producer", "ec_consumer"))
        for e, pd in servers.values():
            e.wait_ready()
            pd.wait_ready()
        for e, pd in servers.values():  # first requests pay one-time costs
            for _ in range(2):
                warm = bodies(model, imgs["warm"])
                post(e.base, warm[0])
                post(pd.base, warm[1])
        res = {k: {"encoder_s": [], "pd_s": [], "pd_tower_idle": 0} for k in pair}
        runs0 = {k: servers[k][0].encoder_log.count() for k in pair}
        for k in range(n):
            enc_body, full = bodies(model, [imgs[f"p{k}-{j}"] for j in range(images)])
            for kind in (pair if k % 2 == 0 else pair[::-1]):
                e, pd = servers[kind]
                time.sleep(SETTLE_S)
                before = pd.encoder_log.count()
                t0 = time.perf_counter()
                res[kind]["encoder_s"].append(post(e.base, enc_body))
                t1 = time.perf_counter()
                res[kind]["pd_s"].append(post(pd.base, full))
                windows[kind]["e"].append((t0, t1))
                windows[kind]["pd"].append((t1, time.perf_counter()))
                res[kind]["pd_tower_idle"] += pd.encoder_log.count() == before
    finally:
        for both in servers.values():
            for s in both:
                s.stop()
    out = {"pair": list(pair), "requests": n, "images_per_request": images,
           "order": "alternating per request", "settle_s": SETTLE_S}
    for kind in pair:
        r = res[kind]
        e, pd = servers[kind]
        out[kind] = {"pd_hit_ratio": r["pd_tower_idle"] / n,
                     "encoder_tower_runs": e.encoder_log.count() - runs0[kind],
                     "encoder_ms": summary(r["encoder_s"], 1e3),
                     "pd_ttft_ms": summary(r["pd_s"], 1e3),
                     "inside_encoder": _split(_calls_within(e, windows[kind]["e"])),
                     "inside_pd": _split(_calls_within(pd, windows[kind]["pd"]))}
    a, b = res[pair[0]], res[pair[1]]
    for key in ("encoder_s", "pd_s"):
        ratios = [x / y for x, y in zip(a[key], b[key])]
        out[f"{key[:-2]}_ratio"] = {  # first / second per request: < 1 is the first faster
            **{q: pct(ratios, p) for q, p in (("p25", 25), ("p50", 50), ("p75", 75))},
            "first_faster": sum(x < 1 for x in ratios), "of": n}
    return out


def report(results: dict) -> str:
    parts = []
    rows = []
    for r in results["sizes"]:
        for phase in ("online", "mixed") if "online" in r else ():
            for k in VARIANTS:
                v = r[phase][k]
                rows.append([r["size"], phase, k, f"{v['pd_hit_ratio']:.2f}",
                             f"{v['encoder_ms']['p50']:.1f} / {v['encoder_ms']['p99']:.1f}",
                             f"{v['pd_ttft_ms']['p50']:.1f} / {v['pd_ttft_ms']['p99']:.1f}",
                             str(v["encoder_tower_runs"])])
    if rows:
        parts.append("one pair at a time\n" + table(
            rows, ["size", "workload", "connector", "PD hits", "encoder ms p50/p99",
                   "PD TTFT ms p50/p99", "encoder tower runs"]))
    rows = []
    for r in results["sizes"]:
        if "paired" not in r:
            continue
        v = r["paired"]
        first, second = v["pair"]
        for key, ms in (("encoder_ratio", "encoder_ms"), ("pd_ratio", "pd_ttft_ms")):
            q = v[key]
            rows.append([r["size"], ms.split("_")[0], f"{v[first][ms]['p50']:.1f}",
                         f"{v[second][ms]['p50']:.1f}",
                         f"{q['p50']:.3f} ({q['p25']:.3f}-{q['p75']:.3f})",
                         f"{q['first_faster']}/{q['of']}",
                         f"{v[first]['pd_hit_ratio']:.2f} / {v[second]['pd_hit_ratio']:.2f}"])
    if rows:
        parts.append(f"paired per request ({first} vs {second}), both pairs up, order "
                     "alternating\n" + table(
                         rows, ["size", "latency", "first ms p50", "second ms p50",
                                "first/second per request p50 (p25-p75)", "first faster",
                                "PD hits (first / second)"]))
    rows = []
    for r in results["sizes"]:
        v = r.get("paired")
        for side, label in (("inside_encoder", "encoder"), ("inside_pd", "PD")) if v else ():
            a, b = (v[k][side] for k in v["pair"])
            rows.append([r["size"], label,
                         f"{a['connector_ms']['p50']:.2f} / {a['connector_ms']['p99']:.2f}",
                         f"{b['connector_ms']['p50']:.2f} / {b['connector_ms']['p99']:.2f}",
                         f"{a['handoff_ms'].get('p50', 0):.2f} / "
                         f"{b['handoff_ms'].get('p50', 0):.2f}",
                         f"{a['tower_ms']['p50']:.1f} / {b['tower_ms']['p50']:.1f}"])
    if rows:
        parts.append("inside the servers, per request (paired run), first vs second\n"
                     + table(rows, ["size", "server", "first connector ms p50/p99",
                                    "second connector ms p50/p99",
                                    "metadata hand-off ms p50",
                                    "tower + save_caches ms p50"]))
    rows = []
    for r in results["sizes"]:
        for k, v in r.get("producer_overhead_ms", {}).items():
            rows.append([r["size"], k, f"{v['p50']:.3f}", f"{v['p99']:.3f}"])
    if rows:
        parts.append("producer per-item write cost (in-process)\n" + table(
            rows, ["size", "step", "ms p50", "ms p99"]))
    return "\n\n".join(parts)


def plot(results: dict, filename: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq = [r for r in results["sizes"] if "online" in r]
    paired = [r for r in results["sizes"] if "paired" in r]
    panels = [(key, title) for key, title in (
        ("pd_hit_ratio", "PD hit ratio (online, one pair at a time)"),
        ("encoder_ms", "encoder latency p50, ms (online, one pair at a time)"),
        ("pd_ttft_ms", "PD time to first token p50, ms (one pair at a time)")) if seq]
    if paired:
        first, second = paired[0]["paired"]["pair"]
        panels.append(("paired", f"{first} / {second} per request, paired\n(median, p25-p75)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.4 * len(panels), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        if key == "paired":
            labels = [r["size"] for r in paired]
            for j, (rk, name) in enumerate((("encoder_ratio", "encoder latency"),
                                            ("pd_ratio", "PD time to first token"))):
                qs = [r["paired"][rk] for r in paired]
                xs = [i + (j - 0.5) * 0.35 for i in range(len(labels))]
                ax.bar(xs, [q["p50"] for q in qs], width=0.35, label=name,
                       yerr=[[q["p50"] - q["p25"] for q in qs],
                             [q["p75"] - q["p50"] for q in qs]], capsize=4)
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xticks(range(len(labels)), labels)
        else:
            width = 0.8 / len(VARIANTS)
            for j, k in enumerate(VARIANTS):
                vals = [r["online"][k][key] if key == "pd_hit_ratio"
                        else r["online"][k][key]["p50"] for r in seq]
                off = (j - (len(VARIANTS) - 1) / 2) * width
                ax.bar([i + off for i in range(len(seq))], vals, width=width, label=k)
            ax.set_xticks(range(len(seq)), [r["size"] for r in seq])
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("EPD on one CPU host: encoder -> store -> PD (scripts/bench/epd_bench.py)")
    fig.tight_layout()
    fig.savefig(ROOT / "benchmarks" / filename, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=12, help="images per workload and size")
    p.add_argument("--sizes", default="small,gemma,crops")
    p.add_argument("--sections", default="sequential,paired",
                   help="sequential: every variant, one pair at a time; paired: encache vs "
                        "ECExample (--pair), both pairs up, per request")
    p.add_argument("--paired-requests", type=int, default=24, help="images per size, paired")
    p.add_argument("--pair", default=",".join(PAIRED),
                   help=f"the paired section's two variants, first,second (of {', '.join(KINDS)})")
    p.add_argument("--images", type=int, default=1, help="new images per request, paired")
    p.add_argument("--out", default="epd")
    a = p.parse_args(argv)
    sections = set(a.sections.split(","))
    if not sections or sections - {"sequential", "paired"}:
        p.error(f"--sections: sequential and/or paired, not {a.sections!r}")
    pair = tuple(a.pair.split(","))
    if len(pair) != 2 or set(pair) - set(KINDS) or pair[0] == pair[1]:
        p.error(f"--pair: two different variants of {', '.join(KINDS)}, not {a.pair!r}")
    set_engine_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # servers as users run them
    code0 = code_state()
    root = Path(tempfile.mkdtemp(prefix="epd-bench-", dir=ROOT / ".venv"))
    from redis_cluster_fixture import LocalCluster
    from redis_fixture import RedisServer
    redis = cluster = None  # the servers of the variants on Redis / Redis Cluster
    results = {"benchmark": "epd", "machine": machine(),
               "params": {"requests": a.requests, "sizes": a.sizes, "code": code0,
                          "sections": a.sections, "paired_requests": a.paired_requests,
                          "pair": list(pair), "images_per_request": a.images,
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
        urls = {}
        servers = set(SHARED.values()) if "sequential" in sections else (
            {SHARED[k] for k in pair if k in SHARED} if "paired" in sections else set())
        if "redis" in servers:
            redis = RedisServer(password="epd-bench")
            urls["redis"] = redis.url_for(db=0)
        if "cluster" in servers:
            cluster = LocalCluster(3, 1)
            urls["cluster"] = cluster.url_for(nodes=6)
        for name in a.sizes.split(","):
            entry = ({"size": SIZES[name][0]} if "sequential" not in sections
                     else run_size(name, a.requests, root, urls))
            if "paired" in sections:
                entry["paired"] = run_paired(name, a.paired_requests, root, pair, urls,
                                             a.images)
            results["sizes"].append(entry)
            print(f"[epd] {name} done", file=sys.stderr)
    finally:
        for server in (cluster, redis):
            if server is not None:
                server.stop()
        shutil.rmtree(root, ignore_errors=True)
    finish_run(results, a.out, code0, plot)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
