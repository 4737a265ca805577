"""A mixed-version fleet: entries of the previous formats, of this build and of a synthetic
next format (a header this build does not know) side by side in one store, on a real disk
store and a real Redis (a repair on a real Redis Cluster too), through ``verify``,
``verify --repair``, ``purge``, ``stats``, ``list``, a consumer's loads, a producer's
skip, ``warm`` and the local tier; then the
store's own bookkeeping of a newer encache (counter files, corpus manifests). A real
engine over such a store: ``tests/engine/test_newer_format_engine.py``.

What must hold (docs/upgrading.md): nothing of a newer format is lost (never quarantined,
repaired, rewritten or counted corrupt; a consumer misses it with its own reason), and
nothing of a format this build knows is served wrong (its corruption is still found and
repaired; older layouts still load, byte for byte).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash
from blake3 import blake3

from encache.cli import errors
from encache.connectors.store import NewerFormat, open_store
from encache.connectors.store.disk.store import DiskStore
from cli_support import invoke
from entries import rewrite_header

ROWS, WIDTH = 64, 8


def _tensor(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, WIDTH)).astype(np.float16)


def _current(ident: str, seed: int, model: str = "m") -> bytes:
    from encache.connectors.store import encode
    arr = _tensor(seed)
    return encode(ident, arr.view(np.uint8), "F16", arr.shape, model=model)


def _with(blob: bytes, **md) -> bytes:
    return rewrite_header(blob, lambda h: h["__metadata__"].update(md))


@dataclass(frozen=True)
class Fleet:
    """What each encache of the fleet wrote, by identifier."""

    current: str = "c" * 64  # this build
    xxh3: str = "a" * 64  # before the piecewise checksum: one XXH3-128 of the bytes
    blake3: str = "b" * 64  # the first entries: blake3
    legacy: str = "e" * 64  # ECExampleConnector's: no metadata
    next_format: str = "f" * 64  # a next encache: format "2", its own tensor layout
    next_checksum: str = "d" * 64  # a next encache: format "1", a checksum unknown here
    rotten: str = "0" * 63 + "1"  # this build's format, one bit flipped: corrupt

    @property
    def newer(self) -> set[str]:
        return {self.next_format, self.next_checksum}

    @property
    def known(self) -> dict[str, int]:
        """Entries of a format this build reads, and the seed of their tensor."""
        return {self.current: 1, self.xxh3: 2, self.blake3: 3, self.legacy: 4}


F = Fleet()


def write_fleet(store) -> dict[str, bytes]:
    """Every entry of :class:`Fleet` into ``store``; returns their bytes."""
    data = {i: _tensor(seed).tobytes() for i, seed in F.known.items()}
    out = {
        F.current: _current(F.current, 1),
        F.xxh3: _with(_current(F.xxh3, 2),
                      checksum="xxh3_128:" + xxhash.xxh3_128_hexdigest(data[F.xxh3])),
        F.blake3: _with(_current(F.blake3, 3),
                        checksum="blake3:" + blake3(data[F.blake3]).hexdigest()),
        F.legacy: rewrite_header(_current(F.legacy, 4), lambda h: h.pop("__metadata__")),
        F.next_format: rewrite_header(
            _current(F.next_format, 5),
            lambda h: (h["__metadata__"].update(encache_format="2",
                                                checksum="xxh3_256x1m:" + "0" * 64),
                       h.update(tensors=[h.pop("ec_cache")]))),
        F.next_checksum: _with(_current(F.next_checksum, 6), checksum="xxh3_256x1m:" + "1" * 64),
    }
    rotten = bytearray(_current(F.rotten, 7))
    rotten[-3] ^= 0x10
    out[F.rotten] = bytes(rotten)
    for ident, b in out.items():
        store.put(ident, b)
    return out


@pytest.fixture(params=["disk", "redis"])
def fleet(request, tmp_path):
    """``(url, store, bytes by identifier)`` of a store holding the whole fleet."""
    if request.param == "disk":
        url = str(tmp_path / "store")
        store = DiskStore(url)
    else:
        server = request.getfixturevalue("redis_server")
        url = f"{server.url}?prefix=t-mixed-{uuid.uuid4().hex[:8]}:"
        store = open_store(url)
    written = write_fleet(store)
    yield url, store, written
    if request.param == "redis":
        store.delete_many(list(store.identifiers()))
        store.reset_counters()
    store.close()


def _run(*args):
    r = invoke(*args)
    return r, json.loads(r.stdout) if r.stdout.strip().startswith("{") else None


def _held(store, written, idents) -> None:
    """Each of ``idents`` is still in ``store``, byte for byte."""
    for i in idents:
        got = store.get(i)
        assert got is not None and bytes(memoryview(got).cast("B")) == written[i], i


def test_verify_reports_newer_entries_apart_and_repair_leaves_them(fleet):
    url, store, written = fleet
    r, d = _run("verify", "-s", url, "--json")
    assert r.exit_code == errors.EXIT_PROBLEMS, r.output
    assert {f["identifier"]: f["reason"] for f in d["problems"]} == {F.rotten: "checksum"}
    assert {f["identifier"]: f["reason"] for f in d["newer_format"]} == \
        dict.fromkeys(F.newer, "newer-format")
    assert "written by a newer encache" in d["newer_format"][0]["detail"]
    assert {f["reason"] for f in d["warnings"]} == {"legacy"}

    r, d = _run("verify", "-s", url, "--repair", "--json")
    assert r.exit_code == errors.EXIT_PROBLEMS, r.output
    assert d["repair"]["failed"] == [] and len(d["newer_format"]) == 2
    assert d["repair"]["quarantined"] + d["repair"]["deleted"] == 1
    assert not store.contains(F.rotten)
    _held(store, written, F.newer | set(F.known))

    r = invoke("verify", "-s", url)  # clean now, but not everything could be checked
    assert r.exit_code == errors.EXIT_NEWER, r.output
    assert "2 written by a newer encache" in r.stdout and "Traceback" not in r.output
    r = invoke("verify", "-s", url, "--repair", "--quiet")
    assert r.exit_code == errors.EXIT_NEWER and "newer" in r.stdout
    _held(store, written, F.newer | set(F.known))


def test_a_redis_cluster_repair_leaves_newer_entries_on_every_primary(redis_cluster):
    url = f"{redis_cluster.url}?prefix=t-mixed-{uuid.uuid4().hex[:8]}:"
    store = open_store(url)
    try:
        written = write_fleet(store)
        r, d = _run("verify", "-s", url, "--repair", "--json")
        assert r.exit_code == errors.EXIT_PROBLEMS, r.output
        assert {f["identifier"] for f in d["newer_format"]} == F.newer
        assert [f["identifier"] for f in d["problems"]] == [F.rotten]
        assert not store.contains(F.rotten)
        _held(store, written, F.newer | set(F.known))
        assert invoke("verify", "-s", url).exit_code == errors.EXIT_NEWER
    finally:
        store.delete_many(list(store.identifiers()))
        store.close()


def test_list_and_stats_show_newer_entries_and_count_them_apart(fleet):
    url, store, written = fleet
    store.delete(F.rotten)
    r, d = _run("list", "-s", url, "--json")
    assert r.exit_code == 0, r.output
    errs = {e["identifier"]: e["error"] for e in d["entries"]}
    assert errs == {**dict.fromkeys(F.known), **dict.fromkeys(F.newer, "newer-format")}
    table = invoke("list", "-s", url).stdout
    assert table.count("newer-format") == 2

    r, st = _run("stats", "-s", url, "--json")
    assert r.exit_code == 0, r.output
    assert st["entries"] == 6 and st["newer_format_entries"] == 2
    assert st["newer_format_bytes"] == sum(len(written[i]) for i in F.newer)
    assert st["unreadable_entries"] == 0 and st["legacy_entries"] == 1
    assert "Newer-format entries" in invoke("stats", "-s", url).stdout


def test_purge_selects_newer_entries_by_age_and_size_not_by_model(fleet):
    url, store, written = fleet
    store.delete(F.rotten)
    # by model: a newer entry's model is not readable here, so it is not selected
    r, d = _run("purge", "-s", url, "--model", "m", "--yes", "--json")
    assert r.exit_code == 0, r.output
    assert store.contains(F.next_format) and store.contains(F.next_checksum)
    assert not store.contains(F.current) and not store.contains(F.xxh3)
    # by age: like any entry (a disk entry's file time, a Redis entry's write time)
    r, d = _run("purge", "-s", url, "--older-than", "1h", "--dry-run", "--json")
    assert d["plan"]["entries"] == 0
    r, d = _run("purge", "-s", url, "--all", "--dry-run", "--json")
    items = d["plan"]["items"]
    assert {i["identifier"] for i in items} >= F.newer
    assert sum(i["size"] for i in items if i["identifier"] in F.newer) == \
        sum(len(written[i]) for i in F.newer)
    if isinstance(store, DiskStore):
        old = time.time() - 4 * 3600
        for i in F.newer:
            os.utime(store.entry_path(i), (old, old))
        store.changed_outside(F.newer)  # (files changed by hand: the store is told)
        r, d = _run("purge", "-s", url, "--older-than", "1h", "--yes", "--json")
        assert r.exit_code == 0, r.output
        assert not store.contains(F.next_format) and not store.contains(F.next_checksum)


def test_a_consumer_misses_newer_entries_with_their_own_reason_and_loads_the_rest(fleet):
    from encache.connectors.lookup import EntryLookup
    _, store, written = fleet
    lk = EntryLookup(store, counters_flush_s=3600, load_threads=1, index_refresh_s=3600,
                     verify_ahead_start_bytes=0)
    try:
        for ident, seed in F.known.items():
            staged = lk.load_now(ident)
            assert staged is not None, ident
            view = memoryview(staged.blob).cast("B")
            assert bytes(view[staged.offset:staged.offset + staged.meta.data_bytes]) == \
                _tensor(seed).tobytes()
        for ident in F.newer:
            assert lk.load_now(ident) is None
            assert lk.miss_reason(ident) == "newer_format"
        assert lk.load_now(F.rotten) is None and lk.miss_reason(F.rotten) == "corrupt"
    finally:
        lk.close()
    _held(store, written, F.newer)


def test_a_producer_of_this_build_does_not_replace_a_newer_entry(fleet):
    """A producer's writer skips what the store holds, and precompute does not encode
    again what it finds present: a newer encache's entry counts as present to both."""
    from encache.connectors.encoder_config import holds
    from encache.jobs.precompute.identify import stored_state
    _, store, written = fleet
    assert holds(store, F.next_format, "some-config-digest")
    assert holds(store, F.next_checksum, None, "some-lora-digest")
    assert not holds(store, F.current, "some-config-digest")
    for ident in F.newer:
        assert stored_state(store, ident, "", "") == "present"
        assert stored_state(store, ident, "some-config-digest", "some-lora-digest") == "present"
    assert stored_state(store, F.current, "some-config-digest", "") == "other_config"


def test_the_local_tier_keeps_newer_copies_and_serves_known_ones(redis_server, tmp_path):
    url = f"{redis_server.url}?prefix=t-mixed-tier-{uuid.uuid4().hex[:8]}:"
    tier = open_store(url, local_tier=str(tmp_path / "tier"))
    try:
        written = write_fleet(tier.remote)
        for ident in F.known:  # a remote hit, written behind, then a local one
            for where in ("remote", "local"):
                got = tier.read_verified(ident)
                blob, version, meta, offset, _ = got
                tier.flush()
                assert got.source == where, ident
                view = memoryview(blob).cast("B")
                assert bytes(view[offset:offset + meta.data_bytes]) == \
                    _tensor(F.known[ident]).tobytes()
        # a newer encache on this node left copies in its tier (then was rolled back)
        for ident in F.newer:
            tier.tier.put(ident, written[ident])
            with pytest.raises(NewerFormat):
                tier.read_verified(ident)
            tier.flush()
            assert tier.tier.contains(ident) and tier.remote.contains(ident)
        r = invoke("verify", "-s", str(tmp_path / "tier"), "--repair", "--json")
        assert r.exit_code == errors.EXIT_NEWER, r.output
        assert all(tier.tier.contains(i) for i in F.newer)
    finally:
        tier.remote.delete_many(list(tier.remote.identifiers()))
        tier.close()


# ---- the store's own metadata, of a newer encache ------------------------------------------


def test_a_newer_counter_file_of_a_dead_process_is_left_for_its_encache(tmp_path):
    """This build folds dead processes' counter files into counters.json and deletes
    them; one of another layout (another magic) it cannot read, so it leaves it."""
    from encache.connectors.store import counters
    store = DiskStore(tmp_path / "s")
    store.add_counters({"hits": 3})
    d = tmp_path / "s" / ".encache" / "counters"
    d.mkdir(exist_ok=True)
    dead = f"{counters._host()}-999999-1{counters.SUFFIX}"  # (no such pid: a dead process)
    newer = d / dead
    newer.write_bytes(b"ENCCNT02" + b"\x07" * (counters.SIZE - 8))
    ours = d / dead.replace("-999999-", "-999998-")
    ours.write_bytes(newer.read_bytes().replace(b"ENCCNT02", counters.MAGIC, 1))
    assert store.read_counters()["hits"] == 3
    assert newer.exists() and not ours.exists()  # ours folded (its garbage slots: none)


def test_a_newer_corpus_manifest_is_read_as_empty_and_never_overwritten(tmp_path):
    from encache.jobs.corpus import MANIFEST_VERSION, Manifest, walk
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.png").write_bytes(b"x")
    f = next(iter(walk(str(tmp_path / "c"))))
    path, key = tmp_path / "k.json", {"corpus": "c"}
    text = json.dumps({"version": MANIFEST_VERSION + 1, "key": key, "layout": "new"})
    path.write_text(text)
    m = Manifest.load(path, key)
    assert m.newer and m.lookup(f) is None
    m.record(f, "ident1")
    m.save()
    assert path.read_text() == text


def test_warm_does_not_copy_a_newer_entry_and_keeps_it(tmp_path, redis_server):
    """``warm`` verifies what it copies; an entry it cannot verify (a newer encache's) is
    reported, reason ``newer-format``, not copied, and stays in the source."""
    src = DiskStore(tmp_path / "src")
    written = write_fleet(src)
    src.delete(F.rotten)
    url = f"{redis_server.url}?prefix=t-mixed-warm-{uuid.uuid4().hex[:8]}:"
    r = invoke("warm", "--from", src.root, "-s", url, "--json")
    assert r.exit_code == errors.EXIT_PARTIAL, r.output
    d = json.loads(r.stdout)
    assert {f["identifier"]: f["reason"] for f in d["failures"]} == \
        dict.fromkeys(F.newer, "newer-format")
    dst = open_store(url)
    try:
        assert set(dst.identifiers()) == set(F.known)
        for i in F.known:
            assert bytes(memoryview(dst.get(i)).cast("B")) == written[i]
        dst.delete_many(list(F.known))
    finally:
        dst.close()
    _held(src, written, F.newer)


def test_a_header_index_of_an_encache_that_reads_other_formats_is_rebuilt(tmp_path, monkeypatch):
    """The disk store's header index caches each entry's verdict; one written by an
    encache that reads other formats (an older one: ``newer-format`` for an entry this
    build reads) is not used, so an upgrade never serves an old verdict."""
    from encache.connectors.store.disk import header_index
    store = DiskStore(tmp_path / "s")
    write_fleet(store)
    monkeypatch.setattr(header_index, "READS", [["1", "2"], ["xxh3_256x1m"]])
    list(store.scan())  # indexed by "another" encache
    assert header_index.load(tmp_path / "s" / ".encache")
    monkeypatch.undo()
    assert header_index.load(tmp_path / "s" / ".encache") == {}
    errs = {e.identifier: e.error for e in store.scan()}
    assert errs[F.next_format] == errs[F.next_checksum] == "newer-format"
    assert header_index.load(tmp_path / "s" / ".encache")  # rewritten by this build
