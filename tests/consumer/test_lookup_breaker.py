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


def test_a_domain_trips_alone_and_is_probed_until_it_answers():
    """A store whose parts fail apart: an error of one part (a domain) opens its breaker
    alone, with its own backoff; the store's and the other domains' stay closed; the
    tripped domains are listed (to probe) until each is reset, and counted while within
    their own backoff."""
    from encache.connectors.lookup.breaker import CircuitBreaker

    b = CircuitBreaker()
    assert not b.has_tripped_domains() and b.tripped_domains() == []
    now = time.monotonic()
    b.trip("a:1")
    b.trip("a:1")
    assert b.is_open(domain="a:1") and not b.is_open(now + 2.5, domain="a:1")  # 1, 2 s
    assert not b.is_open() and not b.is_open(domain="b:2")
    b.trip("b:2")
    assert sorted(b.tripped_domains()) == ["a:1", "b:2"] and b.has_tripped_domains()
    b.reset("a:1")
    assert not b.is_open(domain="a:1") and b.tripped_domains() == ["b:2"]
    assert b.open_domains() == 1 and b.open_domains(time.monotonic() + 2) == 0
    b.trip()  # the store as a whole: every domain's lookups too
    assert b.is_open() and b.is_open(domain="a:1")
    assert b.open_domains() == 1  # (the parts down: the store's own state apart)
    b.reset()  # (the store's breaker: a domain still tripped stays so)
    assert not b.is_open() and b.is_open(domain="b:2") and not b.is_open(domain="a:1")
    b.reset("b:2")
    assert not b.has_tripped_domains()
