"""What a tiered store (:mod:`.tiered`) answers from its shared store: membership,
listing, stats, notes, removal records, counters, locks. The shared store is the truth;
the node's tier only holds copies of its entries, so these questions go past the tier.
"""

from __future__ import annotations

from collections.abc import Iterator

from .base import EntryInfo


class SharedStoreAnswers:
    """A tiered store's answers that are the shared store's (``self.remote``)."""

    # -- the shared store answers the rest ---------------------------------------------
    def contains(self, identifier: str) -> bool:
        return self.remote.contains(identifier)

    def identifiers(self, *, unreachable: list | None = None,
                    hint: bool = False) -> Iterator[str]:
        return self.remote.identifiers(unreachable=unreachable, hint=hint)

    def scan(self, *, unreachable: list | None = None) -> Iterator[EntryInfo]:
        return self.remote.scan(unreachable=unreachable)

    def stat(self, identifier: str) -> EntryInfo | None:
        return self.remote.stat(identifier)

    def index_version(self):
        return self.remote.index_version()

    def used_bytes(self) -> int:
        return self.remote.used_bytes()

    def count(self, *, unreachable: list | None = None) -> int:
        return self.remote.count(unreachable=unreachable)

    def ping(self) -> float:
        return self.remote.ping()

    def failure_domain(self, identifier: str) -> str | None:
        return self.remote.failure_domain(identifier)  # (the tier's copies: holds_locally)

    def probe_domain(self, domain: str) -> None:
        self.remote.probe_domain(domain)

    def capacity_warnings(self) -> list[str]:
        return self.remote.capacity_warnings()

    def summary_if_unchanged(self, stat_entries: bool = True):
        return self.remote.summary_if_unchanged(stat_entries)

    def put_note(self, name: str, text: str, ttl: float = 600.0) -> str:
        return self.remote.put_note(name, text, ttl)

    def get_note(self, name: str) -> str | None:
        return self.remote.get_note(name)

    def delete_note(self, name: str) -> None:
        self.remote.delete_note(name)

    def stray_files(self, older_than: float = 0.0):
        return self.remote.stray_files(older_than)

    def prune(self) -> int:
        return self.remote.prune()

    def live_counters(self):
        return self.remote.live_counters()

    def verified_log(self):
        return self.tier.verified_log()  # local copies' versions (remote reads have none)

    def record_removals(self, identifiers, reason: str) -> None:
        self.remote.record_removals(identifiers, reason)

    def removals(self) -> dict[str, str]:
        return self.remote.removals()

    def forget_removals(self, identifiers) -> None:
        self.remote.forget_removals(identifiers)

    def removal_counts(self) -> dict[str, int]:
        return self.remote.removal_counts()

    def add_counters(self, deltas: dict[str, float]) -> None:
        self.remote.add_counters(deltas)

    def read_counters(self) -> dict[str, float]:
        return self.remote.read_counters()

    def reset_counters(self) -> None:
        self.remote.reset_counters()

    def lock(self, name: str, wait: float = 0.0):
        return self.remote.lock(name, wait)
