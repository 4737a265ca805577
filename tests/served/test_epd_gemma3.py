"""Encoder disaggregation of Gemma 3 with pan-and-scan at its real entry size, through
real servers.

Gemma 3 with pan-and-scan is the case behind the 11 MB size of ``test_epd_sizes.py``: a wide or
tall image becomes the global view plus up to four crops of 256 soft tokens each, and
vLLM's encoder output for the item -- one entry -- holds all of them. Here the tiny Gemma 3
has its real 256 tokens per tile and a language model 2688 wide (fp32: the bytes of Gemma
3 27B's fp16 rows), so a tile is 2.75 MB and a wide image's entry 11 MB. An encoder
(``ec_producer``) and a PD instance (``ec_consumer``), both ``python -m
vllm.entrypoints.openai.api_server`` with pan-and-scan on and one disk store (their workers
in the engine-core process, as vLLM runs an engine on one GPU), run the EPD
proxy's flow (encoder, its 200, PD at once) for single images of several aspect ratios,
for a two-image request, and for several clients at once. Shown: every PD item is a
store hit, PD's tower never runs, and every entry holds exactly what the encoder's tower
computed, one tile of 256 rows per view.
"""

from __future__ import annotations

import json

import pytest

from engine_support import consumer_config
from served_support import assert_pd_found_every_entry, draw_images, start_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PAS = {"do_pan_and_scan": True}
TILE = 256  # soft tokens per tile (Gemma 3's)
WIDTH = 2688


@pytest.fixture(scope="module")
def epd(tiny_family, tmp_path_factory):
    model = tiny_family("gemma3", text_hidden=WIDTH, image_size=256)
    root = tmp_path_factory.mktemp("epd-gemma3")
    store = str(root / "store")
    common = dict(max_model_len=2048, images=2, executor="uni")
    servers = {}
    try:
        servers["e"] = start_server(model, consumer_config(store, role="ec_producer"), root,
                                    "--mm-processor-kwargs", json.dumps(PAS), probe="e",
                                    dump=True, **common)
        servers["pd"] = start_server(model, consumer_config(store), root,
                                     "--mm-processor-kwargs", json.dumps(PAS), probe="pd",
                                     **common)
        for server in servers.values():
            server.wait_ready()
        yield {**servers, "model": model, "store": store, "backend": "disk", "root": root}
    finally:
        for server in servers.values():
            server.stop()


def test_pd_finds_every_crop_the_encoder_just_wrote(epd):
    imgs = draw_images(epd["root"] / "seq", {"wide": (1000, 400), "square_png": (640, 640),
                                             "tall": (300, 900), "pano": (960, 320),
                                             "small": (500, 500)}, seed=51)
    entries = assert_pd_found_every_entry(
        epd, [imgs["wide"], imgs["square_png"], imgs["tall"], [imgs["pano"], imgs["small"]]],
        clients=1)
    rows = {name: entries[path].shape[0] for name, path in imgs.items()}
    # the global view + 3 crops for the wide ones, the global view alone for the square
    assert rows == {"wide": 4 * TILE, "square_png": TILE, "tall": 4 * TILE, "pano": 4 * TILE,
                    "small": TILE}, rows
    assert {entry.shape[1] for entry in entries.values()} == {WIDTH}


def test_concurrent_proxy_flows_find_every_crop(epd):
    imgs = draw_images(epd["root"] / "conc", {f"c{i}": (1000 + 20 * i, 400) for i in range(4)},
                       seed=53)
    entries = assert_pd_found_every_entry(epd, list(imgs.values()), clients=4)
    assert {tuple(entry.shape) for entry in entries.values()} == {(4 * TILE, WIDTH)}
