"""Why a consumer misses: the engine's model id is not one the store's entries were made for.

What: :class:`MissDiagnosis` learns, in a background thread, which model id strings the
store's entries were written for (their ``model`` header field, from a bounded header
scan, refreshed every few minutes). When this engine's model id is not among them, every
"absent" miss is counted as a *model id mismatch* (``misses_model``) and one actionable
line is logged per interval, naming both strings and what to change, e.g.::

    encache: 12 misses for model '.models/tiny-llava' but the store /srv/encache holds
    entries for '/abs/.models/tiny-llava' (the same model directory): identifiers hash the
    model id string exactly as given to --model; serve with --model '/abs/.models/tiny-llava'
    or precompute with --model '.models/tiny-llava'

Why: vLLM's identifiers hash the model id string as given, so a consumer started with a
relative path (or a hub id) for a model precomputed by absolute path computes other
identifiers and misses everything; from the identifier alone it cannot tell. The store
knows which model ids its entries were written for. Encoder-config and LoRA-digest
mismatches are found per entry by the lookup (its warnings name both sides); this
module covers the case where no entry is ever found.

Pure Python, no vLLM: the connector feeds it.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ..ratelimit import RateLimitedLog

__all__ = ["MissDiagnosis", "same_model", "MISS_REASONS"]

log = logging.getLogger("encache.connector")

#: the reasons ``encache stats`` breaks misses down by (counter ``misses_<reason>``)
MISS_REASONS = ("absent", "model", "config", "lora_stale", "corrupt", "newer_format")
SCAN_LIMIT = 5000  # headers read to learn the store's model ids (a sample of a big store)
REFRESH_S = 300.0


def _resolved(model: str) -> str | None:
    path = os.path.expanduser(model)
    return os.path.realpath(path) if os.path.exists(path) else None


def same_model(a: str, b: str) -> bool:
    """Two model id strings naming the same local model (one path resolves to the other)."""
    ra, rb = _resolved(a), _resolved(b)
    return ra is not None and ra == rb


class MissDiagnosis:
    def __init__(self, store, model_id: str, interval_s: float = 60.0):
        self.store = store
        self.model_id = model_id
        self.warn = RateLimitedLog(log, interval_s)
        self._lock = threading.Lock()
        self._models: set[str] | None = None  # model ids the store's entries were made for
        self._learned_at = 0.0
        self._learning = False
        self._misses = 0  # model-mismatch misses since the last line
        self._same: list[str] = []  # stored model ids resolving to this engine's model

    # -- what the store holds ----------------------------------------------------
    def _learn(self) -> None:
        models: set[str] = set()
        try:
            for n, info in enumerate(self.store.scan()):
                if info.model:
                    models.add(info.model)
                if n >= SCAN_LIMIT:
                    break
        except Exception:  # store down: try again at the next refresh
            models = None
        # resolved here, off the scheduler's path: stored ids naming this engine's model
        same = sorted(m for m in models if same_model(m, self.model_id)) if models else []
        with self._lock:
            if models is not None:
                self._models = models
                self._same = same
            self._learned_at = time.monotonic()
            self._learning = False

    def _maybe_learn(self) -> None:
        with self._lock:
            if self._learning or (self._learned_at and
                                  time.monotonic() - self._learned_at < REFRESH_S):
                return
            self._learning = True
        threading.Thread(target=self._learn, name="encache-diagnosis", daemon=True).start()

    def start(self) -> None:
        self._maybe_learn()

    def wait(self, timeout: float = 10.0) -> None:  # tests
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._learned_at and not self._learning:
                    return
            time.sleep(0.02)

    def model_mismatch(self) -> list[str] | None:
        """The store's model ids when this engine's is not among them (else None)."""
        self._maybe_learn()
        with self._lock:
            models = self._models
        if not models or self.model_id in models:
            return None
        return sorted(models)

    # -- per miss --------------------------------------------------------------------
    def classify(self, reason: str) -> str:
        """Refine an ``absent`` miss: ``model`` when the store holds entries for other
        model ids only (and log the actionable line, at most once per interval)."""
        if reason != "absent":
            return reason
        stored = self.model_mismatch()
        if stored is None:
            return reason
        with self._lock:
            self._misses += 1
            n = self._misses
            same = self._same
        if same:
            hint = (f"(the same model directory): identifiers hash the model id string "
                    f"exactly as given to --model; serve with --model {same[0]!r} or "
                    f"precompute with --model {self.model_id!r}")
            shown = repr(same[0])
        else:
            shown = ", ".join(repr(m) for m in stored[:3]) + (" …" if len(stored) > 3 else "")
            hint = ("and none for this one: precompute with --model "
                    f"{self.model_id!r}, or serve the model the store was built for")
        if self.warn.warning("model", "encache: %d misses for model %r but the store %s "
                             "holds entries for %s %s", n, self.model_id, self.store.url,
                             shown, hint):
            with self._lock:
                self._misses = 0
        return "model"
