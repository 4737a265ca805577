"""Encoder disaggregation through real servers at the entry sizes around Gemma 3's.

``test_epd.py`` runs the proxy's flow at 2.75 MB per entry on a disk store, Redis and a
Redis Cluster. Here the same flow runs on the same three backends at the two sizes
around it: 4 KB (the tiny LLaVA: 16 image tokens x 64 fp32) and 11 MB (1024 image tokens
x 2688 fp32, four Gemma-3-sized crops in one entry). On a disk store the encoder's
request finishes once an entry's bytes are in its temp file, before the commit, so PD
may find the write in flight and must read it whole, never part of it. On Redis and
Redis Cluster the encoder's request waits for the whole ``SET``; PD receives the value
and verifies it as it arrives, and its worker processes get a 4 KB entry as bytes in the
step's metadata and an 11 MB one through the shared memory it was received into.

Per backend an encoder (``ec_producer``) and a PD instance (``ec_consumer``) run for each
size as ``python -m vllm.entrypoints.openai.api_server`` with worker processes; the four
servers of a backend start together, one backend at a time. Shown: every PD item is a
hit, the PD tower never runs, the encoder encodes each image once, and every stored entry
holds exactly the tensor the encoder's tower computed (the probe's dump); sequentially
and with four clients at once; and on a disk store PD's loads skip the checksum the
encoder's records in the store's verified log make redundant.
"""

from __future__ import annotations

import pytest

from engine_support import consumer_config
from redis_fixture import RedisServer
from served_support import assert_pd_found_every_entry, crops_model, draw_images, start_server

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.redis]

SIZES = {  # name: (model builder, image tokens x width, max_model_len)
    "4KB": (None, (16, 64), 256),
    "11MB": (crops_model, (1024, 2688), 1536),
}
NEW = 6  # images sent one after another
CONCURRENT = 4  # clients doing the proxy's flow at the same time


@pytest.fixture(scope="module", params=["disk", "redis", "cluster"])
def sized(request, tiny_model, tmp_path_factory):
    """One backend's encoder and PD servers for every size: ``{size: {...}}``."""
    backend = request.param
    root = tmp_path_factory.mktemp(f"epd-sizes-{backend}")
    redis = RedisServer(password="sizes-secret") if backend == "redis" else None
    out = {}
    try:
        for name, (build, shape, max_len) in SIZES.items():
            model = build() if build else tiny_model
            if backend == "disk":
                store = str(root / name / "store")
            elif backend == "redis":
                store = redis.url_for(db=0) + f"?prefix=sizes-{name}:"
            else:
                cluster = request.getfixturevalue("redis_cluster")
                store = cluster.url_for(nodes=6) + f"?prefix=sizes-{name}:"
            e = start_server(model, consumer_config(store, role="ec_producer"), root / name,
                             max_model_len=max_len, probe=f"e-{name}", dump=True)
            out[name] = {"model": model, "store": store, "shape": shape, "e": e,
                         "backend": backend}
            out[name]["pd"] = start_server(model, consumer_config(store), root / name,
                                           max_model_len=max_len, probe=f"pd-{name}")
        for s in out.values():
            s["e"].wait_ready()
            s["pd"].wait_ready()
        yield out
    finally:
        for s in out.values():
            for key in ("e", "pd"):
                if key in s:
                    s[key].stop()
        if redis is not None:
            redis.stop()


@pytest.mark.parametrize("size", list(SIZES))
def test_every_pd_item_finds_what_the_encoder_just_wrote(sized, size, tmp_path):
    paths = draw_images(tmp_path / "img", {f"s{i}": (300 + 8 * i, 220 + 4 * i)
                                           for i in range(NEW)}, seed=41)
    assert_pd_found_every_entry(sized[size], list(paths.values()), clients=1)


@pytest.mark.parametrize("size", list(SIZES))
def test_concurrent_proxy_flows_at_size(sized, size, tmp_path):
    paths = draw_images(tmp_path / "img", {f"c{i}": (280 + 8 * i, 240 + 4 * i)
                                           for i in range(CONCURRENT)}, seed=43)
    assert_pd_found_every_entry(sized[size], list(paths.values()), clients=CONCURRENT)
