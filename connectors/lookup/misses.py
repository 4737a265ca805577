"""Why an item was a miss, and which entries to skip for a while.

An entry that was found but could not be used — corrupt, produced under another encoder
config, a stale LoRA adapter's, written by a newer encache (``newer_format``), or
rejected by the engine (wrong token count) — is
skipped for ``REJECT_S`` (a miss without another read), and its reason is remembered so
the connector can count ``misses_<reason>``. Anything else is ``absent`` (the connector's
:class:`~encache.connectors.vllm.diagnosis.MissDiagnosis` refines that further).
"""

from __future__ import annotations

import threading
import time

REJECT_S = 60.0  # an unusable entry is retried after this long
REASONS_MAX = 100_000  # remembered reasons; cleared wholesale when exceeded


class MissReasons:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rejected: dict[str, float] = {}  # identifier -> expiry
        self._reasons: dict[str, str] = {}  # identifier -> why it was last a miss

    def reject(self, identifier: str, reason: str) -> None:
        """Skip ``identifier`` for ``REJECT_S``: it was found but is unusable (``reason``:
        ``corrupt``, ``config``, ``lora_stale``, ``newer_format``)."""
        with self._lock:
            self._rejected[identifier] = time.monotonic() + REJECT_S
            if len(self._reasons) > REASONS_MAX:
                self._reasons.clear()
            self._reasons[identifier] = reason

    def is_rejected(self, identifier: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self._rejected.get(identifier, 0) > now  # one dict read: atomic under the GIL

    def reason(self, identifier: str) -> str:
        """Why ``identifier`` was a miss: ``config``, ``lora_stale``, ``corrupt``,
        ``newer_format`` (an entry was found but not usable), else ``absent``."""
        with self._lock:
            if self._rejected.get(identifier, 0) > time.monotonic():
                return self._reasons.get(identifier, "corrupt")
        return "absent"
