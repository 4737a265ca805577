"""Images decoded in precompute's reader thread give byte-identical entries.

Real engine (the tiny LLaVA, in-process), real files: one corpus -- every format
``tests/demo_corpus.py`` writes plus RGBA with transparent pixels, LA,
P-with-transparency (tRNS), CMYK JPEG, 16-bit greyscale PNG, 1-bit, an EXIF-rotated JPEG
and a TIFF -- is precomputed twice: images decoded in the reader with the engine's own
loader (``image_pil`` parts), and every image sent as a data URL that the engine decodes
(the former path). The stores must hold the same identifiers and the same entries: the
same tensor bytes and the same header fields but the creation time.
The engine's chat parts are spied on, so the test fails if the decoded path silently
fell back to data URLs. Run with the server's default image loading, with
``media_io_kwargs`` (another RGBA background colour: a conversion setting the decoder must
honour) and with request ``mm_processor_kwargs`` (where vLLM hashes the item itself).
A file that no longer decodes when the reader meets it is that file's one-line failure.
"""

from __future__ import annotations

import io

import pytest

from engine_support import PRECOMPUTE_KW, AfterHashing

pytestmark = pytest.mark.engine


def _odd_images(root) -> list[str]:
    """Modes and metadata that exercise vLLM's conversion and EXIF handling."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(5)
    rgb = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8), "RGB")
    out = {}
    rgba = rgb.convert("RGBA")
    alpha = np.full((40, 56), 255, np.uint8)
    alpha[:, :20] = 0  # fully transparent: the background colour shows
    alpha[:, 20:30] = 90
    rgba.putalpha(Image.fromarray(alpha, "L"))
    out["rgba_transparent.png"] = (rgba, "PNG", {})
    la = rgb.convert("L").convert("LA")
    la.putalpha(Image.fromarray(alpha, "L"))
    out["la.png"] = (la, "PNG", {})
    pal = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    out["p_trns.png"] = (pal, "PNG", {"transparency": 3})
    out["cmyk.jpg"] = (rgb.convert("CMYK"), "JPEG", {"quality": 90})
    out["grey16.png"] = (Image.fromarray(rng.integers(0, 65535, (40, 56), dtype=np.uint16)),
                         "PNG", {})
    out["bilevel.png"] = (rgb.convert("1"), "PNG", {})
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise on display
    out["exif_rot.jpg"] = (rgb, "JPEG", {"exif": exif.tobytes(), "quality": 92})
    out["scan.tiff"] = (rgb, "TIFF", {})
    paths = []
    for name, (im, fmt, kw) in out.items():
        buf = io.BytesIO()
        im.save(buf, fmt, **kw)
        (root / name).write_bytes(buf.getvalue())
        paths.append(str(root / name))
    assert Image.open(root / "grey16.png").mode.startswith("I")  # 16-bit, not 8
    assert Image.open(root / "exif_rot.jpg").getexif().get(0x0112) == 6
    return paths


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    from demo_corpus import FORMATS, make_corpus

    root = tmp_path_factory.mktemp("decode-corpus")
    files = make_corpus(str(root / "demo"), pages=len(FORMATS), seed=3)
    # the same formats as pages of a document's proportions (the bench's --page-size)
    files += make_corpus(str(root / "pages"), pages=len(FORMATS), seed=4, size=(248, 351))
    return files + _odd_images(root)


def test_demo_corpus_page_size(tmp_path):
    """demo_corpus --size: every format at the size asked for; bad sizes
    are usage errors."""
    import argparse

    from PIL import Image

    from demo_corpus import FORMATS, make_corpus, parse_size

    files = make_corpus(str(tmp_path), pages=len(FORMATS), size=parse_size("620x877"))
    assert {Image.open(f).format for f in files} == {fmt for _, fmt, _ in FORMATS}
    assert all(Image.open(f).size == (620, 877) for f in files)
    for bad in ("620", "x877", "10x10", "axb"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def _spy_parts(monkeypatch) -> list[str]:
    """Record the type of every media part the producer sends to LLM.chat."""
    from encache.connectors.vllm.producer import ProducerEngine

    parts: list[str] = []
    original = ProducerEngine._conversation

    def spy(payload, identifier, kind="image"):
        conv = original(payload, identifier, kind)
        parts.append(conv[0]["content"][0]["type"])
        return conv

    monkeypatch.setattr(ProducerEngine, "_conversation", staticmethod(spy))
    return parts


def _entries(store_dir) -> dict[str, tuple]:
    """identifier -> (header fields but the creation time, tensor bytes)."""
    from encache.connectors.store import decode, open_store

    with open_store(str(store_dir), create=False) as store:
        out = {}
        for ident in store.identifiers():
            meta, data = decode(store.get(ident), identifier=ident)
            header = {k: v for k, v in meta.to_dict().items() if k != "created"}
            out[ident] = (header, bytes(data))
        return out


def _precompute(files, model, store, decode, request=None, engine_args=None):
    from encache.jobs.precompute import LocalStage, PrecomputeOptions, precompute_files

    kw = dict(PRECOMPUTE_KW)
    kw["engine_args"] = {**kw["engine_args"], **(engine_args or {})}
    options = PrecomputeOptions(model=model, store=str(store), batch=4,
                                request_mm_processor_kwargs=request, **kw)
    return precompute_files(files, options, stage=LocalStage(decode=decode))


@pytest.mark.parametrize("setting", ["default", "media_io_kwargs", "request_kwargs"])
def test_decoded_in_the_reader_is_byte_identical(tiny_model, corpus, tmp_path, monkeypatch,
                                                 setting):
    from encache.connectors.vllm.hashing import identify_file

    engine_args = request = media_io = None
    if setting == "media_io_kwargs":
        media_io = {"image": {"rgba_background_color": [0, 90, 200]}}
        engine_args = {"media_io_kwargs": media_io}
    elif setting == "request_kwargs":
        request = {"do_normalize": False}
    parts = _spy_parts(monkeypatch)
    runs = {}
    for decode in (True, False):
        parts.clear()
        s = _precompute(corpus, tiny_model, tmp_path / f"decode-{decode}", decode,
                        request=request, engine_args=engine_args)
        assert s.failed == 0 and s.encoded == len(corpus), s.failures
        # every image went the intended way: decoded in the reader, or as a data URL
        assert parts == ["image_pil" if decode else "image_url"] * len(corpus), parts
        runs[decode] = _entries(tmp_path / f"decode-{decode}")
    decoded, urls = runs[True], runs[False]
    assert len(decoded) == len(corpus)
    assert sorted(decoded) == sorted(urls)
    differ = [i for i in decoded if decoded[i] != urls[i]]
    assert not differ, f"{len(differ)} entries differ"
    # and the identifiers are those vllm serve computes for the files
    expected = {identify_file(f, tiny_model, media_io_kwargs=media_io,
                              mm_processor_kwargs=request).identifier for f in corpus}
    assert set(decoded) == expected


def test_settings_change_the_decoded_pixels(tiny_model, corpus, tmp_path):
    """The control: the test above can tell images apart -- another RGBA background gives
    another encoder output for each transparent image, so a decoder ignoring the setting
    would be caught (the identifiers differ too: the server hashes media_io_kwargs)."""
    from encache.connectors.vllm.hashing import identify_file

    blue = {"image": {"rgba_background_color": [0, 90, 200]}}
    rgba = [f for f in corpus if f.endswith(("rgba_transparent.png", "la.png", "p_trns.png"))]
    assert len(rgba) == 3
    _precompute(rgba, tiny_model, tmp_path / "white", True)
    _precompute(rgba, tiny_model, tmp_path / "blue", True, engine_args={"media_io_kwargs": blue})
    white_entries, blue_entries = _entries(tmp_path / "white"), _entries(tmp_path / "blue")
    for f in rgba:
        on_white = white_entries[identify_file(f, tiny_model).identifier]
        on_blue = blue_entries[identify_file(f, tiny_model, media_io_kwargs=blue).identifier]
        assert on_white[1] != on_blue[1], f


def test_a_file_that_stops_decoding_is_its_own_failure(tiny_model, tmp_path):
    """Hashed fine, then cut short before the reader reads it: a one-line failure worded
    as the hashing phase words it; the rest of its batch is encoded."""
    from encache.jobs.precompute import LocalStage, PrecomputeOptions, precompute_files
    from media_files import png_bytes

    root = tmp_path / "c"
    root.mkdir()
    files = []
    for i in range(3):
        (root / f"p{i}.png").write_bytes(png_bytes((30 + i, 20), (i * 70, 20, 90)))
        files.append(str(root / f"p{i}.png"))

    def cut():
        (root / "p1.png").write_bytes(png_bytes((50, 50))[:60])

    options = PrecomputeOptions(model=tiny_model, store=str(tmp_path / "s"), batch=4,
                                **PRECOMPUTE_KW)
    s = precompute_files(files, options, stage=LocalStage(), progress=AfterHashing(cut))
    assert s.encoded == 2 and s.failed == 1, s.failures
    (failure,) = s.failures
    assert failure["path"].endswith("p1.png")
    assert failure["error"].startswith("not a readable image (")
    assert "\n" not in failure["error"] and "Traceback" not in failure["error"]


def _fake_llm(media_io_kwargs=None):
    """What image_decoder reads of an LLM: its model config's media_io_kwargs."""
    from types import SimpleNamespace

    mm = SimpleNamespace(media_io_kwargs=media_io_kwargs)
    return SimpleNamespace(model_config=SimpleNamespace(multimodal_config=mm))


@pytest.mark.parametrize("media_io", [None, {"image": {"rgba_background_color": [9, 9, 9]}},
                                      {"image": {"image_mode": None}}])
def test_decoder_equals_vllms_fetch_image(corpus, media_io):
    """Without an engine: the decoder's result equals what vLLM's MediaConnector.
    fetch_image makes of the file's data URL -- same pixels, mode, size, original bytes
    and io_config (the hash inputs) -- for every file of the corpus."""
    import numpy as np
    from vllm.multimodal.media.connector import MediaConnector

    from encache.connectors.media import mime_type, sniff
    from encache.connectors.vllm.decode import image_decoder
    from encache.connectors.vllm.producer import data_url

    decode = image_decoder(_fake_llm(media_io))
    connector = MediaConnector(media_io)
    for f in corpus:
        data = open(f, "rb").read()
        ours = decode(data)
        theirs = connector.fetch_image(data_url(data, mime=mime_type(sniff(data, name=f))))
        assert type(ours) is type(theirs), f
        assert ours.original_bytes == theirs.original_bytes == data
        assert ours.io_config == theirs.io_config, f
        assert (ours.media.mode, ours.media.size) == (theirs.media.mode, theirs.media.size), f
        assert np.array_equal(np.asarray(ours.media), np.asarray(theirs.media)), f


def test_no_decoder_under_a_custom_media_connector(monkeypatch):
    """A VLLM_MEDIA_CONNECTOR naming another class (it may load images its own way): no
    decoder, every image stays a data URL; likewise image settings the loader refuses."""
    from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY, MediaConnector

    from encache.connectors.vllm.decode import image_decoder

    class Custom(MediaConnector):
        pass

    monkeypatch.setitem(MEDIA_CONNECTOR_REGISTRY.name2class, "encache-test-custom", Custom)
    assert image_decoder(_fake_llm()) is not None
    monkeypatch.setenv("VLLM_MEDIA_CONNECTOR", "encache-test-custom")
    assert image_decoder(_fake_llm()) is None
    monkeypatch.delenv("VLLM_MEDIA_CONNECTOR")
    assert image_decoder(_fake_llm({"image": {"rgba_background_color": "red"}})) is None
