"""Precompute identifies common images from their header (``identify_bytes(header_only=
True)``, connectors/vllm/hashing.py): the identifier must be exactly the one a full decode
gives -- the one ``vllm serve`` computes -- for every mode and format, with and without
server ``media_io_kwargs`` and request ``mm_processor_kwargs``; formats and files where
the header cannot tell (other formats, several frames, truncated or trailing data) are
decoded as before."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from encache.connectors.vllm.hashing import MediaError, identify_bytes
from media_files import animated_png, mpo

MODEL = "org/some-vlm"


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


def _images() -> dict[str, bytes]:
    rgb = Image.effect_noise((48, 32), 50).convert("RGB")
    rgba = rgb.convert("RGBA")
    rgba.putalpha(Image.linear_gradient("L").resize((48, 32)))
    p_trns = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    p_trns.info["transparency"] = 3
    i16 = Image.linear_gradient("L").resize((48, 32)).convert("I;16")
    return {
        "png-rgb": _save(rgb, "PNG"),
        "png-rgba": _save(rgba, "PNG"),
        "png-la": _save(rgba.convert("LA"), "PNG"),
        "png-l": _save(rgb.convert("L"), "PNG"),
        "png-p": _save(rgb.convert("P"), "PNG"),
        "png-p-trns": _save(p_trns, "PNG"),
        "png-1": _save(rgb.convert("1"), "PNG"),
        "png-i16": _save(i16, "PNG"),
        "png-exif-rotated": _save(rgb, "PNG", exif=_exif(6)),
        "jpeg-rgb": _save(rgb, "JPEG", quality=90),
        "jpeg-l": _save(rgb.convert("L"), "JPEG"),
        "jpeg-cmyk": _save(rgb.convert("CMYK"), "JPEG"),
        "jpeg-progressive": _save(rgb, "JPEG", progressive=True),
        "jpeg-exif-rotated": _save(rgb, "JPEG", exif=_exif(6)),
        "jpeg-exif-mirrored": _save(rgb, "JPEG", exif=_exif(2)),
        "webp-lossy": _save(rgb, "WEBP", quality=80),
        "webp-rgba-lossless": _save(rgba, "WEBP", lossless=True),
        "webp-exif-rotated": _save(rgb, "WEBP", exif=_exif(8)),
        "bmp-rgb": _save(rgb, "BMP"),
        "bmp-odd-width": _save(rgb.resize((45, 31)), "BMP"),
        "bmp-p": _save(rgb.convert("P"), "BMP"),
        "bmp-1": _save(rgb.convert("1"), "BMP"),
        # the header cannot tell (or other formats): decoded
        "gif": _save(rgb.convert("P"), "GIF"),
        "tiff-rgb": _save(rgb, "TIFF"),
        "tiff-cmyk": _save(rgb.convert("CMYK"), "TIFF"),
        "apng": animated_png(),
        "mpo": mpo(),
        "ico": _save(rgb.resize((16, 16)), "ICO"),
        "png-trailing-bytes": _save(rgb, "PNG") + b"\0" * 7,
        "jpeg-trailing-bytes": _save(rgb, "JPEG") + b"junk",
    }


IMAGES = _images()
SETTINGS = {
    "default": {},
    "black-background": {"media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}}},
    "keep-rgba": {"media_io_kwargs": {"image": {"image_mode": "RGBA"}}},
    "request-kwargs": {"mm_processor_kwargs": {"max_pixels": 200704}},
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_header_identity_is_the_decoded_identity(setting):
    kw = SETTINGS[setting]
    for name, data in IMAGES.items():
        full = identify_bytes(data, MODEL, **kw)
        quick = identify_bytes(data, MODEL, header_only=True, **kw)
        assert quick.identifier == full.identifier, (name, setting)
        assert quick.io_config == full.io_config, (name, setting)
        assert (quick.width, quick.height, quick.mode, quick.format) == \
            (full.width, full.height, full.mode, full.format), name
    with_lora = identify_bytes(IMAGES["png-rgba"], MODEL, lora="ad", header_only=True, **kw)
    assert with_lora.identifier == identify_bytes(IMAGES["png-rgba"], MODEL, lora="ad",
                                                  **kw).identifier


def test_which_files_skip_the_decode(monkeypatch):
    """Whole single-frame PNG/JPEG/WebP/BMP files are not decoded; every other file is."""
    from vllm.multimodal.media.image import ImageMediaIO

    decoded = []
    real = ImageMediaIO.load_bytes

    def counting(self, data):
        decoded.append(data)
        return real(self, data)
    monkeypatch.setattr(ImageMediaIO, "load_bytes", counting)
    for name, data in IMAGES.items():
        decoded.clear()
        identify_bytes(data, MODEL, header_only=True)
        header_only = name.split("-")[0] in ("png", "jpeg", "webp", "bmp") \
            and "trailing" not in name
        assert decoded == ([] if header_only else [data]), name


@pytest.mark.parametrize("name", ["png-rgb", "jpeg-rgb", "webp-lossy", "bmp-rgb"])
def test_truncated_files_are_still_unreadable(name):
    """A cut file fails the end-of-file check, so it is decoded -- and refused -- exactly
    as without ``header_only`` (precompute remembers it as unreadable)."""
    cut = IMAGES[name][: len(IMAGES[name]) * 2 // 3]
    with pytest.raises(MediaError) as full:
        identify_bytes(cut, MODEL)
    with pytest.raises(MediaError) as quick:
        identify_bytes(cut, MODEL, header_only=True)
    assert str(quick.value) == str(full.value)


def test_pixel_limit_applies_to_header_identities(monkeypatch):
    from vllm import envs

    monkeypatch.setattr(envs, "VLLM_MAX_IMAGE_PIXELS", 100)
    for name in ("png-rgb", "jpeg-rgb"):
        with pytest.raises(MediaError, match="exceed the maximum of 100 pixels"):
            identify_bytes(IMAGES[name], MODEL, header_only=True)
        with pytest.raises(MediaError, match="exceed the maximum of 100 pixels"):
            identify_bytes(IMAGES[name], MODEL)
