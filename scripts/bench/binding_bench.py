"""What the binding costs (docs/security.md): beside a consumer's load of a 2.75 MB entry.

A binding is one blake3 pass over an item's processed inputs
(:mod:`encache.connectors.vllm.binding`), on the producer before its write and on a
consumer before it serves an entry; a repeat whose inputs vLLM's processor cache hands
back is remembered. Timed here, interleaved (one of each per step, in a new random order):

  load.first        a consumer's first load of a stored 2.75 MB fp16 entry (256 x 5376,
                    Gemma 3 27B's size): a new lookup each round, checksum on the request
                    path (EntryLookup.load_now, defaults, no verified log), no copy after
  load.repeat       the same lookup's load of a version it verified (no checksum)
  write             a producer's write of such an entry (encode_parts: the checksum; put
                    into a disk store, fsync off), with a binding in its header
  binding.<model>   the binding of one item's processed inputs, fresh tensors each time:
                    llava (1 x 3 x 336 x 336 fp32, 1.35 MB), gemma3 (1 x 3 x 896 x 896 fp32,
                    9.6 MB), qwen2_5_vl (a 1036 x 756 image: 3996 x 1176 fp32 patches,
                    18.8 MB, and its grid)
  binding.<model>.one_core  the same hashed on one core (inputs of 1 MiB or more are
                    hashed on every core: binding.PARALLEL_BYTES)
  binding.repeat    the binding of inputs already digested (the processor cache's object)
  check.precomputed a consumer's whole check of an entry precompute wrote (``keyed_by:
                    content``; binding.binding_to_check) for a new Gemma 3 image: no digest
  check.online      the same for an entry an online producer (``ec_producer`` server, EPD
                    encoder) wrote for an item vLLM hashed (its worker's ``keyed_by``: a
                    content hash, client uuids namespaced apart): no digest
  check.client_uuid the same for an entry under a client uuid (``uuid=…``): the Gemma 3
                    digest
  uuid.map          the API server's mapping of one client uuid (uuids.uuid_identifier)

Without the binding a write and a load cost what load.first / load.repeat / write do here
(the binding adds one header field); with it a producer adds one binding.<model> per item
written, a consumer one per item of a request that carries its inputs and meets an entry
under a client uuid (check.client_uuid; a repeat: almost nothing), nothing for an entry
keyed by content (check.precomputed, check.online), and an EPD request one on the encoder.
Short by default (the machine is shared): ``--rounds 5``. Writes ``benchmarks/binding.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import UserDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_common import code_state, loadavg, machine  # noqa: E402
SHAPE = (256, 5376)
INPUTS = {
    "llava": {"pixel_values": (1, 3, 336, 336)},
    "gemma3": {"pixel_values": (1, 3, 896, 896), "num_patches": (1,)},
    "qwen2_5_vl": {"pixel_values": (3996, 1176), "image_grid_thw": (1, 3)},
}


def run(rounds: int, entries: int) -> dict:
    import numpy as np
    import torch

    from encache.connectors.lookup import EntryLookup
    from encache.connectors.store.disk import DiskStore
    from encache.connectors.store.entry import encode_parts
    from encache.connectors.vllm import binding as binding_mod
    from encache.connectors.store.entry import EntryMeta
    from encache.connectors.vllm.binding import binding_to_check, item_binding
    from encache.connectors.vllm.uuids import keyed_by, uuid_identifier

    def one_core(data):
        """item_binding with every input hashed on one core."""
        keep, binding_mod.PARALLEL_BYTES = binding_mod.PARALLEL_BYTES, 1 << 62
        try:
            return item_binding(data)
        finally:
            binding_mod.PARALLEL_BYTES = keep

    torch.set_num_threads(1)
    info, code0, load0 = machine(), code_state(), loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="encache-bench-binding-"))
    rng = np.random.default_rng(0)
    nbytes = SHAPE[0] * SHAPE[1] * 2
    try:
        store = DiskStore(tmp / "store", fsync=False)
        datas = [np.frombuffer(rng.bytes(nbytes), np.float16).reshape(SHAPE)
                 for _ in range(entries)]
        ids = []
        for d in datas:
            ident = uuid.uuid4().hex + uuid.uuid4().hex
            header, view = encode_parts(ident, d.view(np.uint8), "F16", SHAPE, model="bench",
                                        binding="blake3:" + "0" * 64)
            store.put(ident, [header, view])
            ids.append(ident)

        def inputs(model):
            out = {}
            for k, shape in INPUTS[model].items():
                out[k] = (torch.randint(0, 9, shape, dtype=torch.int64) if k.endswith("thw")
                          or k == "num_patches" else torch.randn(shape))
            return out

        # a MultiModalKwargsItem is a UserDict: remembered while it lives
        kept = {m: UserDict(inputs(m)) for m in INPUTS}
        fresh = {m: [inputs(m) for _ in range(4)] for m in INPUTS}
        item_binding(kept["llava"])  # remembered: the repeat row's object
        # the headers a consumer checks: an entry precompute wrote, and what an online
        # producer's worker stamps for a content hash and for a client uuid's identifier
        online = dict(content_keyed=False, content_hashes_keyed=True)
        keyed = {"precomputed": "content", "online": keyed_by(ids[0], **online),
                 "client_uuid": keyed_by(uuid_identifier("c"), **online)}
        assert keyed == {"precomputed": "content", "online": "content", "client_uuid": ""}
        metas = {k: EntryMeta(identifier="x", dtype="F16", shape=SHAPE, data_bytes=nbytes,
                              binding="blake3:" + "0" * 64, keyed_by=v)
                 for k, v in keyed.items()}
        times: dict[str, list[float]] = {}
        written = tmp / "written"
        for r in range(rounds):
            lookup = EntryLookup(DiskStore(tmp / "store", fsync=False), counters_flush_s=3600,
                                 load_threads=1, index_refresh_s=3600, verify_ahead=False,
                                 verify_ahead_start_bytes=0, remember_verified=False)
            wstore = DiskStore(written / str(r), fsync=False)
            order = list(range(entries))
            for step in order:
                jobs = {
                    "load.first": lambda: lookup.load_now(ids[step]),
                    "write": lambda: wstore.put(
                        ids[step], list(encode_parts(ids[step], datas[step].view(np.uint8),
                                                     "F16", SHAPE, model="bench",
                                                     binding="blake3:" + "1" * 64))),
                    "binding.repeat": lambda: item_binding(kept["llava"]),
                    **{f"check.{k}": (lambda k=k: binding_to_check(
                        metas[k], lambda: item_binding(dict(fresh["gemma3"][step % 4]))))
                       for k in metas},
                    "uuid.map": lambda: uuid_identifier(f"client-{r}-{step}"),
                    # a new mapping each time (not remembered), as a new request's
                    **{f"binding.{m}": (lambda m=m: item_binding(dict(fresh[m][step % 4])))
                       for m in INPUTS},
                    # the same on one core (the binding before it used every core)
                    **{f"binding.{m}.one_core": (lambda m=m: one_core(dict(fresh[m][step % 4])))
                       for m in INPUTS},
                }
                names = list(jobs)
                random.shuffle(names)
                for name in names:
                    t0 = time.perf_counter()
                    jobs[name]()
                    times.setdefault(name, []).append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                lookup.load_now(ids[step])
                times.setdefault("load.repeat", []).append(time.perf_counter() - t0)
            lookup.close()
            shutil.rmtree(written / str(r), ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def p(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3

    rows = {name: {"n": len(xs), "p50_ms": round(statistics.median(xs) * 1e3, 4),
                   "p10_ms": round(p(xs, 0.1), 4), "p90_ms": round(p(xs, 0.9), 4)}
            for name, xs in sorted(times.items())}
    first = rows["load.first"]["p50_ms"]
    for name, row in rows.items():
        if name.startswith(("binding.", "check.", "uuid.")):
            row["vs_first_load"] = round(row["p50_ms"] / first, 3)
    return {"benchmark": "the binding's cost beside a 2.75 MB entry's load and write",
            "machine": info, "loadavg": [load0, loadavg()],
            "params": {"code": code0, "rounds": rounds, "entries": entries, "entry_shape": list(SHAPE),
                       "dtype": "F16", "inputs": {m: {k: list(s) for k, s in v.items()}
                                                  for m, v in INPUTS.items()},
                       "torch_threads": 1, "page_cache": "warm"},
            "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--entries", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "binding.json"))
    args = ap.parse_args(argv)
    results = run(args.rounds, args.entries)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    for name, row in results["rows"].items():
        extra = f"  {row['vs_first_load']:.3f} x first load" if "vs_first_load" in row else ""
        print(f"{name:22s} p50 {row['p50_ms']:8.3f} ms{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
