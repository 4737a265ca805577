"""The entry codec: checksum algorithms and header validation."""

import struct

import numpy as np
import pytest
import xxhash

from encache.connectors.store.entry import (FILE_CHUNK, HASH_PIECE, STREAM_CHUNK, CorruptEntry,
                                            NewerFormat, checksum, decode, encode,
                                            read_verified)
from entries import rewrite_header


def test_new_entries_use_xxh3_in_pieces_and_detect_a_flip():
    arr = np.arange(64, dtype=np.float16)
    b = encode("x", arr.view(np.uint8), "F16", arr.shape)
    meta, data = decode(b)
    assert meta.checksum.startswith("xxh3_128x512k:")
    assert np.array_equal(np.frombuffer(data, np.float16), arr)
    flipped = bytearray(b)
    flipped[-1] ^= 1
    with pytest.raises(CorruptEntry, match="checksum"):
        decode(bytes(flipped))


@pytest.mark.parametrize("nbytes", [0, 1, HASH_PIECE - 1, HASH_PIECE, HASH_PIECE + 1,
                                    3 * HASH_PIECE + 5])
def test_the_piecewise_checksum_is_what_its_name_says(nbytes):
    """``xxh3_128x512k``: XXH3-128 of each 512 KiB of the tensor bytes (the last piece
    shorter), then XXH3-128 of the digests in order; written here from its definition,
    not from the codec."""
    data = np.random.default_rng(nbytes).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    pieces = [data[i:i + (512 << 10)] for i in range(0, len(data), 512 << 10)]
    want = xxhash.xxh3_128_hexdigest(b"".join(xxhash.xxh3_128_digest(p) for p in pieces))
    assert checksum(data) == "xxh3_128x512k:" + want


def test_entries_with_one_xxh3_over_their_bytes_still_verify():
    """What encache wrote before the piecewise checksum."""
    arr = np.random.default_rng(1).standard_normal(300_000).astype(np.float32)
    b = _with_metadata(encode("x", arr.view(np.uint8), "F32", arr.shape),
                       checksum="xxh3_128:" + xxhash.xxh3_128_hexdigest(arr.tobytes()))
    assert decode(b)[0].checksum.startswith("xxh3_128:")
    for chunk in (STREAM_CHUNK, FILE_CHUNK):
        buf = bytearray(len(b))
        assert read_verified(_reader(b, 1 << 30), len(b), buf, chunk=chunk)[0].shape == arr.shape
    bad = bytearray(b)
    bad[-5] ^= 2
    with pytest.raises(CorruptEntry) as e:
        decode(bytes(bad))
    assert e.value.reason == "checksum"


def test_blake3_entries_still_verify():
    from blake3 import blake3
    arr = np.ones(32, np.float32)
    b = _with_metadata(encode("x", arr.view(np.uint8), "F32", arr.shape),
                       checksum="blake3:" + blake3(arr.tobytes()).hexdigest())
    assert decode(b)[0].checksum.startswith("blake3:")
    bad = bytearray(b)
    bad[-2] ^= 4
    with pytest.raises(CorruptEntry) as e:
        decode(bytes(bad))
    assert e.value.reason == "checksum"


def test_an_unknown_checksum_algorithm_is_a_newer_encaches_entry():
    """Not corruption: a checksum this build does not know is one a newer encache wrote
    (an older build called the piecewise checksum ``bad-header`` and its repair removed
    every entry); judged from the header alone, with or without a checksum pass."""
    arr = np.ones(4, np.float32)
    b = _with_metadata(encode("x", arr.view(np.uint8), "F32", arr.shape),
                       checksum="md5:abc")
    for verify in (True, False):
        with pytest.raises(NewerFormat) as e:
            decode(b, verify=verify)
        assert e.value.reason == "newer-format" and "'md5'" in str(e.value)
    with pytest.raises(NewerFormat):
        read_verified(_reader(b, 1 << 30), len(b), bytearray(len(b)), chunk=FILE_CHUNK)


@pytest.mark.parametrize("fmt", ["2", "1.1", "x"])
def test_an_unknown_entry_format_is_a_newer_encaches_entry(fmt):
    """Any ``encache_format`` but those this build reads, before anything else of the
    header is judged: a newer format may describe its tensor otherwise (here: none)."""
    arr = np.ones(4, np.float32)
    b = _with_metadata(encode("x", arr.view(np.uint8), "F32", arr.shape), encache_format=fmt)
    with pytest.raises(NewerFormat, match=repr(fmt)):
        decode(b)
    no_tensor = rewrite_header(b, lambda h: h.update(pieces=[h.pop("ec_cache")]))
    with pytest.raises(NewerFormat):
        decode(no_tensor, verify=False)
    garbled = rewrite_header(no_tensor, lambda h: h["__metadata__"].update(encache_format="1"))
    with pytest.raises(CorruptEntry) as e:  # a known format's bad header is corrupt
        decode(garbled)
    assert e.value.reason == "bad-header"


def test_every_entry_layout_this_repository_wrote_still_reads():
    """Format 1 with each checksum encache has written (blake3, xxh3_128, the piecewise
    xxh3_128x512k) and a legacy entry (no metadata: ECExampleConnector's)."""
    from blake3 import blake3
    arr = np.arange(40, dtype=np.float32)
    data = arr.tobytes()
    current = encode("x", arr.view(np.uint8), "F32", arr.shape)
    for recorded in ("blake3:" + blake3(data).hexdigest(),
                     "xxh3_128:" + xxhash.xxh3_128_hexdigest(data), checksum(data)):
        meta, got = decode(_with_metadata(current, checksum=recorded))
        assert meta.checksum == recorded and bytes(got) == data
    legacy = rewrite_header(current, lambda h: h.pop("__metadata__"))
    meta, got = decode(legacy)
    assert meta.legacy and bytes(got) == data


@pytest.mark.parametrize("blob, reason", [
    (b"", "truncated"), (b"\x00" * 8, "bad-header"), (struct.pack("<Q", 10) + b"{", "truncated"),
    (struct.pack("<Q", 8) + b"not json", "bad-header"),
])
def test_malformed_blobs(blob, reason):
    with pytest.raises(CorruptEntry) as e:
        decode(blob)
    assert e.value.reason == reason


def _with_tensor(blob: bytes, **info) -> bytes:
    """``blob`` with its tensor description's fields replaced (``None``: removed)."""
    def mutate(header):
        for k, v in info.items():
            if v is None:
                header["ec_cache"].pop(k)
            else:
                header["ec_cache"][k] = v
    return rewrite_header(blob, mutate)


@pytest.mark.parametrize("info, reason", [
    ({"shape": [-4, -4]}, "bad-header"), ({"shape": ["a", 4]}, "bad-header"),
    ({"shape": None}, "bad-header"), ({"shape": 16}, "bad-header"),
    ({"shape": [4, 3]}, "wrong-shape"), ({"data_offsets": [0]}, "bad-header"),
    ({"data_offsets": [0, 32, 64]}, "bad-header"), ({"data_offsets": [32, 0]}, "bad-header"),
    ({"dtype": "F12"}, "bad-header"), ({"dtype": []}, "bad-header"),
    ({"dtype": {"F16": 2}}, "bad-header"),
    ({"shape": [8, 4], "data_offsets": [0, 64]}, "truncated"),
])
def test_malformed_tensor_descriptions(info, reason):
    arr = np.ones((4, 4), np.float16)
    b = _with_tensor(encode("x", arr.view(np.uint8), "F16", arr.shape), **info)
    with pytest.raises(CorruptEntry) as e:
        decode(b)
    assert e.value.reason == reason


@pytest.mark.parametrize("key, value", [
    ("created", [1]), ("identifier", {"x": 1}), ("model", ["m"]), ("checksum", 7),
    ("encoder_config", None), ("note", 1.5)])
def test_a_metadata_value_that_is_not_a_string_is_a_bad_header(key, value):
    """safetensors metadata holds strings only; anything else is a corrupt entry (one
    hostile header once stopped ``encache list``, ``verify`` and ``stats`` with a
    ``TypeError``), and an empty ``created`` is no time."""
    arr = np.ones(4, np.float16)
    b = encode("x", arr.view(np.uint8), "F16", arr.shape)
    assert decode(_with_metadata(b, created=""))[0].created is None
    with pytest.raises(CorruptEntry) as e:
        decode(_with_metadata(b, **{key: value}))
    assert e.value.reason == "bad-header"


def _with_metadata(blob: bytes, **md) -> bytes:
    """``blob`` with these header metadata values (a checksum of another algorithm, a
    value that is not a string)."""
    return rewrite_header(blob, lambda header: header["__metadata__"].update(md))


def test_unknown_metadata_is_kept_and_a_scalar_shape_is_allowed():
    data = np.ones(1, np.float32).tobytes()
    b = encode("x", data, "F32", ())
    meta, view = decode(b)
    assert meta.shape == () and meta.extra == {} and view.nbytes == 4
    meta = decode(_with_metadata(b, note="kept"))[0]
    assert meta.extra == {"note": "kept"} and meta.identifier == "x"


def _reader(blob: bytes, most: int):
    """A ``readinto`` over ``blob`` that returns at most ``most`` bytes a call (a socket's
    short reads)."""
    pos = 0

    def readinto(view) -> int:
        nonlocal pos
        n = min(len(view), most, len(blob) - pos)
        view[:n] = blob[pos:pos + n]
        pos += n
        return n
    return readinto


@pytest.mark.parametrize("chunk", [4096, 100_003, STREAM_CHUNK, HASH_PIECE + 1, FILE_CHUNK])
def test_read_verified_over_several_pieces_in_any_steps(chunk):
    """Steps that end inside a piece, on a piece's end, or span pieces: the digests are
    the pieces'; a flipped byte in any piece is caught."""
    arr = np.random.default_rng(2).integers(0, 255, 3 * HASH_PIECE + 777, dtype=np.uint8)
    blob = encode("x", arr, "U8", arr.shape)
    buf = bytearray(len(blob))
    meta, offset = read_verified(_reader(blob, 1 << 30), len(blob), buf, chunk=chunk)
    assert bytes(buf) == blob
    for at in (offset, offset + HASH_PIECE - 1, offset + HASH_PIECE, len(blob) - 1):
        bad = bytearray(blob)
        bad[at] ^= 1
        with pytest.raises(CorruptEntry) as e:
            read_verified(_reader(bytes(bad), 1 << 30), len(blob), bytearray(len(blob)),
                          chunk=chunk)
        assert e.value.reason == "checksum"


@pytest.mark.parametrize("chunk", [8, 100, 4096, STREAM_CHUNK, FILE_CHUNK])
@pytest.mark.parametrize("most", [7, 1 << 30])
def test_read_verified_in_any_steps(chunk, most):
    """One pass, whatever the step and however short each read: the header may end in
    any step and the tensor span several; a flipped byte in any step is caught, and a
    source that ends early is ``truncated``."""
    arr = np.arange(3000, dtype=np.float32)
    blob = encode("x", arr.view(np.uint8), "F32", arr.shape)
    buf = bytearray(len(blob))
    meta, offset = read_verified(_reader(blob, most), len(blob), buf, chunk=chunk,
                                 identifier="x")
    assert bytes(buf) == blob and meta.shape == (3000,) and offset == len(blob) - arr.nbytes
    for at in (offset, offset + 4099, len(blob) - 1):
        bad = bytearray(blob)
        bad[at] ^= 1
        with pytest.raises(CorruptEntry) as e:
            read_verified(_reader(bytes(bad), most), len(blob), bytearray(len(blob)),
                          chunk=chunk)
        assert e.value.reason == "checksum"
    with pytest.raises(CorruptEntry) as e:
        read_verified(_reader(blob[:-5], most), len(blob), bytearray(len(blob)), chunk=chunk)
    assert e.value.reason == "truncated"
    with pytest.raises(CorruptEntry) as e:
        read_verified(_reader(blob, most), len(blob), bytearray(len(blob)), chunk=chunk,
                      identifier="y")
    assert e.value.reason == "wrong-identifier"
