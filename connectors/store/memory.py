"""The in-memory store (``memory://NAME``): the reference backend.

Entries, notes, counters and locks live in this process's memory, in a space named by
the URL; every handle opened on ``memory://NAME`` in the process shares it (``reopen``,
a second ``open_store``), and nothing outlives the process. It honours the store
contract (``tests/store_contract.py``) with the ABC's defaults for every capability, so
it is the smallest complete backend: the model for a new one (a module, an entry in
:data:`.registry.BACKENDS`, a contract-test module) and a store for tests that need no
disk or server. Not for serving: another process, a vLLM worker included, sees an
empty store of that name.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .base import EntryInfo, LockBusy, Store, StoreError, StoreInfo, info_from_blob_header
from .entry import byte_views
from .keys import validate

SCHEME = "memory"


@dataclass
class _Space:
    """What every handle on one ``memory://NAME`` shares (guarded by ``mutex``)."""

    mutex: threading.Lock = field(default_factory=threading.Lock)
    #: identifier -> (blob, created)
    entries: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    #: name -> (text, expiry)
    notes: dict[str, tuple[str, float]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    locks: set[str] = field(default_factory=set)
    freed: threading.Condition = field(init=False)

    def __post_init__(self):
        self.freed = threading.Condition(self.mutex)


_SPACES: dict[str, _Space] = {}
_SPACES_MUTEX = threading.Lock()


def _space(name: str) -> _Space:
    with _SPACES_MUTEX:
        return _SPACES.setdefault(name, _Space())


class MemoryStore(Store):
    """Entries in this process's memory, shared by every handle on the same name."""

    backend = "memory"

    def __init__(self, url: str, *, max_bytes: int | None = None):
        parts = urlsplit(url)
        if parts.scheme != SCHEME or not parts.netloc or parts.path.strip("/"):
            raise StoreError(f"an in-memory store is memory://NAME, not {url!r}")
        self._url = f"{SCHEME}://{parts.netloc}"
        self._space = _space(parts.netloc)
        #: reported by ``info`` and ``stats``; not enforced (no eviction in memory)
        self.max_bytes = max_bytes

    @property
    def url(self) -> str:
        return self._url

    def reopen(self) -> MemoryStore:
        return MemoryStore(self._url, max_bytes=self.max_bytes)

    # -- entries -----------------------------------------------------------------
    def get(self, identifier: str) -> bytes | None:
        with self._space.mutex:
            got = self._space.entries.get(identifier)
        return None if got is None else got[0]

    def put(self, identifier: str, parts: bytes | Iterable, *, encoded_here: bool = False) -> int:
        validate(identifier)
        blob = b"".join(byte_views(parts))  # a private copy: the caller may reuse its buffers
        with self._space.mutex:
            self._space.entries[identifier] = (blob, time.time())
        return len(blob)

    def delete(self, identifier: str) -> bool:
        with self._space.mutex:
            return self._space.entries.pop(identifier, None) is not None

    def contains(self, identifier: str) -> bool:
        return identifier in self._space.entries

    def identifiers(self, *, unreachable: list | None = None,
                    hint: bool = False) -> Iterator[str]:
        with self._space.mutex:
            return iter(list(self._space.entries))

    def scan(self, *, unreachable: list | None = None) -> Iterator[EntryInfo]:
        with self._space.mutex:
            items = list(self._space.entries.items())
        for identifier, (blob, created) in items:
            yield info_from_blob_header(identifier, len(blob), blob, created, None)

    def stat(self, identifier: str) -> EntryInfo | None:
        with self._space.mutex:
            got = self._space.entries.get(identifier)
        if got is None:
            return None
        blob, created = got
        return info_from_blob_header(identifier, len(blob), blob, created, None)

    # -- notes ----------------------------------------------------------------------
    def put_note(self, name: str, text: str, ttl: float = 600.0) -> str:
        with self._space.mutex:
            self._space.notes[name] = (text, time.monotonic() + ttl)
        return f"{self._url} note {name}"

    def get_note(self, name: str) -> str | None:
        with self._space.mutex:
            got = self._space.notes.get(name)
            if got is not None and got[1] <= time.monotonic():
                del self._space.notes[name]
                got = None
        return None if got is None else got[0]

    def delete_note(self, name: str) -> None:
        with self._space.mutex:
            self._space.notes.pop(name, None)

    # -- bookkeeping ------------------------------------------------------------------
    def add_counters(self, deltas: dict[str, float]) -> None:
        with self._space.mutex:
            for k, v in deltas.items():
                self._space.counters[k] = self._space.counters.get(k, 0) + v

    def read_counters(self) -> dict[str, float]:
        with self._space.mutex:
            return dict(self._space.counters)

    def reset_counters(self) -> None:
        with self._space.mutex:
            self._space.counters.clear()

    def info(self) -> StoreInfo:
        return StoreInfo(url=self._url, backend=self.backend, max_bytes=self.max_bytes)

    @contextlib.contextmanager
    def lock(self, name: str, wait: float = 0.0):
        """Exclusive among the handles of this process (the only ones a memory store
        has); not re-entrant: a second ``lock`` of a held name waits, then LockBusy."""
        space = self._space
        deadline = time.monotonic() + wait
        with space.mutex:
            while name in space.locks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LockBusy(f"{self._url} is locked ({name})")
                space.freed.wait(left)
            space.locks.add(name)
        try:
            yield self
        finally:
            with space.mutex:
                space.locks.discard(name)
                space.freed.notify_all()
