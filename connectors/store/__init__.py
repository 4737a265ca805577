"""The store core: entry codec, identifiers, and backends. Pure Python, no vLLM.

Imports nothing of encache outside this package (``tests/test_layers.py``). Its face:
:func:`open_store` (a URL -> the backend's store) and the names below."""

from urllib.parse import urlsplit

from .base import COUNTER_NAMES, EntryInfo, LockBusy, Store, StoreError, StoreInfo
from .entry import CorruptEntry, EntryMeta, NewerFormat, decode, encode, encode_parts
from .url import CLUSTER_SCHEMES, REDIS_SCHEMES, redact


def open_store(url: str, *, create: bool = True, local_tier: str | None = None,
               local_tier_max_bytes: int | None = None, local_tier_fsync: bool = False,
               **options) -> Store:
    """Open the store a URL names. ``options`` go to the backend (``max_bytes``, ``prefix``…).
    ``local_tier``: a directory on this node's disk in front of it (:mod:`.tiered`), holding
    at most ``local_tier_max_bytes``; its copies are not fsynced (``local_tier_fsync``):
    after a power loss a torn copy fails its checksum at its first load of the new boot,
    and the shared store serves it again."""
    if local_tier and urlsplit(str(local_tier)).scheme not in ("", "file"):
        raise StoreError(f"a local tier is a directory on this node, not {redact(str(local_tier))}")
    store = _open_backend(url, create=create, **options)
    if not local_tier:
        return store
    from .disk import DiskStore
    from .tiered import TieredStore

    try:
        tier = DiskStore(urlsplit(str(local_tier)).path or local_tier, max_bytes=local_tier_max_bytes,
                         fsync=local_tier_fsync,
                         **{k: v for k, v in options.items() if k == "read_threads"})
        return TieredStore(store, tier)
    except BaseException:
        store.close()
        raise


def check_url(url: str):
    """``url``'s parts when it names a store a backend serves (nothing is opened: the
    store need not exist yet); else :class:`StoreError`, as :func:`open_store` raises."""
    if not url:
        raise StoreError("no store given (use --store PATH or redis://host:port/db)")
    try:
        parts = urlsplit(url)
    except ValueError as e:  # e.g. an unclosed "[" of an IPv6 host
        raise StoreError(f"bad store URL {redact(url)}: {e}") from None
    scheme = parts.scheme
    if scheme == "file" and (parts.netloc not in ("", "localhost") or not parts.path):
        raise StoreError(f"a file:// URL names a path on this host (file:///abs/path), "
                         f"not {url!r}")
    if scheme and len(scheme) > 1 and scheme not in (*REDIS_SCHEMES, "file"):
        raise StoreError(f"unsupported store URL scheme {scheme!r} (use a path, file://, "
                         "redis://, rediss://, unix://, redis+cluster://, rediss+cluster://)")
    return parts


def _open_backend(url: str, *, create: bool = True, **options) -> Store:
    parts = check_url(url)
    scheme = parts.scheme
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
        url = parts.path
    from .disk import DiskStore

    disk_opts = {k: v for k, v in options.items()
                 if k in ("max_bytes", "fsync", "eviction", "load_mode", "read_threads")}
    return DiskStore(url, create=create, **disk_opts)

__all__ = [
    "COUNTER_NAMES", "CorruptEntry", "EntryInfo", "EntryMeta", "LockBusy", "NewerFormat",
    "Store", "StoreError", "StoreInfo", "check_url", "decode", "encode", "encode_parts",
    "open_store", "redact",
]
