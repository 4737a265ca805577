"""Fixtures of the lookup tests (``test_lookup_*.py``, :mod:`encache.connectors.lookup`)."""

from __future__ import annotations

import pytest

from encache.connectors.lookup import loader as lookup_mod  # where the load path reads and validates


@pytest.fixture
def counted(monkeypatch):
    """Count full validations (header parse + checksum) done by the lookup: of a buffer
    (``validate_blob``, the lookup's or the disk store's first-load check) or while
    reading a first load (``read_verified``)."""
    import encache.connectors.store.disk as disk_mod

    calls = []
    real, real_read = lookup_mod.validate_blob, disk_mod.read_verified

    def counting(blob, **kw):
        calls.append(kw.get("verify"))
        return real(blob, **kw)

    def counting_read(*args, **kw):
        calls.append(kw.get("verify"))
        return real_read(*args, **kw)
    monkeypatch.setattr(lookup_mod, "validate_blob", counting)
    monkeypatch.setattr(disk_mod, "validate_blob", counting)
    monkeypatch.setattr(disk_mod, "read_verified", counting_read)
    return calls
