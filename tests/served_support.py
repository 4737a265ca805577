"""Helpers for tests that run real ``python -m vllm.entrypoints.openai.api_server`` servers.

Servers run as users start them (a worker process of its own by default, or the worker in
the engine-core process as on one GPU: ``executor``; a stop of the whole process group
afterwards). :func:`start_server` returns at once so a module can start all its
servers together and wait for them once (:meth:`Server.wait_ready`); :func:`api_server`
is the one-server context manager. ``probe=DIR`` puts :mod:`encoder_probe` on the
server's ``PYTHONPATH``: every vision-encoder run in any of its processes is logged
(:class:`EncoderLog`), and with ``dump=True`` every encoded item's output is saved.

Each server's worker gets a core of its own in turn (:func:`next_core`), as an operator
runs several vLLM CPU servers on one host: left to ``VLLM_CPU_OMP_THREADS_BIND=auto``,
every server binds its worker to the same first core, and vLLM's worker busy-waits
(``sched_yield``) for a second after each step, so servers started together slow each
other down by up to that second per request (docs/epd.md, *One host*).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from encache.connectors.store import open_store
from engine_support import built_model, data_url

PROBE_DIR = Path(__file__).resolve().parent / "encoder_probe"
START_TIMEOUT = 300  # the machine is shared: a server may take minutes to come up
_started = 0  # servers started by this process: the next one's core


def next_core() -> str:
    """The core for the next server's worker (``VLLM_CPU_OMP_THREADS_BIND``): this
    process's allowed CPUs in turn, from the last (vLLM's auto binding takes the first), so
    an encoder and its PD instance started one after the other run on different cores."""
    global _started
    cpus = sorted(os.sched_getaffinity(0), reverse=True)
    _started += 1
    return str(cpus[(_started - 1) % len(cpus)])


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
    def __init__(self, cmd: list[str], env: dict, root: Path, encoder_log: EncoderLog | None,
                 model: str):
        self.cmd, self.root = cmd, root
        #: the server's temp directory: vLLM leaves its IPC sockets and distributed-init
        #: files there when its engine is SIGKILLed (its default stop); removed by stop()
        self.tmp = tempfile.mkdtemp(prefix="encache-server-")
        self.env = {**env, "TMPDIR": self.tmp}
        self.encoder_log = encoder_log
        self.model = model
        self.attempts = 0
        self._spawn()

    def _spawn(self) -> None:
        """Start on a free port (again, if another process took the port meanwhile: the
        machine is shared)."""
        self.attempts += 1
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = self.root / f"server-{port}.log"
        self._log = open(self.log_path, "w")
        cmd = [*self.cmd, "--port", str(port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Server:
        """Until the server answers ``/health``; a server that does not start, or a wait
        interrupted (Ctrl-C in ``scripts/test``), is stopped before the error goes on: a
        caller's ``start_server(...).wait_ready()`` has nothing to stop yet."""
        try:
            return self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> Server:
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=2)
                return self
            except OSError:
                exited = self.proc.poll() is not None
                if exited and self.attempts < 3 and "Address already in use" in \
                        self.log_path.read_text():
                    self._log.close()
                    self._spawn()
                    continue
                if exited or time.time() > deadline:
                    self._log.flush()
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
        shutil.rmtree(self.tmp, ignore_errors=True)

    def chat(self, paths, **kw) -> dict:
        return chat(self.base, self.model, paths, **kw)


def start_server(model: str, store_config: dict | None, root: Path, *extra_args: str,
                 max_model_len: int = 256, images: int | dict = 1, probe: str | None = None,
                 dump: bool = False, executor: str = "mp",
                 extra_env: dict | None = None) -> Server:
    """Start ``api_server`` (with the encache connector when ``store_config``); returns at
    once (:meth:`Server.wait_ready`). ``images``: the image limit per prompt, or the whole
    ``--limit-mm-per-prompt`` dict; ``extra_env``: variables for the server beside this
    process's.

    ``executor``: where the engine core runs its worker (the API server runs the engine
    core in a process of its own either way). ``"mp"``, CPU vLLM's default: in a process of
    its own, so the connector's worker half opens large entries itself (a disk entry's
    pinned file, a received entry's shared memory). ``"uni"``: in the engine-core process,
    as vLLM runs an engine on one GPU (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps CPU vLLM
    from switching to ``mp``), so the connector hands the worker its staged buffers; one
    process import fewer, ~20 s less to start here. vLLM binds only a worker process's
    threads (``VLLM_CPU_OMP_THREADS_BIND``), so a ``"uni"`` server's are bound here, to
    the same one core, as that binding would (when it names one core)."""
    if executor not in ("mp", "uni"):
        raise ValueError(f"executor {executor!r}: 'mp' or 'uni'")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--max-model-len", str(max_model_len),
           "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "4",
           "--max-num-batched-tokens", str(max_model_len),
           "--limit-mm-per-prompt",
           json.dumps(images if isinstance(images, dict) else {"image": images}), *extra_args]
    if store_config is not None:
        cmd += ["--ec-transfer-config", json.dumps(store_config)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if executor == "mp" else "0",
           "VLLM_LOGGING_LEVEL": "WARNING", **(extra_env or {})}
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", next_core())
    if executor == "uni" and env["VLLM_CPU_OMP_THREADS_BIND"].isdigit():
        # (what vLLM's binding sets in a worker process, for one core; a binding of
        # another form, set by the caller's environment, is left to vLLM and so unbound)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("OMP_PLACES", "{%s}" % env["VLLM_CPU_OMP_THREADS_BIND"])
        env.setdefault("OMP_PROC_BIND", "true")
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
    return Server(cmd, env, root, encoder_log, model)


ROOT = Path(__file__).resolve().parent.parent


def vllm_epd_proxy() -> Path:
    """vLLM's EPD proxy (``disagg_epd_proxy.py``) of the installed release: it lives in
    vLLM's source tree, not its wheel; ``scripts/setup`` fetches it from that release's
    source distribution into ``.vllm-src/<version>/``."""
    from vllm import __version__

    path = ROOT / ".vllm-src" / __version__.split("+")[0] / "disagg_epd_proxy.py"
    if not path.is_file():
        pytest.fail(f"{path.relative_to(ROOT)} is missing: scripts/setup fetches it from "
                    "vLLM's source distribution (python scripts/fetch_vllm_proxy.py)")
    return path


def start_proxy(encoder: Server, pd: Server, root: Path, *flags: str) -> Server:
    """vLLM's own EPD proxy (:func:`vllm_epd_proxy`) in front of ``encoder`` and ``pd``
    (E + PD: no prefill instance), with ``flags`` (``--no-rewrite``); returns at once
    (:meth:`Server.wait_ready`: its ``/health`` asks both)."""
    cmd = [sys.executable, str(vllm_epd_proxy()), "--host", "127.0.0.1",
           "--encode-servers-urls", encoder.base, "--prefill-servers-urls", "disable",
           "--decode-servers-urls", pd.base, *flags]
    return Server(cmd, dict(os.environ), root, None, pd.model)


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
    content = [{"type": "image_url", "image_url": {"url": data_url(p)}}
               for p in image_paths(paths)]
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]}
    if top_logprobs:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    if mm_processor_kwargs:
        body["mm_processor_kwargs"] = mm_processor_kwargs
    return post_chat_ok(base, body)


def post_chat(base: str, body: dict, timeout: float = 300) -> tuple[int, dict | str]:
    """POST ``body`` to the server's chat completions: ``(status, reply)``, the reply
    parsed on success, the server's text on an HTTP error."""
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def post_chat_ok(base: str, body: dict) -> dict:
    """:func:`post_chat` that must succeed: the reply, or an AssertionError with the
    server's reason."""
    status, reply = post_chat(base, body)
    if status != 200:
        raise AssertionError(f"HTTP {status}: {str(reply)[:500]}")
    return reply


def image_paths(paths) -> list:
    """A request's image file(s): one path, or a list of them."""
    return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


def image_request(model: str, paths) -> dict:
    """A chat request with the image file(s) ``paths`` (one token, top-5 logprobs): what a
    client sends the EPD proxy."""
    return {"model": model, "max_tokens": 1, "temperature": 0, "logprobs": True,
            "top_logprobs": 5, "messages": [{"role": "user", "content": [
                *({"type": "image_url", "image_url": {"url": data_url(p)}}
                  for p in image_paths(paths)),
                {"type": "text", "text": "What is on this page?"}]}]}


def encoder_part(body: dict) -> dict:
    """What vLLM's EPD proxy sends the encoder instance: the request's media items, no
    text."""
    content = [c for m in body["messages"] for c in m["content"] if c["type"] == "image_url"]
    return {"model": body["model"], "max_tokens": 1,
            "messages": [{"role": "user", "content": content}]}


def proxy_flow(encoder: Server, pd: Server, body: dict) -> dict:
    """What vLLM's EPD proxy does with one request: the media to the encoder, wait for its
    200, then the original request to PD at once (no sleep); PD's reply."""
    post_chat_ok(encoder.base, encoder_part(body))
    return post_chat_ok(pd.base, body)


def assert_pd_found_every_entry(s: dict, requests: list, clients: int) -> dict:
    """The proxy's flow for every request of ``requests`` (an image path, or a list of
    them), ``clients`` at a time, through ``s``'s encoder and PD servers (``e``, ``pd``,
    with the encoder's probe dumping; ``model``, ``store``, ``backend``): the encoder
    encoded each image once, PD's tower never ran, every PD item was a store hit, and
    every image's stored entry holds what the encoder's tower computed for it (bit for
    bit: fp32, stored as computed), of shape ``s["shape"]`` where that is given. On a disk
    store PD hashed again none (or nearly none) of what the encoder on this host vouched
    for. ``{image path: its stored tensor}``."""
    import torch

    from encache.connectors.vllm.hashing import identify_file

    e, pd = s["e"], s["pd"]
    paths = [p for r in requests for p in image_paths(r)]
    before = open_store(s["store"]).read_counters()
    e_items, pd_runs = len(e.encoder_log.items()), pd.encoder_log.count()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda r: proxy_flow(e, pd, image_request(s["model"], r)), requests))
    assert pd.encoder_log.count() == pd_runs, "the PD tower ran: a silent re-encode"
    encoded = e.encoder_log.items()[e_items:]
    assert len(encoded) == len(paths)
    deltas = counter_deltas(s["store"], before, keys=("hits", "misses", "save_timeouts",
                                                       "checksums_skipped"))
    skipped = deltas.pop("checksums_skipped")
    assert deltas == {"hits": len(paths), "misses": 0, "save_timeouts": 0}, deltas
    if s["backend"] == "disk":
        # PD did not hash again what the encoder on this host vouched for in the store's
        # verified log (all of them here; one that finds the whole temp file in the few
        # microseconds before the encoder's record is hashed instead)
        assert skipped > 0, deltas
    computed = [torch.load(f) for _, f in encoded]
    entries = {}
    for path in paths:
        entry = stored_tensor(s["store"], identify_file(path, s["model"]).identifier)
        assert entry is not None, path
        assert s.get("shape") is None or tuple(entry.shape) == s["shape"], (path, entry.shape)
        assert any(t.shape == entry.shape and torch.equal(t, entry) for t in computed), path
        entries[path] = entry
    return entries


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
                   quiet: float = 3.0, stable: float = 1.0) -> dict:
    """Counter changes since ``before``, once the connector's periodic flush settled: a
    change seen and then ``stable`` seconds without another, or ``quiet`` seconds with
    none at all (a loaded machine may delay the flush thread)."""
    t0 = time.time()
    last, last_change = None, None
    while True:
        now = open_store(store).read_counters()
        deltas = {k: now.get(k, 0) - before.get(k, 0) for k in keys}
        if deltas != last:
            last, last_change = deltas, time.time()
        elapsed = time.time() - t0
        changed = any(deltas.values())
        if (changed and time.time() - last_change >= stable) or \
                (not changed and elapsed >= quiet) or elapsed > 20:
            return deltas
        time.sleep(0.25)


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


def draw_images(folder: Path, sizes: dict[str, tuple[int, int]], seed: int) -> dict[str, str]:
    """Distinct synthetic photos-like images (``name.jpg``/``name.png`` -> path), one per
    ``name: (width, height)``; names ending in ``_png`` are saved as PNG."""
    import random

    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    out = {}
    for name, (w, h) in sizes.items():
        img = Image.new("RGB", (w, h), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(img)
        for _ in range(12):
            x0, y0 = rng.randrange(w), rng.randrange(h)
            x1, y1 = x0 + rng.randrange(20, w // 2 + 21), y0 + rng.randrange(20, h // 2 + 21)
            shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
            shape([x0, y0, x1, y1], fill=tuple(rng.randrange(256) for _ in range(3)))
        path = folder / (name + (".png" if name.endswith("_png") else ".jpg"))
        img.save(path, quality=90) if path.suffix == ".jpg" else img.save(path)
        out[name] = str(path)
    return out


def stored_tensor(store: str, identifier: str):
    """The tensor a stored entry holds (None if absent)."""
    import torch

    from encache.connectors.store.entry import decode
    from encache.connectors.vllm.loads import TORCH_DTYPES

    blob = open_store(store).get(identifier)
    if blob is None:
        return None
    meta, view = decode(blob, identifier=identifier)
    return torch.frombuffer(bytearray(view), dtype=TORCH_DTYPES[meta.dtype]).view(meta.shape)


class Reference:
    """What a plain server (no connector, probe with dump) computes for single requests:
    the first token's logprobs and the tower output of the request's one new image."""

    def __init__(self, server: Server):
        self.server = server
        self.replies: dict = {}

    def single(self, path: str, mm_processor_kwargs: dict | None = None):
        """(logprobs, tower output) of ``path`` alone; the first call per (image, kwargs)
        encodes it (later ones are the engine's own cache: output None)."""
        import torch

        key = (path, json.dumps(mm_processor_kwargs, sort_keys=True))
        if key not in self.replies:
            log = self.server.encoder_log
            before = log.count()
            reply = self.server.chat(path, max_tokens=1, top_logprobs=5,
                                     mm_processor_kwargs=mm_processor_kwargs)
            new = log.items()[before:]
            assert len(new) == 1, new  # the plain server encoded exactly this image
            self.replies[key] = (first_token_logprobs(reply), torch.load(new[0][1]))
        return self.replies[key]

    def multi(self, paths, mm_processor_kwargs: dict | None = None) -> dict[str, float]:
        reply = self.server.chat(paths, max_tokens=1, top_logprobs=5,
                                 mm_processor_kwargs=mm_processor_kwargs)
        return first_token_logprobs(reply)


def served_request(server: Server, store: str, paths, **kw) -> tuple[dict, dict, int]:
    """Send one request to a connector server: (first-token logprobs, counter deltas,
    vision-encoder items run for it)."""
    before_counters = open_store(store).read_counters()
    before_items = server.encoder_log.count()
    reply = server.chat(paths, max_tokens=1, top_logprobs=5, **kw)
    deltas = counter_deltas(store, before_counters)
    return first_token_logprobs(reply), deltas, server.encoder_log.count() - before_items


def wide_model() -> str:
    """The tiny LLaVA with Gemma-3-sized entries: 256 image tokens x 2688 fp32 = 2.75 MB
    (built by scripts/setup; built here if missing)."""
    return built_model("tiny-llava-2688", "--image-size", "128", "--patch", "8",
                       "--text-hidden", "2688")


def qwen_epd_model() -> str:
    """The tiny Qwen2.5-VL whose entries span the EPD sizes: a language model 2688 wide
    (fp32) and images of 28 x 28 to 896 x 896 pixels, so an entry has 1 to 1024 rows,
    11 KB to 11 MB (built by scripts/setup; built here if missing)."""
    return built_model("tiny-qwen2_5_vl-epd", "--arch", "qwen2_5_vl", "--text-hidden", "2688",
                       "--max-pixels", str(28 * 28 * 1024), "--min-pixels", str(28 * 28))


def crops_model() -> str:
    """The tiny LLaVA with entries of four Gemma-3-sized crops: 1024 image tokens x 2688
    fp32 = 11 MB per image (scripts/bench/epd_bench.py's; built here if missing)."""
    return built_model("tiny-llava-epd-crops", "--image-size", "256", "--patch", "8",
                  "--text-hidden", "2688")
