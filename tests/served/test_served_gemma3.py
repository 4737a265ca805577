"""Gemma 3 end to end through real api_servers: pan-and-scan on and off.

One store, filled by ``precompute`` twice: the ``on/`` images with the server setting
``{"do_pan_and_scan": true}`` (wide images are cut into crops: one entry holds the
global view and every crop, 16 rows each), the ``off/`` images with defaults. Three
servers, started together: a consumer with pan-and-scan on, a consumer with it off, and a
plain server without the connector (pan-and-scan on; a request's own
``{"do_pan_and_scan": false}`` turns it off there, which processes the image exactly as
the server-level default does -- the other way round vLLM refuses the request, as its
encoder budget was sized for uncropped images). Every server runs the encoder probe: the plain one saves each
tower output, so a stored entry is compared with what the serving engine's own tower
computes for that image; the consumers' logs show the tower idle on hits. The servers'
workers run in their engine-core processes, as vLLM runs an engine on one GPU.
"""

from __future__ import annotations

import json

import pytest

from encache.connectors.encoder_config import encoder_config_digest
from encache.connectors.vllm.hashing import identify_file
from engine_support import PRECOMPUTE_KW
from served_support import (
    Reference,
    assert_logprobs_close,
    draw_images,
    served_request,
    start_server,
    stored_tensor,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PAS = {"do_pan_and_scan": True}
NO_PAS = {"do_pan_and_scan": False}  # a request's own kwargs, on the plain server (PaS on)
TOKENS = 16  # the tiny model's mm_tokens_per_image
LEN = 2048
ON = {"wide": (1000, 400), "square_png": (640, 640), "tall": (300, 900), "pano": (960, 320)}
OFF = {"wide2": (1000, 420), "small_png": (200, 150), "photo": (800, 600)}
FRESH = {"fresh1": (700, 300), "fresh2": (512, 512)}
MULTI = {"m_wide": (1000, 450), "m_square": (500, 500), "m_tall": (350, 800),
         "m_pano": (900, 300)}  # precomputed with pan-and-scan on, for multi-image requests


@pytest.fixture(scope="module")
def gemma(tiny_gemma3, tmp_path_factory):
    from encache.connectors.vllm import transfer_config
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    root = tmp_path_factory.mktemp("gemma3")
    store = str(root / "store")
    images = {"on": draw_images(root / "on", ON, seed=1),
              "off": draw_images(root / "off", OFF, seed=2),
              "fresh": draw_images(root / "fresh", FRESH, seed=3),
              "multi": draw_images(root / "on" / "multi", MULTI, seed=4)}
    config = transfer_config(store, "ec_consumer", {"counters_flush_s": 0.2})
    common = dict(max_model_len=LEN, images=4, probe=None, executor="uni")
    servers = {}
    try:
        # servers first: they start while precompute runs (a consumer looks entries up
        # per request, so entries written after its start are found)
        servers["on"] = start_server(tiny_gemma3, config, root, "--mm-processor-kwargs",
                                     json.dumps(PAS), **dict(common, probe="on"))
        servers["off"] = start_server(tiny_gemma3, config, root, **dict(common, probe="off"))
        servers["plain"] = start_server(tiny_gemma3, None, root, "--trust-request-mm-kwargs",
                                        "--mm-processor-kwargs",
                                        json.dumps(PAS),
                                        **dict(common, probe="plain", dump=True))
        engine = dict(PRECOMPUTE_KW["engine_args"], max_num_batched_tokens=LEN)
        for name, kwargs in (("on", PAS), ("off", None)):
            args = dict(engine, **({"mm_processor_kwargs": kwargs} if kwargs else {}))
            options = PrecomputeOptions(model=tiny_gemma3, store=store, max_model_len=LEN,
                                        dtype="float32", engine_args=args)
            summary = precompute_corpus(str(root / name), options)
            expect = len(images[name]) + (len(MULTI) if name == "on" else 0)
            assert (summary.encoded, summary.failed) == (expect, 0), summary.failures
        for server in servers.values():
            server.wait_ready()
        yield {"model": tiny_gemma3, "store": store, "images": images, "servers": servers,
               "ref": Reference(servers["plain"])}
    finally:
        for server in servers.values():
            server.stop()


def ident(g, path: str) -> str:
    return identify_file(path, g["model"]).identifier


@pytest.mark.parametrize("cfg", ["on", "off"])
def test_every_precomputed_image_hits_with_the_tower_idle(gemma, cfg):
    """Each stored image: one store hit, zero tower runs, the plain server's first-token
    logprobs -- with pan-and-scan on and off."""
    server = gemma["servers"][cfg]
    for name, path in gemma["images"][cfg].items():
        logprobs, deltas, encoded = served_request(server, gemma["store"], path)
        assert deltas == {"hits": 1, "misses": 0, "config_mismatches": 0}, (name, deltas)
        assert encoded == 0, (name, server.encoder_log.records()[-3:])
        want, _ = gemma["ref"].single(path, None if cfg == "on" else NO_PAS)
        assert_logprobs_close(logprobs, want)


@pytest.mark.parametrize("cfg", ["on", "off"])
def test_entries_equal_the_serving_towers_output(gemma, cfg):
    """A stored entry is what the serving engine's own tower computes for that image
    (all crops, in order, with pan-and-scan); wide images really were cropped."""
    digest = encoder_config_digest(PAS if cfg == "on" else None)
    rows = {}
    for name, path in gemma["images"][cfg].items():
        entry = stored_tensor(gemma["store"], ident(gemma, path))
        _, tower = gemma["ref"].single(path, None if cfg == "on" else NO_PAS)
        assert entry is not None and entry.shape == tower.shape, (name, entry, tower.shape)
        assert (entry - tower).abs().max().item() < 1e-4, name
        from encache.connectors.store import open_store
        assert open_store(gemma["store"]).stat(ident(gemma, path)).meta.encoder_config == digest
        rows[name] = entry.shape[0]
    if cfg == "on":  # global view + 3 crops for the wide ones, no crops for the square
        assert rows == {"wide": 4 * TOKENS, "square_png": TOKENS, "tall": 4 * TOKENS,
                        "pano": 4 * TOKENS}, rows
    else:
        assert set(rows.values()) == {TOKENS}, rows


def test_configurations_never_serve_each_others_entries(gemma):
    """Same identifiers, other pan-and-scan setting: a config mismatch (a miss, the tower
    runs), never the other configuration's entry."""
    store = gemma["store"]
    for cfg, other in (("on", "off"), ("off", "on")):
        path = next(iter(gemma["images"][other].values()))
        logprobs, deltas, encoded = served_request(gemma["servers"][cfg], store, path)
        assert deltas == {"hits": 0, "misses": 1, "config_mismatches": 1}, (cfg, deltas)
        assert encoded == 1
        want, _ = gemma["ref"].single(path, None if cfg == "on" else NO_PAS)
        assert_logprobs_close(logprobs, want)


def test_multi_image_requests_hit_stored_items_and_encode_the_rest(gemma):
    """3 images (2 stored, 1 not) then 4 (3 stored, 1 not): hits for the stored ones, the
    tower runs only for the others, output as the plain server's."""
    store, server = gemma["store"], gemma["servers"]["on"]
    m, fresh = gemma["images"]["multi"], list(gemma["images"]["fresh"].values())
    # the second request repeats m_wide: the engine's own encoder cache answers for it
    # (no store lookup, no tower run)
    cases = [[fresh[0], m["m_wide"], m["m_square"]],
             [m["m_tall"], fresh[1], m["m_wide"], m["m_pano"]]]
    served_once = set()
    for paths in cases:
        new_stored = len([p for p in paths if p in m.values() and p not in served_once])
        logprobs, deltas, encoded = served_request(server, store, paths)
        served_once.update(paths)
        want = gemma["ref"].multi(paths)
        assert_logprobs_close(logprobs, want)
        assert encoded == 1, deltas
        assert deltas["misses"] == 1 and deltas["config_mismatches"] == 0, deltas
        assert deltas["hits"] == new_stored, (deltas, new_stored)
