"""``ec_connector_extra_config`` for the encache connector: parsing and defaults.

Every key is optional except the store. ``path`` and ``shared_storage_path`` are
accepted as aliases of ``store`` so encache is a drop-in replacement for vLLM's
``ECExampleConnector`` configuration. Every value is checked when the engine starts (its
type and range): a bad one stops the start with a line naming the key, where it would
otherwise fail a request later, stop a background thread, or mean the opposite of what
was written (``"false"`` is a true string).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, fields
from urllib.parse import parse_qsl, urlsplit

from ..lookup.verified import parse_verify
from ..store.disk.store import EVICTION_POLICIES, LOAD_MODES, READ_THREADS
from ..store.registry import find_backend

log = logging.getLogger("encache.connector")

#: what each setting takes, checked at start (``ConnectorConfig.__post_init__``)
#: sizes: bytes, a whole number (or ``"50G"``) at least this; None where optional
_SIZES = {"max_bytes": 1, "local_tier_max_bytes": 1, "staging_bytes": 0,
          "verify_ahead_start_bytes": 0, "max_pending_write_bytes": 1}
_OPTIONAL = ("max_bytes", "local_tier_max_bytes", "prefix", "local_tier")
_COUNTS = ("load_threads", "write_threads")  # a whole number, at least 1
#: seconds: a finite number, above 0 (False) or 0 allowed too (True)
_SECONDS = {"load_timeout_s": False, "inline_wait_s": True, "index_refresh_s": False,
            "counters_flush_s": False, "store_stats_s": False, "save_wait_s": True,
            "redirect_wait": True}
_FLAGS = ("fsync", "verify_ahead", "remember_verified", "check_encoder_config",
          "skip_existing", "require_binding", "content_keyed")  # JSON true / false
_TEXTS = ("prefix", "local_tier", "tag")


@dataclass(frozen=True)
class ConnectorConfig:
    store: str
    # store
    max_bytes: int | None = None  # disk capacity; evicts LRU past it
    eviction: str = "lru"
    fsync: bool = True
    prefix: str | None = None  # Redis key namespace
    load_mode: str = "auto"  # disk: mmap entry files on local filesystems, else read
    # disk: threads a checksummed read of one entry of 1 MiB+ uses (2: a helper reads part
    # of it while the load hashes; 1: the load alone)
    read_threads: int = READ_THREADS
    # a directory on this node's disk in front of a shared store (Redis, Cluster, NFS):
    # loads look there first, remote hits are written behind into it (docs/local-tier.md)
    local_tier: str | None = None
    local_tier_max_bytes: int | None = None  # the tier's capacity; evicts LRU past it
    # consumer (scheduler side)
    load_threads: int = 4
    staging_bytes: int = 512 << 20
    load_timeout_s: float = 5.0
    inline_wait_s: float = 0.01  # per scheduler step: wait this long for loads before deferring
    index_refresh_s: float = 5.0
    verify: bool | str = True  # checksum each stored version once; "always": every load
    verify_ahead: bool = True  # hash entries that appear while serving, before a request
    # ... and at start, the most recently used entries up to this many bytes (0: none)
    verify_ahead_start_bytes: int = 2 << 30
    # disk: keep the versions verified since the host booted in the store (a restarted
    # consumer does not hash them again); false: remember them in memory only
    remember_verified: bool = True
    # how entries reach workers in other processes (multiprocess executor): "auto" =
    # workers read pinned disk entries of 1 MiB+ themselves when they can, smaller ones
    # (and Redis entries) ride in the step's metadata; "bytes" / "files" force one
    worker_loads: str = "auto"
    check_encoder_config: bool = True  # entries stamped with another encoder config: misses
    # an entry without a binding (written before bindings, or by a producer that had no
    # inputs to digest) is a miss for a request that holds its inputs (docs/security.md)
    require_binding: bool = False
    # Redis: batched counters are flushed this often (a SIGKILLed engine loses at most
    # this much); disk stores count in place in a per-process file and never flush
    counters_flush_s: float = 0.5
    store_stats_s: float = 30.0  # sample store-wide entries/bytes/evictions for metrics
    # both: an operator's label that enters the encoder-config digest (bump it when the
    # weights change in place); see encache.connectors.encoder_config
    tag: str = ""
    # producer (worker side)
    # a step (and so an encoder instance's request) ends once its entries are in the
    # store, waiting at most this long (0: do not wait; precompute drains at the end)
    save_wait_s: float = 10.0
    # Redis Cluster: how long a write or a producer's header read waits out a failover (a
    # primary down, its replica not promoted yet). 0: a serving engine's step never waits
    # on a dead primary (those entries fail at once; consumers encode them themselves);
    # precompute waits as long as the store's default (a batch job rides through)
    redirect_wait: float = 0.0
    write_threads: int = 2
    max_pending_write_bytes: int = 1 << 30
    skip_existing: bool = True
    # producer: every identifier this engine is given was computed from the item's own
    # bytes (encache precompute and warm set it): entries say so (``keyed_by``) and a
    # consumer serves them without digesting its inputs (docs/security.md); the uuids it
    # is given are not namespaced (.uuids). Never on a server that takes client requests
    content_keyed: bool = False

    ALIASES = ("store", "path", "shared_storage_path", "url")
    WORKER_LOADS = ("auto", "bytes", "files")

    def __post_init__(self):
        def refuse(key: str, want: str):
            raise ValueError(f"encache connector: {key} must be {want}, not "
                             f"{getattr(self, key)!r}")

        for key, least in _SIZES.items():
            value = getattr(self, key)
            if value is None and key in _OPTIONAL:
                continue
            if isinstance(value, str):  # "50G" as well as a number
                from ..store.units import parse_size
                try:
                    value = parse_size(value)
                except ValueError:
                    refuse(key, 'a number of bytes (or a size such as "50G")')
            if type(value) is not int or value < least:
                refuse(key, f'a whole number of bytes, at least {least} (or a size such as '
                            f'"50G")')
            object.__setattr__(self, key, value)
        for key in _COUNTS:
            if type(getattr(self, key)) is not int or getattr(self, key) < 1:
                refuse(key, "a whole number, at least 1")
        if type(self.read_threads) is not int or self.read_threads not in (1, 2):
            refuse("read_threads", "1 or 2")
        for key, zero in _SECONDS.items():
            value = getattr(self, key)
            if (type(value) not in (int, float) or not math.isfinite(value) or value < 0
                    or (value == 0 and not zero)):
                refuse(key, f"a number of seconds, {'0 or more' if zero else 'above 0'}")
            object.__setattr__(self, key, float(value))
        for key in _FLAGS:
            if type(getattr(self, key)) is not bool:
                refuse(key, "true or false (JSON booleans)")
        for key in _TEXTS:
            value = getattr(self, key)
            if not (isinstance(value, str) or (value is None and key in _OPTIONAL)):
                refuse(key, "a string")
        for key, words in (("eviction", EVICTION_POLICIES), ("load_mode", LOAD_MODES),
                           ("worker_loads", self.WORKER_LOADS)):
            if getattr(self, key) not in words:
                refuse(key, f"one of {', '.join(words)}")
        if type(self.verify) is not bool:
            try:
                if not isinstance(self.verify, str):
                    raise ValueError
                parse_verify(self.verify)
            except ValueError:
                refuse("verify", "true, false or \"always\"")

    @classmethod
    def from_extra(cls, extra: dict) -> ConnectorConfig:
        extra = dict(extra)
        given = [key for key in cls.ALIASES if key in extra]
        if len(given) > 1:
            raise ValueError(f"encache connector: {', '.join(given)} all name the store: "
                             "give one")
        store = extra.pop(given[0]) if given else None
        if not store:
            raise ValueError("encache connector: ec_connector_extra_config needs a 'store' "
                             "(a directory, redis:// or redis+cluster:// URL)")
        if not isinstance(store, str):
            raise ValueError(f"encache connector: {given[0]} must be a string (a directory "
                             f"or a URL), not {store!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"encache connector: unknown ec_connector_extra_config keys {unknown}")
        config = cls(store=store, **extra)
        for key in ("store", "local_tier"):
            path = getattr(config, key)
            if path and not urlsplit(path).scheme and not os.path.isabs(path):
                log.warning("encache connector: %s %r is a relative path: it is resolved "
                            "against the server's working directory (%s)", key, path,
                            os.getcwd())
        return config

    def store_options(self, loads: bool = True) -> dict:
        """``open_store`` keywords. ``loads``: the connector loads entries (a consumer);
        else the local tier, which holds copies of loaded entries, is left out."""
        opts = {"max_bytes": self.max_bytes, "eviction": self.eviction, "fsync": self.fsync,
                "load_mode": self.load_mode, "read_threads": self.read_threads}
        if loads:
            opts.update(local_tier=self.local_tier,
                        local_tier_max_bytes=self.local_tier_max_bytes,
                        # without checksums a torn copy would be served: then the tier fsyncs
                        local_tier_fsync=not parse_verify(self.verify)[0])
        if self.prefix is not None:
            opts["prefix"] = self.prefix
        url, backend = urlsplit(self.store or ""), find_backend(self.store or "")
        if (backend is not None and "redirect_wait" in backend.option_names
                and "redirect_wait" not in dict(parse_qsl(url.query))):
            opts["redirect_wait"] = self.redirect_wait  # (the URL's own value wins)
        return {k: v for k, v in opts.items() if v is not None}

    def lookup_options(self) -> dict:
        return {"load_threads": self.load_threads, "staging_bytes": self.staging_bytes,
                "load_timeout_s": self.load_timeout_s, "index_refresh_s": self.index_refresh_s,
                "verify": self.verify, "verify_ahead": self.verify_ahead,
                "verify_ahead_start_bytes": self.verify_ahead_start_bytes,
                "remember_verified": self.remember_verified,
                "counters_flush_s": self.counters_flush_s,
                "store_stats_s": self.store_stats_s}

    def writer_options(self) -> dict:
        return {"threads": self.write_threads, "max_pending_bytes": self.max_pending_write_bytes,
                "skip_existing": self.skip_existing}
