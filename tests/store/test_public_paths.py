"""The module paths docs/api.md documents keep working where the code moved: each is the
object its new home defines, not a copy."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("path,home", [
    ("encache.connectors.store.verify", "encache.connectors.store.ops.verify"),
    ("encache.connectors.store.transfer", "encache.connectors.store.ops.transfer"),
])
def test_a_documented_path_names_the_moved_objects(path, home):
    old, new = importlib.import_module(path), importlib.import_module(home)
    names = [n for n in vars(old) if not n.startswith("_")]
    assert names and all(getattr(old, n) is getattr(new, n) for n in names)


def test_the_store_face_and_the_backends_packages():
    from encache.connectors.store import open_store, tiered  # noqa: F401
    from encache.connectors.store.disk import DiskStore
    from encache.connectors.store.disk.store import DiskStore as same
    assert DiskStore is same
    importlib.import_module("encache.connectors.store.redis.cluster")
