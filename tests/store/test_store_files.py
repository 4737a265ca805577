"""atomic_write_json (precompute manifests): whole file or the old one, never a temp
file left behind; and the manifest that uses it round-trips."""

from __future__ import annotations

import json
import os

import pytest

from encache.jobs.corpus import Manifest
from encache.connectors.store.files import atomic_write_json


def test_atomic_write_json_replaces_whole_and_cleans_up(tmp_path):
    p = tmp_path / "sub" / "m.json"
    atomic_write_json(p, {"a": 1})
    assert json.loads(p.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        atomic_write_json(p, {"a": object()})  # fails mid-dump
    assert json.loads(p.read_text()) == {"a": 1}  # the old file, untouched
    assert os.listdir(p.parent) == ["m.json"]  # no temp file left


def test_manifest_save_and_load(tmp_path):
    from encache.jobs.corpus import walk

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.png").write_bytes(b"x")
    f = next(iter(walk(str(tmp_path / "c"))))
    key = {"corpus": "c", "model": "m"}
    m = Manifest(tmp_path / "man" / "k.json", key)
    m.record(f, "ident1")
    m.save()
    assert Manifest.load(tmp_path / "man" / "k.json", key).lookup(f) == "ident1"
    assert Manifest.load(tmp_path / "man" / "k.json", {"other": 1}).lookup(f) is None
