"""``encache list``: one row per entry (identifier, LoRA, model, shape, dtype, size,
created, last access), filtered and sorted; ``-q`` prints identifiers only. The entries
are built by :func:`encache.connectors.store.ops.report.build_list`; this module renders
them (a table, or ``--json`` written from a template: :func:`json_document`)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from encache.connectors.store.keys import split_lora  # light: pure Python, no I/O
from encache.connectors.store.ops.report import build_list, parse_sort
from encache.cli.options import (JsonOpt, LimitOpt, LoraOpt, ModelOpt, OlderThanOpt,
                                 StoreOpt)


def _check_sort(value: str | None) -> str | None:
    if value is not None:
        try:
            parse_sort(value)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    return value


SortOpt = Annotated[Optional[str], typer.Option(
    "--sort", metavar="KEY[:asc|desc]", callback=_check_sort,
    help="Sort by size, created, accessed (newest/biggest first) or identifier.")]


def render_json(url: str, entries: list, unreachable: list[dict]) -> None:
    """:func:`json_document` and a newline, written as it is rendered (a few thousand
    records at a time): a million entries' 335 MB of JSON are never held whole, and the
    reader gets the first records at once."""
    import itertools
    import sys

    write = sys.stdout.write
    write(_head(url, entries, unreachable))
    records, sep = _records(entries), ""
    while True:
        chunk = list(itertools.islice(records, 4096))
        if not chunk:
            break
        write(sep + ", ".join(chunk))
        sep = ", "
    write("]}\n")
    sys.stdout.flush()


def json_document(url: str, entries: list, unreachable: list[dict] = ()) -> str:
    """``json_text({"store", "count", "bytes", "unreachable", "entries":
    entry_dicts(entries)})``, the same text byte for byte, written record by record from
    a template instead of through 100,000 dicts and the generic encoder: ~3x less CPU for
    ``list --json`` at scale (tests/cli/test_cli_list.py checks the equality).
    ``unreachable``: the parts of the store not listed (``parts_dicts``)."""
    return _head(url, entries, unreachable) + ", ".join(_records(entries)) + "]}"


def _head(url: str, entries: list, unreachable) -> str:
    """The document up to its first record: ``{"store": …, "entries": [``."""
    from encache.cli.render import json_text

    head = json_text({"store": url, "count": len(entries), "bytes": sum(e.size for e in entries),
                      "unreachable": list(unreachable), "entries": []})
    return head[:-2]


_RECORD = '{"identifier": %s, %s, "size": %s, "created": %s, "accessed": %s, %s, "error": %s}'
_MIDDLE = '"lora": %s, "model": %s, "shape": %s, "dtype": %s'
_TAIL = '"legacy": %s, "vllm_version": %s, "hash_algo": %s'


def _records(entries):
    from json.encoder import encode_basestring  # the C encoder's, as json.dumps uses

    from encache.cli.render import json_text

    def enc(v):  # one value as json.dumps writes it (raises on NaN like json.dumps)
        if v is None:
            return "null"
        if type(v) is str:
            return encode_basestring(v)
        if type(v) is tuple and all(type(x) is int for x in v):
            return "[" + ", ".join(map(str, v)) + "]"
        return json_text(list(v) if type(v) is tuple else v)

    def num(v):
        if type(v) is float and v - v == 0.0:  # finite: float.__repr__, as json.dumps
            return repr(v)
        return "null" if v is None else enc(v)

    # the record's fields that many entries share (LoRA, model, shape, dtype, legacy,
    # versions) are rendered once per distinct combination
    parts: dict = {}
    for e in entries:
        m, ident = e.meta, e.identifier
        lora = m.lora if m is not None and m.lora else (
            split_lora(ident)[0] if ":" in ident else None)
        if m is not None:
            key = (lora, m.model, m.shape, m.dtype, m.legacy, m.vllm_version, m.hash_algo)
        else:
            key = (lora, None, None, None, False, None, None)
        both = parts.get(key)
        if both is None:
            both = (_MIDDLE % (enc(key[0]), enc(key[1]), enc(key[2]), enc(key[3])),
                    _TAIL % ("true" if key[4] else "false", enc(key[5]), enc(key[6])))
            if len(parts) < 65536:
                parts[key] = both
        c, a, size = e.created, e.accessed, e.size
        yield _RECORD % (
            encode_basestring(ident), both[0], str(size) if type(size) is int else enc(size),
            repr(c) if type(c) is float and c - c == 0.0 else num(c),
            repr(a) if type(a) is float and a - a == 0.0 else num(a),
            both[1], "null" if e.error is None else enc(e.error))


def render_table(url: str, entries: list, filtered: str, found: int | None = None) -> None:
    """``found``: how many entries matched before ``--limit`` (the caption says "of")."""
    import time

    from encache.cli.render import human_ago, note, or_dash, print_table, shape_str
    from encache.connectors.store.units import human_bytes

    if not entries:
        note(f"No entries ({filtered}) in {url}.")
        return
    now = time.time()
    problems = any(e.error for e in entries)
    cols = [("Identifier", {"overflow": "fold", "min_width": 16}), "LoRA", "Model",
            "Shape", "Dtype", "Size>", "Created", "Accessed"]
    if problems:
        cols.append("Problem")
    rows = []
    for e in entries:
        m = e.meta
        row = [e.identifier, or_dash(e.lora), or_dash(m.model if m else None) +
               (" (legacy)" if m is not None and m.legacy else ""),
               shape_str(m.shape) if m else "-", m.dtype if m else "-",
               human_bytes(e.size), human_ago(e.created, now), human_ago(e.accessed, now)]
        if problems:
            row.append(e.error or "")
        rows.append(row)
    total = sum(e.size for e in entries)
    caption = f"{len(entries):,} entries, {human_bytes(total)}"
    if found is not None and found > len(entries):
        caption = f"{len(entries):,} of {found:,} entries (--limit), {human_bytes(total)}"
    print_table(cols, rows, caption=caption)


def register(app: typer.Typer) -> None:
    @app.command("list")
    def list_entries(
        store: StoreOpt,
        lora: LoraOpt = None,
        model: ModelOpt = None,
        older_than: OlderThanOpt = None,
        sort: SortOpt = None,
        limit: LimitOpt = None,
        quiet: Annotated[bool, typer.Option(
            "--quiet", "-q", help="Identifiers only, one per line.")] = False,
        json_: JsonOpt = False,
    ) -> None:
        """List entries: identifier, LoRA, model, shape, dtype, size, created, accessed."""
        from encache.cli.common import (display_url, keep_to_exit, make_filter, no_gc,
                                        opened, usage)
        from encache.cli.render import partial_exit, progress
        from encache.connectors.store.ops.scanning import parts_dicts

        if quiet and json_:  # two output formats: which one was meant is a guess
            raise usage("-q and --json cannot be combined",
                        hint="-q: identifiers, one per line; --json: full records")
        flt = make_filter(lora=lora, model=model, older_than=older_than)
        unreachable: list = []
        with no_gc():  # the rendering too: 100,000 records, no cycles to collect
            with opened(store) as st:
                url = display_url(store, st)
                with progress("Scanning", quiet=quiet or json_) as tick:
                    entries = build_list(st, flt, parse_sort(sort) if sort else None, tick,
                                         unreachable)
            keep_to_exit(entries)
            found = len(entries)
            if limit is not None:
                entries = entries[:limit]
            if quiet:
                import sys

                sys.stdout.write("".join(e.identifier + "\n" for e in entries))
            elif json_:
                render_json(url, entries, parts_dicts(unreachable))
            else:
                render_table(url, entries, flt.describe(), found=found)
        partial_exit(parts_dicts(unreachable), "this list")

