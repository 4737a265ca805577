"""The node-local tier (``connectors/store/tiered.py``) in front of a real redis-server.

The store contract on a tiered store (Redis and a disk directory standing in for a network
filesystem behind a local tier), then what the tier adds: a remote hit is written behind
and the next load is local; copies the shared store changes (a purge or rewrite from
another handle, a purge while this node was down) are dropped at the next sync, in
O(changes) through the journal; through a Redis SIGKILL the local copies are served and
the rest fail fast; a Redis that comes back empty drops them; a full local disk turns the
write-behind off with one warning; a write-behind racing a change is not served until
a sync checked it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
import uuid

import pytest

from encache.connectors.store import StoreError, open_store
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.redis.store import RedisStore
from encache.connectors.store.tiered import TieredStore
from store_contract import StoreContract, blob

pytestmark = pytest.mark.redis


def fresh_prefix() -> str:
    return f"t-tier-{uuid.uuid4().hex[:8]}:"


class TestTieredOverRedis(StoreContract):
    @pytest.fixture
    def store(self, redis_server, tmp_path):
        s = TieredStore(RedisStore(redis_server.url, prefix=fresh_prefix()),
                        DiskStore(tmp_path / "tier"))
        yield s
        s.close()


class TestTieredOverRedisCluster(StoreContract):
    @pytest.fixture
    def store(self, redis_cluster, tmp_path):
        from encache.connectors.store.redis.cluster import RedisClusterStore
        s = TieredStore(RedisClusterStore(redis_cluster.url, prefix=fresh_prefix()),
                        DiskStore(tmp_path / "tier"))
        yield s
        s.close()


def test_a_cluster_journal_drops_copies_and_is_backed_by_full_checks(redis_cluster, tmp_path):
    """A cluster writes its journal record after the entry (another slot): copies are
    dropped through the journal all the same, and a periodic full check catches a
    record that was lost."""
    from encache.connectors.store.redis.cluster import RedisClusterStore
    prefix = fresh_prefix()
    other = RedisClusterStore(redis_cluster.url, prefix=prefix)
    tier = open_store(redis_cluster.url, prefix=prefix, local_tier=str(tmp_path / "tier"))
    try:
        for i in ("c1", "c2"):
            other.put(i, blob(i))
            load(tier, i)
        assert tier.sync() and tier.tier.count() == 2
        other.delete("c1")
        assert tier.sync() and not tier.tier.contains("c1")
        checks = tier.stats["full_checks"]
        other._journal = lambda client, changed: None  # its journal call lost (a failover)
        other.delete("c2")
        tier._next_full = 0.0  # (JOURNAL_FULL_CHECK_S elapsed)
        assert tier.sync() and not tier.tier.contains("c2")
        assert tier.stats["full_checks"] == checks + 1
    finally:
        tier.close()
        other.close()


class TestTieredOverDirectory(StoreContract):
    """A shared directory (an NFS mount's stand-in): its journal is segment files."""

    @pytest.fixture
    def store(self, tmp_path):
        s = TieredStore(DiskStore(tmp_path / "shared"), DiskStore(tmp_path / "tier"))
        yield s
        s.close()


@pytest.fixture
def pair(redis_server, tmp_path):
    """(tiered store of this node, another handle on the shared Redis)."""
    prefix = fresh_prefix()
    tier = open_store(redis_server.url, prefix=prefix, local_tier=str(tmp_path / "tier"))
    other = RedisStore(redis_server.url, prefix=prefix)
    yield tier, other
    tier.close()
    other.close()


def load(store, ident):
    got = store.read_verified(ident)
    if isinstance(store, TieredStore):
        store.flush()
    return None if got is None else (bytes(memoryview(got[0]).cast("B")), got.source)


def test_remote_hit_is_written_behind_then_served_locally(pair):
    tier, other = pair
    b = blob("a", n=4096)
    other.put("a", b)
    data, source = load(tier, "a")
    assert data == b and source == "remote"
    assert tier.tier.contains("a") and tier.stats["written_behind"] == 1
    data, source = load(tier, "a")
    assert data == b and source == "local"
    assert tier.stats["local_reads"] == 1 and tier.holds_locally("a")
    assert tier.info().extra["local_tier"]["entries"] == 1
    # both load paths say "local", with the tier file's version and change time (what the
    # verified log binds a record to)
    st = os.stat(tier.tier.entry_path("a"))
    for got in (tier.read_entry("a"), tier.read_verified("a")):
        version = got[1]
        assert got.source == "local"
        assert tuple(version) == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        assert version.ctime_ns == st.st_ctime_ns


def test_a_corrupt_local_copy_is_dropped_and_the_shared_store_serves(pair, caplog):
    tier, other = pair
    b = blob("c", n=4096)
    other.put("c", b)
    load(tier, "c")  # written behind
    path = tier.tier.entry_path("c")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # bit rot in the tier's copy (same size)
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        got = tier.read_verified("c")
    assert got.source == "remote"
    assert bytes(memoryview(got[0]).cast("B")) == b
    assert "cannot read c" in caplog.text
    tier.flush()  # the remote read is written behind again: a good copy
    data, source = load(tier, "c")
    assert data == b and source == "local"


def test_changes_on_the_shared_store_drop_local_copies_in_o_changes(pair, monkeypatch):
    tier, other = pair
    for i in range(50):
        other.put(f"k{i}", blob(f"k{i}", seed=i))
        load(tier, f"k{i}")
    assert tier.tier.count() == 50
    tier.sync()  # the 50 puts are in the journal: each copy is checked, and kept
    assert tier.tier.count() == 50
    checked = []
    real = tier.remote.unchanged
    monkeypatch.setattr(tier.remote, "unchanged", lambda e: checked.extend(e) or real(e))
    other.delete("k1")  # a purge elsewhere
    other.put("k2", blob("k2", seed=99, encoder_config="0123abcd0123abcd"))  # a rewrite
    assert tier.sync()
    assert not tier.tier.contains("k1") and not tier.tier.contains("k2")
    assert tier.tier.count() == 48 and tier.stats["invalidated"] == 2
    assert sorted(i for i, _, _ in checked) == ["k1", "k2"], "only what the journal named"
    assert load(tier, "k1") is None
    data, source = load(tier, "k2")
    assert source == "remote" and data == bytes(other.get("k2"))


def test_a_consumer_and_its_tier_read_the_journal_once_per_refresh(pair, monkeypatch):
    """The consumer's staging check and the tier's sync ask from the same cursor: one
    read of the shared store's journal serves both, and both see the change."""
    from encache.connectors.lookup import EntryLookup

    tier, other = pair
    other.put("j1", blob("j1"))
    reads = []
    real = tier.remote.changes_since
    monkeypatch.setattr(tier.remote, "changes_since", lambda c: reads.append(c) or real(c))
    lk = EntryLookup(tier, index_refresh_s=0.05, counters_flush_s=3600)
    try:
        assert lk.wait_index(5)
        assert lk.load_now("j1") is not None
        time.sleep(0.5)  # several refreshes: both cursors caught up
        n, t0 = len(reads), time.monotonic()
        time.sleep(0.5)
        refreshes = (time.monotonic() - t0) / 0.05
        assert len(reads) - n <= refreshes * 1.2 + 1, (len(reads) - n, refreshes)
        other.delete("j1")  # a purge elsewhere: the staged copy and the tier's go
        deadline = time.time() + 5
        while ("j1" in lk.staging or tier.tier.contains("j1")) and time.time() < deadline:
            time.sleep(0.05)
        assert not tier.tier.contains("j1")
        assert lk.load_now("j1") is None
    finally:
        lk.close()


def test_a_purge_from_another_process_while_this_node_was_down(pair, tmp_path, redis_server):
    tier, other = pair
    for i in ("p1", "p2"):
        other.put(i, blob(i))
        load(tier, i)
    tier.sync()
    tier.close()  # this node stops
    out = subprocess.run([sys.executable, "-m", "encache.cli", "purge", "--store",
                          f"{redis_server.url}?prefix={other.prefix}", "--all", "--yes",
                          "--quiet"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    again = open_store(redis_server.url, prefix=other.prefix, local_tier=str(tmp_path / "tier"))
    try:
        # resumed from its cursor: the purge is in the journal, dropped at start
        assert again.tier.count() == 0 and again.stats["invalidated"] == 2
        assert again.stats["full_checks"] == 0
        assert load(again, "p1") is None
    finally:
        again.close()


def test_outage_serves_local_copies_and_a_store_back_empty_drops_them(redis_factory, tmp_path,
                                                                      caplog):
    server = redis_factory()
    tier = open_store(server.url, local_tier=str(tmp_path / "tier"), socket_timeout=0.5,
                      connect_timeout=0.5, retries=0)
    other = RedisStore(server.url)
    try:
        near = blob("near", seed=1)
        other.put("near", near)
        other.put("far", blob("far", seed=2))
        load(tier, "near")
        time.sleep(0.1)  # (file times run on the kernel's coarse clock: copies written
        assert tier.sync()  # within SUSPECT_MARGIN_S of a sync are re-checked at start)
        server.kill()
        with caplog.at_level(logging.WARNING):
            assert tier.sync() is False
            assert tier.sync() is False
        assert sum("cannot sync the local tier" in r.message for r in caplog.records) == 1
        data, source = load(tier, "near")
        assert source == "local" and data == near
        assert tier.holds_locally("near") and not tier.holds_locally("far")
        with pytest.raises(StoreError):
            tier.read_verified("far")
        # a restarted consumer on the same tier, the store still down: serves what was
        # current at the last sync
        again = TieredStore(RedisStore(server.url, socket_timeout=0.5, connect_timeout=0.5,
                                       retries=0), DiskStore(tmp_path / "tier"))
        assert again.holds_locally("near")
        again.close()
        server.restart()  # back, empty (no persistence): everything changed
        assert tier.sync()
        assert not tier.tier.contains("near") and load(tier, "near") is None
    finally:
        tier.close()
        other.close()


@contextlib.contextmanager
def _tier_with_a_dead_primary(redis_cluster_factory, tmp_path, journal_on_victim: bool):
    """A 3-primary cluster that serves without full slot coverage, 30 entries copied into
    a consumer's tier and synced, then its first primary SIGKILLed for good: yields
    ``(the dead primary's name, another handle, the tier, blobs, identifiers on the dead
    primary, the others)``. The store's prefix puts its change journal on the dead
    primary, or elsewhere."""
    c = redis_cluster_factory(3, 0, config={"cluster-require-full-coverage": "no"})
    r = c.client()
    victim = c.primaries()[0]
    while True:
        prefix = fresh_prefix()
        on = r.get_node_from_key(f"{{{prefix}}}journal").port == victim.port
        if on == journal_on_victim:
            break
    url = c.url_for(nodes=3) + f"?prefix={prefix}&redirect_wait=0"
    other = open_store(url)
    tier = open_store(url, local_tier=str(tmp_path / "tier"))
    try:
        blobs = {f"p{n:02d}": blob(f"p{n:02d}", seed=n) for n in range(30)}
        for i, b in blobs.items():
            other.put(i, b)
            assert load(tier, i) is not None
        time.sleep(0.1)  # (past SUSPECT_MARGIN_S of the copies' file times)
        assert tier.sync() and tier.tier.count() == len(blobs)
        on_victim = [i for i in blobs if r.get_node_from_key(other.key(i)).port == victim.port]
        elsewhere = [i for i in blobs if i not in on_victim]
        assert on_victim and len(elsewhere) >= 2
        c.kill(victim)
        yield f"127.0.0.1:{victim.port}", other, tier, blobs, on_victim, elsewhere
    finally:
        tier.close()
        other.close()


def test_a_dead_primary_is_an_outage_of_its_copies_alone(redis_cluster_factory, tmp_path,
                                                         caplog):
    """A cluster primary lost for good (``cluster-require-full-coverage no``), and it holds
    the change journal: the tier keeps serving that primary's copies (as through an
    outage), and every other copy is checked against the primaries that answer, so a
    purge made meanwhile on a live primary still reaches the tier."""
    with _tier_with_a_dead_primary(redis_cluster_factory, tmp_path, True) as (
            dead, other, tier, blobs, on_victim, elsewhere), caplog.at_level(logging.WARNING):
        other.delete(elsewhere[0])  # its journal record is lost with the dead primary
        assert tier.sync()
        assert not tier.tier.contains(elsewhere[0])  # the purge reached the tier
        assert all(tier.tier.contains(i) for i in blobs if i != elsewhere[0])
        data, source = load(tier, on_victim[0])  # served unchecked, as in an outage
        assert source == "local"
        assert data == bytes(memoryview(blobs[on_victim[0]]).cast("B"))
        other.delete(elsewhere[1])
        tier._unjournaled_checks.ended = 0.0  # (paced: as if its interval had passed)
        assert tier.sync() and not tier.tier.contains(elsewhere[1])
        assert tier.stats["partial_syncs"] == 2 and tier.stats["sync_failures"] == 0
        info = tier.tier_info()
        assert info["parts_down"] == [dead] and not info["in_sync"]
    said = [m.getMessage() for m in caplog.records if "does not answer" in m.getMessage()]
    assert len(said) == 1 and "holds the change journal" in said[0]
    assert sum("change journal" in m.getMessage() and "unreachable" in m.getMessage()
               for m in caplog.records) == 1  # the writer's, once for both deletes


def test_a_dead_primary_without_the_journal_stays_down_between_full_checks(
        redis_cluster_factory, tmp_path, caplog):
    """A primary that does not hold the change journal dies: the tier's periodic full
    check finds it down (its copies kept, served unchecked), the journal still drops a
    copy purged on a live primary, and the syncs in between (which ask no copy of the
    dead primary) do not take it for back."""
    with _tier_with_a_dead_primary(redis_cluster_factory, tmp_path, False) as (
            dead, other, tier, blobs, on_victim, elsewhere), caplog.at_level(logging.WARNING):
        tier._next_full = 0.0  # (JOURNAL_FULL_CHECK_S elapsed)
        assert tier.sync() and tier.tier_info()["parts_down"] == [dead]
        assert all(tier.tier.contains(i) for i in blobs)
        other.delete(elsewhere[0])
        assert tier.sync() and not tier.tier.contains(elsewhere[0])  # the journal's
        assert tier.sync() and tier.tier_info()["parts_down"] == [dead]
    said = [m.getMessage() for m in caplog.records]
    assert sum("does not answer" in m for m in said) == 1
    assert not any("answers again" in m for m in said)


def test_a_write_behind_racing_a_change_is_held_back_until_a_sync_checks_it(pair):
    """Two remote reads whose write-behinds are not done when a sync runs: one purged
    meanwhile, one merely caught by a full check (as at a consumer's start). Both copies
    are written but neither is served; the next sync drops the purged one and lets the
    other be served locally (it used to be dropped, costing a remote read)."""
    tier, other = pair
    other.put("r", blob("r"))
    other.put("s", blob("s"))
    epoch = tier._epoch
    got_r = tier.remote.read_entry("r")  # reads, their write-behinds not yet done ...
    got_s = tier.remote.read_entry("s")
    other.delete("r")
    tier._cursor = None  # ... when a sync that cannot tell checks every copy
    assert tier.sync() and tier._checked_all_at > epoch
    tier._write_behind("r", got_r[0], epoch)
    tier._write_behind("s", got_s[0], epoch)
    tier.flush()
    assert tier.stats["written_unchecked"] == 2 and tier.tier.contains("s")
    assert not tier.holds_locally("r") and not tier.holds_locally("s")
    assert load(tier, "s")[1] == "remote"
    assert tier.sync()
    assert not tier.tier.contains("r") and tier.holds_locally("s")
    data, source = load(tier, "s")
    assert source == "local" and data == bytes(other.get("s"))


def test_a_full_local_disk_degrades_to_remote_only_with_one_warning(redis_server, tmp_path,
                                                                    caplog):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount not permitted here: {r.stderr.strip()}")
    try:
        prefix = fresh_prefix()
        tier = open_store(redis_server.url, prefix=prefix, local_tier=str(mnt / "tier"))
        other = RedisStore(redis_server.url, prefix=prefix)
        ids = [f"f{i}" for i in range(8)]
        with caplog.at_level(logging.WARNING):
            for i in ids:
                b = blob(i, n=8192, seed=3)  # 128 KiB each: the tmpfs holds ~3
                other.put(i, b)
                assert load(tier, i)[0] == b  # always served
        assert sum("is full or unwritable" in r.message for r in caplog.records) == 1
        assert 1 <= tier.tier.count() < len(ids)
        assert tier.stats["write_behind_dropped"] >= 1
        tier.close()
        other.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_the_local_tier_capacity_evicts_by_use(pair, tmp_path, redis_server):
    _, other = pair
    tier = open_store(redis_server.url, prefix=other.prefix, local_tier=str(tmp_path / "cap"),
                      local_tier_max_bytes=5 * 140_000)
    try:
        for i in range(10):
            other.put(f"c{i}", blob(f"c{i}", n=8192, seed=i))
            load(tier, f"c{i}")
        assert tier.tier.used_bytes() <= 5 * 140_000
        assert tier.tier.contains("c9")
    finally:
        tier.close()


def test_a_tier_cannot_be_the_shared_directory(tmp_path):
    with pytest.raises(StoreError, match="is the shared store itself"):
        open_store(str(tmp_path / "s"), local_tier=str(tmp_path / "s"))
