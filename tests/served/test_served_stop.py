"""Counters survive a server stop with its defaults.

``python -m vllm.entrypoints.openai.api_server`` stops its engine-core process with
SIGKILL (``--shutdown-timeout 0``): nothing at exit runs there. The connector counts in a
per-process mapped file, so the hits served right before a plain ``SIGTERM`` to the server
are in ``encache stats`` afterwards — with the connector's default settings (no
``counters_flush_s``), and with the engine process gone and its file folded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from engine_support import PRECOMPUTE_KW
from served_support import start_server

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def stats_json(store: str) -> dict:
    from typer.testing import CliRunner

    from encache.cli.app import app
    r = CliRunner().invoke(app, ["stats", "--store", store, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _serve_then_sigterm(model: str, config: dict, files, root: Path) -> None:
    server = start_server(model, config, root).wait_ready()
    try:
        for path in files:
            assert server.chat(path)["choices"][0]["message"]["content"] is not None
        # stop it at once, as systemd/docker/Ctrl-C do: SIGTERM to the server process only;
        # the server then SIGKILLs its engine core (--shutdown-timeout 0)
        os.kill(server.proc.pid, signal.SIGTERM)
        server.proc.wait(60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.proc.pid, signal.SIGKILL)  # anything left of the group
        server.stop()
    time.sleep(0.5)


def test_hits_survive_sigterm_to_the_server(tiny_model, tmp_path):
    """... and a restarted server trusts what the first one checksummed (the store's log
    of versions verified this boot): its loads hash nothing."""
    import shutil

    from encache.connectors.vllm import transfer_config
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from demo_corpus import make_corpus

    files = make_corpus(str(tmp_path / "corpus"), pages=4, seed=5)
    store = str(tmp_path / "store")
    summary = precompute_corpus(str(tmp_path / "corpus"), PrecomputeOptions(
        model=tiny_model, store=store, **PRECOMPUTE_KW))
    assert summary.encoded == 4
    # as after a reboot: the precompute's record of what it wrote is gone
    shutil.rmtree(Path(store, ".encache", "verified"))
    config = transfer_config(store, "ec_consumer", {})  # the defaults users run
    _serve_then_sigterm(tiny_model, config, files, tmp_path)
    s = stats_json(store)
    assert (s["hits"], s["misses"]) == (4, 0), s
    assert s["bytes_loaded"] > 0 and s["load_seconds"] > 0
    assert s["checksums"] >= 4 and s["checksums_skipped"] == 0, s
    # the engine process is gone: its counter file was folded into the totals (what is
    # left is this test process's own, from the in-process precompute)
    left = list(Path(store, ".encache", "counters").glob("*.cnt"))
    assert all(f"-{os.getpid()}-" in p.name for p in left), left

    _serve_then_sigterm(tiny_model, config, files, tmp_path)
    again = stats_json(store)
    assert (again["hits"], again["misses"]) == (8, 0), again
    assert again["checksums"] == s["checksums"], "the restarted server hashed entries again"
    assert again["checksums_skipped"] >= 4, again
