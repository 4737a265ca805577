"""Identifiers: validation, filesystem-safe names, and LoRA prefixes.

vLLM identifies an encoder output by its multimodal hash (64 hex digits for blake3), by a
user-supplied ``multi_modal_uuids`` string, or — with tower-connector LoRA — by
``{lora_name}:{hash}``. Identifiers made of safe characters are used verbatim as
directory names / key suffixes, so a store stays readable by vLLM's
``ECExampleConnector`` (``{path}/{identifier}/encoder_cache.safetensors``). Anything that
could escape the store root (``/``, ``..``, NUL, a leading dot) or is too long for a file
name is encoded instead: ``~`` + base32 of the UTF-8 bytes, or ``~h`` + sha256 when even
that is too long (the full identifier then lives only in the entry's metadata).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import re

MAX_IDENTIFIER_BYTES = 4096
MAX_NAME_LEN = 200  # well below NAME_MAX (255) on every common filesystem
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+=@-]*")


class InvalidIdentifier(ValueError):
    """An identifier that cannot name a cache entry (empty, NUL, not text, too long)."""


def validate(identifier: object) -> str:
    if not isinstance(identifier, str) or not identifier:
        raise InvalidIdentifier(f"identifier must be a non-empty string, got {identifier!r}")
    if "\x00" in identifier:
        raise InvalidIdentifier("identifier contains a NUL byte")
    if len(identifier.encode("utf-8", "surrogatepass")) > MAX_IDENTIFIER_BYTES:
        raise InvalidIdentifier(f"identifier longer than {MAX_IDENTIFIER_BYTES} bytes")
    return identifier


def is_verbatim(identifier: str) -> bool:
    """True when the identifier is its own file name (ECExampleConnector-compatible)."""
    return len(identifier) <= MAX_NAME_LEN and _SAFE.fullmatch(identifier) is not None


def to_name(identifier: str) -> str:
    """The directory name / key suffix for an identifier (injective, never escapes)."""
    validate(identifier)
    if is_verbatim(identifier):
        return identifier
    raw = identifier.encode("utf-8", "surrogatepass")
    encoded = "~" + base64.b32encode(raw).decode("ascii").rstrip("=").lower()
    if len(encoded) <= MAX_NAME_LEN:
        return encoded
    return "~h" + hashlib.sha256(raw).hexdigest()


@functools.lru_cache(maxsize=1 << 16)
def _cached_name(identifier: str) -> str:
    return to_name(identifier)


def name_for(identifier: str) -> str:
    """:func:`to_name`, memoised for the serving path (the same identifiers recur)."""
    if type(identifier) is str:
        return _cached_name(identifier)
    return to_name(identifier)  # raises InvalidIdentifier


def from_name(name: str) -> str | None:
    """Inverse of :func:`to_name`; None for hashed names (read the entry's metadata)."""
    if not name.startswith("~"):
        return name
    if name.startswith("~h") and len(name) == 66 and all(c in "0123456789abcdef" for c in name[2:]):
        return None
    body = name[1:].upper()
    body += "=" * (-len(body) % 8)
    try:
        return base64.b32decode(body).decode("utf-8", "surrogatepass")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def is_entry_name(name: str) -> bool:
    """Names the store manages as entries; dot-names are bookkeeping and temp files."""
    return bool(name) and not name.startswith(".")


def split_lora(identifier: str) -> tuple[str | None, str]:
    """``"adapter:abc…"`` -> ``("adapter", "abc…")``; a plain hash -> ``(None, hash)``.

    vLLM prefixes the hash with ``{lora_name}:`` only for tower-connector LoRA; hashes
    are hex, so the last ``:`` separates the two.
    """
    if ":" not in identifier:
        return None, identifier
    lora, _, rest = identifier.rpartition(":")
    return (lora or None), rest


def with_lora(lora: str | None, identifier: str) -> str:
    return f"{lora}:{identifier}" if lora else identifier
