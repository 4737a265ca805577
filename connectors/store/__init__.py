"""The store core: entry codec, identifiers, and backends. Pure Python, no vLLM.

Imports nothing of encache outside this package (``tests/test_layers.py``). Its face:
:func:`open_store` (a URL -> the backend's store, found in :mod:`.registry`) and the
names below."""

from urllib.parse import urlsplit

from .base import COUNTER_NAMES, EntryInfo, LockBusy, Store, StoreError, StoreInfo
from .entry import CorruptEntry, EntryMeta, NewerFormat, decode, encode, encode_parts
from .registry import backend_for, check_url, names_local_path, open_backend
from .url import redact


def open_store(url: str, *, create: bool = True, local_tier: str | None = None,
               local_tier_max_bytes: int | None = None, local_tier_fsync: bool = False,
               **options) -> Store:
    """Open the store a URL names. ``options`` go to the backend (``max_bytes``, ``prefix``…).
    ``local_tier``: a directory on this node's disk in front of it (:mod:`.tiered`), holding
    at most ``local_tier_max_bytes``; its copies are not fsynced (``local_tier_fsync``):
    after a power loss a torn copy fails its checksum at its first load of the new boot,
    and the shared store serves it again."""
    if local_tier and not names_local_path(str(local_tier)):
        raise StoreError(f"a local tier is a directory on this node, not {redact(str(local_tier))}")
    store = open_backend(url, create=create, **options)
    if not local_tier:
        return store
    from .disk.store import DiskStore
    from .tiered import TieredStore

    try:
        tier = DiskStore(urlsplit(str(local_tier)).path or local_tier, max_bytes=local_tier_max_bytes,
                         fsync=local_tier_fsync,
                         **{k: v for k, v in options.items() if k == "read_threads"})
        return TieredStore(store, tier)
    except BaseException:
        store.close()
        raise


__all__ = [
    "COUNTER_NAMES", "CorruptEntry", "EntryInfo", "EntryMeta", "LockBusy", "NewerFormat",
    "Store", "StoreError", "StoreInfo", "backend_for", "check_url", "decode", "encode",
    "encode_parts", "open_store", "redact",
]
