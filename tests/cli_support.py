"""Shared helpers for the CLI tests: a populated real disk store and a CliRunner wrapper.

(The ``store`` fixture, a :func:`populated` store, is in ``tests/cli/conftest.py``.)

(A ``test_cli_*`` module so it sits with the CLI tests; it defines no tests itself.)
"""

from __future__ import annotations

import os
import time

import numpy as np
from typer.testing import CliRunner

from encache.cli.app import app
from encache.connectors.store.disk.store import ENTRY_FILE, DiskStore
from entries import put_entry, rewrite_header
from store_contract import blob

H = [f"{i:064x}" for i in range(1, 10)]  # plain identifiers (hex hashes)
DAY = 86400.0
OLD = 10 * DAY


def invoke(*args, env: dict | None = None, input: str | None = None):
    """Run ``encache ARGS`` in-process; stdout and stderr are captured separately."""
    env = {"ENCACHE_STORE": None, "ENCACHE_DEBUG": None, **(env or {})}
    return CliRunner().invoke(app, [str(a) for a in args], env=env, input=input)


def put_legacy(root, ident: str) -> None:
    """An entry as vLLM's ECExampleConnector writes it (plain safetensors, no metadata)."""
    import safetensors.numpy

    (root / ident).mkdir()
    safetensors.numpy.save_file({"ec_cache": np.zeros((16, 4), np.float32)},
                                str(root / ident / ENTRY_FILE))


def make_old(store, ident: str, age: float = OLD) -> None:
    """Backdate an entry's file times (its metadata ``created`` is set at encode time)."""
    t = time.time() - age
    os.utime(store.entry_path(ident), (t, t))


def populated(root, *, legacy: bool = True) -> DiskStore:
    """A store with a known mix:

    * H[0..2]        model "m", sizes differ (n = 64, 32, 16 rows)
    * ad1:H[3], ad1:H[4]  LoRA "ad1" by identifier prefix
    * H[5]           model "other"
    * H[6]           plain identifier whose metadata names LoRA "ad1"
    * H[7]           old: created and last used 10 days ago
    * H[8]           legacy (no metadata), if ``legacy``
    """
    s = DiskStore(root)
    now = time.time()
    put_entry(s, H[0], 64, 0)
    put_entry(s, H[1], 32, 1)
    put_entry(s, H[2], 16, 2)
    put_entry(s, "ad1:" + H[3], 64, 3)
    put_entry(s, "ad1:" + H[4], 64, 4)
    put_entry(s, H[5], 64, 5, model="other")
    put_entry(s, H[6], 64, 6, lora="ad1")
    put_entry(s, H[7], 64, 7, created=now - OLD)
    make_old(s, H[7])
    if legacy:
        put_legacy(s.root, H[8])
    return s


ALL_IDS = {H[0], H[1], H[2], "ad1:" + H[3], "ad1:" + H[4], H[5], H[6], H[7], H[8]}


def file_sizes(store) -> dict[str, int]:
    return {e.identifier: e.size for e in store.scan()}


def one_line_error(result) -> str:
    """The stderr of a failed command: exactly one line, ``Error: …``, no traceback."""
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


__all__ = ["ALL_IDS", "DAY", "H", "OLD", "blob", "file_sizes", "invoke", "make_old",
           "one_line_error", "populated", "put_legacy", "rewrite_header"]
