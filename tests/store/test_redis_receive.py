"""Entries received from Redis straight into their buffer and checked as they arrive
(``connectors/store/redis/receive.py``): on a real redis-server over TCP, TLS and a Unix
socket at the sizes users have; bad entries, dropped connections, a hung server and a
RESP3 push ahead of the reply; and the reply reader on a socket pair for what a server
only does when it dies part-way (a value cut short)."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import numpy as np
import pytest
import redis

from encache.connectors.store import StoreError, encode
from encache.connectors.store.entry import CorruptEntry
from encache.connectors.store.redis.store import RedisStore
from encache.connectors.store.redis.receive import Unreadable, _receive, receive_verified
from entries import put_entry

pytestmark = pytest.mark.redis

SIZES = {"100 B": 100, "4 KB": 4096, "2.75 MB": 256 * 5376 * 2, "11 MB": 4 * 256 * 5376 * 2}


def put(store, ident: str, nbytes: int, seed: int = 0) -> bytes:
    """An entry whose tensor is ``nbytes`` of float16 (:func:`entries.put_entry`)."""
    return put_entry(store, ident, rows=nbytes // 2, width=1, seed=seed)


def tensor_of(got) -> bytes:
    buf, _, meta, offset, _ = got
    return bytes(memoryview(buf).cast("B")[offset:offset + meta.data_bytes])


@pytest.fixture
def store(redis_server):
    s = RedisStore(redis_server.url, prefix=f"t-{uuid.uuid4().hex[:12]}:")
    yield s
    s.close()


@pytest.mark.parametrize("size", list(SIZES))
def test_an_entry_arrives_whole_and_checked(store, size):
    """Every size, from one that fits the reply's first read to four Gemma-3 crops: the
    stored bytes, checksummed, in a buffer of the entry's size."""
    blob = put(store, "e", SIZES[size])
    got = store.read_verified("e")
    assert got is not None and got[4] is True  # hashed
    assert bytes(got[0]) == blob and len(got[0]) == len(blob)
    assert tensor_of(got) == blob[-SIZES[size]:]
    assert store.read_verified("absent") is None
    assert store.read_verified("e", lambda version: False)[4] is False


def test_tls_and_unix_sockets(redis_factory):
    server = redis_factory(tls=True, password="pw")
    for url in (server.tls_url, server.unix_url):
        s = RedisStore(url, prefix=f"t-{uuid.uuid4().hex[:12]}:")
        try:
            blob = put(s, "t", SIZES["2.75 MB"], seed=1)
            assert bytes(s.read_verified("t")[0]) == blob
        finally:
            s.close()


def test_a_bad_entry_is_refused_and_its_connection_never_reused(store, redis_server):
    """A flipped byte (found at the end) and a wrong identifier (found in the first
    chunk, with megabytes still unread on the socket): each raises CorruptEntry, and the
    next loads on the same store get their own bytes, not the rest of that reply."""
    good = put(store, "good", SIZES["2.75 MB"], seed=2)
    r = redis_server.client()
    flipped = bytearray(put(store, "flip", SIZES["2.75 MB"], seed=3))
    flipped[-5] ^= 0xFF
    r.set(store.key("flip"), bytes(flipped))
    r.set(store.key("other"), put(store, "someone-else", SIZES["11 MB"], seed=4))
    for bad, reason in (("flip", "checksum"), ("other", "wrong-identifier")):
        with pytest.raises(CorruptEntry) as e:
            store.read_verified(bad)
        assert e.value.reason == reason
        for _ in range(3):
            assert bytes(store.read_verified("good")[0]) == good


def test_a_dropped_connection_is_retried(store, redis_server):
    """The server closes every client connection (a restart, an idle timeout): the next
    load reconnects and gets the entry, no error."""
    blob = put(store, "d", SIZES["2.75 MB"], seed=5)
    assert bytes(store.read_verified("d")[0]) == blob  # a pooled connection now exists
    redis_server.client().client_kill_filter(_type="normal", skipme=True)
    assert bytes(store.read_verified("d")[0]) == blob


def test_a_hung_server_fails_the_load_in_socket_timeout(redis_factory):
    server = redis_factory()
    s = RedisStore(server.url, prefix="h:", socket_timeout=0.5)
    try:
        blob = put(s, "h", SIZES["2.75 MB"], seed=6)
        server.pause()
        t0 = time.monotonic()
        try:
            with pytest.raises(StoreError, match="timed out|Timeout"):
                s.read_verified("h")
        finally:
            server.resume()
        assert time.monotonic() - t0 < 3
        assert bytes(s.read_verified("h")[0]) == blob
    finally:
        s.close()


class _OnePool:
    """Hands out one given connection (a real one), as a pool does."""

    def __init__(self, conn):
        self.conn = conn

    def get_connection(self, *a, **kw):
        return self.conn

    def release(self, conn):
        pass


def test_a_push_ahead_of_the_reply_is_left_to_redis_py(store, redis_server):
    """A RESP3 connection with client tracking gets an invalidation push when a key it
    read changes; if one waits on the socket ahead of the GET's reply, the reader does
    not take it apart: it says so (the store then reads through redis-py) and the
    connection is dropped."""
    put(store, "p", 4096, seed=7)
    pool = redis.ConnectionPool.from_url(redis_server.url, protocol=3)
    conn = pool.get_connection()
    try:
        conn.send_command("CLIENT", "TRACKING", "ON")
        conn.read_response()
        conn.send_command("GET", store.key("p"))
        conn.read_response()
        new = put(store, "p", 4096, seed=8)  # -> an invalidation push to conn
        deadline = time.monotonic() + 5
        while not conn.can_read(timeout=0.05) and time.monotonic() < deadline:
            pass
        with pytest.raises(Unreadable):
            receive_verified(_OnePool(conn), store.key("p"), "p", True)
        assert not conn.is_connected  # not reused with half a reply read
    finally:
        pool.disconnect()
    # through the store: the new bytes, whichever way they came
    assert bytes(store.read_verified("p")[0]) == new


class _PairConn:
    """A connection whose server is the test: ``_sock`` is one end of a socket pair;
    what the reader sends is kept (``sent``: one list of commands per write)."""

    def __init__(self, sock):
        self._sock = sock
        self.sent: list = []

    def send_command(self, *args):
        self.sent.append([args])

    def pack_commands(self, commands):
        return list(commands)

    def send_packed_command(self, packed):
        self.sent.append(packed)


@pytest.mark.parametrize("cut", [3, 200, 70_000])
def test_a_value_cut_short_is_a_dropped_connection_not_a_corrupt_entry(cut):
    """A server that dies part-way through a value: a connection error (the load is a
    miss, the entry is not blamed), never CorruptEntry and never a hang."""
    arr = np.random.default_rng(9).integers(0, 255, 100_000, dtype=np.uint8)
    blob = encode("c", arr, "U8", arr.shape, model="m")
    ours, theirs = socket.socketpair()
    ours.settimeout(5)

    def serve():
        theirs.sendall(b"$%d\r\n" % len(blob) + blob[:cut])
        theirs.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        with pytest.raises(redis.ConnectionError):
            _receive(_PairConn(ours), b"k", "c", True)
    finally:
        t.join()
        ours.close()


def test_replies_in_both_protocols_and_error_replies():
    """RESP2 and RESP3 nulls, a RESP3 blob error and a simple error (``MOVED``, which the
    cluster store answers with a re-route) come back as redis-py would give them; a null
    read together with a push behind it says the connection is out of step."""
    for raw, in_step in ((b"$-1\r\n", True), (b"_\r\n", True),
                         (b"_\r\n>2\r\n$10\r\ninvalidate\r\n", False)):  # a push behind
        ours, theirs = socket.socketpair()
        theirs.sendall(raw)
        time.sleep(0.05)  # (all of it waits on the socket)
        assert _receive(_PairConn(ours), b"k", "x", True) == (None, None, in_step)
        ours.close(), theirs.close()
    for raw, kind in ((b"-MOVED 3999 127.0.0.1:6381\r\n", redis.exceptions.MovedError),
                      (b"!21\r\nSYNTAX invalid syntax\r\n", redis.exceptions.ResponseError)):
        ours, theirs = socket.socketpair()
        theirs.sendall(raw)
        value, error, in_step = _receive(_PairConn(ours), b"k", "x", True)
        assert value is None and isinstance(error, kind) and in_step
        ours.close(), theirs.close()


def test_a_due_access_time_rides_ahead_of_the_get_in_one_write():
    """The access-time refresh (``ZADD XX``) goes out in the same write as the ``GET``
    and its reply is read first, whether it arrives with the value or apart from it;
    an error reply to it (a read-only replica) costs the touch, not the load; a reply
    this reader does not take apart (a push) is left to redis-py."""
    arr = np.random.default_rng(3).integers(0, 255, 70_000, dtype=np.uint8)
    blob = encode("t", arr, "U8", arr.shape, model="m")
    value = b"$%d\r\n" % len(blob) + blob + b"\r\n"
    touch = (b"set", b"t", 12.5)
    for first in (b":1\r\n", b":0\r\n", b"-READONLY You can't write against a read only "
                  b"replica.\r\n"):
        for apart in (False, True):
            ours, theirs = socket.socketpair()
            conn = _PairConn(ours)
            if apart:  # the touch's reply alone on the socket first
                theirs.sendall(first)
                t = threading.Timer(0.05, theirs.sendall, (value,))
                t.start()
            else:
                theirs.sendall(first + value)
            got, error, in_step = _receive(conn, b"k", "t", True, touch)
            if apart:
                t.join()
            assert error is None and in_step
            buf, meta, offset = got
            assert bytes(buf) == blob and meta.identifier == "t"
            assert conn.sent == [[("ZADD", b"set", "XX", "12.5", b"t"), ("GET", b"k")]]
            ours.close(), theirs.close()
    ours, theirs = socket.socketpair()
    theirs.sendall(b":1\r\n$-1\r\n")  # touched nothing (XX), then no such key
    time.sleep(0.05)
    assert _receive(_PairConn(ours), b"k", "t", True, touch) == (None, None, True)
    ours.close(), theirs.close()
    ours, theirs = socket.socketpair()
    theirs.sendall(b">2\r\n$10\r\ninvalidate\r\n")
    with pytest.raises(Unreadable):
        _receive(_PairConn(ours), b"k", "t", True, touch)
    ours.close(), theirs.close()


def test_loads_refresh_the_access_time_of_live_entries_only(redis_server):
    """On a real server, a load whose access-time refresh is due moves the entry's LRU
    clock in the same round trip; a miss adds no member for an absent entry; the pooled
    connection stays in step over many loads of both kinds."""
    s = RedisStore(redis_server.url, prefix=f"a-{uuid.uuid4().hex[:12]}:",
                   access_resolution=0)  # every load is due
    try:
        blobs = {f"e{i}": put(s, f"e{i}", 300_000, seed=i) for i in range(3)}
        r = redis.Redis.from_url(redis_server.url)
        atime = s._side(b"e0")[1]
        r.zadd(atime, {b"e0": 1.0}, xx=True)  # long ago
        before = time.time()
        assert bytes(s.read_verified("e0")[0]) == blobs["e0"]
        assert r.zscore(atime, b"e0") >= before
        for n in range(30):
            ident = f"e{n % 3}" if n % 2 else f"gone{n}"
            got = s.read_verified(ident)
            assert (got is None) if n % 2 == 0 else bytes(got[0]) == blobs[ident]
        assert r.zscore(atime, b"gone0") is None  # ZADD XX: no phantom members
        assert r.zcard(atime) == 3
        r.close()
    finally:
        s.close()
