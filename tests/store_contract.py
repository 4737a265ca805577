"""The store contract suite (zarr's StoreTests pattern): subclass per backend.

A backend test module defines ``class TestXStore(StoreContract)`` with a ``store``
fixture returning a fresh, empty store (``make_store`` — by default ``store.reopen()`` —
gives a second handle on the same data, used to check cross-process visibility).

Every capability declared on :class:`encache.connectors.store.base.Store` is exercised
here on every backend: a backend either does better than the ABC's default (and says so
with its ``supports_*`` flag) or inherits the default, and both must honour the contract.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from encache.connectors.store import CorruptEntry, decode, encode, encode_parts
from encache.connectors.store.files import file_version


def blob(identifier: str, n: int = 64, seed: int = 0, **meta) -> bytes:
    arr = np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float16)
    return encode(identifier, arr.view(np.uint8), "F16", arr.shape, model="m", **meta)


class StoreContract:
    @pytest.fixture
    def store(self):  # pragma: no cover - overridden
        raise NotImplementedError

    def make_store(self, store):
        return store.reopen()

    def test_maintain_is_housekeeping_only(self, store):
        """``maintain()`` (a consumer's periodic call) never changes what is stored."""
        b = blob("m1")
        store.put("m1", b)
        assert store.read_entry("m1") is not None
        store.maintain()
        assert bytes(store.get("m1")) == b
        assert sorted(store.identifiers()) == ["m1"]

    def test_put_takes_one_buffer_or_several(self, store):
        """``put(parts)``: bytes, a numpy array (what a load hands a local tier's
        write-behind) or a list of buffers to join; each stores the same entry."""
        b = blob("pb", n=4096)
        arr = np.frombuffer(b, np.uint8).copy()
        for ident, parts in (("pb", b), ("pb", arr), ("pb", [b[:100], memoryview(b)[100:]])):
            store.put(ident, parts)
            assert bytes(memoryview(store.get(ident)).cast("B")) == b

    def test_missing_is_none(self, store):
        assert store.get("nope") is None
        assert not store.contains("nope")
        assert store.stat("nope") is None
        assert store.delete("nope") is False

    def test_put_get_roundtrip(self, store):
        b = blob("a" * 64)
        assert store.put("a" * 64, b) == len(b)
        got = store.get("a" * 64)
        assert bytes(got) == b
        meta, data = decode(got, identifier="a" * 64)
        assert meta.shape == (64, 8) and meta.dtype == "F16" and meta.model == "m"
        assert store.contains("a" * 64)

    def test_read_entry_serves_the_same_bytes(self, store):
        """The serving path (``read_entry``) returns what ``get`` does, small and large."""
        assert store.read_entry("absent") is None
        for ident, n in (("small", 64), ("large", 8192)):  # 1 KiB and 128 KiB of tensor
            b = blob(ident, n=n)
            store.put(ident, b)
            buf, version = store.read_entry(ident)
            assert bytes(memoryview(buf).cast("B")) == b
            if hasattr(store, "flush"):
                # a tiered store serves the first read from the shared store and writes
                # the copy behind into its tier, which serves the later ones: another
                # copy, so another version (the ABC's "this exact stored copy")
                store.flush()
                buf, version = store.read_entry(ident)
                assert bytes(memoryview(buf).cast("B")) == b
            again = store.read_entry(ident)[1]
            assert version == again  # unchanged entry: same version (or None: no versions)
            store.put(ident, blob(ident, n=n, seed=9))
            newer = store.read_entry(ident)[1]
            assert version is None or newer != version  # a rewrite is a new version
            assert bytes(memoryview(buf).cast("B")) == b  # a held buffer keeps its bytes

    def test_put_parts_equals_put_bytes(self, store):
        arr = np.ones((4, 4), np.float32)
        header, view = encode_parts("p", arr.view(np.uint8), "F32", arr.shape)
        store.put("p", [header, view])
        assert bytes(store.get("p")) == header + view.tobytes()

    def test_overwrite_replaces_whole(self, store):
        store.put("k", blob("k", seed=1))
        store.put("k", blob("k", n=32, seed=2))
        meta, _ = decode(store.get("k"))
        assert meta.shape == (32, 8)

    def test_delete(self, store):
        store.put("d", blob("d"))
        assert store.delete("d") is True
        assert store.get("d") is None and not store.contains("d")
        assert "d" not in set(store.identifiers())

    def test_identifiers_and_scan(self, store):
        ids = {f"{i:064x}" for i in range(5)} | {"lora1:" + "f" * 64}
        blobs = {i: blob(i) for i in ids}
        for i in ids:
            store.put(i, blobs[i])
        assert set(store.identifiers()) == ids
        infos = {e.identifier: e for e in store.scan()}
        assert set(infos) == ids
        e = infos["lora1:" + "f" * 64]
        assert e.lora == "lora1" and e.error is None
        assert e.size == len(blobs["lora1:" + "f" * 64])
        assert all(x.meta is not None and x.meta.shape == (64, 8) for x in infos.values())
        assert all(x.created is not None for x in infos.values())
        # a walk that may be partial (management commands): on a store that answers, the
        # same entries and no part named (a dead part: test_cli_shared_stores.py)
        unreachable: list = []
        assert {e.identifier for e in store.scan(unreachable=unreachable)} == ids
        assert set(store.identifiers(unreachable=unreachable)) == ids
        assert store.count(unreachable=unreachable) == len(ids) and unreachable == []
        # a reader index's listing (a hint): the same on a store at rest, deletes gone
        assert set(store.identifiers(hint=True)) == ids
        store.delete(f"{0:064x}")
        assert set(store.identifiers(hint=True)) == ids - {f"{0:064x}"}

    def test_stat_reports_size_and_meta(self, store):
        b = blob("s")
        store.put("s", b)
        info = store.stat("s")
        assert info.size == len(b) and info.meta.identifier == "s" and info.error is None

    @pytest.mark.parametrize("ident", ["../escape", "a/b", ".hidden", "x" * 300, "sp ace", "ü-unicode"])
    def test_unsafe_identifiers_roundtrip(self, store, ident):
        store.put(ident, blob(ident))
        assert decode(store.get(ident), identifier=ident)[0].identifier == ident
        assert ident in set(store.identifiers())
        assert ident in set(store.identifiers(hint=True))

    def test_nul_identifier_rejected(self, store):
        with pytest.raises(ValueError):
            store.put("a\x00b", b"x")

    def test_corrupt_blob_detected_by_codec(self, store):
        b = bytearray(blob("c"))
        b[-3] ^= 0xFF
        store.put("c", bytes(b))
        with pytest.raises(CorruptEntry) as e:
            decode(store.get("c"), identifier="c")
        assert e.value.reason == "checksum"

    def test_counters_add_and_reset(self, store):
        store.add_counters({"hits": 2, "misses": 1})
        store.add_counters({"hits": 3, "load_seconds": 0.5})
        c = store.read_counters()
        assert c["hits"] == 5 and c["misses"] == 1 and abs(c["load_seconds"] - 0.5) < 1e-9
        store.reset_counters()
        assert store.read_counters().get("hits", 0) == 0

    def test_concurrent_counter_updates_are_not_lost(self, store):
        def bump():
            for _ in range(20):
                store.add_counters({"hits": 1})
        threads = [threading.Thread(target=bump) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.read_counters()["hits"] == 80

    def test_lock_is_exclusive(self, store):
        from encache.connectors.store import LockBusy
        with store.lock("precompute"):
            other = self.make_store(store)
            with pytest.raises(LockBusy):
                with other.lock("precompute", wait=0.2):
                    pass
        with self.make_store(store).lock("precompute", wait=0):
            pass

    def test_removal_records(self, store):
        """Entries a policy removed are remembered per reason (the newest reason wins),
        seen by a second handle, counted, and forgotten once stored again; a store
        without records (the ABC's default) remembers nothing."""
        store.record_removals(["r1", "r2", None], "evicted")
        store.record_removals(["r2", "r3"], "older-than")
        other = self.make_store(store)
        if not store.supports_removal_records:
            assert other.removals() == {} and other.removal_counts() == {}
            return
        assert other.removals() == {"r1": "evicted", "r2": "older-than", "r3": "older-than"}
        assert other.removal_counts() == {"evicted": 1, "older-than": 2}
        other.forget_removals(["r1", "r3", "never"])
        assert store.removals() == {"r2": "older-than"}
        assert store.removal_counts() == {"evicted": 0, "older-than": 1}

    def test_second_handle_sees_writes(self, store):
        store.put("shared", blob("shared"))
        assert bytes(self.make_store(store).get("shared")) == bytes(store.get("shared"))

    def test_info(self, store):
        info = store.info()
        assert info.backend == store.backend


    # -- capabilities (declared on the ABC; defaults or backend versions) -----------------
    def test_capability_flags_are_declared(self, store):
        from encache.connectors.store.base import Store
        assert isinstance(store, Store)
        for flag in ("supports_entry_path", "supports_used_bytes", "supports_batch",
                     "supports_index_version", "supports_capacity_warnings", "mapped_loads",
                     "supports_live_counters", "supports_verified_log", "supports_verified_reads",
                     "supports_change_journal", "journal_complete", "supports_in_flight",
                     "supports_removal_records",
                     "supports_failure_domains", "local", "read_only"):
            assert isinstance(getattr(store, flag), bool), flag
        assert isinstance(store.url, str) and store.url
        assert store.max_bytes is None or store.max_bytes > 0

    def test_failure_domains_name_the_part_serving_an_entry(self, store):
        """``supports_failure_domains``: once the store was reached, every entry's domain
        is a name, the same for the same entry, and a probe of a serving part answers;
        without it, no entry has one (the store fails as a whole) and a probe is a ping."""
        ids = [f"fd{i:02d}" for i in range(8)]
        for i in ids:
            store.put(i, blob(i))
        assert store.get(ids[0]) is not None
        domains = [store.failure_domain(i) for i in ids]
        if not store.supports_failure_domains:
            assert domains == [None] * len(ids)
        else:
            assert all(isinstance(d, str) and d for d in domains)
            assert domains == [store.failure_domain(i) for i in ids]
            for d in set(domains):
                store.probe_domain(d)
            store.probe_domain("no-such-part:1")  # not in the store: served by others
        store.probe_domain("any")  # (no raise: the store serves)

    def test_live_counters_are_read_back(self, store):
        live = store.live_counters()
        if not store.supports_live_counters:
            assert live is None
            return
        before = store.read_counters().get("hits", 0)
        live.add("hits", 3)
        live.add_many({"misses": 2})
        counters = store.read_counters()
        assert counters.get("hits", 0) == before + 3
        assert counters.get("misses", 0) >= 2

    def test_verified_log_is_shared_by_handles_of_the_store(self, store):
        """What one handle's consumer verified, another handle's (a restarted consumer)
        reads back; stores without the capability keep no log."""
        log = store.verified_log()
        if not store.supports_verified_log:
            assert log is None
            return
        if log is None:  # declared, but not kept here (network filesystem, no boot id)
            return
        from encache.connectors.store.verified_log import record_key
        key = record_key("vl", (1, 2, 3, 4))
        log.append(key, 5)
        log.close()
        other = store.reopen()
        try:
            table = other.verified_log().load()
            assert table.holds(key, 5)
            assert not table.holds(key, 6) and not table.holds(record_key("vl", (1, 2, 3, 5)), 5)
        finally:
            other.close()

    def test_read_verified_checks_on_the_way_in(self, store):
        """``read_verified``: the entry's bytes, validated, with the version a reader can
        reuse; a flipped byte is caught (checksum asked) or not (a version verified
        before); absent is None."""
        b = blob("rv", n=4096)
        store.put("rv", b)
        got = store.read_verified("rv")
        assert got is not None
        buf, version, meta, offset, hashed = got
        assert bytes(buf) == b and hashed and meta.shape == (4096, 8)
        assert bytes(memoryview(buf).cast("B")[offset:offset + meta.data_bytes]) == b[-4096 * 16:]
        assert store.read_verified("nope") is None
        bad = bytearray(b)
        bad[-3] ^= 0xFF
        store.put("rv", bytes(bad))
        with pytest.raises(CorruptEntry):
            store.read_verified("rv")
        assert store.read_verified("rv", lambda version: False)[4] is False

    def test_read_verified_receives_into_the_callers_buffer(self, store):
        """``read_verified(into=...)``: an entry the backend receives or reads into
        memory of its own lands in the buffer ``into(n)`` made (a memfd here, as a
        consumer with worker processes asks); a mapped or kept copy is served as it is.
        Either way the entry is whole and checked."""
        from encache.connectors.store.memfd import SharedBuffer, shared_buffer
        b = blob("ri", n=4096)
        store.put("ri", b)
        made = []

        def into(n):
            made.append(shared_buffer(n))
            return made[-1]

        buf, _, meta, offset, hashed = store.read_verified("ri", into=into)
        assert bytes(buf) == b and hashed and len(made) <= 1
        assert (buf is made[0]) if made else not isinstance(buf, SharedBuffer)
        if made:
            assert len(made[0]) == len(b)
        if store.backend == "redis" or store.backend == "redis-cluster":
            assert made, "a received entry goes into the caller's buffer"

    def test_unchanged_tells_a_purge_and_a_rewrite(self, store):
        """``unchanged``: a held entry is still the stored version until it is deleted or
        rewritten (by another handle too); a copy of the same bytes and stamps is the same
        version."""
        for i in ("u1", "u2", "u3"):
            store.put(i, blob(i, seed=1, created=100.0))
        held = []
        for i in ("u1", "u2", "u3"):
            buf, version, meta, _, _ = store.read_verified(i)
            held.append((i, version, meta))
        assert store.unchanged(held) == [True, True, True]
        other = self.make_store(store)
        other.delete("u1")
        other.put("u2", blob("u2", seed=2))  # rewritten
        assert store.unchanged(held) == [False, False, True]
        assert store.unchanged([]) == []
        failed: dict = {}  # (part by part, where parts fail apart: all answer here)
        assert store.unchanged_by_part(held, failed) == [False, False, True] and failed == {}

    def test_change_journal_names_what_changed(self, store):
        """``changes_since``: a reader's cursor, then the identifiers another handle put
        or deleted since (O(changes)); nothing since: an empty set. Without a journal:
        "cannot tell" (None), and the reader re-checks what it holds."""
        cursor, changed = store.changes_since(None)
        assert changed is None
        other = self.make_store(store)
        other.put("j1", blob("j1"))
        other.put("j2", blob("j2"))
        other.delete("j1")
        other.delete_many(["j2", "j3"])
        cursor2, changed = store.changes_since(cursor)
        if not store.supports_change_journal:
            assert changed is None
            return
        assert {"j1", "j2", "j3"} <= changed
        assert store.changes_since(cursor2) == (cursor2, set())
        other.put("j4", blob("j4"))
        assert store.changes_since(cursor2)[1] == {"j4"}

    def test_in_flight_lasts_from_visible_to_the_commit(self, store):
        """``supports_in_flight``: another handle sees a write as in flight from
        ``on_visible`` (no bytes to read yet) through ``on_written`` (its bytes readable,
        checked) until the commit, then the entry; an absent or committed entry is not in
        flight. Without it: never in flight, and ``put`` commits before returning."""
        other = self.make_store(store)
        assert not store.in_flight("f1") and store.read_in_flight("f1") is None
        if not store.supports_in_flight:
            other.put("f1", blob("f1"))
            assert not store.in_flight("f1") and store.contains("f1")
            assert store.read_in_flight("f1") is None and store.in_flight_paths("f1") == []
            return
        seen = []

        data = blob("f1")

        def visible():  # before any byte: in flight, nothing whole to read, not stored
            seen.append((store.in_flight("f1"), store.contains("f1"),
                         store.read_in_flight("f1")))
            if store.supports_entry_path:  # its temp file, never a stray while written
                seen.append(len(store.in_flight_paths("f1")))
                assert store.stray_files(older_than=0.0) == []

        def written():
            got = store.read_in_flight("f1")  # the whole entry, checked, before the commit
            seen.append((store.in_flight("f1"), store.contains("f1"),
                         got is not None and bytes(got[0]) == data))
            if store.supports_entry_path:  # the temp file, already the committed version
                paths = store.in_flight_paths("f1")
                seen.append([file_version(os.stat(p)) for p in paths] == [tuple(got[1])])

        other.put("f1", data, on_visible=visible, on_written=written)
        assert seen == ([(True, False, None)] + [1] * store.supports_entry_path
                        + [(True, False, True)] + [True] * store.supports_entry_path)
        assert not store.in_flight("f1") and store.contains("f1")
        assert store.read_in_flight("f1") is None and store.in_flight_paths("f1") == []
        if store.supports_entry_path:  # the commit kept the version
            assert file_version(os.stat(store.entry_path("f1"))) == tuple(
                store.read_entry("f1")[1])

    def test_get_many_keeps_order_and_misses(self, store):
        blobs = {i: blob(i, seed=n) for n, i in enumerate(("a", "b", "c"))}
        for i, b in blobs.items():
            store.put(i, b)
        got = store.get_many(["c", "nope", "a", "c"])
        assert [bytes(memoryview(g).cast("B")) if g is not None else None for g in got] == \
            [blobs["c"], None, blobs["a"], blobs["c"]]
        assert store.get_many([]) == []

    def test_delete_many_counts_and_per_item(self, store):
        ids = [f"dm{i}" for i in range(6)]
        for i in ids:
            store.put(i, blob(i))
        assert store.delete_many(i for i in ids[:3]) == 3  # any iterable
        assert store.delete_many([ids[0], "never-there"]) == 0
        assert store.delete_many([ids[3], "never-there", ids[4]], per_item=True) == \
            [True, False, True]
        assert set(store.identifiers()) == {ids[5]}
        assert all(store.get(i) is None and store.stat(i) is None for i in ids[:5])

    def test_index_version_changes_on_put_and_delete(self, store):
        v0 = store.index_version()
        if not store.supports_index_version:
            assert v0 is None
            return
        assert store.index_version() == v0  # reads do not change it
        store.put("iv", blob("iv"))
        v1 = store.index_version()
        assert v1 != v0
        store.get("iv"), store.contains("iv"), list(store.scan())
        assert store.index_version() == v1
        store.delete("iv")
        v2 = store.index_version()
        assert v2 != v1
        store.delete_many(["iv2"])
        store.put("iv3", blob("iv3"))
        assert store.index_version() != v2

    def test_used_bytes_and_count(self, store):
        assert store.count() == 0 and store.used_bytes() == 0
        sizes = [store.put(i, blob(i, n=16 * (k + 1))) for k, i in enumerate(("u1", "u2", "u3"))]
        assert store.count() == 3
        assert store.used_bytes() == sum(sizes) == sum(e.size for e in store.scan())
        store.delete("u2")
        assert store.count() == 2 and store.used_bytes() == sizes[0] + sizes[2]

    def test_ping(self, store):
        rtt = store.ping()
        assert isinstance(rtt, float) and 0 <= rtt < 5

    def test_capacity_warnings_are_strings(self, store):
        warnings = store.capacity_warnings()
        assert isinstance(warnings, list) and all(isinstance(w, str) and w for w in warnings)
        if not store.supports_capacity_warnings:
            assert warnings == []

    def test_stray_files_and_prune(self, store):
        store.put("sp", blob("sp"))
        strays = store.stray_files(older_than=0.0)
        assert isinstance(strays, list) and all(isinstance(p, Path) for p in strays)
        assert strays == []  # nothing was interrupted
        assert store.prune() == 0  # nothing was lost behind the store's back
        assert store.contains("sp")

    def test_a_read_says_what_it_read_and_where_from(self, store):
        """Every serving read returns its record (``Loaded``): it unpacks as the method's
        tuple and names the same things; ``source`` says which tier served it (None: a
        store without tiers)."""
        from encache.connectors.store.loaded import Loaded
        from encache.connectors.store.tiered import TieredStore
        b = blob("lr", n=4096)
        store.put("lr", b)
        tiers = ("local", "remote") if isinstance(store, TieredStore) else (None,)
        for got in (store.read_entry("lr"), store.read_verified("lr")):
            assert isinstance(got, Loaded) and got.blob is got[0] and got.version is got[1]
            assert bytes(got.blob) == b and got.source in tiers
        got = store.read_verified("lr")
        assert (got.meta, got.offset, got.checksummed) == tuple(got[2:])
        assert got.meta.shape == (4096, 8) and got.checksummed is True
        assert store.read_entry("lr").meta is None  # not checked yet: no header

    def test_a_pinned_read_keeps_the_bytes_it_read(self, store):
        """``Loaded.pin()``: None (the bytes are private: ship them), or ``(fd, ref)``
        that a process on this host opens (``open_ref``) to find exactly the bytes read,
        even once the entry was rewritten and deleted; a read of an entry rewritten since
        pins nothing or still the bytes it read, never the new ones."""
        from encache.connectors.store.loaded import open_ref
        from encache.connectors.store.memfd import shared_buffer
        b = blob("pn", n=4096)
        store.put("pn", b)
        for read in (store.read_entry, lambda i: store.read_verified(i, into=shared_buffer)):
            got = read("pn")
            pinned = got.pin()
            if store.supports_entry_path and store.local:
                assert pinned is not None, "a local store's file is pinned, not shipped"
            if pinned is None:
                continue
            fd, ref = pinned
            try:
                store.put("pn", blob("pn", n=4096, seed=9))
                again = got.pin()  # the entry was rewritten: never the new bytes
                if again is not None:
                    os.close(again[0])
                    assert again[1][2] == ref[2]
                store.delete("pn")
                f, st = open_ref(ref)
                try:
                    assert os.pread(f, st.st_size, 0) == b
                finally:
                    os.close(f)
            finally:
                os.close(fd)
            store.put("pn", b)

    def test_entry_path(self, store):
        from encache.connectors.store import StoreError
        b = blob("ep")
        store.put("ep", b)
        if store.supports_entry_path:
            path = store.entry_path("ep")
            assert Path(path).read_bytes() == b and store.root is not None
            assert Path(path).is_relative_to(store.root)
        else:
            assert store.root is None
            with pytest.raises(StoreError):
                store.entry_path("ep")

    def test_reopen_is_an_independent_handle(self, store):
        other = store.reopen()
        assert other is not store and type(other) is type(store) and other.url == store.url
        b = blob("ro")
        other.put("ro", b)
        assert bytes(memoryview(store.get("ro")).cast("B")) == b
        other.close()
        assert store.contains("ro")  # closing one handle leaves the other working

    def test_notes_are_beside_the_entries(self, store):
        store.put("n1", blob("n1"))
        where = store.put_note("job-marker", "tok-1")
        assert isinstance(where, str) and where
        assert store.get_note("job-marker") == "tok-1"
        other = store.reopen()  # another handle (another node) reads it back
        assert other.get_note("job-marker") == "tok-1"
        other.close()
        assert sorted(store.identifiers()) == ["n1"] and store.count() == 1  # not an entry
        assert store.get_note("no-such-note") is None
        store.delete_note("job-marker")
        store.delete_note("job-marker")  # absent: no error
        assert store.get_note("job-marker") is None

    def test_summary_if_unchanged_is_none_or_a_full_scan(self, store):
        from encache.connectors.store.summary import summarize_entries
        from encache.connectors.store.ops.scanning import scan
        for i in ("s1", "s2", "s3"):
            store.put(i, blob(i, n=32))
        full = summarize_entries(scan(store))
        list(store.scan())  # a scan may record what a later summary can reuse
        fast = store.summary_if_unchanged()
        assert fast is None or fast == full
        store.delete("s2")
        fast = store.summary_if_unchanged()
        assert fast is None or fast == summarize_entries(scan(store))
