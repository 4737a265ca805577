"""Helpers shared by the management commands (no vLLM, no torch)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator

from encache.cli.errors import EXIT_LOCKED, EXIT_USAGE, EncacheError


@contextlib.contextmanager
def opened(url: str, *, create: bool = False) -> Iterator:
    """Open the store ``url`` names; management commands never create one by accident
    (a typo'd path is an error, exit 7, not a new empty store)."""
    from encache.connectors.store import open_store

    store = open_store(url, create=create)
    try:
        yield store
    finally:
        store.close()


#: objects a command leaves to the end of the process (:func:`keep_to_exit`); a list
#: only while the console script runs a command (:func:`keep_to_exit_in`)
_KEPT: list | None = None


def keep_to_exit(obj) -> None:
    """Leave ``obj`` (a million entries a command printed) to the end of the process:
    freeing two million small objects one by one costs about a second, and the process
    is about to exit. The console script then ends it at once, its output flushed
    (``os._exit``: no interpreter teardown). Elsewhere (a test's ``CliRunner``, a library
    caller) ``obj`` is freed as usual."""
    if _KEPT is not None:
        _KEPT.append(obj)


def keep_to_exit_in(command) -> tuple[object, bool]:
    """Run ``command()`` letting it :func:`keep_to_exit`: ``(its result, whether it kept
    anything)``."""
    global _KEPT
    _KEPT = []
    try:
        return command(), bool(_KEPT)
    finally:
        if not _KEPT:
            _KEPT = None


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector around a big scan.

    A 100,000-entry scan allocates a few hundred thousand small objects and no cycles;
    the collector would re-traverse them again and again (about 10 % of the CPU time).
    """
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def display_url(url: str, store=None) -> str:
    """The store URL safe to print (password redacted; disk paths made absolute)."""
    from encache.connectors.store import redact

    if store is not None and store.supports_entry_path:
        return str(store.url)
    return redact(url)


def make_filter(*, lora=None, model=None, older_than=None):
    from encache.connectors.store.ops.scanning import EntryFilter

    return EntryFilter(lora=lora, model=model, older_than=older_than)


def usage(message: str, hint: str | None = None) -> EncacheError:
    return EncacheError(message, EXIT_USAGE, hint)


def quiet_engine_start() -> None:
    """Before a command starts a vLLM engine: keep vLLM's start-up chatter (its INFO logs,
    and the deprecation warnings its import draws from torch) off the terminal, unless
    ``ENCACHE_DEBUG`` is set. Errors still reach the user as encache's one-line message."""
    if os.environ.get("ENCACHE_DEBUG"):
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"vllm(\.|$)")


@contextlib.contextmanager
def quiet_when_locked(quiet: bool) -> Iterator[None]:
    """Another run holds the store's lock (an overlapping cron run: a first fill still
    going when ``*/15`` starts the next): with ``--quiet`` exit 5 printing nothing -- cron
    mails any output, and the run holding the lock does the work; without it the usual
    one-line error and exit 5."""
    from encache.connectors.store.base import LockBusy

    try:
        yield
    except LockBusy:
        if not quiet:
            raise
        import typer
        raise typer.Exit(EXIT_LOCKED) from None
