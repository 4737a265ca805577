"""Units and formatting, for every layer: sizes (``50G``), ages (``7d``), bytes for
people (``2.8 MiB``) and batches of a stream. A leaf: imports nothing of encache."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

_AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", re.IGNORECASE)
AGE_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"50G"`` -> 53687091200. Units K, M, G, T (powers of 1024; ``KiB``, ``GB``
    spelled out too); a bare number is bytes. Raises ValueError fit for a usage error, also
    for a size under one byte (``"0.5"``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text or "", re.IGNORECASE)
    if not m:
        raise ValueError(f"invalid size {text!r} (use e.g. 500M, 50G, 2T)")
    n = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if n <= 0:  # "0.5" is 0 bytes: no capacity at all, never what was meant
        raise ValueError(f"invalid size {text!r}: less than one byte")
    return n


def parse_age(text: str) -> float:
    """``"7d"`` -> 604800.0. Units: s, m, h, d, w (a bare number is seconds).

    Raises ValueError with a message fit for a usage error.
    """
    m = _AGE.fullmatch(text or "")
    if not m:
        raise ValueError(f"invalid age {text!r} (use e.g. 90s, 30m, 12h, 7d, 2w)")
    return float(m.group(1)) * AGE_UNITS[m.group(2).lower()]


_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float | None) -> str:
    """Bytes for people (``2883584`` -> ``"2.8 MiB"``); the one byte formatter of the
    CLI's tables and of messages. None -> ``"-"``."""
    if n is None:
        return "-"
    import math
    n = float(n)
    if abs(n) < 1024:
        return f"{int(n)} B"
    exp = min(int(math.log(abs(n), 1024)), len(_BYTE_UNITS) - 1)
    value = n / 1024 ** exp
    return f"{value:.1f} {_BYTE_UNITS[exp]}" if value < 100 else f"{value:.0f} {_BYTE_UNITS[exp]}"


def format_age(seconds: float) -> str:
    """The inverse of :func:`parse_age`, for messages (``604800`` -> ``"7d"``)."""
    for unit in ("w", "d", "h", "m"):
        n = AGE_UNITS[unit]
        if seconds >= n and seconds % n == 0:
            return f"{int(seconds // n)}{unit}"
    return f"{seconds:g}s"


def batched(items: Iterable, size: int) -> Iterator[list]:
    """Lists of up to ``size`` items, each handed out as soon as it is full (or the items
    end): a store walk or a stream of work in chunks, without reading it all first."""
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
