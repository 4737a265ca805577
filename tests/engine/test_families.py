"""Model families end to end in-process: precompute, then a consumer serving from the store.

For each family (a tiny random-weight model built offline with transformers' real classes,
processor and chat template: scripts/tiny_<arch>.py), the library precompute job encodes
images of several sizes and aspect ratios (one 1000 px wide), and a video for the five
families with a video processor, with a real ``ec_producer`` engine; a consumer engine
then answers single- and two-image requests and a video request for them. Proven per
family: every item is a store hit, the vision tower runs 0 times, the first token's
logprobs equal those of an engine without the connector, each stored entry equals
what that engine's own tower computes for the image or video, and each entry is bound to
the processed inputs (the consumer's, a request of several images or a video, digest the
same as precompute's: no entry refused).

Two families also run at a realistic entry size (a language model 2688 wide, fp32: the
width of Gemma 3 27B's fp16 entries in bytes), where a tiny model's 4 KB entries would
hide copies and sizes: Gemma 3 with pan-and-scan and its real 256 tokens per tile (one
entry holds the global view and every crop, 2.75 MB each, up to 11 MB; its consumer maps
the entry files), and Qwen3-VL (DeepStack: entries twice as wide, up to 5.5 MB; its
consumer reads and hashes every load, as a GPU engine reads into staging: on two
threads).

One engine per role per family (plain reference, producer, consumer), one after the other
(vLLM keeps the worker-side connector in a process global).
"""

from __future__ import annotations

import pytest

from encache.connectors.store import open_store
from encache.connectors.vllm.hashing import identify_file
from engine_support import (PRECOMPUTE_KW, TowerTap, consumer_config, data_url, make_llm,
                            shutdown)
from served_support import assert_logprobs_close, draw_images, stored_tensor

pytestmark = [pytest.mark.engine]

SINGLE = {"wide": (1000, 400), "square_png": (300, 300), "tall": (240, 520)}
# sent together only (never singly first: the engine's own cache would answer them)
MULTI = {"m_a": (640, 480), "m_b": (500, 700)}
VIDEO = "clip"  # 8 frames of 112 x 84 at 4 fps (a family with a "video" limit)

# per family: engine settings shared by the reference, the producer (one image per prompt,
# as `encache precompute` runs) and the consumer; ``width``: the entries' expected width;
# ``fixed``: one resolution for every image; ``arch`` + ``build``: a model built with other
# sizes (conftest's tiny_family); ``mm_kwargs``: the server's --mm-processor-kwargs;
# ``consumer``: the consumer's connector settings; ``dtype``: every engine's (float32);
# ``precompute``: the producer's other engine arguments; a ``"video"`` limit: a video
# is precomputed and served too (vLLM's frame sampler for the family's video processor)
FAMILIES = {
    "qwen2_vl": dict(max_model_len=2048, limits={"image": 2, "video": 1}),
    # DeepStack: merged patches + one deep-layer feature, side by side (2 x 64 columns)
    "qwen3_vl": dict(max_model_len=2048, limits={"image": 2, "video": 1}, width=128),
    # hybrid LM (gated delta net + full attention); no DeepStack: entries 64 wide; bf16:
    # vLLM's CPU gated-delta-net kernel takes bf16/fp16 only ("requires BF16"), and its bf16
    # tower output moves by 1 ulp with the batch, so the producer encodes one image a step
    "qwen3_5": dict(max_model_len=2048, limits={"image": 2, "video": 0}, width=64,
                    dtype="bfloat16", precompute=dict(max_num_seqs=1)),
    "llava_onevision": dict(max_model_len=2048, limits={"image": 2, "video": 1}),
    "llava_next": dict(max_model_len=2048, limits={"image": 2}),
    "idefics3": dict(max_model_len=2048, limits={"image": 2}),
    "mistral3": dict(max_model_len=2048, limits={"image": 2}),
    "internvl": dict(max_model_len=2048, limits={"image": 2, "video": 1}),
    # fixed resolution (every entry has the same shape); one image per prompt
    "paligemma": dict(max_model_len=2048, limits={"image": 1}, fixed=True),
    "glm4v": dict(max_model_len=2048, limits={"image": 2, "video": 1}),
    # tokens follow the aspect ratio, at most 70 per image (3 x 3 pooled patches); no audio
    # tower (as 26B/31B); video frames go through the same tower, not tested here
    "gemma4": dict(max_model_len=2048, limits={"image": 2, "video": 0}),
    # tiles of 16 tokens (8 px patches pixel-shuffled 2 x 2) + a global tile when there are
    # several: the row count follows the best-fit canvas; MoE LM (dense + MoE layer)
    "llama4": dict(max_model_len=2048, limits={"image": 2}),
    # hybrid LM (gated short convolutions + attention), fp32 on the CPU; a large image is
    # one entry: tiles of 16 tokens + a thumbnail, a small one a single smart-resized view
    "lfm2_vl": dict(max_model_len=2048, limits={"image": 2}),
    # realistic sizes: the wide image's entry holds the global view and 3 crops, 4 x 256
    # rows x 2688 fp32 = 11 MB
    "gemma3@2688": dict(arch="gemma3", build=dict(text_hidden=2688, image_size=256),
                        max_model_len=2048, limits={"image": 2}, width=2688,
                        mm_kwargs={"do_pan_and_scan": True}),
    # its consumer reads and hashes every load (load_mode read, verify always), as a GPU
    # engine reads entries into staging: 2-5.5 MB entries read on two threads
    "qwen3_vl@2688": dict(arch="qwen3_vl", build=dict(text_hidden=2688), max_model_len=2048,
                          limits={"image": 2, "video": 0}, width=2 * 2688,
                          consumer=dict(load_mode="read", verify="always")),
}


def first_token_logprobs(llm, paths) -> dict[int, float]:
    from vllm import SamplingParams

    def item(path) -> dict:
        kind = "video_url" if str(path).endswith(".mp4") else "image_url"
        return {"type": kind, kind: {"url": data_url(path)}}

    conv = [{"role": "user", "content": [
        *map(item, paths), {"type": "text", "text": "What is in these pictures?"}]}]
    [out] = llm.chat([conv], SamplingParams(max_tokens=1, temperature=0, logprobs=5),
                     use_tqdm=False)
    return {tok: lp.logprob for tok, lp in out.outputs[0].logprobs[0].items()}


def engine_kw(spec: dict) -> dict:
    n = spec["max_model_len"]
    kw = dict(max_model_len=n, max_num_batched_tokens=n, limit_mm_per_prompt=spec["limits"],
              dtype=spec.get("dtype", "float32"))
    if "mm_kwargs" in spec:
        kw["mm_processor_kwargs"] = spec["mm_kwargs"]
    return kw


def has_video(spec: dict) -> bool:
    return spec["limits"].get("video", 0) > 0


def requests_of(spec: dict) -> list[tuple[str, ...]]:
    """Each SINGLE image alone, then the MULTI images in one request (one by one for a
    family that takes one image per prompt), then the VIDEO alone (a family with one)."""
    together = spec["limits"]["image"] >= 2
    return ([(n,) for n in SINGLE] + ([tuple(MULTI)] if together else [(n,) for n in MULTI])
            + ([(VIDEO,)] if has_video(spec) else []))


def serve_all(llm, tap, images, spec) -> dict:
    """``{request: (first-token logprobs, tower outputs during the request)}``."""
    out = {}
    for names in requests_of(spec):
        tap.take()
        out[names] = (first_token_logprobs(llm, [images[n] for n in names]), tap.take())
    return out


class captured_warnings:  # noqa: N801 - used as a context manager
    """encache's WARNING records while the block runs (a module fixture has no caplog)."""

    def __enter__(self) -> list[str]:
        import logging

        self.lines: list[str] = []
        self.handler = logging.Handler(logging.WARNING)
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        logging.getLogger("encache").addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc) -> None:
        import logging

        logging.getLogger("encache").removeHandler(self.handler)


class read_ahead_jobs:  # noqa: N801 - used as a context manager
    """How many checksummed reads ran on two threads (``store.read_ahead`` jobs) while the
    block runs (the engine is in this process)."""

    def __enter__(self) -> list:
        from encache.connectors.store import read_ahead

        self.module, self.real, jobs = read_ahead, read_ahead.start, []

        def start(*a, **kw):
            job = self.real(*a, **kw)
            if job is not None:
                jobs.append(job.begin)
            return job
        read_ahead.start = start
        return jobs

    def __exit__(self, *exc) -> None:
        self.module.start = self.real


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tiny_family, tmp_path_factory):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus

    arch, spec = request.param, FAMILIES[request.param]
    model = tiny_family(spec.get("arch", arch), **spec.get("build", {}))
    root = tmp_path_factory.mktemp(arch.replace("@", "-"))
    images = draw_images(root / "corpus", {**SINGLE, **MULTI}, seed=21)
    if has_video(spec):
        from media_files import make_video
        images[VIDEO] = make_video(root / "corpus" / f"{VIDEO}.mp4", frames=8, fps=4.0,
                                   size=(112, 84), seed=1)
    store = str(root / "store")
    tap = TowerTap(model)
    try:
        llm = make_llm(model, **engine_kw(spec))
        tap.on = True
        reference = serve_all(llm, tap, images, spec)
        tap.on = False
        shutdown(llm)
        engine = dict(PRECOMPUTE_KW["engine_args"], **engine_kw(spec))
        engine.pop("max_model_len")
        engine["limit_mm_per_prompt"] = dict(spec["limits"], image=1)
        engine.update(spec.get("precompute", {}))
        options = PrecomputeOptions(model=model, store=store, max_model_len=spec["max_model_len"],
                                    dtype=engine.pop("dtype"), engine_args=engine)
        summary = precompute_corpus(str(root / "corpus"), options)
        with captured_warnings() as warnings:
            llm = make_llm(model, consumer_config(store, **spec.get("consumer", {})),
                           **engine_kw(spec))
        tap.on = True
        with read_ahead_jobs() as jobs:
            served = serve_all(llm, tap, images, spec)
        tap.on = False
        shutdown(llm)
    finally:
        tap.close()
    yield {"arch": arch, "spec": spec, "model": model, "store": store, "images": images,
           "summary": summary, "reference": reference, "served": served,
           "consumer_warnings": warnings, "read_ahead_jobs": jobs}


def test_precompute_encodes_every_item(family):
    s = family["summary"]
    assert (s.encoded, s.failed) == (len(family["images"]), 0), s.failures


def test_every_item_hits_and_the_tower_stays_idle(family):
    counters = open_store(family["store"]).read_counters()
    n = len(family["images"])
    assert (counters.get("hits", 0), counters.get("misses", 0)) == (n, 0), counters
    runs = {name: len(items) for name, (_, items) in family["served"].items()}
    assert runs == {name: 0 for name in runs}, runs


def test_every_entry_is_bound_to_the_inputs_the_consumer_holds(family):
    """Precompute (one item per prompt, a decoded image) bound every entry to its
    processed inputs, and a consumer's requests (data URLs; several images at once; a
    video) digested theirs the same: every item hit above, none was refused."""
    store = open_store(family["store"])
    for path in family["images"].values():
        meta = store.stat(identify_file(path, family["model"]).identifier).meta
        assert meta.binding.startswith("blake3:"), path
    counters = store.read_counters()
    assert counters.get("binding_mismatches", 0) == 0, counters


def test_a_consumer_that_reads_its_loads_hashes_them_on_two_threads(family):
    """A consumer whose loads read and hash the entry (load_mode read, verify always: a GPU
    engine's loads into staging) reads its entries of 1 MiB or more on two threads;
    every item still hit with the plain engine's output (the tests above)."""
    if family["spec"].get("consumer", {}).get("load_mode") != "read":
        pytest.skip("this family's consumer maps its entries")
    from encache.connectors.store import read_ahead
    if read_ahead.HELPERS == 0:
        pytest.skip("one CPU: no read-ahead helper")
    store = open_store(family["store"])
    sizes = [store.stat(identify_file(family["images"][n], family["model"]).identifier).size
             for n in (*SINGLE, *MULTI)]
    big = [n for n in sizes if n >= read_ahead.MIN_BYTES]
    # (each such load on two threads when the helper is free: loads may run side by side)
    assert big and 0 < len(family["read_ahead_jobs"]) <= len(big), (sizes,
                                                                    family["read_ahead_jobs"])


def test_the_consumer_starts_without_a_warning(family):
    """No start-up warning for any family (e.g. not the one for models without a vision
    tower: each of these has one)."""
    assert family["consumer_warnings"] == [], family["consumer_warnings"]


def test_output_equals_an_engine_without_the_connector(family):
    for name, (logprobs, _) in family["served"].items():
        want, _ = family["reference"][name]
        assert_logprobs_close(logprobs, want)


def test_entries_equal_the_serving_tower(family):
    rows = set()
    for names, (_, towers) in family["reference"].items():
        assert len(towers) == len(names), (names, [t.shape for t in towers])
        for name, tower in zip(names, towers):
            found = identify_file(family["images"][name], family["model"])
            assert found.kind == ("video" if name == VIDEO else "image"), (name, found.kind)
            entry = stored_tensor(family["store"], found.identifier)
            assert entry is not None and entry.shape == tower.shape, (name, tower.shape)
            assert (entry - tower).abs().max().item() < 1e-4, name
            assert tower.shape[1] == family["spec"].get("width", tower.shape[1]), tower.shape
            rows.add(tower.shape[0])
    # the row count follows each image's size / aspect ratio (but at fixed resolution)
    assert len(rows) == 1 if family["spec"].get("fixed") else len(rows) >= 2, rows
