"""Loaded entries on their way to the engine's encoder cache: no vLLM import.

A :class:`LoadItem` is one verified entry the scheduler staged: its bytes (in-process
workers get the staged buffer itself, no copy) or, for large entries and workers in
other processes, a *pinned* entry -- the scheduler keeps the verified file (or the shared
memory an entry was received into) open through the read's pin
(:meth:`~..store.loaded.Loaded.pin`) and the worker opens it through
``/proc/<pid>/fd/<n>`` (:func:`open_pinned`), so the very inode that was verified is
read even if the entry was replaced since. Otherwise the
tensor bytes travel out of band with pickle protocol 5 (vLLM's shared-memory queue).
:func:`tensor_over` makes the engine's tensor over a buffer. Imports torch (dtype
tables), not vLLM: the device-copy path (:mod:`.device_copy`) and the GPU benchmark run
without vLLM installed.
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..store.loaded import open_ref

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


def _rebuild_load_item_ref(identifier, offset, dtype, shape, ref) -> LoadItem:
    return LoadItem(identifier, None, offset, dtype, shape, ref)


def open_pinned(ref, mmap_min: int):
    """A worker process's view of a pinned entry (:func:`~..store.loaded.open_ref`): a copy-on-write
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
