"""The encoder configuration an entry was produced under, as a short digest.

What: :func:`encoder_config_digest` turns the settings that change a vision encoder's
*output* but not vLLM's identifier into a 16-hex-digit digest ("" for the default
configuration).  Producers stamp it into every entry's header (``encoder_config``);
consumers treat an entry stamped with another digest as a miss and re-encode.

Why: vLLM's identifier hashes the image, the model id string, ``--media-io-kwargs`` and
*per-request* processor kwargs -- but not the server's ``--mm-processor-kwargs`` (merged
into the processor call after hashing), nor the weights revision.  Inside one engine
that is harmless; in a store that outlives and is shared between engines it is not: a
consumer started with ``--mm-processor-kwargs '{"do_normalize": false}'`` computes the
same identifiers as the producer that ran with defaults, and would silently serve the
producer's embeddings (measured on the tiny LLaVA: same identifier, different outputs).
The digest covers what the engine knows about:

* ``mm_processor_kwargs`` -- the server-level processor kwargs (``--mm-processor-kwargs``,
  ``LLM(mm_processor_kwargs=...)``), compared as canonical JSON, without ``device``
  (placement only; see :data:`PLACEMENT_KWARGS`);
* ``revision`` -- the weights revision (``--revision``);
* ``tag`` -- an operator's label (connector setting ``tag``, ``encache precompute
  --tag``) for what the engine cannot see, e.g. weights replaced in place at the same
  path: bump the tag and the old entries stop matching.

Video settings need nothing more here: the server's ``--media-io-kwargs '{"video":
{...}}'`` (``num_frames``, ``fps``, the decoder ``backend``) are hash factors on the OpenAI
path, and on every path they change the sampling metadata vLLM hashes with each video
(sampled frame indices, decoder name; see :mod:`encache.connectors.vllm.hashing`), so a
different frame count or rate is a different identifier already; video keys of
``--mm-processor-kwargs`` (``videos_kwargs``, ``fps``, ``min_pixels``/``max_pixels``, …)
are covered by ``mm_processor_kwargs`` above.

Entries written before this existed, or by producers with the default configuration,
carry no digest and match the default configuration.  This module has no vLLM import:
the CLI computes the same digest from its own arguments.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

__all__ = ["encoder_config_factors", "encoder_config_digest", "holds", "DEFAULT_DIGEST",
           "PLACEMENT_KWARGS"]

#: the digest of the default configuration (and of unstamped entries)
DEFAULT_DIGEST = ""

#: processor kwargs that choose *where* preprocessing runs, not what it computes: left out.
#: vLLM itself adds ``device`` to an encode-only (``ec_producer``) instance's kwargs on an
#: accelerator (and ``--mm-processor-device`` sets it), so keeping it would split a GPU
#: producer from its consumers.
PLACEMENT_KWARGS = frozenset({"device"})


def encoder_config_factors(mm_processor_kwargs: Mapping | None = None,
                           revision: str | None = None, tag: str | None = None) -> dict:
    """The non-default settings that enter the digest (for messages and ``--json``)."""
    factors: dict = {}
    kwargs = {k: v for k, v in (mm_processor_kwargs or {}).items() if k not in PLACEMENT_KWARGS}
    if kwargs:
        factors["mm_processor_kwargs"] = kwargs
    if revision:
        factors["revision"] = str(revision)
    if tag:
        factors["tag"] = str(tag)
    return factors


def encoder_config_digest(mm_processor_kwargs: Mapping | None = None,
                          revision: str | None = None, tag: str | None = None) -> str:
    """16 hex digits of SHA-256 over the canonical JSON of the factors; "" when none."""
    factors = encoder_config_factors(mm_processor_kwargs, revision, tag)
    if not factors:
        return DEFAULT_DIGEST
    canon = json.dumps(factors, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()[:16]


def holds(store, identifier: str, digest: str | None, lora_digest: str = "",
          binding: str = "") -> bool:
    """Whether ``store`` has a usable entry for ``identifier``: stamped ``digest`` (None:
    any stamp), for ``lora_digest`` that adapter's digest, and for ``binding`` bound to
    those inputs (an entry bound to other inputs -- another client's pixels under the
    same identifier -- is not this item's). One header read where a stamp must be
    checked (``stat`` is None for an absent entry), else one ``contains``. An entry
    written by a newer encache counts as held: a producer of this build does not replace
    it."""
    if digest is None and not lora_digest and not binding:
        return store.contains(identifier)
    from .store.entry import NEWER_FORMAT

    info = store.stat(identifier)
    if info is not None and info.error == NEWER_FORMAT:
        return True  # a newer encache's entry: not this producer's to replace
    return (info is not None and info.meta is not None
            and (digest is None or info.meta.encoder_config == digest)
            and (not lora_digest or info.meta.lora_digest == lora_digest)
            and (not binding or info.meta.binding == binding))
