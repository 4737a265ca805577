"""LoadItem crossing a process boundary (multiprocess executor): the tensor bytes travel
out-of-band with pickle protocol 5 (vLLM's shared-memory queue), in-band otherwise, and
the worker's tensor is the stored one either way."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from encache.connectors.lookup import EntryLookup
from encache.connectors.store import encode
from encache.connectors.store.disk import DiskStore
from encache.connectors.vllm.connector import EncacheConnector, LoadItem


@pytest.fixture
def staged(tmp_path):
    store = DiskStore(tmp_path)
    arr = np.random.default_rng(0).standard_normal((1024, 640)).astype(np.float16)  # 1.25 MiB
    store.put("x", encode("x", arr.view(np.uint8), "F16", arr.shape, model="m"))
    lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, load_threads=1)
    st = lk.load_now("x")
    yield LoadItem("x", st.blob, st.offset, st.meta.dtype, st.meta.shape), arr
    lk.close()


def worker():
    w = object.__new__(EncacheConnector)
    w.model_dtype = torch.float16
    w._device = torch.device("cpu")
    return w


def test_protocol5_ships_the_tensor_out_of_band(staged):
    item, arr = staged
    oob = []
    data = pickle.dumps(item, protocol=5, buffer_callback=oob.append)
    assert len(oob) == 1 and oob[0].raw().nbytes == arr.nbytes  # the bytes, not copied in
    assert len(data) < 1024
    got = pickle.loads(data, buffers=[bytearray(b.raw()) for b in oob])
    assert got.offset == 0 and tuple(got.shape) == arr.shape
    assert torch.equal(worker()._to_tensor(got), torch.from_numpy(arr))
    # a read-only out-of-band buffer (a zmq frame) works too, without a warning
    ro = pickle.loads(data, buffers=[bytes(oob[0].raw())])
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(worker()._to_tensor(ro), torch.from_numpy(arr))


@pytest.mark.parametrize("protocol", [4, 5])
def test_in_band_pickles_carry_only_the_tensor(staged, protocol):
    item, arr = staged
    data = pickle.dumps(item, protocol=protocol)
    assert arr.nbytes <= len(data) < arr.nbytes + 1024  # no header or file padding
    got = pickle.loads(data)
    assert torch.equal(worker()._to_tensor(got), torch.from_numpy(arr))
