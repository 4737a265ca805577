"""An exclusive lock held in Redis while a job runs (``precompute`` takes one per store).

``SET key "{token} pid N on HOST" NX PX ttl`` takes it; a thread renews the expiry every
third of ``ttl`` while it is held, so a holder that crashes (or is SIGKILLed) frees it after
``ttl`` seconds at most and a live one never loses it to a slow step; a Lua
compare-and-delete releases only our own token. A renewal that finds another token sets
the handle's ``lost`` (the job may then stop writing). Used by
:meth:`encache.connectors.store.redis.store.RedisStore.lock` (and so by the cluster store).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time

from redis.exceptions import RedisError

from ..base import LockBusy

log = logging.getLogger("encache.connectors.store.redis.store")

UNLOCK_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class LockHandle:
    """What a held lock yields: ``lost`` turns True if a renewal found another holder."""

    lost = False


class RedisLock:
    """The lock protocol over one client (scripts registered once per store handle)."""

    def __init__(self, client, *, describe_error, url: str, prefix: str):
        self._r = client
        self._unlock = client.register_script(UNLOCK_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._describe_error = describe_error  # RedisError -> StoreError (redacted text)
        self.url, self.prefix = url, prefix

    @contextlib.contextmanager
    def hold(self, key: bytes, name: str, *, ttl: float, wait: float = 0.0):
        """Hold ``key`` (raises :class:`LockBusy` after ``wait`` s if another holds it)."""
        holder = f"pid {os.getpid()} on {socket.gethostname()}"
        value = f"{secrets.token_hex(8)} {holder}".encode()
        ttl_ms = max(1000, int(ttl * 1000))
        deadline = time.monotonic() + max(0.0, wait)
        try:
            while not self._r.set(key, value, nx=True, px=ttl_ms):
                if time.monotonic() >= deadline:
                    held = self._r.get(key)
                    who = (held.decode(errors="replace").split(" ", 1)[-1] if held
                           else "just released")
                    raise LockBusy(f"store {self.url} (prefix {self.prefix}) is locked by "
                                   f"another {name} ({who})")
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())) or 0.01)
        except RedisError as e:
            raise self._describe_error(e) from None
        handle = LockHandle()
        stop = threading.Event()

        def renew():
            while not stop.wait(ttl_ms / 3000):
                try:
                    if not self._renew(keys=[key], args=[value, ttl_ms]):
                        handle.lost = True
                        log.warning("lost the %s lock on %s", name, self.url)
                        return
                except RedisError as e:  # keep trying: the server may come back in time
                    log.warning("could not renew the %s lock: %s", name,
                                self._describe_error(e))

        thread = threading.Thread(target=renew, name=f"encache-lock-{name}", daemon=True)
        thread.start()
        try:
            yield handle
        finally:
            stop.set()
            thread.join()
            with contextlib.suppress(RedisError):
                self._unlock(keys=[key], args=[value])
