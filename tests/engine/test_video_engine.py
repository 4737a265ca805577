"""Video items end to end on a tiny Qwen2.5-VL (real vLLM engines, in-process).

``precompute`` a folder of videos (one without a suffix) and an image with a producer
engine; then a consumer engine is sent ``video_url`` data URLs *without* uuids -- vLLM
computes the identifiers itself -- and must hit every item with its vision tower never
running, give the same tokens (and first-token logprobs within float noise) as an engine
without the connector, and each stored entry must equal what that plain engine's own
vision tower computes for the video.

Needs the tiny Qwen2.5-VL of ``scripts/build_tiny_model.py --arch qwen2_5_vl``; without
that builder the module is skipped (the hashing/plumbing it relies on is covered without a
video model by test_media.py, test_media_cli.py, test_precompute_media.py).
"""

from __future__ import annotations

import base64
import subprocess
import sys

import numpy as np
import pytest

from engine_support import ROOT, consumer_config, shutdown
from media_files import make_video, png_bytes

pytestmark = pytest.mark.slow

ENGINE = dict(enforce_eager=True, max_model_len=4096, max_num_seqs=2,
              max_num_batched_tokens=4096, dtype="float32", seed=0)
LIMITS = {"image": 1, "video": 1}


@pytest.fixture(scope="module")
def tiny_qwen() -> str:
    if not (ROOT / "scripts" / "tiny_qwen2_5_vl.py").exists():
        pytest.skip("needs scripts/build_tiny_model.py --arch qwen2_5_vl")
    path = ROOT / ".models" / "tiny-qwen2_5_vl"
    if not (path / "encache_tiny_model.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "build_tiny_model.py"), str(path),
                        "--arch", "qwen2_5_vl"], check=True, capture_output=True)
    return str(path)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    make_video(d / "clip.mp4", frames=8, fps=4.0, size=(112, 84), seed=1)
    make_video(d / "clip_no_suffix", frames=12, fps=6.0, size=(84, 112), fourcc="VP80", seed=2)
    (d / "still.png").write_bytes(png_bytes((112, 112), (10, 120, 200)))
    (d / "captions.txt").write_text("not media\n")
    return d


class TowerRuns:
    """Counts / records Qwen2.5-VL vision-tower runs (embed_multimodal) in this process."""

    def __init__(self):
        from vllm.model_executor.models import qwen2_5_vl
        self.cls = qwen2_5_vl.Qwen2_5_VLForConditionalGeneration
        self.original = self.cls.embed_multimodal
        self.outputs: list = []
        runs = self

        def recorded(model_self, **kwargs):
            out = self.original(model_self, **kwargs)
            runs.outputs.extend(t.detach().float().cpu().numpy() for t in out)
            return out
        self.cls.embed_multimodal = recorded

    def close(self):
        self.cls.embed_multimodal = self.original


def _url(path, mime) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def _conversations(media) -> list:
    parts = [("video_url", _url(media / "clip.mp4", "video/mp4")),
             ("video_url", _url(media / "clip_no_suffix", "video/webm")),
             ("image_url", _url(media / "still.png", "image/png"))]
    return [[{"role": "user", "content": [{"type": kind, kind: {"url": url}},
                                          {"type": "text", "text": "What happens?"}]}]
            for kind, url in parts]


def _run(llm, convs) -> list:
    from vllm import SamplingParams
    outs = llm.chat(convs, SamplingParams(max_tokens=3, temperature=0, logprobs=5),
                    use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs[0]) for o in outs]


def test_precomputed_videos_hit_and_match_the_plain_engine(tiny_qwen, media, tmp_path):
    import time

    from vllm import LLM

    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from encache.connectors.store import decode, open_store
    from encache.connectors.vllm.hashing import identify_file

    store = str(tmp_path / "store")
    options = PrecomputeOptions(model=tiny_qwen, store=store, batch=4, max_model_len=4096,
                                dtype="float32", engine_args={
                                    k: v for k, v in ENGINE.items()
                                    if k not in ("max_model_len", "dtype")})
    s = precompute_corpus(str(media), options)
    assert s.failed == 0, s.failures
    assert s.encoded == 3 and s.skipped_non_media == 1
    idents = {name: identify_file(media / name, tiny_qwen) for name in
              ("clip.mp4", "clip_no_suffix", "still.png")}
    assert [i.kind for i in idents.values()] == ["video", "video", "image"]
    assert idents["clip.mp4"].video["loader"] == "qwen2_vl"  # Qwen2.5-VL's sampler
    assert set(open_store(store).identifiers()) == {i.identifier for i in idents.values()}

    convs = _conversations(media)
    runs = TowerRuns()
    try:
        consumer = LLM(model=tiny_qwen, limit_mm_per_prompt=LIMITS,
                       ec_transfer_config=consumer_config(store), **ENGINE)
        runs.outputs.clear()
        served = _run(consumer, convs)
        assert runs.outputs == [], "the consumer ran the vision tower"
        shutdown(consumer)
        deadline = time.time() + 5
        while time.time() < deadline and open_store(store).read_counters().get("hits", 0) < 3:
            time.sleep(0.1)
        counters = open_store(store).read_counters()
        assert counters["hits"] == 3 and counters.get("misses", 0) == 0

        plain = LLM(model=tiny_qwen, limit_mm_per_prompt=LIMITS, **ENGINE)
        reference = []
        tower = []
        for conv in convs:  # one at a time: one tower output per item, in order
            runs.outputs.clear()
            reference.extend(_run(plain, [conv]))
            tower.append(np.concatenate([o.reshape(-1, o.shape[-1]) for o in runs.outputs]))
        shutdown(plain)
    finally:
        runs.close()
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(served, reference):
        assert tokens == ref_tokens
        for tok, lp in ref_logprobs.items():
            assert abs(logprobs[tok].logprob - lp.logprob) < 1e-3
    st = open_store(store)
    for ident, expected in zip(idents.values(), tower):
        meta, data = decode(st.get(ident.identifier), identifier=ident.identifier)
        stored = _as_array(meta, data)
        stored = stored.reshape(-1, stored.shape[-1])
        assert stored.shape == expected.shape, ident.path
        assert float(np.abs(stored - expected).max()) < 1e-4, ident.path


def _as_array(meta, data) -> np.ndarray:
    dtypes = {"F32": np.float32, "F16": np.float16}
    return np.frombuffer(data, dtypes[meta.dtype]).astype(np.float32).reshape(meta.shape)


def test_a_video_found_after_the_engine_started_gets_an_engine_that_takes_it(tiny_qwen,
                                                                              tmp_path):
    """precompute starts its engine at the first missing file, with the media kinds found
    by then. Here hashing is held after the first file (an image) until that engine is
    up, so it accepts images only; the video found next is put aside and encoded by a
    second engine that takes videos, under the identifier a server computes."""
    import threading

    from encache.connectors.store import open_store
    from encache.connectors.vllm.hashing import identify_file
    from encache.jobs.precompute import PrecomputeOptions, precompute_files

    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a_still.png").write_bytes(png_bytes((112, 112), (10, 120, 200)))
    make_video(d / "b_clip.mp4", frames=8, fps=4.0, size=(112, 84), seed=1)
    files = [str(d / "a_still.png"), str(d / "b_clip.mp4")]

    class HoldHashingUntilTheEngineIsUp:
        def __init__(self):
            self.engine_up = threading.Event()
            self.phases: list[str] = []
            self.held = None

        def start(self, phase, total):
            self.phases.append(phase)
            if phase == "encoding":
                self.engine_up.set()

        def advance(self, n, failed=None, phase=None):
            if phase == "hashing" and self.held is None:  # after the image's row
                self.held = self.engine_up.wait(300)

    hold = HoldHashingUntilTheEngineIsUp()
    options = PrecomputeOptions(model=tiny_qwen, store=str(tmp_path / "store"), batch=4,
                                max_model_len=4096, dtype="float32",
                                engine_args={k: v for k, v in ENGINE.items()
                                             if k not in ("max_model_len", "dtype")})
    s = precompute_files(files, options, progress=hold)
    assert hold.held is True
    assert s.failed == 0 and s.encoded == 2, s.failures
    assert hold.phases.count("starting engine") == 2, hold.phases
    expected = {identify_file(p, tiny_qwen).identifier for p in files}
    assert set(open_store(str(tmp_path / "store")).identifiers()) == expected
