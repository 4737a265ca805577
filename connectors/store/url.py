"""Open a store from a URL: ``PATH`` / ``file://PATH`` (disk), ``redis://``,
``rediss://`` (TLS) or ``unix://`` (Redis). Also redacts passwords for display."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from .base import Store, StoreError

REDIS_SCHEMES = ("redis", "rediss", "unix")


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
            from .redis import RedisStore
        except ImportError as e:  # pragma: no cover - redis is a dependency
            raise StoreError(f"Redis support unavailable: {e}") from None
        redis_opts = {k: v for k, v in options.items() if k in RedisStore.OPTIONS}
        return RedisStore(url, **redis_opts)
    if scheme == "file":
        url = urlsplit(url).path
    elif scheme and len(scheme) > 1:
        raise StoreError(f"unsupported store URL scheme {scheme!r} (use a path, file://, redis://, rediss://, unix://)")
    from .disk import DiskStore

    disk_opts = {k: v for k, v in options.items() if k in ("max_bytes", "fsync", "eviction", "load_mode")}
    return DiskStore(url, create=create, **disk_opts)
