"""Encoder disaggregation through real servers at every entry size, on one model.

``test_epd.py`` runs the proxy's flow with a tiny LLaVA at 2.75 MB per entry on a disk
store and a Redis Cluster. Here the same flow runs on a disk store, a password-protected
Redis and a Redis Cluster with a second family, Qwen2.5-VL, whose entries follow the
image's size (a token per 28 x 28 pixels; a language model 2688 wide, fp32): 11 KB (one
token, a 28 px image), 2.75 MB (256 tokens, Gemma 3 27B's entry) and 11 MB (1024 tokens,
four Gemma-3-sized crops in one entry), so one encoder and one PD instance per backend
serve all three sizes. On a disk store the encoder's request finishes once an entry's
bytes are in its temp file, before the commit, so PD may find the write in flight and
must read it whole, never part of it. On Redis and Redis Cluster the encoder's request
waits for the whole ``SET``; PD receives the value and verifies it as it arrives.

Per backend an encoder (``ec_producer``) and a PD instance (``ec_consumer``) run as
``python -m vllm.entrypoints.openai.api_server``; one backend at a time. On the disk store
the servers' workers run in processes of their own (CPU vLLM's default): PD's worker gets
a small entry as bytes in the step's metadata and opens a large one's pinned file itself.
On Redis and Redis Cluster they run in the engine-core process, as vLLM runs one GPU, and
take the buffers PD received into (``test_epd.py`` runs a Redis Cluster with worker
processes, which map the shared memory a large entry was received into).

Shown, at each size: every PD item is a hit, the PD tower never runs, the encoder encodes
each image once, and every stored entry holds exactly the tensor the encoder's tower
computed (the probe's dump) with the size's row count; sequentially and with four clients
at once; and on a disk store PD's loads skip the checksum the encoder's records in the
store's verified log make redundant.
"""

from __future__ import annotations

import pytest

from engine_support import consumer_config
from redis_fixture import RedisServer
from served_support import assert_pd_found_every_entry, draw_images, qwen_epd_model, start_server

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.redis]

WIDTH = 2688
SIZES = {  # name: (image side in pixels, image tokens)
    "11KB": (28, 1),
    "2.75MB": (448, 256),
    "11MB": (896, 1024),
}
MAX_LEN = 1536
NEW = 4  # images sent one after another
CONCURRENT = 4  # clients doing the proxy's flow at the same time


@pytest.fixture(scope="module", params=["disk", "redis", "cluster"])
def sized(request, tmp_path_factory):
    """One backend's encoder and PD servers (every size goes through them)."""
    backend = request.param
    model = qwen_epd_model()
    root = tmp_path_factory.mktemp(f"epd-sizes-{backend}")
    redis = RedisServer(password="sizes-secret") if backend == "redis" else None
    if backend == "disk":
        store = str(root / "store")
    elif backend == "redis":
        store = redis.url_for(db=0) + "?prefix=sizes:"
    else:
        store = request.getfixturevalue("redis_cluster").url_for(nodes=6) + "?prefix=sizes:"
    out = {"model": model, "store": store, "backend": backend}
    executor = "mp" if backend == "disk" else "uni"
    try:
        out["e"] = start_server(model, consumer_config(store, role="ec_producer"), root,
                                max_model_len=MAX_LEN, probe="e", dump=True,
                                executor=executor)
        out["pd"] = start_server(model, consumer_config(store), root, max_model_len=MAX_LEN,
                                 probe="pd", executor=executor)
        out["e"].wait_ready()
        out["pd"].wait_ready()
        yield out
    finally:
        for key in ("e", "pd"):
            if key in out:
                out[key].stop()
        if redis is not None:
            redis.stop()


def at_size(sized: dict, size: str) -> dict:
    return {**sized, "shape": (SIZES[size][1], WIDTH)}


def images(folder, size: str, count: int, seed: int) -> list[str]:
    """``count`` distinct images whose entries are ``size``."""
    side = SIZES[size][0]
    return list(draw_images(folder, {f"i{i}": (side, side) for i in range(count)},
                            seed=seed).values())


@pytest.mark.parametrize("size", list(SIZES))
def test_every_pd_item_finds_what_the_encoder_just_wrote(sized, size, tmp_path):
    assert_pd_found_every_entry(at_size(sized, size), images(tmp_path, size, NEW, 41),
                                clients=1)


@pytest.mark.parametrize("size", list(SIZES))
def test_concurrent_proxy_flows_at_size(sized, size, tmp_path):
    assert_pd_found_every_entry(at_size(sized, size),
                                images(tmp_path, size, CONCURRENT, 43), clients=CONCURRENT)
