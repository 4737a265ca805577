"""The identifier vLLM computes for an image file sent to ``vllm serve``.

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
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

DEFAULT_HASH_ALGO = "blake3"  # vLLM's default --mm-hasher-algorithm


@dataclass(frozen=True)
class Identity:
    """An image's identifier and every input that went into it."""

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

    def to_dict(self) -> dict:
        return asdict(self)


def identify_bytes(data: bytes, model: str, *, lora: str | None = None,
                   hash_algo: str = DEFAULT_HASH_ALGO, media_io_kwargs: dict | None = None,
                   request_media_io_kwargs: dict | None = None,
                   mm_processor_kwargs: dict | None = None, path: str | None = None) -> Identity:
    """Identity of an image given as its file bytes. Raises ValueError if not an image.

    ``media_io_kwargs`` are the server's (``--media-io-kwargs``): they change how the
    image is loaded (and so its io config) but are not hash factors.
    ``request_media_io_kwargs`` and ``mm_processor_kwargs`` are a request's own (API
    fields): the former replace the server's for loading, and both are hash factors.
    """
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.image import ImageMediaIO

    # Loading: the request's media_io_kwargs, else the server's (renderers/chat_utils.py)
    load = dict((request_media_io_kwargs or media_io_kwargs or {}).get("image", {}))
    media = ImageMediaIO(**({"image_mode": "RGB"} | load)).load_bytes(data)
    # Hash factors exactly as vLLM adds them (multimodal/processing/inputs.py): only the
    # request's kwargs, only when non-empty, media_io_kwargs scoped to the modality.
    factors: dict = {}
    request_image = dict((request_media_io_kwargs or {}).get("image", {}))
    if request_image:
        factors["media_io_kwargs"] = {"image": request_image}
    if mm_processor_kwargs:
        factors["mm_processor_kwargs"] = dict(mm_processor_kwargs)
    base = MultiModalHasher.hash_kwargs(hash_algo, model_id=model, image=media, **factors)
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as original:  # header only: size and source mode
        width, height, mode = original.width, original.height, original.mode
    return Identity(
        identifier=f"{lora}:{base}" if lora else base, base_hash=base, lora=lora or None,
        model=model, hash_algo=hash_algo, io_config=media.io_config, path=path,
        size=len(data), width=width, height=height, mode=mode,
        hash_factors=factors,
    )


def identify_file(path: str | os.PathLike, model: str, *, lora: str | None = None,
                  hash_algo: str = DEFAULT_HASH_ALGO, media_io_kwargs: dict | None = None,
                  request_media_io_kwargs: dict | None = None,
                  mm_processor_kwargs: dict | None = None) -> Identity:
    """Identity of an image file as ``vllm serve`` will compute it when sent that file."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    return identify_bytes(data, model, lora=lora, hash_algo=hash_algo,
                          media_io_kwargs=media_io_kwargs,
                          request_media_io_kwargs=request_media_io_kwargs,
                          mm_processor_kwargs=mm_processor_kwargs, path=path)
