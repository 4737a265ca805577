"""The CLI's one output path: Rich tables for people (stdout), JSON for machines (stdout),
progress bars, notes and confirmation prompts on stderr. Commands build plain data first
and hand it to one renderer per format; no command writes to stdout/stderr, draws a
progress bar or asks a question any other way (``list`` and ``stats`` still have a few
of their own, to be moved here; ``precompute`` draws its phases with
:class:`PhaseProgress` and dumps ``--json`` with ``emit_json(data, indent=2, ascii=True)``).

Rich is imported lazily (only when a table or a progress bar is drawn), so ``--json``
and ``-q`` paths start fast.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence


#: width used for tables when stdout is not a terminal (pipes, files, cron mail):
#: wide enough that identifiers are never cut
PIPE_WIDTH = 250


def is_tty(stream=None) -> bool:
    stream = sys.stdout if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def out_console():
    from rich.console import Console

    tty = is_tty(sys.stdout)
    return Console(file=sys.stdout, highlight=False, soft_wrap=False,
                   width=None if tty else PIPE_WIDTH, emoji=False)


def err_console():
    from rich.console import Console

    return Console(file=sys.stderr, stderr=True, highlight=False, emoji=False)


# -- plain text ----------------------------------------------------------------------

def note(message: str) -> None:
    """A log line for people: stderr, never mixed into data on stdout."""
    print(message, file=sys.stderr, flush=True)


def partial_note(unreachable: Sequence[dict], what: str) -> None:
    """Say on stderr which parts of the store a command's walk could not reach
    (``unreachable``: a report's field, a Redis Cluster's dead primaries): their entries
    are missing from ``what`` it printed."""
    for p in unreachable:
        note(f"Partial: {p['part']} did not answer ({p['error']}); its entries are not in "
             f"{what}.")


def partial_exit(unreachable: Sequence[dict], what: str, *, quiet: bool = False) -> None:
    """After a command printed what it found: if its walk could not reach every part of
    the store, :func:`partial_note` (unless ``quiet``) and exit 3, so a script knows the
    output is incomplete. Nothing when the walk was complete."""
    if not unreachable:
        return
    import typer

    from encache.cli.errors import EXIT_PARTIAL

    if not quiet:
        partial_note(unreachable, what)
    raise typer.Exit(EXIT_PARTIAL)


def emit(line: str = "") -> None:
    print(line, file=sys.stdout)


def json_text(obj, *, compact: bool = False, indent: int | None = None,
              ascii: bool = False) -> str:
    """The JSON encoding every command uses (no NaN; UTF-8 unless ``ascii``;
    ``compact``: no spaces, for a value pasted into a command line)."""
    return json.dumps(obj, ensure_ascii=ascii, allow_nan=False, indent=indent,
                      separators=(",", ":") if compact else None)


def emit_json(obj, *, compact: bool = False, indent: int | None = None,
              ascii: bool = False) -> None:
    """One JSON document on stdout (``--json`` results)."""
    sys.stdout.write(json_text(obj, compact=compact, indent=indent, ascii=ascii))
    sys.stdout.write("\n")
    sys.stdout.flush()


# -- questions -----------------------------------------------------------------------

def can_prompt() -> bool:
    """A person can answer a question: stdin is a terminal."""
    return is_tty(sys.stdin)


def confirm(question: str, *, refusal: str, declined: str, hint: str | None = None) -> None:
    """Ask ``question`` on stderr (default: no). Raises the exit-6 error ``refusal`` (with
    ``hint``) when no person can answer, ``declined`` when the answer is no or the prompt
    is left with Ctrl-D / Ctrl-C."""
    import typer

    from encache.cli import errors

    if not can_prompt():
        raise errors.EncacheError(refusal, errors.EXIT_ABORTED, hint=hint)
    try:
        answer = typer.confirm(question, default=False, err=True)
    except typer.Abort:  # Ctrl-D / Ctrl-C at the prompt: declined too, not Typer's exit 1
        note("")  # the error line starts on a line of its own, not after the prompt
        answer = False
    if not answer:
        raise errors.EncacheError(declined, errors.EXIT_ABORTED)


# -- human formats (bytes: encache.connectors.store.units.human_bytes) -------------------

def human_ago(t: float | None, now: float | None = None) -> str:
    """``1.7e9`` -> ``"3d ago"`` (``"-"`` when unknown)."""
    if t is None:
        return "-"
    d = (time.time() if now is None else now) - t
    if d < 0:
        return "in the future"
    if d < 60:
        return f"{int(d)}s ago"
    for unit, n in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60)):
        if d >= n:
            return f"{int(d // n)}{unit} ago"
    return "-"  # pragma: no cover


def human_time(t: float | None) -> str:
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def human_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def shape_str(shape: Sequence[int] | None) -> str:
    return "-" if shape is None else "×".join(str(s) for s in shape) or "scalar"


def or_dash(x) -> str:
    return "-" if x is None or x == "" else str(x)


# -- tables --------------------------------------------------------------------------

def table(columns: Sequence[str | tuple[str, dict]], rows: Sequence[Sequence[str]],
          title: str | None = None, caption: str | None = None):
    """A Rich table; a column is ``"Name"`` or ``("Name", {column kwargs})``. Column
    names ending in ``>`` are right-aligned (numbers). Cells, title and caption are
    printed literally (:func:`literal`): they hold data (identifiers, models, paths)."""
    from rich import box
    from rich.table import Table

    t = Table(title=literal(title, "table.title"), caption=literal(caption, "table.caption"),
              box=box.SIMPLE_HEAD, title_justify="left", caption_justify="left",
              pad_edge=False)
    for c in columns:
        name, kw = (c, {}) if isinstance(c, str) else c
        if name.endswith(">"):
            name, kw = name[:-1], {"justify": "right", **kw}
        t.add_column(name, **kw)
    for r in rows:
        t.add_row(*(literal(cell) for cell in r))
    return t


def literal(text, style: str = ""):
    """``text`` as a Rich ``Text`` in ``style`` (printed as is: ``[bold]`` or ``[/]`` in an
    identifier or a file name is neither a style nor a markup error); anything else
    (None, a renderable) unchanged."""
    if not isinstance(text, str):
        return text
    from rich.text import Text

    return Text(text, style=style)


#: above this many rows a table is drawn as plain aligned text: Rich lays out every cell
#: (~1 ms a row), which would take minutes for a 100,000-entry listing
RICH_MAX_ROWS = 1000


def print_table(columns: Sequence[str | tuple[str, dict]], rows: Sequence[Sequence[str]],
                title: str | None = None, caption: str | None = None) -> None:
    """A table on stdout: Rich for normal sizes, the same layout as plain text for huge
    ones (same columns, same alignment, no wrapping)."""
    if len(rows) <= RICH_MAX_ROWS:
        print_renderables(table(columns, rows, title=title, caption=caption))
        return
    names, right = [], []
    for c in columns:
        name = c if isinstance(c, str) else c[0]
        right.append(name.endswith(">") or (not isinstance(c, str)
                                            and c[1].get("justify") == "right"))
        names.append(name[:-1] if name.endswith(">") else name)
    widths = [len(n) for n in names]
    for r in rows:
        for i, cell in enumerate(r):
            if len(cell) > widths[i]:
                widths[i] = len(cell)

    def line(cells) -> str:
        return " " + "   ".join(c.rjust(w) if ra else c.ljust(w)
                                 for c, w, ra in zip(cells, widths, right)).rstrip()

    out = []
    if title:
        out.append(title)
    out += [line(names), " " + "─" * (sum(widths) + 3 * (len(widths) - 1))]
    out += [line(r) for r in rows]
    if caption:
        out += ["", caption]
    sys.stdout.write("\n".join(out) + "\n")


def print_renderables(*items) -> None:
    con = out_console()
    for item in items:
        con.print(item)


# -- progress (stderr, only on a terminal) ------------------------------------------

@contextlib.contextmanager
def progress(label: str, total: int | None = None, *, quiet: bool = False,
             unit: str = "entries") -> Iterator[Callable[[int], None]]:
    """Yield ``update(done)``. Draws on stderr only when it is a terminal; never starts a
    thread (safe around ``fork``), redraws at most 10 times a second."""
    if quiet or not is_tty(sys.stderr):
        yield lambda done: None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                               TextColumn, TimeElapsedColumn)

    cols = [SpinnerColumn(), TextColumn("{task.description}")]
    if total is not None:
        cols += [BarColumn(), MofNCompleteColumn()]
    else:
        cols += [TextColumn("{task.completed:,} " + unit)]
    cols.append(TimeElapsedColumn())
    bar = Progress(*cols, console=err_console(), auto_refresh=False, transient=True)
    task = bar.add_task(label, total=total)
    last = 0.0

    def update(done: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= 0.1:
            last = now
            bar.update(task, completed=done)
            bar.refresh()

    with bar:
        bar.refresh()
        yield update


class PhaseProgress:
    """Draws a job's :class:`encache.jobs.progress.Progress` (``start(phase, total)`` /
    ``advance(n, failed=, phase=)``: precompute's hashing, starting engine, encoding;
    warm's hashing, copying, reading). Drawn with Rich on stderr; silent when ``quiet`` or (with
    ``terminal_only``) when stderr is not a terminal. ``transient``: each phase replaces
    the last and the bar disappears at the end (else every phase's bar stays);
    ``show_failures``: print ``failed …`` lines as ``advance(failed=…)`` reports them.
    (precompute uses ``PhaseProgress(quiet, width=15, transient=False,
    show_failures=True, terminal_only=False)``.)"""

    def __init__(self, quiet: bool = False, *, width: int = 16, transient: bool = True,
                 show_failures: bool = False, terminal_only: bool = True):
        self.bar = None
        self.task = None
        self.tasks: dict[str, object] = {}  # phase -> its bar's task
        self.transient = transient
        self.show_failures = show_failures
        if quiet or (terminal_only and not is_tty(sys.stderr)):
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn)
        self.console = err_console()
        self.bar = Progress(TextColumn("{task.description:>%d}" % width), BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), console=self.console,
                            transient=transient)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def start(self, phase: str, total: int | None) -> None:
        if self.bar is not None:
            if self.task is not None and self.transient:
                self.bar.remove_task(self.task)
                self.tasks = {p: t for p, t in self.tasks.items() if t != self.task}
            self.task = self.bar.add_task(phase, total=total)
            self.tasks[phase] = self.task

    def advance(self, n: int, failed: str | None = None, phase: str | None = None) -> None:
        """Advance ``phase``'s bar (phases may overlap: precompute hashes on a thread
        while it encodes), else the phase started last."""
        task = self.task if phase is None else self.tasks.get(phase)
        if self.bar is not None and task is not None:
            try:
                self.bar.advance(task, n)
            except KeyError:  # a transient bar removed by the phase that followed
                return
            if failed and self.show_failures:
                from rich.text import Text  # the path is data: printed as is

                self.console.print(Text.assemble(("failed", "yellow"), " ", failed))
