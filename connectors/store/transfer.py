"""Where the copy and page-cache warming primitives were documented to live: they are in
:mod:`.ops.transfer` (this name stays for callers of the documented API)."""

from .ops.transfer import TransferAborted, copy_entries, warm_page_cache  # noqa: F401
