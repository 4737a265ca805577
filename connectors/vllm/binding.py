"""An entry's binding: a digest of the processed inputs its encoder output was computed from.

vLLM keys an encoder output by an identifier that a client may choose (a request's
``uuid``). Inside one engine that trust lasts while the item is cached; in a persistent
store shared by many servers it would let one client decide what another client's
request loads: send image A with ``uuid`` set to image B's identifier, and every later
request for B would be answered from A's encoder output. So every writer records in the
entry (header field ``binding``) a digest of what the tower actually consumed -- the
item's ``MultiModalKwargsItem`` (``pixel_values``, ``image_grid_thw``, video frames, the
crops of pan-and-scan ...) -- and a consumer that holds the item's inputs digests its own
and serves the entry only when both agree (:class:`~.scheduler.EncacheSchedulerConnector`).

The digest is blake3 (cryptographic: the client controls the pixels, so a fast
non-cryptographic hash could be steered into a collision) over every field in key order,
each with its dtype and shape, nested lists element by element. The processed inputs are
what the model's HF processor made of the media in the API server; the same media, model
and processor settings give the same tensors in any process (tested across processes for
LLaVA, Qwen2-VL, InternVL and Gemma 3, single images, several images and video).

An entry whose identifier was computed from the item's own bytes (precompute's, and an
online producer's content hashes where client uuids are namespaced apart, :mod:`.uuids`:
header ``keyed_by: content``) is bound by that identifier: a consumer compares nothing
(:func:`binding_to_check`), so its first load costs no digest.

Cost: one blake3 pass over the inputs per request item that meets an entry under a
client uuid (or unbound), on every core from :data:`PARALLEL_BYTES` (a repeat whose inputs vLLM's
processor cache hands back is remembered); docs/performance.md gives the measured figures.
"""

from __future__ import annotations

import weakref
from typing import Callable

from blake3 import blake3

from ..store.entry import KEYED_BY_CONTENT

PREFIX = "blake3:"
#: inputs from this size are hashed on all cores (a thread hand-off costs more below)
PARALLEL_BYTES = 1 << 20
_MEMO_MAX = 4096
#: id(inputs) -> (weak reference to them, binding): vLLM's processor cache hands the same
#: ``MultiModalKwargsItem`` back for a repeated item, which is then not hashed again
_memo: dict[int, tuple] = {}


def binding_to_check(meta, inputs_binding: Callable[[], str | None]) -> str | None:
    """What a consumer compares a stored entry (its header ``meta``) with before serving
    it: nothing for an entry its writer keyed by the item's content (the identifier,
    computed from the item's bytes, binds it), else ``inputs_binding()`` -- the binding of
    the request's own inputs, digested only now that an entry needs it."""
    if meta.keyed_by == KEYED_BY_CONTENT:
        return None
    return inputs_binding()


def item_binding(data) -> str | None:
    """The binding of one item's processed inputs (a ``MultiModalKwargsItem``, or any
    mapping of field name -> element with ``.data`` or -> tensor), or None when there
    are none here (vLLM's processor cache restored them elsewhere: ``data`` is None, or
    a field's data was left out). Remembered per inputs object while it lives."""
    if data is None:
        return None
    known = _memo.get(id(data))
    if known is not None and known[0]() is data:
        return known[1]
    parts: list = []
    for key in sorted(data.keys()):
        elem = data[key]
        value = getattr(elem, "data", elem)
        if value is None:  # cached in the engine core: not here to digest
            return None
        parts.append(key.encode())
        if not _collect(value, parts):
            return None
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    # blake3's tree hashes large inputs on every core (the same digest as on one)
    h = blake3(max_threads=blake3.AUTO) if size >= PARALLEL_BYTES else blake3()
    for p in parts:
        h.update(p)
    binding = PREFIX + h.hexdigest()
    try:
        ref = weakref.ref(data)
    except TypeError:  # (a plain dict: not remembered)
        return binding
    if len(_memo) >= _MEMO_MAX:
        _memo.clear()
    _memo[id(data)] = (ref, binding)
    return binding


def _collect(value, parts: list) -> bool:
    """Append ``value``'s bytes (with its type, dtype and shape) to ``parts``; False when
    it holds something that cannot be digested the same way everywhere."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        parts.append(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            parts.append(memoryview(t.view(-1).view(torch.uint8).numpy()))
        return True
    if isinstance(value, (list, tuple)):
        parts.append(f"L{len(value)}".encode())
        return all(_collect(v, parts) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        parts.append(f"V{value!r}".encode())
        return True
    return False
