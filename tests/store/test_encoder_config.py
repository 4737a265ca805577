"""The encoder-config stamp: what vLLM's identifier leaves out must not be served across.

Unit level (a disk store and a real Redis): the digest, the header field, the consumer
lookup treating another config's entries as misses, and the producer's writer replacing
them instead of skipping them.  ``test_engine_roles.py`` shows the same on real engines
with different ``mm_processor_kwargs``.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from encache.connectors.encoder_config import (DEFAULT_DIGEST, encoder_config_digest,
                                               encoder_config_factors)
from encache.connectors.lookup import EntryLookup
from encache.connectors.store import decode, encode, open_store
from encache.connectors.vllm.config import ConnectorConfig
from encache.connectors.vllm.writer import EntryWriter
from entries import put_entry

ARR = np.arange(256, dtype=np.float16).reshape(16, 16)


def lookup(store, **kw) -> EntryLookup:
    return EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, load_threads=1, **kw)


def test_digest_is_empty_for_the_default_and_stable_otherwise():
    assert encoder_config_digest() == DEFAULT_DIGEST == ""
    assert encoder_config_digest({}, None, "") == ""
    a = encoder_config_digest({"max_pixels": 100, "do_normalize": False})
    assert len(a) == 16 and int(a, 16) >= 0
    assert a == encoder_config_digest({"do_normalize": False, "max_pixels": 100})  # key order
    assert a != encoder_config_digest({"max_pixels": 101, "do_normalize": False})
    assert len({a, encoder_config_digest(revision="r1"), encoder_config_digest(tag="t"),
                encoder_config_digest(tag="u")}) == 4
    # where preprocessing runs is not what it computes (vLLM adds "device" to GPU producers)
    assert encoder_config_digest({"device": "cuda"}) == ""
    assert encoder_config_digest({"device": "cuda", "max_pixels": 100, "do_normalize": False}) == a
    assert encoder_config_factors({"x": 1}, "r", "t") == {
        "mm_processor_kwargs": {"x": 1}, "revision": "r", "tag": "t"}


def test_header_carries_the_stamp_only_when_not_default():
    arr = ARR
    plain = encode("x", arr.view(np.uint8), "F16", arr.shape)
    stamped = encode("x", arr.view(np.uint8), "F16", arr.shape, encoder_config="abcd")
    assert b"encoder_config" not in plain  # default entries are byte-for-byte as before
    assert decode(plain)[0].encoder_config == ""
    meta = decode(stamped)[0]
    assert meta.encoder_config == "abcd" and meta.to_dict()["encoder_config"] == "abcd"
    assert "encoder_config" not in meta.extra


@pytest.fixture(params=["disk", "redis"])
def store(request, tmp_path):
    if request.param == "disk":
        s = open_store(str(tmp_path / "s"), create=True)
    else:
        server = request.getfixturevalue("redis_server")
        s = open_store(server.url, prefix=f"cfg{uuid.uuid4().hex[:8]}:", create=True)
    yield s
    s.close()


def test_lookup_serves_only_its_own_config(store):
    put_entry(store, "plain", array=ARR)
    put_entry(store, "kw", array=ARR, encoder_config="1111222233334444")
    default = lookup(store, encoder_config="")
    try:
        assert default.load_now("plain") is not None  # unstamped = default config
        assert default.load_now("kw") is None  # another config: a miss, not its bytes
        assert default.metrics.pending("config_mismatches") == 1
        assert not default.metrics.pending("load_errors")  # not corruption
    finally:
        default.close()
    other = lookup(store, encoder_config="1111222233334444")
    try:
        assert other.load_now("kw") is not None
        assert other.load_now("plain") is None
    finally:
        other.close()
    unchecked = lookup(store, encoder_config=None)  # check_encoder_config: false
    try:
        assert unchecked.load_now("plain") is not None and unchecked.load_now("kw") is not None
    finally:
        unchecked.close()


def test_mismatched_entry_is_not_staged_by_background_requests(store):
    put_entry(store, "kw", array=ARR, encoder_config="1111222233334444")
    lk = lookup(store, encoder_config="")
    try:
        assert lk.wait_index(10)  # a remote store is known through its index
        assert lk.probably_stored("kw")
        lk.request("kw")
        lk.wait_idle(10)
        assert lk.get_staged("kw") is None
        lk.request("kw")  # remembered for a while: not read again at once
        lk.wait_idle(10)
        assert lk.metrics.pending("config_mismatches") == 1
    finally:
        lk.close()


def test_writer_replaces_other_configs_entries_and_skips_its_own(store):
    put_entry(store, "a", array=ARR + np.float16(1.0), encoder_config="")
    put_entry(store, "b", array=ARR + np.float16(1.0), encoder_config="1111222233334444")
    writer = EntryWriter(store, threads=1, encoder_config="1111222233334444")

    def data():
        return ARR.view(np.uint8).reshape(-1), "F16", ARR.shape
    for ident in ("a", "b"):
        writer.submit(ident, data, ARR.nbytes, model="m", encoder_config="1111222233334444")
    assert writer.flush(30)
    assert writer.counters.get("skipped_existing") == 1  # b: same config, kept
    assert writer.counters.get("saves") == 1  # a: other config, replaced
    meta_a, data_a = decode(bytes(store.get("a")))
    assert meta_a.encoder_config == "1111222233334444"
    assert np.array_equal(np.frombuffer(data_a, np.float16).reshape(ARR.shape), ARR)
    meta_b, data_b = decode(bytes(store.get("b")))
    assert np.array_equal(np.frombuffer(data_b, np.float16).reshape(ARR.shape), ARR + 1)
    writer.close()


def test_connector_config_keys():
    c = ConnectorConfig.from_extra({"store": "/x", "tag": "weights-v2",
                                    "check_encoder_config": False})
    assert c.tag == "weights-v2" and c.check_encoder_config is False
    assert ConnectorConfig.from_extra({"store": "/x"}).check_encoder_config is True
