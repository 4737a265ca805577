"""Read-only stores and full disks, on real mounts (the tests run as root).

* A store synced without its ``.encache/`` (or filled by vLLM's ECExampleConnector) and
  mounted read-only: a consumer engine starts and serves hits; ``list``, ``stats``,
  ``size``, ``verify`` and ``hash`` work; nothing is written.
* A small tmpfs that fills up during ``encache precompute``: one clear error line, exit
  7, no partial entry; after space is freed, a rerun completes.

Skipped, with the reason, only where ``mount`` is not permitted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from engine_support import PRECOMPUTE_KW

pytestmark = pytest.mark.engine


def _mount(*args: str) -> None:
    r = subprocess.run(["mount", *args], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount not permitted here ({' '.join(args)}): {r.stderr.strip()}")


def _umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture(params=["without-meta-dir", "with-meta-dir"])
def readonly_store(request, tiny_model, tmp_path):
    """A precomputed store bind-mounted read-only: synced without its .encache/ (the case
    that used to kill the engine), and as it was written."""
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from demo_corpus import make_corpus

    files = make_corpus(str(tmp_path / "corpus"), pages=3, seed=21)
    src = tmp_path / "src"
    summary = precompute_corpus(str(tmp_path / "corpus"), PrecomputeOptions(
        model=tiny_model, store=str(src), **PRECOMPUTE_KW))
    assert summary.encoded == 3
    if request.param == "without-meta-dir":
        shutil.rmtree(src / ".encache")  # synced without dot-directories
    meta_before = sorted(p.name for p in (src / ".encache").rglob("*")) \
        if (src / ".encache").exists() else None
    ro = tmp_path / "ro"
    ro.mkdir()
    _mount("--bind", str(src), str(ro))
    try:
        _mount("-o", "remount,bind,ro", str(ro))
        with pytest.raises(OSError):
            (ro / "probe").write_text("x")
        yield {"store": str(ro), "files": files, "model": tiny_model, "meta": meta_before}
    finally:
        _umount(ro)


def test_consumer_on_readonly_store_without_meta_dir_serves_hits(readonly_store):
    from engine_support import EncoderCounter, chat_texts, consumer_config, make_llm, shutdown

    counter = EncoderCounter()
    llm = make_llm(readonly_store["model"], consumer_config(readonly_store["store"]))
    try:
        counter.reset()
        chat_texts(llm, readonly_store["files"])
        assert counter.items == 0, "entries on a read-only store must be loaded, not encoded"
    finally:
        shutdown(llm)
    _unchanged(readonly_store)


def _unchanged(ro: dict) -> None:
    meta = Path(ro["store"]) / ".encache"
    now = sorted(p.name for p in meta.rglob("*")) if meta.exists() else None
    assert now == ro["meta"]


def test_read_only_cli_commands_on_readonly_store(readonly_store):
    from typer.testing import CliRunner

    from encache.cli.app import app
    store = readonly_store["store"]
    run = CliRunner().invoke
    for args in (["list"], ["stats"], ["size"], ["verify"]):
        r = run(app, [*args, "--store", store, "--json"])
        assert r.exit_code == 0, (args, r.output)
    s = json.loads(run(app, ["stats", "--store", store, "--json"]).stdout)
    assert s["entries"] == 3 and s["hits"] == 0
    r = run(app, ["hash", readonly_store["files"][0], "--model", readonly_store["model"],
                  "--store", store, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["files"][0]["in_store"] is True, r.stdout
    _unchanged(readonly_store)


def test_precompute_into_a_full_tmpfs(tiny_model, tmp_path):
    from demo_corpus import make_corpus

    from encache.connectors.store import open_store
    make_corpus(str(tmp_path / "corpus"), pages=12, seed=3)
    mnt = tmp_path / "small"
    mnt.mkdir()
    _mount("-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt))
    try:
        store = mnt / "store"
        # leave room for a few entries only: the disk fills up mid-run
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            try:
                f.write(b"\0" * (300 << 10))
            except OSError:
                pass
        os.truncate(filler, max(0, filler.stat().st_size - (48 << 10)))
        cmd = [str(Path(os.sys.executable).parent / "encache"), "precompute",
               str(tmp_path / "corpus"), "--model", tiny_model, "--store", str(store),
               "--max-model-len", "256", "--dtype", "float32", "--quiet",
               "--engine-arg", "enforce_eager=true", "--engine-arg", "max_num_seqs=4",
               "--engine-arg", "max_num_batched_tokens=256"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 7, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and "No space left on device" in errors[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr
        st = open_store(str(store))
        kept = list(st.identifiers())
        assert 0 < len(kept) < 12
        assert not st.stray_files()  # no partial entry or temp file left behind
        for ident in kept:  # every entry that is there is whole
            from encache.connectors.store.entry import decode
            decode(st.get(ident), identifier=ident)
        filler.unlink()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
        assert len(list(open_store(str(store)).identifiers())) == 12
    finally:
        _umount(mnt)
