"""What the store holds: a set of identifiers kept fresh in the background.

The scheduler asks "is this item stored?" per item per step, so the answer comes from
memory. The set is scanned at start and refreshed every ``index_refresh_s`` by the
lookup's background thread (skipped while the store's ``index_version()`` is unchanged,
and while listing again would take more than ``LIST_SHARE`` of the thread's time: a
million-entry disk store costs seconds to list, and a producer writing to it moves the
version at every put).
Where the store keeps a change journal (``changes_since``), a refresh after a change
reads the journal from its cursor and looks up only the identifiers it names (a
``stat`` each on disk, an ``EXISTS`` on Redis): O(changes), not a listing of a million
entries. It lists the store whole when the journal cannot tell (no cursor yet, trimmed
past it, a part down), when the version moved with nothing journaled (a change by a
program other than encache), and, for a journal that can miss a change
(``journal_complete`` False), at least every ``JOURNAL_FULL_CHECK_S`` (paced as above).
An identifier not in the set may have been written since the last listing (an encoder
instance wrote it a moment ago, EPD): a local disk store checks it with one ``stat``, and
for a remote store (Redis) it is worth one background read (``holds`` says yes; the read
finds it or not). Either way an identifier found absent is remembered for ``ABSENT_S``
only, so a retry moments later looks again. A stale positive costs one background read
that finds nothing: a miss.
"""

from __future__ import annotations

import threading
import time

from ..store.base import JOURNAL_FULL_CHECK_S, Store, StoreError
from ..store.throttle import ScanThrottle

ABSENT_MAX = 100_000  # negative-cache size; cleared wholesale when exceeded
ABSENT_S = 0.2  # an identifier found absent is not looked up again for this long
LIST_SHARE = 0.05  # the largest share of time spent listing the store (after the first)


class StoreIndex:
    def __init__(self, store: Store, refresh_s: float):
        self.store = store
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._ids: set[str] = set()
        self._absent: dict[str, float] = {}  # identifier -> expiry (local stores)
        self._last_version = None
        #: the last refresh found the store changed (or cannot tell: no version token)
        self.changed = True
        #: parts of the store the last refresh could not reach: ``{part: reason}``
        self.down: dict[str, str] = {}
        self._ready = threading.Event()
        self.listing = ScanThrottle(LIST_SHARE)  # paces listings after the first
        self._cursor = None  # the store's change journal, read up to here (None: list)
        self._listed_at = 0.0  # when the last whole listing ended (monotonic)
        #: refreshes answered from the journal (tests, benchmarks)
        self.journal_refreshes = 0

    def refresh(self) -> set[str]:
        """Re-list the store if its index version moved; the identifiers that appeared
        (or, from the journal, were rewritten).
        Raises what the store raises (the caller trips the breaker and keeps the old set),
        but where the store's parts fail apart (a Redis Cluster's primaries) a part that
        does not answer is named in :attr:`down` (``{part: reason}``) and the others are
        listed: its entries are left out until it answers (a listing is then taken again,
        paced as any other), and if it holds the version token, changes are unknown."""
        down: dict[str, str] = {}
        self.down = down
        try:
            version = self.store.index_version()
        except StoreError as e:
            if e.domain is None:  # (the store as a whole)
                raise
            down[e.domain] = e.reason
            version = None  # (cannot tell what changed)
        self.changed = version is None or version != self._last_version
        if not self.changed:
            return set()
        if not down and self._cursor is not None:
            new = self._from_journal()
            if new is not None:
                self._last_version = version
                return new
        if not self.listing.due():
            return set()  # later; a local store's holds() stats an unknown identifier meanwhile
        cursor = self._journal_end()  # before the listing: a change during it is read next
        parts: list = []
        # (a hint: the lookup reads an entry before anything is served from it)
        ids = self.listing.run(lambda: set(self.store.identifiers(unreachable=parts,
                                                                  hint=True)))
        self._listed_at = time.monotonic()
        down.update(parts)
        with self._lock:
            old, self._ids = self._ids, ids
        self._last_version = None if down else version  # (partial: list again)
        self._cursor = None if down else cursor
        return ids - old

    def _journal_end(self):
        """A journal cursor at its current end, or None (no journal, or it cannot say)."""
        if not self.store.supports_change_journal:
            return None
        try:
            return self.store.changes_since(None)[0]
        except StoreError:
            return None

    def _from_journal(self) -> set[str] | None:
        """Apply the changes the journal names since the cursor (each identifier looked up
        once: present, added; absent, dropped); the identifiers written since (new or
        rewritten: a listing may have named one while its write was in flight, so
        "not held yet" would miss it), or None where a whole listing is needed instead
        (see the module docstring)."""
        store = self.store
        if (not store.journal_complete
                and time.monotonic() - self._listed_at >= JOURNAL_FULL_CHECK_S):
            return None
        try:
            cursor, changed = store.changes_since(self._cursor)
        except StoreError:
            return None
        if changed is None or (not changed and not store.journal_complete):
            return None  # cannot tell; or the version moved for a change not journaled
        present = {i for i in changed if store.contains(i)}
        with self._lock:  # in place: each add / discard is atomic for a lock-free holds()
            ids = self._ids
            ids |= present
            ids -= changed - present
            for i in present:
                self._absent.pop(i, None)
        self._cursor = cursor
        self.journal_refreshes += 1
        return present

    @property
    def versioned(self) -> bool:
        """The store gives a version token (``index_version``): :attr:`changed` is exact."""
        return self._last_version is not None

    @property
    def listings(self) -> int:
        """How many times the store was listed (tests, benchmarks)."""
        return self.listing.walks

    def mark_ready(self) -> None:
        """The first refresh finished (or failed): lookups may trust the set now."""
        self._ready.set()

    def is_ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)

    def holds(self, identifier: str, now: float | None = None) -> bool:
        """Is ``identifier`` worth a read? Memory speed, except one ``stat`` for an
        unknown identifier on a local store (a remote store: yes, unless it was found
        absent within ``ABSENT_S``); may be stale. Raises what the store raises on that
        ``stat``."""
        # single set/dict reads, atomic under the GIL (the set is swapped whole by
        # refresh()): no lock on the scheduler's per-item path
        if identifier in self._ids:
            return True
        now = time.monotonic() if now is None else now
        if self._absent.get(identifier, 0) > now:
            return False
        if not self.store.local:
            return True  # the background read finds out (forget() if it is absent)
        found = self.store.contains(identifier)  # one stat on a local disk
        with self._lock:
            if found:
                self._ids.add(identifier)
            else:
                self._note_absent(identifier, now)
        return found

    def forget(self, identifier: str) -> None:
        """A read found nothing: the entry is gone (until the next refresh lists it)."""
        with self._lock:
            self._ids.discard(identifier)
            self._note_absent(identifier, time.monotonic())

    def recheck(self, identifier: str) -> None:
        """Look ``identifier`` up again at its next ``holds`` (a caller waits for it)."""
        self._absent.pop(identifier, None)

    def _note_absent(self, identifier: str, now: float) -> None:  # caller holds the lock
        self._absent[identifier] = now + ABSENT_S
        if len(self._absent) > ABSENT_MAX:
            self._absent.clear()
