"""Pacing a full walk of a store so it takes at most a share of the time.

A consumer's index listing, the store's usage for metrics, ``--over-capacity skip`` and
the disk store's capacity total each walk every entry: cheap on a small store, seconds on
a million entries. :class:`ScanThrottle` tells when such a walk may run again.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ScanThrottle:
    """When a full walk of a store may run again: once at least ``1 / share`` times its
    last duration has passed since it ended (so walking takes at most ``share`` of the
    time), and no sooner than ``min_interval`` seconds. The walks it paces (a consumer's
    index listing, the store's usage for metrics, ``--over-capacity skip`` and the disk
    store's capacity total) cost a ``stat`` per entry: milliseconds on a small store,
    which is then walked every time it is asked, seconds on a million entries."""

    def __init__(self, share: float = 0.05, min_interval: float = 0.0):
        self.share = share
        self.min_interval = min_interval
        self.ended = 0.0  # when the last walk ended (monotonic)
        self.cost = 0.0  # how long it took
        #: how many walks ran (tests, benchmarks)
        self.walks = 0

    def due(self) -> bool:
        """No walk yet, or enough time has passed since the last one."""
        return not self.walks or (time.monotonic() - self.ended
                                  >= max(self.min_interval, self.cost / self.share))

    def run(self, walk: Callable[[], object]):
        """``walk()``, timed; returns what it returns."""
        t0 = time.monotonic()
        result = walk()
        self.ended = time.monotonic()
        self.cost = self.ended - t0
        self.walks += 1
        return result
