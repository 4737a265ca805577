"""`encache precompute` as cron runs it: exit codes, lock, manifest, prune, quiet, JSON.

These runs never need the engine: the store is pre-filled with entries under the
identifiers vLLM computes for the corpus files, so precompute finds everything present.
(The engine path itself is covered by test_engine_e2e and test_served.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from encache.cli.app import app
from encache.connectors.store import encode, open_store

MODEL = "org/some-model"  # any id string: nothing is loaded when every entry is present


@pytest.fixture
def corpus(tmp_path):
    from demo_corpus import make_corpus
    make_corpus(str(tmp_path / "corpus"), pages=5, seed=3)
    return tmp_path / "corpus"


def fill(store_url, corpus, model=MODEL, encoder_config=None):
    """Put a (fake but valid) entry under each file's served identifier."""
    from encache.jobs.corpus import walk
    from encache.connectors.vllm.hashing import identify_file
    store = open_store(str(store_url))
    ids = {}
    for f in walk(corpus):
        ident = identify_file(f.path, model).identifier
        arr = np.zeros((4, 8), np.float16)
        store.put(ident, encode(ident, arr.view(np.uint8), "F16", arr.shape, model=model,
                                encoder_config=encoder_config))
        ids[f.rel] = ident
    return ids


def run(*args):
    return CliRunner().invoke(app, list(args))


def test_everything_present_no_engine_json_summary(tmp_path, corpus):
    fill(tmp_path / "s", corpus)
    r = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--json", "-q")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["files"] == 5 and data["present"] == 5 and data["encoded"] == 0
    assert data["engine_started"] is False and data["failed"] == 0
    for key in ("hashed", "from_manifest", "bytes_written", "seconds", "images_per_second", "failures"):
        assert key in data


def test_entries_of_another_encoder_config_are_not_present(tmp_path, corpus):
    from encache.connectors.encoder_config import encoder_config_digest
    fill(tmp_path / "s", corpus)  # default config (unstamped)
    args = ("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--json", "-q",
            "--dry-run")
    tagged = json.loads(run(*args, "--tag", "v2").stdout)
    assert tagged["present"] == 0 and tagged["other_config"] == 5
    assert tagged["encoder_config"] == encoder_config_digest(tag="v2")
    kw = json.loads(run(*args, "--engine-arg", 'mm_processor_kwargs={"do_normalize": false}')
                    .stdout)
    assert kw["other_config"] == 5
    assert kw["encoder_config"] == encoder_config_digest({"do_normalize": False})
    plain = json.loads(run(*args).stdout)
    assert plain["present"] == 5 and plain["other_config"] == 0 and plain["encoder_config"] == ""
    fill(tmp_path / "s", corpus, encoder_config=encoder_config_digest(tag="v2"))
    assert json.loads(run(*args, "--tag", "v2").stdout)["present"] == 5
    assert json.loads(run(*args).stdout)["other_config"] == 5


def test_a_dry_run_keeps_the_store_capacity_as_it_was(tmp_path, corpus):
    """``--dry-run --max-bytes`` wrote the capacity into the store, and the next write
    then evicted nearly every entry to honour a size the user only tried. A dry run uses
    it for its capacity note and changes nothing; a real run keeps it."""
    fill(tmp_path / "s", corpus)
    args = ("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--json",
            "-q", "--max-bytes", "1000")
    r = run(*args, "--dry-run")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["capacity"] is not None  # the corpus needs more than that
    assert open_store(str(tmp_path / "s")).max_bytes is None
    assert run(*args).exit_code == 0
    assert open_store(str(tmp_path / "s")).max_bytes == 1000


def test_manifest_skips_unchanged_files_without_reading_them(tmp_path, corpus):
    fill(tmp_path / "s", corpus)
    first = json.loads(run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--json").stdout)
    assert first["hashed"] == 5 and first["from_manifest"] == 0
    # Overwrite every file with garbage of the same size and restore its mtime: a run
    # that read or decoded any file would now report it as unreadable.
    for p in corpus.rglob("*.*"):
        st = p.stat()
        p.write_bytes(b"\0" * st.st_size)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = json.loads(run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--json").stdout)
    assert second["hashed"] == 0 and second["from_manifest"] == 5 and second["failed"] == 0
    # --no-manifest re-reads: now every file is garbage
    third = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--json", "--no-manifest")
    assert third.exit_code == 3 and json.loads(third.stdout)["failed"] == 5


def test_changed_file_is_hashed_again(tmp_path, corpus):
    fill(tmp_path / "s", corpus)
    run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--json")
    victim = sorted(corpus.rglob("*.jpg"))[0]
    victim.write_bytes(b"not an image any more")
    r = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--json")
    data = json.loads(r.stdout)
    assert r.exit_code == 3 and data["hashed"] == 1 and data["from_manifest"] == 4
    assert data["failures"][0]["path"].endswith(victim.name)
    assert "not a readable image" in data["failures"][0]["error"]


def test_broken_file_is_partial_exit_3_and_reported(tmp_path, corpus):
    fill(tmp_path / "s", corpus)
    (corpus / "broken.png").write_bytes(b"garbage")
    r = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"))
    assert r.exit_code == 3
    assert "broken.png" in r.stdout and "Traceback" not in r.output


def test_prune_missing_deletes_entries_of_removed_files(tmp_path, corpus):
    ids = fill(tmp_path / "s", corpus)
    run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"))
    gone = sorted(ids)[0]
    (corpus / gone).unlink()
    r = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--prune-missing", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["pruned"] == 1
    store = open_store(str(tmp_path / "s"))
    assert not store.contains(ids[gone])
    assert all(store.contains(i) for rel, i in ids.items() if rel != gone)


def test_quiet_prints_nothing_on_success(tmp_path, corpus):
    fill(tmp_path / "s", corpus)
    r = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--quiet")
    assert r.exit_code == 0 and r.stdout == ""


HOLDER = r"""
import sys, time
from encache.connectors.store import open_store
with open_store(sys.argv[1]).lock("precompute"):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_lock_between_two_processes(tmp_path, corpus):
    fill(tmp_path / "s", corpus)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "s"), "2"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"))
        assert busy.exit_code == 5
        assert "locked" in busy.output and "Traceback" not in busy.output
        t0 = time.monotonic()
        waited = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--wait", "30")
        assert waited.exit_code == 0 and time.monotonic() - t0 < 25
    finally:
        holder.kill()
        holder.wait()


def test_an_overlapping_cron_run_exits_5_and_with_quiet_says_nothing(tmp_path, corpus):
    """A run while another holds the store (a long first fill under */15): exit 5 at once,
    one line without --quiet, nothing at all with it (cron mails any output)."""
    fill(tmp_path / "s", corpus)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "s"), "30"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        quiet = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "-q")
        assert (quiet.exit_code, quiet.stdout, quiet.stderr) == (5, "", "")
        loud = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "-q",
                   "--json")
        assert loud.exit_code == 5 and loud.stdout == ""  # (-q wins: nothing for cron)
        loud = run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"))
        assert loud.exit_code == 5 and loud.stdout == ""
        assert len(loud.stderr.strip().splitlines()) == 1
        assert "locked by another precompute" in loud.stderr
    finally:
        holder.kill()
        holder.wait()


def test_entries_purged_by_age_are_not_encoded_again_by_a_refresh(tmp_path, corpus):
    """purge --older-than, then the cron refresh: the purged images are left out (no
    engine starts, counted as skipped_removed) unless --refill-removed asks for them."""
    store_path = str(tmp_path / "s")
    ids = fill(store_path, corpus)
    store = open_store(store_path)
    old = time.time() - 40 * 86400
    for rel in sorted(ids)[:2]:  # written and last read 40 days ago
        ident, arr = ids[rel], np.zeros((4, 8), np.float16)
        store.put(ident, encode(ident, arr.view(np.uint8), "F16", arr.shape, model=MODEL,
                                created=old))
        os.utime(store.entry_path(ident), (old, old))
    r = run("purge", "-s", store_path, "--older-than", "30d", "--yes", "-q")
    assert r.exit_code == 0 and len(list(store.identifiers())) == 3
    r = run("precompute", str(corpus), "-m", MODEL, "-s", store_path, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert (data["present"], data["skipped_removed"], data["encoded"]) == (3, 2, 0)
    assert data["engine_started"] is False
    r = run("precompute", str(corpus), "-m", MODEL, "-s", store_path)
    assert "skipped (removed by policy)" in r.stdout
    r = run("precompute", str(corpus), "-m", MODEL, "-s", store_path, "--refill-removed",
            "--dry-run", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["skipped_removed"] == 0


@pytest.mark.redis
def test_entries_purged_by_age_from_redis_are_not_encoded_again(redis_server, corpus):
    """The same on Redis, whose removal records are sorted sets beside the entries."""
    import uuid

    prefix = f"t-removed-{uuid.uuid4().hex[:10]}:"
    url = f"{redis_server.url}?prefix={prefix}"
    ids = fill(url, corpus)
    old = time.time() - 40 * 86400
    store = open_store(url)
    for rel in sorted(ids)[:2]:  # written and last read 40 days ago
        ident, arr = ids[rel], np.zeros((4, 8), np.float16)
        store.put(ident, encode(ident, arr.view(np.uint8), "F16", arr.shape, model=MODEL,
                                created=old))
        redis_server.client().zadd(prefix + "atime", {ident: old})
    assert run("purge", "-s", url, "--older-than", "30d", "--yes", "-q").exit_code == 0
    assert store.removals() == dict.fromkeys((ids[r] for r in sorted(ids)[:2]), "older-than")
    r = run("precompute", str(corpus), "-m", MODEL, "-s", url, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert (data["present"], data["skipped_removed"], data["engine_started"]) == (3, 2, False)
    store.close()


def test_killed_holder_releases_the_lock(tmp_path, corpus):
    fill(tmp_path / "s", corpus)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "s"), "60"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()  # SIGKILL: no cleanup code runs
    holder.wait()
    assert run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s")).exit_code == 0


@pytest.mark.parametrize("args, code", [
    (["/nonexistent/corpus"], 2),
    (["{corpus}", "--batch", "0"], 2),
    (["{corpus}", "--shard", "3/2"], 2),
    (["{corpus}", "--engine-arg", "novalue"], 2),
    (["{corpus}", "--request-mm-processor-kwargs", "{nope"], 2),
    (["{corpus}", "--request-mm-processor-kwargs", "[1]"], 2),
    (["{corpus}", "--request-mm-processor-kwargs", '{"max_pixels": 50176}',
      "--engine-arg", 'media_io_kwargs={"image": {"rgba_background_color": [0, 0, 0]}}'], 2),
    (["{corpus}", "--wait", "-1"], 2), (["{corpus}", "--wait", "nan"], 2),
    (["{corpus}", "--engines", "0"], 2), (["{corpus}", "--gpus-per-engine", "-1"], 2),
    (["{corpus}", "--max-model-len", "-1"], 2),
])
def test_usage_errors(tmp_path, corpus, args, code):
    args = [a.replace("{corpus}", str(corpus)) for a in args]
    r = run("precompute", *args, "-m", MODEL, "-s", str(tmp_path / "s"))
    assert r.exit_code == code
    assert r.output.strip().splitlines()[-1].startswith("Error:") or "Usage" in r.output
    assert "Traceback" not in r.output


def test_request_mm_processor_kwargs_are_hashed_like_the_server(tmp_path, corpus):
    """Requests carrying their own mm_processor_kwargs compute other identifiers: entries
    for plain requests are not "present" for them, entries made for them are."""
    from encache.jobs.corpus import walk
    from encache.connectors.vllm.hashing import identify_file
    kw = {"max_pixels": 50176}
    fill(tmp_path / "s", corpus)  # entries for requests without kwargs
    args = ("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--dry-run",
            "--json", "-q", "--request-mm-processor-kwargs", json.dumps(kw))
    assert json.loads(run(*args).stdout)["present"] == 0
    store = open_store(str(tmp_path / "s"))
    for f in walk(corpus):
        ident = identify_file(f.path, MODEL, mm_processor_kwargs=kw).identifier
        arr = np.zeros((4, 8), np.float16)
        store.put(ident, encode(ident, arr.view(np.uint8), "F16", arr.shape, model=MODEL))
    data = json.loads(run(*args).stdout)
    assert data["present"] == 5 and data["encoded"] == 0 and data["engine_started"] is False


def test_shards_partition_the_corpus(tmp_path, corpus):
    fill(tmp_path / "s", corpus)
    a = json.loads(run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--shard", "0/2", "--json").stdout)
    b = json.loads(run("precompute", str(corpus), "-m", MODEL, "-s", str(tmp_path / "s"), "--shard", "1/2", "--json").stdout)
    assert a["files"] + b["files"] == 5  # each file in exactly one shard
    from encache.connectors.store.ops.transfer import shard_of
    keys = [f"doc{i:03d}/page{j}.png" for i in range(200) for j in range(4)]
    sizes = [sum(shard_of(k, i, 4) for k in keys) for i in range(4)]
    assert sum(sizes) == len(keys) and min(sizes) > 150  # balanced, deterministic


def test_connector_config_json(tmp_path):
    r = run("connector-config", "-s", str(tmp_path / "st"), "--role", "ec_both", "--max-bytes", "1000")
    cfg = json.loads(r.stdout)
    assert cfg["ec_role"] == "ec_both" and cfg["ec_connector"] == "EncacheConnector"
    assert cfg["ec_connector_extra_config"] == {"store": str(tmp_path / "st"), "max_bytes": 1000}
    assert run("connector-config", "-s", "x", "--role", "nope").exit_code == 2
    r = run("connector-config", "-s", str(tmp_path / "st"), "--load-mode", "read", "--verify", "always")
    extra = json.loads(r.stdout)["ec_connector_extra_config"]
    assert extra["load_mode"] == "read" and extra["verify"] == "always"
    from encache.connectors.vllm.config import ConnectorConfig
    assert ConnectorConfig.from_extra(extra).verify == "always"  # the connector accepts it
    bad = run("connector-config", "-s", "x", "--load-mode", "sometimes")
    assert bad.exit_code == 2 and "--load-mode must be one of" in bad.output


def test_connector_config_prints_the_serve_command_when_asked_for(tmp_path):
    """``-m MODEL`` asks for the command line: it goes to stderr on a pipe too (the JSON
    alone stays on stdout, for ``$(…)``)."""
    from cli_support import invoke

    r = invoke("connector-config", "-s", str(tmp_path / "st"), "-m", "org/model")
    assert json.loads(r.stdout)["ec_role"] == "ec_consumer"
    assert "vllm.entrypoints.openai.api_server --model org/model --ec-transfer-config" in r.stderr
    assert "serve with" not in invoke("connector-config", "-s", str(tmp_path / "st")).stderr
