"""The CLI's exit codes, all of them: scripts and cron jobs branch on them, so they are
part of the interface (docs/cli.md lists them).

The codes a job's :class:`~encache.jobs.errors.EncacheError` carries (usage, store,
engine, cluster) are defined with it, in the library, and named here too, so this module
is the one table a caller reads.
"""

from __future__ import annotations

from encache.jobs.errors import (EXIT_CLUSTER, EXIT_ENGINE, EXIT_STORE, EXIT_USAGE,
                                 NO_VLLM_HINT, EncacheError)

EXIT_OK = 0
EXIT_ERROR = 1  # unexpected failure (a bug: rerun with ENCACHE_DEBUG=1)
# EXIT_USAGE = 2: bad arguments or input (also Typer's own usage errors)
EXIT_PARTIAL = 3  # ran to the end, but some items failed (precompute, warm)
EXIT_PROBLEMS = 4  # verify found problems
EXIT_LOCKED = 5  # another process holds the store's lock
EXIT_ABORTED = 6  # a confirmation was declined or impossible (no TTY, no --yes)
# EXIT_STORE = 7: the store is unreachable, missing or unwritable
# EXIT_ENGINE = 8: the vLLM engine could not start
# EXIT_CLUSTER = 9: Ray is not installed, or the Ray cluster is unreachable
EXIT_NEWER = 10  # verify found no problem, but entries written by a newer encache (left alone)

__all__ = ["EXIT_ABORTED", "EXIT_CLUSTER", "EXIT_ENGINE", "EXIT_ERROR", "EXIT_LOCKED",
           "EXIT_NEWER", "EXIT_OK", "EXIT_PARTIAL", "EXIT_PROBLEMS", "EXIT_STORE",
           "EXIT_USAGE", "NO_VLLM_HINT", "EncacheError"]
