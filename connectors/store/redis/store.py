"""RedisStore: the shared backend — the same entry bytes as DiskStore, kept in Redis.

(Longer than most modules on purpose: one backend whose key-layout hooks — ``key``,
``_side``, ``_transact``, ``_scan_pages``, ``_page_records``, ``_drifted`` — are what
:class:`.redis_cluster.RedisClusterStore` overrides; the entry logic stays written once.)

URLs (see :func:`.url.open_store`)::

    redis://[[user]:password@]host:port/db[?prefix=NAME:&ttl=SECONDS]
    rediss://...                                  (TLS)
    unix:///path/to/redis.sock?db=0[&password=...][&prefix=...]

Key layout (``P`` = ``prefix``, default ``encache:``; several models/tenants share one
Redis by using different prefixes — no prefix may be a prefix of another's ``e:`` keys)::

    P e:{identifier}   STRING  the entry: the exact bytes DiskStore keeps in a file
    P meta             HASH    identifier -> <u64 size><f64 put time> + the entry's header
    P atime            ZSET    identifier -> last load (epoch s; put time until first load)
    P counters         HASH    consumer counters (HINCRBYFLOAT) + "updated"
    P gen              STRING  a counter bumped by every put/delete (``index_version``)
    P journal          STREAM  the change journal: one record per put/delete, its ID the
                               ``gen`` value it set, field ``i`` = the identifiers (NUL-joined)
    P lock:{name}      STRING  "{token} pid N on HOST" with a PX expiry, renewed while held
    P note:{name}      STRING  a note (``put_note``, e.g. a Ray job's marker), with an expiry
    P removed:{reason} ZSET    identifier -> when a policy removed it (:mod:`.removals`)

Why a side hash for headers: ``scan()`` (``encache list/stats/verify`` on 100k entries)
must neither transfer tensors nor *touch* the entry keys — every read of a key (even
``GETRANGE``/``STRLEN``) refreshes its LRU clock, so a listing would reshuffle what
``allkeys-lru`` evicts next. ``scan()`` therefore walks the key space with ``SCAN MATCH
P e:*`` (existence is authoritative: expired/evicted entries simply are not there) and
fetches the headers of each SCAN page with one ``HMGET P meta`` plus access times with
pipelined ``ZSCORE``s — one round trip per ~1000 entries, a few hundred bytes each.
``put`` writes blob, header and access time in one ``MULTI``; ``delete`` removes all three
in one ``MULTI``. The side structures can only drift when Redis itself drops a key
(eviction, TTL) or if the ``meta`` hash is evicted: a missing header is re-read from the
blob (``GETRANGE``) and written back, and fields whose entry is gone are pruned after a
full scan (``prune()``: an atomic Lua check-and-delete per batch).

The change journal (``changes_since``) lets a reader that holds copies of entries (a
node's local tier, a consumer's staging) learn which identifiers changed since it last
looked in O(changes): one ``GET gen`` and an ``XRANGE`` from its cursor, never a rescan.
Each write's ``gen`` bump and its journal record are one Lua call inside the write's
``MULTI`` (on one server the three are atomic). The stream is capped at ``JOURNAL_MAX``
records (``MAXLEN ~``); a reader that fell further behind, or a ``gen`` that went back (the
server lost its data), gets "cannot tell" and re-checks what it holds.

Failures: every Redis error becomes a :class:`.base.StoreError` with a one-line message
(connection refused, authentication failed, timed out, out of memory) naming the URL with
its password redacted. Dropped or refused connections are retried ``retries`` times with
a short exponential backoff (0.02 + 0.04 s: errors.ConnectionBackoff); timeouts and auth failures are not retried.
``socket_timeout`` (per socket read, so large entries on slow links are fine) and
``connect_timeout`` bound each call: a dead server is reported in ~0.1 s, a hung one in
``socket_timeout`` (2 s by default), never a hang.

Why one module of ~670 lines: the key layout, the ``MULTI`` writes and the scan that
repairs drift keep one invariant (blob, header record and access time move together) and
read best side by side. The parts that stand alone live next door: the job lock
(:mod:`.redis_lock`), error text and retries (:mod:`.redis_errors`), the server's memory
settings (:mod:`.redis_memory`), the cluster layout (:mod:`.redis_cluster`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import struct
import time
from collections.abc import Iterable, Iterator
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis as _redis
from redis.exceptions import RedisClusterException, RedisError

from ..base import EntryInfo, Store, StoreError, StoreInfo, info_from_blob_header
from ..entry import NEWER_FORMAT, CorruptEntry, byte_views, header_length
from ..keys import validate
from ..loaded import Loaded
from .errors import ERRORS, ConnectionBackoff, ConnectionRetry, describe_error
from .lock import RedisLock
from .receive import Unreadable, receive_verified
from ..removals import LIMIT as REMOVALS_LIMIT, REASONS
from ..removals import note_failure as note_removal_failure
from .memory import memory_info, memory_warnings
from ..url import REDIS_SCHEMES, redact

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "encache:"
ACCESS_RESOLUTION_S = 60.0  # a load refreshes the recorded access at most once a minute
_HEAD_READ = 4096
_META = struct.Struct("<Qd")  # size, put time
_JOIN_LIMIT = 1 << 20  # parts smaller than this are joined; larger go as SET + APPEND
_BATCH = 500
JOURNAL_MAX = 50_000  # journal records kept (each names the identifiers of one write)
_JOURNAL_SEP = "\x00"  # identifiers never hold a NUL (keys.validate)

# bump gen and journal the write under that number: KEYS = gen, journal; ARGV = maxlen, ids.
# A gen below the journal's last record (gen evicted, reset or damaged: not a count)
# continues after it, so record IDs only grow; a reader sees the jump as a gap and
# re-checks everything.
_JOURNAL_LUA = """
local raw = redis.call('GET', KEYS[1])
local g = 1
if raw and string.match(raw, '^%d+$') then
  g = tonumber(raw) + 1
end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
if #last > 0 then
  local lg = tonumber(string.match(last[1][1], '^(%d+)'))
  if g <= lg then
    g = lg + 1
  end
end
redis.call('SET', KEYS[1], g)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], g .. '-0', 'i', ARGV[2])
return g
"""

# atomic "remove side records whose entry is gone": KEYS = meta, atime, e:id1..; ARGV = ids
_PRUNE_LUA = """
local n = 0
for i = 1, #ARGV do
  if redis.call('EXISTS', KEYS[i + 2]) == 0 then
    n = n + redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('ZREM', KEYS[2], ARGV[i])
  end
end
return n
"""

def _enc(identifier: str) -> bytes:
    return identifier.encode("utf-8", "surrogatepass")


def _dec(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")


def _glob_escape(raw: bytes) -> bytes:
    out = bytearray()
    for b in raw:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)




def _wrapped(method):
    """Turn redis-py errors raised by a method into one-line StoreErrors."""
    @functools.wraps(method)
    def inner(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except ERRORS as e:
            raise self._store_error(e) from None
    return inner


class RedisStore(Store):
    """Entries in Redis under a key prefix (see the module docstring for the layout)."""

    backend = "redis"
    local = False
    supports_batch = True
    supports_index_version = True
    supports_capacity_warnings = True
    supports_change_journal = True
    supports_verified_reads = True
    supports_removal_records = True

    def __init__(self, url: str, *, prefix: str | None = None, socket_timeout: float = 2.0,
                 connect_timeout: float = 2.0, retries: int = 2,
                 max_connections: int | None = 64, ttl: float | None = None,
                 lock_ttl: float = 30.0, access_resolution: float = ACCESS_RESOLUTION_S):
        parts = urlsplit(url)
        if parts.scheme not in self.SCHEMES:
            raise StoreError(f"not a {self.__class__.__name__} URL: {redact(url)}")
        db = parts.path.strip("/") if parts.scheme in ("redis", "rediss") else ""
        if db and not db.isdigit():  # (redis-py would silently use database 0)
            raise StoreError(f"bad Redis URL {redact(url)}: database {db!r} is not a number")
        query = parse_qsl(parts.query, keep_blank_values=True)
        own = {k: v for k, v in query if k in self.URL_OPTIONS}
        rest = [(k, v) for k, v in query if k not in self.URL_OPTIONS]
        base = url.split("?", 1)[0]  # (urlunsplit would turn unix:///path into unix:/path)
        clean = base + ("?" + urlencode(rest) if rest else "")
        if prefix is None:
            prefix = own.get("prefix", DEFAULT_PREFIX)
        if ttl is None and own.get("ttl"):
            try:
                ttl = float(own["ttl"])
            except ValueError:
                raise StoreError(f"bad ttl={own['ttl']!r} in {redact(url)}") from None
        self._url_raw = url
        self._redacted = redact(url)
        self._options = dict(prefix=prefix, socket_timeout=socket_timeout,
                             connect_timeout=connect_timeout, retries=retries,
                             max_connections=max_connections, ttl=ttl, lock_ttl=lock_ttl,
                             access_resolution=access_resolution)
        self._check_prefix(prefix)
        self.prefix = prefix
        self.ttl = float(ttl) if ttl and float(ttl) > 0 else None
        self.socket_timeout = socket_timeout
        self.lock_ttl = float(lock_ttl)
        self.access_resolution = float(access_resolution)
        p = prefix.encode("utf-8")
        self._entry_prefix = p + b"e:"
        self._match = _glob_escape(self._entry_prefix) + b"*"
        self._meta_key = p + b"meta"
        self._atime_key = p + b"atime"
        self._counters_key = p + b"counters"
        self._gen_key, self._journal_key = self._journal_keys(p)
        self._lock_prefix = p + b"lock:"
        self._note_prefix = p + b"note:"
        self._removed_keys = {r: p + b"removed:" + r.encode() for r in REASONS}
        retry = ConnectionRetry(ConnectionBackoff(), max(0, int(retries)))
        kwargs = dict(socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                      retry=retry, client_name="encache",
                      max_connections=max(1, int(max_connections or 64)),
                      timeout=socket_timeout)  # wait for a free pooled connection
        try:
            self._r, self._password = self._connect(clean, kwargs)
        except (ValueError, TypeError, RedisClusterException) as e:
            raise StoreError(f"bad Redis URL {self._redacted}: {self._scrub(str(e))}") from None
        self._prune_script = self._r.register_script(_PRUNE_LUA)
        self._journal_script = self._r.register_script(_JOURNAL_LUA)
        self._locks = RedisLock(self._r, describe_error=self._store_error, url=self.url,
                                prefix=prefix)
        self._touched: dict[str, float] = {}

    SCHEMES = REDIS_SCHEMES
    #: query parameters encache reads itself (the others go to redis-py)
    URL_OPTIONS = ("prefix", "ttl")

    def _check_prefix(self, prefix: str) -> None:
        return None

    def _connect(self, clean_url: str, kwargs: dict):
        """``(client, password)`` for the URL without encache's own query options."""
        self._pool = _redis.BlockingConnectionPool.from_url(clean_url, **kwargs)
        return _redis.Redis(connection_pool=self._pool), self._pool.connection_kwargs.get("password")

    # -- identity ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The URL with any password redacted (safe to print)."""
        return self._redacted

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self._redacted!r}, prefix={self.prefix!r})"

    __str__ = __repr__

    def reopen(self) -> RedisStore:
        """A second, independent handle (own connection pool) on the same data."""
        return self.__class__(self._url_raw, **self._options)

    # -- key layout (RedisClusterStore overrides these four) --------------------------------
    def key(self, identifier: str) -> bytes:
        """The Redis key of an entry's blob."""
        return self._entry_key(_enc(validate(identifier)))

    def _entry_key(self, ident: bytes) -> bytes:
        return self._entry_prefix + ident

    def _ident(self, key: bytes) -> str:
        return _dec(key[len(self._entry_prefix):])

    def _side(self, ident: bytes) -> tuple[bytes, bytes]:
        """``(meta hash, atime zset)``: the keys holding an entry's side records."""
        return self._meta_key, self._atime_key

    def _side_pairs(self, found: set | None = None) -> list[tuple[bytes, bytes]]:
        """Every ``(meta, atime)`` pair to check for drift (``found``: pairs a scan saw)."""
        return [(self._meta_key, self._atime_key)]

    def _grouped(self, idents: list[bytes]) -> dict[tuple[bytes, bytes], list[int]]:
        """Positions of ``idents`` grouped by their side keys (one group on one node)."""
        groups: dict[tuple[bytes, bytes], list[int]] = {}
        for n, ident in enumerate(idents):
            groups.setdefault(self._side(ident), []).append(n)
        return groups

    def _journal_keys(self, p: bytes) -> tuple[bytes, bytes]:
        """``(gen, journal)``: one slot (a cluster tags them)."""
        return p + b"gen", p + b"journal"

    def _journal(self, client, changed: list[bytes]):
        """Bump ``gen`` and journal ``changed`` (identifiers) under it, on ``client`` (a
        MULTI pipeline: queued there)."""
        return self._journal_script(keys=[self._gen_key, self._journal_key],
                                    args=[JOURNAL_MAX, _JOURNAL_SEP.encode().join(changed)],
                                    client=client)

    def _transact(self, build, changed: list[bytes]) -> list:
        """Run ``build(pipe)`` in one MULTI with the ``gen`` bump and the journal record
        of ``changed``; the replies of ``build``'s commands."""
        pipe = self._r.pipeline(transaction=True)
        build(pipe)
        self._journal(pipe, changed)
        return pipe.execute()[:-1]

    # -- errors ----------------------------------------------------------------------------
    def _scrub(self, text: str) -> str:
        pw = getattr(self, "_password", None)
        if pw:
            text = text.replace(pw, "***")
        return text

    def _store_error(self, e: BaseException, domain: str | None = None) -> StoreError:
        """One line for ``e``; ``domain``: the node it concerns (a cluster's primary),
        named at the end (the URL lists every startup node)."""
        error = describe_error(e, url=self._redacted, password=self._password,
                               socket_timeout=self.socket_timeout)
        if domain is None:
            return error
        return StoreError(f"{error} [primary {domain}]", domain=domain, reason=error.reason)

    @contextlib.contextmanager
    def _errors(self):
        try:
            yield
        except ERRORS as e:
            raise self._store_error(e) from None

    @_wrapped
    def ping(self) -> float:
        """Round-trip time in seconds (raises StoreError if unreachable)."""
        t = time.perf_counter()
        self._r.ping()
        return time.perf_counter() - t

    # -- entries ---------------------------------------------------------------------------
    def _should_touch(self, ident: str, now: float) -> bool:
        last = self._touched.get(ident)
        if last is not None and now - last < self.access_resolution:
            return False
        if len(self._touched) > 200_000:
            self._touched.clear()
        self._touched[ident] = now
        return True

    @_wrapped
    def get(self, identifier: str) -> bytes | None:
        key = self.key(identifier)
        now = time.time()
        if not self._should_touch(identifier, now):
            return self._r.get(key)
        ident = _enc(identifier)
        pipe = self._r.pipeline(transaction=False)
        pipe.get(key)
        pipe.zadd(self._side(ident)[1], {ident: now}, xx=True)  # only live entries
        value, _ = pipe.execute(raise_on_error=False)  # a failed ZADD (replica) is no miss
        if isinstance(value, Exception):
            raise value
        if value is None:
            self._touched.pop(identifier, None)
        return value

    def _connection_pool(self, key: bytes):
        """The connection pool of the server holding ``key``."""
        return self._pool

    @_wrapped
    def read_verified(self, identifier: str, checksum=lambda version: True, into=None):
        """The entry received from the socket into a buffer of its own (``into``'s, when
        given) and validated as it arrives (:mod:`.redis_receive`: one pass, where ``get``
        and a validation take two passes after the parser's copy). Versions are not
        tracked (None)."""
        key = self.key(identifier)
        hashing = checksum(None)
        now = time.time()
        ident = _enc(identifier)  # the access time (the LRU clock), when due, in the same
        touch = (self._side(ident)[1], ident, now) \
            if self._should_touch(identifier, now) else None  # round trip (XX: live only)
        try:
            got = receive_verified(self._connection_pool(key), key, identifier, hashing, touch,
                                   into)
        except Unreadable:
            return Store.read_verified(self, identifier, checksum)  # through redis-py
        if got is None:
            self._touched.pop(identifier, None)
            return None
        buf, meta, offset = got
        return Loaded((buf, None, meta, offset, hashing))

    @_wrapped
    def get_many(self, identifiers: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        now = time.time()
        for start in range(0, len(identifiers), 256):
            chunk = identifiers[start:start + 256]
            keys = [self.key(i) for i in chunk]
            touch = {_enc(i): now for i in chunk if self._should_touch(i, now)}
            pipe = self._r.pipeline(transaction=False)
            pipe.mget(keys)
            if touch:
                pipe.zadd(self._atime_key, touch, xx=True)
            values = pipe.execute(raise_on_error=False)[0]
            if isinstance(values, Exception):
                raise values
            out.extend(values)
        return out

    @_wrapped
    def put(self, identifier: str, parts: bytes | Iterable, *, encoded_here: bool = False) -> int:
        key = self.key(identifier)
        views = byte_views(parts)
        total = sum(v.nbytes for v in views)
        head = _leading(views, _HEAD_READ)
        try:
            need = header_length(head)
            if len(head) < need <= total:
                head = _leading(views, need)
            head = head[:need]
        except CorruptEntry:
            pass  # not an entry: keep the leading bytes; scan reports why
        now = time.time()
        px = int(self.ttl * 1000) if self.ttl else None
        value = None
        if len(views) == 1 or total <= _JOIN_LIMIT:
            value = views[0] if len(views) == 1 else b"".join(views)
        ident = _enc(identifier)
        meta_key, atime_key = self._side(ident)

        def build(pipe):
            if value is not None:
                pipe.set(key, value, px=px)
            else:  # large multi-part entry: no joined copy; atomic inside MULTI
                pipe.set(key, views[0], px=px)
                for v in views[1:]:
                    if v.nbytes:
                        pipe.append(key, v)
            pipe.hset(meta_key, ident, _META.pack(total, now) + head)
            pipe.zadd(atime_key, {ident: now})

        self._transact(build, [ident])
        self._touched[identifier] = now
        return total

    @_wrapped
    def delete(self, identifier: str) -> bool:
        key, ident = self.key(identifier), _enc(identifier)
        meta_key, atime_key = self._side(ident)

        def build(pipe):
            pipe.unlink(key)
            pipe.hdel(meta_key, ident)
            pipe.zrem(atime_key, ident)

        existed = self._transact(build, [ident])[0]
        self._touched.pop(identifier, None)
        return bool(existed)

    @_wrapped
    def delete_many(self, identifiers: Iterable[str], *, per_item: bool = False):
        """Delete many entries: UNLINK in pipelined MULTI batches of 500.

        Returns how many existed, or with ``per_item=True`` a list of booleans (one per
        identifier, in order: did it exist).
        """
        removed, existed = 0, []
        batch: list[str] = []

        def flush():
            nonlocal removed
            keys = [self.key(i) for i in batch]
            idents = [_enc(i) for i in batch]
            flags = [False] * len(batch)
            for (meta_key, atime_key), pos in self._grouped(idents).items():
                def build(pipe, pos=pos, meta_key=meta_key, atime_key=atime_key):
                    if per_item:
                        for n in pos:
                            pipe.unlink(keys[n])
                    else:
                        pipe.unlink(*[keys[n] for n in pos])
                    pipe.hdel(meta_key, *[idents[n] for n in pos])
                    pipe.zrem(atime_key, *[idents[n] for n in pos])
                res = self._transact(build, [idents[n] for n in pos])
                if per_item:
                    for n, x in zip(pos, res):
                        flags[n] = bool(x)
                else:
                    removed += res[0]
            if per_item:
                existed.extend(flags)
            for i in batch:
                self._touched.pop(i, None)
            batch.clear()

        for identifier in identifiers:
            batch.append(identifier)
            if len(batch) >= _BATCH:
                flush()
        if batch:
            flush()
        return existed if per_item else removed

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

    def _scan_pages(self, found: set | None = None,
                    unreachable: list | None = None) -> Iterator[list[bytes]]:
        """Entry keys, a SCAN page at a time, each once (``found``, ``unreachable``: for
        cluster layouts; one server fails as a whole)."""
        cursor, seen = 0, set()
        while True:
            with self._errors():
                cursor, keys = self._r.scan(cursor, match=self._match, count=1000)
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

    def identifiers(self, *, unreachable: list | None = None) -> Iterator[str]:
        for page in self._scan_pages(unreachable=unreachable):
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

    # -- bookkeeping -----------------------------------------------------------------------
    @_wrapped
    def add_counters(self, deltas: dict[str, float]) -> None:
        deltas = {k: v for k, v in deltas.items() if v}
        if not deltas:
            return
        pipe = self._r.pipeline(transaction=True)
        for k, v in deltas.items():
            pipe.hincrbyfloat(self._counters_key, k, float(v))
        pipe.hset(self._counters_key, "updated", repr(time.time()))
        pipe.execute()

    @_wrapped
    def read_counters(self) -> dict[str, float]:
        out = {}
        for k, v in self._r.hgetall(self._counters_key).items():
            try:
                x = float(v)
            except ValueError:
                continue
            if not math.isfinite(x):
                continue
            out[k.decode("utf-8", "replace")] = int(x) if x.is_integer() and k != b"updated" else x
        return out

    @_wrapped
    def put_note(self, name: str, text: str, ttl: float = 600.0) -> str:
        self._r.set(self._note_prefix + name.encode("utf-8"), text.encode("utf-8"),
                    px=max(1000, int(ttl * 1000)))
        return f"the key {self.prefix}note:{name}"

    @_wrapped
    def get_note(self, name: str) -> str | None:
        value = self._r.get(self._note_prefix + name.encode("utf-8"))
        return None if value is None else value.decode("utf-8", "replace")

    @_wrapped
    def delete_note(self, name: str) -> None:
        self._r.delete(self._note_prefix + name.encode("utf-8"))

    # -- removal records (one sorted set per reason, scored by time) -----------------------
    def record_removals(self, identifiers, reason: str) -> None:
        idents = [_enc(i) for i in identifiers if i]
        if not idents:
            return
        try:
            self._record_removals(idents, reason)
        except (*ERRORS, StoreError) as e:
            note_removal_failure(self.url, e)

    def _record_removals(self, idents: list[bytes], reason: str) -> None:
        key = self._removed_keys[reason]
        now = time.time()
        pipe = self._r.pipeline(transaction=False)
        for n in range(0, len(idents), 1000):
            chunk = idents[n:n + 1000]
            pipe.zadd(key, dict.fromkeys(chunk, now))
            for other in self._removed_keys.values():
                if other != key:
                    pipe.zrem(other, *chunk)
        pipe.zremrangebyrank(key, 0, -(REMOVALS_LIMIT + 1))  # the oldest past the limit
        pipe.execute()

    @_wrapped
    def removals(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for reason, key in self._removed_keys.items():
            for ident in self._r.zrange(key, 0, -1):
                out[_dec(ident)] = reason
        return out

    def forget_removals(self, identifiers) -> None:
        idents = [_enc(i) for i in identifiers]
        if not idents:
            return
        try:
            pipe = self._r.pipeline(transaction=False)
            for n in range(0, len(idents), 1000):
                for key in self._removed_keys.values():
                    pipe.zrem(key, *idents[n:n + 1000])
            pipe.execute()
        except (*ERRORS, StoreError) as e:
            note_removal_failure(self.url, e)

    @_wrapped
    def removal_counts(self) -> dict[str, int]:
        return {reason: int(self._r.zcard(key)) for reason, key in self._removed_keys.items()}

    @_wrapped
    def reset_counters(self) -> None:
        self._r.delete(self._counters_key)

    @_wrapped
    def count(self, *, unreachable: list | None = None) -> int:
        """Number of entries (a SCAN over the key space; no entry is read)."""
        return sum(len(p) for p in self._scan_pages(unreachable=unreachable))

    def _memory_info(self, **node) -> dict:
        return memory_info(self._r, ERRORS, **node)

    @_wrapped
    def capacity_warnings(self, memory: dict | None = None) -> list[str]:
        """Human-readable problems with the server's memory settings for a cache."""
        return self._memory_warnings(self._memory_info() if memory is None else memory)

    def _memory_warnings(self, mem: dict) -> list[str]:
        return memory_warnings(mem, self.ttl)

    @_wrapped
    def info(self) -> StoreInfo:
        mem = self._memory_info()
        if not mem:  # INFO failed as well: surface the real reason (unreachable, auth…)
            self._r.ping()
        server: dict = {}
        with contextlib.suppress(RedisError):
            server = dict(self._r.info("server"))
        maxmemory = mem.get("maxmemory")
        extra = {
            "prefix": self.prefix,
            "redis_version": server.get("redis_version"),
            # (Valkey also answers redis_version: the Redis release it is compatible with)
            **({"valkey_version": server["valkey_version"]}
               if server.get("valkey_version") else {}),
            "used_memory": mem.get("used_memory"),
            "maxmemory": maxmemory,
            "maxmemory_policy": mem.get("maxmemory_policy"),
            "entries": self.count(),
            "dbsize": self._r.dbsize(),
            "ttl": self.ttl,
            "warnings": self.capacity_warnings(mem),
        }
        return StoreInfo(url=self.url, backend=self.backend,
                         max_bytes=int(maxmemory) if maxmemory else None, extra=extra)

    def lock(self, name: str, wait: float = 0.0):
        """Exclusive lock (see :mod:`.redis_lock`): taken with ``SET NX PX``, renewed while
        held (a crashed holder frees it after ``lock_ttl`` s), released by compare-and-
        delete. Yields a handle whose ``lost`` tells if renewal failed."""
        return self._locks.hold(self._lock_prefix + name.encode("utf-8"), name,
                                ttl=self.lock_ttl, wait=wait)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._pool.disconnect()


def _leading(views: list[memoryview], n: int) -> bytes:
    """The first ``n`` bytes across a list of buffers."""
    out = bytearray()
    for v in views:
        if len(out) >= n:
            break
        out += v[:n - len(out)]
    return bytes(out)
