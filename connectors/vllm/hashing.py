"""The identifier vLLM computes for an image or video file sent to ``vllm serve``.

A served ``image_url`` (http(s) URL or base64 data URL) is loaded by
``ImageMediaIO(image_mode="RGB", **media_io_kwargs["image"]).load_bytes(file_bytes)``,
which keeps the original bytes; ``MultiModalHasher`` then hashes those *bytes* (plus an
``io_config`` when the image had to be converted, e.g. RGBA/P/L -> RGB) together with the
model id string exactly as given to ``--model``. Hashing the decoded PIL image — what
``LLM.generate(multi_modal_data={"image": pil})`` does — gives a different identifier,
so precompute must hash files the way the server does. We call vLLM's own code for both
steps rather than re-implementing either, so a vLLM upgrade that changes the scheme
changes ours with it (and the parity tests catch it).

With tower-connector LoRA (``enable_tower_connector_lora``) vLLM prefixes the hash:
``{lora_name}:{hash}``.

Videos (``video_url``): the server loads the bytes with ``MediaConnector.fetch_video`` --
``VideoMediaIO`` with the merged ``--media-io-kwargs`` / request ``media_io_kwargs``
``"video"`` settings and the frame sampler registered for the model's video processor
(Qwen2-VL/Qwen2.5-VL: ``Qwen2VLVideoProcessor`` -> fps-based ``qwen2_vl`` sampling,
fps 2 by default; other models: uniform ``opencv``). The hasher then hashes the pair
*(media, metadata)*: the original file bytes -- or the decoded frames when those are
smaller than the file -- *and* the sampling metadata (source fps, total frames, duration,
the sampled frame indices, the decoder). So anything that changes which frames are
sampled changes the identifier. :func:`identify_video_bytes` runs exactly these steps
with vLLM's own classes (``ProcessorInputs.get_mm_hashes``).

Any failure to read or decode one file (truncated data, a decompression bomb, a file
that is not media) is raised as :class:`MediaError` (a ValueError), so callers can make
it that file's failure and go on.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import asdict, dataclass, field

from ..media import sniff, suffix_kind
from ..store.files import READ_FLAGS, NotAFile, regular

DEFAULT_HASH_ALGO = "blake3"  # vLLM's default --mm-hasher-algorithm


class MediaError(ValueError):
    """One file cannot be read or decoded as the server would (message: one line)."""


@contextlib.contextmanager
def _decoding(kind: str):
    """Turn *any* decoding error (Pillow's DecompressionBombError is not an OSError,
    plugins raise SyntaxError, struct.error, …) into a one-line :class:`MediaError`."""
    try:
        yield
    except MediaError:
        raise
    except ImportError:  # the environment, not the file: let the caller say so
        raise
    except Exception as e:
        from ..media import error_text
        text = error_text(e)
        raise MediaError(f"not a readable {kind} ({text})"[:300]) from e


@dataclass(frozen=True)
class Identity:
    """A media item's identifier and every input that went into it."""

    identifier: str
    base_hash: str
    lora: str | None
    model: str
    hash_algo: str
    io_config: dict | None
    path: str | None = None
    size: int | None = None
    width: int | None = None
    height: int | None = None
    mode: str | None = None
    hash_factors: dict = field(default_factory=dict)
    kind: str = "image"  # or "video"
    format: str | None = None  # what the content was recognised as (PNG, mp4, …)
    video: dict | None = None  # frames sampled, metadata, loader (videos only)

    def to_dict(self) -> dict:
        return asdict(self)


#: formats whose decoded mode is the mode their header declares (one frame, no mode change
#: on load), so the served identifier can be computed from the header: see _header_media
HEADER_ONLY_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "BMP"})


def image_loader(image_kwargs: dict | None = None):
    """The ``ImageMediaIO`` that vLLM's ``MediaConnector.fetch_image`` builds for these
    ``"image"`` media_io_kwargs: RGB unless they say otherwise. Raises what it raises for
    settings it refuses."""
    from vllm.multimodal.media.image import ImageMediaIO

    return ImageMediaIO(**({"image_mode": "RGB"} | (image_kwargs or {})))


def _header_media(data: bytes, loader):
    """What ``ImageMediaIO.load_bytes`` would return *for hashing*, from the header alone,
    or None when that cannot be known without decoding.

    The hasher reads three things of the loaded image: the original bytes, the
    ``io_config`` (set exactly when the decoded mode differs from ``image_mode``: EXIF
    transposition keeps the mode) and an EXIF ``ImageID`` that is a ``uuid.UUID`` object —
    which a decoded file never has (Pillow yields ints, strings and bytes). For
    single-frame PNG/JPEG/WebP/BMP the decoded mode is the header's, so the identifier is
    the served one without decoding a pixel (``tests/media/test_hash_header_only.py``
    compares both ways over every mode and format we know of). The pixel-size limit
    (``VLLM_MAX_IMAGE_PIXELS``) is checked as the loader does, and a file that does not
    end where its format says (:func:`_ends_whole`: truncation, the common damage) is
    decoded instead, so it is found unreadable here as before. Damage inside an intact
    frame is not noticed here: it fails where the image is decoded for the engine."""
    from io import BytesIO

    from vllm import envs
    from vllm.multimodal.image import open_image
    from vllm.multimodal.media import MediaWithBytes

    try:
        image = open_image(BytesIO(data))
    except Exception:  # the loader's own attempt says why, in its words
        return None
    if image.format not in HEADER_ONLY_FORMATS or getattr(image, "n_frames", 1) != 1:
        return None
    if not _ends_whole(data, image.format):
        return None
    w, h = image.size
    max_pixels = envs.VLLM_MAX_IMAGE_PIXELS
    if max_pixels > 0 and w * h > max_pixels:
        raise ValueError(f"Image dimensions {w}x{h} ({w * h} pixels) exceed the maximum of "
                         f"{max_pixels} pixels. Set VLLM_MAX_IMAGE_PIXELS to increase this limit.")
    io_config = None
    if loader.image_mode is not None and image.mode != loader.image_mode:
        io_config = {"image_mode": loader.image_mode,
                     "rgba_background_color": loader.rgba_background_color}
    return MediaWithBytes(image, data, io_config)


_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the IEND chunk: length, type, CRC


def _ends_whole(data: bytes, fmt: str) -> bool:
    """Does the file end where its format says (IEND, EOI, RIFF or BMP size)? Anything
    else — truncated, or bytes after the end — is left to a real decode."""
    if fmt == "PNG":
        return data.endswith(_PNG_END)
    if fmt == "JPEG":
        return data.endswith(b"\xff\xd9")
    if fmt == "WEBP":
        riff = int.from_bytes(data[4:8], "little") + 8
        return riff + (riff & 1) == len(data) or riff == len(data)
    if fmt == "BMP":
        return 14 < int.from_bytes(data[2:6], "little") == len(data)
    return False


def identify_bytes(data: bytes, model: str, *, lora: str | None = None,
                   hash_algo: str = DEFAULT_HASH_ALGO, media_io_kwargs: dict | None = None,
                   request_media_io_kwargs: dict | None = None,
                   mm_processor_kwargs: dict | None = None, path: str | None = None,
                   header_only: bool = False) -> Identity:
    """Identity of an image given as its file bytes, as ``vllm serve``'s OpenAI API
    computes it. Raises ValueError if not an image.

    ``media_io_kwargs`` are the server's (``--media-io-kwargs``), ``request_media_io_kwargs``
    a request's own field (merged over the server's, per modality). Measured on vLLM 0.32:
    the OpenAI server loads the image with the merged kwargs *and* hashes them as a factor
    (``LLM.chat`` with ``LLM(media_io_kwargs=...)`` loads with them but does not hash them;
    a precomputed uuid is stored as given either way). ``mm_processor_kwargs`` are a
    request's own processor kwargs (a factor); the server's ``--mm-processor-kwargs`` never
    enter the identifier (see :mod:`encache.connectors.encoder_config`).

    ``header_only``: compute the same identifier without decoding the pixels where the
    format allows (:func:`_header_media`; precompute, which decodes each image once more
    for the engine anyway). Default: decode, which also proves the image readable.
    """
    from vllm.multimodal.hasher import MultiModalHasher

    image_kwargs = {**(media_io_kwargs or {}).get("image", {}),
                    **(request_media_io_kwargs or {}).get("image", {})}
    with _decoding("image"):
        loader = image_loader(image_kwargs)
        media = _header_media(data, loader) if header_only else None
        if media is None:
            media = loader.load_bytes(data)
    # Hash factors exactly as vLLM adds them (multimodal/processing/inputs.py): only
    # when non-empty, media_io_kwargs scoped to the modality.
    factors: dict = {}
    if image_kwargs:
        factors["media_io_kwargs"] = {"image": image_kwargs}
    if mm_processor_kwargs:
        factors["mm_processor_kwargs"] = dict(mm_processor_kwargs)
    base = MultiModalHasher.hash_kwargs(hash_algo, model_id=model, image=media, **factors)
    import io

    from PIL import Image

    with _decoding("image"), Image.open(io.BytesIO(data)) as original:  # header only
        width, height, mode, fmt = original.width, original.height, original.mode, original.format
    return Identity(
        identifier=f"{lora}:{base}" if lora else base, base_hash=base, lora=lora or None,
        model=model, hash_algo=hash_algo, io_config=media.io_config, path=path,
        size=len(data), width=width, height=height, mode=mode,
        hash_factors=factors, format=fmt,
    )


@functools.lru_cache(maxsize=16)
def video_processor_name(model: str, revision: str | None = None) -> str | None:
    """The model's video processor class, as the server resolves it (it picks the frame
    sampler): vLLM's own lookup in the model's (video_)preprocessor_config.json /
    config.json. None when the model has none or cannot be read (uniform sampling).
    Looked up once per model and process (a hub id may mean network round trips)."""
    from vllm.transformers_utils.processor import get_video_processor_cls_name_from_config

    try:
        return get_video_processor_cls_name_from_config(model, revision=revision)
    except Exception:  # unreadable/offline hub id: the server would fall back likewise
        return None


def identify_video_bytes(data: bytes, model: str, *, lora: str | None = None,
                         hash_algo: str = DEFAULT_HASH_ALGO,
                         media_io_kwargs: dict | None = None,
                         request_media_io_kwargs: dict | None = None,
                         mm_processor_kwargs: dict | None = None, path: str | None = None,
                         mime: str = "video/mp4", video_processor: str | None = None,
                         revision: str | None = None) -> Identity:
    """Identity of a video file as ``vllm serve`` computes it for a ``video_url`` data URL
    of these bytes. Every step is vLLM's: the server/request ``media_io_kwargs`` merge
    (``merge_media_io_kwargs``), loading (``MediaConnector.fetch_video`` with the model's
    video processor's sampler), parsing and hashing (``ProcessorInputs.get_mm_hashes``:
    media + sampling metadata, modality-scoped factors). ``video_processor`` overrides
    the class looked up from ``model``. Raises :class:`MediaError` if not a video."""
    import base64

    from vllm.multimodal.media.connector import MediaConnector, merge_media_io_kwargs
    from vllm.multimodal.parse import MultiModalDataParser
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.multimodal.video import get_video_loader_backend_for_processor

    merged = merge_media_io_kwargs(media_io_kwargs, request_media_io_kwargs) or {}
    if video_processor is None:
        video_processor = video_processor_name(model, revision)
    url = f"data:{mime};base64," + base64.b64encode(data).decode("ascii")
    with _decoding("video"):
        media = MediaConnector(merged).fetch_video(url, video_processor=video_processor)
        frames, metadata = media.media
        items = MultiModalDataParser(video_needs_metadata=True).parse_mm_data({"video": [media]})
        inputs = ProcessorInputs(prompt=[], mm_data_items=items,
                                 hf_processor_mm_kwargs=dict(mm_processor_kwargs or {}),
                                 media_io_kwargs=merged)
        base = inputs.get_mm_hashes(model, hash_algo)["video"][0]
    if len(frames) == 0:
        raise MediaError("not a readable video (no frame could be decoded)")
    factors: dict = {}
    if merged.get("video"):
        factors["media_io_kwargs"] = {"video": dict(merged["video"])}
    if mm_processor_kwargs:
        factors["mm_processor_kwargs"] = {k: v for k, v in mm_processor_kwargs.items()
                                          if k not in ("images_kwargs", "audio_kwargs")}
    video_kwargs = dict(merged.get("video") or {})
    loader = (video_kwargs.get("video_backend")
              or get_video_loader_backend_for_processor(video_processor)
              or _env_video_loader())
    shape = tuple(int(x) for x in frames.shape)
    return Identity(
        identifier=f"{lora}:{base}" if lora else base, base_hash=base, lora=lora or None,
        model=model, hash_algo=hash_algo, io_config=None, path=path, size=len(data),
        width=shape[2] if len(shape) > 2 else None, height=shape[1] if len(shape) > 1 else None,
        mode=None, hash_factors=factors, kind="video",
        format=sniff(data, name=path).format,
        video={
            "frames": shape[0],
            "frames_indices": list(metadata.get("frames_indices") or []),
            "total_num_frames": metadata.get("total_num_frames"),
            "source_fps": metadata.get("fps"),
            "duration": metadata.get("duration"),
            "decoder": metadata.get("video_backend"),
            "loader": loader,
            "video_processor": video_processor,
            # what the hasher fed the digest besides the metadata: vLLM hashes the
            # decoded frames instead of the file when they are the smaller of the two
            "hashed_content": "frames" if frames.nbytes < len(data) else "file bytes",
        },
    )


def _env_video_loader() -> str:
    from vllm import envs
    return envs.VLLM_VIDEO_LOADER_BACKEND


def identify_file(path: str | os.PathLike, model: str, *, lora: str | None = None,
                  hash_algo: str = DEFAULT_HASH_ALGO, media_io_kwargs: dict | None = None,
                  request_media_io_kwargs: dict | None = None,
                  mm_processor_kwargs: dict | None = None,
                  video_processor: str | None = None, header_only: bool = False) -> Identity:
    """Identity of a media file as ``vllm serve`` will compute it when sent that file: an
    image (``image_url``) or a video (``video_url``), told apart by content
    (:func:`encache.connectors.media.sniff`). Raises :class:`MediaError` for a file that
    cannot be read, is not media, or does not decode."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise MediaError("a directory, not a media file")
    try:  # (never blocking: a FIFO given as a file must not hang the run)
        fd = os.open(path, READ_FLAGS)
        with open(fd, "rb") as f:
            regular(os.fstat(fd), path)
            data = f.read()
    except NotAFile:
        raise MediaError("not a regular file") from None
    except OSError as e:
        raise MediaError(f"cannot read {path}: {e.strerror}") from None
    found = sniff(data, name=path)
    kwargs = dict(lora=lora, hash_algo=hash_algo, media_io_kwargs=media_io_kwargs,
                  request_media_io_kwargs=request_media_io_kwargs,
                  mm_processor_kwargs=mm_processor_kwargs, path=path)
    if found.kind == "video":
        from ..media import mime_type
        return identify_video_bytes(data, model, mime=mime_type(found),
                                    video_processor=video_processor, **kwargs)
    if found.kind is None:
        claimed = suffix_kind(path) or "image"
        raise MediaError(f"not a readable {claimed} ({found.reason})")
    return identify_bytes(data, model, header_only=header_only, **kwargs)
