"""Helpers for tests that run real ``python -m vllm.entrypoints.openai.api_server`` servers.

Servers run as users start them (worker processes, SIGKILL-free stop of the whole process
group afterwards). :func:`start_server` returns at once so a module can start all its
servers together and wait for them once (:meth:`Server.wait_ready`); :func:`api_server`
is the one-server context manager. ``probe=DIR`` puts :mod:`encoder_probe` on the
server's ``PYTHONPATH``: every vision-encoder run in any of its processes is logged
(:class:`EncoderLog`), and with ``dump=True`` every encoded item's output is saved.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from encache.connectors.store import open_store
from engine_support import data_url

PROBE_DIR = Path(__file__).resolve().parent / "encoder_probe"
START_TIMEOUT = 300  # the machine is shared: a server may take minutes to come up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EncoderLog:
    """The probe's record of encoder runs: one entry per encoded item (its shape)."""

    def __init__(self, path: Path, dump: Path | None = None):
        self.path = path
        self.dump = dump

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line]

    def items(self) -> list[tuple[list[int], str | None]]:
        """(shape, dump file or None) of every item encoded so far, in order."""
        out = []
        for r in self.records():
            files = r.get("files") or [None] * len(r["shapes"])
            out.extend(zip(r["shapes"], files))
        return out

    def count(self) -> int:
        return len(self.items())


class Server:
    def __init__(self, proc: subprocess.Popen, base: str, log_path: Path, log,
                 encoder_log: EncoderLog | None, model: str):
        self.proc, self.base, self.log_path, self._log = proc, base, log_path, log
        self.encoder_log = encoder_log
        self.model = model

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Server:
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
                return self
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self._log.flush()
                    self.stop()
                    pytest.fail("server did not start:\n" + self.log_path.read_text()[-3000:])
                time.sleep(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()

    def chat(self, paths, **kw) -> dict:
        return chat(self.base, self.model, paths, **kw)


def start_server(model: str, store_config: dict | None, root: Path, *extra_args: str,
                 max_model_len: int = 256, images: int = 1, probe: str | None = None,
                 dump: bool = False) -> Server:
    """Start ``api_server`` (with the encache connector when ``store_config``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
           "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "4",
           "--max-num-batched-tokens", str(max_model_len),
           "--limit-mm-per-prompt", json.dumps({"image": images}), *extra_args]
    if store_config is not None:
        cmd += ["--ec-transfer-config", json.dumps(store_config)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_LOGGING_LEVEL="WARNING")
    encoder_log = None
    if probe:
        probe_root = root / f"probe-{probe}"
        probe_root.mkdir(parents=True, exist_ok=True)
        encoder_log = EncoderLog(probe_root / "encoder.jsonl", probe_root if dump else None)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(PROBE_DIR), *filter(None, [env.get("PYTHONPATH")])])
        env["ENCACHE_TEST_ENCODER_LOG"] = str(encoder_log.path)
        if dump:
            env["ENCACHE_TEST_ENCODER_DUMP"] = str(probe_root)
    log_path = root / f"server-{port}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    return Server(proc, f"http://127.0.0.1:{port}", log_path, log, encoder_log, model)


@contextlib.contextmanager
def api_server(model: str, store_config: dict | None, root: Path, *extra_args: str, **kw):
    """``python -m vllm.entrypoints.openai.api_server`` with the encache connector, as
    users start it; yields its base URL and stops the whole process group afterwards."""
    server = start_server(model, store_config, root, *extra_args, **kw)
    try:
        server.wait_ready()
        yield server.base
    finally:
        server.stop()


def chat(base: str, model: str, paths, *, max_tokens: int = 2, top_logprobs: int = 0,
         mm_processor_kwargs: dict | None = None, text: str = "What is on this page?") -> dict:
    """One chat completion with the image file(s) ``paths`` as base64 data URLs."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    content = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in paths]
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]}
    if top_logprobs:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    if mm_processor_kwargs:
        body["mm_processor_kwargs"] = mm_processor_kwargs
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def first_token_logprobs(reply: dict) -> dict[str, float]:
    """{token: logprob} of the first generated token's top alternatives."""
    first = reply["choices"][0]["logprobs"]["content"][0]
    return {t["token"]: t["logprob"] for t in first["top_logprobs"]}


def assert_logprobs_close(got: dict[str, float], want: dict[str, float], tol: float = 1e-3):
    """Same distribution within float noise: the top alternatives agree (a near-tie at the
    edge of the list may swap one) and every shared one has the same logprob."""
    common = set(got) & set(want)
    assert len(common) >= len(want) - 1, (got, want)
    diffs = {t: abs(got[t] - want[t]) for t in common}
    assert max(diffs.values()) < tol, diffs


def counters_after(store, key: str, above: float, timeout: float = 10.0) -> dict:
    deadline = time.time() + timeout
    while True:
        c = open_store(store).read_counters()
        if c.get(key, 0) > above or time.time() > deadline:
            return c
        time.sleep(0.1)


def counter_deltas(store, before: dict, keys=("hits", "misses", "config_mismatches"),
                   settle: float = 1.0) -> dict:
    """Counter changes since ``before``, after the connector's periodic flush settled."""
    deadline = time.time() + 10
    last = None
    while True:
        now = open_store(store).read_counters()
        if now == last or time.time() > deadline:
            return {k: now.get(k, 0) - before.get(k, 0) for k in keys}
        last = now
        time.sleep(settle)


def hits_and_misses_per_file(base: str, model: str, store: str, files) -> dict:
    results = {}
    for path in files:
        before = open_store(store).read_counters()
        reply = chat(base, model, path)
        assert reply["choices"][0]["message"]["content"] is not None
        after = counters_after(store, "hits", before.get("hits", 0))
        results[Path(path).suffix + ":" + str(len(results))] = (
            after.get("hits", 0) - before.get("hits", 0),
            after.get("misses", 0) - before.get("misses", 0))
    return results
