"""`encache warm` on real stores: a disk store promoted into a real redis-server, and a
disk store read into the page cache. No mocks; the only vLLM use is its hasher (IMAGE
arguments)."""

from __future__ import annotations

import json
import signal
import uuid

import pytest

from encache.cli import errors
from encache.connectors.store import decode, open_store
from encache.connectors.store.disk.store import DiskStore
from cli_support import invoke, one_line_error
from entries import put_entry

BASE = [f"{i:064x}" for i in range(1, 5)]
LORA = [f"adA:{i:064x}" for i in range(20, 23)]
OTHER_LORA = [f"adB:{i:064x}" for i in range(30, 32)]
ALL = BASE + LORA + OTHER_LORA
PASSWORD = "pw-Secret-4711"


@pytest.fixture
def src(tmp_path) -> DiskStore:
    s = DiskStore(tmp_path / "disk", fsync=False)
    for n, ident in enumerate(ALL):
        put_entry(s, ident, 16 + 8 * n, seed=n)
    return s


@pytest.fixture
def rurl(redis_server):
    url = f"{redis_server.url}?prefix=t-warm-{uuid.uuid4().hex[:12]}:"
    yield url
    s = open_store(url)
    for i in list(s.identifiers()):
        s.delete(i)
    s.close()


def sizes(store: DiskStore, idents) -> int:
    return sum(store.entry_path(i).stat().st_size for i in idents)


def warm_json(*args, code: int = 0) -> dict:
    r = invoke("warm", *args, "--json")
    assert r.exit_code == code, (r.exit_code, r.stdout, r.stderr)
    return json.loads(r.stdout)


def redis_ids(url) -> set[str]:
    s = open_store(url)
    try:
        return set(s.identifiers())
    finally:
        s.close()


def corrupt(store: DiskStore, ident: str) -> None:
    p = store.entry_path(ident)
    data = bytearray(p.read_bytes())
    data[-3] ^= 0xFF  # a tensor byte: the header is intact, the checksum is not
    p.write_bytes(bytes(data))


# -- promote disk -> Redis -------------------------------------------------------------

def test_all_entries_copied_verbatim_then_skipped(src, rurl):
    d = warm_json("--from", src.root, "--store", rurl)
    assert d["mode"] == "copy" and d["source"] == str(src.root)
    assert (d["copied"], d["skipped"], d["failed"]) == (len(ALL), 0, 0)
    assert d["bytes"] == sizes(src, ALL) and d["requested"] is None
    assert d["seconds"] > 0 and d["bytes_per_second"] > 0
    assert redis_ids(rurl) == set(ALL)
    dst = open_store(rurl)
    for ident in ALL:
        blob = dst.get(ident)
        assert bytes(blob) == src.entry_path(ident).read_bytes()
        decode(blob, identifier=ident, verify=True)
    dst.close()

    again = warm_json("--from", src.root, "--store", rurl)  # nothing to do the second time
    assert (again["copied"], again["skipped"], again["failed"], again["bytes"]) == \
        (0, len(ALL), 0, 0)
    over = warm_json("--from", src.root, "--store", rurl, "--overwrite")
    assert (over["copied"], over["skipped"]) == (len(ALL), 0)


def test_human_summary_table(src, rurl):
    r = invoke("warm", "--from", src.root, "-s", rurl)
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "copied" in out and str(len(ALL)) in out and "bytes written" in out
    assert str(src.root) in out and "prefix=t-warm-" in out
    r = invoke("warm", "--from", src.root, "-s", rurl, "-q")  # quiet: no summary
    assert r.exit_code == 0 and r.stdout == ""


def test_by_identifier(src, rurl):
    d = warm_json("--from", src.root, "-s", rurl, "-i", BASE[1], "--identifier", LORA[2])
    assert (d["requested"], d["copied"], d["skipped"], d["failed"]) == (2, 2, 0, 0)
    assert d["bytes"] == sizes(src, [BASE[1], LORA[2]])
    assert redis_ids(rurl) == {BASE[1], LORA[2]}
    d = warm_json("--from", src.root, "-s", rurl, "-i", BASE[1], "-i", BASE[2])
    assert (d["copied"], d["skipped"]) == (1, 1)


def test_by_lora(src, rurl):
    d = warm_json("--from", src.root, "-s", rurl, "--lora", "adA")
    assert (d["copied"], d["skipped"], d["failed"]) == (len(LORA), 0, 0)
    assert d["lora"] == "adA" and d["bytes"] == sizes(src, LORA)
    assert redis_ids(rurl) == set(LORA)
    d = warm_json("--from", src.root, "-s", rurl, "--lora", "adB")
    assert d["copied"] == len(OTHER_LORA)
    assert redis_ids(rurl) == set(LORA + OTHER_LORA)


def test_missing_identifier_is_partial(src, rurl):
    ghost = f"{999:064x}"
    d = warm_json("--from", src.root, "-s", rurl, "-i", BASE[0], "-i", ghost,
                  code=errors.EXIT_PARTIAL)
    assert d["copied"] == 1 and d["failed"] == 1
    assert d["failures"] == [{"identifier": ghost, "path": None, "reason": "missing"}]
    assert redis_ids(rurl) == {BASE[0]}


def test_corrupt_source_entry_reported_and_not_copied(src, rurl):
    corrupt(src, BASE[2])
    r = invoke("warm", "--from", src.root, "-s", rurl, "--json")
    assert r.exit_code == errors.EXIT_PARTIAL, r.output
    d = json.loads(r.stdout)
    assert (d["copied"], d["failed"]) == (len(ALL) - 1, 1)
    assert [(f["identifier"], f["reason"]) for f in d["failures"]] == [(BASE[2], "checksum")]
    assert redis_ids(rurl) == set(ALL) - {BASE[2]}
    r = invoke("warm", "--from", src.root, "-s", rurl)  # the table names it too
    assert r.exit_code == errors.EXIT_PARTIAL
    assert BASE[2] in r.stdout and "checksum" in r.stdout


# -- images (vLLM's hasher, no engine) -------------------------------------------------

def test_images_hashed_with_model(src, rurl, tmp_path):
    from demo_corpus import make_corpus

    from encache.connectors.vllm.hashing import identify_file

    model = "org/some-model"
    pages = make_corpus(str(tmp_path / "imgs"), pages=3, seed=4)
    idents = [identify_file(p, model).identifier for p in pages]
    lora_ident = identify_file(pages[0], model, lora="adA").identifier
    assert lora_ident == "adA:" + idents[0]
    for n, ident in enumerate(idents[:2] + [lora_ident]):
        put_entry(src, ident, 16, seed=100 + n, model=model)
    bad = tmp_path / "imgs" / "broken.png"
    bad.write_bytes(b"this is not an image")

    # two images with entries, one without, one unreadable
    r = invoke("warm", "--from", src.root, "-s", rurl, "--model", model, "--json",
               pages[0], pages[1], pages[2], bad)
    assert r.exit_code == errors.EXIT_PARTIAL, r.output
    d = json.loads(r.stdout)
    assert (d["requested"], d["copied"], d["failed"]) == (3, 2, 2)
    reasons = {f["path"]: (f["identifier"], f["reason"]) for f in d["failures"]}
    assert reasons[pages[2]] == (idents[2], "missing")
    ident, reason = reasons[str(bad)]
    assert ident is None and reason.startswith("not a readable image") and "0x" not in reason
    assert redis_ids(rurl) == set(idents[:2])
    # a directory argument is searched; --lora prefixes the identifiers like vLLM does
    d = warm_json("--from", src.root, "-s", rurl, "-m", model, "--lora", "adA", pages[0])
    assert (d["copied"], d["failed"]) == (1, 0)
    assert lora_ident in redis_ids(rurl)
    r = invoke("warm", "--from", src.root, "-s", rurl, "-m", model, "--json",
               str(tmp_path / "imgs"))
    d = json.loads(r.stdout)
    assert d["requested"] == 3 and d["skipped"] == 2 and d["failed"] == 2  # missing + broken
    # the table tells how to fill the gap
    r = invoke("warm", "--from", src.root, "-s", rurl, "-m", model, pages[2])
    assert r.exit_code == errors.EXIT_PARTIAL and "--compute-missing" in r.stdout


def test_images_hashed_with_the_servers_media_io_kwargs(src, rurl, tmp_path):
    """--engine-arg media_io_kwargs (the server's) change the identifiers warm looks for,
    as precompute's; all present here, so no engine starts."""
    from demo_corpus import make_corpus

    from encache.connectors.vllm.hashing import identify_file

    model = "org/some-model"
    media = {"image": {"rgba_background_color": [0, 0, 0]}}
    pages = make_corpus(str(tmp_path / "imgs"), pages=2, seed=5)
    idents = [identify_file(p, model, media_io_kwargs=media).identifier for p in pages]
    assert not set(idents) & {identify_file(p, model).identifier for p in pages}
    for n, ident in enumerate(idents):
        put_entry(src, ident, 16, seed=200 + n, model=model)
    d = warm_json("--from", src.root, "-s", rurl, "-m", model, "--compute-missing",
                  "--engine-arg", "media_io_kwargs=" + json.dumps(media), *pages)
    assert (d["copied"], d["failed"], d["computed"]) == (2, 0, 0)
    assert set(idents) <= redis_ids(rurl)


def test_compute_missing_counts_other_configs_entries_as_missing(src, rurl, tmp_path):
    """With --tag, an entry stamped otherwise is not usable: warm sets out to encode it
    (the fake model's engine cannot start: exit 8); one with its stamp is copied."""
    from demo_corpus import make_corpus

    from encache.connectors.encoder_config import encoder_config_digest
    from encache.connectors.vllm.hashing import identify_file

    model = "org/some-model"
    pages = make_corpus(str(tmp_path / "imgs"), pages=2, seed=6)
    idents = [identify_file(p, model).identifier for p in pages]
    put_entry(src, idents[0], 16, seed=1, model=model,
              encoder_config=encoder_config_digest(tag="v2"))
    put_entry(src, idents[1], 16, seed=2, model=model)  # default config
    base = ("--from", src.root, "-s", rurl, "-m", model, "--compute-missing")
    d = warm_json(*base, "--tag", "v2", pages[0])
    assert (d["copied"], d["computed"], d["failed"]) == (1, 0, 0)
    r = invoke("warm", *base, "--tag", "v2", pages[1])
    assert r.exit_code == errors.EXIT_ENGINE and "engine failed to start" in r.output
    assert idents[1] not in redis_ids(rurl)
    d = warm_json(*base, pages[1])  # no tag: the default entry is the one wanted
    assert (d["copied"], d["computed"], d["failed"]) == (1, 0, 0)


# -- page cache ------------------------------------------------------------------------

def test_page_cache_warm_reports_entries_and_bytes(src):
    d = warm_json("--store", src.root)
    assert d["mode"] == "page-cache" and d["store"] == str(src.root)
    assert (d["entries"], d["failed"], d["copied"]) == (len(ALL), 0, 0)
    assert d["bytes"] == sizes(src, ALL) and d["seconds"] > 0
    d = warm_json("--store", src.root, "--lora", "adA")
    assert (d["entries"], d["bytes"]) == (len(LORA), sizes(src, LORA))
    d = warm_json("--store", src.root, "-i", BASE[0], "-i", f"{777:064x}",
                  code=errors.EXIT_PARTIAL)
    assert (d["requested"], d["entries"], d["bytes"]) == (2, 1, sizes(src, [BASE[0]]))
    assert [f["reason"] for f in d["failures"]] == ["missing"]
    r = invoke("warm", "-s", src.root)
    assert r.exit_code == 0 and "entries read" in r.stdout and "bytes read" in r.stdout


def test_page_cache_does_not_touch_access_times(src):
    p = src.entry_path(BASE[0])
    before = p.stat().st_atime_ns
    import os
    os.utime(p, ns=(before - 10**12, p.stat().st_mtime_ns))  # an old access time
    old = p.stat().st_atime_ns
    assert warm_json("--store", src.root)["entries"] == len(ALL)
    assert p.stat().st_atime_ns == old  # warming is not "use": LRU order unchanged


# -- errors ----------------------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--from", "redis://127.0.0.1:1/0"], "--from must be a disk store"),
    (["--from", "SRC", "IMG"], "--model"),
    (["--from", "SRC", "--compute-missing", "-m", "x"], "--compute-missing needs IMAGE"),
    (["--from", "SRC", "--lora", "adA", "-i", "x"], "--lora"),
    (["--from", "SRC", "--dtype", "float32"], "only applies with --compute-missing"),
    (["--from", "SRC", "--store", "SRC"], "same store"),
    (["--from", "SRC", "-i", "bad\x00id"], "bad --identifier"),
])
def test_usage_errors(src, rurl, tmp_path, args, needle):
    img = tmp_path / "x.png"
    img.write_bytes(b"not read")
    args = [str(src.root) if a == "SRC" else str(img) if a == "IMG" else a for a in args]
    if "--store" not in args:
        args += ["--store", rurl]
    r = invoke("warm", *args)
    assert r.exit_code == errors.EXIT_USAGE, (r.stdout, r.stderr)
    assert needle in one_line_error(r)
    assert redis_ids(rurl) == set()  # nothing was done


def test_redis_store_without_from_is_usage_error(rurl):
    r = invoke("warm", "--store", rurl)
    assert r.exit_code == errors.EXIT_USAGE
    line = one_line_error(r)
    assert "page cache" in line and "--from" in line


def test_missing_stores_exit_7(src, rurl, tmp_path):
    r = invoke("warm", "--from", tmp_path / "nope", "--store", rurl)
    assert r.exit_code == errors.EXIT_STORE
    assert "nope" in one_line_error(r)
    r = invoke("warm", "--store", tmp_path / "nope2")
    assert r.exit_code == errors.EXIT_STORE
    assert not (tmp_path / "nope2").exists()  # never created by accident


def test_dead_redis_exit_7_one_line_no_password(src, redis_factory):
    server = redis_factory(password=PASSWORD)
    url = server.url_for(password=PASSWORD)
    assert warm_json("--from", src.root, "-s", url, "-i", BASE[0])["copied"] == 1  # alive: fine
    server.kill(signal.SIGKILL)
    for extra in ([], ["--json"]):
        r = invoke("warm", "--from", src.root, "-s", url, *extra)
        assert r.exit_code == errors.EXIT_STORE, (r.stdout, r.stderr)
        line = one_line_error(r)
        assert "connection refused" in line and "redis://:***@127.0.0.1" in line
        assert PASSWORD not in r.stdout + r.stderr
        assert r.stdout == ""  # failed before doing anything


def test_wrong_password_exit_7(src, redis_factory):
    server = redis_factory(password=PASSWORD)
    r = invoke("warm", "--from", src.root, "-s", server.url_for(password="not-it"))
    assert r.exit_code == errors.EXIT_STORE
    line = one_line_error(r)
    assert "wrong password" in line and "not-it" not in r.stdout + r.stderr
    assert server.client().dbsize() == 0


def test_redis_full_mid_copy_exit_7_with_partial_summary(src, redis_factory):
    # maxmemory below what Redis already uses + noeviction: every write is refused (OOM)
    server = redis_factory(config={"maxmemory": "1", "maxmemory-policy": "noeviction"})
    r = invoke("warm", "--from", src.root, "-s", server.url, "--json")
    assert r.exit_code == errors.EXIT_STORE, (r.stdout, r.stderr)
    line = one_line_error(r)
    assert "out of memory" in line and "copy stopped" in line
    d = json.loads(r.stdout)  # what was done before the store failed
    assert d["copied"] == 0 and d["mode"] == "copy"
    assert server.client().dbsize() == 0
