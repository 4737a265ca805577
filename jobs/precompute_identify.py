"""Precompute's identify phase: each file's served identifier and what the store holds.

What: :func:`classify` gives one file's row -- its identifier (from the manifest record,
else vLLM's hasher over the bytes as ``vllm serve`` reads them: :func:`identify_or_mark`),
whether it was hashed, and its state (:func:`stored_state`: present, other encoder
config, stale LoRA adapter, missing; or a marker: not media, unreadable). :func:`account`
counts rows, in corpus order, into the ``Summary`` and returns the ``todo``. Why apart:
the same row is computed in this process (single-host) and in Ray tasks
(:mod:`encache.jobs.ray_precompute`), and counted the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

from .precompute_options import PrecomputeOptions, Summary

# manifest markers, not identifiers (identifiers never contain "!"): an unchanged file
# carrying one is reported again without being read again
UNREADABLE = "!unreadable:"  # media (by suffix or content) that does not decode: a failure
NON_MEDIA = "!skip:"  # not an image or video: skipped and counted


def identify_or_mark(f, model: str, *, lora: str | None, hash_algo: str,
                     media_io_kwargs: dict | None, mm_processor_kwargs: dict | None = None) -> str:
    """``f``'s served identifier, or a marker: :data:`NON_MEDIA` + reason for a file that
    is not media (no media suffix, and its header is no image or video), or
    :data:`UNREADABLE` + error for media that cannot be read or decoded -- whatever the
    error (a decompression bomb, truncated data, …): one file never stops a run. Common
    single-frame image formats are identified from their header (``header_only``): the
    engine decodes them anyway, and a file corrupt past its header fails there."""
    from ..connectors.corpus import non_media_reason
    from ..connectors.media import unreadable_reason

    reason = non_media_reason(f)
    if reason is not None:
        return NON_MEDIA + reason
    from ..connectors.vllm.hashing import identify_file
    try:
        return identify_file(f.path, model, lora=lora, hash_algo=hash_algo,
                             media_io_kwargs=media_io_kwargs,
                             mm_processor_kwargs=mm_processor_kwargs,
                             header_only=True).identifier
    except ImportError:
        raise
    except Exception as e:  # MediaError, OSError, and anything a decoder raises
        return UNREADABLE + unreadable_reason(e)


def stored_state(store, ident: str, encoder_config: str, lora_digest: str) -> str:
    """``present`` (usable as is), ``other_config`` (another encoder config),
    ``stale_lora`` (made with another adapter under this LoRA name, or unstamped) or
    ``missing``: one header read (``holds()`` semantics)."""
    info = store.stat(ident)
    if info is None:
        return "missing"
    if info.meta is None or info.meta.encoder_config != encoder_config:
        return "other_config"
    if lora_digest and info.meta.lora_digest != lora_digest:
        return "stale_lora"
    return "present"


def classify(f, record, *, store, options: PrecomputeOptions, encoder_config: str,
             lora_digest: str, present: set | None = None) -> tuple[str, bool, str]:
    """One file's row: ``(identifier or marker, hashed, state)``. ``record`` is the file's
    manifest record (None: read and hash it); ``present``, when given, is the store's
    identifier listing (no header read for what it lacks). States: those of
    :func:`stored_state`, ``unreadable`` and ``non_media``."""
    unchanged = record and record[0] == f.size and record[1] == f.mtime_ns  # Manifest.lookup
    ident = record[2] if unchanged else None
    hashed = ident is None
    if hashed:
        ident = identify_or_mark(f, options.model, lora=options.lora,
                                 hash_algo=options.effective_hash_algo,
                                 media_io_kwargs=options.media_io_kwargs,
                                 mm_processor_kwargs=options.request_kwargs)
    if ident.startswith(NON_MEDIA):
        return ident, hashed, "non_media"
    if ident.startswith(UNREADABLE):
        return ident, hashed, "unreadable"
    if present is not None and ident not in present:
        return ident, hashed, "missing"
    return ident, hashed, stored_state(store, ident, encoder_config, lora_digest)


def account(rows: Iterable[tuple], summary: Summary, manifest=None) -> dict:
    """Count identify rows ``(CorpusFile, identifier, hashed, state)`` (in corpus order)
    into ``summary`` and record hashed ones in ``manifest``; returns ``identifier ->
    CorpusFile`` of what must be encoded (the first file of an identifier wins)."""
    todo: dict[str, object] = {}
    for f, ident, hashed, state in rows:
        if hashed and manifest is not None:
            manifest.record(f, ident)
        if state == "non_media":  # remembered: an unchanged file is not sniffed again
            summary.skipped_non_media += 1
            summary.non_media.append({"path": f.rel, "reason": ident[len(NON_MEDIA):]})
            continue
        if hashed:
            summary.hashed += 1
        else:
            summary.from_manifest += 1
        if state == "unreadable":  # remembered: an unchanged bad file is not re-read
            summary.failed += 1
            summary.failures.append({"path": f.rel, "error": ident[len(UNREADABLE):]})
        elif state == "present":
            summary.present += 1
        else:
            if ident not in todo:
                if state == "other_config":
                    summary.other_config += 1
                elif state == "stale_lora":
                    summary.stale_lora += 1
            todo.setdefault(ident, f)
    return todo
