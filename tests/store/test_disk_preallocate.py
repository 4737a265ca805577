"""A disk store's put reserves its file's blocks before the entry is in flight
(``files.preallocate``): on ext4 and XFS, from ``PREALLOCATE_MIN_BYTES``. Faster writes (what
an EPD PD load waits for, ``benchmarks/write.json``), and a full disk fails a put before any
reader waits for it. Real filesystems: this test's own (ext4 here and in CI) and a small
loop-mounted ext4 (the tests run as root; skipped, with the reason, where mounting is not
permitted)."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess

import numpy as np
import pytest

from encache.connectors.store import files
from encache.connectors.store.disk.store import PREALLOCATE_MIN_BYTES, DiskStore
from encache.connectors.store.entry import encode_parts


def _entry(identifier: str, nbytes: int, seed: int = 0):
    data = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    header, view = encode_parts(identifier, data, "U8", (nbytes,), model="m",
                                vllm_version="0.32.0")
    return [header, view], bytes(header) + data.tobytes()


def _in_flight_stat(store: DiskStore, identifier: str) -> os.stat_result:
    (path,) = store.in_flight_paths(identifier)
    return os.stat(path)


def test_a_put_reserves_its_blocks_before_its_entry_is_in_flight(tmp_path):
    store = DiskStore(tmp_path / "s", fsync=False)
    if not store.preallocates:
        pytest.skip(f"no preallocation on {store.fs_type} (ext4 and XFS only)")
    nbytes = 2 * PREALLOCATE_MIN_BYTES + 12345
    parts, whole = _entry("a" * 64, nbytes)
    seen = []
    store.put("a" * 64, parts, on_visible=lambda: seen.append(_in_flight_stat(store, "a" * 64)))
    (st,) = seen
    assert st.st_size == 0  # readers see the file grow as the bytes go in, as before
    assert st.st_blocks * 512 >= len(whole)  # ... into blocks already reserved
    path = store.entry_path("a" * 64)
    assert path.read_bytes() == whole
    final = os.stat(path)
    assert final.st_size == len(whole)
    assert final.st_blocks * 512 <= len(whole) + 4096  # nothing reserved past the end

    # below the threshold nothing is reserved ahead
    parts, whole = _entry("b" * 64, PREALLOCATE_MIN_BYTES // 4)
    seen.clear()
    store.put("b" * 64, parts, on_visible=lambda: seen.append(_in_flight_stat(store, "b" * 64)))
    assert seen[0].st_blocks == 0
    assert store.entry_path("b" * 64).read_bytes() == whole


def test_tmpfs_stores_do_not_preallocate():
    if files.filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs here")
    import tempfile
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        assert not DiskStore(d).preallocates  # a reservation there is zeroed pages


def test_where_the_kernel_cannot_preallocate_puts_write_as_before(tmp_path, monkeypatch):
    store = DiskStore(tmp_path / "s", fsync=False)
    if not store.preallocates:
        pytest.skip(f"no preallocation on {store.fs_type} (ext4 and XFS only)")
    calls = []

    def unsupported(fd, mode, offset, length):  # what fallocate(2) says on such a filesystem
        calls.append(length)
        ctypes.set_errno(errno.EOPNOTSUPP)
        return -1

    files.preallocate(-1, 0)  # the real libc function is looked up first
    monkeypatch.setattr(files, "_libc_fallocate", unsupported)
    for k in range(3):
        ident = f"{k}" * 64
        parts, whole = _entry(ident, 2 * PREALLOCATE_MIN_BYTES, seed=k)
        store.put(ident, parts)
        assert store.entry_path(ident).read_bytes() == whole
    assert len(calls) == 1 and not store.preallocates  # asked once, then not again


@pytest.fixture
def small_ext4(tmp_path):
    """An 8 MiB ext4 filesystem, loop-mounted at tmp_path/mnt."""
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(8 << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mkfs.ext4 unavailable here: {r.stderr.strip() or r.returncode}")
    r = subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"mount not permitted here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_fails_a_put_before_any_reader_waits_for_it(small_ext4):
    store = DiskStore(small_ext4 / "store", fsync=False)
    assert store.preallocates
    kept, failed = {}, None
    for k in range(10):  # 2 MiB entries into ~6 MiB free
        ident = f"{k}" * 64
        parts, whole = _entry(ident, 2 << 20, seed=k)
        visible = []
        try:
            store.put(ident, parts, on_visible=lambda: visible.append(True))
        except OSError as e:
            assert e.errno == errno.ENOSPC
            failed = (ident, visible)
            break
        kept[ident] = whole
    assert kept and failed is not None
    ident, visible = failed
    assert visible == []  # never in flight: no reader waited for a write that could not land
    assert not store.in_flight(ident) and store.get(ident) is None
    assert not store.entry_path(ident).parent.exists() and not any(
        p.name.startswith(files.TEMP_PREFIX) for p in store.root.rglob("*"))
    for name, whole in kept.items():  # what was stored before is intact
        assert store.entry_path(name).read_bytes() == whole
