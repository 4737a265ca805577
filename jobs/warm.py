"""The warm job as library code: choose entries, compute the missing ones, then promote
them into another store or read them into the OS page cache.

What: :func:`warm` does what ``encache warm`` does, as :class:`WarmOptions` say, and
returns a :class:`WarmSummary` (no printing). Its parts -- selection (:func:`expand_images`, :func:`count_selected`),
hashing (:func:`hash_media`, exactly as ``vllm serve`` hashes: vLLM is imported only
then), :func:`promote` (verified copies between stores, a node's local tier included)
and :func:`read_into_page_cache` -- are usable alone::

    from encache.connectors.store import open_store
    from encache.jobs.warm import WarmSummary, promote

    with open_store("/data/encache", create=False) as src, \\
            open_store("redis://cache:6379/0") as dst:
        summary = WarmSummary(mode="copy", store=dst.url, source=src.url)
        promote(src, dst, None, summary)          # every entry dst lacks

``compute=True`` (``--compute-missing``) encodes the given
media that neither store holds with :func:`encache.jobs.precompute.precompute_files`
(a producer engine over just those files: no corpus, no manifest)::

    from encache.jobs.warm import WarmOptions, warm

    summary = warm(WarmOptions("redis://cache:6379/0", source="/data/encache",
                               images=["new/"], model="llava-hf/llava-1.5-7b-hf",
                               compute=True))
    print(summary.copied, summary.computed, summary.failures)

Progress goes to an optional :class:`~encache.jobs.progress.Progress` (one phase per step:
hashing, the engine's phases, copying or reading), ``note(text)`` takes a one-line
notice. Errors are
:class:`~encache.jobs.errors.EncacheError` (usage 2, store 7, engine 8).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

from .errors import EXIT_ENGINE, EXIT_USAGE, NO_VLLM_HINT, EncacheError
from ..connectors.media import unreadable_reason
from ..connectors.store.base import Store, StoreError
from ..connectors.store.keys import split_lora
from .precompute import PrecomputeOptions, ProducerSettings, hashing_settings
from .progress import NO_PROGRESS, Progress


@dataclass(frozen=True)
class WarmOptions(ProducerSettings):
    """What a warm does: promote entries ``source`` -> ``store`` (a disk store into,
    typically, Redis), or without ``source`` read ``store``'s entry files into the page
    cache; all entries, one ``lora``'s, those of ``images`` (hashed with ``model``;
    directories searched for media by content) or ``identifiers``. ``compute=True`` first
    encodes the images neither store holds, with the :class:`ProducerSettings`
    (``lora_path``, ``max_model_len``, ``dtype``, ``engine_args``, ``tag``: they apply only
    then). ``local_tier``: copy from ``store`` (any kind) into that directory, a node's
    local tier holding at most ``local_tier_max_bytes``. ``overwrite``: rewrite entries
    the destination has."""

    store: str
    source: str | None = None
    images: Sequence[str] = ()
    identifiers: Sequence[str] = ()
    model: str | None = None
    compute: bool = False
    overwrite: bool = False
    local_tier: str | None = None
    local_tier_max_bytes: int | None = None

    def check(self) -> None:
        """Usage checks (exit 2): nothing is opened, hashed or started for a bad command
        line."""
        from ..connectors.store import names_local_path
        from ..connectors.store.keys import InvalidIdentifier, validate

        local_tier, source = self.local_tier, self.source
        if self.local_tier_max_bytes is not None and not local_tier:
            raise _usage("--local-tier-max-bytes needs --local-tier DIR")
        if local_tier:
            if source is not None:
                raise _usage("--local-tier is filled from --store; drop --from")
            if self.compute:
                raise _usage("--compute-missing writes into the shared store: run it without "
                             "--local-tier first")
            if "://" in local_tier or not names_local_path(local_tier):
                raise _usage(f"--local-tier must be a directory on this node, not {local_tier}")
            if _same_path(local_tier, self.store):
                raise _usage(f"--local-tier is the shared store itself ({local_tier})")
        elif source is not None and _elsewhere(source):
            raise _usage(f"--from must be a disk store (a directory or file://PATH), "
                         f"not {_display_url(source)}",
                         hint="warm promotes a disk store into --store")
        if source is None and not local_tier and _elsewhere(self.store):
            raise _usage(f"without --from, warm reads a disk store into the page cache; "
                         f"{_display_url(self.store)} is not a directory on this node",
                         hint="give --from DISK_STORE to promote entries into it")
        if self.images and not self.model:
            raise _usage("IMAGE arguments need --model MODEL to compute their identifiers",
                         hint="the model id exactly as given to `vllm serve --model`")
        if self.compute and not self.images:
            raise _usage("--compute-missing needs IMAGE arguments (the files to encode)")
        if self.lora and self.identifiers:
            raise _usage("--lora selects entries by itself; with --identifier give full "
                         "identifiers (NAME:hash) instead")
        engine_opts = {"--lora-path": self.lora_path, "--max-model-len": self.max_model_len,
                       "--dtype": self.dtype, "--engine-arg": self.engine_args or None,
                       "--tag": self.tag}
        stray = [k for k, v in engine_opts.items() if v is not None]
        if stray and not self.compute:
            raise _usage(f"{', '.join(stray)} only appl{'y' if len(stray) > 1 else 'ies'} "
                         "with --compute-missing")
        if self.lora_path and not self.lora:
            raise _usage("--lora-path needs --lora NAME")
        for ident in self.identifiers:
            try:
                validate(ident)
            except InvalidIdentifier as e:
                raise _usage(f"bad --identifier {ident!r}: {e}") from None

    def precompute_options(self) -> PrecomputeOptions:
        """The precompute job's options for ``compute=True``: the producer settings as
        given, into ``store``; the images were named, so they are encoded even where a
        policy removed their entries."""
        producer = {f.name: getattr(self, f.name) for f in fields(ProducerSettings)}
        producer["engine_args"] = dict(self.engine_args or {})
        return PrecomputeOptions(model=self.model, store=self.store, refill_removed=True,
                                 **producer)


@dataclass
class WarmSummary:
    """What a warm run did (raw ints and seconds; ``to_dict`` for ``--json``)."""

    mode: str  # "copy" (promote --from a disk store) or "page-cache"
    store: str  # destination (copy) or the warmed disk store; password redacted
    source: str | None = None
    lora: str | None = None
    requested: int | None = None  # explicit identifiers asked for (None: all entries)
    copied: int = 0
    evicted: int = 0  # of those, gone again: the destination's capacity is below the selection
    capacity: int | None = None  # the destination's max_bytes, when it evicted copies
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
               progress: Progress = NO_PROGRESS) -> dict[str, str]:
    """``identifier -> path`` (first file wins) for media files, hashed as ``vllm serve``
    hashes them; unreadable files become ``summary`` failures. Each file advances
    ``progress`` (its phase started by the caller). Raises ImportError when vLLM's hasher
    does not import."""
    from ..connectors.vllm.hashing import identify_file

    idents: dict[str, str] = {}
    for path in files:
        failed = None
        try:
            ident = identify_file(path, model, lora=lora, hash_algo=hash_algo,
                                  media_io_kwargs=media_io_kwargs).identifier
        except ImportError:
            raise
        except Exception as e:  # any decoding error (MediaError), OSError: this file's
            summary.fail(None, unreadable_reason(e), path)
            failed = path
        else:
            idents.setdefault(ident, path)
        progress.advance(1, failed=failed)
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
            paths: dict[str, str] | None = None, progress: Progress = NO_PROGRESS) -> None:
    """Copy entries ``src`` -> ``dst`` into ``summary`` (``identifiers=None``: all,
    optionally one ``lora``); every entry is verified on the way, entries ``dst`` has are
    skipped unless ``overwrite``. ``paths`` (identifier -> media file) names the file in
    failures. Each entry advances ``progress`` (its phase started by the caller). A store failing mid-copy raises
    :class:`~.store.ops.transfer.TransferAborted` with the partial work in ``summary`` (also
    attached to the exception as ``summary``)."""
    from ..connectors.store.ops.transfer import TransferAborted, copy_entries

    paths = paths or {}
    copied: list[str] = []
    evictions_before = _evictions(dst)
    t0 = time.perf_counter()

    def on_item(ident: str, outcome: str, nbytes: int) -> None:
        if outcome == "copied":
            copied.append(ident)
        progress.advance(1, failed=ident if outcome == "failed" else None)

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
    if copied and evictions_before is not None and (_evictions(dst) or 0) > evictions_before:
        # a capacity below the selection: later copies evicted earlier ones (the store is
        # the truth, asked only when it evicted at all)
        with contextlib.suppress(StoreError):
            summary.evicted = sum(1 for ident in copied if not dst.contains(ident))
            summary.capacity = dst.max_bytes


def _evictions(store: Store) -> float | None:
    """The store's eviction count; None where it cannot be read (the copy's report does
    not depend on it)."""
    try:
        return store.read_counters().get("evictions", 0)
    except StoreError:
        return None


def _add_report(summary: WarmSummary, report, paths: dict[str, str]) -> None:
    summary.copied += report.copied
    summary.skipped += report.skipped
    summary.bytes += report.bytes
    for ident, reason in report.errors:
        summary.fail(ident, reason, paths.get(ident))


def read_into_page_cache(store: Store, identifiers: list[str] | None, summary: WarmSummary, *,
                         lora: str | None = None, paths: dict[str, str] | None = None,
                         progress: Progress = NO_PROGRESS) -> None:
    """Read a disk store's entry files into the OS page cache (without marking them as
    used), into ``summary``; an identifier asked for without an entry file is a
    ``missing`` failure. Each entry read advances ``progress``."""
    from ..connectors.store.ops.transfer import warm_page_cache

    paths = paths or {}
    read: set[str] = set()

    def on_item(ident: str, nbytes: int) -> None:
        if ident not in read:
            read.add(ident)
            progress.advance(1)

    report = warm_page_cache(store, identifiers, lora=lora if identifiers is None else None,
                             progress=on_item)
    summary.entries += report.entries
    summary.bytes += report.bytes
    summary.seconds = report.seconds
    for ident in identifiers or ():
        if ident not in read:
            summary.fail(ident, "missing", paths.get(ident))


# -- the job ---------------------------------------------------------------------------


def _usage(message: str, hint: str | None = None) -> EncacheError:
    return EncacheError(message, EXIT_USAGE, hint)


def _display_url(url: str, store=None) -> str:
    """The store URL safe to print (password redacted; disk paths made absolute)."""
    from ..connectors.store import redact

    if store is not None and store.supports_entry_path:
        return str(store.url)
    return redact(url)


def _elsewhere(url: str) -> bool:
    """``url`` names a store a backend serves away from this node's disk (Redis, a
    process's memory); a URL no backend serves is left to the opening to reject."""
    from ..connectors.store.registry import find_backend

    backend = find_backend(url)
    return backend is not None and not backend.local


def _same_path(a: str, b: str) -> bool:
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def _same_disk_store(a, b) -> bool:
    ra, rb = a.root, b.root
    if ra is None or rb is None:
        return False
    try:
        return os.path.samefile(ra, rb)
    except OSError:
        return ra == rb


@contextlib.contextmanager
def _opened(url: str):
    """Open an existing store (a typo'd path is an error, exit 7, not a new empty store)."""
    from ..connectors.store import open_store

    store = open_store(url, create=False)
    try:
        yield store
    finally:
        store.close()


def hash_images(files: list[str], model: str, lora: str | None, summary: WarmSummary, *,
                engine_args: dict | None = None,
                progress: Progress = NO_PROGRESS) -> dict[str, str]:
    """``identifier -> path`` (first file wins); unreadable files become failures.
    Hashed as precompute does, with the server settings among ``engine_args``."""

    media_io_kwargs, hash_algo = hashing_settings(engine_args)
    try:
        from ..connectors.vllm.hashing import identify_file  # noqa: F401
    except ImportError as e:
        raise EncacheError(
            f"hashing IMAGE arguments needs vLLM's hasher, which does not import: {e}",
            EXIT_ENGINE, hint=NO_VLLM_HINT) from None
    progress.start("Hashing images", len(files))
    return hash_media(files, model, lora, summary, hash_algo=hash_algo,
                      media_io_kwargs=media_io_kwargs, progress=progress)


def compute_missing(missing: dict[str, str], options: PrecomputeOptions, summary: WarmSummary,
                    *, progress: Progress = NO_PROGRESS) -> set[str]:
    """Encode ``missing`` (identifier -> media path) into ``options.store`` with the
    precompute job over just those files; their failures become ``summary``'s. Returns
    the identifiers handled (computed or failed)."""
    from .precompute import precompute_files

    ident_of = {path: ident for ident, path in missing.items()}
    result = precompute_files(list(missing.values()), options, progress=progress,
                              identifiers=ident_of)  # hashed already: not again
    for f in result.failures:
        summary.fail(ident_of.get(f["path"]), f["error"], f["path"])
    summary.computed += result.encoded
    return set(missing)


def warm(options: WarmOptions, *, progress: Progress = NO_PROGRESS,
         note: Callable[[str], None] | None = None) -> WarmSummary:
    """Run the warm job :class:`WarmOptions` describe (checked first: nothing is opened
    for a bad one) and return what it did."""
    options.check()
    store_url, source_url, lora = options.store, options.source, options.lora
    images, identifiers = list(options.images), list(options.identifiers)
    local_tier = options.local_tier

    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if local_tier:  # the shared store into this node's tier (created if new)
            from ..connectors.store import open_store
            src = stack.enter_context(_opened(store_url))
            dst = stack.enter_context(contextlib.closing(
                open_store(local_tier, max_bytes=options.local_tier_max_bytes)))
            source_url, store_url = store_url, local_tier
        else:
            src = stack.enter_context(_opened(source_url)) if source_url is not None else None
            dst = stack.enter_context(_opened(store_url))
        if src is not None and _same_disk_store(src, dst):
            raise _usage(f"--from and --store are the same store ({src.url})")
        dst.ping()  # a dead or misconfigured Redis fails here, before any hashing
        summary = WarmSummary(mode="copy" if src is not None else "page-cache",
                              store=_display_url(store_url, dst),
                              source=_display_url(source_url, src) if src is not None else None,
                              lora=lora)
        paths: dict[str, str] = {}  # identifier -> image path (for messages)
        explicit = bool(images or identifiers)
        if images:
            files = expand_images(images, summary)
            if not files:
                raise _usage("no image or video files in the IMAGE arguments")
            paths = hash_images(files, options.model, lora, summary,
                                engine_args=options.engine_args, progress=progress)
            summary.hashed = len(files)
        wanted: list[str] | None = None
        if explicit:
            wanted = list(dict.fromkeys([*paths, *identifiers]))
            summary.requested = len(wanted)
        if options.compute and paths:
            from ..connectors.encoder_config import holds
            digest = options.encoder_config
            missing = {i: p for i, p in paths.items()  # no usable entry in either store
                       if not holds(dst, i, digest)
                       and not (src is not None and holds(src, i, digest))}
            if missing:
                if note:
                    note(f"Encoding {len(missing)} missing item(s) with {options.model!r} "
                         f"(vLLM producer engine)")
                handled = compute_missing(missing, options.precompute_options(), summary,
                                          progress=progress)
                if src is not None:  # computed straight into the destination
                    wanted = [i for i in wanted if i not in handled]
        if src is not None:
            if wanted is None or wanted:
                _copy(src, dst, wanted, summary, lora=lora, overwrite=options.overwrite,
                      paths=paths, progress=progress)
        elif wanted is None or wanted:
            _page_cache(dst, wanted, summary, lora=lora, paths=paths, progress=progress)
    summary.total_seconds = time.perf_counter() - t_start
    return summary


def _copy(src, dst, idents, summary, *, lora, overwrite, paths, progress) -> None:
    progress.start("Copying", count_selected(src, idents, lora))
    promote(src, dst, idents, summary, lora=lora, overwrite=overwrite, paths=paths,
            progress=progress)


def _page_cache(store, idents, summary, *, lora, paths, progress) -> None:
    progress.start("Reading into the page cache", count_selected(store, idents, lora))
    read_into_page_cache(store, idents, summary, lora=lora, paths=paths, progress=progress)
