"""The GPU path measured: a cached load onto the device against the encoder it replaces.

Runs where vLLM is not installed (the device-copy and lookup code import no vLLM): a GPU
machine with torch, transformers, safetensors and numpy, plus encache and its small
dependencies (``scripts/bench/gpu`` installs them). For bf16 entries of 0.25 / 2.75 / 11
MB (256 x 512; 256 x 5376, one Gemma 3 27B image; 1024 x 5376) on a local disk with a warm
page cache, timed per load up to the tensor on the device (``torch.cuda.synchronize``):

  bound             a page-locked host buffer copied to the device (no file): GB/s
  readinto          os.open + one readv of the file into a reused page-locked buffer,
                    then a non-blocking copy to the device (the floor of a file loader)
  safetensors       ``safetensors.torch.load_file(path, device="cuda")``: what vLLM's
                    ECExampleConnector does
  encache.first     a consumer's first load of a stored version: a new store and lookup
                    each round (``EntryLookup`` with ``HostStaging``, as a one-GPU engine's
                    scheduler builds it), read and checksummed in one pass into
                    page-locked staging, then the worker's device copy
                    (``DeviceCopier.load``)
  encache.first.pure  the same as an install without the C extension runs it (no
                    read-ahead helper thread: the load reads and checksums alone)
  encache.repeat    the same lookup's next load of that version (verified already: read
                    into staging, no checksum), then the device copy

and the encoder a hit replaces: a Gemma-3-sized SigLIP tower (896 px, patch 14, 27
layers, hidden 1152) and the Gemma 3 projector (4096 patches pooled to 256 tokens, then
1152 -> 5376), random weights in bf16, batch 1 and 8: ms per image, and encoder time over
load time at 2.75 MB. ``--tiny`` runs everything small on the CPU (the test of this
script's CPU parts).

Loads are interleaved (each step of a round loads one entry per method, in a new random
order) so that whatever else the machine does hits every method alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"0.25 MB": (256, 512), "2.75 MB": (256, 5376), "11 MB": (1024, 5376)}
WORKING_SET = 192 << 20  # bytes of entries per size (the page cache holds them all)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bf16_bytes(shape, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
    return t, t.view(torch.uint16).numpy().view(np.uint8).reshape(-1)


def build_entries(root: Path, shape, n: int, tag: str):
    """``n`` entries of ``shape`` in an encache disk store under ``root`` and the same
    tensors as safetensors files: (store path, ids, entry paths, safetensors paths,
    the first tensor)."""
    from safetensors.torch import save_file

    from encache.connectors.store import encode
    from encache.connectors.store.disk.store import DiskStore

    store = DiskStore(root / "encache", fsync=False)
    st_dir = root / "safetensors"
    st_dir.mkdir(parents=True, exist_ok=True)
    ids, paths, st_paths, first = [], [], [], None
    for i in range(n):
        ident = f"{tag}-{i:05d}"
        t, raw = _bf16_bytes(shape, hash((tag, i)) & 0xFFFF)
        store.put(ident, encode(ident, raw, "BF16", shape, model="bench"))
        p = st_dir / f"{ident}.safetensors"
        save_file({"ec_cache": t}, str(p))
        ids.append(ident)
        paths.append(str(store.entry_path(ident)))
        st_paths.append(str(p))
        if first is None:
            first = t
    store.close()
    for p in paths + st_paths:  # warm page cache
        with open(p, "rb") as f:
            while f.read(8 << 20):
                pass
    return root / "encache", ids, paths, st_paths, first


def measure_loads(root: Path, device: torch.device, rounds: int, scale: float, log) -> dict:
    from safetensors.torch import load_file

    from encache.connectors.lookup import EntryLookup
    from encache.connectors.store import read_ahead
    from encache.connectors.store.disk.store import DiskStore
    from encache.connectors.vllm.device_copy import DeviceCopier, HostStaging
    from encache.connectors.vllm.loads import LoadItem

    results = {}
    for label, shape in SIZES.items():
        shape = (max(1, int(shape[0] * scale)), max(1, int(shape[1] * scale)))
        nbytes = shape[0] * shape[1] * 2
        n = max(4, min(512, int(WORKING_SET * scale * scale) // nbytes))
        tag = label.split()[0].replace(".", "_")
        store_path, ids, paths, st_paths, first = build_entries(root / tag, shape, n, tag)
        log(f"{label}: {n} entries of {shape} bf16 ({nbytes / 1e6:.2f} MB)")

        # the bound: page-locked host memory to the device, no file
        pin = device.type == "cuda"
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for _ in range(3):
            dev.copy_(host, non_blocking=pin)
        _sync(device)
        reps = max(10, min(200, (1 << 30) // nbytes))
        t0 = time.perf_counter()
        for _ in range(reps):
            dev.copy_(host, non_blocking=pin)
        _sync(device)
        bound_s = (time.perf_counter() - t0) / reps

        file_size = os.path.getsize(paths[0])
        pinned_file = torch.empty(file_size, dtype=torch.uint8, pin_memory=pin)
        pinned_view = memoryview(pinned_file.numpy())
        dev_file = torch.empty(file_size, dtype=torch.uint8, device=device)

        def readinto(i):
            fd = os.open(paths[i], os.O_RDONLY)
            try:
                os.readv(fd, [pinned_view])
            finally:
                os.close(fd)
            dev_file.copy_(pinned_file, non_blocking=pin)
            return dev_file

        def safetensors(i):
            return load_file(st_paths[i], device=str(device))["ec_cache"]

        copier = DeviceCopier(device)
        lookups: dict = {}

        def new_lookup(key):
            old = lookups.pop(key, None)
            if old is not None:
                old.close()
            staging = HostStaging(device) if device.type == "cuda" else None
            lookups[key] = EntryLookup(
                DiskStore(store_path, fsync=False), counters_flush_s=3600, load_threads=1,
                index_refresh_s=3600, verify_ahead=False, verify_ahead_start_bytes=0,
                remember_verified=False, host_staging=staging)
            lookups[key].start_verify_done.wait(60)

        def encache_load(key):
            def fn(i):
                st = lookups[key].load_now(ids[i])
                if st is None:
                    raise RuntimeError(f"encache: {ids[i]} did not load")
                return copier.load(LoadItem(ids[i], st.blob, st.offset, st.meta.dtype,
                                            st.meta.shape))
            return fn

        def unbuilt(fn):  # as an install without the C extension runs it (no helper)
            def call(i):
                read_ahead.BUILT = False
                try:
                    return fn(i)
                finally:
                    read_ahead.BUILT = built
            return call

        built = read_ahead.BUILT
        methods = {"readinto": readinto, "safetensors": safetensors,
                   "encache.first": encache_load("first"),
                   "encache.first.pure": unbuilt(encache_load("first.pure")),
                   "encache.repeat": encache_load("repeat")}
        # correctness before timing: every method gives the stored tensor
        for key in ("first", "first.pure", "repeat"):
            new_lookup(key)
        want = first.to(device)
        for name, fn in methods.items():
            got = fn(0)
            _sync(device)
            if name == "readinto":
                got = got[file_size - nbytes:].view(torch.bfloat16).view(shape)
            if not torch.equal(got.view(torch.bfloat16).view(shape), want):
                raise SystemExit(f"gpu_bench: {name} loaded a different tensor at {label}")
        for i in range(n):  # the repeat lookup has verified every version once
            methods["encache.repeat"](i)
        _sync(device)

        times = {name: [] for name in methods}
        for _ in range(rounds):
            new_lookup("first")  # consumers that never saw these versions
            new_lookup("first.pure")
            order = list(range(n))
            random.shuffle(order)
            for step, i in enumerate(order):
                names = list(methods)
                random.shuffle(names)
                for name in names:
                    j = (i + names.index(name) * 7) % n  # another entry per method
                    t0 = time.perf_counter()
                    methods[name](j)
                    _sync(device)
                    times[name].append(time.perf_counter() - t0)
        for look in lookups.values():
            look.close()
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        results[label] = {
            "shape": list(shape), "entry_bytes": nbytes, "entries": n,
            "loads_per_method": len(times["readinto"]),
            "bound_gbps": nbytes / bound_s / 1e9, "bound_ms": bound_s * 1e3,
            "ms_per_load": med,
            "p90_ms": {k: float(np.percentile(v, 90)) * 1e3 for k, v in times.items()},
            "x_readinto": {k: med["readinto"] / v for k, v in med.items()},
            "x_safetensors": {k: med["safetensors"] / v for k, v in med.items()},
        }
        log(f"  bound {results[label]['bound_gbps']:.1f} GB/s; ms per load: "
            + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    results["read_ahead_built"] = read_ahead.BUILT
    return results


def measure_encoder(device: torch.device, tiny: bool, log) -> dict:
    """ms per image of a Gemma-3-sized vision tower + projector (random weights, bf16)."""
    from transformers import Gemma3Config, SiglipVisionConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
    from transformers.models.siglip.modeling_siglip import SiglipVisionModel

    if tiny:
        vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, image_size=112, patch_size=14)
        text_hidden, tokens, batches, iters = 256, 16, (1, 2), 2
    else:
        vision = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                      num_attention_heads=16, image_size=896, patch_size=14)
        text_hidden, tokens, batches, iters = 5376, 256, (1, 8), 10
    vcfg = SiglipVisionConfig(**vision, vision_use_head=False)
    cfg = Gemma3Config(vision_config=vcfg.to_dict(), mm_tokens_per_image=tokens,
                       text_config={"hidden_size": text_hidden, "num_hidden_layers": 1,
                                    "vocab_size": 1024, "intermediate_size": 64,
                                    "num_attention_heads": 1, "num_key_value_heads": 1,
                                    "head_dim": 64})
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tower = SiglipVisionModel._from_config(vcfg, attn_implementation="sdpa")
    tower = tower.to(device=device, dtype=dtype).eval()
    proj = Gemma3MultiModalProjector(cfg).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        torch.nn.init.normal_(proj.mm_input_projection_weight, std=0.02)
    out = {"vision": vision, "text_hidden": text_hidden, "tokens": tokens,
           "dtype": str(dtype).replace("torch.", "")}
    for b in batches:
        px = torch.randn(b, 3, vision["image_size"], vision["image_size"], device=device,
                         dtype=dtype)
        with torch.inference_mode():
            for _ in range(3):
                emb = proj(tower(pixel_values=px).last_hidden_state)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                emb = proj(tower(pixel_values=px).last_hidden_state)
            _sync(device)
        ms = (time.perf_counter() - t0) / iters * 1e3
        assert tuple(emb.shape) == (b, tokens, text_hidden), emb.shape
        out[f"batch{b}_ms_per_image"] = ms / b
        log(f"encoder batch {b}: {ms / b:.2f} ms per image ({tuple(emb.shape)} {emb.dtype})")
    return out


def plot(data: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [k for k in SIZES if k in data["loads"]]
    methods = list(data["loads"][sizes[0]]["ms_per_load"])
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        vals = [data["loads"][s]["ms_per_load"][m] for s in sizes]
        bars = ax.bar([i + j * width for i in range(len(sizes))], vals, width, label=m)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    enc = data["encoder"]
    for b, style in (("batch1_ms_per_image", "--"), ("batch8_ms_per_image", ":")):
        if b in enc:
            ax.axhline(enc[b], color="k", linestyle=style,
                       label=f"encoder, {b.split('_')[0]}: {enc[b]:.2f} ms/image")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))], sizes)
    ax.set_yscale("log")
    ax.set_ylabel("ms per load (to the tensor on the device), median")
    ax.set_title(f"{data['device']}: a cached load vs the Gemma 3 vision encoder it replaces")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks"), help="folder for gpu.json/.png")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true",
                    help="small sizes and a small tower, on the CPU if no GPU (a test)")
    ap.add_argument("--dir", default=None, help="where entries are written (a local disk)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[gpu_bench {time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        print("gpu_bench: no CUDA device (use --tiny to run the CPU parts)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    log(f"device {name}, torch {torch.__version__}, python {platform.python_version()}")
    scale = 0.125 if args.tiny else 1.0
    random.seed(0)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="encache-gpu-") as tmp:
        loads = measure_loads(Path(tmp), device, max(1, args.rounds), scale, log)
    encoder = measure_encoder(device, args.tiny, log)
    ref = "2.75 MB"
    enc1 = encoder.get("batch1_ms_per_image")
    enc8 = encoder.get("batch8_ms_per_image") or encoder.get("batch2_ms_per_image")
    ms = loads[ref]["ms_per_load"]
    data = {
        "benchmark": "gpu", "device": name, "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "tiny": args.tiny, "rounds": args.rounds, "loads": loads, "encoder": encoder,
        "encoder_over_load_at_2.75MB": {
            k: {"batch1": enc1 / v, "batchN": enc8 / v} for k, v in ms.items()},
        "seconds": time.perf_counter() - t_start,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(data, indent=1) + "\n")
    plot(data, out / "gpu.png")
    log(f"wrote {out / 'gpu.json'} and gpu.png; encoder / encache.first load at 2.75 MB: "
        f"{enc1 / ms['encache.first']:.1f}x (batch 1), {enc8 / ms['encache.first']:.1f}x "
        "(batched)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
