"""Verify once per stored version: which stored copies were already checksummed.

A full validation hashes every byte of an entry. The lookup does it on the first load of
each stored *version* — for a disk file its identity ``(device, inode, size, mtime_ns)``,
which access tracking leaves alone and any rewrite or replacement changes — and later
loads of the same unchanged file reuse the parsed header and skip the hash.
``verify="always"`` hashes every load; Redis values carry no version and are always
verified. Bounded LRU of ``VERIFIED_VERSIONS`` records.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ..store.entry import EntryMeta

VERIFIED_VERSIONS = 1 << 16  # remembered (version -> parsed header) pairs, LRU


def parse_verify(value) -> tuple[bool, bool]:
    """``verify`` setting -> (checksum at all, checksum every load)."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "always":
            return True, True
        if v in ("true", "yes", "1", "once", "on"):
            return True, False
        if v in ("false", "no", "0", "off", "never"):
            return False, False
        raise ValueError(f"verify must be true, false or 'always', not {value!r}")
    return bool(value), False


@dataclass
class VerifiedRecord:
    """A stored version already validated: its parsed header and payload offset."""

    identifier: str
    meta: EntryMeta
    offset: int
    last_load: float  # monotonic time of the last load (page-cache readahead decision)


class VerifiedVersions:
    def __init__(self, verify: bool | str = True):
        self.verify, self.verify_always = parse_verify(verify)
        self._lock = threading.Lock()
        self._records: OrderedDict[object, VerifiedRecord] = OrderedDict()

    def find(self, identifier: str, version) -> VerifiedRecord | None:
        """The record of an already validated stored version of ``identifier``, or None
        (unversioned, ``verify="always"``, or not validated yet)."""
        if version is None or self.verify_always:
            return None
        with self._lock:
            record = self._records.get(version)
            if record is None or record.identifier != identifier:
                return None
            self._records.move_to_end(version)
            return record

    def remember(self, identifier: str, version, meta: EntryMeta, offset: int) -> None:
        """``version`` of ``identifier`` passed validation (nothing kept when unversioned
        or when every load is verified anyway)."""
        if version is None or self.verify_always:
            return
        with self._lock:
            self._records[version] = VerifiedRecord(identifier, meta, offset, time.monotonic())
            if len(self._records) > VERIFIED_VERSIONS:
                self._records.popitem(last=False)

    def forget_all(self) -> None:
        with self._lock:
            self._records.clear()

    def count(self, identifiers) -> int:
        """How many of ``identifiers`` have a verified version on record."""
        with self._lock:
            seen = {rec.identifier for rec in self._records.values()}
        return sum(1 for i in identifiers if i in seen)
