"""``encache stats``: what is in a store and how well it serves (``ccache -s`` style).

Contents (entries, bytes, used / max, by model, by LoRA, legacy and unreadable entries,
entries written by a newer encache)
come from a header-only scan; the consumer counters (hits, misses, load time…) are the
ones serving engines record in the store. ``--reset-counters`` prints the statistics,
then zeroes the counters (so a cron job can log and reset in one step). The data is
built by :func:`encache.connectors.store.ops.report.build_stats`; this module renders it.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from encache.cli.options import MAX_JOBS, JsonOpt, LocalTierOpt, StoreOpt

#: how a table names the reasons misses are broken down by (report.MISS_REASONS)
REASON_LABELS = {"absent": "absent", "model": "model id mismatch", "config": "config mismatch",
                 "lora_stale": "LoRA stale", "corrupt": "corrupt",
                 "newer_format": "written by a newer encache",
                 "binding": "other inputs (client uuid)"}


_BYTES_KEYS = ("used_memory", "maxmemory")


def backend_rows(info: dict) -> list[tuple[str, str]]:
    """Backend specifics (filesystem free space; Redis memory, policy, warnings…)."""
    from encache.connectors.store.units import human_bytes

    rows = []
    for key, value in info.items():
        if value is None or value == "" or value == []:
            continue
        label = key.replace("_", " ").capitalize()
        if key == "filesystem_free_bytes":
            rows.append(("Filesystem free", human_bytes(value)))
        elif key.endswith("_bytes") or key in _BYTES_KEYS:
            try:
                rows.append((label, human_bytes(int(value))))
            except (TypeError, ValueError):
                rows.append((label, str(value)))
        elif isinstance(value, (list, tuple)):
            rows += [(label if i == 0 else "", _node_row(v) if isinstance(v, dict) else str(v))
                     for i, v in enumerate(value)]
        elif isinstance(value, dict):
            rows.append((label, ", ".join(f"{k}={v}" for k, v in value.items())))
        else:
            rows.append((label, f"{value:,}" if isinstance(value, int) else str(value)))
    return rows


def _reasons(s: dict) -> str:
    parts = [f"{REASON_LABELS[r]} {n:,}" for r, n in s["misses_by_reason"].items() if n]
    return f" ({', '.join(parts)})" if parts else ""


def _node_row(node: dict) -> str:
    """One cluster primary: ``host:port  used / maxmemory (policy), N keys, R replicas``."""
    from encache.connectors.store.units import human_bytes

    def b(v):
        return "-" if v is None else human_bytes(int(v))
    if node.get("reachable") is False:
        return f"{node.get('node')}  unreachable ({node.get('error')})"
    limit = b(node.get("maxmemory")) if node.get("maxmemory") else "unbounded"
    return (f"{node.get('node')}  {b(node.get('used_memory'))} / {limit} "
            f"({node.get('maxmemory_policy') or '?'}), {node.get('keys', '?')} keys, "
            f"{node.get('replicas', '?')} replicas")


def render_table(s: dict) -> None:
    from encache.cli.render import (human_ago, human_duration, human_pct, human_time, or_dash,
                                    print_renderables, table)
    from encache.connectors.store.units import human_bytes

    used = human_bytes(s["bytes"])
    if s["max_bytes"]:
        used += f" / {human_bytes(s['max_bytes'])} ({human_pct(s['used_ratio'])})"
    else:
        used += " (no capacity set)"
    rows = [
        ("Store", f"{s['store']} ({s['backend']})"),
        ("Entries", f"{s['entries']:,}"),
        ("Used", used),
    ]
    rows += backend_rows(s["backend_info"])
    rows += [
        ("Legacy entries", f"{s['legacy_entries']:,} ({human_bytes(s['legacy_bytes'])}),"
                           " no metadata or checksum" if s["legacy_entries"] else "0"),
        ("Unreadable entries", f"{s['unreadable_entries']:,} ({human_bytes(s['unreadable_bytes'])})"
                               " — run `encache verify`" if s["unreadable_entries"] else "0"),
        *([("Newer-format entries", f"{s['newer_format_entries']:,} "
                                    f"({human_bytes(s['newer_format_bytes'])}), written by a "
                                    "newer encache: kept, not served by this one")]
          if s["newer_format_entries"] else []),
        ("Oldest / newest", f"{human_time(s['oldest_created'])} / {human_time(s['newest_created'])}"
                            if s["entries"] else "-"),
    ]
    removed = s.get("removed_by_policy") or {}
    if any(removed.values()):
        rows.append(("Removed by policy", f"{sum(removed.values()):,} ("
                     + ", ".join(f"{r} {n:,}" for r, n in removed.items() if n)
                     + "), not re-encoded by a refresh (precompute --refill-removed)"))
    contents = table(["", ""], rows, title="Contents")
    contents.show_header = False

    lookups = s["hits"] + s["misses"]
    crow = [
        ("Hits", f"{s['hits']:,}"),
        ("Misses", f"{s['misses']:,}" + _reasons(s)),
        ("Hit ratio", human_pct(s["hit_ratio"]) + (f" of {lookups:,} lookups" if lookups else "")),
        *([("Hits by tier", f"local {s['hits_local']:,} "
                             f"({human_pct(s['hits_local'] / (s['hits_local'] + s['hits_remote']))})"
                             f", remote {s['hits_remote']:,}")]
          if s["hits_local"] or s["hits_remote"] else []),
        ("Mean load time", human_duration(s["mean_load_seconds"])),
        ("Loaded", human_bytes(s["bytes_loaded"])),
        ("Load errors", f"{s['load_errors']:,}"),
        ("Config mismatches", f"{s['config_mismatches']:,}"),
        *([("Stale LoRA loads", f"{s['lora_stale']:,}")] if s["lora_stale"] else []),
        *([("Entries refused: other inputs", f"{s['binding_mismatches']:,}")]
          if s["binding_mismatches"] else []),
        ("Checksums run / skipped", f"{s['checksums']:,} / {s['checksums_skipped']:,}"
                                    + (" (verified or encoded on this host this boot)"
                                       if s["checksums_skipped"] else "")),
        ("Saves", f"{s['saves']:,} ({human_bytes(s['bytes_saved'])})"),
        ("Save errors", f"{s['save_errors']:,}"),
        *([("Saves late (EPD)", f"{s['save_timeouts']:,}")] if s["save_timeouts"] else []),
        *([("Saved again from the encoder cache (EPD)", f"{s['resaves']:,}")]
          if s["resaves"] else []),
        *([("Loaded while being written (EPD)", f"{s['in_flight_loads']:,}" + (
            f" (waited {human_duration(s['mean_in_flight_wait_seconds'])} each on average)"
            if s["in_flight_wait_seconds"] else ""))]  # (engines before it timed nothing)
          if s["in_flight_loads"] else []),
        *([("Requests failed, entry not delivered (EPD)", f"{s['unavailable']:,} ("
            + ", ".join(f"{r} {n:,}" for r, n in s["unavailable_by_reason"].items() if n) + ")")]
          if s["unavailable"] else []),
        ("Evictions", f"{s['evictions']:,}"),
        ("Counters updated", human_ago(s["counters_updated"]) if s["counters_updated"] else "never"),
    ]
    if s["counters_unavailable"]:
        crow = [("Unavailable", s["counters_unavailable"])]
    counters = table(["", ""], crow, title="Consumer counters")
    counters.show_header = False

    def breakdown(title: str, key: str, none_label: str, empty_label: str | None = None):
        total = s["bytes"] or 1
        rows = [(none_label if g["name"] is None
                 else empty_label if g["name"] == "" and empty_label else or_dash(g["name"]),
                 f"{g['entries']:,}", human_bytes(g["bytes"]), human_pct(g["bytes"] / total))
                for g in s[key]]
        return table([title, "Entries>", "Size>", "Share>"], rows)

    items = [contents]
    if s["entries"]:
        items += [breakdown("Model", "by_model", "(unknown)"),
                  breakdown("LoRA", "by_lora", "(none)")]
        if s["stale_lora"]:
            items.append(breakdown("Stale LoRA (older adapter)", "stale_lora", "(none)"))
        if any(g["name"] for g in s["by_encoder_config"]):  # more than the default config
            items.append(breakdown("Encoder config", "by_encoder_config", "(unreadable)",
                                   "(default)"))
    items.append(counters)
    tier = s.get("local_tier")
    if tier:
        tused = human_bytes(tier["bytes"]) + (f" / {human_bytes(tier['max_bytes'])}"
                                              if tier["max_bytes"] else " (no capacity set)")
        trows = [("Path", tier["path"]), ("Entries", f"{tier['entries']:,}"), ("Used", tused),
                 ("Last sync", human_ago(tier["last_sync"]) if tier["last_sync"] else "never")]
        if not tier["same_store"]:
            trows.append(("Synced with", f"{tier['synced_with']} (another store!)"))
        ttable = table(["", ""], trows, title="Local tier (this node)")
        ttable.show_header = False
        items.append(ttable)
    print_renderables(*items)


def register(app: typer.Typer) -> None:
    @app.command("stats")
    def stats(
        store: StoreOpt,
        json_: JsonOpt = False,
        reset_counters: Annotated[bool, typer.Option(
            "--reset-counters", help="After printing, zero the consumer counters.")] = False,
        workers: Annotated[Optional[int], typer.Option(
            "--workers", "-j", min=1, max=MAX_JOBS, metavar="N",
            help=f"Processes for the header scan, at most {MAX_JOBS} (default: 1, or one per "
                 "idle CPU when 4+ are idle and the store is big).")] = None,
        quiet: Annotated[bool, typer.Option(
            "--quiet", "-q", help="No progress or notes on stderr.")] = False,
        local_tier: LocalTierOpt = None,
    ) -> None:
        """Entry count, bytes (used / max), by model and LoRA, legacy entries, and the
        hits / misses / load times recorded by serving engines."""
        from encache.cli.common import display_url, no_gc, opened
        from encache.cli.render import emit_json, note, partial_exit, progress
        from encache.connectors.store.ops.report import build_stats
        from encache.connectors.store.ops.scanning import default_workers

        with opened(store) as st, no_gc():
            url = display_url(store, st)
            n = default_workers() if workers is None else workers
            with progress("Scanning", quiet=quiet or json_) as tick:
                data = build_stats(st, url, workers=n, open_url=store, progress=tick,
                                   local_tier=local_tier)
            if json_:
                emit_json(data)
            else:
                render_table(data)
            if reset_counters:
                st.reset_counters()
                if not (json_ or quiet):
                    note("Counters reset.")
        partial_exit(data["unreachable"], "these statistics", quiet=quiet)
