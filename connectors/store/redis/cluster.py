"""RedisClusterStore: the Redis store on a Redis Cluster (or Valkey cluster).

URLs (see :func:`.url.open_store`)::

    redis+cluster://[[user]:password@]host:port[,host:port…][?prefix=NAME:&ttl=SECONDS
                                                              &redirect_wait=SECONDS]
    rediss+cluster://…                                       (TLS; ssl_ca_certs=… etc.)

The hosts are startup nodes: any one reachable node is enough, the client learns the
rest (and every later change) from ``CLUSTER SLOTS``.

Why a different key layout: one Redis primary caps the cache at one machine's RAM. Under
Cluster every key lives in one of 16384 hash slots and a MULTI, a multi-key command or a
Lua script may only touch keys of *one* slot, so :class:`.redis.RedisStore`'s single
``meta`` hash / ``atime`` set (written in the same MULTI as every entry) would be
cross-slot. Here the side records are split into one bucket per slot, and every key of a
bucket carries the same hash tag::

    P{T}:e:{identifier}   STRING  the entry (same bytes as DiskStore's file)
    P{T}:m                HASH    identifier -> <u64 size><f64 put time> + header
    P{T}:a                ZSET    identifier -> last load
    P counters / P gen / P lock:{name}     (as for one node; each a single key)

``T`` is the bucket's tag: the bucket is the slot the identifier itself hashes to
(CRC16 mod 16384), and ``T`` is the shortest decimal string that hashes to that same slot
(:mod:`.redis_cluster_routing`: tags, slots, the URL, the lazily built client).
So the buckets are *slot-aligned* — exactly one bucket per slot — entries spread over all
primaries as evenly as slots do, and ``redis-cli --cluster reshard`` moves whole buckets:
an entry, its header and its access time always move together and live on one node.

Consequences:

* ``put``/``delete`` stay one MULTI on one node (blob + header + access time: never a
  half-written entry). The ``gen`` counter (``index_version``) is a separate key bumped
  right after the MULTI: a reader that sees the new value also sees the entry.
* ``scan``/``identifiers``/``count`` walk every primary with ``SCAN`` (deduplicated:
  during a reshard a key can be seen on two nodes), and fetch headers with one ``HMGET``
  per bucket of a page, pipelined per node.
* MOVED/ASK are followed by redis-py; a MULTI that meets a slot half-way through a
  migration (ASK / TRYAGAIN: its keys are on two nodes for a moment) is retried with a
  short backoff until the slot has moved (``redirect_wait`` seconds at most).
* A dead primary: a consumer's loads of its slots fail fast (connection refused →
  StoreError → a miss, and the consumer's circuit breaker of that primary backs off: the
  errors name it, ``supports_failure_domains``, and the other primaries' entries still
  load) until the cluster promotes its replica. A client learns the new slot map only from a failed call, so a
  load (``get``/``read_entry``/``get_many``) that fails on a stale route (connection
  refused or reset, CLUSTERDOWN, an uncovered slot, MOVED/ASK left over) re-reads the slot
  map once and retries once, at once: the first load after the promotion is a hit, not a
  miss. Those re-reads happen at most once per ``REROUTE_EVERY_S`` (0.5 s) per store, and
  the retry is made only if the map now routes the key elsewhere than the failed call did
  (whoever re-read it: this load, another thread's, or redis-py itself): while the primary
  is dead and not yet promoted the map still names it, and a load fails fast (milliseconds,
  never a wait). ``read_verified`` (the one-pass receive on the routed node's socket) that
  fails on a stale route is made again as that ``get``, whose redis-py call re-reads the
  map and retries on its own as well. A timeout is not retried (it already cost
  ``socket_timeout``). A listing (a consumer's index refresh) whose walk meets the dead
  node the stale map still names a primary likewise re-reads the map once and walks the
  new primaries. Writes and header reads
  (``put``/``delete``/``stat``/``contains``: producers, ``precompute``, ``warm``) retry
  for up to ``redirect_wait`` s — a failover quicker than that costs nothing — and are
  reported as failed after it (a second ``precompute`` run writes what is missing).
* ``info()``/``capacity_warnings()`` report and check every primary: memory, maxmemory and
  policy per node (each primary evicts on its own; one full node fails writes to its
  slots even when the others have room).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from urllib.parse import parse_qsl, unquote

from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.crc import key_slot as hashed_slot  # (Redis's own: a key's hash tag decides)

from ..base import Store, StoreError, StoreInfo
from .cluster_routing import _RETRY_WRITES, _STALE_ROUTE
from .cluster_scan import _PAGE_LUA, ClusterScan
from .layout import _dec, _enc, _glob_escape, _wrapped
from .store import RedisStore
from .cluster_routing import LazyCluster, key_slot, parse_cluster_url, primary_of, slot_tags
from .errors import ERRORS
from ..url import CLUSTER_SCHEMES, redact

log = logging.getLogger(__name__)
REROUTE_EVERY_S = 0.5  # a store re-reads the slot map for its loads at most this often
#: how long writes and header reads wait out a failover by default (``redirect_wait``)
REDIRECT_WAIT_S = 10.0
class RedisClusterStore(ClusterScan, RedisStore):
    """Entries on a Redis Cluster in slot-aligned buckets (see the module docstring)."""

    backend = "redis-cluster"
    supports_failure_domains = True
    SCHEMES = CLUSTER_SCHEMES
    URL_OPTIONS = RedisStore.URL_OPTIONS + ("redirect_wait",)
    #: the journal record is written after the entry's MULTI (another slot), not with it
    journal_complete = False

    def __init__(self, url: str, *, redirect_wait: float | None = None, **options):
        if redirect_wait is None:
            query = dict(parse_qsl(url.partition("?")[2]))
            try:
                redirect_wait = float(query.get("redirect_wait", REDIRECT_WAIT_S))
            except ValueError:
                raise StoreError(f"bad redirect_wait={query['redirect_wait']!r} in "
                                 f"{redact(url)}") from None
        self.redirect_wait = float(redirect_wait)
        self._no_wait_until = 0.0
        self._reroute_lock = threading.Lock()
        self._rereading = threading.Lock()  # held while the map is re-read
        self._next_reroute = 0.0  # monotonic time before which loads do not re-read the map
        self.route_refreshes = 0  # slot-map re-reads done for loads (each one bumps it)
        self._journal_warned_until = 0.0
        super().__init__(url, **options)
        self._options["redirect_wait"] = self.redirect_wait
        p = self.prefix.encode("utf-8")
        self._bucket_match = _glob_escape(p) + b"{*"
        self._tags = slot_tags()
        self._page_sha = hashlib.sha1(_PAGE_LUA.encode()).hexdigest()
        # the page script reads only: EVALSHA_RO (Redis 7+) runs it under a consumer's
        # read-only ACL (docs/security.md); EVALSHA on a server without it
        self._page_cmd = "EVALSHA_RO"

    def _check_prefix(self, prefix: str) -> None:
        if "{" in prefix or "}" in prefix:
            raise StoreError(f"a cluster store prefix may not contain braces: {prefix!r} "
                             "(encache adds its own hash tags)")

    def _connect(self, clean_url: str, kwargs: dict):
        nodes, single, query = parse_cluster_url(clean_url)
        opts = parse_url(single + ("?" + query if query else ""))
        for k in ("host", "port", "db"):
            opts.pop(k, None)
        if opts.pop("connection_class", None) is not None and single.startswith("rediss:"):
            opts["ssl"] = True  # (RedisCluster takes ssl=True, not an SSLConnection class)
        retry = kwargs.pop("retry")
        kwargs.pop("timeout", None)  # (a BlockingConnectionPool option)
        password = opts.get("password")
        self._pool = None
        return LazyCluster(lambda: RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in nodes], retry=retry, **kwargs,
            **opts)), (unquote(password) if password else password)

    # -- key layout ---------------------------------------------------------------------------
    def _tag(self, ident: bytes) -> bytes:
        return self._tags[key_slot(ident)]

    def _entry_key(self, ident: bytes) -> bytes:
        return self._bucket(self._tag(ident)) + b":e:" + ident

    def _bucket(self, tag: bytes) -> bytes:
        return self.prefix.encode("utf-8") + b"{" + tag + b"}"

    def _ident(self, key: bytes) -> str:
        return _dec(key[key.index(b"}:e:", len(self.prefix.encode("utf-8"))) + 4:])

    def _side(self, ident: bytes) -> tuple[bytes, bytes]:
        b = self._bucket(self._tag(ident))
        return b + b":m", b + b":a"

    def _side_pairs(self, found: set | None = None) -> list[tuple[bytes, bytes]]:
        if found is None:  # walk the key space for them
            found = set()
            for _ in self._scan_pages(found):
                pass
        return sorted(found)

    # -- cluster plumbing -----------------------------------------------------------------------
    def _waiting(self, op):
        """``op()``, retried with backoff for up to ``redirect_wait`` s while its slot is
        being migrated (ASK, TRYAGAIN), the cluster reconfigures (CLUSTERDOWN) or its
        primary is down and a replica is being promoted (connection refused). Used by
        writes and by the header reads of producers and management commands; a
        consumer's loads (``get``/``read_entry``) never wait. After one wait ran out, calls
        fail fast for ``redirect_wait`` s (a primary with no replica stays down)."""
        if time.monotonic() < self._no_wait_until:
            return op()
        deadline = time.monotonic() + self.redirect_wait
        delay = 0.02
        while True:
            try:
                return op()
            except _RETRY_WRITES:
                if time.monotonic() >= deadline:
                    self._no_wait_until = time.monotonic() + self.redirect_wait
                    raise
                time.sleep(delay)
                delay = min(0.25, delay * 2)
                with contextlib.suppress(*ERRORS):
                    self._r.nodes_manager.initialize()  # learn where the slot is now

    def _routes(self) -> dict:
        """The client's slot map (slot -> [primary, replicas…]) as it is now (a re-read
        replaces the dict; redis-py may also change an entry in place on a failure)."""
        return self._r.nodes_manager.slots_cache

    def _load(self, op, slots):
        """``op()`` for a consumer's load of keys in ``slots``: on a stale route, one
        slot-map re-read and one immediate retry; never a sleep (see the module docstring).

        The re-read is rate-limited per store. The retry is made only if the map now
        routes one of ``slots`` elsewhere than the failed call did (whoever re-read it:
        this load, another one, or redis-py itself): a map that still names the node that
        just failed (a primary dead and not yet replaced, a cluster down) fails fast."""
        routes = self._routes()
        # the primaries the call is made with, noted before it: redis-py may change its
        # map in place while handling the failure (a replica moved up for the slot)
        before = {s: primary_of(routes, s) for s in slots}
        try:
            try:
                return op()
            except _STALE_ROUTE:
                if not self._rerouted(before):
                    raise
            return op()
        except ERRORS as e:  # one primary's failure, if the keys are all on one
            primaries = set(before.values())
            raise self._store_error(e, domain=primaries.pop() if len(primaries) == 1
                                    else None) from None

    def _rerouted(self, before: dict) -> bool:
        """After a failed call made with the primaries ``before`` (slot -> primary):
        re-read the map (unless that was done less than ``REROUTE_EVERY_S`` ago); does it
        route any of those slots elsewhere?"""
        self._reread_routes()
        now = self._routes()
        return any(primary != primary_of(now, s) for s, primary in before.items())

    def _reread_routes(self) -> bool:
        """Re-read the slot map unless that was done less than ``REROUTE_EVERY_S`` ago;
        did it succeed?"""
        now = time.monotonic()
        with self._reroute_lock:
            rate_limited = now < self._next_reroute
            if not rate_limited:
                self._next_reroute = now + REROUTE_EVERY_S
                self._rereading.acquire()  # (taken before any rate-limited caller looks)
        if rate_limited:  # another load's re-read may be under way: its map, once read
            with self._rereading:
                return False
        try:
            self._r.nodes_manager.initialize()
        except ERRORS:  # no node answers: the map stays what it was
            return False
        finally:
            self._rereading.release()
        with self._reroute_lock:
            self.route_refreshes += 1
        return True

    @_wrapped
    def get(self, identifier: str) -> bytes | None:
        return self._load(lambda: RedisStore.get.__wrapped__(self, identifier),
                          (key_slot(_enc(identifier)),))  # (a bucket's slot: its tag's)

    @_wrapped
    def read_verified(self, identifier: str, checksum=lambda version: True, into=None):
        try:
            return RedisStore.read_verified.__wrapped__(self, identifier, checksum, into)
        except _STALE_ROUTE:
            # a slot on the move (ASK), a map not re-read yet (MOVED), a primary dead or
            # replaced (connection refused): the load is get()'s, whose redis-py call
            # follows redirects and re-reads the map itself, then _load's re-read and retry;
            # the access-time refresh sent with the failed GET went nowhere: get() sends it
            self._touched.pop(identifier, None)
            return Store.read_verified(self, identifier, checksum)

    def _connection_pool(self, key: bytes):
        """The pool of the primary the slot map names for ``key`` (a stale map: ``MOVED``
        or a refused connection, and :meth:`read_verified` falls back to ``get``)."""
        return self._r.get_redis_connection(self._r.get_node_from_key(key)).connection_pool

    @_wrapped
    def index_version(self) -> bytes | None:
        # (a consumer's index refresh: its probe of the store, as cheap as a load)
        return self._load(lambda: RedisStore.index_version.__wrapped__(self),
                          (hashed_slot(self._gen_key),))

    def _journal_keys(self, p: bytes) -> tuple[bytes, bytes]:
        # one hash tag (the prefix: it has no braces) puts both on one slot for the script
        return b"{" + p + b"}gen", b"{" + p + b"}journal"

    def _transact(self, build, changed: list[bytes]) -> list:
        """One MULTI on the bucket's node (waiting out a reshard or failover), then the
        ``gen`` bump and journal record on theirs. Not atomic with the entry: a write
        whose journal call fails (logged) is not seen by journal readers until their
        periodic full check (``journal_complete`` is False)."""
        def multi():
            pipe = self._r.pipeline(transaction=True)
            build(pipe)
            return pipe.execute()

        res = self._waiting(multi)
        try:
            self._waiting(lambda: self._journal(None, changed))
        except _RETRY_WRITES as e:
            now = time.monotonic()
            if now >= self._journal_warned_until:  # (once a minute: a purge makes many)
                self._journal_warned_until = now + 60.0
                log.warning("encache: %d entr%s written or deleted, but the change journal "
                            "(%s) is unreachable: readers that follow it (local tiers) see "
                            "such changes only at their next full check: %s", len(changed),
                            "y" if len(changed) == 1 else "ies",
                            self._journal_key.decode("utf-8", "replace"),
                            self._store_error(e))
        return res

    @_wrapped
    def changes_since(self, cursor):
        return self._load(lambda: RedisStore.changes_since.__wrapped__(self, cursor),
                          (hashed_slot(self._gen_key),))

    @_wrapped
    def read_counters(self) -> dict[str, float]:
        # (one key: a failure names its primary, as a load's does)
        return self._load(lambda: RedisStore.read_counters.__wrapped__(self),
                          (hashed_slot(self._counters_key),))

    @_wrapped
    def stat(self, identifier: str):
        return self._waiting(lambda: RedisStore.stat.__wrapped__(self, identifier))

    @_wrapped
    def contains(self, identifier: str) -> bool:
        return self._waiting(lambda: RedisStore.contains.__wrapped__(self, identifier))

    @_wrapped
    def get_many(self, identifiers: list[str]) -> list[bytes | None]:
        return self._load(lambda: self._get_many(identifiers),
                          {key_slot(_enc(i)) for i in identifiers})

    def _get_many(self, identifiers: list[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        now = time.time()
        for start in range(0, len(identifiers), 256):
            chunk = identifiers[start:start + 256]
            raw = [i.encode("utf-8", "surrogatepass") for i in chunk]
            keys = [self.key(i) for i in chunk]
            pipe = self._r.pipeline(transaction=False)
            for k in keys:
                pipe.get(k)
            touched = 0
            for (_, atime_key), pos in self._grouped(raw).items():
                touch = {raw[n]: now for n in pos if self._should_touch(chunk[n], now)}
                if touch:
                    pipe.zadd(atime_key, touch, xx=True)
                    touched += 1
            values = pipe.execute(raise_on_error=False)[:len(keys)]
            for v in values:
                if isinstance(v, Exception):
                    raise v
            out.extend(values)
        return out

    # -- failure domains: one primary's outage misses only its slots --------------------------
    def failure_domain(self, identifier: str) -> str | None:
        """The primary (``host:port``) the client's slot map routes ``identifier`` to; None
        before the client is built (a lookup then treats the cluster as one)."""
        client = self._r.built()
        if client is None:
            return None
        return primary_of(client.nodes_manager.slots_cache, key_slot(_enc(identifier)))

    @_wrapped
    def probe_domain(self, domain: str) -> None:
        """One keyed read (``EXISTS`` of a bucket's header key) on a slot the slot map
        routes to ``domain``, after re-reading the map (rate-limited): what a load meets,
        CLUSTERDOWN included. A ``domain`` the map no longer names a primary answers:
        its slots are served by others now (the primary that replaced it is a domain of
        its own)."""
        self._reread_routes()
        routes = self._routes()
        slot = next((s for s, nodes in routes.items() if nodes and nodes[0].name == domain),
                    None)
        if slot is None:
            return
        try:
            self._r.exists(self._bucket(self._tags[slot]) + b":m")
        except ERRORS as e:
            raise self._store_error(e, domain=domain) from None

    @_wrapped
    def ping(self) -> float:
        """Round trip to every primary (the slowest; raises if any is unreachable)."""
        t = time.perf_counter()
        self._r.ping(target_nodes=RedisCluster.PRIMARIES)
        return time.perf_counter() - t

    # -- capacity, per primary ---------------------------------------------------------------
    def _node_facts(self) -> list[dict]:
        """Memory settings and usage of every primary (and its replica count); a primary
        that does not answer is listed with ``reachable`` False and its ``error``."""
        facts = []
        for node in self._primaries():
            try:
                self._r.ping(target_nodes=node)
            except ERRORS as e:
                facts.append({"node": node.name, "reachable": False,
                              "error": self._store_error(e).reason, "used_memory": None,
                              "maxmemory": None, "maxmemory_policy": None, "keys": None,
                              "replicas": None, "_mem": None})
                continue
            mem = self._memory_info(target_nodes=node)
            keys = replicas = None
            with contextlib.suppress(*ERRORS):
                keys = self._r.dbsize(target_nodes=node)
            with contextlib.suppress(*ERRORS):  # as the primary itself sees them
                replicas = int(self._r.info("replication", target_nodes=node)
                               .get("connected_slaves", 0))
            facts.append({"node": node.name, "reachable": True, "error": None,
                          "used_memory": mem.get("used_memory"),
                          "maxmemory": mem.get("maxmemory"),
                          "maxmemory_policy": mem.get("maxmemory_policy"),
                          "keys": keys, "replicas": replicas,
                          "_mem": mem})
        return facts

    @_wrapped
    def capacity_warnings(self, facts: list[dict] | None = None) -> list[str]:
        """Every primary's memory problems, each prefixed with the node."""
        facts = self._node_facts() if facts is None else facts
        out = []
        for f in facts:
            if not f["reachable"]:
                out.append(f"primary {f['node']}: unreachable ({f['error']})")
                continue
            out += [f"primary {f['node']}: {w}" for w in self._memory_warnings(f["_mem"])]
            if f["replicas"] == 0:
                out.append(f"primary {f['node']}: no replica (if it fails, its slots are "
                           "down until it is back, and its entries are lost)")
        policies = {f["maxmemory_policy"] for f in facts if f["maxmemory_policy"]}
        if len(policies) > 1:
            out.append(f"primaries disagree on maxmemory-policy ({', '.join(sorted(policies))})")
        return out

    @_wrapped
    def info(self) -> StoreInfo:
        """Every primary's facts (``nodes``); one that does not answer is listed as such,
        and the figures summed over primaries (``entries``, ``used_memory``…) are those
        of the others (a capacity is unknown then). Raises when no primary answers."""
        facts = self._node_facts()
        live = [f for f in facts if f["reachable"]]
        if not live:
            self._r.ping(target_nodes=RedisCluster.PRIMARIES)  # raises the real reason
            raise StoreError(f"Redis {self._redacted}: no primary answers")
        server: dict = {}
        with contextlib.suppress(*ERRORS):
            node = self._r.get_node(node_name=live[0]["node"])
            server = dict(self._r.info("server", target_nodes=node))
        maxes = [int(f["maxmemory"] or 0) for f in facts]
        total_max = sum(maxes) if maxes and all(maxes) else None
        policies = sorted({str(f["maxmemory_policy"]) for f in facts if f["maxmemory_policy"]})
        extra = {
            "prefix": self.prefix,
            "redis_version": server.get("redis_version"),
            # (Valkey also answers redis_version: the Redis release it is compatible with)
            **({"valkey_version": server["valkey_version"]}
               if server.get("valkey_version") else {}),
            "primaries": len(facts),
            "used_memory": sum(int(f["used_memory"] or 0) for f in facts),
            "maxmemory": total_max or 0,
            "maxmemory_policy": ", ".join(policies) or None,
            "entries": self.count(unreachable=[]),
            "dbsize": sum(int(f["keys"] or 0) for f in facts),
            "ttl": self.ttl,
            "nodes": [{k: v for k, v in f.items() if not k.startswith("_")} for f in facts],
            "warnings": self.capacity_warnings(facts),
        }
        return StoreInfo(url=self.url, backend=self.backend, max_bytes=total_max, extra=extra)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._r.close()


