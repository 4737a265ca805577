"""The store core: entry codec, identifiers, and backends. Pure Python, no vLLM."""

from .base import COUNTER_NAMES, EntryInfo, LockBusy, Store, StoreError, StoreInfo
from .entry import CorruptEntry, EntryMeta, decode, encode, encode_parts
from .url import open_store, redact

__all__ = [
    "COUNTER_NAMES", "CorruptEntry", "EntryInfo", "EntryMeta", "LockBusy", "Store",
    "StoreError", "StoreInfo", "decode", "encode", "encode_parts", "open_store", "redact",
]
