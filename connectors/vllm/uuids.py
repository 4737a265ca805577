"""Client uuids in a namespace of their own, so a content hash names only content.

vLLM lets a client name an item (a chat part's ``"uuid"``, ``multi_modal_uuids``): the
item's identifier is then that string, not a hash of the pixels, and the engine core
cannot tell the two apart. encache maps client uuids (all but the hex ones below), in
the API server, to :func:`uuid_identifier` -- ``"uuid="`` followed by 64 hex digits of
blake3 over the uuid's UTF-8 bytes -- before vLLM uses it. Such an identifier is never hex (vLLM's
content hashes are), holds no ``:`` (vLLM prefixes ``"{lora_name}:"`` after this, in
``InputProcessor._get_mm_identifier``), and is a file name the disk store keeps verbatim.
The same uuid maps to the same identifier on every server (EPD: the proxy sends one uuid
to the encoder and to prefill/decode), a uuid-only reference (a uuid with no data:
vLLM's cache reference) maps as the item it refers to did, and an identifier already in
the namespace maps to itself (a proxy may send PD the encoder's reported identifier).

Where vLLM hashes a given uuid again (request ``mm_processor_kwargs`` /
``media_io_kwargs`` hash factors, a model's own ``_get_mm_hashes`` such as H2OVL's), the
result is hex: it is mapped to ``"uuid="`` + that digest, so an item a client named stays
in the namespace whatever vLLM did with the name.

So an identifier outside the namespace (:func:`is_content_hash`) was computed by vLLM
from the item's bytes, and an online producer stamps its entry ``keyed_by: content``
(:func:`content_keying`): a consumer serves it without digesting its inputs. Entries
under the namespace keep the binding check (two clients may pick one uuid for different
pixels).

A uuid of 64 hex digits on an item that carries its data, of a modality whose
placeholders need no metadata, is not used at all: the item is keyed by its bytes
(:func:`_keyed_by_content`), so vLLM's EPD proxy, which names such items differently to
the encoder and to PD, still has PD find the encoder's entry.

The patch wraps ``BaseRenderer._process_multimodal`` (``vllm/renderers/base.py``, the
same in vLLM 0.32 and 0.34: every chat, completion and ``LLM`` request's media go
through it, with the request's uuids and the engine's ``VllmConfig``), and that
renderer's processor's ``_get_mm_hashes`` (so the processor cache is keyed by the hash
the item ends up with: vLLM 0.34 invalidates it by that hash). It is installed by
the general plugin in every process and acts only for a renderer whose engine uses an
encache connector that is not ``content_keyed`` (encache's own precompute and warm pass
identifiers they computed from the bytes: those must land where a request without a uuid
looks). A vLLM without that function (:func:`patch_target`) is left alone, said once, and
content keying is not claimed.

How the engine core knows: vLLM loads the general plugins in the API server (before it
builds the renderer) and in the engine core and each worker (before their connector
starts), from the same installation and environment (``VLLM_PLUGINS``). So the patch is
in place in the worker exactly when it is in the API server that launched it, and the
worker checks that directly (:func:`installed`) together with its config
(:func:`applies`).
Not covered: vLLM's scale-out token endpoints (``--enable-scale-out``) take item hashes
from the client as given; docs/security.md says so.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import re
import threading

from blake3 import blake3

from ..store.entry import KEYED_BY_CONTENT
from ..store.keys import split_lora
from . import CONNECTOR_MODULE, CONNECTOR_NAMES

log = logging.getLogger("encache.connector")

#: every client-named item's identifier starts with this (before any LoRA prefix)
UUID_PREFIX = "uuid="
#: vLLM's content hashes: hex digests (blake3 / sha256: 64 digits, sha512: 128)
_CONTENT_HASH = re.compile(r"[0-9a-f]{64}|[0-9a-f]{128}")


def uuid_identifier(uuid: str) -> str:
    """The identifier an item a client names ``uuid`` is stored under, on every server.
    A uuid already in the namespace is kept: a proxy may hand PD the identifier the
    encoder reported (``ec_transfer_params`` keys) rather than the uuid it sent."""
    if in_namespace(uuid):
        return uuid
    return UUID_PREFIX + blake3(uuid.encode("utf-8", "surrogatepass")).hexdigest()


def in_namespace(mm_hash: str) -> bool:
    """Whether a (LoRA-less) item hash is in the client-uuid namespace."""
    return mm_hash.startswith(UUID_PREFIX) and _CONTENT_HASH.fullmatch(
        mm_hash[len(UUID_PREFIX):]) is not None


def is_content_hash(identifier: str) -> bool:
    """Whether ``identifier`` (LoRA prefix allowed) is one vLLM computed from the item's
    bytes: hex of a digest's length. A client uuid is never one where :func:`applies`;
    vLLM's request-local names (both caches off: ``renderer0-mm-1-image-0``) are not."""
    return _CONTENT_HASH.fullmatch(split_lora(identifier)[1]) is not None


def keyed_by(identifier: str, *, content_keyed: bool, content_hashes_keyed: bool) -> str:
    """An entry's ``keyed_by`` header field: ``content`` when its identifier was computed
    from the item's bytes -- every identifier of a writer told so (``content_keyed``:
    precompute, warm), or a content hash where client uuids are namespaced apart
    (``content_hashes_keyed``: :func:`content_keying`) -- else empty (checked on load)."""
    if content_keyed or (content_hashes_keyed and is_content_hash(identifier)):
        return KEYED_BY_CONTENT
    return ""


def namespaces(ec_transfer_config) -> bool:
    """Whether an engine with this ``ec_transfer_config`` maps client uuids: it uses an
    encache connector (any role) that was not told its identifiers are content hashes."""
    if ec_transfer_config is None:
        return False
    name = getattr(ec_transfer_config, "ec_connector", None)
    module = getattr(ec_transfer_config, "ec_connector_module_path", None)
    if name not in CONNECTOR_NAMES and module != CONNECTOR_MODULE:
        return False
    extra = getattr(ec_transfer_config, "ec_connector_extra_config", None) or {}
    return extra.get("content_keyed") is not True


def installed() -> bool:
    """Whether the patch is in place in this process: vLLM ran encache's general plugin
    here (it does in the API server before it builds the renderer, and in the engine core
    and every worker before their connector starts), on a vLLM that has the functions it
    wraps. Not where ``VLLM_PLUGINS`` leaves the plugin out, or where encache is imported
    without its entry point (a connector named by module path alone)."""
    target = patch_target()
    return target is not None and getattr(target._process_multimodal, "_encache_uuids", False)


@functools.lru_cache(maxsize=1)
def patch_target():
    """vLLM's ``BaseRenderer`` when its ``_process_multimodal`` takes ``mm_uuids`` and its
    processors compute item hashes in ``_get_mm_hashes`` (what the patch wraps), else
    None."""
    try:
        from vllm.multimodal.processing.processor import BaseMultiModalProcessor
        from vllm.renderers.base import BaseRenderer
    except Exception:  # noqa: BLE001 - another vLLM layout
        return None
    fn = getattr(BaseRenderer, "_process_multimodal", None)
    if fn is None or not callable(getattr(BaseMultiModalProcessor, "_get_mm_hashes", None)):
        return None
    fn = getattr(fn, "__wrapped__", fn)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    return BaseRenderer if "mm_uuids" in params else None


def applies(vllm_config) -> bool:
    """Whether client uuids are namespaced for this engine's requests: its connector asks
    for it (:func:`namespaces`) and the patch is in place (:func:`installed`). The same
    answer in the API server and in the engine core's processes: one installation, one
    environment, one config; so they agree without talking."""
    return namespaces(getattr(vllm_config, "ec_transfer_config", None)) and installed()


def content_keying(vllm_config) -> bool:
    """Whether an online producer may stamp an entry whose identifier is a content hash
    ``keyed_by: content`` (:func:`applies`). An encache engine on a vLLM the patch does
    not know says so in one line: its entries keep the binding check."""
    if applies(vllm_config):
        return True
    if namespaces(getattr(vllm_config, "ec_transfer_config", None)):
        why = ("this vLLM has no BaseRenderer._process_multimodal(mm_uuids=...) to namespace "
               "client uuids in" if patch_target() is None else
               "vLLM did not load encache's general plugin (VLLM_PLUGINS, or encache "
               "installed without its entry point): client uuids are not namespaced")
        log.warning("encache: %s; every entry written here is checked against a request's "
                    "inputs when loaded", why)
    return False


def install() -> None:
    """Wrap ``BaseRenderer._process_multimodal`` (once per process; nothing on a vLLM
    without it: :func:`content_keying` says so for an encache engine)."""
    target = patch_target()
    if target is None:
        return
    original = target._process_multimodal
    if getattr(original, "_encache_uuids", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _process_multimodal(self, *args, **kwargs):
        on = getattr(self, "_encache_uuids_on", None)
        if on is None:
            on = applies(getattr(self, "config", None))
            self._encache_uuids_on = on
        if not on:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        given = bound.arguments.get("mm_uuids")
        if not given:
            return original(self, *args, **kwargs)
        processor = self.get_mm_processor()
        given, by_content = _keyed_by_content(given, bound.arguments.get("mm_data"),
                                              processor)
        mapped = bound.arguments["mm_uuids"] = _mapped(given)
        _hook_processor(processor)
        out = original(*bound.args, **bound.kwargs)
        # (a processor that bypasses _get_mm_hashes: its output is put right here)
        hashes = out.get("mm_hashes") if isinstance(out, dict) else None
        if hashes:
            out["mm_hashes"] = _kept_in_namespace(hashes, mapped)
            _remember(by_content, out["mm_hashes"])
        return out

    _process_multimodal._encache_uuids = True
    target._process_multimodal = _process_multimodal


class _Kept(str):
    """A content hash vLLM computed in this process, passed as an item's uuid as is."""


#: hex uuids whose items this process keyed by their bytes -> the hash vLLM gave the
#: item, so a later uuid-only reference (vLLM's processor-cache reference) names it too
#: ("" where one uuid came with two images: such a reference is then refused)
_ALIASES: collections.OrderedDict[str, str] = collections.OrderedDict()
_ALIASES_MAX = 65536
_aliases_lock = threading.Lock()


def _no_placeholder_metadata(processor, modality: str) -> bool:
    """Whether ``modality``'s placeholders need no metadata for this model (LLaVA, Gemma
    3: a fixed token count; Qwen-VL's need ``image_grid_thw``); False where vLLM does not
    say (nothing is then keyed otherwise)."""
    try:
        return not processor.info.data_parser.placeholder_metadata_fields(modality)
    except Exception:  # noqa: BLE001 - a vLLM without the declaration
        return False


def _as_list(uuids) -> list:
    """A modality's ``multi_modal_uuids`` value (one uuid, a list, or None) as a list."""
    return [uuids] if isinstance(uuids, str) else list(uuids or ())


def _keyed_by_content(mm_uuids: dict, mm_data, processor) -> tuple[dict, list]:
    """``mm_uuids`` with each uuid of 64 (or 128) hex digits on an item that carries its
    data, of a modality whose placeholders need no metadata, left out: vLLM then keys the
    item by its bytes, as the same item sent without a uuid. Why: vLLM's EPD proxy (0.32
    to 0.34, default mode) gives the encoder every item under sha256 of its URL and, for
    such a model, sends PD the raw item *without* it, so PD keys it by its bytes; keyed
    alike on every encache server, the encoder's entry is PD's (and precompute's entries
    serve both). A client's hex uuid gets the same: keyed by the pixels, never by a
    client's choice. A uuid-only reference (no data) to such an item gets the hash vLLM
    gave it in this process (:data:`_ALIASES`), as vLLM's own cache reference would.
    Returns ``(uuids, [(modality, index, uuid)] left out)``."""
    out, left_out = {}, []
    for modality, uuids in mm_uuids.items():
        single, items = isinstance(uuids, str), _as_list(uuids)
        if not any(isinstance(u, str) and _CONTENT_HASH.fullmatch(u) for u in items) \
                or not _no_placeholder_metadata(processor, modality):
            out[modality] = uuids
            continue
        data = (mm_data or {}).get(modality)
        datas = list(data) if isinstance(data, (list, tuple)) and not single else [data]
        kept = []
        for i, u in enumerate(items):
            if isinstance(u, str) and _CONTENT_HASH.fullmatch(u):
                item = datas[i] if i < len(datas) else None
                if item is None:  # a uuid-only reference
                    with _aliases_lock:
                        known = _ALIASES.get(u)
                    if known:
                        kept.append(_Kept(known))
                        continue
                elif not isinstance(item, dict):  # (a dict: embeddings, kept as named)
                    kept.append(None)
                    left_out.append((modality, i, u))
                    continue
            kept.append(u)
        out[modality] = kept[0] if single else kept
    return out, left_out


def _remember(left_out: list, hashes: dict) -> None:
    """Note the hash vLLM gave each item :func:`_keyed_by_content` left its uuid out of."""
    for modality, i, u in left_out:
        try:
            mm_hash = hashes[modality][i]
        except (KeyError, IndexError, TypeError):
            continue
        if is_content_hash(mm_hash):
            with _aliases_lock:
                # one uuid sent with two images (a client replacing another's): neither
                # (a reference then fails as an unknown uuid, never answered wrongly)
                known = _ALIASES.get(u)
                _ALIASES[u] = mm_hash if known in (None, mm_hash) else ""
                _ALIASES.move_to_end(u)
                while len(_ALIASES) > _ALIASES_MAX:
                    _ALIASES.popitem(last=False)


def _hook_processor(processor) -> None:
    """Wrap this processor's ``_get_mm_hashes`` (the model's own, if it has one) so that a
    hash vLLM computed again from a mapped uuid stays in the namespace *before* the
    processor cache is keyed by it: the sender cache, the engine core's receiver cache
    and vLLM 0.34's cache invalidations then all name an item alike."""
    if getattr(processor, "_encache_uuids", False):
        return
    original = processor._get_mm_hashes

    def _get_mm_hashes(inputs):
        hashes = original(inputs)
        named = getattr(inputs, "mm_uuid_items", None)
        return _kept_in_namespace(hashes, named) if named else hashes

    processor._get_mm_hashes = _get_mm_hashes
    processor._encache_uuids = True


def _mapped(mm_uuids: dict) -> dict:
    """``multi_modal_uuids`` with every given uuid mapped by :func:`uuid_identifier`."""
    def one(u):
        return u if u is None or isinstance(u, _Kept) else uuid_identifier(u)

    out = {}
    for modality, uuids in mm_uuids.items():
        if isinstance(uuids, str) or uuids is None:
            out[modality] = one(uuids)
        else:
            out[modality] = [one(u) for u in uuids]
    return out


def _kept_in_namespace(hashes, given) -> dict:
    """``hashes`` (modality -> item hashes) with each hash of an item named by a mapped
    uuid put back in the namespace where vLLM hashed it again (hash factors, a model's
    own ``_get_mm_hashes``). Where the hashes' modalities do not line up with the uuids'
    (a model's unified modality), every hash of the request goes in: such items then keep
    the binding check. Items named by anything else (a raw uuid: an engine the patch does
    not act for) are left as they are."""
    named = {m: [u if isinstance(u, str) and in_namespace(u) else None for u in _as_list(us)]
             for m, us in given.items()}
    named = {m: u for m, u in named.items() if any(u)}
    if not named:
        return hashes
    aligned = all(m in hashes and len(hashes[m]) == len(u) for m, u in named.items())
    out = dict(hashes)
    for modality, items in hashes.items():
        uuids = named.get(modality) if aligned else None
        kept = list(items)
        for i, mm_hash in enumerate(kept):
            named_here = uuids is not None and i < len(uuids) and uuids[i] is not None
            if (named_here or not aligned) and not in_namespace(mm_hash):
                kept[i] = UUID_PREFIX + mm_hash
        out[modality] = kept
    return out
