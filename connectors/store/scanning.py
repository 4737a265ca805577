"""Scan, filter and summarise a store's entries — shared by ``list``, ``stats``, ``size``,
``purge`` and ``verify``. Pure Python over the :class:`~.base.Store` interface (no vLLM,
no torch, no backend internals), so it works on every backend.

* :func:`parse_age` turns ``90s`` / ``30m`` / ``12h`` / ``7d`` / ``2w`` into seconds.
* :class:`EntryFilter` selects entries by LoRA, model and age.
* :class:`Summary` aggregates counts and bytes (total, by model, by LoRA, legacy,
  unreadable, written by a newer encache); summaries merge, so shards can be scanned in parallel.
* :class:`ScanThrottle` paces full walks repeated in the background (≤ 5 % of the time).
* :func:`scan` / :func:`summarize` walk a store (headers only), optionally across
  processes (:func:`summarize` with ``workers > 1`` re-opens the store by URL in each
  worker process and splits the identifiers between them); given a list
  ``unreachable``, a walk of a store whose parts fail apart covers the parts that answer
  and names the others there (:func:`parts_dicts`: as a report's JSON).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from .base import EntryInfo, Store
from .entry import NEWER_FORMAT
from .keys import split_lora

_AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", re.IGNORECASE)
AGE_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}

#: progress callbacks are called at most once per this many entries
TICK_EVERY = 256


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"50G"`` -> 53687091200. Units K, M, G, T (powers of 1024; ``KiB``, ``GB``
    spelled out too); a bare number is bytes. Raises ValueError fit for a usage error, also
    for a size under one byte (``"0.5"``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text or "", re.IGNORECASE)
    if not m:
        raise ValueError(f"invalid size {text!r} (use e.g. 500M, 50G, 2T)")
    n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if n <= 0:  # "0.5" is 0 bytes: no capacity at all, never what was meant
        raise ValueError(f"invalid size {text!r}: less than one byte")
    return n


def parse_age(text: str) -> float:
    """``"7d"`` -> 604800.0. Units: s, m, h, d, w (a bare number is seconds).

    Raises ValueError with a message fit for a usage error.
    """
    m = _AGE.fullmatch(text or "")
    if not m:
        raise ValueError(f"invalid age {text!r} (use e.g. 90s, 30m, 12h, 7d, 2w)")
    return float(m.group(1)) * AGE_UNITS[m.group(2).lower()]


_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float | None) -> str:
    """Bytes for people (``2883584`` -> ``"2.8 MiB"``); the one byte formatter of the
    CLI's tables and of messages. None -> ``"-"``."""
    if n is None:
        return "-"
    import math
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    exp = min(int(math.log(abs(n), 1024)), len(_BYTE_UNITS) - 1)
    value = n / 1024 ** exp
    return f"{value:.1f} {_BYTE_UNITS[exp]}" if value < 100 else f"{value:.0f} {_BYTE_UNITS[exp]}"


def format_age(seconds: float) -> str:
    """The inverse of :func:`parse_age`, for messages (``604800`` -> ``"7d"``)."""
    for unit in ("w", "d", "h", "m"):
        n = AGE_UNITS[unit]
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


def last_used(e: EntryInfo) -> float | None:
    """When the entry was last written or read (the later of created / accessed)."""
    times = [t for t in (e.created, e.accessed) if t is not None]
    return max(times) if times else None


def lora_names(e: EntryInfo) -> set[str]:
    """Every LoRA an entry belongs to: its identifier prefix and its metadata's LoRA."""
    names = set()
    prefix = split_lora(e.identifier)[0]
    if prefix:
        names.add(prefix)
    if e.meta is not None and e.meta.lora:
        names.add(e.meta.lora)
    return names


@dataclass(frozen=True)
class EntryFilter:
    """Which entries a command acts on. Empty filter = every entry.

    ``older_than`` (seconds) matches entries not written or read for that long (the later
    of creation and last access, where the backend records access) — the ``ccache
    --evict-older-than`` meaning, so a cache entry still being served is never "old".
    """

    lora: str | None = None
    model: str | None = None
    older_than: float | None = None
    now: float = field(default_factory=time.time)

    @property
    def active(self) -> bool:
        return self.lora is not None or self.model is not None or self.older_than is not None

    def matches(self, e: EntryInfo) -> bool:
        if self.lora is not None and self.lora not in lora_names(e):
            return False
        if self.model is not None and e.model != self.model:
            return False
        if self.older_than is not None:
            t = last_used(e)
            if t is None or self.now - t < self.older_than:
                return False
        return True

    def describe(self) -> str:
        parts = []
        if self.lora is not None:
            parts.append(f"LoRA {self.lora!r}")
        if self.model is not None:
            parts.append(f"model {self.model!r}")
        if self.older_than is not None:
            parts.append(f"unused for {format_age(self.older_than)}")
        return ", ".join(parts) or "all entries"


@dataclass
class Group:
    entries: int = 0
    bytes: int = 0

    def to_dict(self) -> dict:
        return {"entries": self.entries, "bytes": self.bytes}


@dataclass
class Summary:
    """Counts and bytes over a set of entries; mergeable (parallel shards)."""

    entries: int = 0
    bytes: int = 0
    legacy: int = 0
    legacy_bytes: int = 0
    unreadable: int = 0
    unreadable_bytes: int = 0
    #: entries written by a newer encache (a format this build does not read): not
    #: counted as unreadable
    newer: int = 0
    newer_bytes: int = 0
    oldest: float | None = None  # earliest creation
    newest: float | None = None  # latest creation
    last_access: float | None = None
    by_model: dict[str | None, Group] = field(default_factory=dict)
    by_lora: dict[str | None, Group] = field(default_factory=dict)
    #: encoder-config digest ("" = default) -> group; None for unreadable headers
    by_encoder_config: dict[str | None, Group] = field(default_factory=dict)
    #: (LoRA name, adapter digest) -> [entries, bytes, newest creation]: stale-LoRA view
    lora_digests: dict[tuple[str, str], list] = field(default_factory=dict)

    def add(self, e: EntryInfo) -> None:
        size = e.size
        self.entries += 1
        self.bytes += size
        if e.error == NEWER_FORMAT:
            self.newer += 1
            self.newer_bytes += size
        elif e.error is not None:
            self.unreadable += 1
            self.unreadable_bytes += size
        elif e.meta is not None and e.meta.legacy:
            self.legacy += 1
            self.legacy_bytes += size
        c = e.created
        if c is not None:
            if self.oldest is None or c < self.oldest:
                self.oldest = c
            if self.newest is None or c > self.newest:
                self.newest = c
        a = e.accessed
        if a is not None and (self.last_access is None or a > self.last_access):
            self.last_access = a
        meta = e.meta
        lora = meta.lora if meta is not None and meta.lora else split_lora(e.identifier)[0]
        for groups, key in ((self.by_model, meta.model if meta is not None else None),
                            (self.by_lora, lora),
                            (self.by_encoder_config,
                             meta.encoder_config if meta is not None else None)):
            g = groups.get(key)
            if g is None:
                g = groups[key] = Group()
            g.entries += 1
            g.bytes += size
        if meta is not None and meta.lora_digest and e.lora:
            d = self.lora_digests.setdefault((e.lora, meta.lora_digest), [0, 0, 0.0])
            d[0] += 1
            d[1] += size
            d[2] = max(d[2], c or 0.0)

    def stale_lora(self) -> dict[str, Group]:
        """LoRA name -> entries stamped with an adapter digest other than the newest one
        written under that name (a retrained adapter's predecessors)."""
        from .lora_stamp import newest_of

        out: dict[str, Group] = {}
        current = newest_of(self.lora_digests)
        for (name, digest), (n, size, _) in self.lora_digests.items():
            if digest != current[name]:
                g = out.setdefault(name, Group())
                g.entries += n
                g.bytes += size
        return out

    def to_state(self) -> dict:
        """Plain builtins (for the disk store's header index)."""
        state = {k: getattr(self, k) for k in ("entries", "bytes", "legacy", "legacy_bytes",
                                                "unreadable", "unreadable_bytes", "newer",
                                                "newer_bytes", "oldest", "newest",
                                                "last_access")}
        for name in ("by_model", "by_lora", "by_encoder_config"):
            state[name] = {k: (g.entries, g.bytes) for k, g in getattr(self, name).items()}
        return state

    @classmethod
    def from_state(cls, state: dict) -> Summary:
        groups = {name: {k: Group(*v) for k, v in state[name].items()}
                  for name in ("by_model", "by_lora", "by_encoder_config")}
        plain = {k: v for k, v in state.items() if k not in groups}
        return cls(**plain, **groups)

    def merge(self, other: Summary) -> Summary:
        self.entries += other.entries
        self.bytes += other.bytes
        self.legacy += other.legacy
        self.legacy_bytes += other.legacy_bytes
        self.unreadable += other.unreadable
        self.unreadable_bytes += other.unreadable_bytes
        self.newer += other.newer
        self.newer_bytes += other.newer_bytes
        for name in ("oldest", "last_access", "newest"):
            a, b = getattr(self, name), getattr(other, name)
            if b is not None:
                pick = min if name == "oldest" else max
                setattr(self, name, b if a is None else pick(a, b))
        for mine, theirs in ((self.by_model, other.by_model), (self.by_lora, other.by_lora),
                             (self.by_encoder_config, other.by_encoder_config)):
            for k, g in theirs.items():
                m = mine.setdefault(k, Group())
                m.entries += g.entries
                m.bytes += g.bytes
        for k, (n, size, newest) in other.lora_digests.items():
            d = self.lora_digests.setdefault(k, [0, 0, 0.0])
            d[0] += n
            d[1] += size
            d[2] = max(d[2], newest)
        return self


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Lists of up to ``size`` items, each handed out as soon as it is full (or the items
    end): a store walk or a stream of work in chunks, without reading it all first."""
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


def scan(store: Store, flt: EntryFilter | None = None,
         progress: Callable[[int], None] | None = None,
         unreachable: list | None = None) -> Iterator[EntryInfo]:
    """Every entry's header info (optionally filtered); ``progress(n_seen)`` now and then.
    ``unreachable``: a list for a walk that may be partial (:meth:`.base.Store.scan`)."""
    n = 0
    for e in store.scan(unreachable=unreachable):
        n += 1
        if progress is not None and n % TICK_EVERY == 0:
            progress(n)
        if flt is None or flt.matches(e):
            yield e
    if progress is not None:
        progress(n)


def parts_dicts(unreachable: Iterable[tuple[str, str]]) -> list[dict]:
    """A walk's ``unreachable`` parts, ``(part, reason)``, as JSON records (the
    ``unreachable`` field of a report)."""
    return [{"part": part, "error": reason} for part, reason in unreachable]


def summarize_entries(entries: Iterable[EntryInfo]) -> Summary:
    s = Summary()
    for e in entries:
        s.add(e)
    return s


# -- parallel summaries ---------------------------------------------------------------

def default_workers() -> int:
    """Worker processes for :func:`summarize`: 1 unless at least :data:`MIN_PARALLEL_CPUS`
    CPUs are idle (then one per idle CPU, at most 8).

    A parallel summary lists identifiers, then each worker looks entries up one by one
    (``store.stat``), which costs ~1.7x the CPU of the single sequential ``store.scan()``
    (measured on disk: 7.8 s vs 4.5 s for 100,000 entries, plus 0.9 s to list them). So it
    only wins with 4+ free cores; on a loaded or small machine it loses
    (``benchmarks/cli.json``).
    """
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    try:
        idle = int(n - os.getloadavg()[0] + 0.5)
    except OSError:  # pragma: no cover
        idle = n
    return min(8, idle) if idle >= MIN_PARALLEL_CPUS else 1


MIN_PARALLEL_CPUS = 4

#: below this many entries a process pool costs more than it saves
PARALLEL_MIN_ENTRIES = 20_000


def _summarize_shard(args) -> Summary:
    url, options, identifiers, flt = args
    from . import open_store  # the package face (a worker process opens its own)

    s = Summary()
    with open_store(url, create=False, **options) as store:
        for ident in identifiers:
            e = store.stat(ident)
            if e is not None and (flt is None or flt.matches(e)):
                s.add(e)
    return s


def summarize(store: Store, flt: EntryFilter | None = None, *, url: str | None = None,
              workers: int = 1, options: dict | None = None,
              progress: Callable[[int], None] | None = None,
              min_parallel: int = PARALLEL_MIN_ENTRIES,
              unreachable: list | None = None) -> Summary:
    """Summarise a store. With ``workers > 1`` and ``url`` given, header reads are split
    across that many processes (each re-opens ``url``); small stores are scanned inline.
    ``unreachable``: as for :func:`scan` (the summary is then of the parts that answered).
    """
    if flt is None or not flt.active:
        summary = store.summary_if_unchanged()  # disk: from the header index, if current
        if summary is not None:
            if progress is not None:
                progress(summary.entries)
            return summary
    if workers <= 1 or url is None:
        return summarize_entries(scan(store, flt, progress, unreachable))
    skipped: list = []
    identifiers = list(store.identifiers(unreachable=None if unreachable is None else skipped))
    if len(identifiers) < max(1, min_parallel):
        return summarize_entries(scan(store, flt, progress, unreachable))
    if unreachable is not None:
        unreachable.extend(skipped)
    import multiprocessing as mp

    # fork: the children need nothing but the arguments (no re-import, fast start)
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
    n_chunks = workers * 4
    size = -(-len(identifiers) // n_chunks)
    chunks = [(url, options or {}, identifiers[i:i + size], flt)
              for i in range(0, len(identifiers), size)]
    total, done = Summary(), 0
    with ctx.Pool(workers) as pool:
        for part, chunk in zip(pool.imap(_summarize_shard, chunks), chunks):
            total.merge(part)
            done += len(chunk[2])
            if progress is not None:
                progress(done)
    return total

