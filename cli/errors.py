"""The exit codes and :class:`EncacheError`, for the CLI modules (defined in
:mod:`encache.connectors.errors`, where the jobs raise them without importing the CLI)."""

from ..connectors.errors import *  # noqa: F401,F403
from ..connectors.errors import EncacheError  # noqa: F401
