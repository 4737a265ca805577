"""The encoder-cache manager contract, checked on vLLM's own manager and on encache's.

Every test in ``TestContract`` runs against the installed vLLM's ``EncoderCacheManager``
and ``PolicyEncoderCacheManager`` with each online policy, and against every checked
release's own manager (its source recorded in tests/vllm_releases/, run here over the
installed vLLM's imports) with encache's policy in front of it, so a behaviour that the
scheduler relies on (reference counts, ``freed``, ``can_allocate`` budget semantics,
``reset`` ...) cannot differ between them on any release. Only the *choice* of victim
may differ.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from policy_vllm import FakeRequest  # noqa: E402  (the driver of vLLM's manager, tests/)

vllm_ecm = pytest.importorskip("vllm.v1.core.encoder_cache_manager")
from encache.connectors.vllm.compat import CHECKED_VERSIONS  # noqa: E402
from encache.connectors.vllm.manager import (PolicyEncoderCacheManager,  # noqa: E402
                                             PolicyManagerMixin)

EncoderCacheManager = vllm_ecm.EncoderCacheManager
RELEASES = Path(__file__).resolve().parents[1] / "vllm_releases"


def release_managers(version: str) -> tuple[type, type]:
    """(vLLM ``version``'s ``EncoderCacheManager``, encache's policy manager over it),
    from the release's recorded source."""
    import importlib.util

    path = RELEASES / f"encoder_cache_manager-{version}.py"
    spec = importlib.util.spec_from_file_location(f"_vllm_ecm_{version.replace('.', '_')}",
                                                  path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = mod.EncoderCacheManager
    return base, type(f"PolicyEncoderCacheManager_{version}", (PolicyManagerMixin, base), {})


RELEASE_MANAGERS = {v: release_managers(v) for v in CHECKED_VERSIONS}

FACTORIES = {
    "vllm": lambda size: EncoderCacheManager(cache_size=size),
    "encache-dlfu": lambda size: PolicyEncoderCacheManager(cache_size=size),
    "encache-dlfu-fixed": lambda size: PolicyEncoderCacheManager(
        cache_size=size, policy="dlfu", policy_params={"halflife": 4}),
    "encache-lru": lambda size: PolicyEncoderCacheManager(cache_size=size, policy="lru"),
    "encache-s3fifo": lambda size: PolicyEncoderCacheManager(cache_size=size, policy="s3fifo"),
    "encache-wtinylfu": lambda size: PolicyEncoderCacheManager(cache_size=size,
                                                               policy="wtinylfu"),
    "encache-fifo": lambda size: PolicyEncoderCacheManager(cache_size=size, policy="fifo"),
}
for _v, (_base, _policy) in RELEASE_MANAGERS.items():
    FACTORIES[f"vllm-{_v}"] = lambda size, b=_base: b(cache_size=size)
    FACTORIES[f"encache-dlfu@{_v}"] = lambda size, p=_policy: p(cache_size=size)
    FACTORIES[f"encache-lru@{_v}"] = lambda size, p=_policy: p(cache_size=size, policy="lru")

BIG = 1 << 30


def req(rid: str, *items: tuple[str, int]) -> FakeRequest:
    return FakeRequest(rid, list(items))


def alloc(m, r: FakeRequest, i: int = 0, budget: int = BIG) -> bool:
    """The scheduler's sequence for one input: check, else can_allocate + allocate."""
    if m.check_and_update_cache(r, i):
        return True
    if not m.can_allocate(r, i, budget, 0):
        return False
    m.allocate(r, i)
    return True


def invariants(m) -> None:
    used = sum(m.num_embeds_by_hash.values())
    assert set(m.cached) == set(m.num_embeds_by_hash)
    assert m.num_free_slots == m.cache_size - used
    unref = {h for h, refs in m.cached.items() if not refs}
    assert set(m.freeable) == unref
    assert m.num_freeable_slots == m.num_free_slots + sum(m.num_embeds_by_hash[h] for h in unref)
    for h in m.freeable:
        assert m.freeable[h] == m.num_embeds_by_hash[h]


@pytest.fixture(params=list(FACTORIES))
def make(request):
    return FACTORIES[request.param]


class TestContract:
    def test_miss_allocate_then_hit_adds_reference(self, make):
        m = make(100)
        a = req("a", ("x", 10))
        assert m.get_cached_num_encoder_embeds(a, 0) is None
        assert m.check_and_update_cache(a, 0) is False
        assert m.can_allocate(a, 0, BIG, 0)
        m.allocate(a, 0)
        assert m.num_free_slots == 90 and m.num_freeable_slots == 90
        b = req("b", ("x", 10))
        assert m.get_cached_num_encoder_embeds(b, 0) == 10
        assert m.check_and_update_cache(b, 0) is True
        assert m.cached["x"] == {"a", "b"}
        assert m.get_cached_input_ids(b) == {0}
        assert m.num_free_slots == 90  # a hit does not take space
        invariants(m)

    def test_compute_budget_refuses_without_side_effects(self, make):
        m = make(100)
        a = req("a", ("x", 30))
        assert m.can_allocate(a, 0, 29, 0) is False
        assert m.can_allocate(a, 0, 30, 0) is True
        assert m.num_free_slots == 100 and not m.cached

    def test_num_embeds_to_schedule_counts_against_space(self, make):
        m = make(100)
        keep = req("keep", ("k", 60))
        assert alloc(m, keep)  # referenced: not reclaimable
        a = req("a", ("x", 30))
        assert m.can_allocate(a, 0, BIG, 10) is True     # 30 + 10 <= 40 free
        assert m.can_allocate(a, 0, BIG, 11) is False    # 41 > 40 free + 0 freeable
        assert m.get_freed_mm_hashes() == []

    def test_release_makes_freeable_but_keeps_entry(self, make):
        m = make(100)
        a = req("a", ("x", 10), ("y", 20))
        assert alloc(m, a, 0) and alloc(m, a, 1)
        m.free(a)
        assert m.num_free_slots == 70 and m.num_freeable_slots == 100
        assert m.get_cached_input_ids(a) == set()
        b = req("b", ("y", 20))
        assert m.check_and_update_cache(b, 0) is True     # still cached
        assert m.num_freeable_slots == 80                 # y is referenced again
        invariants(m)

    def test_evicts_only_unreferenced_just_enough_and_reports_freed(self, make):
        m = make(100)
        pinned = req("p", ("p", 40))
        assert alloc(m, pinned)
        for i in range(6):
            r = req(f"r{i}", (f"e{i}", 10))
            assert alloc(m, r)
            m.free(r)
        assert m.num_free_slots == 0 and m.num_freeable_slots == 60
        n = req("n", ("new", 25))
        assert m.check_and_update_cache(n, 0) is False
        assert m.can_allocate(n, 0, BIG, 0) is True
        freed_now = set(m.freed)
        # exactly enough: three 10-embedding entries for 25 embeddings
        assert len(freed_now) == 3 and freed_now <= {f"e{i}" for i in range(6)}
        assert "p" in m.cached and m.num_free_slots == 30
        m.allocate(n, 0)
        assert set(m.get_freed_mm_hashes()) == freed_now
        assert m.get_freed_mm_hashes() == []
        invariants(m)

    def test_can_allocate_false_when_everything_is_referenced(self, make):
        m = make(50)
        for i in range(5):
            assert alloc(m, req(f"r{i}", (f"e{i}", 10)))
        x = req("x", ("x", 10))
        assert m.can_allocate(x, 0, BIG, 0) is False
        assert m.freed == [] and len(m.cached) == 5
        invariants(m)

    def test_freed_list_omits_entries_recached_in_same_pass(self, make):
        m = make(20)
        a = req("a", ("a", 10))
        b = req("b", ("b", 10))
        assert alloc(m, a) and alloc(m, b)
        m.free(a)
        m.free(b)
        c = req("c", ("c", 20))
        assert alloc(m, c)                      # evicts both a and b
        m.free(c)
        a2 = req("a2", ("a", 10))
        assert alloc(m, a2)                     # evicts c, re-caches a
        freed = m.get_freed_mm_hashes()
        assert "a" not in freed and set(freed) == {"b", "c"}
        invariants(m)

    def test_duplicate_item_held_until_last_occurrence_freed(self, make):
        m = make(100)
        r = req("r", ("x", 10), ("x", 10))
        assert alloc(m, r, 0)
        assert m.check_and_update_cache(r, 1) is True
        m.free_encoder_input(r, 0)
        assert m.cached["x"] == {"r"} and m.num_freeable_slots == 90
        m.free_encoder_input(r, 1)
        assert m.cached["x"] == set() and m.num_freeable_slots == 100
        invariants(m)

    def test_free_of_already_evicted_input_is_harmless(self, make):
        m = make(10)
        a = req("a", ("x", 10), ("y", 10))
        assert alloc(m, a, 0)
        m.free_encoder_input(a, 0)              # x now evictable
        assert alloc(m, a, 1)                   # evicts x
        assert "x" not in m.cached
        m.free(a)
        assert m.get_cached_input_ids(a) == set()
        invariants(m)

    def test_reset_restores_initial_state_and_cache_still_works(self, make):
        m = make(30)
        for i in range(5):
            r = req(f"r{i}", (f"e{i}", 10))
            assert alloc(m, r)
            m.free(r)
        held = req("held", ("h", 10))
        assert alloc(m, held)
        m.reset()
        assert m.num_free_slots == 30 and m.num_freeable_slots == 30
        assert not m.cached and not m.freeable and not m.freed
        assert not m.num_embeds_by_hash and m.get_cached_input_ids(held) == set()
        assert m.check_and_update_cache(req("z", ("e4", 10)), 0) is False
        for i in range(6):  # fills and evicts again without errors
            r = req(f"s{i}", (f"f{i}", 10))
            assert alloc(m, r)
            m.free(r)
        assert len(m.get_freed_mm_hashes()) == 3
        invariants(m)

    def test_random_operations_keep_invariants(self, make):
        rnd = random.Random(7)
        m = make(120)
        live: dict[str, FakeRequest] = {}
        sizes = {f"k{i}": rnd.choice([5, 10, 20, 40]) for i in range(40)}
        n = 0
        for _ in range(1500):
            op = rnd.random()
            if op < 0.5 or not live:
                n += 1
                keys = rnd.sample(sorted(sizes), rnd.randint(1, 3))
                r = req(f"q{n}", *[(k, sizes[k]) for k in keys])
                live[r.request_id] = r
                for i, k in enumerate(keys):
                    before_ref = {h for h, refs in m.cached.items() if refs}
                    if m.check_and_update_cache(r, i):
                        continue
                    need = sizes[k]
                    expect = need <= m.num_freeable_slots
                    free_before = m.num_free_slots
                    ok = m.can_allocate(r, i, BIG, 0)
                    assert ok == expect
                    assert before_ref <= set(m.cached)       # referenced never evicted
                    if ok:
                        assert m.num_free_slots >= need
                        evicted = m.num_free_slots - free_before
                        if evicted:  # stopped as soon as enough was free
                            smallest = min(sizes[h] for h in m.freed[-1:])
                            assert m.num_free_slots - smallest < need
                        m.allocate(r, i)
                    invariants(m)
            elif op < 0.9:
                rid = rnd.choice(sorted(live))
                m.free(live.pop(rid))
            else:
                m.get_freed_mm_hashes()
            invariants(m)


@pytest.mark.parametrize("release", ["installed", *CHECKED_VERSIONS])
def test_fifo_policy_is_exactly_vllms_manager(release):
    """Differential test: same random operations, identical observable state, on the
    installed vLLM's manager and on each checked release's; some requests hold the same
    item twice (0.33 and later count a request's references per item)."""
    rnd = random.Random(3)
    base, policy = ((EncoderCacheManager, PolicyEncoderCacheManager) if release == "installed"
                    else RELEASE_MANAGERS[release])
    a, b = base(cache_size=100), policy(100, policy="fifo")
    sizes = {f"k{i}": rnd.choice([5, 10, 25]) for i in range(30)}
    live = []
    for n in range(2000):
        if rnd.random() < 0.55 or not live:
            keys = rnd.sample(sorted(sizes), rnd.randint(1, 3))
            if rnd.random() < 0.2:
                keys.append(keys[0])  # the same image twice in one request
            r = req(f"q{n}", *[(k, sizes[k]) for k in keys])
            live.append(r)
            for i in range(len(keys)):
                ra, rb = a.check_and_update_cache(r, i), b.check_and_update_cache(r, i)
                assert ra == rb
                if not ra:
                    ca, cb = a.can_allocate(r, i, 30, 0), b.can_allocate(r, i, 30, 0)
                    assert ca == cb
                    if ca:
                        a.allocate(r, i)
                        b.allocate(r, i)
        else:
            r = live.pop(rnd.randrange(len(live)))
            a.free(r)
            b.free(r)
        assert list(a.freeable.items()) == list(b.freeable.items())
        assert a.cached == b.cached and a.num_free_slots == b.num_free_slots
        if n % 7 == 0:
            assert a.get_freed_mm_hashes() == b.get_freed_mm_hashes()
    assert b.stats["evictions"] > 20 and b.stats["hits"] > 50


def test_create_manager_reads_manager_config_and_resolves_by_path():
    from vllm.config.ec_manager_config import EncoderCacheManagerConfig

    path = "encache.connectors.vllm.manager.PolicyEncoderCacheManager"
    cfg = EncoderCacheManagerConfig(encoder_cache_manager_cls=path,
                                    manager_config={"policy": "s3fifo",
                                                    "policy_params": {"small_ratio": 0.2}})
    cls = cfg.get_encoder_cache_manager_obj()
    assert cls is PolicyEncoderCacheManager
    m = cls.create_manager(cache_size=64, vllm_config=SimpleNamespace(ec_manager_config=cfg))
    assert m.cache_size == 64 and m.policy.name == "s3fifo" and m.policy.small_ratio == 0.2
    default = cls.create_manager(
        cache_size=64, vllm_config=SimpleNamespace(ec_manager_config=EncoderCacheManagerConfig()))
    assert default.policy.name == "dlfu"


@pytest.mark.parametrize("bad", ["belady", "static", "nope"])
def test_offline_or_unknown_policies_are_refused(bad):
    with pytest.raises(ValueError):
        PolicyEncoderCacheManager(cache_size=10, policy=bad)


def test_policy_manager_keeps_frequent_items_that_vllm_evicts():
    """Same stream, same capacity: a hot item survives a scan under dlfu, not under vLLM."""
    results = {}
    for name in ("vllm", "encache-dlfu"):
        m = FACTORIES[name](40)
        hits = 0
        n = 0
        for rnd_round in range(30):
            n += 1
            r = req(f"h{n}", ("hot", 10))
            hits += m.check_and_update_cache(r, 0)
            if not hits or not m.cached.get("hot"):
                alloc(m, r)
            m.free(r)
            for j in range(4):  # a scan of one-off items between hot reads
                n += 1
                s = req(f"s{n}", (f"once{rnd_round}-{j}", 10))
                assert alloc(m, s)
                m.free(s)
        results[name] = hits
    assert results["encache-dlfu"] >= 25 and results["vllm"] == 0
