"""Is a valid entry usable by *this* engine? Encoder-config and LoRA-adapter stamps.

vLLM's identifier leaves out what else the encoder output depends on: the server's
``mm_processor_kwargs``, the model revision, a tag (the encoder-config digest,
:mod:`encache.connectors.encoder_config`), and for a LoRA entry the adapter's files (a
retrained adapter under the same name). Entries carry these as stamps; an entry stamped
otherwise is a miss — counted (``config_mismatches``, ``lora_stale``), remembered as the
miss reason, and warned about once per interval with both sides named.
"""

from __future__ import annotations

from ..ratelimit import RateLimitedLog
from ..store.entry import EntryMeta
from .metrics import LookupMetrics
from .misses import MissReasons


class EntryChecks:
    def __init__(self, store_url: str, encoder_config: str | None, misses: MissReasons,
                 metrics: LookupMetrics, warn: RateLimitedLog):
        self.store_url = store_url
        # the engine's encoder-config digest: entries stamped otherwise are misses
        # (None: accept any)
        self.encoder_config = encoder_config
        #: LoRA name -> digest of the adapter this engine serves under it (kept by the
        #: connector from its requests); a stamped entry with another digest is a miss
        self.lora_digests: dict[str, str] = {}
        self.misses, self.metrics, self.warn = misses, metrics, warn

    def usable(self, identifier: str, meta: EntryMeta) -> bool:
        """True, or False after counting and reporting why not."""
        if self.encoder_config is not None and meta.encoder_config != self.encoder_config:
            self._config_mismatch(identifier, meta.encoder_config)
            return False
        if self.lora_digests and self._lora_stale(identifier, meta):
            return False
        return True

    def _config_mismatch(self, identifier: str, stamped: str) -> None:
        """An entry produced under another encoder config: a miss (the engine re-encodes;
        a producer on this config overwrites it), retried after a minute."""
        self.misses.reject(identifier, "config")
        self.metrics.count("config_mismatches")
        self.warn.warning("encoder-config",
                          "encache: entry %s in %s was produced under encoder config %r, this "
                          "engine's is %r (server mm_processor_kwargs / revision / tag "
                          "differ); re-encoding", identifier, self.store_url,
                          stamped or "default", self.encoder_config or "default")

    def _lora_stale(self, identifier: str, meta: EntryMeta) -> bool:
        """A LoRA entry stamped with another adapter digest than the one this engine
        serves under that name (a retrained adapter): a miss, counted ``lora_stale``."""
        if not meta.lora_digest:
            return False  # unstamped (older entries, hub adapters): nothing to compare
        name = meta.lora or identifier.rpartition(":")[0]
        want = self.lora_digests.get(name)
        if not want or want == meta.lora_digest:
            return False
        self.misses.reject(identifier, "lora_stale")
        self.metrics.count("lora_stale")
        self.warn.warning("lora-stale:" + name,
                          "encache: entries for LoRA %r in %s were produced with adapter "
                          "digest %s, this engine serves %s under that name (retrained?); "
                          "re-encoding. Refresh them with `encache precompute --lora %s "
                          "--lora-path DIR` or remove them with `encache purge --lora %s "
                          "--stale`", name, self.store_url, meta.lora_digest, want, name, name)
        return True
