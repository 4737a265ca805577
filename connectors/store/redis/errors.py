"""Redis failures as one line each, and which of them are worth retrying.

Every redis-py error a store method meets becomes a :class:`.base.StoreError` with one
line a person can act on (connection refused, authentication failed, timed out, out of
memory, read-only replica, still loading, a cluster down), naming the URL with its
password redacted (``StoreError.reason``: the same line without the URL).
:class:`ConnectionRetry` retries dropped or refused connections only.
"""

from __future__ import annotations

import time

from redis.exceptions import (AuthenticationError, AuthorizationError, BusyLoadingError,
                              ClusterDownError, ConnectionError as RedisConnectionError,
                              NoPermissionError, OutOfMemoryError, ReadOnlyError,
                              RedisClusterException, RedisError,
                              TimeoutError as RedisTimeoutError)
from redis.backoff import AbstractBackoff
from redis.retry import Retry

from ..base import StoreError

#: what redis-py raises (cluster topology errors are not RedisErrors)
ERRORS = (RedisError, RedisClusterException)


class ConnectionBackoff(AbstractBackoff):
    """The wait before retry ``n`` (1, 2, ...): ``first * 2 ** (n - 1)``, at most ``cap``
    (0.02 + 0.04 s for the default two retries). Our own, not redis-py's
    ``ExponentialBackoff``, whose count of failures (and so every wait) has changed
    between its releases: a failed load's time must not depend on the client's version."""

    def __init__(self, first: float = 0.02, cap: float = 0.5):
        self.first, self.cap = first, cap

    def reset(self) -> None:
        pass

    def compute(self, failures: int) -> float:
        return min(self.cap, self.first * 2 ** max(0, failures - 1))


class ConnectionRetry(Retry):
    """Retry dropped/refused connections (a restart, a stale pooled socket), but neither a
    refused password nor a timeout (a hung or overloaded server: waiting again only
    multiplies the delay every caller sees).

    The loop is ours, not ``Retry.call_with_retry``'s: redis-py 5 calls it with ``(do,
    fail)``, later releases add ``is_retryable`` and ``with_failure_count``, and the
    base class of each release accepts only its own; this one takes either call."""

    def __init__(self, backoff, retries):
        super().__init__(backoff, retries, supported_errors=(RedisConnectionError,))

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        self._backoff.reset()
        failures = 0
        while True:
            try:
                return do()
            except self._supported_errors as e:
                if isinstance(e, (AuthenticationError, AuthorizationError)) \
                        or (is_retryable is not None and not is_retryable(e)):
                    raise
                failures += 1
                fail(e, failures) if with_failure_count else fail(e)
                if 0 <= self._retries < failures:
                    raise
                wait = self._backoff.compute(failures)
                if wait > 0:
                    time.sleep(wait)


def describe_error(e: BaseException, *, url: str, password: str | None,
                   socket_timeout: float) -> StoreError:
    """One line for what went wrong, naming ``url`` (already redacted); the password is
    scrubbed from anything the server or redis-py put in the message."""
    msg = " ".join(str(e).split()) or e.__class__.__name__
    low = msg.lower()
    if isinstance(e, NoPermissionError) or low.startswith("noperm") \
            or "user executing the script can't" in low:
        what = (f"permission denied: this user's ACL does not allow it ({msg}); "
                "docs/security.md lists what a consumer and a writer need")
    elif isinstance(e, AuthenticationError) or "noauth" in low \
            or "wrongpass" in low or "invalid password" in low \
            or "invalid username-password" in low or "already authenticated" in low \
            or "authentication required" in low:
        if not password:
            what = "authentication failed: the server requires a password (the URL has none)"
        elif "wrongpass" in low or "invalid" in low:
            what = "authentication failed: wrong password (or user)"
        else:
            what = f"authentication failed ({msg})"
    elif isinstance(e, RedisTimeoutError) or "timed out" in low or "timeout" in low:
        what = f"timed out after {socket_timeout:g}s ({msg})"
    elif isinstance(e, OutOfMemoryError) or "maxmemory" in low or low.startswith("oom"):
        what = ("out of memory: maxmemory reached and the policy evicts nothing "
                "(use maxmemory-policy allkeys-lru; see `encache stats`)")
    elif isinstance(e, ReadOnlyError):
        what = "the server is a read-only replica (point the URL at the primary)"
    elif isinstance(e, BusyLoadingError):
        what = "Redis is still loading its dataset; retry shortly"
    elif isinstance(e, RedisConnectionError) or "cannot be connected" in low:
        if "refused" in low:
            what = "connection refused (is redis-server running there?)"
        elif "no such file" in low:
            what = "unix socket not found"
        elif "name or service not known" in low or "nodename" in low:
            what = "unknown host"
        else:
            what = f"connection failed ({msg})"
    elif isinstance(e, ClusterDownError) or low.startswith("clusterdown") \
            or "cluster is down" in low:
        what = ("the cluster is down: a slot has no live primary, and while "
                "cluster-require-full-coverage is yes every node refuses commands until it "
                "is replaced (with no, only its slots would fail)")
    else:
        what = f"command failed ({msg})"
    if len(what) > 300:
        what = what[:297] + "..."
    text = f"Redis {url}: {what}"
    if password:
        text, what = text.replace(password, "***"), what.replace(password, "***")
    return StoreError(text, reason=what)
