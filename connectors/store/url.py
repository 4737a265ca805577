"""Open a store from a URL: ``PATH`` / ``file://PATH`` (disk), ``redis://``,
``rediss://`` (TLS) or ``unix://`` (Redis), ``redis+cluster://host:port[,host:port…]`` or
``rediss+cluster://`` (Redis Cluster). Also redacts passwords for display."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from .base import Store, StoreError

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
REDIS_SCHEMES = ("redis", "rediss", "unix") + CLUSTER_SCHEMES


def is_redis_url(url: str) -> bool:
    return urlsplit(url).scheme in REDIS_SCHEMES


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (safe to print and log).

    Edits the string in place rather than re-assembling it (``urlunsplit`` would turn
    ``unix:///path`` into ``unix:/path``).
    """
    parts = urlsplit(url)
    if parts.password is not None:
        prefix = parts.scheme + "://"
        userinfo, _, hostpart = parts.netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        url = prefix + f"{user}:***@{hostpart}" + url[len(prefix) + len(parts.netloc):]
    return re.sub(r"(password=)[^&#]*", r"\1***", url)


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
