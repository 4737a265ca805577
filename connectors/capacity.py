"""A corpus larger than the store's capacity: measure it, say so once, and let the
operator choose what a refresh does about it.

What: :func:`mean_entry_bytes` estimates one entry's size from entries already stored
(header reads of a sample); :func:`capacity_note` turns "distinct identifiers × mean
size" against ``max_bytes`` into one sentence with the numbers; :class:`RoomBudget`
decides, batch by batch, how many more entries fit without evicting anything (for
``--over-capacity skip``).

Why: with ``max_bytes`` below what the corpus needs, every cron refresh re-encodes the
entries the previous one evicted (the eviction keeps the least recently *served* out,
which is right for serving, but costs a full engine start and re-encode per run), and
nothing said so. Two policies:

* ``keep-served`` (default, the behaviour so far): encode every missing image; the store
  evicts the least recently used entries to make room, so what consumers serve stays.
* ``skip``: encode missing images only into free room (below the store's low
  watermark); nothing already stored is evicted by the run, and what does not fit is
  counted as skipped (capacity). A refresh of an unchanged corpus then starts no engine.

No vLLM import: precompute (CLI) uses it around the producer engine.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


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
        advice = ("each refresh re-encodes what the last one evicted (the least recently "
                  "served go first); raise --max-bytes, or pass --over-capacity skip to "
                  "stop re-encoding what cannot be kept")
    message = (f"the corpus needs ~{_human(need)} ({entries:,} entries x ~{_human(mean_bytes)}) "
               f"but the store holds at most {_human(max_bytes)} (~{fit:,} entries): {advice}")
    return {"need_bytes": need, "max_bytes": int(max_bytes), "entries": entries,
            "mean_entry_bytes": int(mean_bytes), "message": message}


@dataclass
class RoomBudget:
    """How many more entries fit under ``max_bytes × low_watermark`` without eviction."""

    store: object
    max_bytes: int
    low_watermark: float = 0.9
    mean_bytes: float | None = None

    #: entries other writers may be adding at the same time (Ray: the other engines'
    #: batches in flight), held back from the room once the entry size is known
    others_in_flight: int = 0

    def fits(self, wanted: int) -> int:
        """Of ``wanted`` new entries, how many fit now (all, while the size is unknown
        and the store is empty enough to learn it from the first batch)."""
        used = self.store.used_bytes()
        room = self.max_bytes * self.low_watermark - used
        if self.mean_bytes is None:
            return wanted if room > 0 else 0
        room -= self.others_in_flight * self.mean_bytes
        return max(0, min(wanted, int(room // self.mean_bytes)))
