"""The LoRA adapter an entry was produced with, as a digest of its files (stale-LoRA guard).

What: :func:`adapter_digest` hashes an adapter directory's weight and config files
(blake3, 16 hex digits), cached per path and (name, size, mtime) of those files, so a
scheduler asks it per request at memory speed. Producers stamp the digest into every
entry of a LoRA (``lora_digest`` in the header, beside ``lora``); a consumer serving an
adapter with another digest under the same name treats the entry as a miss
(``lora_stale``), precompute replaces it, ``encache stats`` counts entries whose digest
is not the newest for their LoRA name and ``purge --lora NAME --stale`` removes them.

Why: with tower-connector LoRA the identifier is ``{lora_name}:{image hash}``: it names
the adapter, not its weights. An adapter retrained and served under the same name would
get the old adapter's embeddings from a persistent store (vLLM had the same bug in its
in-memory encoder cache, vllm#44939). Entries written before the stamp existed carry
none and are served as before (nothing to compare).

An adapter that is not a local directory (a hub id resolved by vLLM elsewhere) has no
digest here (""): such entries are neither stamped nor checked.
"""

from __future__ import annotations

import os
import threading

from blake3 import blake3

__all__ = ["adapter_digest", "ADAPTER_FILES", "lora_name_of", "newest_digests", "newest_of",
           "is_stale"]

#: files whose bytes define the adapter (weights and the config that shapes them)
ADAPTER_FILES = ("adapter_config.json",)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

_cache: dict[tuple, str] = {}
_lock = threading.Lock()


def _files(path: str) -> list[tuple[str, int, int]]:
    out = []
    for name in sorted(os.listdir(path)):
        if name in ADAPTER_FILES or name.endswith(WEIGHT_SUFFIXES):
            full = os.path.join(path, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            if os.path.isfile(full):
                out.append((name, st.st_size, st.st_mtime_ns))
    return out


def adapter_digest(path: str | os.PathLike | None) -> str:
    """16 hex digits over the adapter's files ("" if ``path`` is not a readable local
    directory). Recomputed only when a file's size or mtime changes."""
    if not path:
        return ""
    path = os.path.realpath(os.path.expanduser(os.fspath(path)))
    try:
        files = _files(path)
    except OSError:
        return ""
    if not files:
        return ""
    key = (path, tuple(files))
    with _lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    h = blake3()
    try:
        for name, _, _ in files:
            h.update(name.encode() + b"\0")
            with open(os.path.join(path, name), "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
    except OSError:
        return ""
    digest = h.hexdigest()[:16]
    with _lock:
        if len(_cache) > 1024:
            _cache.clear()
        _cache[key] = digest
    return digest


def lora_name_of(identifier: str) -> str | None:
    from .keys import split_lora
    return split_lora(identifier)[0]


def newest_digests(infos) -> dict[str, str]:
    """LoRA name -> the digest of its most recently created stamped entry."""
    best: dict[str, tuple[float, str]] = {}
    for info in infos:
        meta = info.meta
        digest = getattr(meta, "lora_digest", "") if meta is not None else ""
        name = info.lora
        if not name or not digest:
            continue
        created = info.created or 0.0
        if name not in best or created > best[name][0]:
            best[name] = (created, digest)
    return {k: v[1] for k, v in best.items()}


def newest_of(groups: dict[tuple[str, str], list]) -> dict[str, str]:
    """From ``(name, digest) -> [entries, bytes, newest creation]``: name -> the digest
    of its most recently created entries (ties: the larger group)."""
    best: dict[str, tuple] = {}
    for (name, digest), (n, _, newest) in groups.items():
        key = (newest, n, digest)
        if name not in best or key > best[name]:
            best[name] = key
    return {name: k[2] for name, k in best.items()}


def is_stale(info, current: dict[str, str]) -> bool:
    """A stamped entry of a LoRA whose digest is not that LoRA's current one."""
    meta = info.meta
    digest = getattr(meta, "lora_digest", "") if meta is not None else ""
    name = info.lora
    return bool(name and digest and name in current and digest != current[name])
