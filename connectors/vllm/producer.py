"""Drive a real vLLM engine in ``ec_producer`` role to fill a store (``encache precompute``).

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: starts in seconds, and
lets us wait for the connector's background writes). Each image is sent exactly as a
served request would carry it — a base64 data URL in a chat message, through the model's
own chat template — with its precomputed identifier as the item's ``uuid``, so the entry
lands under the key a ``vllm serve`` consumer computes for the same file. Videos go the
same way as ``video_url`` parts (a base64 ``data:video/…`` URL). Generation is one token:
only the encoder pass matters.

An image may instead arrive already decoded (:meth:`ProducerEngine.decode_image`, called
by precompute's reader thread: :mod:`.decode` says why it is the same image); it is then
sent as an ``image_pil`` part with the same ``uuid``, so the engine thread neither
base64-decodes nor decodes it.
"""

from __future__ import annotations

import base64
import logging
import mimetypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..store.redis.cluster import REDIRECT_WAIT_S
from . import transfer_config

log = logging.getLogger("encache.producer")


@dataclass
class EngineOptions:
    model: str
    store: str
    max_model_len: int | None = None
    dtype: str | None = None
    max_num_seqs: int | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    extra: dict | None = None  # any other vllm.LLM keyword arguments
    store_options: dict | None = None  # more ec_connector_extra_config keys (max_bytes, tag)
    modalities: tuple[str, ...] = ("image",)  # media kinds the items will carry
    # a request's own mm_processor_kwargs (what the served requests carry): applied to each
    # item, and a factor of the identifier -- see ProducerEngine.encode
    request_mm_processor_kwargs: dict | None = None


@dataclass
class ItemResult:
    identifier: str
    ok: bool
    error: str | None = None


def data_url(data: bytes, path: str | None = None, *, mime: str | None = None) -> str:
    mime = mime or (mimetypes.guess_type(path)[0] if path else None) or "image/png"
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


class ProducerEngine:
    def __init__(self, opts: EngineOptions):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.opts = opts
        self._supported: frozenset | None = None  # model_takes()
        # a batch job: writes overlap the next batch's encoding, wait_for_saves() drains them,
        # and on a Redis Cluster they wait out a failover (a serving engine does not)
        # every identifier is computed here from the item's bytes (or hashed by the engine
        # from them): entries say so and consumers need not digest their inputs
        extra_config = {"save_wait_s": 0, "redirect_wait": REDIRECT_WAIT_S, "content_keyed": True,
                        **(opts.store_options or {})}
        kwargs = dict(
            model=opts.model,
            # one item per prompt; video only when asked for (a model without video
            # support then rejects video items one by one, never the image items)
            limit_mm_per_prompt={kind: 1 for kind in ("image", *opts.modalities)},
            ec_transfer_config=transfer_config(opts.store, "ec_producer", extra_config),
        )
        for key in ("max_model_len", "dtype", "max_num_seqs"):
            if getattr(opts, key) is not None:
                kwargs[key] = getattr(opts, key)
        self.lora_request = None
        if opts.lora_path:
            from vllm.lora.request import LoRARequest
            kwargs.update(enable_lora=True, enable_tower_connector_lora=True)
            self.lora_request = LoRARequest(opts.lora_name, 1, opts.lora_path)
            _skip_encoder_width_probe()
        kwargs.update(opts.extra or {})
        self.llm = LLM(**kwargs)
        from vllm import SamplingParams
        self.sampling = SamplingParams(max_tokens=1, temperature=0.0)
        from .decode import image_decoder
        #: ``bytes -> decoded image`` exactly as this engine's data-URL path decodes them
        #: (None: a custom media connector; images then stay data URLs)
        self.decode_image = image_decoder(self.llm)

    @staticmethod
    def _conversation(payload, identifier: str | None, kind: str = "image") -> list[dict]:
        """The chat message a served request carries for one image or video item (without
        a uuid when the engine must hash the item itself): a data URL as ``image_url`` /
        ``video_url``, an image decoded by :attr:`decode_image` as ``image_pil``."""
        if isinstance(payload, str):
            part = "video_url" if kind == "video" else "image_url"
            item = {"type": part, part: {"url": payload}}
        else:
            item = {"type": "image_pil", "image_pil": payload}
        if identifier is not None:
            item["uuid"] = identifier
        return [{"role": "user", "content": [item, {"type": "text", "text": f"Describe the {kind}."}]}]

    def encode(self, items: Sequence[tuple[str, ...]]) -> list[ItemResult]:
        """Encode ``(identifier, payload[, kind])`` items (kind "image" by default or
        "video"; payload a data URL, or for an image what :attr:`decode_image` returned);
        one bad item does not sink the batch."""
        # vLLM prefixes the item's uuid with "{lora_name}:" itself under tower-connector
        # LoRA, so the engine is given the bare hash.
        prefix = f"{self.opts.lora_name}:" if self.lora_request is not None else ""
        # With request mm_processor_kwargs vLLM re-hashes a given uuid together with them, so
        # the engine hashes the item itself instead: a data URL keeps the file's bytes, and
        # LLM.chat hashes them with the kwargs exactly as the server does (precompute then
        # checks the entry landed under the expected identifier). A decoded image works
        # there too: vLLM hashes its MediaWithBytes (original bytes + io_config) as it
        # would the data URL's.
        request_kwargs = self.opts.request_mm_processor_kwargs or None
        convs = [self._conversation(item[1], None if request_kwargs else
                                    item[0][len(prefix):] if prefix and item[0].startswith(prefix)
                                    else item[0],
                                    item[2] if len(item) > 2 else "image")
                 for item in items]
        try:
            self.llm.chat(convs, self.sampling, use_tqdm=False, lora_request=self.lora_request,
                          mm_processor_kwargs=request_kwargs)
            return [ItemResult(item[0], True) for item in items]
        except Exception as batch_error:  # retry one by one to isolate the bad item(s)
            if len(items) == 1:
                kind = items[0][2] if len(items[0]) > 2 else "image"
                return [ItemResult(items[0][0], False, self._explain(batch_error, kind))]
        results = []
        for item in items:
            results.extend(self.encode([item]))
        return results

    def model_takes(self, kind: str) -> bool:
        """Whether the model accepts ``kind`` items at all (its processor's supported
        modalities), whatever this engine's ``limit_mm_per_prompt``; True when vLLM
        cannot tell (another engine could then take them)."""
        if self._supported is None:
            try:
                from vllm.multimodal import MULTIMODAL_REGISTRY
                info = MULTIMODAL_REGISTRY.get_processing_info(self.llm.model_config)
                self._supported = frozenset(info.supported_mm_limits)
            except Exception:  # noqa: BLE001 - unknown: assume it does
                self._supported = frozenset(("image", "video", kind))
        return kind in self._supported

    def lora_reaches_encoder(self) -> bool:
        """Whether the model applies LoRA to its vision tower and connector (vLLM's
        ``supports_tower_connector_lora``: most families in vLLM 0.32, Gemma 3 and
        Qwen2.5-VL included; not Mistral 3 or LLaVA-OneVision). Where it does not, an adapter cannot change the encoder
        outputs, and a server started with ``--enable-lora`` alone looks up a LoRA
        request's images under their bare hashes: the base entries. True when vLLM cannot
        tell (nothing is then said)."""
        try:
            from vllm.model_executor.models import ModelRegistry
            config = self.llm.model_config
            cls, _ = ModelRegistry.resolve_model_cls(config.architectures, config)
        except Exception:  # noqa: BLE001 - unknown: assume it does
            return True
        return bool(getattr(cls, "supports_tower_connector_lora", False))

    def _explain(self, error: BaseException, kind: str) -> str:
        """One line; names the model family when it takes no items of this kind."""
        line = _one_line(error)
        if f"At most 0 {kind}(s)" in line:
            arch = getattr(getattr(self.llm, "model_config", None), "architecture", None)
            return f"{arch or self.opts.model} takes no {kind} input ({line})"[:300]
        return line

    def wait_for_saves(self, timeout: float | None = 300.0) -> bool:
        from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
        if not has_ec_transfer():
            return True
        return get_ec_transfer().wait_for_saves(timeout)

    def save_errors(self) -> dict[str, str]:
        from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
        if not has_ec_transfer():
            return {}
        writer = get_ec_transfer().writer
        return dict(writer.errors) if writer is not None else {}

    def saved_identifiers(self) -> set[str]:
        from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
        if not has_ec_transfer():
            return set()
        writer = get_ec_transfer().writer
        return set(writer.saved) if writer is not None else set()

    def close(self) -> None:
        self.wait_for_saves()
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # best effort; the process is about to exit anyway
                pass
        from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown
        ensure_ec_transfer_shutdown()


def _skip_encoder_width_probe() -> None:
    """Work around a vLLM 0.32 bug: with tower-connector LoRA enabled, an ``ec_producer``
    engine crashes at start-up in ``measure_encoder_output_widths`` (its dummy encode runs
    the LoRA-wrapped tower with no adapter mapping set). The widths only size transfers
    for push-style connectors; encache never reads them, so the in-process producer skips
    the probe. Only precompute's own engine is affected (it runs in this process)."""
    from vllm.v1.engine import core

    core.measure_encoder_output_widths = lambda vllm_config, collective_rpc: None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
