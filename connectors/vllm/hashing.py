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
    """Identity of an image given as its file bytes, as ``vllm serve``'s OpenAI API
    computes it. Raises ValueError if not an image.

    ``media_io_kwargs`` are the server's (``--media-io-kwargs``), ``request_media_io_kwargs``
    a request's own field (merged over the server's, per modality). Measured on vLLM 0.32:
    the OpenAI server loads the image with the merged kwargs *and* hashes them as a factor
    (``LLM.chat`` with ``LLM(media_io_kwargs=...)`` loads with them but does not hash them;
    a precomputed uuid is stored as given either way). ``mm_processor_kwargs`` are a
    request's own processor kwargs (a factor); the server's ``--mm-processor-kwargs`` never
    enter the identifier (see :mod:`encache.connectors.encoder_config`).
    """
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.image import ImageMediaIO

    image_kwargs = {**(media_io_kwargs or {}).get("image", {}),
                    **(request_media_io_kwargs or {}).get("image", {})}
    media = ImageMediaIO(**({"image_mode": "RGB"} | image_kwargs)).load_bytes(data)
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
