"""The warm job as library code: choose entries, compute the missing ones, then promote
them into another store or read them into the OS page cache.

What: :func:`warm` does what ``encache warm`` does and returns a
:class:`~encache.connectors.warm.WarmSummary` (no printing). Its parts --
selection, hashing, promote, the page-cache read -- are
:mod:`encache.connectors.warm`; ``compute=True`` (``--compute-missing``) encodes the given
media that neither store holds with :func:`encache.jobs.precompute.precompute_files`
(a producer engine over just those files: no corpus, no manifest)::

    from encache.jobs.warm import warm

    summary = warm("redis://cache:6379/0", source_url="/data/encache",
                   images=["new/"], model="llava-hf/llava-1.5-7b-hf", compute=True)
    print(summary.copied, summary.computed, summary.failures)

Progress is drawn by the caller: ``progress(label, total, unit)`` returns a context
manager yielding ``update(done)`` (the CLI passes ``encache.cli.render.progress``),
``phases()`` returns a context manager yielding a ``start(phase, total)`` /
``advance(n, failed=)`` object for the engine's phases (entered only while it runs), ``note(text)`` a one-line notice. Errors are
:class:`~encache.connectors.errors.EncacheError` (usage 2, store 7, engine 8).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

from ..connectors.errors import EXIT_ENGINE, EXIT_USAGE, EncacheError
from ..connectors.warm import WarmSummary
from .precompute import PrecomputeOptions, engine_encoder_config, hashing_settings


@contextlib.contextmanager
def _no_progress(label: str, total: int | None = None, unit: str = "entries"):
    yield lambda done: None


def _usage(message: str, hint: str | None = None) -> EncacheError:
    return EncacheError(message, EXIT_USAGE, hint)


def _display_url(url: str, store=None) -> str:
    """The store URL safe to print (password redacted; disk paths made absolute)."""
    from ..connectors.store import redact

    if store is not None and store.supports_entry_path:
        return str(store.url)
    return redact(url)


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
                engine_args: dict | None = None, progress=_no_progress) -> dict[str, str]:
    """``identifier -> path`` (first file wins); unreadable files become failures.
    Hashed as precompute does, with the server settings among ``engine_args``."""
    from ..connectors.warm import hash_media

    media_io_kwargs, hash_algo = hashing_settings(engine_args)
    try:
        from ..connectors.vllm.hashing import identify_file  # noqa: F401
    except ImportError as e:
        raise EncacheError(
            f"hashing IMAGE arguments needs vLLM's hasher, which does not import: {e}",
            EXIT_ENGINE, hint="install encache with the [cpu] or [gpu] extra") from None
    with progress("Hashing images", len(files), "images") as tick:
        return hash_media(files, model, lora, summary, hash_algo=hash_algo,
                          media_io_kwargs=media_io_kwargs, progress=tick)


def compute_missing(missing: dict[str, str], options: PrecomputeOptions, summary: WarmSummary,
                    *, phases=None) -> set[str]:
    """Encode ``missing`` (identifier -> media path) into ``options.store`` with the
    precompute job over just those files; their failures become ``summary``'s. Returns
    the identifiers handled (computed or failed)."""
    from .precompute import precompute_files

    ident_of = {path: ident for ident, path in missing.items()}
    with (phases() if phases else contextlib.nullcontext()) as bar:
        result = precompute_files(list(missing.values()), options, progress=bar,
                                  identifiers=ident_of)  # hashed already: not again
    for f in result.failures:
        summary.fail(ident_of.get(f["path"]), f["error"], f["path"])
    summary.computed += result.encoded
    return set(missing)


def warm(store_url: str, *, source_url: str | None = None, images: list[str] | None = None,
         identifiers: list[str] | None = None, lora: str | None = None,
         model: str | None = None, compute: bool = False, overwrite: bool = False,
         lora_path: str | None = None, max_model_len: int | None = None,
         dtype: str | None = None, engine_args: dict | None = None, tag: str | None = None,
         local_tier: str | None = None, local_tier_max_bytes: int | None = None,
         progress: Callable | None = None, phases=None,
         note: Callable[[str], None] | None = None) -> WarmSummary:
    """Promote entries ``source_url`` -> ``store_url`` (a disk store into, typically,
    Redis), or without ``source_url`` read ``store_url``'s entry files into the page cache:
    all entries, one ``lora``'s, those of ``images`` (hashed with ``model``; directories
    searched for media by content) or ``identifiers``. ``compute=True`` first encodes the
    images neither store holds (``lora_path``, ``max_model_len``, ``dtype``,
    ``engine_args``, ``tag`` go to the producer engine). ``local_tier``: copy from
    ``store_url`` (any kind) into that directory, a node's local tier holding at most
    ``local_tier_max_bytes``."""
    from ..connectors.store.keys import InvalidIdentifier, validate
    from ..connectors.store.url import is_redis_url
    from ..connectors.warm import expand_images

    progress = progress or _no_progress
    images = list(images or [])
    identifiers = list(identifiers or [])
    # usage first: nothing is opened, hashed or started for a bad command line
    if local_tier_max_bytes is not None and not local_tier:
        raise _usage("--local-tier-max-bytes needs --local-tier DIR")
    if local_tier:
        if source_url is not None:
            raise _usage("--local-tier is filled from --store; drop --from")
        if compute:
            raise _usage("--compute-missing writes into the shared store: run it without "
                         "--local-tier first")
        if is_redis_url(local_tier) or "://" in local_tier:
            raise _usage(f"--local-tier must be a directory on this node, not {local_tier}")
        if _same_path(local_tier, store_url):
            raise _usage(f"--local-tier is the shared store itself ({local_tier})")
    elif source_url is not None and is_redis_url(source_url):
        raise _usage(f"--from must be a disk store (a directory or file://PATH), "
                     f"not {_display_url(source_url)}",
                     hint="warm promotes a disk store into --store")
    if source_url is None and not local_tier and is_redis_url(store_url):
        raise _usage(f"without --from, warm reads a disk store into the page cache; "
                     f"{_display_url(store_url)} is Redis",
                     hint="give --from DISK_STORE to promote entries into it")
    if images and not model:
        raise _usage("IMAGE arguments need --model MODEL to compute their identifiers",
                     hint="the model id exactly as given to `vllm serve --model`")
    if compute and not images:
        raise _usage("--compute-missing needs IMAGE arguments (the files to encode)")
    if lora and identifiers:
        raise _usage("--lora selects entries by itself; with --identifier give full "
                     "identifiers (NAME:hash) instead")
    engine_opts = {"--lora-path": lora_path, "--max-model-len": max_model_len,
                   "--dtype": dtype, "--engine-arg": engine_args or None, "--tag": tag}
    stray = [k for k, v in engine_opts.items() if v is not None]
    if stray and not compute:
        raise _usage(f"{', '.join(stray)} only apply with --compute-missing")
    if lora_path and not lora:
        raise _usage("--lora-path needs --lora NAME")
    for ident in identifiers:
        try:
            validate(ident)
        except InvalidIdentifier as e:
            raise _usage(f"bad --identifier {ident!r}: {e}") from None

    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if local_tier:  # the shared store into this node's tier (created if new)
            from ..connectors.store import open_store
            src = stack.enter_context(_opened(store_url))
            dst = stack.enter_context(contextlib.closing(
                open_store(local_tier, max_bytes=local_tier_max_bytes)))
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
            paths = hash_images(files, model, lora, summary, engine_args=engine_args,
                                progress=progress)
            summary.hashed = len(files)
        wanted: list[str] | None = None
        if explicit:
            wanted = list(dict.fromkeys([*paths, *identifiers]))
            summary.requested = len(wanted)
        if compute and paths:
            from ..connectors.encoder_config import holds
            digest = engine_encoder_config(engine_args, tag)
            missing = {i: p for i, p in paths.items()  # no usable entry in either store
                       if not holds(dst, i, digest)
                       and not (src is not None and holds(src, i, digest))}
            if missing:
                if note:
                    note(f"Encoding {len(missing)} missing item(s) with {model!r} "
                         f"(vLLM producer engine)")
                options = PrecomputeOptions(model=model, store=store_url, lora=lora,
                                            lora_path=lora_path, max_model_len=max_model_len,
                                            dtype=dtype, engine_args=dict(engine_args or {}),
                                            tag=tag)
                handled = compute_missing(missing, options, summary, phases=phases)
                if src is not None:  # computed straight into the destination
                    wanted = [i for i in wanted if i not in handled]
        if src is not None:
            if wanted is None or wanted:
                _copy(src, dst, wanted, summary, lora=lora, overwrite=overwrite, paths=paths,
                      progress=progress)
        elif wanted is None or wanted:
            _page_cache(dst, wanted, summary, lora=lora, paths=paths, progress=progress)
    summary.total_seconds = time.perf_counter() - t_start
    return summary


def _copy(src, dst, idents, summary, *, lora, overwrite, paths, progress) -> None:
    from ..connectors.warm import count_selected, promote

    with progress("Copying", count_selected(src, idents, lora), "entries") as tick:
        promote(src, dst, idents, summary, lora=lora, overwrite=overwrite, paths=paths,
                progress=tick)


def _page_cache(store, idents, summary, *, lora, paths, progress) -> None:
    from ..connectors.warm import count_selected, read_into_page_cache

    with progress("Reading into the page cache", count_selected(store, idents, lora),
                  "entries") as tick:
        read_into_page_cache(store, idents, summary, lora=lora, paths=paths, progress=tick)
