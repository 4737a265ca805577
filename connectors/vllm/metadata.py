"""What the scheduler ships to the worker each step: load items in the connector metadata.

A :class:`LoadItem` is one verified entry the scheduler staged: its bytes (in-process
workers get the staged buffer itself, no copy) or, for large entries and workers in
other processes, a *pinned file* — the scheduler keeps the verified file open and the
worker opens it through ``/proc/<pid>/fd/<n>`` (:func:`pin_entry`, :func:`open_pinned`),
so the very inode that was verified is read even if the entry was replaced since. An
entry received from Redis (or read from a network filesystem) is pinned the same way
through the shared memory it was received into (:func:`pin_shared`). Otherwise the
tensor bytes travel out of band with pickle protocol 5 (vLLM's shared-memory queue).
Imports torch (dtype tables) and vLLM's metadata base class.
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from ..store import memfd
from ..store.files import READ_FLAGS, file_version

TORCH_DTYPES = {
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "BOOL": torch.bool,
}
DTYPE_CODES = {v: k for k, v in TORCH_DTYPES.items()}
DTYPE_BYTES = {k: torch.empty(0, dtype=v).element_size() for k, v in TORCH_DTYPES.items()}
#: the numpy type a tensor over a writable buffer is made through (:func:`tensor_over`);
#: BF16 has none: its 16 bits are viewed as bfloat16 after
_NUMPY_TYPES = {
    "F16": np.float16, "BF16": np.uint16, "F32": np.float32, "F64": np.float64,
    "I8": np.int8, "U8": np.uint8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
    "BOOL": np.bool_,
}


def tensor_over(blob, offset: int, dtype: str, shape) -> torch.Tensor:
    """A tensor of the stored ``dtype`` and ``shape`` over ``blob``'s bytes from
    ``offset``, no copy. A writable buffer (one a load read into, a copy-on-write
    mapping) goes through a numpy view: made cold, as right after a large read,
    ``torch.from_numpy`` over an ``np.ndarray`` measured 26-33 us here against 43-60 for
    ``torch.frombuffer`` and a view, a fifth of a 0.25 MB load. A read-only one (a Redis
    reply's bytes, a worker process's copy) goes through ``torch.frombuffer``, whose
    warning that it is read-only is silenced: the encoder cache never writes to it."""
    if offset % 8 == 0 and not isinstance(blob, bytes):
        view = np.ndarray(shape, _NUMPY_TYPES[dtype], blob, offset)
        if view.flags.writeable:
            t = torch.from_numpy(view)
            return t.view(torch.bfloat16) if dtype == "BF16" else t
    numel = 1
    for s in shape:
        numel *= s
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(blob, dtype=TORCH_DTYPES[dtype], count=numel, offset=offset)
    return t.view(shape)


#: entries at least this big reach multiprocess workers as pinned files (worker_loads auto)
WORKER_READS_MIN_BYTES = 1 << 20


@dataclass
class LoadItem:
    identifier: str
    blob: Any  # any buffer holding the whole entry (bytes, bytearray, uint8 array)
    offset: int
    dtype: str
    shape: tuple[int, ...]
    #: (scheduler pid, open fd, verified version, path or None) of an entry the scheduler
    #: pinned (a disk file, or shared memory: no path): a worker in another process opens
    #: it itself instead of receiving the bytes
    ref: tuple | None = None

    def __reduce_ex__(self, protocol):
        if self.ref is not None:  # the worker reads the pinned file (see open_pinned)
            return (_rebuild_load_item_ref, (self.identifier, self.offset, self.dtype,
                                             tuple(self.shape), self.ref))
        # Shipped to worker processes only with a multiprocess executor: send just the
        # tensor bytes. With pickle protocol 5 (vLLM's shared-memory message queue) they
        # go as an out-of-band PickleBuffer: written once from the staged buffer (often the
        # page cache itself) into the queue, instead of a tobytes() copy that the pickler
        # then copies again into its stream (tests/consumer/test_connector_pickle.py, issue #11).
        view = memoryview(self.blob).cast("B")
        nbytes = DTYPE_BYTES[self.dtype]
        for s in self.shape:
            nbytes *= s
        part = view[self.offset:self.offset + nbytes]
        payload = pickle.PickleBuffer(part) if protocol >= 5 else part.tobytes()
        return (_rebuild_load_item, (self.identifier, payload, self.dtype, tuple(self.shape)))


def pin_entry(store, identifier: str, version) -> tuple[int, tuple] | None:
    """Scheduler side: open a verified disk entry and check it is still that version;
    ``(fd, ref)`` for a :class:`LoadItem`, or None (replaced, purged: ship the bytes).
    A version verified from a write still in flight (EPD: PD loads what the encoder wrote
    before its commit) is pinned through that write's temp file: the commit renames it,
    keeping the inode, so the worker reads the verified bytes either way (shipping them
    in the step's metadata instead delays PD's step: docs/performance.md, EPD).
    The caller keeps ``fd`` open until the workers have read it."""
    if version is None:
        return None
    version = tuple(version)
    path = str(store.entry_path(identifier))

    def candidates():  # the committed file; else a write's temp file (listed only then);
        yield path     # else the committed file again (renamed meanwhile)
        yield from store.in_flight_paths(identifier)
        yield path

    for candidate in candidates():
        try:
            fd = os.open(candidate, READ_FLAGS)
        except OSError:
            continue
        try:
            if file_version(os.fstat(fd)) == version:
                return fd, (os.getpid(), fd, version, path)
        except OSError:
            pass
        os.close(fd)
    return None


def pin_shared(buf: memfd.SharedBuffer, identifier: str) -> tuple[int, tuple] | None:
    """Scheduler side: an entry received into shared memory (:mod:`..store.memfd`),
    sealed (its size fixed) and pinned as :func:`pin_entry` pins a file: ``(fd, ref)``,
    the caller keeps ``fd`` open until the workers have read it; None when it cannot be
    (no descriptor left: ship the bytes). The staged buffer may be evicted meanwhile:
    the duplicate descriptor keeps the memory."""
    try:
        memfd.seal(buf)
        fd = os.dup(buf.fd)
    except OSError:
        return None
    try:
        return fd, (os.getpid(), fd, file_version(os.fstat(fd)), None)
    except OSError:
        os.close(fd)
        return None


def _rebuild_load_item_ref(identifier, offset, dtype, shape, ref) -> LoadItem:
    return LoadItem(identifier, None, offset, dtype, shape, ref)


def open_ref(ref) -> tuple[int, os.stat_result]:
    """``(fd, stat)`` of an entry the scheduler verified and pinned, opened through the
    scheduler's own descriptor (``/proc/<pid>/fd/<n>``), so the very inode it verified is
    read even if the entry was replaced or purged since; the version is checked again (no
    checksum: the scheduler hashed this exact version). Falls back to the entry's path
    when /proc is not reachable, with the same version check (shared memory has no path).
    The caller closes ``fd``."""
    pid, fd, version, path = ref
    try:
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    except OSError:
        if path is None:
            raise
        f = os.open(path, READ_FLAGS)
    try:
        st = os.fstat(f)
        if file_version(st) != tuple(version):
            raise RuntimeError(f"encache: pinned entry {path or '(shared memory)'} changed "
                               "under the worker")
    except BaseException:
        os.close(f)
        raise
    return f, st


def open_pinned(ref, mmap_min: int):
    """A worker process's view of a pinned entry (:func:`open_ref`): a copy-on-write
    mapping, or for a small one a buffer read into."""
    import mmap

    path = ref[3] or "(shared memory)"
    f, st = open_ref(ref)
    try:
        if st.st_size >= mmap_min:
            return mmap.mmap(f, st.st_size, access=mmap.ACCESS_COPY)
        buf = bytearray(st.st_size)
        view, got = memoryview(buf), 0
        while got < st.st_size:
            n = os.readv(f, [view[got:]])
            if n == 0:
                raise RuntimeError(f"encache: pinned entry {path} is shorter than verified")
            got += n
        return buf
    finally:
        os.close(f)


def _rebuild_load_item(identifier, payload, dtype, shape) -> LoadItem:
    if not isinstance(payload, (bytes, bytearray)):
        payload = memoryview(payload)  # an out-of-band buffer (a zmq frame, a PickleBuffer)
    return LoadItem(identifier, payload, 0, dtype, shape)


@dataclass
class EncacheConnectorMetadata(ECConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)
    #: LoRA name -> adapter digest of the requests scheduled so far (producers stamp it)
    lora_digests: dict[str, str] = field(default_factory=dict)
    #: producers: items this step neither encodes nor finds in the store -- vLLM's own
    #: encoder cache answered them; the worker saves them from that cache
    resave: list[str] = field(default_factory=list)
    #: producers: identifier -> binding (digest of the processed inputs,
    #: :mod:`.binding`) of the items this step encodes or resaves: stamped into entries
    bindings: dict[str, str] = field(default_factory=dict)
