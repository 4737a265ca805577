"""Walking a Redis Cluster store: every primary scanned on its own, header reads grouped
by node, and a part that does not answer named rather than failing the walk
(``supports_failure_domains``). Part of :class:`~.cluster.RedisClusterStore` (a mixin:
the methods use its routing and connection).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from redis.exceptions import NoScriptError, ResponseError

from ..base import StoreError
from .cluster_routing import _RETRY_WRITES, _STALE_ROUTE
from .errors import ERRORS

# one bucket's part of a SCAN page: KEYS = meta, atime; ARGV = identifiers
_PAGE_LUA = """
return {redis.call('HLEN', KEYS[1]), redis.call('ZCARD', KEYS[2]),
        redis.call('HMGET', KEYS[1], unpack(ARGV)), redis.call('ZMSCORE', KEYS[2], unpack(ARGV))}
"""


class ClusterScan:
    """A Redis Cluster store's walk over its primaries."""

    def _page_records(self, raw: list[bytes], sides: dict) -> tuple[list, list]:
        """Headers and access times of one SCAN page: one Lua call per bucket (HMGET +
        ZMSCORE + the bucket's HLEN/ZCARD for the drift check), sent as one plain pipeline
        per node — redis-py's cluster pipeline spends ~100 µs of Python per command on
        slot routing, and a sparse page touches one bucket per entry. If a slot moved
        meanwhile (MOVED/ASK in a reshard), the page goes through the cluster client,
        which follows redirects."""
        groups = self._grouped(raw)
        calls = [(pair, [raw[n] for n in pos]) for pair, pos in groups.items()]
        try:
            try:
                replies = self._per_node(calls)
            except ResponseError as e:
                if self._page_cmd != "EVALSHA_RO" or "unknown command" not in str(e).lower():
                    raise
                self._page_cmd = "EVALSHA"  # (Redis 6)
                replies = self._per_node(calls)
        except NoScriptError:  # first scan, or a promoted replica (empty script cache)
            for node in self._primaries():  # (one that does not answer is not this page's)
                with contextlib.suppress(*ERRORS):
                    self._r.execute_command("SCRIPT LOAD", _PAGE_LUA, target_nodes=node)
            replies = self._per_node(calls)
        metas, atimes = [None] * len(raw), [None] * len(raw)
        for (pair, pos), (hlen, zcard, mv, tv) in zip(groups.items(), replies):
            seen = sides.setdefault(pair, [0, 0])
            seen[0] += len(pos)
            seen[1] = max(seen[1], int(hlen), int(zcard))
            for j, n in enumerate(pos):
                metas[n] = mv[j] or None
                atimes[n] = float(tv[j]) if tv[j] else None
        return metas, atimes

    def _per_node(self, calls: list) -> list:
        sha, cmd = self._page_sha, self._page_cmd
        nm = self._r.nodes_manager
        try:
            by_node: dict[str, tuple] = {}
            for n, ((meta_key, atime_key), members) in enumerate(calls):
                node = nm.get_node_from_slot(self._r.keyslot(meta_key))
                entry = by_node.get(node.name)
                if entry is None:
                    entry = by_node[node.name] = (node.redis_connection.pipeline(transaction=False), [])
                entry[0].execute_command(cmd, sha, 2, meta_key, atime_key, *members)
                entry[1].append(n)
            out: list = [None] * len(calls)
            for pipe, positions in by_node.values():
                for n, value in zip(positions, pipe.execute()):
                    out[n] = value
            return out
        except (*_RETRY_WRITES, AttributeError):  # (AttributeError: no connection yet)
            return [self._r.execute_command(cmd, sha, 2, m, a, *members)
                    for (m, a), members in calls]

    def _drifted(self, found: set, sides: dict) -> list[tuple[bytes, bytes]]:
        """Buckets holding more records than live entries, and side keys of buckets
        without any entry left (all counted during the scan: no extra round trip)."""
        return sorted([pair for pair, (seen, held) in sides.items() if held > seen] +
                      [pair for pair in found if pair not in sides])

    def _primaries(self) -> list:
        with self._errors():  # (the first call may build the client: unreachable, auth…)
            return self._r.get_primaries()

    def _scan_pages(self, found: set | None = None, unreachable: list | None = None,
                    dedupe: bool = True) -> Iterator[list[bytes]]:
        """Entry keys of every primary, a SCAN page at a time, each once (``dedupe`` off:
        as often as SCAN names them); side keys met on the way go to ``found`` as
        ``(meta, atime)`` pairs.

        The primaries come from the client's slot map; if one of them is a dead node the
        map still lists (a failover the client has not seen yet: a consumer's index
        refresh right after a promotion), the map is re-read once (as for a load) and the
        walk goes on over the primaries not walked yet (keys already yielded are not
        yielded again). A primary that still fails raises (naming it), or with
        ``unreachable`` (a list: :meth:`.base.Store.scan`) is appended there as
        ``(node, reason)`` and the walk goes on; if no primary answered, the last failure
        raises."""
        seen: set[bytes] | None = set() if dedupe else None
        # entry keys only, unless side keys are wanted too (a sparse bucket has 3 keys)
        match = self._bucket_match if found is not None else self._bucket_match + b"}:e:*"
        walked: set[str] = set()
        failed: dict[str, StoreError] = {}
        nodes, rerouted = list(self._primaries()), False
        while nodes:
            node = nodes.pop(0)
            try:
                yield from self._scan_node(node, match, seen, found)
            except _STALE_ROUTE as e:
                error = self._store_error(e, domain=node.name)
                if not rerouted:
                    rerouted = True
                    self._reread_routes()
                    nodes = [n for n in self._primaries()
                             if n.name not in walked and n.name not in failed]
                    if not any(n.name == node.name for n in nodes):  # replaced: walk the new
                        continue
                    nodes = [n for n in nodes if n.name != node.name]  # still named: down
                if unreachable is None:
                    raise error from None
                failed[node.name] = error
                continue
            except ERRORS as e:
                if unreachable is None:
                    raise self._store_error(e, domain=node.name) from None
                failed[node.name] = self._store_error(e, domain=node.name)
                continue
            walked.add(node.name)
        if failed and not walked:
            raise failed.popitem()[1]
        if unreachable is not None:
            unreachable.extend((name, error.reason) for name, error in failed.items())

    def _scan_node(self, node, match: bytes, seen: set | None, found: set | None):
        """One primary's entry keys, a SCAN page at a time (see ``_scan_pages``)."""
        plen = len(self.prefix.encode("utf-8"))
        cursor = 0
        while True:
            cursors, keys = self._r.scan(cursor, match=match, count=1000, target_nodes=node)
            cursor = cursors[node.name] if isinstance(cursors, dict) else cursors
            page = []
            for k in keys:
                close = k.find(b"}", plen)
                rest = k[close + 1:]
                if rest.startswith(b":e:"):
                    if seen is None:
                        page.append(k)
                    elif k not in seen:
                        seen.add(k)
                        page.append(k)
                elif found is not None and rest in (b":m", b":a"):
                    found.add((k[:close + 1] + b":m", k[:close + 1] + b":a"))
            if page:
                yield page
            if cursor == 0:
                return
