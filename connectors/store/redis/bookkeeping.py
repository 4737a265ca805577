"""The Redis store's bookkeeping beside its entries: counters, notes, removal records,
memory facts and warnings, locks. Part of :class:`~.store.RedisStore` (a mixin: the
methods use its keys and connection).
"""

from __future__ import annotations

import contextlib
import math
import time

from redis.exceptions import RedisError

from ..base import StoreError, StoreInfo
from ..removals import LIMIT as REMOVALS_LIMIT
from ..removals import note_failure as note_removal_failure
from .errors import ERRORS
from .layout import _enc, _dec, _wrapped
from .memory import memory_info, memory_warnings


class RedisBookkeeping:
    """A Redis store's counters, notes, removal records, memory facts and locks."""

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
