"""Loads onto an accelerator (:mod:`encache.connectors.vllm.device_copy`): the entry's
bytes go once into page-locked staging -- read from the scheduler's pinned file, copied
from the staged buffer, or read there by the lookup itself (``HostStaging``, a worker in
the scheduler's process) -- then to the device. No GPU here: the CPU runs the same reads
and views (pageable staging; the page-locked request fails as on any CPU-only torch), a
``meta`` device runs the worker's accelerator branch, a pageable stand-in for
``HostStaging`` (next to the real one, which falls back here) runs the lookup's one-pass
reads into staging, and the CUDA tests are skipped."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch

import mmap

from encache.connectors.lookup import EntryLookup
from encache.connectors.store import encode
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.vllm import device_copy
from encache.connectors.vllm.device_copy import DeviceCopier, HostStaging
from encache.connectors.vllm.loads import LoadItem

SHAPE = (256, 5376)  # one Gemma 3 image, fp16: 2.75 MB


@pytest.fixture
def entry(tmp_path):
    """A Gemma-3-sized entry staged by the lookup and pinned as the scheduler pins it:
    (LoadItem with bytes, LoadItem with only the pinned file, the stored array, store)."""
    store = DiskStore(tmp_path)
    arr = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float16)
    store.put("g", encode("g", arr.view(np.uint8), "F16", arr.shape, model="m"))
    lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, load_threads=1)
    st = lk.load_now("g")
    fd, ref = st.pin()
    assert st.offset > 0  # the tensor starts after the header: offsets are exercised
    try:
        yield (LoadItem("g", st.blob, st.offset, st.meta.dtype, st.meta.shape),
               LoadItem("g", None, st.offset, st.meta.dtype, st.meta.shape, ref), arr, store)
    finally:
        os.close(fd)
        lk.close()


def test_staging_from_the_pinned_file_and_from_bytes_is_the_entry(entry):
    staged, pinned, arr, _ = entry
    copier = DeviceCopier(torch.device("cpu"))
    assert copier.pin is False  # a CPU target stages in pageable memory
    for buf in (copier.from_file(pinned.ref, pinned.offset, arr.nbytes),
                copier.from_buffer(staged.blob, staged.offset, arr.nbytes),
                copier.from_buffer(bytes(memoryview(staged.blob)), staged.offset, arr.nbytes)):
        t = copier.to_device(buf, torch.float16, SHAPE)
        assert t.dtype == torch.float16 and tuple(t.shape) == SHAPE
        assert torch.equal(t, torch.from_numpy(arr))
    # cast after the copy: the stored bytes cross, the engine gets its dtype
    t = copier.to_device(copier.from_file(pinned.ref, pinned.offset, arr.nbytes),
                         torch.float16, SHAPE, torch.float32)
    assert t.dtype == torch.float32 and torch.equal(t, torch.from_numpy(arr.astype(np.float32)))


def test_no_page_locked_memory_falls_back_to_pageable_once(entry, caplog):
    """pin requested where no allocator can give it (a CPU-only torch, as here, or a
    locked-memory limit): pageable staging, one warning, the same tensor."""
    staged, pinned, arr, _ = entry
    copier = DeviceCopier(torch.device("cpu"), pin=True)
    with caplog.at_level(logging.WARNING, logger="encache.connector"):
        a = copier.to_device(copier.from_file(pinned.ref, pinned.offset, arr.nbytes),
                             torch.float16, SHAPE)
        b = copier.to_device(copier.from_buffer(staged.blob, staged.offset, arr.nbytes),
                             torch.float16, SHAPE)
    if torch.cuda.is_available():  # pragma: no cover - a GPU host pins
        pytest.skip("page-locked memory is available here")
    assert copier.pin is False and copier.stats == {"pinned": 0, "pageable": 2}
    assert len([r for r in caplog.records if "page-locked" in r.getMessage()]) == 1
    assert torch.equal(a, torch.from_numpy(arr)) and torch.equal(b, torch.from_numpy(arr))


def test_a_changed_pinned_file_is_refused(entry):
    _, pinned, arr, _ = entry
    pid, fd, version, path = pinned.ref
    stale = (pid, fd, (version[0], version[1] + 1, *version[2:]), path)
    with pytest.raises(RuntimeError, match="changed under the worker"):
        DeviceCopier(torch.device("cpu")).from_file(stale, pinned.offset, arr.nbytes)


def _worker(device: str, model_dtype=torch.float16):
    pytest.importorskip("vllm")  # (the GPU benchmark's machine runs this file without it)
    from encache.connectors.vllm.worker import EncacheWorkerConnector
    w = object.__new__(EncacheWorkerConnector)
    w.model_dtype = model_dtype
    w._device = torch.device(device)
    return w


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.float32])
def test_the_worker_takes_the_staging_path_for_a_non_cpu_device(entry, model_dtype):
    """``meta`` stands for an accelerator: the worker stages both item kinds and copies
    them to the device, cast there to the engine's dtype; the CPU path is unchanged."""
    staged, pinned, arr, _ = entry
    w = _worker("meta", model_dtype)
    for item in (staged, pinned):
        t = w._to_tensor(item)
        assert t.device.type == "meta" and t.dtype == model_dtype and tuple(t.shape) == SHAPE
    assert w._copier.stats["pageable"] == 2 and w._copier.pin is False  # no pinning on CPU torch
    cpu = _worker("cpu", model_dtype)._to_tensor(staged)
    assert torch.equal(cpu, torch.from_numpy(arr).to(model_dtype))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here or in CI")
def test_cuda_loads_are_pinned_and_asynchronous(entry):  # pragma: no cover - needs a GPU
    """The worker's accelerator path (``DeviceCopier.load``) for both item kinds: staged
    in page-locked memory, copied without blocking, the stored tensor on the device (and
    cast there to the engine's dtype)."""
    staged, pinned, arr, _ = entry
    copier = DeviceCopier(torch.device("cuda:0"))
    for item in (staged, pinned):
        t = copier.load(item)
        torch.cuda.current_stream().synchronize()
        assert t.is_cuda and torch.equal(t.cpu(), torch.from_numpy(arr))
    assert copier.stats["pinned"] == 2 and copier.stats["pageable"] == 0
    wide = copier.load(staged, torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide.cpu(), torch.from_numpy(arr).float())


def test_a_cpu_output_is_saved_as_is():
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    host, copied = DeviceCopier(torch.device("cpu")).to_host(t)
    assert host is t and copied is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here or in CI")
def test_cuda_outputs_reach_the_writer_after_the_step_stream_computed_them():  # pragma: no cover
    """vLLM computes on a dedicated non-blocking stream; the host copy is queued there and
    a writer thread waits on its event: it reads the finished output, not a partial one."""
    import threading

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # long enough that an unordered copy would race it
            x = x @ x / 4096
        host, copied = DeviceCopier(x.device).to_host(x)
    got = {}

    def writer():
        copied.synchronize()
        got["bytes"] = host.clone()
    th = threading.Thread(target=writer)
    th.start()
    th.join()
    assert host.is_pinned()
    assert torch.equal(got["bytes"], x.cpu())


class PageableStaging:
    """Stands in for :class:`HostStaging` where no page-locked memory can be had (here):
    the same buffers -- numpy views of torch tensors -- from pageable memory."""

    stages = True

    def __init__(self):
        self.given = []

    def __call__(self, n):
        buf = torch.empty(n, dtype=torch.uint8).numpy()
        self.given.append(buf)
        return buf


def _staging_lookup(store, staging):
    return EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, load_threads=1,
                       verify_ahead=False, remember_verified=False, host_staging=staging)


def _first_load(store, staging):
    """The first (hashed) load of the entry by a lookup reading into ``staging``."""
    lk = _staging_lookup(store, staging)
    try:
        return lk.load_now("g")
    finally:
        lk.close()


def test_host_staging_without_page_locked_memory_maps_as_a_cpu_engine(entry, caplog):
    """The real HostStaging on a CPU-only torch: one warning, private memory, and it no
    longer asks for hashed loads to be read into it (mapping costs less than a read into
    new private memory)."""
    _, _, arr, store = entry
    staging = HostStaging(torch.device("cuda"))
    with caplog.at_level(logging.WARNING, logger="encache.connector"):
        first = staging(4096)
        staging(4096)
    if torch.cuda.is_available():  # pragma: no cover - a GPU host pins
        pytest.skip("page-locked memory is available here")
    assert staging.stages is False and len(first) == 4096
    assert len([r for r in caplog.records if "page-locked" in r.getMessage()]) == 1
    lk = _staging_lookup(store, staging)
    try:
        st = lk.load_now("g")
        assert isinstance(st.blob, mmap.mmap)  # mapped and hashed over the mapping
        assert lk.metrics.pending("checksums") == 1
    finally:
        lk.close()


def test_a_hashed_first_load_is_read_into_staging_in_one_pass(entry, tmp_path):
    """With staging that stages, a disk entry whose bytes must be hashed is read into a
    staging buffer and hashed in the same pass (not mapped); a corrupt one is a miss; a
    version verified since is served from its mapping (nothing to hash: no read)."""
    _, _, arr, store = entry
    staging = PageableStaging()
    lk = _staging_lookup(store, staging)
    try:
        st = lk.load_now("g")
        assert len(staging.given) == 1 and st.blob is staging.given[0]
        assert isinstance(st.blob.base, torch.Tensor)  # what the worker's copy goes from
        assert lk.metrics.pending("checksums") == 1
        got = np.frombuffer(st.blob, np.float16, count=arr.size, offset=st.offset)
        assert np.array_equal(got.view(np.uint16), arr.reshape(-1).view(np.uint16))
        again = lk.load_now("g")
        assert len(staging.given) == 1 and isinstance(again.blob, mmap.mmap)
    finally:
        lk.close()
    bad = DiskStore(tmp_path / "bad")
    bad.put("g", encode("g", arr.view(np.uint8), "F16", arr.shape, model="m"))
    path = bad.entry_path("g")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # one flipped byte in the tensor
    path.write_bytes(bytes(raw))
    lk = _staging_lookup(bad, PageableStaging())
    try:
        assert lk.load_now("g") is None
        assert lk.metrics.pending("load_errors") == 1
    finally:
        lk.close()


def test_a_first_load_that_needs_no_hash_is_read_into_staging_too(entry):
    """A version on the store's log of versions verified this boot (a producer on this
    host vouched for it, EPD on one host; here the fixture's lookup hashed it) is not
    hashed again; with staging that stages it is still read into a staging buffer, one
    pass, not mapped and then copied into staging by the worker."""
    _, _, arr, store = entry
    staging = PageableStaging()
    lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, load_threads=1,
                     verify_ahead=False, host_staging=staging)
    try:
        assert lk.start_verify_done.wait(30)  # (the log is read at start)
        st = lk.load_now("g")
        assert len(staging.given) == 1 and st.blob is staging.given[0]
        assert lk.metrics.pending("checksums_skipped") == 1
        assert not lk.metrics.pending("checksums")
        got = np.frombuffer(st.blob, np.float16, count=arr.size, offset=st.offset)
        assert np.array_equal(got.view(np.uint16), arr.reshape(-1).view(np.uint16))
    finally:
        lk.close()


def test_the_worker_copies_to_the_device_straight_from_page_locked_staging(entry,
                                                                           monkeypatch):
    """A staged buffer the lookup read into page-locked staging is the device copy's
    source as it is: no second staging buffer, no host copy (page-lockedness stands in
    here: no allocator gives it on a CPU-only torch; the CUDA test below runs it)."""
    _, _, arr, store = entry
    st = _first_load(store, PageableStaging())
    monkeypatch.setattr(device_copy, "_page_locked", lambda t: True)
    copier = DeviceCopier(torch.device("cpu"), pin=True)
    buf = copier.from_buffer(st.blob, st.offset, arr.nbytes)
    assert buf.data_ptr() == st.blob.ctypes.data + st.offset  # the staging itself
    assert copier.stats == {"pinned": 1, "pageable": 0}
    assert torch.equal(copier.to_device(buf, torch.float16, SHAPE), torch.from_numpy(arr))
    # a buffer that is not a whole staging buffer is copied as before
    copied = copier.from_buffer(bytes(memoryview(st.blob)), st.offset, arr.nbytes)
    gpu = torch.cuda.is_available()  # (page-locked memory only where an accelerator is)
    assert copier.stats == {"pinned": 1 + gpu, "pageable": 0 if gpu else 1}
    assert torch.equal(copier.to_device(copied, torch.float16, SHAPE), torch.from_numpy(arr))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here or in CI")
def test_cuda_hashed_loads_read_into_page_locked_staging(entry):  # pragma: no cover
    _, _, arr, store = entry
    staging = HostStaging(torch.device("cuda"))
    st = _first_load(store, staging)
    assert staging.stages and st.blob.base.is_pinned()
    copier = DeviceCopier(torch.device("cuda:0"))
    t = copier.load(LoadItem("g", st.blob, st.offset, st.meta.dtype, st.meta.shape))
    torch.cuda.current_stream().synchronize()
    assert torch.equal(t.cpu(), torch.from_numpy(arr))
    assert copier.stats == {"pinned": 1, "pageable": 0}  # no second staging buffer
