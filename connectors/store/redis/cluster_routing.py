"""Where a key lives on a Redis Cluster and how the store reaches it: the slot-aligned
hash tags, CRC16 slots, the ``redis+cluster://`` URL and a client built on first use.

Why apart from :mod:`.cluster`: this is pure addressing (no store semantics), the
part a reader needs to follow the key layout described there, and the part tests check
against redis-py's own slot function."""

from __future__ import annotations

import binascii
import threading

from redis.commands.core import Script
from redis.exceptions import (AskError, ClusterDownError, MovedError, SlotNotCoveredError,
                              TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError

from ..base import StoreError
from ..url import CLUSTER_SCHEMES, redact

#: a write or a header read failing with one of these met a slot on the move or a failover:
#: waited out and retried (``redirect_wait``)
_RETRY_WRITES = (AskError, MovedError, TryAgainError, ClusterDownError, SlotNotCoveredError,
                 RedisConnectionError)
#: a load failing with one of these may have met a stale route: re-read the map, retry once
#: (not TimeoutError, not TRYAGAIN: the retry would wait, or meet the same half-moved slot)
_STALE_ROUTE = (RedisConnectionError, ClusterDownError, SlotNotCoveredError, MovedError, AskError)

__all__ = ["SLOTS", "slot_tags", "key_slot", "primary_of", "parse_cluster_url", "LazyCluster"]

SLOTS = 16384
_TAGS: list[bytes] | None = None


def slot_tags() -> list[bytes]:
    """``tags[slot]``: the smallest decimal string whose CRC16 lands in ``slot``.

    Deterministic, so every process agrees; built once per process (~0.05 s)."""
    global _TAGS
    if _TAGS is None:
        tags: list[bytes | None] = [None] * SLOTS
        left, n = SLOTS, 0
        while left:
            t = b"%d" % n
            s = binascii.crc_hqx(t, 0) & (SLOTS - 1)
            if tags[s] is None:
                tags[s] = t
                left -= 1
            n += 1
        _TAGS = tags  # type: ignore[assignment]
    return _TAGS  # type: ignore[return-value]


def key_slot(raw: bytes) -> int:
    """Redis Cluster's slot of a key without hash tag (CRC16-XMODEM mod 16384)."""
    return binascii.crc_hqx(raw, 0) & (SLOTS - 1)


def primary_of(routes: dict, slot: int) -> str | None:
    """The name (host:port) of the primary a slot map routes ``slot`` to."""
    nodes = routes.get(slot)
    return nodes[0].name if nodes else None


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], str, str]:
    """``(startup nodes, a redis[s]:// URL for the connection options, query)``."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in CLUSTER_SCHEMES:
        raise StoreError(f"not a Redis Cluster URL: {redact(url)}")
    cut = min((rest.find(c) for c in "/?" if c in rest), default=len(rest))
    netloc, tail = rest[:cut], rest[cut:]
    if tail.startswith("/"):
        path, _, query = tail[1:].partition("?")
        if path not in ("", "0"):
            raise StoreError(f"a Redis Cluster has only database 0, not /{path}: {redact(url)}")
    else:
        query = tail[1:]
    userinfo, _, hosts = netloc.rpartition("@")
    nodes = []
    for h in hosts.split(","):
        host, _, port = h.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            raise StoreError(f"bad node {h!r} in {redact(url)} (use host:port[,host:port…])")
        nodes.append((host, int(port)))
    base = "rediss" if scheme.startswith("rediss") else "redis"
    auth = f"{userinfo}@" if userinfo else ""
    h0, p0 = nodes[0]
    return nodes, f"{base}://{auth}{h0}:{p0}/0", query


class LazyCluster:
    """A ``RedisCluster`` client built on first use.

    redis-py's client asks the startup nodes for the topology as it is constructed; done
    lazily, opening a store never touches the network (like :class:`.redis.RedisStore`), so
    a cluster that is down when an engine starts means misses, not a failed start-up, and
    the first command after it is back builds the client."""

    def __init__(self, factory):
        self._factory = factory
        self._client = None
        self._lock = threading.Lock()

    def _get(self):
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    self._client = self._factory()
                client = self._client
        return client

    def built(self):
        """The client if it was built already, else None (never touches the network)."""
        return self._client

    def register_script(self, script: str) -> Script:
        return Script(self, script.encode())  # (bytes: no encoder, so no connection yet)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def __getattr__(self, name):
        return getattr(self._get(), name)
