"""Entries across the host/accelerator boundary, through page-locked memory, in stream order.

**Loads.** On a CPU engine the worker gives vLLM a view over the staged bytes (no copy).
On a GPU the entry must reach device memory, and a copy from pageable memory (an mmap, a
bytes object) makes the driver bounce it through its own small pinned buffer while the
step waits.
:class:`DeviceCopier` instead puts the bytes once into page-locked host memory -- read
straight from the scheduler's pinned file descriptor for a disk entry in another process,
copied from the staged buffer otherwise -- and queues the host-to-device copy with
``non_blocking=True`` on the current stream, the stream vLLM's model runner runs the step's
kernels on, so they see the copy done. When the worker runs in the scheduler's process
(one GPU per engine), the lookup reads or receives entries straight into that staging
(:class:`HostStaging`): a disk entry that must be hashed is read and hashed in one pass
into page-locked memory, a Redis value is received and verified into it, and the worker's
device copy goes from there with no second pass over the bytes on the host.

The staging memory comes from torch's caching host allocator (``pin_memory=True``): it
keeps freed page-locked blocks for reuse, and a non-blocking copy records an event on its
block, which is not handed out again before that copy has finished. So there is no buffer
pool here to alias an engine-owned tensor. When page-locked memory cannot be had (no
accelerator allocator, a locked-memory limit), pageable memory is used with a synchronous
copy, and the log says so once.

**Saves.** A producer's encoder output lives on the device, computed on vLLM's own stream
(a dedicated, non-blocking one on CUDA), and the entry is written by a writer thread
whose current stream is another: a plain ``.cpu()`` there could copy the bytes before the
tower's kernels have finished. :meth:`DeviceCopier.to_host` therefore queues the copy into
page-locked memory on the step's stream, where the step calls ``save_caches``, and hands
the writer an event to wait on before it reads the bytes; the step does not wait.

Not measured: no GPU here or in CI. The tests run this path on the CPU (pageable staging,
and the page-locked request failing as it does on a CPU-only torch).
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from ..store.loaded import open_ref
from .loads import DTYPE_BYTES, TORCH_DTYPES, LoadItem

log = logging.getLogger("encache.connector")


def _page_locked(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is page-locked (a CPU-only torch has none)."""
    try:
        return t.is_pinned()
    except RuntimeError:
        return False


def _pinned_base(blob) -> torch.Tensor | None:
    """The page-locked tensor a whole :class:`HostStaging` buffer views, or None."""
    base = getattr(blob, "base", None)
    if not isinstance(base, torch.Tensor) or not _page_locked(base):
        return None
    ctypes = getattr(blob, "ctypes", None)
    return base if ctypes is not None and ctypes.data == base.data_ptr() else None


class HostStaging:
    """The buffers a consumer's lookup reads or receives entries into when the worker
    that copies them to an accelerator runs in the same process: page-locked memory from
    torch's caching host allocator, as numpy views (the lookup's buffers are byte
    buffers) whose ``base`` is the page-locked tensor the worker's copy goes from
    (:meth:`DeviceCopier.from_buffer`). ``stages``: true while page-locked memory can be
    had, so a disk entry's first load is read into it (and hashed in the same pass when
    it must be) rather than mapped; where it cannot (no accelerator allocator, a
    locked-memory limit), private memory, and entries are mapped as on a CPU engine. Staged entries hold their buffer: page-locked memory in
    use stays within the lookup's ``staging_bytes`` and the loads in flight. The buffers
    are :meth:`DeviceCopier.staging`'s (``device``: where the worker copies them)."""

    def __init__(self, device: torch.device):
        self._copier = DeviceCopier(device, pin=True)

    @property
    def stages(self) -> bool:
        return self._copier.pin

    def __call__(self, n: int):
        return self._copier.staging(n).numpy()


class DeviceCopier:
    """Copies entries' bytes to ``device`` through page-locked staging (see the module)."""

    def __init__(self, device: torch.device, *, pin: bool | None = None):
        self.device = device
        #: stage in page-locked memory; None: when the device is an accelerator
        self.pin = device.type != "cpu" if pin is None else pin
        self.stats = {"pinned": 0, "pageable": 0}

    def staging(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` for one entry: page-locked while that can be had."""
        if self.pin:
            try:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.stats["pinned"] += 1
                return buf
            except RuntimeError as e:
                self.pin = False
                log.warning("encache: no page-locked host memory for loads to %s (%s): entries "
                            "are copied from pageable memory, synchronously", self.device,
                            str(e).splitlines()[0] if str(e) else type(e).__name__)
        self.stats["pageable"] += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def from_buffer(self, blob, offset: int, nbytes: int) -> torch.Tensor:
        """Staging filled from a buffer holding the entry (staged bytes, a received frame);
        a :class:`HostStaging` buffer is staging already: its page-locked tensor as is (a
        view of the original tensor, so the copy's completion event is recorded on the
        allocator's block and the block is not reused before the copy has finished)."""
        pinned = _pinned_base(blob) if self.pin and offset % 8 == 0 else None
        if pinned is not None:  # (8-aligned: any dtype can view it; safetensors aligns so)
            self.stats["pinned"] += 1
            return pinned[offset:offset + nbytes]
        buf = self.staging(nbytes)
        with warnings.catch_warnings():  # a read-only source is only read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.frombuffer(blob, dtype=torch.uint8, count=nbytes, offset=offset)
        buf.copy_(src)
        return buf

    def from_file(self, ref, offset: int, nbytes: int) -> torch.Tensor:
        """Staging filled by reading a pinned entry (a read's :meth:`~..store.loaded.Loaded.pin`)
        straight into it: one pass from the page cache, no mapping, no bounce."""
        f, _ = open_ref(ref)
        try:
            buf = self.staging(nbytes)
            view, got = memoryview(buf.numpy()), 0
            while got < nbytes:
                n = os.preadv(f, [view[got:]], offset + got)
                if n == 0:
                    where = ref[3] or "(shared memory)"
                    raise RuntimeError(f"encache: pinned entry {where} is shorter than verified")
                got += n
            return buf
        finally:
            os.close(f)

    def load(self, item: LoadItem, cast_to: torch.dtype | None = None) -> torch.Tensor:
        """A load item's tensor on the device: one pass into page-locked staging (read
        from its pinned file when it carries no bytes: a worker in another process), then
        the asynchronous copy, cast there to ``cast_to`` when given. The worker's
        accelerator path, and the GPU benchmark's (``scripts/bench/gpu``)."""
        nbytes = DTYPE_BYTES[item.dtype]
        for s in item.shape:
            nbytes *= s
        if item.blob is None:
            buf = self.from_file(item.ref, item.offset, nbytes)
        else:
            buf = self.from_buffer(item.blob, item.offset, nbytes)
        return self.to_device(buf, TORCH_DTYPES[item.dtype], tuple(item.shape), cast_to)

    def to_host(self, tensor: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """``(host tensor, event or None)``: a device tensor's copy queued on the current
        stream (the step's), into page-locked staging; the bytes are there once the event
        has completed (``event.synchronize()``, from any thread). A CPU tensor is returned
        as is; a device without CUDA events is copied synchronously, here."""
        if tensor.device.type == "cpu":
            return tensor, None
        if tensor.device.type != "cuda":
            return tensor.to("cpu"), None
        nbytes = tensor.numel() * tensor.element_size()
        host = self.staging(nbytes).view(tensor.dtype).view(tensor.shape)
        host.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def to_device(self, buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                  cast_to: torch.dtype | None = None) -> torch.Tensor:
        """The staged bytes as a ``dtype`` tensor of ``shape`` on the device (cast there to
        ``cast_to`` when given: the stored bytes cross, not a widened copy)."""
        t = buf.view(dtype).view(shape)
        t = t.to(self.device, non_blocking=buf.is_pinned())
        if cast_to is not None and t.dtype != cast_to:
            t = t.to(cast_to)
        return t
