"""A process-independent key hash and Caffeine's count-min frequency sketch.

Why a hash of our own: Python's ``hash`` of ``str`` is salted per process, and the
benchmark must be deterministic (seeded, identical row for row across runs).
:func:`stable_hash` is used by the sketch (W-TinyLFU) and by dlfu's spatially sampled
shadow caches.
"""

from __future__ import annotations

import zlib

from .base import Key

__all__ = ["stable_hash", "CountMinSketch"]

_MASK64 = (1 << 64) - 1
_SEEDS = (0x97CB3127, 0xC2B2AE3D27D4EB4F, 0x9E3779B97F4A7C15, 0x165667B19E3779F9)


def stable_hash(key: Key) -> int:
    """A process-independent 64-bit hash (Python's ``hash`` of ``str`` is salted)."""
    if isinstance(key, int):
        h = key & _MASK64
    else:
        data = key.encode() if isinstance(key, str) else repr(key).encode()
        h = zlib.crc32(data) | (zlib.crc32(data, 0x5BD1E995) << 32)
    h = ((h ^ (h >> 33)) * 0xFF51AFD7ED558CCD) & _MASK64
    h = ((h ^ (h >> 33)) * 0xC4CEB9FE1A85EC53) & _MASK64
    return h ^ (h >> 33)


class CountMinSketch:
    """Caffeine-style frequency sketch: 4 rows of 4-bit counters with periodic halving.

    ``width`` is a power of two >= the expected number of cache entries; after
    ``10 * entries`` counted increments every counter is halved ("reset"), which ages the
    history.  ``frequency`` returns the minimum over rows (0..15).
    """

    def __init__(self, entries: int, sample_factor: int = 10):
        self.width = 1 << max(4, (max(1, entries) - 1).bit_length())
        self.mask = self.width - 1
        self.rows = [[0] * self.width for _ in range(4)]
        self.sample_size = sample_factor * max(1, entries)
        self.additions = 0
        self._idx: dict = {}  # memo of key -> counter indexes (pure speed-up)

    def _indexes(self, key):
        idx = self._idx.get(key)
        if idx is None:
            h = stable_hash(key)
            m = self.mask
            idx = [((h * s) & _MASK64) >> 40 & m for s in _SEEDS]
            if len(self._idx) >= 1 << 17:
                self._idx.clear()
            self._idx[key] = idx
        return idx

    def increment(self, key) -> None:
        added = False
        for row, i in zip(self.rows, self._indexes(key)):
            if row[i] < 15:
                row[i] += 1
                added = True
        if added:
            self.additions += 1
            if self.additions >= self.sample_size:
                self.reset()

    def frequency(self, key) -> int:
        return min(row[i] for row, i in zip(self.rows, self._indexes(key)))

    def reset(self) -> None:
        odd = 0
        for row in self.rows:
            for i, v in enumerate(row):
                odd += v & 1
                row[i] = v >> 1
        self.additions = max(0, self.additions - (odd >> 2)) >> 1
