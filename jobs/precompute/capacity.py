"""A corpus larger than the store's capacity: measure it, say so once, and let the
operator choose what a refresh does about it.

What: :func:`mean_entry_bytes` estimates one entry's size from entries already stored
(header reads of a sample); :func:`capacity_note` turns "distinct identifiers × mean
size" against ``max_bytes`` into one sentence with the numbers; :class:`RoomBudget`
decides, batch by batch, how many more entries fit without evicting anything (for
``--over-capacity skip``).

Why: with ``max_bytes`` below what the corpus needs, every cron refresh re-encoded the
entries the previous one evicted (the eviction keeps the least recently *served* out,
which is right for serving, but cost a full engine start and re-encode per run), and
nothing said so. The store now remembers what it evicted (:mod:`.store.removals`) and a
refresh leaves that out unless ``--refill-removed``; the note says so. Two policies:

* ``keep-served`` (default): encode every missing image not removed by a policy; the
  store evicts the least recently used entries to make room, so what consumers serve
  stays.
* ``skip``: encode missing images only into free room (below the store's low
  watermark); nothing already stored is evicted by the run, and what does not fit is
  counted as skipped (capacity). A refresh of an unchanged corpus then starts no engine.

No vLLM import: precompute (CLI) uses it around the producer engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...connectors.store.units import human_bytes
from ...connectors.store.throttle import ScanThrottle

__all__ = ["OVER_CAPACITY", "mean_entry_bytes", "capacity_note", "RoomBudget"]

OVER_CAPACITY = ("keep-served", "skip")


def mean_entry_bytes(store, identifiers, sample: int = 32) -> float | None:
    """Mean stored size of up to ``sample`` of ``identifiers`` that are in the store."""
    sizes = []
    for ident in identifiers:
        info = store.stat(ident)
        if info is not None:
            sizes.append(info.size)
            if len(sizes) >= sample:
                break
    return sum(sizes) / len(sizes) if sizes else None


def capacity_note(entries: int, mean_bytes: float | None, max_bytes: int | None,
                  policy: str) -> dict | None:
    """``{"need_bytes", "max_bytes", "entries", "mean_entry_bytes", "message"}`` when
    the corpus does not fit the capacity, else None."""
    if not max_bytes or not mean_bytes or entries <= 0:
        return None
    need = int(entries * mean_bytes)
    if need <= max_bytes:
        return None
    fit = int(max_bytes // mean_bytes)
    if policy == "skip":
        advice = ("images that do not fit are skipped (--over-capacity skip); raise "
                  "--max-bytes to store them all")
    else:
        advice = ("the least recently served entries are evicted to make room, and later "
                  "refreshes leave them out (--refill-removed encodes them again); raise "
                  "--max-bytes, or pass --over-capacity skip to evict nothing")
    message = (f"the corpus needs ~{human_bytes(need)} ({entries:,} entries x ~{human_bytes(mean_bytes)}) "
               f"but the store holds at most {human_bytes(max_bytes)} (~{fit:,} entries): {advice}")
    return {"need_bytes": need, "max_bytes": int(max_bytes), "entries": entries,
            "mean_entry_bytes": int(mean_bytes), "message": message}


@dataclass
class RoomBudget:
    """How many more entries fit under ``max_bytes × low_watermark`` without eviction.

    The store's usage is re-read only while reading it costs at most 5 % of the time
    since the last read (``scan_share``): a disk store stats every entry to sum them,
    seconds on a million-entry store, and a run asks before every batch. Between reads
    the figure is the last one plus what this run let in (``fits`` reserves
    ``n × mean_bytes`` for the ``n`` it returns). A small store is therefore re-read at
    every batch (exact, as before); a million-entry one about once a minute. What other
    writers add between reads (Ray's other engines) goes unseen for that long; the gap
    between the low watermark and ``max_bytes`` (10 % of the store) absorbs it unless
    they write more than ~1,200 entries/s (0.1 / (20 × ~4 µs per entry read)), and
    past ``max_bytes`` the store evicts."""

    store: object
    max_bytes: int
    low_watermark: float = 0.9
    mean_bytes: float | None = None

    #: entries other writers may be adding at the same time (Ray: the other engines'
    #: batches in flight), held back from the room once the entry size is known
    others_in_flight: int = 0

    #: the largest share of a run's time spent re-reading the store's usage
    scan_share: float = 0.05

    #: called before the usage is re-read (a producer: wait for its queued writes)
    before_read: Callable[[], None] | None = None

    _used: int | None = field(default=None, init=False, repr=False)
    _reserved: float = field(default=0.0, init=False, repr=False)
    _unsized: bool = field(default=False, init=False, repr=False)
    _reading: ScanThrottle = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._reading = ScanThrottle(self.scan_share)

    @property
    def reads(self) -> int:
        """How many times the store's usage was read (tests, benchmarks)."""
        return self._reading.walks

    def used(self) -> float:
        """The store's usage as this budget knows it: last read plus reservations."""
        if self._used is None or self._unsized or self._reading.due():
            if self.before_read is not None:
                self.before_read()
            self._used = int(self._reading.run(self.store.used_bytes))
            self._reserved, self._unsized = 0.0, False
        return self._used + self._reserved

    def fits(self, wanted: int) -> int:
        """Of ``wanted`` new entries, how many fit now (all, while the size is unknown
        and the store is empty enough to learn it from the first batch); the ones
        returned are counted as written until the usage is next read."""
        room = self.max_bytes * self.low_watermark - self.used()
        if self.mean_bytes is None:
            n = wanted if room > 0 else 0
            self._unsized = self._unsized or n > 0  # read again once they are written
            return n
        room -= self.others_in_flight * self.mean_bytes
        n = max(0, min(wanted, int(room // self.mean_bytes)))
        self._reserved += n * self.mean_bytes
        return n
