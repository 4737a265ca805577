"""The backend registry: one lookup opens a URL, each backend declares its schemes, its
options (as its store class takes them) and whether its URL is a path here, and nothing
above the store asks what kind a store is."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from encache.connectors.store import StoreError, backend_for, check_url, open_store
from encache.connectors.store.registry import BACKENDS, find_backend, names_local_path

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("url,name,local", [
    ("/srv/cache", "disk", True), ("rel/dir", "disk", True), ("file:///srv/cache", "disk", True),
    ("redis://h:6379/0", "redis", False), ("rediss://h/0", "redis", False),
    ("unix:///run/redis.sock", "redis", False),
    ("redis+cluster://h:7000,h:7001", "redis-cluster", False),
    ("rediss+cluster://h:7000", "redis-cluster", False), ("memory://t", "memory", False),
])
def test_a_url_names_one_backend(url, name, local):
    assert backend_for(url).name == name and find_backend(url).name == name
    assert backend_for(url).local is local and names_local_path(url) is local


def test_schemes_are_declared_once():
    schemes = [s for b in BACKENDS for s in b.schemes]
    assert len(schemes) == len(set(schemes))
    assert len({b.name for b in BACKENDS}) == len(BACKENDS)


def test_an_unserved_url_is_refused_by_name():
    with pytest.raises(StoreError, match=r"unsupported store URL scheme 'ftp' \(use a path, "
                                         r"file://, .*memory://\)"):
        check_url("ftp://h/x")
    assert find_backend("ftp://h/x") is None and not names_local_path("ftp://h/x")
    assert find_backend("http://[::1") is None  # a malformed URL: no backend, no error


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_each_backend_declares_what_its_store_class_takes(backend):
    """The declared options are keyword parameters of the store class with the declared
    defaults; its ``backend`` is the registry's name; its own schemes (if it checks
    them) are the registry's."""
    cls = backend.store_class()
    assert cls.backend == backend.name
    assert tuple(getattr(cls, "SCHEMES", backend.schemes)) == backend.schemes
    params = {}
    for klass in reversed(cls.__mro__):  # a subclass passing **options on to its base
        if "__init__" in vars(klass):
            params.update(inspect.signature(klass.__init__).parameters)
    for opt in backend.options:
        assert opt.name in params, (backend.name, opt.name)
        assert params[opt.name].default == opt.default, (backend.name, opt.name)
        assert opt.doc and isinstance(opt.type, type)
    assert ("create" in params) is backend.creates


def test_open_store_passes_each_backend_its_own_options(tmp_path):
    """One option set serves every backend (a consumer's extra config): each takes the
    options it declares, the rest are left out."""
    mixed = {"max_bytes": 1 << 20, "prefix": "p:", "redirect_wait": 1.0, "fsync": False}
    with open_store(str(tmp_path / "d"), **mixed) as disk:
        assert disk.backend == "disk" and disk.max_bytes == 1 << 20
    with open_store("memory://opts", **mixed) as mem:
        assert mem.backend == "memory" and mem.info().max_bytes == 1 << 20


def test_nothing_above_the_store_asks_what_kind_a_store_is():
    """Above the store package no module names a backend's schemes or classes' kinds:
    it asks the registry (``names_local_path``, a backend's declared options)."""
    pattern = re.compile(r"REDIS_SCHEMES|CLUSTER_SCHEMES|is_redis_url|"
                         r"\.backend\s*[!=]=|scheme in \(")
    found = []
    for folder in ("cli", "jobs", "policy", "connectors"):
        for path in (ROOT / folder).rglob("*.py"):
            if "store" in path.relative_to(ROOT).parts[:2]:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []
