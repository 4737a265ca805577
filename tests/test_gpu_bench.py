"""``scripts/bench/gpu``'s CPU parts, so that it runs unchanged whenever a GPU is lent:
the benchmark with ``--tiny`` (small entries, a small tower, on the CPU) where vLLM cannot
be imported (as on the GPU machine), through the wrapper that installs encache from the
checkout into a folder of its own and runs the CUDA test files (skipped here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_the_gpu_benchmark_runs_its_cpu_parts_without_vllm(tmp_path):
    fake = tmp_path / "no-vllm" / "vllm"  # importing vllm fails, as where it is not installed
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'vllm\'", name="vllm")\n')
    out = tmp_path / "out"
    run = subprocess.run([str(ROOT / "scripts" / "bench" / "gpu"), str(out), "--tiny",
                          "--rounds", "1"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHON": sys.executable,
                              "PYTHONPATH": str(fake.parent)})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads((out / "gpu.json").read_text())
    assert data["tiny"] and data["device"] == "CPU"
    for size in ("0.25 MB", "2.75 MB", "11 MB"):
        ms = data["loads"][size]["ms_per_load"]
        assert set(ms) == {"readinto", "safetensors", "encache.first", "encache.first.pure",
                           "encache.repeat"}
        assert all(v > 0 for v in ms.values())
    assert data["loads"]["read_ahead_built"] is True  # (built by the wrapper's install)
    assert data["encoder"]["batch1_ms_per_image"] > 0
    assert (out / "gpu.png").stat().st_size > 10_000
    tests = (out / "gpu_tests.log").read_text()
    assert "passed" in tests and "failed" not in tests
    assert "C read-ahead helper built: True" in run.stderr
