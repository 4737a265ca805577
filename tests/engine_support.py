"""Helpers for tests that run real vLLM engines in-process.

vLLM keeps the worker-side EC connector in a process global, so engines with different
connector settings must not be alive at the same time: build one, use it, ``shutdown()``
it, then build the next (fixtures here are module- or session-scoped accordingly).
"""

from __future__ import annotations

import base64
import contextlib
import gc
import mimetypes
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from encache.connectors.vllm import transfer_config

ROOT = Path(__file__).resolve().parent.parent

ENGINE_KW = dict(enforce_eager=True, max_model_len=256, max_num_seqs=4,
                 max_num_batched_tokens=256, limit_mm_per_prompt={"image": 1},
                 dtype="float32", seed=0)
# the same settings as `encache precompute` options
PRECOMPUTE_KW = dict(max_model_len=256, dtype="float32",
                     engine_args={"enforce_eager": True, "max_num_seqs": 4,
                                  "max_num_batched_tokens": 256, "seed": 0})


def built_model(name: str, *args: str) -> str:
    """``.models/<name>``: ``scripts/build_tiny_model.py <args>``'s model, built here if
    scripts/setup did not. Built aside and renamed into place, so the served and engine
    lanes of scripts/test can ask for the same model at once."""
    path = ROOT / ".models" / name
    if not (path / "encache_tiny_model.json").exists():
        path.parent.mkdir(exist_ok=True)
        aside = tempfile.mkdtemp(prefix=f".{name}-", dir=path.parent)
        try:
            subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"),
                            aside, *args], check=True, capture_output=True)
            if not (path / "encache_tiny_model.json").exists():
                # (scripts/setup's build cut short before its last file; never a whole model)
                shutil.rmtree(path, ignore_errors=True)
            try:
                os.rename(aside, path)
            except OSError:  # the other lane's build got there first
                pass
        finally:
            shutil.rmtree(aside, ignore_errors=True)
    return str(path)


def consumer_config(store: str, role: str = "ec_consumer", **extra) -> dict:
    return transfer_config(store, role, {"counters_flush_s": 0.2, **extra})


def make_llm(model: str, ec_transfer_config: dict | None = None, **kw):
    from vllm import LLM
    args = dict(ENGINE_KW, **kw)
    if ec_transfer_config:
        args["ec_transfer_config"] = ec_transfer_config
    return LLM(model=model, **args)


def consumer_lookup(llm):
    """The in-process engine's scheduler-side lookup (``EntryLookup``): its index, breaker
    and staged entries, for tests that look inside the consumer."""
    return llm.llm_engine.engine_core.engine_core.scheduler.ec_connector.lookup


def wait_consumer_sees(llm, identifiers, why: str, timeout: float = 60) -> None:
    """Until the in-process consumer's own lookup (its index, its breaker) says every one
    of ``identifiers`` is stored: for tests that must wait for the consumer's view of a
    recovered store rather than sleep past its index refresh. ``why`` names the failure."""
    lookup = consumer_lookup(llm)
    deadline = time.monotonic() + timeout
    while not all(lookup.probably_stored(i) for i in identifiers):
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


@contextlib.contextmanager
def store_troubles(llm):
    """While in the block: every warning the in-process consumer's lookup gives (those its
    rate limit keeps out of the log too) and every opening of its breaker, in order, as
    ``(seconds since the block began, what)``: what a test that expects no miss reports
    when one happens anyway."""
    lookup = consumer_lookup(llm)
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    warning, trip = lookup.warn.warning, lookup.breaker.trip

    def warned(key, msg, *args):
        seen.append((round(time.monotonic() - t0, 3), msg % args))
        return warning(key, msg, *args)

    def tripped(domain=None):
        seen.append((round(time.monotonic() - t0, 3),
                     f"breaker opened for {domain}" if domain else "breaker opened"))
        trip(domain)

    lookup.warn.warning, lookup.breaker.trip = warned, tripped
    try:
        yield seen
    finally:
        del lookup.warn.warning, lookup.breaker.trip


def shutdown(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown
    ensure_ec_transfer_shutdown()
    del llm
    gc.collect()


def data_url(path: str | os.PathLike) -> str:
    mime = mimetypes.guess_type(str(path))[0] or "image/png"
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()


def conversation(path) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(path)}},
        {"type": "text", "text": "What is on this page?"}]}]


#: engine arguments of the LoRA tests (an adapter that reaches the vision tower)
LORA_KW = dict(enable_lora=True, enable_tower_connector_lora=True, max_lora_rank=8)


def chat_texts(llm, paths, max_tokens: int = 6, lora=None) -> list[str]:
    """Greedy replies to one single-image chat per path (``lora``: a ``LoRARequest``)."""
    from vllm import SamplingParams
    outs = llm.chat([conversation(p) for p in paths],
                    SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False,
                    lora_request=lora)
    return [o.outputs[0].text for o in outs]


class EncoderCounter:
    """Counts vision-encoder runs of the in-process LLaVA model (all engines)."""

    def __init__(self):
        from vllm.model_executor.models import llava
        cls = llava.LlavaForConditionalGeneration
        self.calls = 0
        self.items = 0
        if getattr(cls, "_encache_counter", None) is None:
            original = cls.embed_multimodal

            def counted(model_self, **kwargs):
                out = original(model_self, **kwargs)
                counter = type(model_self)._encache_counter
                counter.calls += 1
                if isinstance(out, (list, tuple)):
                    counter.items += len(out)
                else:  # one batched tensor (items, tokens, width) when images share a size
                    counter.items += out.shape[0] if out.dim() == 3 else 1
                return out
            cls.embed_multimodal = counted
        cls._encache_counter = self

    def reset(self) -> None:
        self.calls = 0
        self.items = 0


class TowerTap:
    """Any family's :class:`EncoderCounter`: records every output of the model class's
    ``embed_multimodal`` (the vision tower + projector: the call a store hit skips), one
    tensor per encoded item, while ``on``. The class is the one vLLM's registry resolves
    for the model's ``architectures[0]``; ``close()`` restores it."""

    def __init__(self, model: str):
        import json

        from vllm.model_executor.models.registry import ModelRegistry

        with open(os.path.join(model, "config.json")) as f:
            arch = json.load(f)["architectures"][0]
        self.cls = ModelRegistry._try_load_model_cls(arch)
        assert self.cls is not None, arch
        self.items: list = []
        self.on = False
        original = self.cls.__dict__["embed_multimodal"] if "embed_multimodal" in \
            self.cls.__dict__ else None
        base = original or self.cls.embed_multimodal
        tap = self

        def embed_multimodal(model_self, **kwargs):
            out = base(model_self, **kwargs)
            if tap.on:
                items = list(out) if isinstance(out, (list, tuple)) else list(out.unbind(0))
                tap.items.extend(t.detach().to("cpu", copy=True) for t in items)
            return out

        self._original = original
        self.cls.embed_multimodal = embed_multimodal

    def take(self) -> list:
        items, self.items = self.items, []
        return items

    def close(self) -> None:
        if self._original is None:  # inherited: drop the wrapper, the parent's shows again
            del self.cls.embed_multimodal
        else:
            self.cls.embed_multimodal = self._original


class AfterHashing:
    """A precompute ``progress`` object that runs ``action()`` once every file is hashed
    and before the engine reads any: at the start of the "encoding" phase, after waiting
    for the identify thread's last "hashing" advance (hashing runs beside the engine's
    start-up). Tests use it to change files between hashing and encoding."""

    def __init__(self, action, timeout: float = 120.0):
        self.action, self.timeout = action, timeout
        self.total, self.hashed = None, 0
        self.hashing_done = threading.Event()

    def start(self, phase, total):
        if phase == "hashing":
            self.total = total
            if not total:
                self.hashing_done.set()
        elif phase == "encoding":
            assert self.hashing_done.wait(self.timeout), "hashing never finished"
            self.action()

    def advance(self, n, failed=None, phase=None):
        if phase == "hashing":
            self.hashed += n
            if self.hashed >= self.total:
                self.hashing_done.set()


class RequestsStuck(Exception):
    """Requests were not answered within the time a test allows (deferred, never served)."""


def chat_within(llm, paths, seconds: float, on_timeout) -> list[str]:
    """``chat_texts`` that must answer within ``seconds``; else ``on_timeout()`` (to unblock
    the engine) and :class:`RequestsStuck`."""
    box: dict = {}

    def run():
        try:
            box["texts"] = chat_texts(llm, paths)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    if th.is_alive():
        on_timeout()  # unblock the engine so the requests can finish before we move on
        th.join(120)
        raise RequestsStuck(f"{len(paths)} requests got no answer within {seconds:g}s while "
                            "the store was down (deferred, never re-encoded)")
    if "error" in box:
        raise box["error"]
    return box["texts"]


class EngineSlot:
    """At most one consumer engine alive; ``get`` replaces it when the settings differ."""

    def __init__(self, model: str):
        self.model = model
        self.key = None
        self.llm = None

    def get(self, key, store: str, **extra):
        if self.key != key:
            self.release()
            self.llm = make_llm(self.model, consumer_config(store, **extra))
            self.key = key
        return self.llm

    def release(self) -> None:
        llm, self.llm, self.key = self.llm, None, None
        if llm is not None:
            shutdown(llm)
        del llm


def engine_module_fixtures(pages: int, seed: int):
    """The module fixtures of a store-backend engine test, as a tuple to assign to module
    globals: ``manifest_home, corpus, idents, reference, engines, counter = ...``.

    * ``manifest_home`` (autouse): precompute keeps the manifests of Redis stores under
      ``$XDG_CACHE_HOME``: a temporary one, not ``~``;
    * ``corpus``: ``pages`` demo pages (``{"root", "pages"}``), ``idents``: page -> served
      identifier (all distinct);
    * ``reference``: greedy outputs of a cache-less engine, computed before any connector;
    * ``engines``: an :class:`EngineSlot`; ``counter``: an :class:`EncoderCounter`.
    """

    @pytest.fixture(scope="module", autouse=True)
    def manifest_home(tmp_path_factory):
        old = os.environ.get("XDG_CACHE_HOME")
        os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg"))
        yield
        if old is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old

    @pytest.fixture(scope="module")
    def corpus(tmp_path_factory):
        from demo_corpus import make_corpus
        root = tmp_path_factory.mktemp("corpus")
        return {"root": str(root),
                "pages": make_corpus(str(root / "docs"), pages=pages, seed=seed)}

    @pytest.fixture(scope="module")
    def idents(corpus, tiny_model) -> dict[str, str]:
        from encache.connectors.vllm.hashing import identify_file
        out = {p: identify_file(p, tiny_model).identifier for p in corpus["pages"]}
        assert len(set(out.values())) == pages
        return out

    @pytest.fixture(scope="module")
    def reference(tiny_model, corpus):
        llm = make_llm(tiny_model)
        texts = dict(zip(corpus["pages"], chat_texts(llm, corpus["pages"])))
        shutdown(llm)
        del llm
        return texts

    @pytest.fixture(scope="module")
    def engines(tiny_model, reference):
        slot = EngineSlot(tiny_model)
        yield slot
        slot.release()

    @pytest.fixture(scope="module")
    def counter():
        return EncoderCounter()

    return manifest_home, corpus, idents, reference, engines, counter
