"""Decode an image file's bytes exactly as the producer engine's data-URL path would.

What: :func:`image_decoder` returns, for a running ``vllm.LLM``, a function ``bytes ->
decoded image`` that precompute's reader thread calls, so the engine thread receives an
already decoded image (an ``image_pil`` chat part with the item's ``uuid``) instead of a
base64 data URL it would decode itself, serially with the encoder.

Why it is the same image: for an ``image_url`` data URL, ``LLM.chat`` (vLLM 0.32:
``renderers/chat_utils.py`` ``MultiModalContentParser.parse_image``) calls
``MediaConnector.fetch_image(url)`` on the connector named by ``VLLM_MEDIA_CONNECTOR``,
built with the model config's ``media_io_kwargs`` (``LLM.chat`` passes no request
``media_io_kwargs``). ``fetch_image`` builds ``ImageMediaIO(image_mode="RGB" |
media_io_kwargs["image"])`` and, for a ``data:`` URL, ``load_base64`` ->
``load_bytes(b64decode(data))``: Pillow open with vLLM's format allowlist,
``VLLM_MAX_IMAGE_PIXELS``, EXIF transpose, full load, mode conversion (RGBA background
colour, transparency) and a ``MediaWithBytes`` that keeps the original bytes and the
io_config. The decoder here builds the same ``ImageMediaIO`` with the same kwargs and
calls the same ``load_bytes`` on the file's bytes (base64 round trips to the same bytes),
so the tracker receives an equal ``MediaWithBytes`` either way (``parse_image_pil`` adds
the object as given). With no ``uuid`` (request ``mm_processor_kwargs`` mode) vLLM hashes
that object: ``MultiModalHasher`` hashes its original bytes and io_config, as for the
data URL.

When it cannot promise that -- a custom media connector (``VLLM_MEDIA_CONNECTOR`` naming
a class that is not vLLM's ``MediaConnector`` or overrides its image loading), or image
``media_io_kwargs`` that ``ImageMediaIO`` refuses -- there is no decoder (None) and every
image stays a data URL. Videos always stay data URLs.
"""

from __future__ import annotations

from collections.abc import Callable


def image_decoder(llm) -> Callable[[bytes], object] | None:
    """``bytes -> MediaWithBytes[PIL.Image]`` as ``llm``'s data-URL path decodes them,
    or None when another media connector could load images differently. The function
    raises what ``ImageMediaIO.load_bytes`` raises for a file that does not decode."""
    import vllm.envs as envs
    from vllm.multimodal.media.connector import MEDIA_CONNECTOR_REGISTRY, MediaConnector

    from .hashing import image_loader

    cls = MEDIA_CONNECTOR_REGISTRY.name2class.get(envs.VLLM_MEDIA_CONNECTOR)
    if cls is not MediaConnector:  # a subclass may override fetch_image/load_from_url
        return None
    mm_config = llm.model_config.multimodal_config
    media_io_kwargs = (mm_config.media_io_kwargs if mm_config else None) or {}
    try:
        image_io = image_loader(media_io_kwargs.get("image"))
    except Exception:  # noqa: BLE001 - settings the loader refuses: the engine's own path
        return None  # then reports them per item, as it always did

    def decode(data: bytes):
        return image_io.load_bytes(data)

    return decode

