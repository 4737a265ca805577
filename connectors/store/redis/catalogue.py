"""The Redis store's catalogue: listing, headers, membership and what changed.

Entries are listed by ``SCAN`` over the entry keys, their headers read with ``GETRANGE``
in pipelined pages beside the side records (size, put time, access time); the change
journal is a stream under the store's prefix. Part of :class:`~.store.RedisStore` (a
mixin: the methods use its keys and connection).
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterator

from ..base import EntryInfo, Store, StoreError, info_from_blob_header
from ..entry import NEWER_FORMAT, CorruptEntry, header_length
from ..keys import validate
from .errors import ERRORS
from .layout import _HEAD_READ, _META, _BATCH, _JOURNAL_SEP, _enc, _dec, _wrapped


class RedisCatalogue:
    """A Redis store's listing, headers, membership and change tracking."""

    @_wrapped
    def index_version(self) -> bytes | None:
        """A token that changes whenever encache adds or removes an entry (one GET).

        Entries Redis itself evicts or expires do not change it: an index built from it may
        then hold a few stale identifiers, which cost one failed read each (a miss)."""
        return self._r.get(self._gen_key) or b"0"

    @_wrapped
    def changes_since(self, cursor):
        """``(cursor, identifiers put or deleted after cursor)``; the set is None when the
        journal cannot tell (no cursor yet, records trimmed past it, ``gen`` went back):
        the caller re-checks what it holds. One ``GET`` when nothing changed, else one
        ``XRANGE`` per 1000 records."""
        try:
            gen = int(self._r.get(self._gen_key) or 0)
        except ValueError:  # a damaged generation key: the journal cannot tell
            return None, None
        if type(cursor) is not int or gen < cursor:  # (none yet, or a damaged one)
            return gen, None
        if gen == cursor:
            return cursor, set()
        changed: set[str] = set()
        expect = cursor + 1
        while True:
            rows = self._r.xrange(self._journal_key, min=f"{expect}-0", count=1000)
            for record_id, fields in rows:
                if int(record_id.split(b"-", 1)[0]) != expect:
                    return gen, None  # a gap: records trimmed, or gen jumped
                raw = fields.get(b"i", b"")
                if raw:
                    try:
                        changed.update(_dec(x) for x in raw.split(_JOURNAL_SEP.encode()))
                    except ValueError:  # not a record encache writes
                        return gen, None
                expect += 1
            if len(rows) < 1000:
                break
        if expect <= gen:
            return gen, None  # gen moved without records (written before the journal)
        return expect - 1, changed

    @_wrapped
    def unchanged(self, entries) -> list[bool]:
        """One ``HMGET`` of the entries' meta rows per side-key group (one round trip on
        a single server): each row's header is compared with the held one. An entry
        without a meta row is checked with :meth:`stat`."""
        from ..entry import parse_header, same_version
        idents = [_enc(i) for i, _, _ in entries]
        out: list[bool] = [False] * len(entries)
        pipe = self._r.pipeline(transaction=False)
        groups = list(self._grouped(idents).items())
        for (meta_key, _), positions in groups:
            pipe.hmget(meta_key, [idents[n] for n in positions])
        for ((_, _), positions), rows in zip(groups, pipe.execute()):
            for n, row in zip(positions, rows):
                identifier, _, meta = entries[n]
                if row is None:
                    out[n] = Store.unchanged(self, [entries[n]])[0]
                    continue
                try:
                    size, _ = _META.unpack_from(row)
                    held, _ = parse_header(row[_META.size:], total_size=size)
                except (CorruptEntry, struct.error):
                    continue
                out[n] = same_version(held, meta)
        return out

    @_wrapped
    def contains(self, identifier: str) -> bool:
        return bool(self._r.exists(self.key(identifier)))  # EXISTS does not touch the LRU

    def _scan_pages(self, found: set | None = None, unreachable: list | None = None,
                    dedupe: bool = True) -> Iterator[list[bytes]]:
        """Entry keys, a SCAN page at a time, each once (``found``, ``unreachable``: for
        cluster layouts; one server fails as a whole). ``dedupe`` off: a key SCAN names
        twice is yielded twice (for a caller that makes a set of them: no set of every
        key beside it, ~150 MB at a million)."""
        cursor, seen = 0, set() if dedupe else None
        while True:
            with self._errors():
                cursor, keys = self._r.scan(cursor, match=self._match, count=1000)
            if seen is None:
                page = keys
            else:
                page = [k for k in keys if k not in seen]
                seen.update(page)
            if page:
                yield page
            if cursor == 0:
                return

    def _idents(self, page: list[bytes]) -> list[str]:
        """The identifiers of a page of entry keys. A key no encache writer made (its name
        not UTF-8, or not an identifier: another program's, under this prefix) is left
        out: it stopped every listing, and a consumer's index refresh counted the store
        as down for good."""
        out = []
        for key in page:
            try:
                out.append(validate(self._ident(key)))
            except ValueError:
                continue
        return out

    def identifiers(self, *, unreachable: list | None = None,
                    hint: bool = False) -> Iterator[str]:
        for page in self._scan_pages(unreachable=unreachable, dedupe=not hint):
            yield from self._idents(page)

    def scan(self, *, unreachable: list | None = None) -> Iterator[EntryInfo]:
        sides: dict = {}  # (meta, atime) -> [entries seen under it, records it holds or 0]
        found: set = set()  # side-key pairs the key walk came across (cluster)
        for page in self._scan_pages(found, unreachable):
            ids = self._idents(page)
            if not ids:  # (a page of keys no encache writer made)
                continue
            raw = [_enc(i) for i in ids]
            with self._errors():
                metas, atimes = self._page_records(raw, sides)
                missing = [n for n, m in enumerate(metas) if m is None]
                repaired = self._read_heads([ids[n] for n in missing]) if missing else {}
            for n, ident in enumerate(ids):
                value = metas[n] if metas[n] is not None else repaired.get(ident)
                if value is None:  # deleted between SCAN and now
                    continue
                info = self._info(ident, value, atimes[n])
                if info.error not in (None, NEWER_FORMAT) and metas[n] is not None:
                    # the side record may be what is damaged, not the entry: its own
                    # header decides (and is written back), so a repair never removes a
                    # good entry for a bad side record (a newer encache's header, read
                    # whole, is not damage: its row is left as it is)
                    with self._errors():
                        again = self._read_heads([ident]).get(ident)
                    if again is not None:
                        info = self._info(ident, again, atimes[n])
                yield info
        with contextlib.suppress(StoreError), self._errors():
            drift = self._drifted(found, sides)
            if drift:
                self.prune(drift)

    def _page_records(self, raw: list[bytes], sides: dict) -> tuple[list, list]:
        """Header records and access times of one SCAN page (one HMGET + ZSCOREs)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.hmget(self._meta_key, raw)
        for r in raw:
            pipe.zscore(self._atime_key, r)
        res = pipe.execute()
        pair = (self._meta_key, self._atime_key)
        sides.setdefault(pair, [0, 0])[0] += len(raw)
        return res[0], res[1:]

    def _drifted(self, found: set, sides: dict) -> list[tuple[bytes, bytes]]:
        """Side-key pairs holding records of entries that are gone (evicted, expired)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.hlen(self._meta_key)
        pipe.zcard(self._atime_key)
        held = max(pipe.execute())
        pair = (self._meta_key, self._atime_key)
        return [pair] if held > sides.get(pair, [0])[0] else []

    @_wrapped
    def stat(self, identifier: str) -> EntryInfo | None:
        key, ident = self.key(identifier), _enc(identifier)
        meta_key, atime_key = self._side(ident)
        pipe = self._r.pipeline(transaction=False)
        pipe.exists(key)
        pipe.hget(meta_key, ident)
        pipe.zscore(atime_key, ident)
        exists, value, accessed = pipe.execute()
        if not exists:
            return None
        if value is None:
            value = self._read_heads([identifier]).get(identifier)
            if value is None:
                return None
        return self._info(identifier, value, accessed)

    def _info(self, ident: str, value: bytes, accessed: float | None) -> EntryInfo:
        if len(value) < _META.size:
            return EntryInfo(ident, 0, None, None, accessed, "bad-meta")
        size, put_time = _META.unpack_from(value)
        info = info_from_blob_header(ident, size, value[_META.size:], put_time, accessed)
        if info.identifier != ident:  # the key is what consumers look up: keep it, flag it
            return EntryInfo(ident, info.size, info.meta, info.created, info.accessed,
                             info.error or "wrong-identifier")
        return info

    def _read_heads(self, ids: list[str]) -> dict[str, bytes]:
        """Header records for entries whose ``meta`` field is missing (re-read, write back).

        Reading the blob refreshes its LRU clock; this only happens after Redis dropped
        the side hash (or for entries written by something other than encache).
        """
        pipe = self._r.pipeline(transaction=False)
        for i in ids:
            key = self.key(i)
            pipe.exists(key)
            pipe.strlen(key)
            pipe.getrange(key, 0, _HEAD_READ - 1)
        res = pipe.execute()
        out: dict[str, bytes] = {}
        now = time.time()
        for n, ident in enumerate(ids):
            exists, size, head = res[3 * n:3 * n + 3]
            if not exists:
                continue
            try:
                need = header_length(head)
                if len(head) < need <= size:
                    head = self._r.getrange(self.key(ident), 0, need - 1)
                head = head[:need]
            except CorruptEntry:
                pass
            out[ident] = _META.pack(size, now) + head
        if out:
            with contextlib.suppress(*ERRORS):  # best effort (e.g. a read-only replica)
                raw = [_enc(k) for k in out]
                vals = list(out.values())
                for (meta_key, _), pos in self._grouped(raw).items():
                    self._r.hset(meta_key, mapping={raw[n]: vals[n] for n in pos})
        return out

    @_wrapped
    def prune(self, pairs: list[tuple[bytes, bytes]] | None = None) -> int:
        """Drop ``meta``/``atime`` records of entries Redis evicted or expired; returns count.

        ``pairs``: which ``(meta, atime)`` keys to walk (default: all of them)."""
        removed = 0
        for meta_key, atime_key in (self._side_pairs() if pairs is None else pairs):
            for kind in ("meta", "atime"):
                cursor = 0
                while True:
                    if kind == "meta":
                        cursor, page = self._r.hscan(meta_key, cursor, count=_BATCH)
                        fields = list(page)
                    else:
                        cursor, page = self._r.zscan(atime_key, cursor, count=_BATCH)
                        fields = [m for m, _ in page]
                    if fields:
                        keys = [meta_key, atime_key] + [self._entry_key(f) for f in fields]
                        removed += int(self._prune_script(keys=keys, args=fields))
                    if cursor == 0:
                        break
        return removed

    @_wrapped
    def count(self, *, unreachable: list | None = None) -> int:
        """Number of entries (a SCAN over the key space; no entry is read)."""
        return sum(len(p) for p in self._scan_pages(unreachable=unreachable))
