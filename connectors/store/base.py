"""The store contract: what every backend (disk, Redis) provides, and its data classes.

Stores move *bytes* (whole encoded entries, see :mod:`.entry`) and keep the bookkeeping a
store needs to be operable: usage counters written by serving engines, a capacity, an
exclusive lock for batch jobs. They never import vLLM or torch.

Semantics every backend honours (checked by ``tests/store_contract.py``):

* ``put`` is atomic: a reader sees the previous entry, the new one, or nothing — never a
  partial blob. A failed ``put`` leaves no visible trace.
* ``get`` of a missing (or concurrently deleted) entry returns ``None``: a miss, not an
  error. Integrity is checked by the caller with :func:`.entry.decode`.
* ``delete`` removes an entry whole; concurrent readers see it or a miss.
* Counters are additive across processes and hosts (``add_counters`` takes deltas).
* A serving read (``read_entry``, ``read_verified``, ``read_in_flight``) returns its
  record, a :class:`~.loaded.Loaded`: the bytes, their version, the tier that served
  them, and ``pin()`` (the disk store's file, or shared memory, kept open for a worker
  process), so nobody asks the store afterwards what it read.

Capabilities (zarr's ``supports_*`` pattern): every optional ability has a working default
here and a flag saying whether the backend does better than the default, so callers never
probe with ``getattr``/``hasattr``. ``tests/store_contract.py`` checks each one on every
backend:

==========================  ==================================================================
``supports_entry_path``     entries are files: ``root``, ``entry_path()`` (page-cache warming,
                            quarantine, no-atime reads); default: ``entry_path`` raises
``supports_used_bytes``     ``used_bytes()`` is cheap (no header read); default: sums a scan
``supports_batch``          ``get_many``/``delete_many`` are native batches; default: loops
``supports_index_version``  ``index_version()`` changes on every put/delete; default: None
``supports_capacity_warnings``  ``capacity_warnings()`` inspects server settings; default: []
``mapped_loads``            ``read_entry`` may return a read-only file mapping (mmap)
``supports_live_counters``  ``live_counters()`` gives this process an in-place counter file
                            that survives SIGKILL; default: None (counts are batched and
                            flushed with ``add_counters``)
``supports_verified_reads`` ``read_verified()`` reads an entry into a private buffer and checks
                            it in the same pass (one pass over the bytes); default:
                            ``read_entry`` then a validation pass
``supports_change_journal`` ``changes_since(cursor)`` names the identifiers put or deleted
                            since a cursor, in O(changes) (Redis: a stream; disk: per-writer
                            segment files, ``disk/journal.py``; ``journal_complete``: every
                            write is journaled atomically with it); default: "cannot tell"
                            (the caller re-checks what it holds with ``unchanged``)
``supports_verified_log``   ``verified_log()`` keeps the entry versions checksummed this boot
                            (``verified_log.py``) so a restarted consumer need not hash them
                            again; default: None (verification is remembered in memory only)
``supports_in_flight``      a write is visible to every reader as in flight (``in_flight()``)
                            from before its first byte until its commit, while its writer
                            lives (a killed writer's is not in flight), and
                            ``put(on_visible=...)`` says when that moment comes: a writer may
                            report the entry landed then; a reader that finds it in flight
                            reads its bytes once all are written (``read_in_flight()``,
                            checked in full; with ``supports_entry_path``,
                            ``in_flight_paths()`` names the files) or waits for the commit,
                            looking again whenever ``in_flight_wait()`` returns (disk on a
                            local filesystem: the write then runs off the encoder's
                            request); default: never in flight
``supports_failure_domains`` the store's parts fail apart (a Redis Cluster's primaries):
                            ``failure_domain(identifier)`` names the part serving an entry
                            (memory speed, no round trip), a ``StoreError`` names the part
                            it concerns (``domain``), and ``probe_domain()`` asks one part
                            whether it serves again: a consumer then misses only what the
                            failed part holds; ``unchanged_by_part()`` checks held entries
                            part by part (None for a failed part's); a walk (``scan``, ``identifiers``, ``count``)
                            given a list ``unreachable`` walks the parts that answer and
                            names the others there (management commands report the rest
                            as partial); default: the store fails as a whole (None)
``supports_removal_records`` the store remembers entries a policy removed (capacity
                            eviction, ``purge --older-than``: :mod:`.removals`) so a
                            refresh does not encode them again: ``record_removals``,
                            ``removals()``, ``forget_removals``, ``removal_counts()``;
                            default: nothing is remembered (a refresh encodes every
                            missing entry)
==========================  ==================================================================

Methods every backend has (default in brackets): ``ping()`` [a ``contains`` round trip],
``count()`` [counts ``identifiers()``], ``stray_files()`` [none], ``prune()`` [0],
``reopen()`` (a second independent handle), ``max_bytes`` [None], ``low_watermark``
[0.9: eviction stops at this fraction of ``max_bytes``], ``read_only`` [False: the store
cannot be written, e.g. a read-only mount; serving reads still work], ``url``.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .entry import CorruptEntry, EntryMeta
from .loaded import Loaded

#: how often a reader waiting for an in-flight write looks again when nothing can wake it
IN_FLIGHT_POLL_S = 0.001

#: a store whose journal can miss a change (``journal_complete`` False): readers holding
#: copies also re-check all of them this often
JOURNAL_FULL_CHECK_S = 300.0

#: counters a consumer connector records; all additive
COUNTER_NAMES = ("hits", "misses", "load_errors", "config_mismatches", "load_seconds",
                 "bytes_loaded", "saves", "save_errors", "bytes_saved", "evictions")


class StoreError(RuntimeError):
    """The store itself is unusable (unreachable, unwritable, misconfigured).

    ``domain``: the part of the store the failure concerns, where a store's parts fail
    apart (``supports_failure_domains``: a Redis Cluster's primary); None: the store."""

    def __init__(self, *args, domain: str | None = None, reason: str | None = None):
        super().__init__(*args)
        self.domain = domain
        #: what went wrong, without the store's name (``str(self)`` names it): a report
        #: listing parts of one store says it per part
        self.reason = reason if reason is not None else str(self)


class LockBusy(StoreError):
    """Another process holds the lock asked for."""


class EntryInfo(msgspec.Struct, frozen=True):
    """One entry as a scan sees it: its header metadata (or why it is unreadable).

    A msgspec struct, as :class:`~.entry.EntryMeta`: a scan of a million entries builds
    (or unpickles from the header index) a million of them, ~5x faster than a frozen
    dataclass, and ``list`` / sorts read their fields at slot speed."""

    identifier: str
    size: int  # bytes of the whole stored blob
    meta: EntryMeta | None = None
    created: float | None = None  # epoch seconds (metadata, else file mtime)
    accessed: float | None = None  # last load, where the backend records it
    error: str | None = None  # why the header is unreadable (reason tag)

    @property
    def lora(self) -> str | None:
        if self.meta is not None and self.meta.lora:
            return self.meta.lora
        from .keys import split_lora
        return split_lora(self.identifier)[0]

    @property
    def model(self) -> str | None:
        return self.meta.model if self.meta else None

    @property
    def legacy(self) -> bool:
        return self.meta is not None and self.meta.legacy


@dataclass(frozen=True)
class StoreInfo:
    """Backend-level facts for ``encache stats``."""

    url: str  # with any password redacted
    backend: str  # "disk" | "redis"
    max_bytes: int | None = None
    extra: dict = field(default_factory=dict)  # backend specifics (Redis memory, policy…)


class Store(ABC):
    """Abstract store of encoded entries keyed by vLLM identifier."""

    backend: str = "?"
    #: True when ``contains`` is cheap enough for a scheduler hot path (a local stat)
    local: bool = False

    # -- capabilities (see the module docstring; all False/None means "the defaults") ------
    supports_entry_path: bool = False
    supports_used_bytes: bool = False
    supports_batch: bool = False
    supports_index_version: bool = False
    supports_capacity_warnings: bool = False
    #: ``read_entry`` may hand out a mapping of a file rather than a private copy
    mapped_loads: bool = False
    #: the directory holding entry files (``supports_entry_path`` backends), else None
    root: Path | None = None
    #: capacity in bytes the store enforces itself, or None
    max_bytes: int | None = None
    #: eviction brings usage down to this fraction of ``max_bytes``
    low_watermark: float = 0.9
    #: the store cannot be written (a read-only mount): reads and read-only commands work
    read_only: bool = False
    supports_live_counters: bool = False
    supports_verified_log: bool = False
    supports_verified_reads: bool = False
    supports_change_journal: bool = False
    #: every change is in the journal the moment it is visible (False: a write's journal
    #: record is a separate step that can be lost; readers also re-check everything every
    #: ``JOURNAL_FULL_CHECK_S``)
    journal_complete: bool = True
    supports_in_flight: bool = False
    supports_failure_domains: bool = False
    supports_removal_records: bool = False

    @property
    @abstractmethod
    def url(self) -> str:
        """Where the store is, safe to print (passwords redacted)."""

    @abstractmethod
    def reopen(self) -> Store:
        """A second, independent handle on the same data (own connections, own caches)."""

    def live_counters(self):
        """This process's in-place counters (``supports_live_counters`` backends), else
        None: the caller batches deltas into ``add_counters``."""
        return None

    # -- entries -----------------------------------------------------------------
    @abstractmethod
    def get(self, identifier: str) -> bytes | bytearray | None:
        """The whole encoded entry, or None if absent."""

    def read_entry(self, identifier: str) -> Loaded | None:
        """``(buffer, version)`` for the serving path (a :class:`~.loaded.Loaded`: it also
        says which tier served it and pins it), or None if absent.

        ``version`` identifies this exact stored copy (for a file: device, inode, size and
        mtime, which only writers set) so a reader can skip re-verifying bytes it has already checked;
        None when the backend cannot tell (then every load is verified). The buffer may be
        a read-only-backed mapping: callers must not assume it is a private copy.
        """
        blob = self.get(identifier)
        return None if blob is None else Loaded((blob, None))

    def read_verified(self, identifier: str, checksum=lambda version: True, into=None):
        """``(buffer, version, meta, offset, checksummed)`` of a whole entry validated on
        the way in (a :class:`~.loaded.Loaded`), or None if absent. ``checksum(version) -> bool`` says whether this
        stored version's bytes must be hashed (False: a version verified before; header
        and size are still checked). ``into(n)``: where a backend receives or reads the
        entry into memory of its own, it takes that buffer of ``n`` writable bytes from
        here instead (shared memory a worker process can map: :mod:`.memfd`; the
        page-locked staging of a device copy); a mapped or kept copy is served as it is.
        ``into.stages`` true: its buffers are where the bytes go next anyway (a device
        copy's staging), so an entry is read into one (and a version that must be hashed
        hashed in the same pass) even where it would be mapped or kept. Raises
        :class:`~.entry.CorruptEntry` for bad bytes.
        Default: :meth:`read_entry`, then a validation pass over the buffer (``into``
        unused)."""
        from .entry import validate_blob
        got = self.read_entry(identifier)
        if got is None:
            return None
        blob, version = got
        hashing = checksum(version)
        meta, offset = validate_blob(blob, identifier=identifier, verify=hashing)
        out = Loaded((blob, version, meta, offset, hashing))
        if got.pinner is not None:
            out.pinner, out.identifier = got.pinner, identifier
        return out

    def unchanged(self, entries: list[tuple[str, object, EntryMeta]]) -> list[bool]:
        """For ``(identifier, version, meta)`` of entries a reader holds in memory: is each
        still the stored version (not purged, quarantined, evicted or rewritten)? One
        bool per entry, in order. Default: one header read each (``stat``); backends do
        it in a ``stat`` (disk: the file's version) or one round trip per batch (Redis)."""
        from .entry import same_version
        out = []
        for identifier, _, meta in entries:
            info = self.stat(identifier)
            out.append(info is not None and info.meta is not None
                       and same_version(info.meta, meta))
        return out

    def unchanged_by_part(self, entries: list[tuple[str, object, EntryMeta]],
                          failed: dict) -> list[bool | None]:
        """:meth:`unchanged` asked of each part of the store on its own, where the parts
        fail apart (``supports_failure_domains``): None for the entries of a part that
        fails, the part named in ``failed`` (part -> its ``StoreError``); a failure no
        part can be blamed for raises. Otherwise :meth:`unchanged` itself."""
        if not self.supports_failure_domains:
            return self.unchanged(entries)
        parts: dict[str | None, list[int]] = {}
        for n, (identifier, _, _) in enumerate(entries):
            parts.setdefault(self.failure_domain(identifier), []).append(n)
        out: list[bool | None] = [None] * len(entries)
        for part, positions in parts.items():
            try:
                answers = self.unchanged(
                    entries if len(parts) == 1 else [entries[n] for n in positions])
            except StoreError as e:
                if part is None:
                    raise
                failed[part] = e
                continue
            for n, ok in zip(positions, answers):
                out[n] = ok
        return out

    def changes_since(self, cursor) -> tuple[object, set[str] | None]:
        """``(new cursor, identifiers put or deleted since cursor)``. The set is None when
        the store cannot tell (no journal, a ``None`` cursor, the journal trimmed past the
        cursor, the store lost its data): the caller then re-checks every copy it holds
        (:meth:`unchanged`). Pass the returned cursor next time. Default: cannot tell."""
        return None, None

    def changed_outside(self, identifiers: Iterable[str | None]) -> None:
        """Entry files (``supports_entry_path``) were changed other than through
        :meth:`put` / :meth:`delete` (a quarantine, a removal by raw name): tell the
        store's change tracking (None: an entry whose identifier is unknown). Default:
        nothing to tell."""

    # -- removal records (:mod:`.removals`) --------------------------------------------
    def record_removals(self, identifiers: Iterable[str | None], reason: str) -> None:
        """Remember that a policy (``reason``: ``evicted``, ``older-than``) removed these
        entries, so a refresh leaves them out. Default: nothing is remembered."""

    def removals(self) -> dict[str, str]:
        """Identifier -> reason of every removal remembered. Default: none."""
        return {}

    def forget_removals(self, identifiers: Iterable[str]) -> None:
        """Drop the records of entries stored again. Default: nothing to drop."""

    def removal_counts(self) -> dict[str, int]:
        """Removals remembered, per reason. Default: none."""
        return {}

    def local_tier_usage(self) -> tuple[int, int | None] | None:
        """``(bytes, capacity)`` of the node-local tier in front of this store, cheap
        enough for every metrics sample; None for a store without one (:mod:`.tiered`)."""
        return None

    def in_flight(self, identifier: str) -> bool:
        """A write of ``identifier`` is under way: visible, not yet committed
        (``supports_in_flight`` backends): a reader that wants it reads the bytes once
        whole (:meth:`read_in_flight`) or waits for the commit, rather than taking it for
        absent. Default: False."""
        return False

    def read_in_flight(self, identifier: str, checksum=lambda version: True):
        """The bytes of a write in flight, once all are written (``supports_in_flight``
        backends): ``(buffer, version, meta, offset)`` checked in full, the version the
        committed entry will have; None while none is whole. ``checksum(version)``, asked
        once the file is open: whether to hash it (False: a version the store's verified
        log vouches for, header and size checks only). Default: None."""
        return None

    @contextlib.contextmanager
    def in_flight_wait(self, identifier: str):
        """What a reader of an in-flight write of ``identifier`` calls between its
        looks (a context manager yielding a ``wait()`` callable): it returns when the write
        may have moved on (its bytes all in, its commit, its writer gone), and after a
        while in any case. Default: a sleep of ``IN_FLIGHT_POLL_S``."""
        yield lambda: time.sleep(IN_FLIGHT_POLL_S)

    def in_flight_paths(self, identifier: str) -> list[str]:
        """The files of writes of ``identifier`` in flight, newest first
        (``supports_in_flight`` backends with ``supports_entry_path``): a reader that
        verified one's bytes may hand that file on, since its commit (a rename) keeps the
        inode and so the version. Default: none."""
        return []

    def holds_locally(self, identifier: str) -> bool:
        """A copy of ``identifier`` this node may serve without reaching the store (a
        local tier's current copy). Asked *before* any read, to decide whether to read at
        all: through an outage such items are still loaded, and such a load may run
        inline. (Which tier did serve a read, its record says: ``Loaded.source``.)"""
        return False

    def failure_domain(self, identifier: str) -> str | None:
        """The part of the store that serves ``identifier``, as far as failures go
        (``supports_failure_domains`` backends: e.g. ``host:port`` of its primary);
        memory speed, never a round trip. None: the store fails as a whole (default)."""
        return None

    def probe_domain(self, domain: str) -> None:
        """Raise ``StoreError`` unless the part ``domain`` serves entries again (a
        ``failure_domain`` name; a part no longer in the store answers: its entries are
        served by others now). Default: :meth:`ping`."""
        self.ping()

    @abstractmethod
    def put(self, identifier: str, parts: bytes | Iterable, *, encoded_here: bool = False) -> int:
        """Store an encoded entry atomically (``parts``: one buffer or several to join).

        ``encoded_here``: the caller encoded these bytes itself from a tensor (the codec
        computed their checksum in this process), so a store with a verified log
        (``supports_verified_log``) records the written version as verified. Never set
        for bytes copied from elsewhere. Returns the number of bytes written.
        ``supports_in_flight`` backends also take ``on_visible``, called once
        :meth:`in_flight` shows the write (before its bytes), and ``on_written``, called
        once the bytes are written; the commit follows its return (it may block to hold
        the commit back).
        """

    @abstractmethod
    def delete(self, identifier: str) -> bool:
        """Remove an entry; True if it existed."""

    @abstractmethod
    def contains(self, identifier: str) -> bool:
        ...

    @abstractmethod
    def identifiers(self, *, unreachable: list | None = None,
                    hint: bool = False) -> Iterator[str]:
        """Every identifier present (cheap: no entry is read); ``unreachable`` as for
        :meth:`scan`. ``hint``: for a reader's index, which reads an entry before it
        serves it and keeps a set -- the store may then also name entries being written
        or just removed (a read finds them absent: a miss), or one twice, where that
        saves a check per entry (a disk store lists its directory without a ``stat`` per
        entry; Redis keeps no set of every key it has named)."""

    @abstractmethod
    def scan(self, *, unreachable: list | None = None) -> Iterator[EntryInfo]:
        """Every entry with its header metadata (headers only, not tensors).

        ``unreachable``: a list for a walk that may be partial. A store whose parts fail
        apart (``supports_failure_domains``) appends ``(part, reason)`` for each part it
        cannot walk and goes on with the others; it still raises when no part answers.
        Without the list, or on a store that fails as a whole, a failure raises."""

    @abstractmethod
    def stat(self, identifier: str) -> EntryInfo | None:
        """One entry's header metadata, or None if absent."""

    def index_version(self) -> object | None:
        """A cheap token that changes when entries are added or removed, or None when the
        backend has none (readers then rescan ``identifiers()`` every refresh)."""
        return None

    def get_many(self, identifiers: list[str]) -> list[bytes | bytearray | None]:
        """Whole entries in order (None for a miss); one round trip per batch where
        ``supports_batch``."""
        return [self.get(i) for i in identifiers]

    def delete_many(self, identifiers: Iterable[str], *, per_item: bool = False):
        """Delete many entries: how many existed, or with ``per_item=True`` one bool per
        identifier, in order (did it exist)."""
        existed = [self.delete(i) for i in identifiers]
        return existed if per_item else sum(existed)

    def entry_path(self, identifier: str) -> Path:
        """The file holding an entry (``supports_entry_path`` backends only)."""
        raise StoreError(f"a {self.backend} store keeps no entry files ({self.url})")

    def used_bytes(self) -> int:
        """Bytes of all entries (cheap where ``supports_used_bytes``; else a scan)."""
        return sum(e.size for e in self.scan())

    def count(self, *, unreachable: list | None = None) -> int:
        """Number of entries (no entry is read); ``unreachable`` as for :meth:`scan`."""
        return sum(1 for _ in self.identifiers(unreachable=unreachable))

    def ping(self) -> float:
        """Round-trip time of one lookup in seconds (raises StoreError if unusable)."""
        import time
        t = time.perf_counter()
        self.contains("~ping")
        return time.perf_counter() - t

    def capacity_warnings(self) -> list[str]:
        """Human-readable problems with the backend's capacity settings (none known)."""
        return []

    def summary_if_unchanged(self, stat_entries: bool = True):
        """The store's :class:`~.summary.Summary` without reading any header, when the
        backend keeps an index it can prove current (disk: a summary kept under the
        store's generation, in O(1); else, with ``stat_entries``, the header index
        checked with a ``stat`` per entry); None when it cannot (then the caller
        scans)."""
        return None

    # -- notes: short texts beside the entries (never listed or counted as entries) -----
    @abstractmethod
    def put_note(self, name: str, text: str, ttl: float = 600.0) -> str:
        """Leave ``text`` under ``name`` (e.g. a marker every node of a cluster job must
        read back to prove it sees this same store); it may expire after ``ttl`` s.
        Returns where it went, for messages."""

    @abstractmethod
    def get_note(self, name: str) -> str | None:
        """The note's text, or None if absent (or expired)."""

    @abstractmethod
    def delete_note(self, name: str) -> None:
        """Remove a note (no error if absent)."""

    def stray_files(self, older_than: float = 0.0) -> list[Path]:
        """Leftovers of interrupted writes that ``verify --repair`` may remove."""
        return []

    def prune(self) -> int:
        """Drop side records of entries the backend lost by itself; returns how many."""
        return 0

    def verified_log(self):
        """A :class:`~.verified_log.VerifiedLog` shared by this host's consumers of the
        store (``supports_verified_log`` backends, where it can be kept safely), else None."""
        return None

    def maintain(self) -> None:
        """Periodic housekeeping of this process's own state, called by a long-lived
        reader's background thread (the consumer's index refresh). Default: nothing; the
        disk store drops kept buffers of entries changed or removed by other processes."""

    # -- bookkeeping ---------------------------------------------------------------
    @abstractmethod
    def add_counters(self, deltas: dict[str, float]) -> None:
        ...

    @abstractmethod
    def read_counters(self) -> dict[str, float]:
        ...

    @abstractmethod
    def reset_counters(self) -> None:
        ...

    @abstractmethod
    def info(self) -> StoreInfo:
        ...

    @abstractmethod
    def lock(self, name: str, wait: float = 0.0) -> contextlib.AbstractContextManager:
        """Exclusive, process-crash-safe lock; raises :class:`LockBusy` after ``wait`` s."""

    def close(self) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def info_from_blob_header(identifier: str, size: int, header_bytes,
                          created: float | None, accessed: float | None) -> EntryInfo:
    """Build an :class:`EntryInfo` from an entry's leading bytes (shared by backends)."""
    from .entry import parse_header

    try:
        meta, _ = parse_header(header_bytes, total_size=size)
    except CorruptEntry as e:
        return EntryInfo(identifier, size, None, created, accessed, e.reason)
    if meta.created is not None:
        created = meta.created
    ident = meta.identifier or identifier
    return EntryInfo(ident, size, meta, created, accessed, None)
