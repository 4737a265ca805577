"""Precompute's encode phase in this process: one in-process producer engine.

What: :class:`LocalStage` (the job's default ``Stage``): identify in this process, then
encode ``todo`` batch by batch with a
:class:`~encache.connectors.vllm.producer.ProducerEngine` whose connector writes to the
store (writes are asynchronous: ``wait_for_saves`` at the end), trimming each batch to
the free room with ``--over-capacity skip`` and stopping when the store's filesystem is
full (exit 7). :class:`Encoded` is what any encode stage reports. The Ray stage
(:mod:`encache.jobs.ray_precompute`) shares :func:`media_item` and
:func:`engine_store_url`.
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..errors import EXIT_ENGINE, EXIT_STORE, EncacheError
from ...connectors.store.units import batched
from .identify import classify
from .options import PrecomputeOptions, Summary


@dataclass
class Encoded:
    """What an encode stage reports: identifiers the engines encoded (``ok``), the rest
    with their error (``failed``), the identifiers the engines' writers saved (to tell an
    entry evicted after its write from a lost one) and write errors by identifier."""

    ok: list = field(default_factory=list)
    failed: dict = field(default_factory=dict)
    saved: set = field(default_factory=set)
    save_errors: dict = field(default_factory=dict)


_FULL = tuple(os.strerror(e) for e in (errno.ENOSPC, errno.EDQUOT, errno.EROFS))


def store_full(save_errors: dict[str, str]) -> str | None:
    """The reason when writes failed because the store cannot take more (no space,
    quota, read-only filesystem): no later write can succeed, so the run stops."""
    for err in save_errors.values():
        for reason in _FULL:
            if reason in err:
                return reason
    return None


def media_item(ident: str, f, decode=None) -> tuple[tuple | None, str | None]:
    """``((identifier, payload, kind), None)`` for the engine, or ``(None, error)`` when
    the file cannot be read, is no longer media (changed since it was hashed) or, with
    ``decode``, does not decode. ``payload`` is a data URL, or for an image, when
    ``decode`` (the engine's :attr:`~encache.connectors.vllm.producer.ProducerEngine.
    decode_image`) is given, the decoded image: the caller's thread does the decoding
    the engine would otherwise do in its own."""
    from ...connectors.media import error_text, mime_type, sniff
    from ...connectors.vllm.producer import data_url

    try:
        with open(f.path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        return None, f"cannot read: {e.strerror}"
    found = sniff(data, name=f.rel)
    if not found:
        return None, f"not a readable image or video ({found.reason})"
    if decode is not None and found.kind == "image":
        try:
            return (ident, decode(data), "image"), None
        except Exception as e:  # noqa: BLE001 - any decoder error is this file's failure
            # worded as the hashing phase words the same failure (hashing._decoding)
            return None, f"not a readable image ({error_text(e)})"[:300]
    return (ident, data_url(data, mime=mime_type(found)), found.kind), None


def engine_store_url(options: PrecomputeOptions, store) -> str:
    """The URL the engine's connector opens: the absolute path for a store in a directory
    here, else the real URL (``store.url`` is redacted for display and would fail AUTH)."""
    from ...connectors.store import names_local_path

    return str(store.url) if names_local_path(options.store) else options.store


def _reason(e: BaseException) -> str:
    """The one line that says why: a pydantic ``ValidationError`` (vLLM's config checks)
    prints "1 validation error for VllmConfig" first and the reason after it, so its
    first error's message is taken instead ("An EC producer-only instance requires a
    multimodal model.")."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        try:
            msg = str(errors()[0].get("msg", "")).strip()
        except Exception:  # noqa: BLE001 - not pydantic after all: its text below
            msg = ""
        if msg:
            return msg.removeprefix("Value error, ").splitlines()[0]
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def model_architecture(model: str) -> str | None:
    """``architectures[0]`` of a local model directory's config.json (the family vLLM
    resolves), None when there is none to read (a hub id, no config)."""
    import json

    try:
        with open(os.path.join(model, "config.json")) as f:
            return json.load(f)["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def engine_error(model: str, e: BaseException) -> EncacheError:
    arch = model_architecture(model)
    named = f"{model!r} ({arch})" if arch else repr(model)
    return EncacheError(f"vLLM engine failed to start for {named}: {_reason(e)}", EXIT_ENGINE,
                        hint="set ENCACHE_DEBUG=1 for vLLM's traceback")


def room_budget(store, options: PrecomputeOptions):
    """``--over-capacity skip`` on a store with a capacity: its
    :class:`~encache.jobs.precompute.capacity.RoomBudget` (the entry size from what the store
    holds, None while it holds nothing); None for any other run."""
    if options.over_capacity != "skip" or not store.max_bytes:
        return None
    from .capacity import RoomBudget, mean_entry_bytes

    return RoomBudget(store, store.max_bytes, store.low_watermark,
                      mean_entry_bytes(store, store.identifiers()))


def lora_note(options: PrecomputeOptions, engine) -> str | None:
    """``--lora`` on a model whose LoRA does not reach its vision encoder: say which
    server configuration the ``{lora}:`` entries serve, and which one they do not."""
    if not options.lora or engine.lora_reaches_encoder():
        return None
    arch = ", ".join(getattr(engine.llm.model_config, "architectures", None) or [options.model])
    return (f"{arch} does not apply LoRA to its vision encoder: the '{options.lora}:' entries "
            f"equal the base ones and serve only a server started with "
            f"--enable-tower-connector-lora; a server with --enable-lora alone looks up every "
            f"adapter's images under the base entries (precompute without --lora)")


def nothing_fits(budget, wanted: int, summary: Summary) -> bool:
    """True, with the ``wanted`` entries counted as skipped, when none of them fits: then
    no engine starts."""
    if budget.fits(wanted) > 0:
        return False
    summary.skipped_capacity += wanted
    return True


class LocalStage:
    """Identify in this process; encode with one in-process producer engine, ``batch``
    files per engine call, with the ``--over-capacity skip`` room budget and a stop when
    the store's filesystem is full.

    Nothing waits for a whole phase. Files are identified on a background thread
    (:class:`~.identify.RowStream`); the engine starts as soon as the first
    missing file is found and takes batches as they are identified, so hashing overlaps
    the engine's start-up and its encoding (before, a million-file corpus was hashed
    before the encoder started). A reader thread reads batch ``k+1``'s files -- and
    decodes its images with the engine's own loader -- while the engine encodes batch
    ``k`` (the connector's writes are already asynchronous), so the engine waits neither
    for the disk nor for image decoding between batches.

    The engine accepts the media kinds of the missing files found by the time it starts
    (images always). A file of another kind the model takes, found later (a video after
    images), is put aside and encoded at the end by a second engine that accepts it: one
    extra start-up for a mixed corpus whose first missing file is an image. A kind the
    model does not take goes to the engine as before and fails item by item, naming the
    architecture."""

    summary_class = Summary

    def __init__(self, *, prefetch: bool = True, decode: bool = True, trace=None,
                 hash_threads: int | None = None):
        #: read the next batch while the engine encodes this one (False: one after the other)
        self.prefetch = prefetch
        #: decode images in the reader with the engine's own loader (False: send every
        #: image as a data URL, decoded by the engine in its own thread, as before)
        self.decode = decode
        #: threads that identify files (default: one per CPU, at most 8)
        self.hash_threads = max(1, hash_threads or min(8, os.cpu_count() or 1))
        #: ``trace(stage, batch_index, t_start, t_end)`` for each batch's "read" and
        #: "encode" (``time.perf_counter`` seconds; tests show the overlap with it)
        self.trace = trace

    def _note(self, stage: str, k: int, t_start: float) -> None:
        if self.trace is not None:
            self.trace(stage, k, t_start, time.perf_counter())

    def _read(self, k: int, chunk: list, decode=None) -> list:
        """``[(identifier, engine item or None, error or None)]`` of one batch."""
        t_start = time.perf_counter()
        read = [(ident, *media_item(ident, f, decode)) for ident, f in chunk]
        self._note("read", k, t_start)
        return read

    def _read_next(self, k: int, batches, decode=None) -> tuple[list, list] | None:
        """The next batch (waiting for it to be identified) and what :meth:`_read` made
        of it; None at the end."""
        chunk = next(batches, None)
        return None if chunk is None else (chunk, self._read(k, chunk, decode))

    def identify(self, files, records, store, options, summary, lora_digest, progress):
        from .identify import RowStream

        present = set(store.identifiers())
        encoder_config = summary.encoder_config
        if progress:
            progress.start("hashing", len(files))

        def row(f):
            return (f, *classify(f, records.get(f.rel), store=store, options=options,
                                 encoder_config=encoder_config, lora_digest=lora_digest,
                                 present=present))
        return RowStream(files, row, threads=self.hash_threads, progress=progress)

    def encode(self, todo, store, options, summary, progress) -> Encoded | None:
        budget = room_budget(store, options)
        if budget is not None:
            todo.drain()  # the room budget is planned for the whole todo
            if not todo.files or nothing_fits(budget, len(todo.files), summary):
                return None
        stream = iter(todo)  # (identifier, file) of each missing file as it is identified
        found = list(todo.files.items())  # the whole todo when it was drained above
        if not found:
            first = next(stream, None)
            if first is None:
                return None  # nothing is missing: no engine starts
            found = [first, *todo.take_ready()]
        out = Encoded()
        t0 = None
        engine = None
        try:
            engine = self._start(options, store, [f for _, f in found], summary, progress)
            t0 = time.perf_counter()
            found += todo.take_ready()  # identified during the start-up
            if progress:  # the total is known when identification ended meanwhile
                progress.start("encoding", len(todo.files) if todo.complete else None)
            later = self._encode_batches(engine, itertools.chain(found, stream), options,
                                         store, out, budget, summary, progress,
                                         on_error=todo.close)
            if later:  # kinds this engine does not accept: a second one that does
                self._collect(engine, out)
                engine.close()
                engine = None
                engine = self._start(options, store, [f for _, f in later], summary, progress)
                if progress:
                    progress.start("encoding", len(later))
                self._encode_batches(engine, iter(later), options, store, out, budget,
                                     summary, progress)
            self._collect(engine, out)
            # from the engine being ready until every write is on disk (not its shutdown)
            summary.encode_seconds = time.perf_counter() - t0
        finally:
            if engine is not None:
                engine.close()
        full = store_full(out.save_errors)
        if full:
            written = sum(1 for ident in out.ok if ident in out.saved)
            if todo.complete:
                what = (f"{len(todo.files) - written:,} of {len(todo.files):,} entries were "
                        f"not written to {store.url}")
            else:  # nothing more can be written: stop identifying the rest of the corpus
                todo.close()
                what = (f"{written:,} entries were written to {store.url} before it filled, "
                        f"the rest of the corpus was not (identifying it stopped too)")
            raise EncacheError(
                f"the store's filesystem is full ({full}): {what}; every entry written is "
                f"whole", EXIT_STORE,
                hint="free space or set --max-bytes below the free space, then rerun: it "
                     "encodes only what is missing")
        return out

    @staticmethod
    def _collect(engine, out: Encoded) -> None:
        """Wait for the engine's writes and take its write results."""
        engine.wait_for_saves()
        out.save_errors.update(engine.save_errors())
        out.saved |= engine.saved_identifiers()

    def _start(self, options, store, files: list, summary, progress):
        """A producer engine accepting the media kinds of ``files`` (a header read each)."""
        from ...connectors.media import sniff
        from ...connectors.vllm.producer import EngineOptions, ProducerEngine

        kinds = {sniff(f.path, name=f.rel).kind or "image" for f in files}
        opts = EngineOptions(**options.engine_options(engine_store_url(options, store), kinds))
        if progress:
            progress.start("starting engine", None)
        try:
            engine = ProducerEngine(opts)
        except Exception as e:
            raise engine_error(options.model, e) from e
        summary.engine_started = True
        note = lora_note(options, engine)
        if note and note not in summary.notes:
            summary.notes.append(note)
        return engine

    def _encode_batches(self, engine, items, options, store, out: Encoded, budget, summary,
                        progress, on_error=None) -> list:
        """Encode ``items`` (``(identifier, file)``, consumed as they come) in batches;
        returns the items of a media kind the engine does not accept, untouched.
        ``on_error`` stops what feeds ``items`` when this fails (an engine error, Ctrl-C):
        the reader may be waiting for the next batch to be identified."""
        from .capacity import mean_entry_bytes

        accepted = {"image", *engine.opts.modalities}
        later: list = []
        batches = batched(items, options.batch)
        # one reader thread (started after the engine), at most one batch ahead: reading
        # the next batch's files (bytes -> sniff -> decoded image with the engine's own
        # loader, or a data URL for a video) overlaps the engine's encode of this one
        # (Pillow releases the GIL while it decodes); results are taken in batch order,
        # so the output is the same as without it
        decode = engine.decode_image if self.decode else None
        if budget is not None:  # a re-read of the store's usage includes queued writes
            budget.before_read = engine.wait_for_saves
        reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encache-read")
        try:
            ahead = reader.submit(self._read_next, 0, batches, decode) if self.prefetch else None
            k = 0
            while True:
                if self.prefetch:
                    got = ahead.result()
                    if got is None:
                        break
                    ahead = reader.submit(self._read_next, k + 1, batches, decode)
                else:  # one after the other: this batch is read once the last is encoded
                    got = self._read_next(k, batches, decode)
                    if got is None:
                        break
                chunk, read = got
                k += 1
                if budget is not None:
                    if out.ok and budget.mean_bytes is None:
                        engine.wait_for_saves()
                        budget.mean_bytes = mean_entry_bytes(store, out.ok)
                    n = budget.fits(len(chunk))
                    summary.skipped_capacity += len(chunk) - n
                    if progress and n < len(chunk):
                        progress.advance(len(chunk) - n)
                    chunk, read = chunk[:n], read[:n]
                    if not chunk:
                        continue
                payload, put_aside = [], 0
                for (ident, f), (_, item, error) in zip(chunk, read):
                    if item is None:
                        out.failed[ident] = error
                    elif item[2] not in accepted and engine.model_takes(item[2]):
                        later.append((ident, f))
                        put_aside += 1
                    else:
                        payload.append(item)
                t_encode = time.perf_counter()
                for res in engine.encode(payload) if payload else []:
                    if res.ok:
                        out.ok.append(res.identifier)
                    else:
                        out.failed[res.identifier] = res.error
                self._note("encode", k - 1, t_encode)
                if progress:
                    progress.advance(len(chunk) - put_aside)
                if store_full(engine.save_errors()):
                    return []  # the store's filesystem is full: stop encoding, report after
        except BaseException:
            if on_error is not None:
                on_error()
            raise
        finally:
            reader.shutdown(wait=True, cancel_futures=True)
        return later

