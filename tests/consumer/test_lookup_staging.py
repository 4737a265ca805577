"""Tests for :mod:`encache.connectors.lookup.staging`: the byte-bounded staging LRU."""

from __future__ import annotations


def test_staging_is_a_byte_bounded_lru_that_keeps_the_newest():
    from encache.connectors.lookup.staging import Staged, StagingArea

    def st(name, n):
        return Staged(name, None, bytearray(n), 0, 0.0)

    area = StagingArea(max_bytes=100)
    area.add(st("a", 40))
    area.add(st("b", 40))
    assert area.touch("a")  # a is now the most recently used
    area.add(st("c", 40))  # over the bound: the least recently used (b) goes
    assert "a" in area and "c" in area and "b" not in area and area.nbytes == 80
    area.add(st("big", 500))  # alone over the bound: kept, everything else goes
    assert area.get("big") is not None and "a" not in area and area.nbytes == 500
    area.discard("big")
    assert area.nbytes == 0 and not area.touch("big")
