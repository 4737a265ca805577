"""``tensor_over``: the tensor the engine's encoder cache holds, made over a load's
buffer without a copy, for every stored dtype and every kind of buffer a load hands
over (a buffer read into, a copy-on-write mapping, a Redis reply's bytes, a read-only
out-of-band frame), with no warning."""

from __future__ import annotations

import mmap
import warnings

import numpy as np
import pytest
import torch

from encache.connectors.vllm.loads import TORCH_DTYPES, tensor_over

SHAPE = (3, 5)
OFFSET = 16


def _source(dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(SHAPE, generator=g) * 50
    return t > 0 if dtype == "BOOL" else t.to(TORCH_DTYPES[dtype])


def _entry_bytes(t: torch.Tensor) -> bytes:
    return b"h" * OFFSET + t.contiguous().view(torch.uint8).numpy().tobytes() + b"tail"


def _buffers(raw: bytes, tmp_path):
    arr = np.frombuffer(raw, np.uint8).copy()
    yield "array", arr, True
    yield "bytearray", bytearray(raw), True
    path = tmp_path / "entry"
    path.write_bytes(raw)
    with open(path, "rb") as f:
        yield "mapping", mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), True
    yield "bytes", raw, False
    yield "readonly view", memoryview(raw), False
    ro = np.frombuffer(raw, np.uint8)  # a read-only array
    yield "readonly array", ro, False


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES))
def test_every_dtype_over_every_buffer(dtype, tmp_path):
    want = _source(dtype)
    raw = _entry_bytes(want)
    for kind, buf, writable in _buffers(raw, tmp_path):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            t = tensor_over(buf, OFFSET, dtype, SHAPE)
        assert t.dtype == want.dtype and tuple(t.shape) == SHAPE, kind
        assert torch.equal(t, want), kind
        if writable:  # a view of the load's buffer, not a copy
            ptr = np.frombuffer(buf, np.uint8).ctypes.data
            assert t.data_ptr() == ptr + OFFSET, kind


def test_an_offset_off_the_alignment_still_gives_the_tensor():
    """safetensors aligns its data on 8 bytes; a buffer that is not (a legacy writer's)
    takes the general path."""
    want = _source("F32")
    raw = b"h" * 4 + want.view(torch.uint8).numpy().tobytes()
    t = tensor_over(np.frombuffer(raw, np.uint8).copy(), 4, "F32", SHAPE)
    assert torch.equal(t, want)


def test_a_short_buffer_is_an_error_not_a_tensor_past_its_end():
    raw = np.zeros(OFFSET + 10, np.uint8)
    with pytest.raises((TypeError, ValueError)):
        tensor_over(raw, OFFSET, "F32", SHAPE)
