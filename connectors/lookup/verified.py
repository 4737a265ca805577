"""Verify once per stored version: which stored copies were already checksummed.

A full validation hashes every byte of an entry. The lookup does it on the first load of
each stored *version* — for a disk file its identity ``(device, inode, size, mtime_ns)``,
which access tracking leaves alone and any rewrite or replacement changes — and later
loads of the same unchanged file reuse the parsed header and skip the hash.
``verify="always"`` hashes every load; Redis values carry no version and are always
verified. Bounded LRU of ``VERIFIED_VERSIONS`` records.

Where the store keeps a log of verified versions (``Store.verified_log``: a local disk
store, per boot; ``store/verified_log.py``), every checksum that passes is appended to it,
and :meth:`VerifiedVersions.load_log` reads what earlier consumers (and producers) of this
boot recorded, and later reads what they append while it runs: a version found there is
*trusted* -- its first load here parses and size-checks the header but skips the
checksum. A producer on the same host records every entry it commits, so in encoder
disaggregation on one host the prefill instance's first load of what the encoder just
wrote is not hashed a second time. A restart (vLLM SIGKILLs its engine) then
costs no second hashing pass over entries already verified since the host booted. Log
records also bind the inode's change time (``files.ServedVersion``); when the store's own
access-time refresh moves it, the new one is recorded, but only if the ctime found was
the one this process verified or trusted (anything else may have written the file).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..store.entry import EntryMeta
from ..store.files import ServedVersion
from ..store.verified_log import VerifiedLog, VerifiedTable, record_key

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
    ctime_ns: int | None = None  # the inode change time this process vouches for (the log)


class VerifiedVersions:
    def __init__(self, verify: bool | str = True, log: VerifiedLog | None = None):
        self.verify, self.verify_always = parse_verify(verify)
        self._lock = threading.Lock()
        self._records: OrderedDict[object, VerifiedRecord] = OrderedDict()
        self._seen: set[str] = set()  # identifiers with a record (first loads: not here)
        #: the store's log of versions verified this boot (only when checksums run once)
        self.log = log if self.verify and not self.verify_always else None
        self._trusted = VerifiedTable()  # what the log held at start, and read since
        self._new: dict[int, int] = {}  # records read since, not yet merged into it
        self._live = False  # read what others append while this runs (after load_log)
        self._log_lock = threading.Lock()
        #: loads whose checksum the log made unnecessary
        self.trusted_loads = 0

    def load_log(self) -> int:
        """Trust the versions the log holds; returns how many it holds."""
        if self.log is not None:
            table = self.log.load()
            with self._log_lock:
                self._trusted, self._new, self._live = table, {}, True
        return len(self._trusted)

    @property
    def logged_versions(self) -> int:
        """How many versions the log held when :meth:`load_log` read it."""
        return len(self._trusted)

    def trusted(self, identifier: str, version) -> bool:
        """``version`` of ``identifier``, unchanged since (same ctime), was verified
        earlier this boot (the log)."""
        if self.log is None or not isinstance(version, ServedVersion):
            return False
        key = record_key(identifier, version)
        if self._trusted.holds(key, version.ctime_ns):
            return True
        if not self._live:
            return False
        with self._log_lock:
            self._read_new()
            if self._new.get(key) == version.ctime_ns:
                return True
        # (a match on any record is sound: a file's ctime never moves back)
        return self._trusted.holds(key, version.ctime_ns)

    def _read_new(self) -> None:
        """Read the log's records appended since it was loaded (other consumers'
        checksums, and entries producers on this host committed while this one runs: an
        EPD encoder's output reaches the prefill instance's first load already vouched
        for), folded into the table once there are many. A log replaced since (another
        process compacted it when it loaded it) is loaded again, whole. Under
        ``_log_lock``."""
        if not self._live:
            return
        got = self.log.read_new()
        if got is None:
            self._trusted, self._new = self.log.load(), {}
            return
        keys, ctimes = got
        if len(keys):
            self._new.update(zip(keys.tolist(), ctimes.tolist()))
            if len(self._new) > max(4096, len(self._trusted) // 8):
                n = len(self._new)
                self._trusted = self._trusted.merged(np.fromiter(self._new, np.uint64, n),
                                                     np.fromiter(self._new.values(), np.int64, n))
                self._new = {}

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
        self._log_touch(identifier, version, record)
        return record

    def _log_touch(self, identifier: str, version, record: VerifiedRecord) -> None:
        """The store refreshed the access time of a version this process vouches for:
        record its new ctime (else a restarted consumer would hash it again)."""
        if (self.log is None or not isinstance(version, ServedVersion)
                or version.touched_ctime_ns == version.ctime_ns
                or version.ctime_ns != record.ctime_ns):
            return
        record.ctime_ns = version.touched_ctime_ns
        self.log.append(record_key(identifier, version), version.touched_ctime_ns)

    def remember(self, identifier: str, version, meta: EntryMeta, offset: int, *,
                 checksummed: bool = True) -> None:
        """``version`` of ``identifier`` passed validation (nothing kept when unversioned
        or when every load is verified anyway). A fresh checksum goes to the log, and so
        does a trusted version's new ctime after the store's access-time refresh."""
        if version is None or self.verify_always:
            return
        ctime = None
        if isinstance(version, ServedVersion):
            ctime = version.touched_ctime_ns
            if self.log is not None and (checksummed or ctime != version.ctime_ns):
                self.log.append(record_key(identifier, version), ctime)
        with self._lock:
            self._records[version] = VerifiedRecord(identifier, meta, offset, time.monotonic(),
                                                    ctime)
            self._seen.add(identifier)
            if len(self._records) > VERIFIED_VERSIONS:
                self._seen.discard(self._records.popitem(last=False)[1].identifier)

    def forget_all(self) -> None:
        """Forget every verified version, the log's included (they are hashed again)."""
        with self._lock:
            self._records.clear()
            self._seen.clear()
        with self._log_lock:
            self._trusted, self._new, self._live = VerifiedTable(), {}, False

    def seen(self, identifier: str) -> bool:
        """A version of ``identifier`` was validated here (else its next load is a first
        load: nothing to reuse, read and check it in one pass)."""
        return identifier in self._seen

    def count(self, identifiers) -> int:
        """How many of ``identifiers`` have a verified version on record."""
        with self._lock:
            seen = {rec.identifier for rec in self._records.values()}
        return sum(1 for i in identifiers if i in seen)
