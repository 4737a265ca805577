"""The data of ``encache list``, ``stats`` and ``size``, built over any store: JSON-ready
dicts and sorted entries (raw bytes, epoch seconds) that the CLI only renders, and that
scripts and benchmarks call as they are.

* ``list``: :func:`build_list` (the entries, filtered and sorted: :func:`parse_sort`),
  :func:`entry_dict` (one entry's JSON record);
* ``stats``: :func:`build_stats` (contents from a header scan, the consumer counters
  engines keep in the store, a node's local tier: :func:`tier_stats`);
* ``size``: :func:`build_size` (O(1) on an unchanged disk store, else a header scan).
"""

from __future__ import annotations

from ..keys import split_lora  # light: pure Python, no I/O

#: sort keys and their default direction (True = descending: biggest / newest first)
SORT_KEYS = {"identifier": False, "size": True, "created": True, "accessed": True}


def parse_sort(value: str) -> tuple[str, bool]:
    """``"size"`` / ``"created:asc"`` -> ``(key, descending)``."""
    key, _, direction = value.lower().partition(":")
    if key == "name":
        key = "identifier"
    if key not in SORT_KEYS:
        raise ValueError(f"unknown sort key {key!r} (use {', '.join(SORT_KEYS)}; "
                         "append :asc or :desc to set the order)")
    if direction not in ("", "asc", "desc"):
        raise ValueError(f"unknown sort order {direction!r} (use asc or desc)")
    return key, (SORT_KEYS[key] if not direction else direction == "desc")


def entry_dict(e) -> dict:
    """The JSON record of one entry (raw bytes, epoch seconds)."""
    m = e.meta
    return {
        "identifier": e.identifier,
        # EntryInfo.lora, without its per-call import (100,000 calls for a big store)
        "lora": m.lora if m is not None and m.lora else split_lora(e.identifier)[0],
        "model": m.model if m else None,
        "shape": list(m.shape) if m else None,
        "dtype": m.dtype if m else None,
        "size": e.size,
        "created": e.created,
        "accessed": e.accessed,
        "legacy": bool(m is not None and m.legacy),
        "vllm_version": m.vllm_version if m else None,
        "hash_algo": m.hash_algo if m else None,
        "error": e.error,
    }


def build_list(store, flt=None, sort: tuple[str, bool] | None = None,
               progress=None, unreachable: list | None = None) -> list:
    """The entries to show, filtered and sorted (EntryInfo objects); the command cuts
    them to ``--limit`` itself, to say how many matched. ``unreachable``: a list for the
    parts of the store that did not answer (then the others' entries are listed)."""
    from operator import attrgetter

    from .scanning import scan

    entries = list(scan(store, flt if flt is not None and flt.active else None, progress,
                        unreachable))
    key, desc = sort or ("identifier", False)
    if key == "identifier":
        entries.sort(key=attrgetter("identifier"), reverse=desc)
    else:
        # unknown values (None) always last, whatever the direction
        known = [e for e in entries if getattr(e, key) is not None]
        unknown = [e for e in entries if getattr(e, key) is None]
        known.sort(key=lambda e: (getattr(e, key), e.identifier), reverse=desc)
        entries = known + sorted(unknown, key=lambda e: e.identifier)
    return entries


def entry_dicts(entries) -> list[dict]:
    return [entry_dict(e) for e in entries]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


#: the reasons misses are broken down by (see encache.connectors.vllm.diagnosis)
MISS_REASONS = ("absent", "model", "config", "lora_stale", "corrupt", "newer_format",
                "binding")


def tier_stats(path: str, shared_url: str) -> dict:
    """A node's local tier (``--local-tier DIR``): what it holds and when it last synced
    with the shared store (its note; ``connectors/store/tiered.py``)."""
    from .. import open_store
    from ..tiered import sync_state

    tier = open_store(path, create=False)
    try:
        state = sync_state(tier) or {}
        remote = state.get("remote", "").rsplit("#", 1)[0] or None
        return {"path": str(tier.root), "entries": tier.count(), "bytes": tier.used_bytes(),
                "max_bytes": tier.max_bytes, "last_sync": state.get("synced"),
                "synced_with": remote,
                "same_store": remote is None or remote == shared_url}
    finally:
        tier.close()


def build_stats(store, url: str, *, workers: int = 1, open_url: str | None = None,
                progress=None, local_tier: str | None = None) -> dict:
    """The ``stats`` data (JSON-ready: raw bytes, epoch seconds). Parts of the store that
    do not answer (a Redis Cluster's dead primary) are listed in ``unreachable`` and the
    figures are the other parts'; counters kept on such a part are ``counters_unavailable``
    (why) and read as zero."""
    from ..base import StoreError
    from .scanning import parts_dicts, summarize

    unreachable: list = []
    summary = summarize(store, url=open_url, workers=workers, progress=progress,
                        unreachable=unreachable)
    info = store.info()
    counters, counters_unavailable = {}, None
    try:
        counters = store.read_counters()
    except StoreError as e:
        if e.domain is None:  # (the store as a whole: the command fails)
            raise
        counters_unavailable = f"{e.domain}: {e.reason}"
        if all(part != e.domain for part, _ in unreachable):
            unreachable.append((e.domain, e.reason))

    try:  # entries a policy removed that a refresh leaves out (store/removals.py)
        removed = store.removal_counts() if store.supports_removal_records else None
    except StoreError:  # (kept on a part that did not answer: the rest is reported)
        removed = None

    def c(name: str) -> float:
        v = counters.get(name, 0) or 0
        return int(v) if float(v).is_integer() else float(v)

    hits, misses = c("hits"), c("misses")
    lookups = hits + misses

    def groups(d: dict) -> list[dict]:
        rows = [{"name": k, **g.to_dict()} for k, g in d.items()]
        rows.sort(key=lambda r: (-r["bytes"], str(r["name"])))
        return rows

    return {
        "store": url,
        "backend": info.backend,
        # parts that did not answer: every figure is of the others
        "unreachable": parts_dicts(unreachable),
        "entries": summary.entries,
        "bytes": summary.bytes,
        "max_bytes": info.max_bytes,
        "used_ratio": _ratio(summary.bytes, info.max_bytes or 0),
        "legacy_entries": summary.legacy,
        "legacy_bytes": summary.legacy_bytes,
        "unreadable_entries": summary.unreadable,
        "unreadable_bytes": summary.unreadable_bytes,
        # entries written by a newer encache (a format this build does not read): kept
        "newer_format_entries": summary.newer,
        "newer_format_bytes": summary.newer_bytes,
        "oldest_created": summary.oldest,
        "newest_created": summary.newest,
        "last_access": summary.last_access,
        "by_model": groups(summary.by_model),
        "by_lora": groups(summary.by_lora),
        "by_encoder_config": groups(summary.by_encoder_config),
        # entries made with an older adapter under a LoRA name (`purge --lora NAME --stale`)
        "stale_lora": groups(summary.stale_lora()),
        "hits": hits,
        "misses": misses,
        "hit_ratio": _ratio(hits, lookups),
        # hits of engines with a local tier, by the tier that served them
        "hits_local": c("hits_local"),
        "hits_remote": c("hits_remote"),
        "local_tier": tier_stats(local_tier, store.url) if local_tier else None,
        "load_errors": c("load_errors"),
        "config_mismatches": c("config_mismatches"),
        "lora_stale": c("lora_stale"),
        # entries computed from other inputs than a request's (not served: docs/security.md)
        "binding_mismatches": c("binding_mismatches"),
        # consumers' digests of a request's inputs (entries under client uuids, unbound)
        "inputs_digested": c("inputs_digested"),
        # consumers' checksum passes, and first loads that skipped one (verified this boot)
        "checksums": c("checksums"),
        "checksums_skipped": c("checksums_skipped"),
        # why engines missed (counted per miss; older engines recorded no reason)
        "misses_by_reason": {r: c("misses_" + r) for r in MISS_REASONS},
        "load_seconds": c("load_seconds"),
        # load_seconds accumulates over successful loads (hits)
        "mean_load_seconds": _ratio(c("load_seconds"), hits),
        "bytes_loaded": c("bytes_loaded"),
        "saves": c("saves"),
        "save_errors": c("save_errors"),
        # encoders (EPD): writes not in the store when the request finished
        "save_timeouts": c("save_timeouts"),
        # encoders (EPD): entries written again from vLLM's encoder cache (the store lost them)
        "resaves": c("resaves"),
        # PD (EPD): loads of entries read while their write was in flight (before its commit)
        "in_flight_loads": c("in_flight_loads"),
        # ... and the time those loads took, mostly waiting for the bytes
        "in_flight_wait_seconds": c("in_flight_wait_seconds"),
        "mean_in_flight_wait_seconds": _ratio(c("in_flight_wait_seconds"),
                                              c("in_flight_loads")),
        # PD (EPD): requests failed because a metadata-only item's entry was not delivered
        "unavailable": c("unavailable"),
        "unavailable_by_reason": {r: c("unavailable_" + r)
                                  for r in ("late", "corrupt", "config", "lora_stale")},
        "bytes_saved": c("bytes_saved"),
        "evictions": c("evictions"),
        # entries a policy removed (capacity eviction, purge --older-than), by reason:
        # precompute leaves them out unless --refill-removed (None: not kept here)
        "removed_by_policy": removed,
        "counters_updated": counters.get("updated"),
        "counters_unavailable": counters_unavailable,
        "backend_info": dict(info.extra),
    }


def build_size(store, url: str, by: str | None = None, progress=None) -> dict:
    """``{"store", "bytes", "unreachable"[, "entries", "by", "groups"]}`` (raw bytes;
    ``unreachable``: parts of the store that did not answer, the figures being the
    others')."""
    from .scanning import parts_dicts, summarize

    if by is None:
        if store.supports_used_bytes:  # disk: file sizes only, no header read
            current = store.summary_if_unchanged(stat_entries=False)  # O(1) when unchanged
            used = current.bytes if current is not None else store.used_bytes()
            return {"store": url, "bytes": int(used), "unreachable": []}
    unreachable: list = []
    s = summarize(store, progress=progress, unreachable=unreachable)
    data = {"store": url, "bytes": s.bytes, "entries": s.entries,
            "unreachable": parts_dicts(unreachable)}
    if by is not None:
        groups = s.by_model if by == "model" else s.by_lora
        data["by"] = by
        data["groups"] = sorted(({"name": k, **g.to_dict()} for k, g in groups.items()),
                                key=lambda g: (-g["bytes"], str(g["name"])))
    return data
