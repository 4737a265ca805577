"""``encache size``: the store's total size — human-readable on a terminal, raw bytes when
piped (like ``uv cache size``); ``--by model|lora`` for a breakdown."""

from __future__ import annotations

from typing import Annotated

import typer

from encache.cli.options import ByOpt, JsonOpt, StoreOpt


def build_size(store, url: str, by: str | None = None, progress=None) -> dict:
    """``{"store", "bytes", "unreachable"[, "entries", "by", "groups"]}`` (raw bytes;
    ``unreachable``: parts of the store that did not answer, the figures being the
    others')."""
    from encache.connectors.store.ops.scanning import parts_dicts, summarize

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


def render(data: dict, human: bool) -> None:
    from encache.cli.render import emit, print_renderables, table
    from encache.connectors.store.units import human_bytes

    fmt = human_bytes if human else str
    if "groups" not in data:
        emit(fmt(data["bytes"]))
        return
    none_label = "(unknown)" if data["by"] == "model" else "(none)"
    if not human:  # tab-separated, for scripts: name, entries, bytes
        for g in data["groups"]:
            name = none_label if g["name"] is None else g["name"]
            emit(f"{name}\t{g['entries']}\t{g['bytes']}")
        return
    rows = [(none_label if g["name"] is None else g["name"], f"{g['entries']:,}",
             human_bytes(g["bytes"])) for g in data["groups"]]
    rows.append(("Total", f"{data['entries']:,}", human_bytes(data["bytes"])))
    t = table([data["by"].capitalize() if data["by"] == "model" else "LoRA", "Entries>",
               "Size>"], rows)
    if len(t.rows) > 1:
        t.rows[-2].end_section = True  # a rule above the total
    print_renderables(t)


def register(app: typer.Typer) -> None:
    @app.command("size")
    def size(
        store: StoreOpt,
        by: ByOpt = None,
        human: Annotated[bool | None, typer.Option(
            "--human/--raw", "-H",
            help="Human-readable sizes (default on a terminal) or raw bytes (default "
                 "when piped).", show_default=False)] = None,
        json_: JsonOpt = False,
    ) -> None:
        """Total size of the store (raw bytes when piped); --by model|lora to break down."""
        from encache.cli.common import display_url, no_gc, opened
        from encache.cli.render import emit_json, is_tty, partial_exit, progress

        with opened(store) as st, no_gc():
            url = display_url(store, st)
            with progress("Scanning", quiet=json_) as tick:
                data = build_size(st, url, by.value if by else None, tick)
        if json_:
            emit_json(data)
        else:
            render(data, is_tty() if human is None else human)
        partial_exit(data["unreachable"], "this total")
