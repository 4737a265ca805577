"""The warm job's parts as library code: choose entries (all, one LoRA, media files,
identifiers), then promote them between stores or read them into the OS page cache.

``encache warm`` (``encache.cli.warm``) parses options, validates them, opens the stores
and renders a :class:`WarmSummary`; everything that touches entries is here, over
:mod:`.store.transfer`'s :func:`~.store.transfer.copy_entries` and
:func:`~.store.transfer.warm_page_cache`::

    from encache.connectors.store import open_store
    from encache.connectors.warm import WarmSummary, promote

    with open_store("/data/encache", create=False) as src, \\
            open_store("redis://cache:6379/0") as dst:
        summary = WarmSummary(mode="copy", store=dst.url, source=src.url)
        promote(src, dst, None, summary)          # every entry dst lacks
    print(summary.copied, summary.skipped, summary.failures)

Media files are hashed exactly as ``vllm serve`` hashes them
(:func:`encache.connectors.vllm.hashing.identify_file`); vLLM is imported only then.
The whole job, with ``--compute-missing`` (encoding with a producer engine through
:func:`encache.jobs.precompute.precompute_files`), is :func:`encache.jobs.warm.warm`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from .media import unreadable_reason  # noqa: F401 (part of this API)
from .store.base import Store
from .store.keys import split_lora

#: ``progress(done)``: items handled so far
Progress = Callable[[int], None]


@dataclass
class WarmSummary:
    """What a warm run did (raw ints and seconds; ``to_dict`` for ``--json``)."""

    mode: str  # "copy" (promote --from a disk store) or "page-cache"
    store: str  # destination (copy) or the warmed disk store; password redacted
    source: str | None = None
    lora: str | None = None
    requested: int | None = None  # explicit identifiers asked for (None: all entries)
    copied: int = 0
    skipped: int = 0  # already in the destination
    computed: int = 0  # encoded by the producer engine (--compute-missing)
    entries: int = 0  # page cache: entry files read
    bytes: int = 0  # bytes written to the destination (copy) / read (page cache)
    seconds: float = 0.0  # the copy / read phase
    total_seconds: float = 0.0  # including hashing and computing
    hashed: int = 0  # IMAGE files hashed
    skipped_non_media: int = 0  # files in IMAGE directories that are not images or videos
    failures: list[dict] = field(default_factory=list)  # {identifier, path, reason}
    non_media: list[dict] = field(default_factory=list)  # {path, reason}: skipped, not failed

    @property
    def failed(self) -> int:
        return len(self.failures)

    @property
    def bytes_per_second(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def fail(self, identifier: str | None, reason: str, path: str | None = None) -> None:
        self.failures.append({"identifier": identifier, "path": path, "reason": reason})

    def to_dict(self) -> dict:
        d = asdict(self)
        d["failed"] = self.failed
        d["bytes_per_second"] = self.bytes_per_second
        return d


# -- selection -----------------------------------------------------------------------

def expand_images(paths: list[str], summary: WarmSummary | None = None) -> list[str]:
    """Files as given; directories searched recursively for media by content, like
    precompute (files there that are not images or videos are skipped and, with
    ``summary``, counted and listed). A file given by name is always hashed: if it is
    not media, that is its failure."""
    from .corpus import non_media_reason, walk

    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            for f in walk(p):
                reason = non_media_reason(f)
                if reason is None:
                    out.append(f.path)
                elif summary is not None:
                    summary.skipped_non_media += 1
                    summary.non_media.append({"path": f.path, "reason": reason})
        else:
            out.append(os.path.abspath(p))
    return out


def hash_media(files: list[str], model: str, lora: str | None, summary: WarmSummary, *,
               hash_algo: str | None = None, media_io_kwargs: dict | None = None,
               progress: Progress | None = None) -> dict[str, str]:
    """``identifier -> path`` (first file wins) for media files, hashed as ``vllm serve``
    hashes them; unreadable files become ``summary`` failures. Raises ImportError when
    vLLM's hasher does not import."""
    from .vllm.hashing import identify_file

    idents: dict[str, str] = {}
    for n, path in enumerate(files, 1):
        try:
            ident = identify_file(path, model, lora=lora, hash_algo=hash_algo,
                                  media_io_kwargs=media_io_kwargs).identifier
        except ImportError:
            raise
        except Exception as e:  # any decoding error (MediaError), OSError: this file's
            summary.fail(None, unreadable_reason(e), path)
        else:
            idents.setdefault(ident, path)
        if progress is not None:
            progress(n)
    return idents


def lora_of(identifier: str) -> str | None:
    return split_lora(identifier)[0]


def count_selected(store: Store, identifiers: list[str] | None, lora: str | None) -> int:
    """How many entries a warm of ``identifiers`` (None: all, optionally of one LoRA)
    handles: the total for a progress bar."""
    if identifiers is None:
        return sum(1 for i in store.identifiers() if lora is None or lora_of(i) == lora)
    return len(identifiers)


# -- the two jobs --------------------------------------------------------------------

def promote(src: Store, dst: Store, identifiers: list[str] | None, summary: WarmSummary, *,
            lora: str | None = None, overwrite: bool = False,
            paths: dict[str, str] | None = None, progress: Progress | None = None) -> None:
    """Copy entries ``src`` -> ``dst`` into ``summary`` (``identifiers=None``: all,
    optionally one ``lora``); every entry is verified on the way, entries ``dst`` has are
    skipped unless ``overwrite``. ``paths`` (identifier -> media file) names the file in
    failures. A store failing mid-copy raises
    :class:`~.store.transfer.TransferAborted` with the partial work in ``summary`` (also
    attached to the exception as ``summary``)."""
    from .store.transfer import TransferAborted, copy_entries

    paths = paths or {}
    done = 0
    t0 = time.perf_counter()

    def on_item(ident: str, outcome: str, nbytes: int) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done)

    try:
        report = copy_entries(src, dst, identifiers,
                              lora=lora if identifiers is None else None,
                              skip_existing=not overwrite, progress=on_item)
    except TransferAborted as e:
        _add_report(summary, e.report, paths)
        summary.seconds = time.perf_counter() - t0
        e.summary = summary  # the partial work, for the caller to show
        raise
    summary.seconds = time.perf_counter() - t0
    _add_report(summary, report, paths)


def _add_report(summary: WarmSummary, report, paths: dict[str, str]) -> None:
    summary.copied += report.copied
    summary.skipped += report.skipped
    summary.bytes += report.bytes
    for ident, reason in report.errors:
        summary.fail(ident, reason, paths.get(ident))


def read_into_page_cache(store: Store, identifiers: list[str] | None, summary: WarmSummary, *,
                         lora: str | None = None, paths: dict[str, str] | None = None,
                         progress: Progress | None = None) -> None:
    """Read a disk store's entry files into the OS page cache (without marking them as
    used), into ``summary``; an identifier asked for without an entry file is a
    ``missing`` failure."""
    from .store.transfer import warm_page_cache

    paths = paths or {}
    read: set[str] = set()

    def on_item(ident: str, nbytes: int) -> None:
        read.add(ident)
        if progress is not None:
            progress(len(read))

    report = warm_page_cache(store, identifiers, lora=lora if identifiers is None else None,
                             progress=on_item)
    summary.entries += report.entries
    summary.bytes += report.bytes
    summary.seconds = report.seconds
    for ident in identifiers or ():
        if ident not in read:
            summary.fail(ident, "missing", paths.get(ident))
