"""What counts as media: a file's kind (image, video or neither) from its first bytes.

What: :func:`sniff` reads a file's header (:data:`HEAD_BYTES`, never the whole file) or
takes bytes already read, and says whether ``vllm serve`` would load it as an image
(``image_url``: vLLM's ``ImageMediaIO``, i.e. Pillow, which recognises a file by content
-- animated PNG, MPO, ICO, … included), as a video (``video_url``: vLLM's video loader,
OpenCV/FFmpeg: MP4/MOV/3GP, WebM/MKV, AVI, FLV, ASF/WMV, MPEG-PS/TS, Ogg Theora), or
neither, with a short reason (empty file, text, unknown signature, …).

Why: a corpus is found by *content*, as the server's loader finds it, not by a suffix
list: files the server accepts under other names are encoded, and files that are not
media are skipped with a reason instead of failing or vanishing silently. Sniffing is
cheap (one small read) and callers do it only for files they cannot already place (see
:mod:`encache.jobs.corpus`). A file sniffed as media can still fail to *decode*
(truncated, decompression bomb, …): that is the hasher's finding, per file.

No vLLM import (Pillow only, imported on first use).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Sniffed", "sniff", "suffix_kind", "mime_type", "HEAD_BYTES", "IMAGE_SUFFIXES",
           "VIDEO_SUFFIXES", "MEDIA_SUFFIXES"]

#: bytes read from a file to sniff it (MPEG-TS needs 189; Pillow looks at 16)
HEAD_BYTES = 512

#: suffixes taken as images without sniffing (a superset is recognised by content)
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff",
                            ".apng", ".mpo", ".ico", ".jfif", ".jpe", ".avif", ".jp2", ".tga",
                            ".ppm", ".pgm", ".pbm", ".pnm", ".qoi", ".dib", ".pcx", ".psd",
                            ".icns", ".dds", ".sgi", ".rgb", ".xbm", ".xpm", ".cur"})
#: suffixes taken as videos without sniffing
VIDEO_SUFFIXES = frozenset({".mp4", ".m4v", ".mov", ".qt", ".3gp", ".3g2", ".webm", ".mkv",
                            ".avi", ".flv", ".wmv", ".asf", ".mpg", ".mpeg", ".ts", ".m2ts",
                            ".ogv"})
MEDIA_SUFFIXES = IMAGE_SUFFIXES | VIDEO_SUFFIXES

#: Pillow formats whose signature is too weak to trust without a matching suffix
#: (XBM accepts any file starting with "/*", PPM any "P1".."P6", WMF four bytes, …)
_WEAK_IMAGE_FORMATS = frozenset({"XBM", "PPM", "GBR", "WMF", "MCIDAS", "FITS", "PIXAR"})
#: Pillow formats it identifies but cannot decode (stub plugins): the server fails on them
_UNDECODABLE_IMAGE_FORMATS = frozenset({"MPEG", "BUFR", "GRIB", "HDF5"})
#: ISO-BMFF ("ftyp") brands that are still images (HEIF/AVIF), not videos
_IMAGE_BRANDS = frozenset({b"avif", b"avis", b"heic", b"heix", b"heim", b"heis", b"hevc",
                           b"hevx", b"mif1", b"msf1", b"miaf"})

_MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "MPO": "image/jpeg", "GIF": "image/gif",
         "WEBP": "image/webp", "BMP": "image/bmp", "TIFF": "image/tiff",
         "ICO": "image/x-icon", "AVIF": "image/avif", "mp4": "video/mp4",
         "quicktime": "video/quicktime", "webm": "video/webm", "avi": "video/x-msvideo",
         "flv": "video/x-flv", "asf": "video/x-ms-asf", "mpeg": "video/mpeg",
         "mpeg-ts": "video/mp2t", "ogg": "video/ogg"}


@dataclass(frozen=True)
class Sniffed:
    """``kind`` is "image", "video" or None (not media); ``format`` names what was
    recognised ("PNG", "mp4", …); ``reason`` says why a file is not media."""

    kind: str | None
    format: str | None = None
    reason: str | None = None

    def __bool__(self) -> bool:
        return self.kind is not None


def suffix_kind(path: str) -> str | None:
    """The kind a file *claims* by its suffix ("image", "video" or None)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in VIDEO_SUFFIXES:
        return "video"
    return None


def mime_type(sniffed: Sniffed) -> str:
    """A MIME type for a data URL of this media (vLLM ignores it except "video/jpeg")."""
    default = "video/mp4" if sniffed.kind == "video" else "image/png"
    return _MIME.get(sniffed.format or "", default)


def sniff(source: str | os.PathLike | bytes | bytearray | memoryview, *,
          name: str | None = None) -> Sniffed:
    """The media kind of a file (path: reads :data:`HEAD_BYTES`) or of its bytes
    (``name``: the file name they came from, whose suffix vouches for weak signatures)."""
    path = name
    if isinstance(source, (bytes, bytearray, memoryview)):
        head = bytes(source[:HEAD_BYTES])
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            return Sniffed(None, reason="a directory")
        try:
            with open(path, "rb") as f:
                head = f.read(HEAD_BYTES)
        except OSError as e:
            return Sniffed(None, reason=f"cannot read: {e.strerror or e}")
    if not head:
        return Sniffed(None, reason="empty file")
    video = _video_format(head)
    if video is not None:
        return video
    image, weak = _image_format(head, path)
    if image is not None:
        return image
    if weak is not None:
        return Sniffed(None, reason=f"a weak {weak} signature, not trusted without a "
                                    f"{weak} file suffix")
    return Sniffed(None, reason=_describe(head))


def _video_format(head: bytes) -> Sniffed | None:
    if len(head) >= 12 and head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in _IMAGE_BRANDS:
            return None  # HEIF/AVIF still image: Pillow decides
        if brand in (b"M4A ", b"M4B ", b"M4P ", b"F4A ", b"F4B "):
            return Sniffed(None, "mp4", f"audio only ({brand.decode().strip()})")
        return Sniffed("video", "quicktime" if brand == b"qt  " else "mp4")
    if len(head) >= 8 and head[4:8] in (b"moov", b"mdat", b"wide", b"free", b"skip"):
        return Sniffed("video", "quicktime")  # QuickTime without an ftyp box
    if head.startswith(b"\x1aE\xdf\xa3"):  # EBML: WebM / Matroska
        return Sniffed("video", "webm" if b"webm" in head[:64] else "matroska")
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return Sniffed("video", "avi")
    if head.startswith(b"FLV\x01"):
        return Sniffed("video", "flv")
    if head.startswith(b"\x30\x26\xb2\x75\x8e\x66\xcf\x11"):
        return Sniffed("video", "asf")
    if head.startswith(b"\x00\x00\x01\xba"):
        return Sniffed("video", "mpeg")
    if len(head) > 188 and head[0] == 0x47 and head[188] == 0x47:
        return Sniffed("video", "mpeg-ts")
    if head.startswith(b"OggS") and b"\x80theora" in head:
        return Sniffed("video", "ogg")
    return None


_pil_ready = False


def _image_format(head: bytes, path: str | None) -> tuple[Sniffed | None, str | None]:
    """Ask Pillow's own format plugins (the ones ``Image.open`` tries) about the header:
    ``(result, weak format matched without its suffix)``."""
    global _pil_ready
    from PIL import Image

    if not _pil_ready:
        Image.init()
        _pil_ready = True
    suffix = os.path.splitext(path)[1].lower() if path else ""
    by_suffix = Image.registered_extensions().get(suffix)
    weak = None
    for fmt in Image.ID:
        _, accept = Image.OPEN[fmt]
        if accept is None:  # no signature (TGA, SPIDER, IM…): only with its suffix
            continue
        try:
            verdict = accept(head)
        except Exception:  # a plugin's check choking on odd bytes is a "no"
            continue
        if not verdict:
            continue
        if fmt in _WEAK_IMAGE_FORMATS and by_suffix != fmt:
            weak = weak or fmt
            continue
        if fmt in _UNDECODABLE_IMAGE_FORMATS:
            return Sniffed(None, fmt, f"{fmt} data (Pillow cannot decode it)"), None
        if isinstance(verdict, str):  # Pillow: recognised but unsupported here
            return Sniffed(None, fmt, f"{fmt} image not supported: {verdict}"), None
        if fmt == "PNG" and b"acTL" in head:
            return Sniffed("image", "APNG"), None
        return Sniffed("image", fmt), None
    if by_suffix is not None and Image.OPEN.get(by_suffix, (None, None))[1] is None:
        return Sniffed("image", by_suffix), None  # signature-less format named by its suffix
    return None, weak


def _describe(head: bytes) -> str:
    """Why a header is not media, in a few words."""
    sample = head[:64]
    try:
        text = sample.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in "\t\r\n" for c in text):
        shown = " ".join(text.split())[:24]
        return f"text: {shown!r}"
    if head.startswith(b"%PDF"):
        return "a PDF document"
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive"
    return f"unknown signature {head[:8].hex(' ')}"


def error_text(e: BaseException) -> str:
    """An exception's message on one line, without the ``<_io.BytesIO object at 0x…>``
    reprs decoders put in it (so the same bad file gives the same line every run)."""
    import re

    text = " ".join(str(e).split()) or type(e).__name__
    return re.sub(r"\s*<_io\.\w+ object at 0x[0-9a-f]+>", "", text)


def unreadable_reason(e: BaseException) -> str:
    """One line (at most 300 characters, no object reprs) for a file that would not read
    or decode; a message already saying "not a …" (a :class:`MediaError` from the hasher)
    is kept as is."""
    text = error_text(e)
    return (text if text.startswith("not a") else f"not a readable image ({text})")[:300]
