"""Scan, filter and summarise a store's entries — shared by ``list``, ``stats``, ``size``,
``purge`` and ``verify``. Pure Python over the :class:`~.base.Store` interface (no vLLM,
no torch, no backend internals), so it works on every backend.

* :class:`EntryFilter` selects entries by LoRA, model and age (ages: :mod:`.units`).
* :func:`summarize` adds them up into a :class:`~.summary.Summary` (total, by model, by
  LoRA, legacy, unreadable, written by a newer encache).
* :func:`scan` / :func:`summarize` walk a store (headers only), optionally across
  processes (:func:`summarize` with ``workers > 1`` re-opens the store by URL in each
  worker process and splits the identifiers between them); given a list
  ``unreachable``, a walk of a store whose parts fail apart covers the parts that answer
  and names the others there (:func:`parts_dicts`: as a report's JSON).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ..base import EntryInfo, Store
from ..keys import split_lora
from ..summary import Summary, summarize_entries
from ..units import format_age

#: progress callbacks are called at most once per this many entries
TICK_EVERY = 256


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
    from .. import open_store  # the package face (a worker process opens its own)

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

