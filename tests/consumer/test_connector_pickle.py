"""LoadItem crossing a process boundary (multiprocess executor): the tensor bytes travel
out-of-band with pickle protocol 5 (vLLM's shared-memory queue), in-band otherwise, and
the worker's tensor is the stored one either way."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch

from encache.connectors.lookup import EntryLookup
from encache.connectors.store import encode
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.vllm.loads import LoadItem
from encache.connectors.vllm.scheduler import EncacheSchedulerConnector
from encache.connectors.vllm.worker import EncacheWorkerConnector


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
    w = object.__new__(EncacheWorkerConnector)
    w.model_dtype = torch.float16
    w._device = torch.device("cpu")
    return w


def consumer_scheduler(store, lookup, url: str):
    """The scheduler half of a consumer whose workers are other local processes (the
    fields ``build_connector_meta`` reads), over ``lookup``."""
    import collections

    from encache.connectors.vllm.config import ConnectorConfig

    c = object.__new__(EncacheSchedulerConnector)
    c.config = ConnectorConfig.from_extra({"store": url})
    c.store, c.lookup, c._worker_procs = store, lookup, True
    c._need_loads, c._pinned, c._pins = {}, {}, collections.deque()
    c._step, c._pinned_fds = 0, 0
    c.is_producer, c._lora_digests, c._stored = False, {}, {}  # a consumer
    c._step_bindings, c._expect, c._inputs, c._refused = {}, {}, {}, set()
    return c


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


def _child_load(data: bytes, conn) -> None:
    try:
        item = pickle.loads(data)
        assert item.blob is None and item.ref is not None
        t = worker()._to_tensor(item)
        conn.send(t.numpy().tobytes())
    except Exception as e:  # pragma: no cover - reported to the parent
        conn.send(repr(e))
    finally:
        conn.close()


def test_workers_read_a_pinned_entry_even_after_replace_and_purge(tmp_path):
    """worker_loads=files: the metadata carries a pinned file; a worker process reads the
    exact version the scheduler verified, even after the entry was rewritten and purged."""
    import multiprocessing as mp

    store = DiskStore(tmp_path)
    arr = np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float16)  # 2 MiB
    store.put("p", encode("p", arr.view(np.uint8), "F16", arr.shape, model="m"))
    lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, load_threads=1)
    try:
        st = lk.load_now("p")
        assert st.version is not None
        fd, ref = st.pin()  # the load's own record pins it (the disk store's file)
        item = LoadItem("p", st.blob, st.offset, st.meta.dtype, st.meta.shape, ref)
        data = pickle.dumps(item, protocol=5)
        assert len(data) < 1024  # no tensor bytes in the message
        other = np.zeros_like(arr)
        store.put("p", encode("p", other.view(np.uint8), "F16", other.shape, model="m"))
        assert st.pin() is None  # a new version: ship bytes instead
        store.delete("p")
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_load, args=(data, child))
        proc.start()
        got = parent.recv()
        proc.join(30)
        os.close(fd)
        assert got == arr.tobytes()
    finally:
        lk.close()


def test_an_entry_verified_in_flight_is_pinned_through_its_temp_file(tmp_path):
    """EPD: PD verifies the encoder's entry from its temp file before the commit; the
    scheduler pins that file (not the bytes into the step's metadata), and a worker
    process reads the verified bytes after the commit renamed it."""
    import multiprocessing as mp

    store = DiskStore(tmp_path)
    arr = np.random.default_rng(2).standard_normal((1024, 1024)).astype(np.float16)
    pinned = []

    def written():  # the bytes are written, the commit (fsync, rename) not yet
        assert store.in_flight("q") and not store.contains("q")
        read = store.read_in_flight("q")
        pinned.append((read.pin(), read, read.offset, read.meta))

    store.put("q", encode("q", arr.view(np.uint8), "F16", arr.shape, model="m"),
              on_written=written)
    (got, read, offset, meta), = pinned
    assert got is not None, "an in-flight version must be pinned, not shipped as bytes"
    fd, ref = got
    try:
        assert store.contains("q") and not store.in_flight("q")  # committed since
        data = pickle.dumps(LoadItem("q", None, offset, meta.dtype, meta.shape, ref),
                            protocol=5)
        assert len(data) < 1024
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_load, args=(data, child))
        proc.start()
        assert parent.recv() == arr.tobytes()
        proc.join(30)
        again = read.pin()  # the committed file: the same version
        assert again is not None
        os.close(again[0])
    finally:
        os.close(fd)


#: a worker process started afresh (it inherits nothing): reads the items it is sent (a
#: pickled list of pickled step items, each a reference, no bytes) and writes their tensor
#: bytes one after the other
WORKERS = r"""
import pickle, sys, torch
from encache.connectors.vllm.worker import EncacheWorkerConnector
w = object.__new__(EncacheWorkerConnector)
w.model_dtype, w._device = torch.float16, torch.device("cpu")
for data in pickle.loads(sys.stdin.buffer.read()):
    item = pickle.loads(data)
    assert item.blob is None and item.ref is not None
    sys.stdout.buffer.write(w._to_tensor(item).numpy().tobytes())
"""


def memfds() -> int:
    """How many of this process's descriptors are entries' shared memory."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:encache-entry")
        except OSError:
            pass
    return n


@pytest.mark.redis
def test_a_received_entry_reaches_a_worker_process_through_shared_memory(redis_server):
    """Redis, workers in other processes: an entry of 1 MiB+ is received into shared
    memory (a memfd) and ``build_connector_meta`` pins it, so the step's metadata carries
    no tensor bytes; a worker process started afresh (it inherits nothing) opens it
    through /proc and gets the exact bytes, even after the scheduler dropped its staged
    copy. A smaller entry stays private memory and rides as bytes. The memory goes once
    the pin is released."""
    import gc
    import subprocess
    import sys
    import uuid

    from encache.connectors.store import open_store
    from encache.connectors.store.memfd import SharedBuffer
    from encache.connectors.vllm.loads import WORKER_READS_MIN_BYTES

    store = open_store(redis_server.url, prefix=f"t-{uuid.uuid4().hex[:8]}:")
    big = np.random.default_rng(3).standard_normal((1024, 1024)).astype(np.float16)  # 2 MiB
    small = np.ones((64, 64), np.float16)
    store.put("big", encode("big", big.view(np.uint8), "F16", big.shape, model="m"))
    store.put("small", encode("small", small.view(np.uint8), "F16", small.shape, model="m"))
    lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, load_threads=1,
                     shared_from=WORKER_READS_MIN_BYTES)
    c = consumer_scheduler(store, lk, redis_server.url)
    before = memfds()
    try:
        c._need_loads = {"big": lk.load_now("big"), "small": lk.load_now("small")}
        assert isinstance(c._need_loads["big"].blob, SharedBuffer)
        assert not isinstance(c._need_loads["small"].blob, SharedBuffer)
        items = {i.identifier: i for i in c.build_connector_meta(None).loads}
        assert items["small"].ref is None and items["big"].ref is not None
        assert items["big"].ref[3] is None  # shared memory, not a file
        data = pickle.dumps(items["big"], protocol=5)
        assert len(data) < 1024  # no tensor bytes in the step's metadata
        del items
        lk.close()  # the staged copy is gone: the pin alone keeps the memory
        gc.collect()
        assert memfds() == before + 1
        out = subprocess.run([sys.executable, "-c", WORKERS], input=pickle.dumps([data]),
                             capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        assert out.stdout == big.tobytes()
    finally:
        c._release_pins(everything=True)
        lk.close()
        store.close()
    gc.collect()
    assert memfds() == before


@pytest.mark.redis
def test_a_local_tier_copy_reaches_a_worker_process_as_a_pinned_file(redis_server, tmp_path):
    """Redis with a local tier, workers in other processes: a load served from the
    node's tier copy is pinned as that file (the read's ``pin``), not shipped as bytes
    in the step's metadata; a worker process started afresh reads the exact bytes, also
    after the copy was dropped from the tier. A load served remotely goes through shared
    memory. (One worker process reads both items: starting one costs a vLLM import.)"""
    import subprocess
    import sys
    import uuid

    from encache.connectors.store import open_store
    from encache.connectors.store.memfd import SharedBuffer
    from encache.connectors.vllm.loads import WORKER_READS_MIN_BYTES

    store = open_store(redis_server.url, prefix=f"t-{uuid.uuid4().hex[:8]}:",
                       local_tier=str(tmp_path / "tier"))
    big = np.random.default_rng(4).standard_normal((1024, 1024)).astype(np.float16)  # 2 MiB
    store.put("big", encode("big", big.view(np.uint8), "F16", big.shape, model="m"))
    lookups, consumers, items = [], [], []
    try:
        for where in ("remote", "local"):
            lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600,
                             load_threads=1, shared_from=WORKER_READS_MIN_BYTES)
            lookups.append(lk)
            c = consumer_scheduler(store, lk, redis_server.url)
            consumers.append(c)
            st = lk.load_now("big")
            assert st is not None and st.source == where
            assert isinstance(st.blob, SharedBuffer) == (where == "remote")
            c._need_loads = {"big": st}
            item = c.build_connector_meta(None).loads[0]
            assert item.ref is not None
            assert (item.ref[3] is None) == (where == "remote")  # a path: the tier file
            items.append(pickle.dumps(item, protocol=5))
            assert len(items[-1]) < 1024  # no tensor bytes in the step's metadata
            if where == "remote":
                store.flush()  # the remote read's copy, written behind into the tier,
                store.sync()  # is served once a sync checked it
        store.tier.delete("big")  # the pinned file is still read
        out = subprocess.run([sys.executable, "-c", WORKERS], input=pickle.dumps(items),
                             capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr.decode()[-2000:]
        assert out.stdout == big.tobytes() * 2
    finally:
        for c in consumers:
            c._release_pins(everything=True)
        for lk in lookups:
            lk.close()
        store.close()


def test_worker_loads_setting_is_checked():
    from encache.connectors.vllm.config import ConnectorConfig
    assert ConnectorConfig.from_extra({"store": "/x"}).worker_loads == "auto"
    with pytest.raises(ValueError, match="worker_loads"):
        ConnectorConfig.from_extra({"store": "/x", "worker_loads": "maybe"})


def test_scheduler_pins_large_entries_and_releases_them(tmp_path, monkeypatch):
    """build_connector_meta (worker_loads auto): entries of 1 MiB+ go as pinned files,
    smaller ones as bytes; pins are closed once old enough, and capped."""
    store = DiskStore(tmp_path)
    big = np.ones((1024, 640), np.float16)  # 1.25 MiB
    small = np.ones((64, 64), np.float16)
    store.put("big", encode("big", big.view(np.uint8), "F16", big.shape, model="m"))
    store.put("small", encode("small", small.view(np.uint8), "F16", small.shape, model="m"))
    lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, load_threads=1)
    c = consumer_scheduler(store, lk, str(tmp_path))
    try:
        c._need_loads = {"big": lk.load_now("big"), "small": lk.load_now("small")}
        meta = c.build_connector_meta(None)
        refs = {i.identifier: i.ref for i in meta.loads}
        assert refs["small"] is None and refs["big"] is not None
        fd = refs["big"][1]
        pinned = os.fstat(fd)  # open while workers may read it
        monkeypatch.setattr(EncacheSchedulerConnector, "PIN_SECONDS", 0.0)
        for _ in range(EncacheSchedulerConnector.PIN_STEPS + 1):
            c.build_connector_meta(None)
        try:  # released: closed (its number may already name another thread's file)
            now = os.fstat(fd)
            assert (now.st_dev, now.st_ino) != (pinned.st_dev, pinned.st_ino)
        except OSError:
            pass
        assert c._pinned_fds == 0
        monkeypatch.setattr(EncacheSchedulerConnector, "PIN_MAX_FDS", 0)
        c._need_loads = {"big": lk.load_now("big")}
        assert c.build_connector_meta(None).loads[0].ref is None  # capped: bytes
    finally:
        c._release_pins(everything=True)
        lk.close()


def test_shared_memory_that_cannot_be_pinned_ships_as_bytes(monkeypatch):
    """No descriptor left to pin a received entry with: ``pin_shared`` says so (None) and
    the scheduler ships the bytes instead, never an error on the engine's step."""
    import errno

    from encache.connectors.store import loaded as loads
    from encache.connectors.store.memfd import shared_buffer

    buf = shared_buffer(1 << 20)
    fd, ref = loads.pin_shared(buf)
    os.close(fd)
    assert ref[0] == os.getpid() and ref[3] is None

    def dup(fd):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(loads.os, "dup", dup)
    assert loads.pin_shared(buf) is None
