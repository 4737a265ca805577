"""Counts and bytes over a set of entries (:class:`Summary`), mergeable so shards can be
summarised in parallel; what ``stats`` and ``size`` report and what the disk store's
header index keeps. Over :class:`~.base.EntryInfo` only, on every backend."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .base import EntryInfo
from .entry import NEWER_FORMAT
from .keys import split_lora


@dataclass
class Group:
    entries: int = 0
    bytes: int = 0

    def to_dict(self) -> dict:
        return {"entries": self.entries, "bytes": self.bytes}


@dataclass
class Summary:
    """Counts and bytes over a set of entries; mergeable (parallel shards)."""

    entries: int = 0
    bytes: int = 0
    legacy: int = 0
    legacy_bytes: int = 0
    unreadable: int = 0
    unreadable_bytes: int = 0
    #: entries written by a newer encache (a format this build does not read): not
    #: counted as unreadable
    newer: int = 0
    newer_bytes: int = 0
    oldest: float | None = None  # earliest creation
    newest: float | None = None  # latest creation
    last_access: float | None = None
    by_model: dict[str | None, Group] = field(default_factory=dict)
    by_lora: dict[str | None, Group] = field(default_factory=dict)
    #: encoder-config digest ("" = default) -> group; None for unreadable headers
    by_encoder_config: dict[str | None, Group] = field(default_factory=dict)
    #: (LoRA name, adapter digest) -> [entries, bytes, newest creation]: stale-LoRA view
    lora_digests: dict[tuple[str, str], list] = field(default_factory=dict)

    def add(self, e: EntryInfo) -> None:
        size = e.size
        self.entries += 1
        self.bytes += size
        if e.error == NEWER_FORMAT:
            self.newer += 1
            self.newer_bytes += size
        elif e.error is not None:
            self.unreadable += 1
            self.unreadable_bytes += size
        elif e.meta is not None and e.meta.legacy:
            self.legacy += 1
            self.legacy_bytes += size
        c = e.created
        if c is not None:
            if self.oldest is None or c < self.oldest:
                self.oldest = c
            if self.newest is None or c > self.newest:
                self.newest = c
        a = e.accessed
        if a is not None and (self.last_access is None or a > self.last_access):
            self.last_access = a
        meta = e.meta
        lora = meta.lora if meta is not None and meta.lora else split_lora(e.identifier)[0]
        for groups, key in ((self.by_model, meta.model if meta is not None else None),
                            (self.by_lora, lora),
                            (self.by_encoder_config,
                             meta.encoder_config if meta is not None else None)):
            g = groups.get(key)
            if g is None:
                g = groups[key] = Group()
            g.entries += 1
            g.bytes += size
        if meta is not None and meta.lora_digest and e.lora:
            d = self.lora_digests.setdefault((e.lora, meta.lora_digest), [0, 0, 0.0])
            d[0] += 1
            d[1] += size
            d[2] = max(d[2], c or 0.0)

    def stale_lora(self) -> dict[str, Group]:
        """LoRA name -> entries stamped with an adapter digest other than the newest one
        written under that name (a retrained adapter's predecessors)."""
        from .lora_stamp import newest_of

        out: dict[str, Group] = {}
        current = newest_of(self.lora_digests)
        for (name, digest), (n, size, _) in self.lora_digests.items():
            if digest != current[name]:
                g = out.setdefault(name, Group())
                g.entries += n
                g.bytes += size
        return out

    def to_state(self) -> dict:
        """Plain builtins (for the disk store's header index)."""
        state = {k: getattr(self, k) for k in ("entries", "bytes", "legacy", "legacy_bytes",
                                                "unreadable", "unreadable_bytes", "newer",
                                                "newer_bytes", "oldest", "newest",
                                                "last_access")}
        for name in ("by_model", "by_lora", "by_encoder_config"):
            state[name] = {k: (g.entries, g.bytes) for k, g in getattr(self, name).items()}
        return state

    @classmethod
    def from_state(cls, state: dict) -> Summary:
        groups = {name: {k: Group(*v) for k, v in state[name].items()}
                  for name in ("by_model", "by_lora", "by_encoder_config")}
        plain = {k: v for k, v in state.items() if k not in groups}
        return cls(**plain, **groups)

    def merge(self, other: Summary) -> Summary:
        self.entries += other.entries
        self.bytes += other.bytes
        self.legacy += other.legacy
        self.legacy_bytes += other.legacy_bytes
        self.unreadable += other.unreadable
        self.unreadable_bytes += other.unreadable_bytes
        self.newer += other.newer
        self.newer_bytes += other.newer_bytes
        for name in ("oldest", "last_access", "newest"):
            a, b = getattr(self, name), getattr(other, name)
            if b is not None:
                pick = min if name == "oldest" else max
                setattr(self, name, b if a is None else pick(a, b))
        for mine, theirs in ((self.by_model, other.by_model), (self.by_lora, other.by_lora),
                             (self.by_encoder_config, other.by_encoder_config)):
            for k, g in theirs.items():
                m = mine.setdefault(k, Group())
                m.entries += g.entries
                m.bytes += g.bytes
        for k, (n, size, newest) in other.lora_digests.items():
            d = self.lora_digests.setdefault(k, [0, 0, 0.0])
            d[0] += n
            d[1] += size
            d[2] = max(d[2], newest)
        return self


def summarize_entries(entries: Iterable[EntryInfo]) -> Summary:
    s = Summary()
    for e in entries:
        s.add(e)
    return s
