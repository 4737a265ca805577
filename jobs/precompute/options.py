"""Precompute's options, its ``Summary`` and the argument checks (no vLLM, no store).

What: :class:`ProducerSettings` (how a producer engine runs: shared with warm),
:class:`PrecomputeOptions` (everything that decides what a precompute writes and
how its engine runs), :class:`Summary` (what a run did: the ``--json`` fields), and the
helpers that derive what the server hashes with (:func:`hashing_settings`), the
encoder-config stamp (:func:`engine_encoder_config`) and the manifest's key
(:func:`manifest_key`). Why apart: the CLI, warm and Ray build and check options without
importing the job. Usage errors are :class:`~encache.jobs.errors.EncacheError`, exit 2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import EXIT_USAGE, EncacheError


@dataclass
class Summary:
    """What a precompute run did (``dataclasses.asdict`` + ``images_per_second`` is the
    ``--json`` output; the field names are part of the interface)."""

    store: str
    model: str
    lora: str | None
    files: int = 0
    hashed: int = 0  # read and hashed this run (new or changed files)
    from_manifest: int = 0  # identifier taken from the manifest, file not read
    present: int = 0  # already in the store: skipped
    other_config: int = 0  # in the store, but stamped with another encoder config: re-encoded
    stale_lora: int = 0  # in the store, but made with another adapter under this LoRA name: replaced
    encoder_config: str = ""  # this run's encoder-config digest ("" = default)
    encoded: int = 0
    failed: int = 0
    pruned: int = 0
    evicted: int = 0  # entries the store evicted for capacity during this run (any entry)
    evicted_own: int = 0  # of those, entries this run wrote (encoded, then evicted)
    skipped_capacity: int = 0  # missing, not encoded: no room without eviction (--over-capacity skip)
    # missing, not encoded: a policy removed it (capacity eviction, purge --older-than);
    # --refill-removed encodes these (connectors/store/removals.py)
    skipped_removed: int = 0
    refilled_removed: int = 0  # of the encoded, entries a policy had removed (--refill-removed)
    over_capacity: str = "keep-served"
    capacity: dict | None = None  # the corpus needs more than max_bytes: numbers + message
    skipped_non_media: int = 0  # files that are not images or videos (listed in non_media)
    bytes_written: int = 0
    engine_started: bool = False
    seconds: float = 0.0
    encode_seconds: float = 0.0
    failures: list = field(default_factory=list)  # [{path, error}]
    non_media: list = field(default_factory=list)  # [{path, reason}]: skipped, not failed
    notes: list = field(default_factory=list)  # one-line notes on what the run wrote (str)

    @property
    def images_per_second(self) -> float:
        return self.encoded / self.encode_seconds if self.encode_seconds > 0 else 0.0


@dataclass(frozen=True, kw_only=True)
class ProducerSettings:
    """How a producer engine runs and what it stamps: the settings every job that encodes
    shares (:class:`PrecomputeOptions`, ``WarmOptions`` of :mod:`encache.jobs.warm`),
    written once. ``engine_args`` are extra ``vllm.LLM`` arguments; the server settings
    among them (``media_io_kwargs``, ``mm_hasher_algorithm``, ``mm_processor_kwargs``,
    ``revision``) are hash or encoder-config factors, as on the server."""

    lora: str | None = None
    lora_path: str | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    engine_args: Mapping = field(default_factory=dict)
    tag: str | None = None

    @property
    def encoder_config(self) -> str:
        """The encoder-config digest the producer connector stamps."""
        return engine_encoder_config(self.engine_args, self.tag)


@dataclass(frozen=True)
class PrecomputeOptions(ProducerSettings):
    """Everything that decides what a precompute writes, and how the engine runs: the
    :class:`ProducerSettings` and these.

    ``model`` is the id exactly as given to ``vllm serve --model``; ``store`` the store URL
    or path (the real URL: the engine's connector opens it itself).
    ``request_mm_processor_kwargs``: the per-request kwargs the served requests carry
    (hashed into each identifier)."""

    model: str
    store: str
    batch: int = 16
    max_bytes: int | None = None
    hash_algo: str = "blake3"
    over_capacity: str = "keep-served"  # or "skip": encode only into free room
    request_mm_processor_kwargs: Mapping | None = None
    #: encode again what a policy removed (capacity eviction, ``purge --older-than``);
    #: False: a refresh leaves those out, so it does not undo the policy
    refill_removed: bool = False

    def check(self) -> None:
        """Usage checks (exit 2), before anything is opened or started."""
        from .capacity import OVER_CAPACITY

        check_common(self.batch, self.lora, self.lora_path)
        if self.over_capacity not in OVER_CAPACITY:
            raise EncacheError(f"--over-capacity must be one of {', '.join(OVER_CAPACITY)}",
                               EXIT_USAGE)
        for name in ("mm_processor_kwargs", "media_io_kwargs"):
            if not isinstance((self.engine_args or {}).get(name) or {}, dict):
                example = ('{"max_pixels": 1003520}' if name == "mm_processor_kwargs"
                           else '{"image": {"rgba_background_color": [0, 0, 0]}}')
                raise EncacheError(f"--engine-arg {name}= expects a JSON object, e.g. "
                                   f"{name}='{example}'", EXIT_USAGE)
        check_request_kwargs(self.request_mm_processor_kwargs, self.media_io_kwargs)

    @property
    def media_io_kwargs(self) -> dict | None:
        return hashing_settings(self.engine_args, self.hash_algo)[0]

    @property
    def effective_hash_algo(self) -> str:
        """The algorithm the server hashes with (``mm_hasher_algorithm`` wins)."""
        return hashing_settings(self.engine_args, self.hash_algo)[1]

    @property
    def request_kwargs(self) -> dict | None:
        return dict(self.request_mm_processor_kwargs) if self.request_mm_processor_kwargs else None

    def store_options(self) -> dict | None:
        """What the engine's connector is given besides the URL."""
        return {**({"max_bytes": self.max_bytes} if self.max_bytes else {}),
                **({"tag": self.tag} if self.tag else {})} or None

    def engine_options(self, store_url: str, modalities: Iterable[str]) -> dict:
        """Keyword arguments of :class:`~encache.connectors.vllm.producer.EngineOptions`
        (a plain dict: Ray ships it to the actors)."""
        return dict(model=self.model, store=store_url, max_model_len=self.max_model_len,
                    dtype=self.dtype, lora_name=self.lora, lora_path=self.lora_path,
                    extra=dict(self.engine_args or {}), store_options=self.store_options(),
                    modalities=tuple(sorted(set(modalities))),
                    request_mm_processor_kwargs=self.request_kwargs)


def parse_engine_args(pairs: list[str] | None) -> dict:
    """``--engine-arg KEY=VALUE`` pairs -> a dict (JSON values, else strings)."""
    out = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise EncacheError(f"--engine-arg expects KEY=VALUE, got {pair!r}", EXIT_USAGE)
        k, v = pair.split("=", 1)
        try:
            out[k.strip().replace("-", "_")] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip().replace("-", "_")] = v
    return out


def hashing_settings(engine_args: Mapping | None, hash_algo: str = "blake3") -> tuple[dict | None, str]:
    """``(media_io_kwargs, hash_algo)`` the server will hash with, from the engine arguments
    that also go to the producer (``--engine-arg media_io_kwargs=… mm_hasher_algorithm=…``).

    The server's media_io_kwargs change how an image is loaded and are a hash factor on the
    OpenAI path; the producer's own ``LLM.chat`` path stores the precomputed uuid as given.
    """
    engine_args = engine_args or {}
    return (engine_args.get("media_io_kwargs") or None,
            engine_args.get("mm_hasher_algorithm") or hash_algo)


def engine_encoder_config(engine_args: Mapping | None, tag: str | None) -> str:
    """The encoder-config digest the producer connector will stamp, from the same engine
    arguments (``mm_processor_kwargs``, ``revision``) and ``--tag``."""
    from ...connectors.encoder_config import encoder_config_digest

    engine_args = engine_args or {}
    return encoder_config_digest(engine_args.get("mm_processor_kwargs"),
                                 engine_args.get("revision"), tag)


def manifest_key(corpus: str, model: str, lora: str | None, hash_algo: str,
                 shard: str | None, media_io_kwargs: dict | None,
                 request_mm_processor_kwargs: dict | None = None) -> dict:
    """What a manifest's identifiers depend on (a different key: a different manifest)."""
    key = {"corpus": os.path.abspath(corpus), "model": model, "lora": lora or "",
           "hash_algo": hash_algo, "shard": shard or ""}
    if media_io_kwargs:  # absent by default, so existing manifests keep their location
        key["media_io_kwargs"] = media_io_kwargs
    if request_mm_processor_kwargs:
        key["request_mm_processor_kwargs"] = request_mm_processor_kwargs
    return key


def check_request_kwargs(request_mm_processor_kwargs, media_io_kwargs) -> dict | None:
    """Validate ``--request-mm-processor-kwargs`` (a JSON object, not combinable yet with
    server media_io_kwargs: LLM.chat does not hash those the way the server does)."""
    if not request_mm_processor_kwargs:
        return None
    if not isinstance(request_mm_processor_kwargs, Mapping):
        raise EncacheError("--request-mm-processor-kwargs expects a JSON object, e.g. "
                           "'{\"max_pixels\": 200704}'", EXIT_USAGE)
    if media_io_kwargs:
        raise EncacheError("--request-mm-processor-kwargs cannot be combined with "
                           "--engine-arg media_io_kwargs yet", EXIT_USAGE)
    return dict(request_mm_processor_kwargs)


def check_common(batch: int, lora: str | None, lora_path: str | None) -> None:
    if batch < 1:
        raise EncacheError("--batch must be at least 1", EXIT_USAGE)
    if lora_path and not lora:
        raise EncacheError("--lora-path needs --lora NAME", EXIT_USAGE)
    if lora and not lora_path:
        raise EncacheError("--lora NAME needs --lora-path DIR: the producer must run the adapter "
                           "the consumer serves (tower-connector LoRA changes the encoder output)",
                           EXIT_USAGE)


def validate_args(corpus: str, batch: int, lora: str | None, lora_path: str | None,
                  shard: str | None) -> tuple[int, int] | None:
    """Usage checks of a corpus run, before any work starts; returns the parsed shard."""
    from ...connectors.store.ops.transfer import parse_shard

    if not os.path.exists(corpus):
        raise EncacheError(f"corpus not found: {corpus}", EXIT_USAGE)
    check_common(batch, lora, lora_path)
    if not shard:
        return None
    try:
        return parse_shard(shard)
    except ValueError as e:
        raise EncacheError(str(e), EXIT_USAGE) from None
