"""Receive one Redis value straight into a buffer of ours, checking it as it arrives.

redis-py hands a ``GET``'s value back as a new ``bytes`` object: the value crosses the
socket into the parser's buffer, is copied into that object, and checking its checksum is
one more pass over it. An entry load (a 2.75 MB Gemma-3 tensor, several per request) does
better reading the reply itself: :func:`receive_verified` sends the ``GET`` on a pooled
connection and ``recv_into``\\ s the value's bytes into the entry's buffer in chunks, each
hashed while it is still in the CPU cache (:func:`.entry.read_verified`), so the bytes
are received, placed and verified in one pass.

Only the ``GET`` is in flight on the connection, so nothing follows its reply on the
socket; a read that stops part-way (a bad entry, a timeout, a dropped connection)
disconnects the connection, which therefore never returns to the pool with unread bytes.
Dropped connections are retried as the pool's other commands are (the connection's
``retry``: a stale pooled socket after a server restart); timeouts are not.
"""

from __future__ import annotations

import socket

from redis._parsers.base import BaseParser
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..entry import STREAM_CHUNK, read_verified
from ..files import uninitialized

#: bytes asked of the first ``recv`` of a reply: its ``$<length>\r\n`` line and the start
#: of the value (which is then moved into the entry's buffer)
HEAD = 4096


class _Reply:
    """One reply read from ``sock``: its first line, then the value's bytes."""

    def __init__(self, sock):
        self.sock = sock
        self.pending = memoryview(b"")

    def _recv_into(self, view) -> int:
        try:
            n = self.sock.recv_into(view)
        except socket.timeout:
            raise RedisTimeoutError("Timeout reading from socket") from None
        except OSError as e:
            raise RedisConnectionError(f"Error while reading from socket: {e}") from None
        if not n:
            raise RedisConnectionError("Connection closed by server.")
        return n

    def line(self) -> bytes:
        """The next reply's first line (without its CRLF), beginning with what an earlier
        line's read brought (a pipelined reply ahead of this one: never more than
        ``HEAD`` bytes); what follows it stays pending."""
        head = bytearray(HEAD)
        view = memoryview(head)
        filled = self.pending.nbytes
        view[:filled] = self.pending
        while True:
            end = head.find(b"\r\n", 0, filled)
            if end >= 0:
                self.pending = view[end + 2:filled]
                return bytes(head[:end])
            if filled == HEAD:
                raise RedisConnectionError("Protocol error: reply line too long")
            filled += self._recv_into(view[filled:])

    def readinto(self, view) -> int:
        """The value's next bytes into ``view`` (what the first read brought, then the
        socket); never more than ``view`` holds, so nothing past the value is taken."""
        if self.pending.nbytes:
            n = min(self.pending.nbytes, view.nbytes)
            view[:n] = self.pending[:n]
            self.pending = self.pending[n:]
            return n
        return self._recv_into(view)

    def end(self) -> bool:
        """Read the CRLF that ends a bulk value; whether nothing past it was taken."""
        tail = bytearray(2)
        got = 0
        while got < 2:
            got += self.readinto(memoryview(tail)[got:])
        if tail != b"\r\n":
            raise RedisConnectionError("Protocol error: bad end of a bulk reply")
        return not self.pending.nbytes


class Unreadable(Exception):
    """A reply this reader does not take apart (a RESP3 push or attribute ahead of the
    value): the caller reads the entry through redis-py instead."""


def _receive(conn, key: bytes, identifier: str, hashing: bool, touch=None, into=None):
    """Send the ``GET`` and read its reply (RESP2 or RESP3): ``(value, error, in_step)``.
    ``value`` is ``(buffer, meta, offset)`` or None (no such key); ``error`` the server's
    error reply as redis-py's exception; ``in_step`` False when a read took bytes past
    the reply (a push that followed it): the connection must not be reused. ``touch``:
    ``(sorted set, member, score)``, a ``ZADD XX`` sent ahead of the ``GET`` in the same
    write, its reply read first (an error reply costs the touch, not the load)."""
    if touch is None:
        conn.send_command("GET", key)
    else:
        zset, member, score = touch
        conn.send_packed_command(conn.pack_commands(
            [("ZADD", zset, "XX", repr(score), member), ("GET", key)]))
    reply = _Reply(conn._sock)  # (the socket send_command just wrote to)
    if touch is not None:
        first = reply.line()
        if first[:1] not in (b":", b"-"):
            raise Unreadable(f"reply starting {first[:1]!r} to ZADD")
    line = reply.line()
    kind, rest = line[:1], line[1:]
    if kind == b"_" or line == b"$-1":  # no such key (RESP3, RESP2)
        return None, None, not reply.pending.nbytes
    if kind == b"-":
        return None, BaseParser.parse_error(rest.decode("utf-8", "replace")), \
            not reply.pending.nbytes
    if kind == b"!":  # RESP3 blob error
        text = bytearray(int(rest))
        got = 0
        while got < len(text):
            got += reply.readinto(memoryview(text)[got:])
        in_step = reply.end()
        return None, BaseParser.parse_error(text.decode("utf-8", "replace")), in_step
    if kind != b"$":
        raise Unreadable(f"reply starting {line[:1]!r} to GET")
    size = int(rest)
    buf = uninitialized(size) if into is None else into(size)
    meta, offset = read_verified(reply.readinto, size, buf, chunk=STREAM_CHUNK,
                                 identifier=identifier, verify=hashing)
    return (buf, meta, offset), None, reply.end()


def receive_verified(pool, key: bytes, identifier: str, hashing: bool, touch=None,
                     into=None):
    """``GET key`` on a connection of ``pool``, the value received into a new buffer
    (``into(n)``'s, when given) and validated in the same pass (``hashing``: its checksum
    too). ``(buffer, meta, offset)``, or None when the key does not exist. ``touch``:
    ``(sorted set, member, score)`` to ``ZADD XX`` in the same round trip (the entry's
    access time). Raises
    redis-py's errors (a ``MOVED`` reply as ``MovedError``), :class:`.entry.CorruptEntry`
    and :class:`Unreadable`."""
    conn = pool.get_connection()
    clean = False  # the whole reply, and nothing past it, was read
    try:
        value, error, clean = conn.retry.call_with_retry(
            lambda: _receive(conn, key, identifier, hashing, touch, into),
            lambda error: conn.disconnect())
        if error is not None:
            raise error
        return value
    finally:
        if not clean:
            conn.disconnect()  # bytes of this or another reply may be left: never reuse
        pool.release(conn)
