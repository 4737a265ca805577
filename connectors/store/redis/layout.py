"""The Redis store's key layout and settings, its Lua scripts, and the error wrapper its
methods share (:mod:`.store`, :mod:`.catalogue`, :mod:`.bookkeeping`, :mod:`.cluster`).
"""

from __future__ import annotations

import functools
import struct

from .errors import ERRORS


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
