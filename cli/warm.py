"""``encache warm``: get entries where serving engines read them fast.

Two jobs, one command:

* **Promote** (``--from DISK --store redis://…``): copy entries from a disk store into
  another store (typically the shared Redis) — all of them, one LoRA's (``--lora``), or
  those of given images or videos (``IMAGE…``, hashed with ``--model`` exactly as
  ``vllm serve`` hashes them; directories searched for media by content, other files
  skipped and listed) or identifiers (``--identifier``). Entries the destination already has
  are skipped (``--overwrite`` to rewrite them); every entry is verified on the way
  (header, size, checksum) and a corrupt one is reported, never copied.
  ``--compute-missing`` encodes the given images that neither store has with a real
  vLLM producer engine (``encache precompute`` for just those files) into the
  destination.
* **Page cache** (``--store DISK`` without ``--from``): read the chosen entry files of a
  disk store once so they sit in the OS page cache — after a reboot or a fresh volume
  mount — without marking them as recently used.

Progress goes to stderr (on a terminal); the summary to stdout (a table, or ``--json``
with raw bytes and seconds). Exit code 3 when some items failed (unreadable images,
corrupt or missing entries), 7 when a store is unreachable.

vLLM is imported only to hash IMAGE arguments or to compute missing entries.

The job's parts (selection, hashing, promote, page-cache read, :class:`WarmSummary`) are
library code in :mod:`encache.connectors.warm`; this module validates options, opens the
stores, draws progress and renders. ``--compute-missing`` still reuses precompute through
a temporary corpus directory (until precompute's job has a library API).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from encache.cli import errors
from encache.cli.options import JsonOpt, LoraOpt, ModelOpt, QuietOpt, StoreOpt, TagOpt

if TYPE_CHECKING:
    from encache.connectors.warm import WarmSummary

#: failures shown in the table (all of them are in --json)
SHOW_FAILURES = 20


# -- selection (the job: encache.connectors.warm) -------------------------------------

def hash_images(files: list[str], model: str, lora: str | None, summary: WarmSummary, *,
                engine_args: dict | None = None, quiet: bool = False) -> dict[str, str]:
    """``identifier -> path`` (first file wins); unreadable files become failures.
    Hashed as precompute does, with the server settings among ``engine_args``."""
    from encache.cli.precompute import hashing_settings
    from encache.cli.render import progress
    from encache.connectors.warm import hash_media

    media_io_kwargs, hash_algo = hashing_settings(engine_args)
    try:
        from encache.connectors.vllm.hashing import identify_file  # noqa: F401
    except ImportError as e:
        raise errors.EncacheError(
            f"hashing IMAGE arguments needs vLLM's hasher, which does not import: {e}",
            errors.EXIT_ENGINE, hint="install encache with the [cpu] or [gpu] extra") from None
    with progress("Hashing images", len(files), quiet=quiet, unit="images") as tick:
        return hash_media(files, model, lora, summary, hash_algo=hash_algo,
                          media_io_kwargs=media_io_kwargs, progress=tick)


# -- computing missing entries (producer engine) -------------------------------------

def compute_missing(missing: dict[str, str], model: str, store_url: str, summary: WarmSummary,
                    *, lora: str | None, lora_path: str | None, max_model_len: int | None,
                    dtype: str | None, engine_args: dict | None, quiet: bool,
                    tag: str | None = None) -> set[str]:
    """Encode ``missing`` (identifier -> image path) into ``store_url`` with
    ``encache precompute``'s job, run over a temporary directory of links to just those
    files. Returns the identifiers handled (computed or failed)."""
    from encache.cli.precompute import run_precompute
    from encache.cli.render import PhaseProgress, note

    if not os.environ.get("ENCACHE_DEBUG"):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's start-up chatter
    if not quiet:
        note(f"Encoding {len(missing)} missing item(s) with {model!r} (vLLM producer engine)")
    by_link: dict[str, tuple[str, str]] = {}  # link name -> (identifier, original path)
    with tempfile.TemporaryDirectory(prefix="encache-warm-") as tmp:
        for k, (ident, path) in enumerate(missing.items()):
            # the original suffix (or none): precompute tells images and videos by content
            name = f"{k:06d}{os.path.splitext(path)[1].lower()}"
            os.symlink(os.path.abspath(path), os.path.join(tmp, name))
            by_link[name] = (ident, path)
        with PhaseProgress(quiet) as prog:
            result = run_precompute(tmp, model, store_url, lora=lora, lora_path=lora_path,
                                    use_manifest=False, max_model_len=max_model_len,
                                    dtype=dtype, engine_args=engine_args, tag=tag,
                                    progress=prog)
        _drop_manifest(store_url, tmp, model, lora, engine_args)
    for f in result.failures:
        ident, path = by_link.get(f["path"], (None, f["path"]))
        summary.fail(ident, f["error"], path)
    summary.computed += result.encoded
    return set(missing)


def _drop_manifest(store_url: str, corpus: str, model: str, lora: str | None,
                   engine_args: dict | None) -> None:
    """precompute records a manifest for its (temporary) corpus; it is of no further use.
    Best effort, with precompute's own key."""
    with contextlib.suppress(Exception):
        from encache.cli.precompute import hashing_settings, manifest_key
        from encache.connectors.corpus import Manifest
        from encache.connectors.store import open_store

        media_io_kwargs, hash_algo = hashing_settings(engine_args)
        key = manifest_key(corpus, model, lora, hash_algo, None, media_io_kwargs)
        st = open_store(store_url, create=False)
        try:
            os.unlink(Manifest.location(st, key))
        finally:
            st.close()


# -- the two jobs (library: encache.connectors.warm), with a progress bar --------------

def copy_phase(src, dst, idents: list[str] | None, summary: WarmSummary, *, lora: str | None,
               overwrite: bool, paths: dict[str, str], quiet: bool) -> None:
    """Promote entries ``src`` -> ``dst`` (``idents=None``: all, optionally one LoRA)."""
    from encache.cli.render import progress
    from encache.connectors.warm import count_selected, promote

    total = count_selected(src, idents, lora)
    with progress("Copying", total, quiet=quiet) as tick:
        promote(src, dst, idents, summary, lora=lora, overwrite=overwrite, paths=paths,
                progress=tick)


def page_cache_phase(store, idents: list[str] | None, summary: WarmSummary, *,
                     lora: str | None, paths: dict[str, str], quiet: bool) -> None:
    """Read a disk store's entry files into the OS page cache."""
    from encache.cli.render import progress
    from encache.connectors.warm import count_selected, read_into_page_cache

    total = count_selected(store, idents, lora)
    with progress("Reading into the page cache", total, quiet=quiet) as tick:
        read_into_page_cache(store, idents, summary, lora=lora, paths=paths, progress=tick)


# -- rendering -----------------------------------------------------------------------

def render(summary: WarmSummary, as_json: bool, *, hint: str | None = None) -> None:
    from encache.cli.render import (emit, emit_json, human_bytes, human_duration,
                                    print_renderables, table)

    if as_json:
        emit_json(summary.to_dict())
        return
    rate = f"{human_bytes(summary.bytes_per_second)}/s" if summary.seconds > 0 else "-"
    if summary.mode == "copy":
        title = "warm: copy entries"
        rows = [("from", summary.source), ("to", summary.store)]
        if summary.lora:
            rows.append(("LoRA", summary.lora))
        if summary.requested is not None:
            rows.append(("requested", f"{summary.requested:,}"))
        rows += [("copied", f"{summary.copied:,}"),
                 ("already there (skipped)", f"{summary.skipped:,}")]
        if summary.computed:
            rows.append(("computed (engine)", f"{summary.computed:,}"))
        rows += [("failed", f"{summary.failed:,}"), ("bytes written", human_bytes(summary.bytes))]
        if summary.skipped_non_media:
            rows.append(("not media (skipped)", f"{summary.skipped_non_media:,}"))
    else:
        title = "warm: page cache"
        rows = [("store", summary.store)]
        if summary.lora:
            rows.append(("LoRA", summary.lora))
        if summary.requested is not None:
            rows.append(("requested", f"{summary.requested:,}"))
        rows.append(("entries read", f"{summary.entries:,}"))
        if summary.computed:
            rows.append(("computed (engine)", f"{summary.computed:,}"))
        rows += [("failed", f"{summary.failed:,}"), ("bytes read", human_bytes(summary.bytes))]
        if summary.skipped_non_media:
            rows.append(("not media (skipped)", f"{summary.skipped_non_media:,}"))
    rows += [("time", human_duration(summary.seconds)), ("throughput", rate)]
    if summary.hashed or summary.computed:
        rows.append(("total (with hashing/encoding)", human_duration(summary.total_seconds)))
    t = table(["", ("", {"overflow": "fold"})], rows, title=title)
    t.show_header = False
    items = [t]
    if summary.failures:
        shown = summary.failures[:SHOW_FAILURES]
        items.append(table([("Failed", {"overflow": "fold"}), ("File", {"overflow": "fold"}),
                            "Reason"],
                           [(f["identifier"] or "-", f["path"] or "-", f["reason"]) for f in shown]))
    print_renderables(*items)
    if summary.failed > SHOW_FAILURES:
        emit(f"… and {summary.failed - SHOW_FAILURES} more (see --json)")
    if hint:
        emit(hint)


# -- the command ---------------------------------------------------------------------

def _same_disk_store(a, b) -> bool:
    ra, rb = a.root, b.root
    if ra is None or rb is None:
        return False
    try:
        return os.path.samefile(ra, rb)
    except OSError:
        return ra == rb


def run_warm(store_url: str, *, source_url: str | None = None, images: list[str] | None = None,
             identifiers: list[str] | None = None, lora: str | None = None,
             model: str | None = None, compute: bool = False, overwrite: bool = False,
             lora_path: str | None = None, max_model_len: int | None = None,
             dtype: str | None = None, engine_args: dict | None = None,
             tag: str | None = None, quiet: bool = False) -> WarmSummary:
    """The warm job (no summary printed; progress on stderr unless ``quiet``)."""
    from encache.cli.common import display_url, opened, usage
    from encache.connectors.store.keys import InvalidIdentifier, validate
    from encache.connectors.store.url import is_redis_url
    from encache.connectors.warm import WarmSummary, expand_images

    images = list(images or [])
    identifiers = list(identifiers or [])
    # usage first: nothing is opened, hashed or started for a bad command line
    if source_url is not None and is_redis_url(source_url):
        raise usage(f"--from must be a disk store (a directory or file://PATH), "
                    f"not {display_url(source_url)}",
                    hint="warm promotes a disk store into --store")
    if source_url is None and is_redis_url(store_url):
        raise usage(f"without --from, warm reads a disk store into the page cache; "
                    f"{display_url(store_url)} is Redis",
                    hint="give --from DISK_STORE to promote entries into it")
    if images and not model:
        raise usage("IMAGE arguments need --model MODEL to compute their identifiers",
                    hint="the model id exactly as given to `vllm serve --model`")
    if compute and not images:
        raise usage("--compute-missing needs IMAGE arguments (the files to encode)")
    if lora and identifiers:
        raise usage("--lora selects entries by itself; with --identifier give full "
                    "identifiers (NAME:hash) instead")
    engine_opts = {"--lora-path": lora_path, "--max-model-len": max_model_len,
                   "--dtype": dtype, "--engine-arg": engine_args or None, "--tag": tag}
    stray = [k for k, v in engine_opts.items() if v is not None]
    if stray and not compute:
        raise usage(f"{', '.join(stray)} only apply with --compute-missing")
    if lora_path and not lora:
        raise usage("--lora-path needs --lora NAME")
    for ident in identifiers:
        try:
            validate(ident)
        except InvalidIdentifier as e:
            raise usage(f"bad --identifier {ident!r}: {e}") from None

    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        src = stack.enter_context(opened(source_url)) if source_url is not None else None
        dst = stack.enter_context(opened(store_url))
        if src is not None and _same_disk_store(src, dst):
            raise usage(f"--from and --store are the same store ({src.url})")
        dst.ping()  # a dead or misconfigured Redis fails here, before any hashing
        summary = WarmSummary(mode="copy" if src is not None else "page-cache",
                              store=display_url(store_url, dst),
                              source=display_url(source_url, src) if src is not None else None,
                              lora=lora)
        paths: dict[str, str] = {}  # identifier -> image path (for messages)
        explicit = bool(images or identifiers)
        if images:
            files = expand_images(images, summary)
            if not files:
                raise usage("no image or video files in the IMAGE arguments")
            paths = hash_images(files, model, lora, summary, engine_args=engine_args,
                                quiet=quiet)
            summary.hashed = len(files)
        wanted: list[str] | None = None
        if explicit:
            wanted = list(dict.fromkeys([*paths, *identifiers]))
            summary.requested = len(wanted)
        if compute and paths:
            from encache.cli.precompute import engine_encoder_config
            from encache.connectors.encoder_config import holds
            digest = engine_encoder_config(engine_args, tag)
            missing = {i: p for i, p in paths.items()  # no usable entry in either store
                       if not holds(dst, i, digest)
                       and not (src is not None and holds(src, i, digest))}
            if missing:
                handled = compute_missing(missing, model, store_url, summary, lora=lora,
                                          lora_path=lora_path, max_model_len=max_model_len,
                                          dtype=dtype, engine_args=engine_args, tag=tag,
                                          quiet=quiet)
                if src is not None:  # computed straight into the destination
                    wanted = [i for i in wanted if i not in handled]
        if src is not None:
            if wanted is None or wanted:
                copy_phase(src, dst, wanted, summary, lora=lora, overwrite=overwrite,
                           paths=paths, quiet=quiet)
        elif wanted is None or wanted:
            page_cache_phase(dst, wanted, summary, lora=lora, paths=paths, quiet=quiet)
    summary.total_seconds = time.perf_counter() - t_start
    return summary


def register(app: typer.Typer) -> None:
    @app.command("warm")
    def warm(
        store: StoreOpt,
        images: Annotated[Optional[list[Path]], typer.Argument(
            metavar="IMAGE", exists=True, readable=True, show_default=False,
            help="Only the entries of these images or videos (directories are searched "
                 "recursively, media found by content); needs --model.")] = None,
        source: Annotated[Optional[str], typer.Option(
            "--from", metavar="DISK_STORE",
            help="Copy entries from this disk store into --store (without it: read "
                 "--store's entry files into the OS page cache).")] = None,
        identifier: Annotated[Optional[list[str]], typer.Option(
            "--identifier", "-i", metavar="ID",
            help="Only this entry (repeatable).")] = None,
        lora: LoraOpt = None,
        model: ModelOpt = None,
        compute: Annotated[bool, typer.Option(
            "--compute-missing",
            help="Encode IMAGEs that no store has with a vLLM producer engine, into "
                 "--store (needs --model).")] = False,
        overwrite: Annotated[bool, typer.Option(
            "--overwrite", help="Rewrite entries --store already has.")] = False,
        lora_path: Annotated[Optional[str], typer.Option(
            "--lora-path", metavar="PATH",
            help="With --compute-missing: LoRA adapter to load in the producer.")] = None,
        max_model_len: Annotated[Optional[int], typer.Option(
            "--max-model-len", metavar="N",
            help="With --compute-missing: engine max_model_len.")] = None,
        dtype: Annotated[Optional[str], typer.Option(
            "--dtype", help="With --compute-missing: engine dtype.")] = None,
        engine_arg: Annotated[Optional[list[str]], typer.Option(
            "--engine-arg", metavar="KEY=VALUE",
            help="With --compute-missing: extra vllm.LLM argument (JSON value); "
                 "repeatable.")] = None,
        tag: TagOpt = None,
        quiet: QuietOpt = False,
        json_: JsonOpt = False,
    ) -> None:
        """Promote entries from a disk store into Redis (--from), or read a disk store
        into the OS page cache; all entries, --lora NAME, --identifier ID, or IMAGEs."""
        from encache.cli.precompute import _parse_engine_args
        from encache.connectors.store.transfer import TransferAborted

        engine_args = _parse_engine_args(engine_arg or []) if engine_arg else None
        try:
            summary = run_warm(
                store, source_url=source, images=[str(p) for p in images or []],
                identifiers=identifier, lora=lora, model=model, compute=compute,
                overwrite=overwrite, lora_path=lora_path, max_model_len=max_model_len,
                dtype=dtype, engine_args=engine_args, tag=tag, quiet=quiet or json_)
        except TransferAborted as e:
            partial = getattr(e, "summary", None)
            if partial is not None and (json_ or not quiet):
                render(partial, json_)
            raise
        hint = None
        if any(f["reason"] == "missing" and f["path"] for f in summary.failures) and not compute:
            hint = ("Some images have no entry in the source: add --compute-missing to "
                    "encode them.")
        if json_ or not quiet or summary.failed:
            render(summary, json_, hint=hint)
        raise typer.Exit(errors.EXIT_PARTIAL if summary.failed else errors.EXIT_OK)
