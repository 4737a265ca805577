"""``ec_connector_extra_config`` for the encache connector: parsing and defaults.

Every key is optional except the store. ``path`` and ``shared_storage_path`` are
accepted as aliases of ``store`` so encache is a drop-in replacement for vLLM's
``ECExampleConnector`` configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..lookup.verified import parse_verify


@dataclass(frozen=True)
class ConnectorConfig:
    store: str
    # store
    max_bytes: int | None = None  # disk capacity; evicts LRU past it
    eviction: str = "lru"
    fsync: bool = True
    prefix: str | None = None  # Redis key namespace
    load_mode: str = "auto"  # disk: mmap entry files on local filesystems, else read
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
    write_threads: int = 2
    max_pending_write_bytes: int = 1 << 30
    skip_existing: bool = True

    ALIASES = ("store", "path", "shared_storage_path", "url")
    WORKER_LOADS = ("auto", "bytes", "files")

    def __post_init__(self):
        if self.worker_loads not in self.WORKER_LOADS:
            raise ValueError(f"encache connector: worker_loads must be one of "
                             f"{self.WORKER_LOADS}, not {self.worker_loads!r}")

    @classmethod
    def from_extra(cls, extra: dict) -> ConnectorConfig:
        extra = dict(extra)
        store = None
        for key in cls.ALIASES:
            if extra.get(key):
                store = str(extra.pop(key))
                break
        if not store:
            raise ValueError("encache connector: ec_connector_extra_config needs a 'store' "
                             "(a directory, redis:// or redis+cluster:// URL)")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - names - set(cls.ALIASES))
        if unknown:
            raise ValueError(f"encache connector: unknown ec_connector_extra_config keys {unknown}")
        for key in ("max_bytes", "local_tier_max_bytes"):  # "50G" as well as a number
            if isinstance(extra.get(key), str):
                from ..store.scanning import parse_size
                extra[key] = parse_size(extra[key])
        return cls(store=store, **{k: v for k, v in extra.items() if k in names})

    def store_options(self) -> dict:
        opts = {"max_bytes": self.max_bytes, "eviction": self.eviction, "fsync": self.fsync,
                "load_mode": self.load_mode, "local_tier": self.local_tier,
                "local_tier_max_bytes": self.local_tier_max_bytes,
                # without checksums a torn copy would be served: then the tier fsyncs
                "local_tier_fsync": not parse_verify(self.verify)[0]}
        if self.prefix is not None:
            opts["prefix"] = self.prefix
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
