"""The one helper tests use to write an encache entry into a store.

``put_entry(store, ident)`` encodes a float16 tensor with encache's codec
(:func:`encache.connectors.store.encode`), stores it under ``ident`` and returns the
entry's bytes. A module whose entries have another shape binds its defaults once, e.g.
``put = functools.partial(put_entry, rows=4, fill=0.0)``. ``big_blob`` is an entry's bytes
of a chosen size (not stored), for stores' large-value paths; ``rewrite_header`` an
entry's bytes with another header (another checksum, a hostile or foreign layout).
"""

from __future__ import annotations

import json
import struct

import numpy as np

from encache.connectors.store import encode, encode_parts


def put_entry(store, ident: str, rows: int = 64, seed: int = 0, *, width: int = 8,
              model: str = "m", fill: float | None = None, array: np.ndarray | None = None,
              **meta) -> bytes:
    """Store an entry under ``ident``; return its bytes.

    The tensor is ``array`` (float16) if given; else ``rows`` x ``width`` float16 values,
    all ``fill`` if given, otherwise standard-normal ones drawn from ``seed`` (so equal
    arguments give equal bytes, apart from the ``created`` time). ``model`` and ``meta``
    (``lora``, ``created``, ``encoder_config``, ...) go into the entry's header.
    """
    if array is None:
        if fill is not None:
            array = np.full((rows, width), fill, dtype=np.float16)
        else:
            array = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float16)
    if array.dtype != np.float16:
        raise TypeError(f"put_entry writes float16 tensors, not {array.dtype}")
    b = encode(ident, array.view(np.uint8), "F16", array.shape, model=model, **meta)
    store.put(ident, b)
    return b


def big_blob(identifier: str, nbytes: int, seed: int = 0) -> bytes:
    """The bytes of an entry of ``nbytes`` random uint8 values (drawn from ``seed``)."""
    arr = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    return b"".join(encode_parts(identifier, arr, "U8", arr.shape, model="m"))


def rewrite_header(data: bytes, mutate=None, *, gap: int = 0,
                   separators: tuple[str, str] = (",", ":")) -> bytes:
    """``data`` (an entry's bytes) with its safetensors header re-encoded after
    ``mutate(header_dict)``; ``gap`` bytes put between the header and the tensor, its
    ``data_offsets`` moved by as much (a layout safetensors allows, encache never
    writes); ``separators``: the JSON's (another writer's spacing)."""
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    if mutate is not None:
        mutate(header)
    if gap:
        begin, end = header["ec_cache"]["data_offsets"]
        header["ec_cache"]["data_offsets"] = [begin + gap, end + gap]
    raw = json.dumps(header, separators=separators).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + b"g" * gap + data[8 + n:]
