"""``encache hash FILE… --model M [--lora NAME]``: the identifier vLLM will use for each
image or video file when it is served, whether the store has it, and every input that
went into it.

This is the tool for "why does my consumer miss?": the identifier depends on the file's
bytes, the model id string *exactly* as given to ``vllm serve --model`` (a trailing slash
or a local path vs. a hub id makes a different hash), the hasher algorithm
(``--mm-hasher-algorithm``), the image io config (set when vLLM converts the image, e.g.
RGBA -> RGB), any ``--media-io-kwargs``, and the LoRA prefix (tower-connector LoRA).
A video's identifier also covers which frames the server samples (the model's video
processor picks the sampler; ``num_frames`` / ``fps`` change it): shown per file.
Files are told apart by content; one that cannot be read or decoded (or is a directory)
is that file's error, never the command's.

It imports vLLM (its own hasher is used, never a re-implementation), as ``precompute`` and
``warm`` do when they hash new files or start an engine; the other commands never do.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from encache.cli.options import JsonOpt, LoraOpt, OptionalStoreOpt, not_empty, parse_json

HASH_ALGOS = ("blake3", "sha256", "sha512")


def _json_dict(value: str | None, option: str, *, by_modality: bool = False) -> dict | None:
    """The JSON object ``option`` gives, checked here so a bad one is a usage error naming
    the option (not every file's error, nor a traceback). ``by_modality``: media io kwargs,
    ``{"image": {...}, "video": {...}}``, an object per modality."""
    if value is None:
        return None
    try:
        d = parse_json(value)
    except ValueError as e:
        raise typer.BadParameter(f"not JSON: {e}", param_hint=option) from None
    if not isinstance(d, dict):
        raise typer.BadParameter("expected a JSON object", param_hint=option)
    for modality, kwargs in d.items() if by_modality else ():
        if not isinstance(kwargs, dict):
            raise typer.BadParameter(
                f"the value of {modality!r} is not a JSON object (expected e.g. "
                '{"image": {...}, "video": {...}})', param_hint=option)
    return d


def _check_algo(value: str) -> str:
    if value not in HASH_ALGOS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(HASH_ALGOS)}")
    return value


def build_hashes(paths: list[str], model: str, *, lora: str | None, hash_algo: str,
                 media_io_kwargs: dict | None, mm_processor_kwargs: dict | None,
                 request_media_io_kwargs: dict | None = None, store=None) -> list[dict]:
    """One record per file: its identity (inputs included) and whether the store has it."""
    from encache.cli import errors

    def no_vllm(e: ImportError) -> errors.EncacheError:
        return errors.EncacheError(
            f"encache hash needs vLLM's hasher, which does not import ({e})",
            errors.EXIT_ENGINE, hint=errors.NO_VLLM_HINT)

    try:
        from encache.connectors.vllm.hashing import identify_file
    except ImportError as e:
        raise no_vllm(e) from None
    out = []
    for path in paths:
        rec: dict = {"path": path}
        try:
            ident = identify_file(path, model, lora=lora, hash_algo=hash_algo,
                                  media_io_kwargs=media_io_kwargs,
                                  request_media_io_kwargs=request_media_io_kwargs,
                                  mm_processor_kwargs=mm_processor_kwargs)
        except ImportError as e:  # vLLM is imported on first use
            raise no_vllm(e) from None
        except Exception as e:  # MediaError (any decoding error), OSError: this file's
            rec["error"] = " ".join(str(e).split())[:300] or type(e).__name__
            out.append(rec)
            continue
        rec.update(ident.to_dict())
        rec["path"] = path
        rec["error"] = None
        rec["in_store"] = None
        rec["stored"] = None
        if store is not None:
            info = store.stat(ident.identifier)
            rec["in_store"] = info is not None
            if info is not None:
                m = info.meta
                rec["stored"] = {
                    "size": info.size, "created": info.created, "error": info.error,
                    "model": m.model if m else None, "hash_algo": m.hash_algo if m else None,
                    "legacy": bool(m is not None and m.legacy),
                }
        out.append(rec)
    return out


def _presence(rec: dict) -> str:
    if rec.get("in_store") is None:
        return "?"
    if not rec["in_store"]:
        return "no"
    st = rec["stored"]
    if st["error"]:
        return f"yes, unreadable ({st['error']})"
    notes = []
    if st["model"] and st["model"] != rec["model"]:
        notes.append(f"made for {st['model']!r}")
    if st["hash_algo"] and st["hash_algo"] != rec["hash_algo"]:
        notes.append(f"hashed with {st['hash_algo']}")
    return "yes" + (f" ({'; '.join(notes)})" if notes else "")


def describe_media(rec: dict) -> str:
    """One cell: an image's size and mode; for a video also what the server samples and
    what the hasher digests (file bytes or decoded frames, plus the sampling metadata)."""
    size = f"{rec.get('width')}×{rec.get('height')}"
    fmt = rec.get("format") or ""
    if rec.get("kind") != "video" or not rec.get("video"):
        return f"image {fmt} {size} {rec.get('mode') or ''}".replace("  ", " ").strip()
    v = rec["video"]
    idx = v.get("frames_indices") or []
    shown = ",".join(map(str, idx[:8])) + (",…" if len(idx) > 8 else "")
    fps = v.get("source_fps")
    return (f"video {fmt} {size}: {v['frames']} of {v.get('total_num_frames')} frames "
            f"[{shown}] at {fps:g} fps, sampler {v.get('loader')}"
            f"{' (' + v['video_processor'] + ')' if v.get('video_processor') else ''}; "
            f"hashed: {v.get('hashed_content')} + sampling metadata")


def render_table(records: list[dict], *, model: str, lora: str | None, hash_algo: str,
                 media_io_kwargs: dict | None, mm_processor_kwargs: dict | None,
                 store_url: str | None, request_media_io_kwargs: dict | None = None) -> None:
    from encache.cli.render import emit, print_renderables, table
    from encache.connectors.store.units import human_bytes

    inputs = [
        ("Model id", repr(model) + "  (hashed exactly as given to `vllm serve --model`)"),
        ("Algorithm", hash_algo + "  (`--mm-hasher-algorithm`)"),
        ("LoRA", f"{lora}  (identifier prefix `{lora}:`)" if lora else "-"),
    ]
    if media_io_kwargs:
        inputs.append(("Server media io kwargs", json.dumps(media_io_kwargs, sort_keys=True)
                       + "  (hashed)"))
    if request_media_io_kwargs:
        inputs.append(("Request media io kwargs",
                       json.dumps(request_media_io_kwargs, sort_keys=True) + "  (hashed)"))
    if mm_processor_kwargs:
        inputs.append(("Request processor kwargs",
                       json.dumps(mm_processor_kwargs, sort_keys=True) + "  (hashed)"))
    inputs.append(("Store", store_url or "-  (give --store to check presence)"))
    head = table(["", ""], inputs, title="Inputs")
    head.show_header = False
    rows = []
    for r in records:
        if r.get("error"):
            rows.append((r["path"], f"error: {r['error']}", "-", "-", "-"))
            continue
        io = json.dumps(r["io_config"], sort_keys=True) if r.get("io_config") else "-"
        rows.append((r["path"], r["identifier"], _presence(r),
                     f"{describe_media(r)}, {human_bytes(r['size'])}", io))
    body = table([("File", {"overflow": "fold"}), ("Identifier", {"overflow": "fold"}),
                  "In store", ("Media", {"overflow": "fold"}), "io_config"], rows)
    print_renderables(head, body)
    missing = sum(1 for r in records if r.get("in_store") is False)
    if missing and store_url:
        emit(f"{missing} of {len(records)} not in the store: check the model id string, "
             "the algorithm and the LoRA against what the server was started with.")


def register(app: typer.Typer) -> None:
    @app.command("hash")
    def hash_images(
        images: Annotated[list[Path], typer.Argument(
            metavar="FILE...",  # no exists=True: a missing file is its own error, not all's
            help="Image or video files, as they will be sent to the server "
                 "(image_url / video_url; told apart by content).")],
        model: Annotated[str, typer.Option(
            "--model", "-m", metavar="MODEL", callback=not_empty,
            help="Model id exactly as given to `vllm serve --model`.")],
        lora: LoraOpt = None,
        store: OptionalStoreOpt = None,
        hash_algo: Annotated[str, typer.Option(
            "--hash-algo", metavar="ALGO", callback=_check_algo,
            help="vLLM's --mm-hasher-algorithm: blake3 (default), sha256, sha512.")] = "blake3",
        media_io_kwargs: Annotated[Optional[str], typer.Option(
            "--media-io-kwargs", metavar="JSON",
            help="The server's --media-io-kwargs, e.g. '{\"image\": {...}}' (how images "
                 "load; hashed).")] = None,
        request_media_io_kwargs: Annotated[Optional[str], typer.Option(
            "--request-media-io-kwargs", metavar="JSON",
            help="A request's own media_io_kwargs field (merged over the server's; "
                 "hashed).")] = None,
        mm_processor_kwargs: Annotated[Optional[str], typer.Option(
            "--mm-processor-kwargs", metavar="JSON",
            help="A request's own mm_processor_kwargs field (hashed). The server's "
                 "--mm-processor-kwargs do not change identifiers.")] = None,
        json_: JsonOpt = False,
    ) -> None:
        """Show the identifier vLLM uses for each image or video, whether the store has
        it, and the inputs that went into it (model id string, algorithm, io config, LoRA;
        for videos the frames sampled, fps and sampler)."""
        from encache.cli import errors
        from encache.cli.common import display_url, opened
        from encache.cli.render import emit_json, progress

        mio = _json_dict(media_io_kwargs, "--media-io-kwargs", by_modality=True)
        rmio = _json_dict(request_media_io_kwargs, "--request-media-io-kwargs",
                          by_modality=True)
        mpk = _json_dict(mm_processor_kwargs, "--mm-processor-kwargs")
        paths = [str(p) for p in images]
        with contextlib.ExitStack() as stack:
            st = stack.enter_context(opened(store)) if store else None
            url = display_url(store, st) if st is not None else None
            with progress("Loading vLLM's hasher", quiet=json_):
                records = build_hashes(paths, model, lora=lora, hash_algo=hash_algo,
                                       media_io_kwargs=mio, mm_processor_kwargs=mpk,
                                       request_media_io_kwargs=rmio, store=st)
        if json_:
            emit_json({"store": url, "model": model, "lora": lora, "hash_algo": hash_algo,
                       "media_io_kwargs": mio, "request_media_io_kwargs": rmio,
                       "mm_processor_kwargs": mpk, "files": records})
        else:
            render_table(records, model=model, lora=lora, hash_algo=hash_algo,
                         media_io_kwargs=mio, mm_processor_kwargs=mpk, store_url=url,
                         request_media_io_kwargs=rmio)
        failed = sum(1 for r in records if r.get("error"))
        if failed:
            from encache.cli.render import note

            for r in records:  # each line names its file (once: "cannot read PATH: …")
                if r.get("error"):
                    err, path = r["error"], r["path"]
                    note(f"Error: {err}" if f" {path}:" in f" {err}" else f"Error: {path}: {err}")
            raise typer.Exit(errors.EXIT_USAGE if failed == len(records) else errors.EXIT_PARTIAL)
