"""Serving benchmarks for encache's connectors against vLLM's ECExampleConnector.

    scripts/bench/serving [--quick] [--only load,lookup,engine] [--threads 1]

  1. load     load throughput of one entry (0.25 / 2.75 / 10 MB fp16): memcpy limit,
              encache disk (mapped + verified version, first load, read mode, verify always) /
              Redis (verify on and off), ECExampleConnector
              -> benchmarks/serving_load.{json,png}            (serving_load.py)
  2. lookup   has_cache_item latency on real scheduler-side connectors
              -> benchmarks/serving_lookup.{json,png}          (serving_lookup.py)
  3. engine   a real CPU vLLM consumer engine per configuration (no connector /
              ECExampleConnector / EncacheConnector): per-step worker block time,
              request latency, batch throughput, warm and cold page cache
              -> benchmarks/serving_engine.{json,png}          (serving_engine.py)
  4.          from the same runs: vision-encoder time vs encache load time per image
              -> benchmarks/serving_encoder.{json,png}

Every part runs in its own process (engines: one process per model, configurations one
after another, each engine shut down before the next). ``benchmarks/serving_summary.json``
keeps the headline numbers and the wall time of the run. The machine is described in
every JSON (CPU, load average before/after: a shared machine makes timings noisy).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from serving_common import (BENCH_DIR, ENGINE_ENV, ROOT, code_changed,  # noqa: E402
                            code_state, loadavg, machine, write_json)

PARTS = ("load", "lookup", "engine")
FULL = {"load": {"rounds": 7, "cold_rounds": 2, "target_mb": 64},
        "lookup": {"entries": 1000, "rounds": 20},
        "engine": {"models": ["tiny", "siglip-base", "siglip-base-wide"], "warmup": 4,
                   "sequential": 8, "batch": 32, "max_tokens": 8, "reps": 2}}
QUICK = {"load": {"rounds": 3, "cold_rounds": 1, "target_mb": 24},
         "lookup": {"entries": 300, "rounds": 5},
         "engine": {"models": ["tiny", "siglip-base-wide"], "warmup": 2, "sequential": 4,
                    "batch": 16, "max_tokens": 8, "reps": 1}}
CONFIGS = ["none", "ecexample", "encache"]
# the stock SigLIP-base build (64-wide LM) is there for benchmark 4 (encoder vs load time):
# ECExampleConnector and repetitions add nothing to that, and cost a minute
MODEL_CONFIGS = {"siglip-base": (["none", "encache"], 1)}


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(ENGINE_ENV)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT / "scripts"), str(ROOT / "tests"),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_child(argv: list[str], log: Path, env: dict) -> None:
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, *argv], stdout=f, stderr=subprocess.STDOUT,
                              env=env, cwd=str(ROOT))
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(f"benchmark step failed ({' '.join(argv[:3])}), exit "
                         f"{proc.returncode}; log {log}:\n" + "\n".join(tail))
    print(f"  done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)


def part_engine_model(a) -> int:
    """Child process: one model, every configuration (imports vLLM)."""
    import serving_engine
    serving_engine.run_model(a.model, a.configs.split(","), a.warmup, a.sequential, a.batch,
                             a.max_tokens, a.workdir, a.json, cold=not a.no_cold,
                             reps=a.reps or 1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer rounds/images, one repetition, no stock SigLIP-base run "
                        "(~3 min instead of ~7.5 on a 2-vCPU VM)")
    p.add_argument("--only", default=",".join(PARTS), help="comma list of: " + ", ".join(PARTS))
    p.add_argument("--threads", type=int, default=1,
                   help="torch/OpenMP threads of the engines (default 1: on a shared 2-core "
                        "machine 2 OpenMP threads stall each other at every barrier)")
    p.add_argument("--models", help="engine models (comma list of tiny, siglip-base, "
                                    "siglip-base-wide)")
    p.add_argument("--tmp", help="work directory (default: a new temp dir, removed after)")
    # internal: a child process running one engine model
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--configs", default=",".join(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, help=argparse.SUPPRESS)
    p.add_argument("--sequential", type=int, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--max-tokens", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--no-cold", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=None,
                   help="engine repetitions of each connector configuration (default 2; "
                        "--quick 1)")
    a = p.parse_args(argv)
    if a.part == "engine-model":
        return part_engine_model(a)

    parts = [x.strip() for x in a.only.split(",") if x.strip()]
    bad = set(parts) - set(PARTS)
    if bad:
        p.error(f"unknown part(s) {sorted(bad)}; choose from {PARTS}")
    conf = QUICK if a.quick else FULL
    started = time.perf_counter()
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    tmp = Path(a.tmp or tempfile.mkdtemp(prefix="encache-bench-serving-"))
    tmp.mkdir(parents=True, exist_ok=True)
    env = child_env(a.threads)
    timings = {}
    summary = {"mode": "quick" if a.quick else "full", "parts": parts, "threads": a.threads,
               "machine": machine(), "code": code_state()}
    try:
        if "load" in parts:
            c = conf["load"]
            print("[1/3] load throughput ...", file=sys.stderr, flush=True)
            t = time.perf_counter()
            run_child([str(HERE / "serving_load.py"), "--rounds", str(c["rounds"]),
                       "--cold-rounds", str(c["cold_rounds"]), "--target-mb", str(c["target_mb"])],
                      tmp / "load.log", env)
            timings["load"] = time.perf_counter() - t
        if "lookup" in parts:
            c = conf["lookup"]
            print("[2/3] has_cache_item latency ...", file=sys.stderr, flush=True)
            t = time.perf_counter()
            run_child([str(HERE / "serving_lookup.py"), "--entries", str(c["entries"]),
                       "--rounds", str(c["rounds"])], tmp / "lookup.log", env)
            timings["lookup"] = time.perf_counter() - t
        if "engine" in parts:
            c = dict(conf["engine"])
            if a.reps:
                c["reps"] = a.reps
            if a.models:
                c["models"] = [m.strip() for m in a.models.split(",") if m.strip()]
            t = time.perf_counter()
            _prebuild(c["models"], tmp, env)
            code0 = code_state()
            models = {}
            for kind in c["models"]:
                cfgs, reps = MODEL_CONFIGS.get(kind, (CONFIGS, c["reps"]))
                reps = min(reps, c["reps"])
                print(f"[3/3] engine: {kind} ({', '.join(cfgs)}; connectors x{reps}) ...",
                      file=sys.stderr, flush=True)
                out = tmp / f"engine-{kind}.json"
                run_child([str(HERE / "serving_bench.py"), "--part", "engine-model",
                           "--model", kind, "--configs", ",".join(cfgs), "--reps", str(reps),
                           "--warmup", str(c["warmup"]), "--sequential", str(c["sequential"]),
                           "--batch", str(c["batch"]), "--max-tokens", str(c["max_tokens"]),
                           "--workdir", str(tmp / f"work-{kind}"), "--json", str(out)],
                          tmp / f"engine-{kind}.log", env)
                models[kind] = json.loads(out.read_text())
            timings["engine"] = time.perf_counter() - t
            _write_engine(models, c, a.threads, code0)
    finally:
        if not a.tmp:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    timings["total"] = time.perf_counter() - started
    summary["runtime_s"] = timings
    summary["machine"]["loadavg_end"] = loadavg()
    summary["headline"] = headline(parts)
    code_changed(summary["code"], summary)
    write_json("serving_summary.json", summary)
    print(report(parts))
    print(f"\nwall time: {timings['total']:.0f} s ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items() if k != "total")
          + f"); loadavg {summary['machine']['loadavg_start']} -> {loadavg()}")
    return 0


def _prebuild(models: list[str], tmp: Path, env: dict) -> None:
    from serving_models import SPECS, model_path
    missing = [m for m in models if not (model_path(m) / "config.json").exists()
               or (m != "tiny" and not (model_path(m) / "encache_bench_model.json").exists())]
    for m in missing:
        assert m in SPECS, m
        print(f"  building model {m} (once, into {model_path(m)}) ...", file=sys.stderr, flush=True)
        run_child([str(HERE / "serving_models.py"), m], tmp / f"build-{m}.log", env)


def _write_engine(models: dict, conf: dict, threads: int, code0: dict) -> None:
    import serving_results as sr
    mach = machine()
    mach["loadavg_start"] = min((m["configs"][c]["loadavg_start"] for m in models.values()
                                 for c in m["configs"]), key=lambda x: x[0], default=[])
    params = {**conf, "configs": CONFIGS, "torch_threads": threads, "code": code0,
              "page_cache": "warm phases: entries written just before (in the page cache); "
                            "cold phases: posix_fadvise(DONTNEED) on every entry file first"}
    code_changed(code0, params)
    engine = {"benchmark": "per-step worker block time, latency, throughput (issues #4, #5)",
              "machine": mach, "params": params, "models": models,
              "rows": sr.engine_rows(models), "ratios": sr.engine_ratios(models)}
    write_json("serving_engine.json", engine)
    sr.plot_engine(engine, "serving_engine.png")
    enc = {"benchmark": "encoder time vs load time per image (issue #4)", "machine": mach,
           "params": params, "rows": sr.encoder_rows(models)}
    write_json("serving_encoder.json", enc)
    sr.plot_encoder(enc, "serving_encoder.png")


def _load(name: str) -> dict | None:
    path = BENCH_DIR / name
    return json.loads(path.read_text()) if path.exists() else None


def report(parts: list[str]) -> str:
    out = []
    if (d := _load("serving_summary.json")) and d.get("code"):
        c = d["code"]
        out.append(f"Measured encache code: commit {c.get('commit')}"
                   + (f" + uncommitted changes in {', '.join(c['dirty'])}" if c.get("dirty")
                      else "") + (" (CHANGED DURING THE RUN: rerun)" if d.get("code_changed")
                                  else ""))
    if "load" in parts and (d := _load("serving_load.json")):
        import serving_load
        out += ["", serving_load.report(d)]
    if "lookup" in parts and (d := _load("serving_lookup.json")):
        import serving_lookup
        out += ["", serving_lookup.report(d)]
    if "engine" in parts and (d := _load("serving_engine.json")):
        import serving_results as sr
        out += ["", sr.engine_report(d)]
        if (e := _load("serving_encoder.json")):
            out += ["", sr.encoder_report(e)]
    return "\n".join(out)


def headline(parts: list[str]) -> dict:
    """The numbers to quote, straight from this run's JSON files."""
    h = {}
    if "load" in parts and (d := _load("serving_load.json")):
        for row in d["sizes"]:
            m, r = row["methods"], row["ratios"]
            h[f"load {row['label']}"] = {
                "memcpy_pagecache_mb_s": m["memcpy.pagecache"]["mb_s"],
                "encache_disk_mb_s": m["encache.disk"]["mb_s"],
                "encache_disk_first_mb_s": m["encache.disk.first"]["mb_s"],
                "encache_disk_read_mb_s": m["encache.disk.read"]["mb_s"],
                "encache_redis_mb_s": m["encache.redis"]["mb_s"],
                "ecexample_mb_s": m["ecexample.disk"]["mb_s"],
                "encache_disk_x_memcpy": r["encache.disk"]["vs_memcpy_pagecache"],
                "encache_disk_first_x_memcpy": r["encache.disk.first"]["vs_memcpy_pagecache"],
                "encache_disk_read_x_memcpy": r["encache.disk.read"]["vs_memcpy_pagecache"],
                "encache_disk_x_ecexample": r["encache.disk"]["vs_ecexample"],
                "cold_encache_disk_x_ecexample": (row.get("cold") or {}).get("ratios", {})
                .get("encache.disk", {}).get("vs_ecexample"),
            }
    if "lookup" in parts and (d := _load("serving_lookup.json")):
        h["has_cache_item_us_p50_p99"] = {k: [v["us"]["p50"], v["us"]["p99"]]
                                          for k, v in d["cases"].items()}
    if "engine" in parts and (d := _load("serving_engine.json")):
        h["engine_ratios"] = d["ratios"]
        h["block_p50_ms_per_loading_step"] = {
            f"{r['model']}/{r['config']}/{r['phase']}": r["block_p50_ms"]
            for r in d["rows"] if r["config"] != "none"}
    if "engine" in parts and (d := _load("serving_encoder.json")):
        h["encoder_vs_load_ms"] = {r["model"]: {
            "encode": r["encoder_ms_per_image"], "encache_load": r["encache_load_ms_in_engine"],
            "encache_worker": r["encache_worker_block_ms_per_image"],
            "ratio": r["encoder_over_encache_load"]} for r in d["rows"]}
    return h


if __name__ == "__main__":
    sys.exit(main())
