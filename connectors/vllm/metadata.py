"""What the scheduler ships to the worker each step: the connector metadata.

:class:`EncacheConnectorMetadata` carries the step's :class:`~.loads.LoadItem` list (the
entries to load, :mod:`.loads`), the LoRA adapter digests producers stamp, and the items
a producer re-saves from vLLM's own encoder cache. The one module of the load path that
imports vLLM (its metadata base class).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata

from .loads import LoadItem


@dataclass
class EncacheConnectorMetadata(ECConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)
    #: LoRA name -> adapter digest of the requests scheduled so far (producers stamp it)
    lora_digests: dict[str, str] = field(default_factory=dict)
    #: producers: items this step neither encodes nor finds in the store -- vLLM's own
    #: encoder cache answered them; the worker saves them from that cache
    resave: list[str] = field(default_factory=list)
    #: producers: identifier -> binding (digest of the processed inputs,
    #: :mod:`.binding`) of the items this step encodes or resaves: stamped into entries
    bindings: dict[str, str] = field(default_factory=dict)
