"""Media corpora: walking them, and the manifest that makes cron refreshes cheap.

:func:`walk` lists every regular (non-hidden) file; what is media is decided by content
(:mod:`encache.connectors.media`), but lazily: a file whose suffix claims a media kind is
handed to the hasher directly (which checks the content anyway), and only files with
another suffix are sniffed -- a few header bytes -- by :func:`non_media_reason`, and only
when the manifest does not already know them.

The manifest maps each corpus file ``(relative path, size, mtime_ns)`` to the identifier
it hashed to. A re-run over an unchanged corpus therefore stats files but never reads,
decodes or hashes them (and never imports vLLM): 10,000 images refresh in well under a
second. A file whose size or mtime changed is hashed again. The manifest is keyed by
everything the identifier depends on (corpus root, model id string, LoRA, hash algorithm),
so a different model never reuses another model's identifiers.

Manifests live in the store's bookkeeping directory for a disk store
(``{root}/.encache/manifests/``), else under ``$XDG_CACHE_HOME/encache/manifests/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..connectors.media import sniff, suffix_kind
from ..connectors.store.files import atomic_write_json

MANIFEST_VERSION = 1


@dataclass(frozen=True)
class CorpusFile:
    path: str  # absolute
    rel: str  # relative to the corpus root (manifest key)
    size: int
    mtime_ns: int

    @property
    def claimed(self) -> str | None:
        """The media kind its suffix claims ("image", "video") or None: sniff it."""
        return suffix_kind(self.rel)


def non_media_reason(f: CorpusFile | str) -> str | None:
    """None when ``f`` is to be hashed as media (its suffix claims a kind, or its first
    bytes are an image or video), else why it is not media. Reads a header at most."""
    path = f if isinstance(f, str) else f.path
    if suffix_kind(path) is not None:
        return None
    found = sniff(path)
    return None if found else found.reason


def walk(root: str | os.PathLike) -> list[CorpusFile]:
    """Every regular file under ``root`` (recursive, sorted, symlinked files followed;
    names starting with "." skipped). Nothing is opened: see :func:`non_media_reason`.

    A single file may be given instead of a directory.
    """
    root = os.path.abspath(os.fspath(root))
    if os.path.isfile(root):
        st = os.stat(root)
        return [CorpusFile(root, os.path.basename(root), st.st_size, st.st_mtime_ns)]
    out: list[CorpusFile] = []
    cut = len(root.rstrip(os.sep)) + 1  # relative path by slicing: os.path.relpath is slow
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                if e.name.startswith("."):
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                    continue
                try:
                    st = e.stat()
                except OSError:  # dangling symlink
                    continue
                if stat.S_ISREG(st.st_mode):  # not a FIFO, socket, device, linked dir
                    out.append(CorpusFile(e.path, e.path[cut:], st.st_size, st.st_mtime_ns))
    out.sort(key=lambda f: f.rel)
    return out


class Manifest:
    """``rel -> (size, mtime_ns, identifier)`` for one corpus/model/LoRA/algorithm."""

    def __init__(self, path: Path, key: dict):
        self.path = path
        self.key = key
        self.files: dict[str, list] = {}
        self.dirty = False
        #: the file is a newer encache's (a later ``version``): read as empty, never
        #: overwritten by this one (docs/upgrading.md)
        self.newer = False

    @classmethod
    def location(cls, store, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        root = store.root
        if root is not None:
            base = Path(root) / ".encache" / "manifests"
        else:
            cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
            safe = hashlib.sha256(store.url.encode()).hexdigest()[:12]
            base = Path(cache) / "encache" / "manifests" / safe
        return base / f"{digest}.json"

    @classmethod
    def load(cls, path: Path, key: dict) -> Manifest:
        m = cls(path, key)
        try:
            data = json.loads(path.read_text())
            version = data.get("version")
            if version == MANIFEST_VERSION and data.get("key") == key:
                m.files = data.get("files", {})
            elif type(version) is int and version > MANIFEST_VERSION:
                m.newer = True
        except (FileNotFoundError, json.JSONDecodeError, AttributeError):
            pass
        return m

    def lookup(self, f: CorpusFile) -> str | None:
        rec = self.files.get(f.rel)
        if rec and rec[0] == f.size and rec[1] == f.mtime_ns:
            return rec[2]
        return None

    def record(self, f: CorpusFile, identifier: str) -> None:
        self.files[f.rel] = [f.size, f.mtime_ns, identifier]
        self.dirty = True

    def drop(self, rel: str) -> None:
        if self.files.pop(rel, None) is not None:
            self.dirty = True

    def save(self) -> None:
        if not self.dirty or self.newer:
            return
        atomic_write_json(self.path, {"version": MANIFEST_VERSION, "key": self.key,
                                      "files": self.files})
        self.dirty = False
