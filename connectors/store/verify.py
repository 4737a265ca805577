"""Where ``verify_store`` and its repairs were documented to live: they are in
:mod:`.ops.verify` (this name stays for callers of the documented API)."""

from .ops.verify import DEFAULT_GRACE, repair_plan, repair_store, verify_store  # noqa: F401
