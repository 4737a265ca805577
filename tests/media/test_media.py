"""Media by content: the sniffer, hostile files as per-file failures, and video
identifiers computed with vLLM's own loader and hasher.

The video parity check here drives vLLM's server-side request path in-process: the
chat-message parser of the OpenAI server (``parse_chat_messages`` -> ``MediaConnector.
fetch_video``) feeding ``ProcessorInputs.get_mm_hashes``, for a ``video_url`` data URL
exactly as a client sends it -- and compares with :func:`identify_file`.
"""

from __future__ import annotations

import base64
import os

import pytest

from encache.connectors.media import sniff, suffix_kind
from media_files import (BAD, NON_MEDIA, animated_png, hostile_corpus, make_bomb, make_video,
                         mpo, noisy_jpeg, png_bytes)

MODEL = "org/some-vlm"


# -- sniffing -------------------------------------------------------------------------

@pytest.mark.parametrize("data,kind,fmt", [
    (png_bytes(), "image", "PNG"),
    (noisy_jpeg(), "image", "JPEG"),
    (animated_png(), "image", "APNG"),
    (mpo(), "image", "JPEG"),  # MPO is a JPEG stream with extra frames: Pillow opens it as MPO
    (png_bytes(fmt="ICO"), "image", "ICO"),
    (png_bytes(fmt="WEBP"), "image", "WEBP"),
    (png_bytes(fmt="GIF"), "image", "GIF"),
    (png_bytes(fmt="TIFF"), "image", "TIFF"),
    (png_bytes(fmt="BMP"), "image", "BMP"),
    (b"", None, None),
    (b"hello, I am text", None, None),
    (b"/* looks like XBM to Pillow, but it is C */ int x;", None, None),
    (b"%PDF-1.7\n\x00\xff", None, None),
    (bytes(range(256)), None, None),
])
def test_sniff_bytes(data, kind, fmt):
    found = sniff(data)
    assert found.kind == kind
    assert bool(found) is (kind is not None)
    if kind:
        assert found.format == fmt and found.reason is None
    else:
        assert found.reason  # always says why


@pytest.mark.parametrize("fourcc,name,fmt", [("mp4v", "v.mp4", "mp4"), ("MJPG", "v.avi", "avi"),
                                             ("VP80", "v.webm", "webm")])
def test_sniff_videos_by_content_whatever_the_name(tmp_path, fourcc, name, fmt):
    path = make_video(tmp_path / name, fourcc=fourcc)
    assert sniff(path).kind == "video" and sniff(path).format == fmt
    renamed = tmp_path / "no_suffix"
    path.rename(renamed)
    assert sniff(renamed).kind == "video"  # by content
    assert sniff(renamed.read_bytes()).format == fmt


def test_sniff_reads_a_header_only_and_explains(tmp_path):
    big = tmp_path / "big.dat"
    big.write_bytes(b"x" * 10_000_000)
    assert "text" in sniff(big).reason
    assert sniff(tmp_path).reason == "a directory"
    assert "cannot read" in sniff(tmp_path / "missing").reason
    assert sniff(tmp_path / "missing").kind is None


def test_weak_signatures_need_their_suffix(tmp_path):
    from PIL import Image
    p = tmp_path / "x.ppm"
    Image.new("RGB", (4, 4)).save(p)
    assert sniff(p).kind == "image"
    assert sniff(p.read_bytes()).kind is None and "PPM" in sniff(p.read_bytes()).reason
    assert sniff(p.read_bytes(), name="y.ppm").kind == "image"


def test_suffix_kind():
    assert suffix_kind("a/b.JPG") == "image" and suffix_kind("x.apng") == "image"
    assert suffix_kind("c.mp4") == "video" and suffix_kind("c.webm") == "video"
    assert suffix_kind("notes.txt") is None and suffix_kind("README") is None


# -- identifiers: hostile files are per-file MediaErrors ------------------------------

@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    return make_bomb(tmp_path_factory.mktemp("bomb") / "bomb.png")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, bomb):
    root = tmp_path_factory.mktemp("hostile") / "corpus"
    info = hostile_corpus(root, bomb=bomb)
    return root, info


@pytest.mark.slow
def test_identify_file_good_and_hostile(hostile):
    from encache.connectors.vllm.hashing import MediaError, identify_file
    root, info = hostile
    kinds = {}
    for rel in info["good"]:
        ident = identify_file(root / rel, MODEL)
        assert len(ident.base_hash) == 64
        kinds[rel] = ident.kind
    assert {r for r, k in kinds.items() if k == "video"} == set(info["videos"])
    for rel in sorted(BAD):
        with pytest.raises(MediaError) as e:
            identify_file(root / rel, MODEL)
        msg = str(e.value)
        assert msg.startswith("not a readable") and "\n" not in msg and len(msg) <= 300
    with pytest.raises(MediaError, match="could be decompression bomb"):
        identify_file(root / "bomb.png", MODEL)
    with pytest.raises(MediaError, match="empty file"):
        identify_file(root / "empty.png", MODEL)
    with pytest.raises(MediaError, match="directory"):
        identify_file(root / "album.png", MODEL)
    for rel in NON_MEDIA:
        with pytest.raises(MediaError, match="not a readable image"):
            identify_file(root / rel, MODEL)


# -- video identifiers ----------------------------------------------------------------

@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return {"a": make_video(d / "a.mp4", frames=8, fps=4.0, seed=1),
            "b": make_video(d / "b.mp4", frames=8, fps=4.0, seed=2),
            "long": make_video(d / "long.mp4", frames=24, fps=8.0, seed=3),
            "webm": make_video(d / "c.webm", fourcc="VP80", seed=1)}


def served_video_hash(path, model: str, *, video_processor: str | None,
                      media_io_kwargs: dict | None = None,
                      request_media_io_kwargs: dict | None = None,
                      mm_processor_kwargs: dict | None = None, algo: str = "blake3") -> str:
    """The identifier vLLM's OpenAI chat path computes for a ``video_url`` message part:
    the server's own message parser loads the data URL (``MultiModalItemTracker`` +
    ``MediaConnector``, as ``parse_chat_messages`` does), the renderer's kwargs merge
    (``ChatParams.with_defaults``), and the processor inputs' hasher."""
    from vllm.multimodal.media.connector import MediaConnector
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.renderers.params import ChatParams

    params = ChatParams(media_io_kwargs=request_media_io_kwargs,
                        mm_processor_kwargs=mm_processor_kwargs).with_defaults(
        default_media_io_kwargs=media_io_kwargs,
        default_mm_processor_kwargs=mm_processor_kwargs)
    url = "data:video/mp4;base64," + base64.b64encode(open(path, "rb").read()).decode()
    video = MediaConnector(params.media_io_kwargs).fetch_video(url, video_processor=video_processor)
    items = MultiModalDataParser(video_needs_metadata=True).parse_mm_data({"video": [video]})
    return ProcessorInputs(prompt=[], mm_data_items=items,
                           hf_processor_mm_kwargs=params.mm_processor_kwargs or {},
                           media_io_kwargs=params.media_io_kwargs or {}
                           ).get_mm_hashes(model, algo)["video"][0]


@pytest.mark.slow
@pytest.mark.parametrize("processor", [None, "Qwen2VLVideoProcessor"])
def test_video_identifier_matches_the_served_path(clips, processor):
    from encache.connectors.vllm.hashing import identify_file
    for name in ("a", "long", "webm"):
        ident = identify_file(clips[name], MODEL, video_processor=processor)
        assert ident.kind == "video"
        assert ident.identifier == served_video_hash(clips[name], MODEL,
                                                     video_processor=processor)
    kw = dict(media_io_kwargs={"video": {"num_frames": 4}},
              request_media_io_kwargs={"video": {"fps": 1}},
              mm_processor_kwargs={"fps": 1.0})
    ident = identify_file(clips["long"], MODEL, video_processor=processor, **kw)
    assert ident.identifier == served_video_hash(clips["long"], MODEL,
                                                 video_processor=processor, **kw)
    assert ident.hash_factors["mm_processor_kwargs"] == {"fps": 1.0}


@pytest.mark.slow
def test_video_identifier_inputs(clips):
    """What the identifier depends on: content, model string, LoRA, and every setting
    that changes which frames are sampled (the sampling metadata is hashed)."""
    from encache.connectors.vllm.hashing import identify_file
    a = identify_file(clips["a"], MODEL)
    assert a.video["frames"] == 8 and a.video["frames_indices"] == list(range(8))
    assert a.video["source_fps"] == pytest.approx(4.0) and a.video["total_num_frames"] == 8
    assert a.video["loader"] == "opencv" and a.width == 64 and a.height == 48
    assert a.video["hashed_content"] in ("file bytes", "frames")
    assert identify_file(clips["a"], MODEL).identifier == a.identifier  # deterministic
    assert identify_file(clips["b"], MODEL).identifier != a.identifier
    assert identify_file(clips["a"], MODEL + "/").identifier != a.identifier
    lora = identify_file(clips["a"], MODEL, lora="ad1")
    assert lora.identifier == "ad1:" + a.identifier
    # Qwen2-VL/Qwen2.5-VL sampling (fps 2, even frame counts) picks other frames
    q = identify_file(clips["long"], MODEL, video_processor="Qwen2VLVideoProcessor")
    u = identify_file(clips["long"], MODEL)
    assert q.video["loader"] == "qwen2_vl" and q.video["frames"] % 2 == 0
    assert q.video["frames"] < u.video["frames"] == 24
    assert q.identifier != u.identifier
    # the server's frame settings change the identifier
    n4 = identify_file(clips["long"], MODEL, media_io_kwargs={"video": {"num_frames": 4}})
    assert n4.video["frames"] == 4 and n4.identifier != u.identifier
    assert n4.hash_factors == {"media_io_kwargs": {"video": {"num_frames": 4}}}
    fps1 = identify_file(clips["long"], MODEL, media_io_kwargs={"video": {"fps": 1}})
    assert fps1.video["frames"] == 3 and fps1.identifier not in (u.identifier, n4.identifier)
    # image settings are not a video's hash factor (modality-scoped, as vLLM does)
    img = identify_file(clips["a"], MODEL, media_io_kwargs={"image": {"image_mode": "RGB"}})
    assert img.identifier == a.identifier


@pytest.mark.slow
def test_video_processor_is_read_from_a_local_model(tmp_path, clips):
    """The sampler follows the model's video processor, as the server resolves it."""
    import json
    from encache.connectors.vllm.hashing import identify_file, video_processor_name
    model = tmp_path / "qwen-like"
    model.mkdir()
    (model / "preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen2VLVideoProcessor"}))
    assert video_processor_name(str(model)) == "Qwen2VLVideoProcessor"
    ident = identify_file(clips["long"], str(model))
    assert ident.video["video_processor"] == "Qwen2VLVideoProcessor"
    assert ident.identifier == served_video_hash(clips["long"], str(model),
                                                 video_processor="Qwen2VLVideoProcessor")


def test_corpus_walk_is_all_regular_files_and_sniffs_lazily(tmp_path, monkeypatch):
    from encache.jobs import corpus
    (tmp_path / "a.png").write_bytes(png_bytes())
    (tmp_path / "b").write_bytes(png_bytes())
    (tmp_path / "c.txt").write_text("hello")
    (tmp_path / "d.png").mkdir()
    (tmp_path / "d.png" / "e.jpg").write_bytes(noisy_jpeg())
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / ".hidden").write_text("x")
    files = corpus.walk(tmp_path)
    assert [f.rel for f in files] == ["a.png", "b", "c.txt", "d.png/e.jpg"]
    sniffed = []
    real = corpus.sniff
    monkeypatch.setattr(corpus, "sniff", lambda p: sniffed.append(p) or real(p))
    reasons = {f.rel: corpus.non_media_reason(f) for f in files}
    assert reasons["a.png"] is None and reasons["b"] is None and reasons["d.png/e.jpg"] is None
    assert "text" in reasons["c.txt"]
    assert sorted(os.path.basename(p) for p in sniffed) == ["b", "c.txt"]  # suffix: no read


@pytest.mark.slow
def test_video_frame_settings_change_the_identifier_on_every_path(clips):
    """Why server video settings need no encoder-config stamp: even where the server's
    media_io_kwargs are *not* a hash factor (``LLM.chat``), the frames they sample are
    -- vLLM hashes the sampling metadata with each video. And video processor kwargs
    are in the stamp."""
    from encache.connectors.encoder_config import encoder_config_digest
    from vllm.multimodal.media.connector import MediaConnector
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs

    url = "data:video/mp4;base64," + base64.b64encode(clips["long"].read_bytes()).decode()

    def unfactored_hash(load_kwargs):  # loaded with the settings, hashed without them
        video = MediaConnector(load_kwargs).fetch_video(url)
        items = MultiModalDataParser(video_needs_metadata=True).parse_mm_data({"video": [video]})
        return ProcessorInputs(prompt=[], mm_data_items=items).get_mm_hashes(MODEL, "blake3")["video"][0]

    hashes = {unfactored_hash(kw) for kw in (None, {"video": {"num_frames": 4}},
                                             {"video": {"fps": 1}}, {"video": {"fps": 2}})}
    assert len(hashes) == 4
    assert len({encoder_config_digest(kw) for kw in (None, {"fps": 1.0},
                {"videos_kwargs": {"max_pixels": 50176}}, {"min_pixels": 3136})}) == 4


def test_iso_bmff_brands():
    box = lambda brand: b"\x00\x00\x00\x18ftyp" + brand + b"\x00\x00\x00\x00isom"  # noqa: E731
    assert sniff(box(b"isom")).kind == "video" and sniff(box(b"qt  ")).format == "quicktime"
    assert sniff(box(b"M4A ")).kind is None and "audio" in sniff(box(b"M4A ")).reason
    assert sniff(box(b"heic")).kind is None  # a HEIF still: Pillow cannot open it here
