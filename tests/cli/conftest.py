"""Fixtures of the CLI tests (the redis ones come from tests/conftest.py)."""

from __future__ import annotations

import pytest

from cli_support import populated


@pytest.fixture
def store(tmp_path):
    """A :func:`cli_support.populated` disk store (its known mix of entries)."""
    return populated(tmp_path / "store")
