"""Benchmarks 3 and 4 from the per-model engine runs: JSON, plots and summary tables.

Pure data handling (no torch, no vLLM): ``serving_engine.run_model`` produced the numbers.
"""

from __future__ import annotations

from serving_common import BENCH_DIR, ratio, table

CONFIG_LABELS = {"none": "no connector (encode)", "ecexample": "ECExampleConnector",
                 "encache": "EncacheConnector"}
COLORS = {"none": "#7f7f7f", "ecexample": "#d62728", "encache": "#1f77b4"}
MODEL_LABELS = {"tiny": "tiny (16x64 F32, 4 KiB)",
                "siglip-base": "SigLIP-base tower (196x64 F32, 49 KiB)",
                "siglip-base-wide": "SigLIP-base tower + 2048-wide LM (196x2048 F32, 1.5 MiB)"}


def _g(d: dict, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


# -- benchmark 3: per-step worker block time, latency, throughput --------------------------------

def engine_rows(models: dict) -> list[dict]:
    rows = []
    for kind, m in models.items():
        for cfg, c in m["configs"].items():
            for phase in ("sequential", "batch", "sequential_cold", "batch_cold"):
                p = c.get(phase)
                if not p:
                    continue
                rows.append({
                    "model": kind, "entry_bytes": m["entry_bytes"], "config": cfg, "phase": phase,
                    "requests": p["requests"],
                    "latency_p50_ms": _g(p, "latency_ms", "p50"),
                    "e2e_p50_ms": _g(p, "e2e_ms", "p50"),
                    "ttft_p50_ms": _g(p, "ttft_ms", "p50"),
                    "throughput_req_s": p.get("throughput_req_s"),
                    "wall_s": p.get("wall_s"),
                    "engine_steps": p["engine_steps"],
                    "step_p50_ms": _g(p, "step_ms", "p50"), "step_p99_ms": _g(p, "step_ms", "p99"),
                    "loading_steps": p["load_calls_with_items"], "loaded_items": p["loaded_items"],
                    "block_p50_ms": _g(p, "block_ms_per_loading_step", "p50"),
                    "block_p99_ms": _g(p, "block_ms_per_loading_step", "p99"),
                    "block_max_ms": _g(p, "block_ms_per_loading_step", "max"),
                    "block_call_only_p50_ms": _g(p, "block_call_only_ms_per_loading_step", "p50"),
                    "block_per_item_ms": p["block_ms_per_item"],
                    "block_total_ms": p["block_total_ms"],
                    "block_share_of_step_time": ratio(p["block_total_ms"] / 1e3, p["step_total_s"]),
                    "encoder_items": p["encoder_items"],
                    "encoder_ms_per_item": p["encoder_ms_per_item"],
                    "staged_load_p50_ms": _g(p, "staged_load_ms", "p50"),
                })
    return rows


def engine_ratios(models: dict) -> dict:
    """encache vs ECExample (and vs encoding) per model and phase."""
    out = {}
    for kind, m in models.items():
        c = m["configs"]
        per = {}
        for phase in ("sequential", "batch", "sequential_cold", "batch_cold"):
            ex, en, no = (_g(c, k, phase) for k in ("ecexample", "encache", "none"))
            base = phase.replace("_cold", "")
            no = no or _g(c, "none", base)
            r = {}
            if ex and en:
                r["block_per_loading_step_p50_ecexample_over_encache"] = ratio(
                    _g(ex, "block_ms_per_loading_step", "p50"),
                    _g(en, "block_ms_per_loading_step", "p50"))
                r["block_total_ecexample_over_encache"] = ratio(ex["block_total_ms"],
                                                                en["block_total_ms"])
                if phase.startswith("batch"):
                    r["throughput_encache_over_ecexample"] = ratio(en["throughput_req_s"],
                                                                   ex["throughput_req_s"])
                else:
                    r["latency_p50_ecexample_over_encache"] = ratio(
                        _g(ex, "latency_ms", "p50"), _g(en, "latency_ms", "p50"))
            if no and en:
                if phase.startswith("batch"):
                    r["throughput_encache_over_none"] = ratio(en["throughput_req_s"],
                                                              no["throughput_req_s"])
                else:
                    r["latency_p50_none_over_encache"] = ratio(_g(no, "latency_ms", "p50"),
                                                               _g(en, "latency_ms", "p50"))
            if r:
                per[phase] = r
        out[kind] = per
    return out


def engine_report(data: dict) -> str:
    rows = []
    for r in data["rows"]:
        share = r["block_share_of_step_time"]
        rows.append([f"{r['model']} / {r['config']}", r["phase"], r["requests"],
                     r["latency_p50_ms"] if r["phase"].startswith("seq") else r["e2e_p50_ms"],
                     r["throughput_req_s"] if r["phase"].startswith("batch")
                     else (r["requests"] / r["wall_s"] if r["wall_s"] else None),
                     r["loading_steps"], r["block_p50_ms"], r["block_call_only_p50_ms"],
                     r["block_max_ms"], r["block_total_ms"],
                     None if share is None else f"{share * 100:.2f}%", r["encoder_items"]])
    p = data["params"]
    algos = sorted({m.get("checksum_algo", "?") for m in data["models"].values()})
    head = ("Engine: per-step worker block time (start_load_caches, incl. page fault-in of its "
            f"tensors; 'call' = the call alone), latency, throughput — torch threads "
            f"{p['torch_threads']}, connector configs x{p.get('reps', 1)} (pooled); "
            "lat = per request one at a time (sequential) / queued->last token (batch); "
            f"entry checksums: {', '.join(algos)}")
    lines = [head, table(rows, [
        "model / config", "phase", "req", "lat p50 ms", "req/s", "load steps",
        "block p50 ms", "call p50 ms", "block max ms", "block tot ms", "of step time",
        "encoded"])]
    for kind, per in data.get("ratios", {}).items():
        parts = []
        for phase in ("batch", "batch_cold"):
            r = per.get(phase, {})
            a = r.get("block_per_loading_step_p50_ecexample_over_encache")
            b = r.get("block_total_ecexample_over_encache")
            t = r.get("throughput_encache_over_ecexample")
            n = r.get("throughput_encache_over_none")
            if a is not None:
                parts.append(f"{phase}: ECExample blocks {a:.1f}x longer per loading step "
                             f"({b:.1f}x in total); encache throughput {t:.2f}x ECExample"
                             + (f", {n:.2f}x no-cache" if n else ""))
            elif n is not None:
                parts.append(f"{phase}: encache throughput {n:.2f}x no-cache")
        if parts:
            lines.append(f"  {kind}: " + "; ".join(parts))
    return "\n".join(lines)


def plot_engine(data: dict, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(data["models"])
    both = [m for m in models if {"ecexample", "encache"} <= set(data["models"][m]["configs"])]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    # (a) block time per loading step
    ax = axes[0]
    groups = [(m, ph) for m in both for ph in ("batch", "batch_cold")]
    w = 0.38
    for k, cfg in enumerate(("ecexample", "encache")):
        vals, lo, hi = [], [], []
        for m, ph in groups:
            p = _g(data["models"][m], "configs", cfg, ph) or {}
            s = p.get("block_ms_per_loading_step", {})
            v = s.get("p50") or 0
            vals.append(v)
            lo.append(max(0, v - (s.get("p10") or v)))
            hi.append(max(0, (s.get("p90") or v) - v))
        xs = [i + (k - 0.5) * w for i in range(len(groups))]
        ax.bar(xs, vals, w, yerr=[lo, hi], capsize=2, color=COLORS[cfg], label=CONFIG_LABELS[cfg])
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.2g}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{'cold' if ph.endswith('cold') else 'warm'}" for m, ph in groups],
                       fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms blocked in the worker per step that loads (p50; p10–p90)")
    ax.set_title("(a) worker start_load_caches per loading step", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3, which="both")
    # (b) sequential latency
    ax = axes[1]
    cfgs = ("none", "ecexample", "encache")
    w = 0.8 / 3
    for k, cfg in enumerate(cfgs):
        vals = [_g(data["models"][m], "configs", cfg, "sequential", "latency_ms", "p50")
                for m in models]
        xs = [i + (k - 1) * w for i in range(len(models))]
        pts = [(x, v) for x, v in zip(xs, vals) if v]
        ax.bar([x for x, _ in pts], [v for _, v in pts], w, color=COLORS[cfg],
               label=CONFIG_LABELS[cfg])
        for x, v in pts:
            ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per request, one at a time (p50)")
    ax.set_title("(b) request latency (warm page cache)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3, which="both")
    # (c) batch throughput
    ax = axes[2]
    groups = [(m, ph) for m in both for ph in ("batch", "batch_cold")]
    for k, cfg in enumerate(cfgs):
        vals = []
        for m, ph in groups:
            p = _g(data["models"][m], "configs", cfg, ph)
            if p is None and cfg == "none":
                p = _g(data["models"][m], "configs", cfg, "batch")
            vals.append((p or {}).get("throughput_req_s") or 0)
        xs = [i + (k - 1) * w for i in range(len(groups))]
        ax.bar(xs, vals, w, color=COLORS[cfg], label=CONFIG_LABELS[cfg])
        for x, v in zip(xs, vals):
            ax.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{'cold' if ph.endswith('cold') else 'warm'}" for m, ph in groups],
                       fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel(f"requests/s ({data['params']['batch']} submitted at once)")
    ax.set_title("(c) batch throughput", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3, which="both")
    mach = data["machine"]
    fig.suptitle(f"Benchmark 3 — real vLLM {mach.get('vllm', '')} CPU engine, consumer of cached "
                 f"encoder outputs ({mach['cpus']} CPUs, torch threads "
                 f"{data['params']['torch_threads']}, loadavg {mach['loadavg_start'][0]})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(BENCH_DIR / name, dpi=110)
    plt.close(fig)


# -- benchmark 4: encoder time vs load time per image ----------------------------------------

def encoder_rows(models: dict) -> list[dict]:
    rows = []
    for kind, m in models.items():
        c = m["configs"]
        enc_seq = _g(c, "none", "sequential", "encoder_ms_per_item")
        enc_batch = _g(c, "none", "batch", "encoder_ms_per_item")
        load_bg = _g(c, "encache", "sequential", "staged_load_ms", "p50")
        load_bg_cold = _g(c, "encache", "sequential_cold", "staged_load_ms", "p50")
        load_direct = _g(m, "direct_load_ms", "encache", "p50")
        load_direct_v = _g(m, "direct_load_ms", "encache_verified", "p50")
        ex_direct = _g(m, "direct_load_ms", "ecexample", "p50")
        block_en = _g(c, "encache", "sequential", "block_ms_per_item")
        block_ex = _g(c, "ecexample", "sequential", "block_ms_per_item")
        block_ex_cold = _g(c, "ecexample", "sequential_cold", "block_ms_per_item")
        lat_none = _g(c, "none", "sequential", "latency_ms", "p50")
        lat_en = _g(c, "encache", "sequential", "latency_ms", "p50")
        lat_ex = _g(c, "ecexample", "sequential", "latency_ms", "p50")
        rows.append({
            "model": kind, "model_info": m["model_info"], "entry_shape": m["entry_shape"],
            "entry_bytes": m["entry_bytes"], "torch_threads": m.get("torch_threads"),
            "encoder_ms_per_image": enc_seq, "encoder_ms_per_image_batched": enc_batch,
            "encache_load_ms_direct": load_direct, "encache_load_ms_direct_verified_version": load_direct_v,
            "encache_load_ms_in_engine": load_bg, "encache_load_ms_in_engine_cold": load_bg_cold,
            "encache_worker_block_ms_per_image": block_en,
            "ecexample_load_ms_direct": ex_direct,
            "ecexample_worker_block_ms_per_image": block_ex,
            "ecexample_worker_block_ms_per_image_cold": block_ex_cold,
            "encoder_over_encache_load": ratio(enc_seq, load_bg),
            "step_time_saved_ms_per_image": (enc_seq - block_en)
            if enc_seq is not None and block_en is not None else None,
            "cpu_time_saved_ms_per_image": (enc_seq - load_bg - block_en)
            if None not in (enc_seq, load_bg, block_en) else None,
            "latency_p50_ms": {"none": lat_none, "ecexample": lat_ex, "encache": lat_en},
            "latency_saved_ms_per_request": (lat_none - lat_en)
            if lat_none is not None and lat_en is not None else None,
        })
    return rows


def encoder_report(data: dict) -> str:
    rows = [[r["model"], r["entry_bytes"] / 1024, r["encoder_ms_per_image"],
             r["encoder_ms_per_image_batched"], r["encache_load_ms_direct"],
             r["encache_load_ms_in_engine"], r["encache_load_ms_in_engine_cold"],
             r["encache_worker_block_ms_per_image"], r["encoder_over_encache_load"],
             r["step_time_saved_ms_per_image"], r["latency_p50_ms"]["none"],
             r["latency_p50_ms"]["encache"]] for r in data["rows"]]
    return "\n".join([
        "Encoder time vs encache load time per image (ms; encoder = embed_multimodal, "
        "1 image per call / batched; load = read + checksum verify)",
        table(rows, ["model", "entry KiB", "encode", "encode(b)", "load", "load(eng)",
                     "load(cold)", "worker", "enc/load", "saved/img", "lat none",
                     "lat encache"])])


def plot_encoder(data: dict, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    series = [("encoder_ms_per_image", "vision encoder (embed_multimodal), 1 image/call", "#7f7f7f"),
              ("encache_load_ms_in_engine", "encache load in the engine (background read+verify)",
               "#1f77b4"),
              ("encache_load_ms_in_engine_cold", "… from a cold page cache", "#9ecae1"),
              ("encache_worker_block_ms_per_image", "encache worker block (frombuffer)", "#17becf"),
              ("ecexample_worker_block_ms_per_image", "ECExample worker block (warm)", "#d62728"),
              ("ecexample_worker_block_ms_per_image_cold", "ECExample worker block (cold)",
               "#ff9896")]
    fig, ax = plt.subplots(figsize=(11, 5.2))
    w = 0.8 / len(series)
    for k, (key, lab, col) in enumerate(series):
        vals = [r.get(key) or 0 for r in rows]
        xs = [i + (k - len(series) / 2 + 0.5) * w for i in range(len(rows))]
        ax.bar(xs, vals, w, color=col, label=lab)
        for x, v in zip(xs, vals):
            if v:
                ax.text(x, v, f"{v:.0f}" if v >= 100 else f"{v:.2g}", ha="center",
                        va="bottom", fontsize=6)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([MODEL_LABELS.get(r["model"], r["model"]).replace(" (", "\n(")
                        for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per image (median)")
    mach = data["machine"]
    ax.set_title(f"Benchmark 4 — encoder vs load per image on this CPU ({mach['cpus']} CPUs, "
                 f"torch threads {data['params']['torch_threads']}, loadavg "
                 f"{mach['loadavg_start'][0]})", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(BENCH_DIR / name, dpi=110)
    plt.close(fig)

