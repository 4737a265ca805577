"""Tests for :mod:`encache.connectors.lookup.breaker`: the store circuit breaker."""

from __future__ import annotations

import time


def test_circuit_breaker_backs_off_and_closes():
    """A store error opens the breaker for 1 s, doubling per consecutive failure up to
    30 s; a success closes it at once."""
    from encache.connectors.lookup.breaker import CircuitBreaker

    b = CircuitBreaker()
    assert not b.is_open()
    now = time.monotonic()
    b.trip()
    assert b.is_open() and not b.is_open(now + 1.5)  # 1 s
    for _ in range(3):
        b.trip()
    assert b.is_open(now + 7.5) and not b.is_open(now + 8.5)  # 1, 2, 4, 8 s
    for _ in range(10):
        b.trip()
    assert b.is_open(now + 29.5) and not b.is_open(now + 31)  # capped at 30 s
    b.reset()
    assert not b.is_open()
