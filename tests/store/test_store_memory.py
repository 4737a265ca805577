"""MemoryStore (``memory://NAME``), the reference backend: the contract suite and the
registry that opens it — a backend is a module, a registry entry and this module."""

from __future__ import annotations

import itertools

import pytest

from encache.connectors.store import StoreError, open_store
from encache.connectors.store.memory import MemoryStore
from store_contract import StoreContract, blob

_names = itertools.count()


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self):
        with open_store(f"memory://contract-{next(_names)}") as store:
            yield store


def test_handles_on_one_name_share_it_and_names_keep_apart():
    a = open_store("memory://shared-a", max_bytes=1 << 20)
    assert isinstance(a, MemoryStore) and a.info().max_bytes == 1 << 20
    a.put("x", blob("x"))
    assert open_store("memory://shared-a").contains("x")
    assert not open_store("memory://shared-b").contains("x")


@pytest.mark.parametrize("url", ["memory://", "memory://name/path"])
def test_a_memory_url_names_one_space(url):
    with pytest.raises(StoreError, match="memory://NAME"):
        open_store(url)
