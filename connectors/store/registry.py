"""The backend registry: which backend serves a store URL, the options it takes, and
whether its URL names a path on this host. Opening a URL is one lookup here
(:func:`open_backend`); nothing above the store asks what kind a store is.

Each :class:`Backend` declares its URL schemes (``""``: a bare path), its options
(:class:`Option`: name, type, default, doc; what :func:`open_backend` passes on, the
rest are left out) and ``local``: its URL names a directory on this host (made absolute
before it is handed to another process, and the only kind a node-local tier, a page-cache
warm or a ``--from`` source can be). Its module is imported only when a URL of its
kind is opened. A new backend is a module (a :class:`~.base.Store`), one entry in
:data:`BACKENDS` and one contract-test module (``tests/store/test_store_memory.py`` is
the smallest). The model: vLLM's connector factory (a name -> a lazily imported class).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from .base import Store, StoreError
from .url import CLUSTER_SCHEMES, REDIS_SCHEMES, redact


@dataclass(frozen=True)
class Option:
    """A keyword option a backend's store takes (``open_store(url, name=value)``)."""

    name: str
    type: type
    default: object
    doc: str


@dataclass(frozen=True)
class Backend:
    """One kind of store, as the registry knows it."""

    name: str  # the stores' ``backend`` (``encache stats``, ``info()``)
    schemes: tuple[str, ...]  # URL schemes it serves; "" is a bare path
    module: str  # its module, under this package
    cls: str  # its Store class there
    options: tuple[Option, ...]
    #: its URL names a directory on this host (a path, ``file://``)
    local: bool
    #: it takes ``create`` (a directory made on first open)
    creates: bool = False

    @property
    def option_names(self) -> frozenset[str]:
        return frozenset(o.name for o in self.options)

    def store_class(self) -> type[Store]:
        return getattr(importlib.import_module(f"{__package__}.{self.module}"), self.cls)

    def open(self, url: str, parts: SplitResult, *, create: bool = True,
             **options) -> Store:
        """A store on ``url`` (``parts``: its split, from :func:`check_url`), given the
        options this backend declares (others are left out: one option set serves every
        backend, e.g. a consumer's ``ec_connector_extra_config``)."""
        try:
            cls = self.store_class()
        except ImportError as e:  # pragma: no cover - the backends' libraries are dependencies
            raise StoreError(f"{self.name} support unavailable: {e}") from None
        kwargs = {k: v for k, v in options.items() if k in self.option_names}
        if self.creates:
            kwargs["create"] = create
        if parts.scheme == "file":
            url = parts.path
        return cls(url, **kwargs)


_REDIS_OPTIONS = (
    Option("prefix", str, None, "key prefix of the store's keys (default: the URL's "
           "?prefix=, else encache:)"),
    Option("socket_timeout", float, 2.0, "seconds a command may take"),
    Option("connect_timeout", float, 2.0, "seconds a connection may take"),
    Option("retries", int, 2, "retries of a command that failed on a connection"),
    Option("max_connections", int, 64, "connections in the pool"),
    Option("ttl", float, None, "entries expire this many seconds after their write "
           "(default: the URL's ?ttl=, else never)"),
    Option("lock_ttl", float, 30.0, "seconds a job lock lives unless renewed"),
    Option("access_resolution", float, 60.0, "a load records its access at most this often"),
)

#: every backend, looked up by scheme
BACKENDS: tuple[Backend, ...] = (
    Backend("disk", ("", "file"), "disk.store", "DiskStore", (
        Option("max_bytes", int, None, "capacity; writes past it evict (None: unbounded)"),
        Option("fsync", bool, True, "fsync each entry and its directory before it is visible"),
        Option("eviction", str, "lru", "what capacity eviction removes first: lru, fifo"),
        Option("load_mode", str, "auto", "how loads read files: auto, mmap, read"),
        Option("read_threads", int, 2, "threads reading one large entry in parallel"),
    ), local=True, creates=True),
    Backend("redis", REDIS_SCHEMES, "redis.store", "RedisStore", _REDIS_OPTIONS,
            local=False),
    Backend("redis-cluster", CLUSTER_SCHEMES, "redis.cluster",
            "RedisClusterStore", _REDIS_OPTIONS + (
                Option("redirect_wait", float, None, "seconds writes and header reads wait "
                       "out a failover (default: the URL's ?redirect_wait=, else 10)"),
            ), local=False),
    Backend("memory", ("memory",), "memory", "MemoryStore", (
        Option("max_bytes", int, None, "capacity reported by info (not enforced)"),
    ), local=False),
)

_BY_SCHEME = {scheme: b for b in BACKENDS for scheme in b.schemes}


def _scheme_list() -> str:
    return ", ".join(["a path"] + [f"{s}://" for b in BACKENDS for s in b.schemes if s])


def check_url(url: str) -> SplitResult:
    """``url``'s parts when it names a store a backend serves (nothing is opened: the
    store need not exist yet); else :class:`StoreError`, as :func:`open_backend` raises."""
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
    if _backend_of(parts) is None:
        raise StoreError(f"unsupported store URL scheme {scheme!r} (use {_scheme_list()})")
    return parts


def _backend_of(parts: SplitResult) -> Backend | None:
    scheme = parts.scheme
    if len(scheme) <= 1:  # a path (a Windows drive letter is not a scheme)
        scheme = ""
    return _BY_SCHEME.get(scheme)


def backend_for(url: str) -> Backend:
    """The backend serving ``url`` (:class:`StoreError` for a URL none serves)."""
    return _backend_of(check_url(url))


def find_backend(url: str) -> Backend | None:
    """The backend serving ``url``, or None for a URL none serves (the caller's own
    checks first; opening it later says why)."""
    try:
        return _backend_of(urlsplit(url))
    except ValueError:
        return None


def names_local_path(url: str) -> bool:
    """``url`` names a directory on this host (a path, ``file://``): False for a
    network store and for a URL no backend serves."""
    backend = find_backend(url)
    return backend is not None and backend.local


def open_backend(url: str, *, create: bool = True, **options) -> Store:
    """The store ``url`` names, opened by its backend with the options it declares."""
    parts = check_url(url)
    return _backend_of(parts).open(url, parts, create=create, **options)
