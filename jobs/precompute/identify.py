"""Precompute's identify phase: each file's served identifier and what the store holds.

What: :func:`classify` gives one file's row -- its identifier (from the manifest record,
else vLLM's hasher over the bytes as ``vllm serve`` reads them: :func:`identify_or_mark`),
whether it was hashed, and its state (:func:`stored_state`: present, other encoder
config, stale LoRA adapter, missing; or a marker: not media, unreadable). A
:class:`Todo` counts rows, in corpus order, into the ``Summary`` and yields what must be
encoded as the rows arrive (:func:`account`: all at once); a :class:`RowStream` computes
the rows on a background thread, so encoding starts before the corpus is hashed. Why
apart: the same row is computed in this process (single-host) and in Ray tasks
(:mod:`encache.jobs.ray_precompute`), and counted the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ...connectors.store.entry import NEWER_FORMAT

from .options import PrecomputeOptions, Summary

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
    from ..corpus import non_media_reason
    from ...connectors.media import unreadable_reason

    reason = non_media_reason(f)
    if reason is not None:
        return NON_MEDIA + reason
    from ...connectors.vllm.hashing import identify_file
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
    ``missing``: one header read (``holds()`` semantics). An entry written by a newer
    encache is ``present``: not this build's to encode again or replace."""
    info = store.stat(ident)
    if info is None:
        return "missing"
    if info.error == NEWER_FORMAT:
        return "present"
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


def _ordered(pool, fn, items, window: int):
    """``pool.map(fn, items)`` with at most ``window`` calls queued (a corpus of millions
    of files is not turned into millions of futures at once); results in input order."""
    from collections import deque

    pending: deque = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


class RowStream:
    """Identify rows computed in the background, handed out in corpus order as they come.

    A thread (``encache-identify``) runs ``row(f)`` for every file on ``threads`` worker
    threads (at most a bounded window queued, results in input order) and puts each row in
    a queue; iterating the stream takes them, waiting for the next one when needed, and
    re-raises an error the thread met. Why: the encode stage starts its engine when the
    first missing file is found, while the rest are still being hashed, instead of after
    the whole corpus (minutes on a million files). ``progress.advance(1, failed=…,
    phase="hashing")`` is called from that thread after each row; ``close()`` stops it (an
    engine that failed to start) and waits for it."""

    _END = object()

    def __init__(self, files: list, row, *, threads: int, progress=None):
        import queue
        import threading

        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._progress = progress
        self._thread = threading.Thread(target=self._run, args=(files, row, max(1, threads)),
                                        name="encache-identify", daemon=True)
        self._thread.start()

    def _run(self, files: list, row, threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        try:
            # files are read, hashed (blake3) and, where the header cannot tell, decoded
            # (Pillow) by a few threads: both release the GIL
            with ThreadPoolExecutor(max_workers=threads,
                                    thread_name_prefix="encache-hash") as pool:
                for f, ident, hashed, state in _ordered(pool, row, self._files(files),
                                                        4 * threads):
                    self._queue.put((f, ident, hashed, state))
                    if self._progress:
                        self._progress.advance(
                            1, failed=f"{f.rel}: {ident[len(UNREADABLE):]}"
                            if state == "unreadable" else None, phase="hashing")
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
            self._error = e
        finally:
            self._queue.put(self._END)

    def _files(self, files: list):
        for f in files:
            if self._stop.is_set():
                return
            yield f

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is self._END:
                self._queue.put(self._END)  # a second iteration ends at once
                if self._error is not None:
                    raise self._error
                return
            yield item

    def ready(self) -> int:
        """Rows computed and not yet taken (taking them will not wait)."""
        return self._queue.qsize()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class Todo:
    """What must be encoded, found as identify rows arrive (corpus order).

    Iterating yields ``(identifier, CorpusFile)`` for each identifier that must be encoded,
    the first file of an identifier winning, and counts every row it passes into the
    ``Summary`` and (hashed rows) the manifest, as :func:`account` did for a whole list.
    A missing identifier in ``removed`` (a policy removed its entry: ``store.removals()``)
    is counted as ``skipped_removed``, not encoded.
    ``files`` is what was found so far (identifier -> file); :meth:`drain` takes every
    remaining row and returns it complete. One consumer at a time."""

    def __init__(self, rows: Iterable[tuple], summary: Summary, manifest=None,
                 removed: Mapping[str, str] | None = None):
        self.files: dict[str, object] = {}
        #: identifiers a policy removed (``store.removals()``): missing, but left out
        self._removed = removed or {}
        self._rows = rows
        self._iter = iter(rows)
        self._summary = summary
        self._manifest = manifest
        self.complete = False

    def __iter__(self):
        for f, ident, hashed, state in self._iter:
            if self._take(f, ident, hashed, state):
                yield ident, f
        self.complete = True

    def take_ready(self) -> list:
        """``(identifier, file)`` of the rows already computed (no wait; every row when
        they are a list)."""
        n = self._rows.ready() if isinstance(self._rows, RowStream) else None
        found = []
        while n is None or n > 0:
            row = next(self._iter, None)
            if row is None:
                self.complete = True
                break
            if n is not None:
                n -= 1
            f, ident, hashed, state = row
            if self._take(f, ident, hashed, state):
                found.append((ident, f))
        return found

    def drain(self) -> dict:
        for _ in self:
            pass
        return self.files

    def close(self) -> None:
        if isinstance(self._rows, RowStream):
            self._rows.close()

    def _take(self, f, ident: str, hashed: bool, state: str) -> bool:
        """Count one row; True (and ``f`` recorded in ``files``) when it is an identifier
        to encode not found before."""
        summary = self._summary
        if hashed and self._manifest is not None:
            self._manifest.record(f, ident)
        if state == "non_media":  # remembered: an unchanged file is not sniffed again
            summary.skipped_non_media += 1
            summary.non_media.append({"path": f.rel, "reason": ident[len(NON_MEDIA):]})
            return False
        if hashed:
            summary.hashed += 1
        else:
            summary.from_manifest += 1
        if state == "unreadable":  # remembered: an unchanged bad file is not re-read
            summary.failed += 1
            summary.failures.append({"path": f.rel, "error": ident[len(UNREADABLE):]})
            return False
        if state == "present":
            summary.present += 1
            return False
        if state == "missing" and ident in self._removed:  # not undone by a refresh
            summary.skipped_removed += 1
            return False
        if ident in self.files:  # another file with the same content: encoded once
            return False
        if state == "other_config":
            summary.other_config += 1
        elif state == "stale_lora":
            summary.stale_lora += 1
        self.files[ident] = f
        return True


def account(rows: Iterable[tuple], summary: Summary, manifest=None) -> dict:
    """Count identify rows ``(CorpusFile, identifier, hashed, state)`` (in corpus order)
    into ``summary`` and record hashed ones in ``manifest``; returns ``identifier ->
    CorpusFile`` of what must be encoded (the first file of an identifier wins)."""
    return Todo(rows, summary, manifest).drain()
