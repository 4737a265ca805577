"""The one progress protocol of the jobs: an object with phases.

What: a job reports progress to a :class:`Progress` -- ``start(phase, total)`` when a phase
begins (``total`` None: not known yet), ``advance(n, failed=None, phase=None)`` as items
finish (``failed``: the item that failed, for a caller that lists failures; ``phase``:
which bar, where phases overlap, as precompute hashes on a thread while it encodes).
Why one: precompute, warm and the Ray stage report through the same object, so a caller
draws every job one way (the CLI: :class:`encache.cli.render.PhaseProgress`) and a
library user passes one object or nothing (:data:`NO_PROGRESS`). Beneath the jobs, the
store's own operations (scan, verify, copy) report through plain callbacks (the store
imports nothing above it); the jobs turn those into this protocol.
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """What a job reports its progress to (see the module)."""

    def start(self, phase: str, total: int | None) -> None:
        """A phase begins with ``total`` items (None: not known yet)."""

    def advance(self, n: int, failed: str | None = None, phase: str | None = None) -> None:
        """``n`` more items of ``phase`` (None: the phase started last) are done."""


class _NoProgress:
    """Reports nowhere."""

    def start(self, phase: str, total: int | None) -> None:
        pass

    def advance(self, n: int, failed: str | None = None, phase: str | None = None) -> None:
        pass


#: the progress of a caller that draws none
NO_PROGRESS: Progress = _NoProgress()

