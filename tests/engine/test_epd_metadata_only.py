"""EPD with vLLM 0.33's proxy: items keyed by a client ``uuid``, sent to PD metadata-only.

The proxy injects a ``uuid`` per media item on the encoder request, reads each item's
placeholder metadata from the encoder's ``ec_transfer_params`` (``request_finished``),
and sends PD an ``image_embeds`` reference holding only that metadata (Qwen2.5-VL:
``image_grid_thw``) -- no pixels. Real in-process engines on the tiny Qwen2.5-VL:

* the encoder's ``ec_transfer_params`` is what vLLM's own helper reports (the proxy's
  input), keyed by the identifier the client's uuid maps to (``uuid=…``,
  :mod:`encache.connectors.vllm.uuids`), and the entry is listed, verified and purged
  like any other;
* PD answers a metadata-only item from the store, its tower idle, with the answer the
  pixels give -- whether the proxy sends it the uuid it gave the encoder or the
  identifier the encoder reported;
* a metadata-only item whose entry is absent, or corrupt, fails that request alone (a
  request error, counted with its reason) and the engine goes on serving.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from encache.connectors.store import open_store
from encache.connectors.vllm.uuids import uuid_identifier
from engine_support import TowerTap, consumer_config, consumer_lookup, data_url, make_llm, shutdown
from served_support import draw_images

pytestmark = [pytest.mark.engine, pytest.mark.slow]

UUIDS = ["doc-7/page 3", "proxy-sha-0001", "never-encoded"]
KW = dict(max_model_len=512, max_num_batched_tokens=512)


def image_part(path: str, uuid: str) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(path)}, "uuid": uuid}


def embeds_part(metadata: dict, uuid: str) -> dict:
    return {"type": "image_embeds", "image_embeds": metadata, "uuid": uuid}


def ask(llm, part: dict):
    from vllm import SamplingParams
    msgs = [{"role": "user", "content": [part, {"type": "text", "text": "What is shown?"}]}]
    return llm.chat(msgs, SamplingParams(max_tokens=1, temperature=0, logprobs=5),
                    use_tqdm=False)[0]


@pytest.fixture(scope="module")
def produced(tiny_qwen2_5_vl, tmp_path_factory):
    """An encoder (ec_producer) run with client uuids: (store, paths, ec_transfer_params,
    reference answers of a plain engine given the pixels)."""
    root = tmp_path_factory.mktemp("epd-meta")
    imgs = draw_images(root / "img", {"a": (96, 64), "b": (64, 96)}, seed=3)
    paths = [imgs["a"], imgs["b"]]
    store = str(root / "store")
    plain = make_llm(tiny_qwen2_5_vl, **KW)
    try:
        reference = [ask(plain, image_part(p, u)).outputs[0] for p, u in zip(paths, UUIDS)]
    finally:
        shutdown(plain)
    enc = make_llm(tiny_qwen2_5_vl, consumer_config(store, role="ec_producer"), **KW)
    try:
        params = [ask(enc, image_part(p, u)).ec_transfer_params for p, u in zip(paths, UUIDS)]
    finally:
        shutdown(enc)
    return {"store": store, "paths": paths, "params": params, "reference": reference}


def encache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "encache.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_encoder_reports_what_the_proxy_reads(produced, tmp_path):
    s = open_store(produced["store"])
    for uuid, params in zip(UUIDS, produced["params"]):
        assert list(params) == [uuid_identifier(uuid)], params  # the uuid's identifier
        item = params[uuid_identifier(uuid)]
        assert item["item_indices"] == [0]
        (grid,) = [item["metadata"]["image_grid_thw"]]
        assert len(grid) == 3 and all(isinstance(x, int) for x in grid), item
        assert s.contains(uuid_identifier(uuid))  # stored there, like any identifier
    # listed, verified and purged like any entry (the CLI, on a copy of the store)
    copy = str(tmp_path / "copy")
    shutil.copytree(produced["store"], copy)
    listed = encache("list", "--store", copy, "--quiet")
    mapped = {uuid_identifier(u) for u in UUIDS[:2]}
    assert listed.returncode == 0 and set(listed.stdout.split("\n")) >= mapped, listed
    verified = encache("verify", "--store", copy)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    purged = encache("purge", "--store", copy, "--all", "--yes")
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert not any(open_store(copy).contains(uuid_identifier(u)) for u in UUIDS)


def test_pd_answers_metadata_only_items_from_the_store_and_fails_the_rest(
        produced, tiny_qwen2_5_vl):
    store = produced["store"]
    # a third entry: the second one's bytes under another uuid, then corrupted
    s = open_store(store)
    blob = bytearray(s.get(uuid_identifier(UUIDS[1])))
    from encache.connectors.store.entry import encode_parts, validate_blob
    meta, off = validate_blob(blob)
    data = bytes(blob[off:off + meta.data_bytes])
    header, view = encode_parts(uuid_identifier("corrupt-one"), data, meta.dtype, meta.shape, model=meta.model,
                                vllm_version=meta.vllm_version, hash_algo=meta.hash_algo)
    bad = bytearray(header + bytes(view))
    bad[-7] ^= 0xFF
    s.put(uuid_identifier("corrupt-one"), bytes(bad))
    tap = TowerTap(tiny_qwen2_5_vl)
    pd = make_llm(tiny_qwen2_5_vl, consumer_config(store, load_timeout_s=1.0), **KW)
    try:
        lookup = consumer_lookup(pd)
        tap.on = True
        # the uuid the proxy gave the encoder, or the identifier the encoder reported
        for i, uuid in enumerate(UUIDS[:2]):
            sent = uuid if i == 0 else uuid_identifier(uuid)
            out = ask(pd, embeds_part(produced["params"][i][uuid_identifier(uuid)]["metadata"],
                                      sent))
            want = produced["reference"][i]
            assert out.outputs[0].token_ids == want.token_ids
            got_lp, want_lp = out.outputs[0].logprobs[0], want.logprobs[0]
            assert set(got_lp) == set(want_lp)
            assert max(abs(got_lp[t].logprob - want_lp[t].logprob) for t in want_lp) < 1e-3
        assert tap.take() == [], "PD ran its tower for a metadata-only item"
        grid = produced["params"][1][uuid_identifier(UUIDS[1])]["metadata"]
        absent = ask(pd, embeds_part(grid, "never-encoded"))
        assert absent.outputs[0].finish_reason == "error", absent
        corrupt = ask(pd, embeds_part(grid, "corrupt-one"))
        assert corrupt.outputs[0].finish_reason == "error", corrupt
        assert tap.take() == []
        # the engine goes on: the stored item is still answered
        again = ask(pd, embeds_part(
            produced["params"][0][uuid_identifier(UUIDS[0])]["metadata"], UUIDS[0]))
        assert again.outputs[0].token_ids == produced["reference"][0].token_ids
        lookup.maybe_flush(force=True)
        c = s.read_counters()
        assert c.get("unavailable") == 2, c
        assert c.get("unavailable_late") == 1 and c.get("unavailable_corrupt") == 1, c
    finally:
        tap.close()
        shutdown(pd)
