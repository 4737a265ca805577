"""``encache connector-config``: the exact ``--ec-transfer-config`` JSON for ``vllm serve``.

Users should never hand-write this: a typo in a key silently disables the cache.
The JSON goes to stdout (so ``--ec-transfer-config "$(encache connector-config …)"``
works); a ready-to-paste command line goes to stderr.
"""

from __future__ import annotations

import shlex
import sys
from typing import Annotated

import typer

from .errors import EXIT_USAGE, EncacheError
from ..connectors.vllm import transfer_config
from .options import (LocalTierMaxOpt, LocalTierOpt, StoreOpt, TagOpt, not_empty,
                      not_negative, parse_size)

def register(app: typer.Typer) -> None:
    @app.command("connector-config")
    def connector_config(
        store: StoreOpt,
        role: Annotated[str, typer.Option(help="ec_consumer | ec_producer | ec_both")] = "ec_consumer",
        max_bytes: Annotated[int | None, typer.Option(
            metavar="SIZE", parser=parse_size,
            help="Disk capacity the connector enforces (bytes, or 500M, 50G…).")] = None,
        load_timeout_s: Annotated[float | None, typer.Option(
            callback=not_negative,
            help="Max seconds a request waits for a load before re-encoding.")] = None,
        load_mode: Annotated[str | None, typer.Option(help="Disk loads: auto (map files on local filesystems) | mmap | read.")] = None,
        verify: Annotated[str | None, typer.Option(help="Checksums: once (each stored version; default) | always | off.")] = None,
        model: Annotated[str | None, typer.Option(
            "--model", "-m", callback=not_empty,
            help="Print a full vllm serve command for this model (stderr).")] = None,
        tag: TagOpt = None,
        local_tier: LocalTierOpt = None,
        local_tier_max_bytes: LocalTierMaxOpt = None,
    ) -> None:
        """Print the --ec-transfer-config JSON that points vLLM at this store."""
        from ..connectors.store import check_url

        check_url(store)  # (a store that need not exist yet: nothing is opened)
        extra = {}
        if local_tier_max_bytes is not None and not local_tier:
            raise EncacheError("--local-tier-max-bytes needs --local-tier DIR", EXIT_USAGE)
        if local_tier and role == "ec_producer":
            raise EncacheError("--local-tier holds copies of the entries a consumer loads; an "
                               "ec_producer (encode-only) loads none: leave it out",
                               EXIT_USAGE)
        if local_tier:
            import os
            extra["local_tier"] = os.path.abspath(os.path.expanduser(local_tier))
            if local_tier_max_bytes is not None:
                extra["local_tier_max_bytes"] = local_tier_max_bytes
        if load_mode is not None:
            from ..connectors.store.disk.store import LOAD_MODES
            if load_mode not in LOAD_MODES:
                raise EncacheError(f"--load-mode must be one of {', '.join(LOAD_MODES)}", EXIT_USAGE)
            extra["load_mode"] = load_mode
        if verify is not None:
            if verify not in ("once", "always", "off"):
                raise EncacheError("--verify must be one of once, always, off", EXIT_USAGE)
            extra["verify"] = verify  # the connector parses these words (lookup.parse_verify)
        if max_bytes is not None:
            extra["max_bytes"] = max_bytes
        if load_timeout_s is not None:
            extra["load_timeout_s"] = load_timeout_s
        if tag:
            extra["tag"] = tag
        try:
            cfg = transfer_config(store, role, extra)
        except ValueError as e:  # a role it does not take
            raise EncacheError(str(e), EXIT_USAGE) from None
        from .render import emit, is_tty, json_text, note

        text = json_text(cfg, compact=True, ascii=True)
        emit(text)
        if model or is_tty(sys.stderr):  # asked for with -m; else a hint on a terminal
            cmd = ["python", "-m", "vllm.entrypoints.openai.api_server",
                   "--model", model or "MODEL", "--ec-transfer-config", text]
            note("# serve with:\n" + shlex.join(cmd))
