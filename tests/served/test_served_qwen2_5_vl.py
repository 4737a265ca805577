"""Qwen2.5-VL end to end through real api_servers: dynamic resolution, a server
``max_pixels``, and requests that carry their own ``mm_processor_kwargs``.

Both servers run with ``--mm-processor-kwargs '{"max_pixels": ...}'`` (a server setting:
part of the entries' encoder-config stamp, not of the identifier). Images of several sizes
and aspect ratios give entries of different shapes (rows = merged 28x28 patches). The
``req/`` images are precomputed with ``--request-mm-processor-kwargs`` for requests that
carry a smaller ``max_pixels`` of their own (a hash factor of the identifier). One
consumer, one plain server (its probe saves every tower output: entries are compared with
what the serving engine's own tower computes), started together, their workers in the
engine-core process as vLLM runs an engine on one GPU. The consumer also takes
what vLLM 0.33's EPD proxy sends PD: metadata-only items keyed by a ``uuid``.
"""

from __future__ import annotations

import json

import pytest

from encache.connectors.encoder_config import encoder_config_digest
from encache.connectors.store import open_store
from encache.connectors.vllm.hashing import identify_file
from encache.connectors.vllm.uuids import uuid_identifier
from engine_support import PRECOMPUTE_KW
from served_support import (
    Reference,
    assert_logprobs_close,
    counter_deltas,
    draw_images,
    first_token_logprobs,
    post_chat,
    served_request,
    start_server,
    stored_tensor,
)

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SERVER = {"max_pixels": 28 * 28 * 128}  # the server's --mm-processor-kwargs
REQUEST = {"max_pixels": 28 * 28 * 32}  # a request's own mm_processor_kwargs
LEN = 2048
LIMITS = {"image": 4, "video": 0}
MAIN = {"wide": (1000, 400), "square_png": (640, 640), "tall": (300, 900),
        "small_png": (200, 150), "big": (1000, 1000)}
REQ = {"r_wide": (900, 500), "r_tall": (400, 800)}
MULTI = {"m_a": (800, 600), "m_b": (600, 800), "m_c": (1000, 300)}
FRESH = {"fresh1": (720, 480), "fresh2": (333, 333)}


@pytest.fixture(scope="module")
def qwen(tiny_qwen2_5_vl, tmp_path_factory):
    from encache.connectors.vllm import transfer_config
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    model = tiny_qwen2_5_vl
    root = tmp_path_factory.mktemp("qwen")
    store = str(root / "store")
    images = {"main": draw_images(root / "main", MAIN, seed=11),
              "multi": draw_images(root / "main" / "multi", MULTI, seed=12),
              "req": draw_images(root / "req", REQ, seed=13),
              "fresh": draw_images(root / "fresh", FRESH, seed=14)}
    config = transfer_config(store, "ec_consumer", {"counters_flush_s": 0.2, "load_timeout_s": 2.0})
    # a request may carry its own mm_processor_kwargs only where the server trusts them
    server_args = ("--trust-request-mm-kwargs", "--mm-processor-kwargs", json.dumps(SERVER))
    servers = {}
    try:
        servers["ec"] = start_server(model, config, root, *server_args, max_model_len=LEN,
                                     images=LIMITS, probe="ec", executor="uni")
        servers["plain"] = start_server(model, None, root, *server_args, max_model_len=LEN,
                                        images=LIMITS, probe="plain", dump=True,
                                        executor="uni")
        engine = dict(PRECOMPUTE_KW["engine_args"], max_num_batched_tokens=LEN,
                      mm_processor_kwargs=SERVER, limit_mm_per_prompt={"image": 1, "video": 0})
        for name, request in (("main", None), ("req", REQUEST)):
            options = PrecomputeOptions(model=model, store=store, max_model_len=LEN,
                                        dtype="float32", engine_args=engine,
                                        request_mm_processor_kwargs=request)
            summary = precompute_corpus(str(root / name), options)
            expect = len(images[name]) + (len(MULTI) if name == "main" else 0)
            assert (summary.encoded, summary.failed) == (expect, 0), summary.failures
            assert summary.encoder_config == encoder_config_digest(SERVER)
        for server in servers.values():
            server.wait_ready()
        yield {"model": model, "store": store, "images": images, "servers": servers,
               "ref": Reference(servers["plain"])}
    finally:
        for server in servers.values():
            server.stop()


def test_every_precomputed_image_hits_with_the_tower_idle(qwen):
    """Every size and aspect ratio, with and without the request's own kwargs: one hit,
    zero tower runs, the plain server's first-token logprobs."""
    server = qwen["servers"]["ec"]
    for group, kwargs in (("main", None), ("req", REQUEST)):
        for name, path in qwen["images"][group].items():
            logprobs, deltas, encoded = served_request(server, qwen["store"], path,
                                                       mm_processor_kwargs=kwargs)
            assert deltas == {"hits": 1, "misses": 0, "config_mismatches": 0}, (name, deltas)
            assert encoded == 0, (name, server.encoder_log.records()[-3:])
            want, _ = qwen["ref"].single(path, kwargs)
            assert_logprobs_close(logprobs, want)


def test_entries_have_per_image_shapes_equal_to_the_serving_tower(qwen):
    """Each entry is the serving engine's tower output for its image (max abs diff within
    float noise); shapes follow each image's size under the server/request max_pixels."""
    store = open_store(qwen["store"])
    rows = {}
    for group, kwargs in (("main", None), ("req", REQUEST)):
        for name, path in qwen["images"][group].items():
            identifier = identify_file(path, qwen["model"], mm_processor_kwargs=kwargs).identifier
            entry = stored_tensor(qwen["store"], identifier)
            _, tower = qwen["ref"].single(path, kwargs)
            assert entry is not None and entry.shape == tower.shape, (name, tower.shape)
            assert (entry - tower).abs().max().item() < 1e-4, name
            assert store.stat(identifier).meta.encoder_config == encoder_config_digest(SERVER)
            rows[name] = entry.shape[0]
    assert len(set(rows.values())) >= 5, rows  # entries of different shapes
    assert max(rows.values()) <= SERVER["max_pixels"] // (28 * 28), rows
    assert max(rows[n] for n in REQ) <= REQUEST["max_pixels"] // (28 * 28), rows


def test_request_kwargs_are_part_of_the_identifier(qwen):
    """An image stored for plain requests is a miss for a request carrying its own
    max_pixels (another identifier), and `encache hash --mm-processor-kwargs` names the
    stored identifier of a request-kwargs entry."""
    from cli_support import invoke

    path = qwen["images"]["fresh"]["fresh2"]
    server, store = qwen["servers"]["ec"], qwen["store"]
    _, deltas, encoded = served_request(server, store, path, mm_processor_kwargs=REQUEST)
    assert deltas["hits"] == 0 and deltas["misses"] == 1 and encoded == 1, deltas
    req_path = qwen["images"]["req"]["r_wide"]
    r = invoke("hash", req_path, "-m", qwen["model"], "-s", store,
               "--mm-processor-kwargs", json.dumps(REQUEST), "--json")
    assert r.exit_code == 0, r.output
    [rec] = json.loads(r.output)["files"]
    assert rec["in_store"] is True and rec["hash_factors"] == {"mm_processor_kwargs": REQUEST}
    without = invoke("hash", req_path, "-m", qwen["model"], "-s", store, "--json")
    assert json.loads(without.output)["files"][0]["in_store"] is False


def test_multi_image_requests_hit_stored_items_and_encode_the_rest(qwen):
    """2-4 images of different sizes, some stored, some not: hits for the stored ones, the
    tower only for the others, output as the plain server's."""
    store, server = qwen["store"], qwen["servers"]["ec"]
    m, fresh = qwen["images"]["multi"], qwen["images"]["fresh"]
    cases = [[m["m_a"], fresh["fresh1"]],
             [m["m_b"], m["m_c"], fresh["fresh2"], m["m_a"]]]  # m_a again: engine cache
    served_once = set()
    for paths in cases:
        new_stored = len([p for p in paths if p in m.values() and p not in served_once])
        new_fresh = len([p for p in paths if p not in m.values() and p not in served_once])
        logprobs, deltas, encoded = served_request(server, store, paths)
        served_once.update(paths)
        assert_logprobs_close(logprobs, qwen["ref"].multi(paths))
        assert encoded == new_fresh, (deltas, encoded)
        assert deltas == {"hits": new_stored, "misses": new_fresh, "config_mismatches": 0}


def grid_thw(path: str) -> list[int]:
    """The ``image_grid_thw`` Qwen2.5-VL's processor gives ``path`` under the server's
    ``max_pixels``: the placeholder metadata an encoder reports and vLLM 0.33's proxy
    forwards to PD."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    width, height = Image.open(path).size
    h, w = smart_resize(height, width, factor=28, min_pixels=3136,
                        max_pixels=SERVER["max_pixels"])
    return [1, h // 14, w // 14]


def metadata_only_request(server, uuid: str, grid: list[int]) -> tuple[int, dict | str]:
    """What vLLM 0.33's proxy sends PD for one image: an ``image_embeds`` reference with
    the item's placeholder metadata and its ``uuid``, no pixels. (status, reply)."""
    part = {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": uuid}
    body = {"model": server.model, "max_tokens": 1, "temperature": 0, "logprobs": True,
            "top_logprobs": 5, "messages": [{"role": "user", "content": [
                part, {"type": "text", "text": "What is on this page?"}]}]}
    return post_chat(server.base, body, timeout=120)


def test_metadata_only_items_load_from_the_store_or_fail_their_request_alone(qwen):
    """vLLM 0.33's EPD proxy sends PD each image as a metadata-only reference keyed by the
    uuid it gave the encoder: PD cannot encode it. (0.33's proxy does not drive 0.32
    servers; this client sends PD what it sends.) Through the consumer api_server: a
    stored item is answered from the store with the tower idle and the plain server's
    logprobs for the pixels; an item the store lacks, or holds corrupt, fails that request
    alone (an HTTP error the proxy retries), counted with its reason, and the server goes
    on."""
    from encache.connectors.store.entry import encode_parts, validate_blob

    server, store = qwen["servers"]["ec"], qwen["store"]
    path = qwen["images"]["main"]["square_png"]
    grid = grid_thw(path)
    # the encoder stored this image under the proxy's uuid's identifier (a copy of its entry)
    s = open_store(store)
    blob = s.get(identify_file(path, qwen["model"]).identifier)
    meta, off = validate_blob(blob)
    assert meta.shape[0] == grid[0] * grid[1] * grid[2] // 4, (meta.shape, grid)
    uuid = "proxy-uuid/page 1"
    header, view = encode_parts(uuid_identifier(uuid), bytes(blob[off:off + meta.data_bytes]), meta.dtype,
                                meta.shape, model=meta.model, vllm_version=meta.vllm_version,
                                hash_algo=meta.hash_algo, encoder_config=meta.encoder_config)
    s.put(uuid_identifier(uuid), header + bytes(view))
    corrupt = bytearray(header + bytes(view))
    corrupt[-7] ^= 0xFF
    s.put(uuid_identifier("proxy-uuid/corrupt"), bytes(corrupt))

    keys = ("hits", "misses", "unavailable", "unavailable_late", "unavailable_corrupt")
    before, items = s.read_counters(), server.encoder_log.count()
    status, reply = metadata_only_request(server, uuid, grid)
    assert status == 200, reply
    assert_logprobs_close(first_token_logprobs(reply), qwen["ref"].single(path)[0])
    status, reply = metadata_only_request(server, "proxy-uuid/never encoded", grid)
    assert status >= 400, reply
    status, reply = metadata_only_request(server, "proxy-uuid/corrupt", grid)
    assert status >= 400, reply
    assert counter_deltas(store, before, keys) == {
        "hits": 1, "misses": 0, "unavailable": 2, "unavailable_late": 1,
        "unavailable_corrupt": 1}
    assert server.encoder_log.count() == items, "PD ran its tower for a metadata-only item"
    # the server goes on serving
    status, reply = metadata_only_request(server, uuid, grid)
    assert status == 200, reply
