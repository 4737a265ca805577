"""RedisStore: the shared backend — the same entry bytes as DiskStore, kept in Redis.

Here: reads and writes; beside it, by concept, the catalogue (listing, headers, change
journal: :mod:`.catalogue`), the bookkeeping (counters, notes, removal records, memory
facts, locks: :mod:`.bookkeeping`) and the key layout's names and scripts (:mod:`.layout`).
The key-layout hooks (``key``, ``_side``, ``_transact``, ``_scan_pages``,
``_page_records``, ``_drifted``) are what :class:`.cluster.RedisClusterStore` overrides;
the entry logic stays written once.

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
settings (:mod:`.memory`), the cluster layout (:mod:`.cluster`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from urllib.parse import parse_qsl, urlencode, urlsplit

import redis as _redis
from redis.exceptions import RedisClusterException

from ..base import Store, StoreError
from ..entry import CorruptEntry, byte_views, header_length
from ..keys import validate
from ..loaded import Loaded
from .errors import ERRORS, ConnectionBackoff, ConnectionRetry, describe_error
from .lock import RedisLock
from .receive import Unreadable, receive_verified
from ..removals import REASONS
from .bookkeeping import RedisBookkeeping
from .catalogue import RedisCatalogue
from .layout import (DEFAULT_PREFIX, ACCESS_RESOLUTION_S, _HEAD_READ, _META, _JOIN_LIMIT,
                     _BATCH, JOURNAL_MAX, _JOURNAL_SEP, _JOURNAL_LUA, _PRUNE_LUA, _enc, _dec,
                     _glob_escape, _wrapped)
from ..url import REDIS_SCHEMES, redact

log = logging.getLogger(__name__)

class RedisStore(RedisCatalogue, RedisBookkeeping, Store):
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
        given) and validated as it arrives (:mod:`.receive`: one pass, where ``get``
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
