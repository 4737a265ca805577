"""The store core: entry codec, identifiers, and backends. Pure Python, no vLLM.

Imports nothing of encache outside this package (``tests/test_layers.py``). Its face:
:func:`open_store` (a URL -> the backend's store) and the names below."""

from urllib.parse import urlsplit

from .base import COUNTER_NAMES, EntryInfo, LockBusy, Store, StoreError, StoreInfo
from .entry import CorruptEntry, EntryMeta, decode, encode, encode_parts
from .url import CLUSTER_SCHEMES, REDIS_SCHEMES, redact


def open_store(url: str, *, create: bool = True, **options) -> Store:
    """Open the store a URL names. ``options`` go to the backend (``max_bytes``, ``prefix``…)."""
    if not url:
        raise StoreError("no store given (use --store PATH or redis://host:port/db)")
    scheme = urlsplit(url).scheme
    if scheme in REDIS_SCHEMES:
        try:
            if scheme in CLUSTER_SCHEMES:
                from .redis_cluster import RedisClusterStore as cls
            else:
                from .redis import RedisStore as cls
        except ImportError as e:  # pragma: no cover - redis is a dependency
            raise StoreError(f"Redis support unavailable: {e}") from None
        return cls(url, **{k: v for k, v in options.items() if k in cls.OPTIONS})
    if scheme == "file":
        url = urlsplit(url).path
    elif scheme and len(scheme) > 1:
        raise StoreError(f"unsupported store URL scheme {scheme!r} (use a path, file://, redis://, rediss://, unix://, "
                         "redis+cluster://, rediss+cluster://)")
    from .disk import DiskStore

    disk_opts = {k: v for k, v in options.items() if k in ("max_bytes", "fsync", "eviction", "load_mode")}
    return DiskStore(url, create=create, **disk_opts)

__all__ = [
    "COUNTER_NAMES", "CorruptEntry", "EntryInfo", "EntryMeta", "LockBusy", "Store",
    "StoreError", "StoreInfo", "decode", "encode", "encode_parts", "open_store", "redact",
]
