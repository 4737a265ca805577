"""``encache size``: the store's total size — human-readable on a terminal, raw bytes when
piped (like ``uv cache size``); ``--by model|lora`` for a breakdown. The data is built by
:func:`encache.connectors.store.ops.report.build_size`; this module renders it."""

from __future__ import annotations

from typing import Annotated

import typer

from encache.cli.options import ByOpt, JsonOpt, StoreOpt


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
        from encache.connectors.store.ops.report import build_size

        with opened(store) as st, no_gc():
            url = display_url(store, st)
            with progress("Scanning", quiet=json_) as tick:
                data = build_size(st, url, by.value if by else None, tick)
        if json_:
            emit_json(data)
        else:
            render(data, is_tty() if human is None else human)
        partial_exit(data["unreachable"], "this total")
