"""Online encoder disaggregation (EPD) through real servers: encoder -> store -> PD.

For a disk store and for a Redis Cluster an encoder instance (``ec_producer``:
encode-only) and a prefill/decode instance (``ec_consumer``) run as ``python -m
vllm.entrypoints.openai.api_server`` with worker processes, sharing the store. The model
is a tiny LLaVA whose language model is 2688 wide: 256 image tokens x 2688 fp32 = 2.75 MB
per entry, Gemma 3 27B's size (small entries hide the race this guards against). The
client does what vLLM's EPD proxy does: the request's images to the encoder, wait for
its 200, then the original request to PD at once, no sleep.

Shown here: every PD item is a hit and the PD tower never runs (the Redis Cluster's PD
with a node-local tier in front of the cluster: its loads are remote, then written behind
into the tier); the same with eight clients at once on the disk store (the encoder
batches their images into shared steps while PD loads what it already wrote); PD's
answers equal a plain single instance's; an encoder asked for images the store already
holds (precomputed) does not run its tower either, and PD still loads them. Redis (and
the cluster, with several clients at once) at this size and the two around it:
``test_epd_sizes.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from encache.connectors.store import open_store
from engine_support import PRECOMPUTE_KW, consumer_config
from served_support import (assert_logprobs_close, counter_deltas, draw_images,
                            first_token_logprobs, image_request, post_chat_ok, proxy_flow,
                            start_server, wide_model)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.redis]

MAX_LEN = 512
NEW = 12  # images only the encoder sees first
PRE = 4  # images precomputed before the servers start
CONCURRENT = 8  # clients doing the proxy's flow at the same time


@pytest.fixture(scope="module")
def epd(tmp_path_factory, redis_cluster):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    model = wide_model()
    root = tmp_path_factory.mktemp("epd")
    images = draw_images(root / "img", {f"p{i}": (160 + 8 * i, 128 + 4 * i)
                                        for i in range(NEW + PRE)}, seed=23)
    paths = [images[f"p{i}"] for i in range(NEW + PRE)]
    stores = {"disk": str(root / "store"),
              "cluster": redis_cluster.url_for(nodes=6) + "?prefix=epd-c:"}
    pre_dir = root / "pre"
    pre_dir.mkdir()
    for p in paths[NEW:]:
        (pre_dir / Path(p).name).write_bytes(Path(p).read_bytes())
    pre = dict(PRECOMPUTE_KW, max_model_len=MAX_LEN,
               engine_args={**PRECOMPUTE_KW["engine_args"], "max_num_batched_tokens": MAX_LEN})
    summary = precompute_corpus(str(pre_dir),
                                PrecomputeOptions(model=model, store=stores["disk"], **pre))
    assert summary.encoded == PRE
    servers = {}
    try:  # (started inside: a start that fails stops the ones started before it)
        servers["plain"] = start_server(model, None, root, max_model_len=MAX_LEN,
                                        probe="plain", executor="uni")
        for name, store in stores.items():
            servers[f"e-{name}"] = start_server(
                model, consumer_config(store, role="ec_producer"), root, max_model_len=MAX_LEN,
                probe=f"e-{name}")
            tier = {"local_tier": str(root / "tier")} if name == "cluster" else {}
            servers[f"pd-{name}"] = start_server(
                model, consumer_config(store, **tier), root, max_model_len=MAX_LEN,
                probe=f"pd-{name}")
        for s in servers.values():
            s.wait_ready()
        yield {"model": model, "paths": paths, "stores": stores, "servers": servers,
               "reference": {}, "tier": root / "tier"}
    finally:
        for s in servers.values():
            s.stop()


def reference(epd, path: str) -> dict:
    if path not in epd["reference"]:
        reply = post_chat_ok(epd["servers"]["plain"].base, image_request(epd["model"], path))
        epd["reference"][path] = first_token_logprobs(reply)
    return epd["reference"][path]


@pytest.mark.parametrize("backend", ["disk", "cluster"])
def test_every_pd_item_finds_what_the_encoder_just_wrote(epd, backend):
    e, pd = epd["servers"][f"e-{backend}"], epd["servers"][f"pd-{backend}"]
    store = epd["stores"][backend]
    before = open_store(store).read_counters()
    e_runs, pd_runs = e.encoder_log.count(), pd.encoder_log.count()
    replies = []
    for path in epd["paths"][:NEW]:
        replies.append((path, proxy_flow(e, pd, image_request(epd["model"], path))))
    assert e.encoder_log.count() - e_runs == NEW  # the encoder encoded each image once
    assert pd.encoder_log.count() == pd_runs, "the PD tower ran: a silent re-encode"
    deltas = counter_deltas(store, before, keys=("hits", "misses", "saves", "save_timeouts",
                                                 "hits_remote"))
    assert deltas["hits"] == NEW and deltas["misses"] == 0, deltas
    assert deltas["save_timeouts"] == 0, deltas
    if backend == "cluster":  # through PD's local tier: remote hits, each written behind
        assert deltas["hits_remote"] == NEW, deltas
        deadline = time.time() + 10
        while len(list(epd["tier"].glob("*/encoder_cache.safetensors"))) < NEW:
            assert time.time() < deadline, "the PD's tier did not receive the entries"
            time.sleep(0.2)
    for path, reply in replies:  # what a single instance answers
        assert_logprobs_close(first_token_logprobs(reply), reference(epd, path))


def test_concurrent_proxy_flows_find_what_their_encoder_wrote(epd, tmp_path):
    """Eight clients at once, each doing the proxy's flow for an image nobody has seen:
    the encoder's steps hold several requests, and a request finishes only once its own
    entries are written, while PD is already loading those of others."""
    from concurrent.futures import ThreadPoolExecutor

    images = draw_images(tmp_path / "img", {f"c{i}": (300 + 8 * i, 220 + 4 * i)
                                            for i in range(CONCURRENT)}, seed=31)
    e, pd = epd["servers"]["e-disk"], epd["servers"]["pd-disk"]
    store = epd["stores"]["disk"]
    before = open_store(store).read_counters()
    e_runs, pd_runs = e.encoder_log.count(), pd.encoder_log.count()

    def flow(path):
        return path, proxy_flow(e, pd, image_request(epd["model"], path))

    with ThreadPoolExecutor(CONCURRENT) as pool:
        replies = list(pool.map(flow, images.values()))
    assert e.encoder_log.count() - e_runs == CONCURRENT
    assert pd.encoder_log.count() == pd_runs, "the PD tower ran: a silent re-encode"
    deltas = counter_deltas(store, before, keys=("hits", "misses", "save_timeouts"))
    assert deltas == {"hits": CONCURRENT, "misses": 0, "save_timeouts": 0}, deltas
    for path, reply in replies:
        assert_logprobs_close(first_token_logprobs(reply), reference(epd, path))


def test_an_encoder_does_not_encode_what_the_store_holds(epd):
    """Precomputed images: the encoder's request returns without its tower, PD loads them."""
    e, pd = epd["servers"]["e-disk"], epd["servers"]["pd-disk"]
    store = epd["stores"]["disk"]
    before = open_store(store).read_counters()
    e_runs, pd_runs = e.encoder_log.count(), pd.encoder_log.count()
    for path in epd["paths"][NEW:]:
        reply = proxy_flow(e, pd, image_request(epd["model"], path))
        assert_logprobs_close(first_token_logprobs(reply), reference(epd, path))
    assert e.encoder_log.count() == e_runs, "the encoder re-encoded stored images"
    assert pd.encoder_log.count() == pd_runs
    deltas = counter_deltas(store, before, keys=("hits", "misses", "saves"))
    assert deltas == {"hits": PRE, "misses": 0, "saves": 0}, deltas
