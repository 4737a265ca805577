"""copy_entries (disk <-> Redis, verified), warm_page_cache, shard_of."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from encache.connectors.store import decode
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.redis.store import RedisStore
from encache.connectors.store.ops.transfer import (TransferAborted, copy_entries, parse_shard,
                                               shard_of, warm_page_cache)
from store_contract import blob

BASE = [f"{i:064x}" for i in range(4)]
LORA = [f"adapterA:{i:064x}" for i in range(10, 13)]


@pytest.fixture
def disk(tmp_path):
    s = DiskStore(tmp_path / "disk", fsync=False)
    for i in BASE + LORA:
        s.put(i, blob(i, seed=len(i)))
    return s


@pytest.fixture
def rstore(redis_server):
    s = RedisStore(redis_server.url, prefix=f"x-{uuid.uuid4().hex[:12]}:")
    yield s
    s.close()


def corrupt(disk: DiskStore, ident: str) -> None:
    p = disk.entry_path(ident)
    data = bytearray(p.read_bytes())
    data[-5] ^= 0xFF  # a tensor byte: header intact, checksum wrong
    p.write_bytes(bytes(data))


@pytest.mark.redis
def test_copy_disk_to_redis_verbatim(disk, rstore):
    events = []
    rep = copy_entries(disk, rstore, progress=lambda i, outcome, n: events.append((i, outcome, n)))
    ids = set(BASE + LORA)
    assert (rep.copied, rep.skipped, rep.failed) == (len(ids), 0, 0) and rep.ok
    assert rep.bytes == sum(disk.entry_path(i).stat().st_size for i in ids)
    assert set(rstore.identifiers()) == ids
    for i in ids:
        assert bytes(rstore.get(i)) == disk.entry_path(i).read_bytes()
    assert sorted(e[0] for e in events) == sorted(ids) and {e[1] for e in events} == {"copied"}
    assert sum(e[2] for e in events) == rep.bytes


@pytest.mark.redis
def test_skip_existing(disk, rstore):
    copy_entries(disk, rstore, BASE[:2])
    rep = copy_entries(disk, rstore)
    assert (rep.copied, rep.skipped) == (len(BASE + LORA) - 2, 2)
    rep = copy_entries(disk, rstore)
    assert (rep.copied, rep.skipped, rep.bytes) == (0, len(BASE + LORA), 0)
    rep = copy_entries(disk, rstore, BASE, skip_existing=False)
    assert rep.copied == len(BASE) and rep.skipped == 0


@pytest.mark.redis
def test_corrupt_source_entry_is_reported_not_copied(disk, rstore):
    bad = BASE[1]
    corrupt(disk, bad)
    rep = copy_entries(disk, rstore)
    assert rep.failed == 1 and rep.errors == [(bad, "checksum")] and not rep.ok
    assert rep.copied == len(BASE + LORA) - 1
    assert not rstore.contains(bad)
    # without verification only the header is checked, and the bytes go across as they are
    rep = copy_entries(disk, rstore, [bad], verify=False)
    assert rep.copied == 1 and rstore.contains(bad)


@pytest.mark.redis
def test_truncated_source_is_refused_even_without_verify(disk, rstore):
    p = disk.entry_path(BASE[0])
    p.write_bytes(p.read_bytes()[:-10])
    rep = copy_entries(disk, rstore, [BASE[0]], verify=False)
    assert rep.errors == [(BASE[0], "truncated")] and not rstore.contains(BASE[0])


@pytest.mark.redis
def test_lora_filter_and_explicit_missing(disk, rstore):
    rep = copy_entries(disk, rstore, lora="adapterA")
    assert rep.copied == len(LORA) and set(rstore.identifiers()) == set(LORA)
    rep = copy_entries(disk, rstore, [BASE[0], "ff" * 32])
    assert rep.copied == 1 and rep.errors == [("ff" * 32, "missing")]


@pytest.mark.redis
def test_copy_redis_to_disk(disk, rstore, tmp_path):
    copy_entries(disk, rstore)
    local = DiskStore(tmp_path / "local", fsync=False)
    rep = copy_entries(rstore, local, lora="adapterA")
    assert rep.copied == len(LORA)
    for i in LORA:
        assert local.entry_path(i).read_bytes() == disk.entry_path(i).read_bytes()
        decode(local.get(i), identifier=i)


@pytest.mark.redis
def test_unreachable_destination_aborts_with_partial_report(disk, redis_factory):
    server = redis_factory()
    dst = RedisStore(server.url)
    copied_before_kill = []

    def progress(ident, outcome, n):
        copied_before_kill.append(ident)
        if len(copied_before_kill) == 2:
            server.kill()

    t0 = time.monotonic()
    with pytest.raises(TransferAborted, match="connection refused") as e:
        copy_entries(disk, dst, progress=progress)
    assert time.monotonic() - t0 < 3
    assert e.value.report.copied == 2


def test_warm_page_cache_reads_every_entry_without_touching_atime(disk):
    ids = BASE + LORA
    old = time.time() - 3 * 86400  # older than relatime's 24 h: a plain read would update it
    for i in ids:
        os.utime(disk.entry_path(i), (old, old))
    seen = []
    rep = warm_page_cache(disk, progress=lambda i, n: seen.append((i, n)))
    assert rep.entries == len(ids) and rep.missing == 0
    assert rep.bytes == sum(disk.entry_path(i).stat().st_size for i in ids) > 0
    assert rep.seconds > 0 and sorted(i for i, _ in seen) == sorted(ids)
    assert all(abs(disk.entry_path(i).stat().st_atime - old) < 1 for i in ids)
    rep = warm_page_cache(disk, [BASE[0], "nope"])
    assert (rep.entries, rep.missing) == (1, 1)
    assert rep.bytes == disk.entry_path(BASE[0]).stat().st_size
    assert warm_page_cache(disk, lora="adapterA").entries == len(LORA)


def test_warm_page_cache_needs_a_disk_store(redis_server):
    from encache.connectors.store import StoreError
    with pytest.raises(StoreError, match="disk store"):
        warm_page_cache(RedisStore(redis_server.url, prefix="w:"))


def test_shard_of_partitions_deterministically():
    names = [f"images/{i:05d}.jpg" for i in range(2000)]
    for n in (1, 3, 4):
        owners = [[i for i in range(n) if shard_of(s, i, n)] for s in names]
        assert all(len(o) == 1 for o in owners)  # exactly one shard each
        sizes = [sum(o == [i] for o in owners) for i in range(n)]
        assert min(sizes) > 0.8 * len(names) / n
    # a pinned value: must never change between releases or machines
    pinned = [[i for i in range(4) if shard_of(f"images/{k:05d}.jpg", i, 4)] for k in range(5)]
    assert pinned == [[2], [0], [0], [2], [0]]
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(ValueError):
            parse_shard(bad)
    with pytest.raises(ValueError):
        shard_of("x", 2, 2)
