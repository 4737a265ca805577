"""Identifier parity through the real OpenAI server: `vllm serve` (api_server) as consumer.

Precompute a corpus with one file per format (RGB JPEG, RGBA PNG, palette GIF, greyscale
PNG, WEBP, BMP), start `python -m vllm.entrypoints.openai.api_server` with the encache
consumer config exactly as README says (worker processes, as in production), send each
file as a base64 data URL, and check the store's counters record a hit — not a miss — for
every one of them. The server and the precompute share non-default settings: an encoder
config (``--mm-processor-kwargs`` and a tag) and ``--media-io-kwargs``, which change every
served identifier.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from encache.connectors.encoder_config import encoder_config_digest
from encache.connectors.store import open_store
from engine_support import PRECOMPUTE_KW
from served_support import api_server, chat, counters_after, hits_and_misses_per_file

pytestmark = [pytest.mark.engine, pytest.mark.slow]

MEDIA = {"image": {"rgba_background_color": [0, 0, 0]}}


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    from encache.connectors.vllm import transfer_config
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from demo_corpus import make_corpus

    root = tmp_path_factory.mktemp("served")
    files = make_corpus(str(root / "corpus"), pages=6, seed=7)
    store = str(root / "store")
    # a non-default encoder config on both sides (CLIP's default do_normalize, spelled out,
    # and a tag): every hit below shows the served engine computes the precompute's stamp
    kw = {"do_normalize": True}
    # and the server's media settings (how images load, and a hash factor on the OpenAI
    # path), given to precompute via --engine-arg
    pre = dict(PRECOMPUTE_KW, engine_args={**PRECOMPUTE_KW["engine_args"],
                                           "mm_processor_kwargs": kw,
                                           "media_io_kwargs": MEDIA})
    summary = precompute_corpus(str(root / "corpus"), PrecomputeOptions(
        model=tiny_model, store=store, tag="served", **pre))
    assert summary.encoded == 6
    assert summary.encoder_config == encoder_config_digest(kw, tag="served") != ""
    # by plugin name, no module path: the vllm.general_plugins entry point must register it
    # in every server process (API server, engine core, workers)
    # load_mode mmap: the scheduler maps every entry and ships its bytes to the worker process
    config = transfer_config(store, "ec_consumer", {"counters_flush_s": 0.2, "load_mode": "mmap",
                                                    "store_stats_s": 0.5, "max_bytes": 1 << 30,
                                                    "tag": "served"})
    config["ec_connector"] = "EncacheDisk"
    del config["ec_connector_module_path"]
    with api_server(tiny_model, config, root, "--mm-processor-kwargs", json.dumps(kw),
                    "--media-io-kwargs", json.dumps(MEDIA)) as base:
        yield {"base": base, "files": files, "store": store, "model": tiny_model}


def test_every_format_hits_through_vllm_serve(served):
    results = hits_and_misses_per_file(served["base"], served["model"], served["store"],
                                       served["files"])
    assert all(v == (1, 0) for v in results.values()), results


def test_unknown_image_is_a_miss_not_an_error(served, tmp_path):
    from demo_corpus import make_corpus
    [fresh] = make_corpus(str(tmp_path), pages=1, seed=99)
    before = open_store(served["store"]).read_counters()
    reply = chat(served["base"], served["model"], fresh)
    assert reply["choices"][0]["message"]["content"] is not None
    after = counters_after(served["store"], "misses", before.get("misses", 0))
    assert after.get("misses", 0) == before.get("misses", 0) + 1
    assert after.get("hits", 0) == before.get("hits", 0)


def test_prometheus_metrics_exported(served):
    """The connector's stats reach vLLM's /metrics through get_ec_connector_stats."""
    chat(served["base"], served["model"], served["files"][0])  # at least one hit
    deadline = time.time() + 30
    while True:
        text = urllib.request.urlopen(served["base"] + "/metrics", timeout=10).read().decode()
        values = {}
        for line in text.splitlines():
            if line.startswith("vllm:embedding_cache_") and not line.startswith("#"):
                name = line.split("{")[0].split(" ")[0]
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        if (values.get("vllm:embedding_cache_hits_total", 0) >= 1
                and values.get("vllm:embedding_cache_entries", 0) >= 6) or time.time() > deadline:
            break
        time.sleep(1)
    p = "vllm:embedding_cache_"
    assert values.get(p + "hits_total", 0) >= 1, values
    assert values.get(p + "loaded_bytes_total", 0) > 0
    assert values.get(p + "load_latency_seconds_count", 0) >= 1
    assert p + "misses_total" in values and p + "evictions_total" in values
    # store-wide gauges, sampled by the connector's background thread
    assert values.get(p + "entries") == 6, values  # the six precomputed pages
    used = values.get(p + "current_bytes", 0)
    assert used > 6 * 4096 and values.get(p + "capacity_bytes") == 1 << 30
    assert values.get(p + "utilization") == pytest.approx(used / (1 << 30))
    assert values.get(p + "store_down") == 0 and values.get(p + "store_parts_down") == 0


def test_server_media_io_kwargs_are_hashed_like_the_server(served):
    """The server's --media-io-kwargs change every served identifier: none of the stored
    entries (which every format hits, above) is what a server without them looks up."""
    from encache.connectors.vllm.hashing import identify_file

    stored = set(open_store(served["store"]).identifiers())
    plain = {identify_file(f, served["model"]).identifier for f in served["files"]}
    assert len(stored) == 6 and not stored & plain
    assert stored == {identify_file(f, served["model"], media_io_kwargs=MEDIA).identifier
                      for f in served["files"]}
