"""The disk backend: one safetensors file per entry under a directory (``store.py``:
:class:`DiskStore`), with what only it uses: its change journal (``journal.py``), the
header index behind O(1) ``stats`` (``header_index.py``), the wake-ups of readers waiting
for a write (``inotify.py``) and the recently-written list (``recent.py``)."""

from .store import DiskStore

__all__ = ["DiskStore"]
