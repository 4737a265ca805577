"""Fixtures of the lookup tests (``test_lookup_*.py``, :mod:`encache.connectors.lookup`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from encache.connectors.lookup import loader as lookup_mod  # where the load path reads and validates


@pytest.fixture
def counted(monkeypatch):
    """Count full validations (header parse + checksum) done by the lookup: of a buffer
    (``validate_blob``, the lookup's or the disk store's first-load check) or while
    reading a first load (``read_verified``)."""
    import encache.connectors.store.disk.in_flight as in_flight_mod
    import encache.connectors.store.disk.store as disk_mod

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
    monkeypatch.setattr(in_flight_mod, "validate_blob", counting)  # (a write in flight's)
    monkeypatch.setattr(in_flight_mod, "read_verified", counting_read)
    return calls


WRITER = r"""
import sys, time
import numpy as np
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.store.entry import encode_parts
root, ident, encoded_here, before_bytes, before_commit = sys.argv[1:]
arr = np.random.default_rng(5).standard_normal((256, 2688)).astype(np.float32)
def visible():
    print("visible", flush=True)
    time.sleep(float(before_bytes))
def written():
    print("written", flush=True)
    time.sleep(float(before_commit))
parts = encode_parts(ident, arr.view(np.uint8), "F32", arr.shape, model="m")
DiskStore(root, fsync=False).put(ident, parts, encoded_here=encoded_here == "1",
                                 on_visible=visible, on_written=written)
print("committed", flush=True)
"""


@pytest.fixture
def writer_process():
    """``start(root, identifier, *, encoded_here, before_bytes, before_commit, until)``: a
    real process writing a 2.75 MB entry (256 x 2688 fp32, ``ARR`` of the in-flight tests)
    to the disk store at ``root``. It pauses ``before_bytes`` s once the write is visible
    (its temp file exists, empty) and ``before_commit`` s once its bytes are all in,
    uncommitted; ``start`` returns once the process said ``until`` ("visible" or
    "written"). ``encoded_here``: the producer records the bytes in the verified log."""
    procs = []

    def start(root, identifier: str, *, encoded_here: bool = False, before_bytes: float = 0,
              before_commit: float = 0, until: str = "visible"):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), identifier, "1" if encoded_here else "0",
             str(before_bytes), str(before_commit)], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        while (line := proc.stdout.readline().strip()) != until:
            assert line, f"the writer exited before saying {until!r}"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
