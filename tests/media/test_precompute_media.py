"""`encache precompute` over a hostile corpus: a decompression bomb, truncated,
mislabelled and empty files, non-media files and videos beside good images.

No engine here: the store is pre-filled under the served identifiers of the good files,
so the run stops after hashing (the engine-side half is test_media_engine.py). What it
shows: every bad file is that file's failure (exit 3, reported, the run goes on), files
that are not media are skipped and listed with a reason, media are found by content
(animated PNG, MPO, ICO, a video without a suffix), and a cron re-run over the unchanged
corpus reads nothing again -- not even the header of a file once found not to be media.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from encache.cli.app import app
from encache.connectors.store import encode, open_store
from media_files import BAD, NON_MEDIA, hostile_corpus, make_bomb, png_bytes

pytestmark = pytest.mark.slow
MODEL = "org/some-model"


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    return make_bomb(tmp_path_factory.mktemp("bomb") / "bomb.png")


@pytest.fixture
def corpus(tmp_path, bomb):
    root = tmp_path / "corpus"
    return root, hostile_corpus(root, bomb=bomb)


def fill(store_url, root, rels, model=MODEL):
    """A (fake but valid) entry under each good file's served identifier."""
    from encache.connectors.vllm.hashing import identify_file
    store = open_store(str(store_url))
    for rel in rels:
        ident = identify_file(root / rel, model).identifier
        arr = np.zeros((4, 8), np.float16)
        store.put(ident, encode(ident, arr.view(np.uint8), "F16", arr.shape, model=model))


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_hostile_files_are_per_file_failures_and_non_media_is_listed(tmp_path, corpus):
    root, info = corpus
    fill(tmp_path / "s", root, info["good"])
    r = run("precompute", root, "-m", MODEL, "-s", tmp_path / "s", "--json", "-q")
    assert r.exit_code == 3, r.output  # EXIT_PARTIAL: ran to the end, some files failed
    d = json.loads(r.stdout)
    assert {f["path"] for f in d["failures"]} == BAD
    errors = {f["path"]: f["error"] for f in d["failures"]}
    assert "decompression bomb" in errors["bomb.png"]
    assert "empty file" in errors["empty.png"] and "text" in errors["text.jpg"]
    assert errors["truncated.mp4"].startswith("not a readable video")
    assert all("\n" not in e and len(e) <= 300 for e in errors.values())
    # every good file -- images found by content, .apng/.mpo/.ico, videos -- is present
    assert d["present"] == len(info["good"]) and d["encoded"] == 0
    assert d["engine_started"] is False
    assert d["skipped_non_media"] == len(NON_MEDIA)
    assert {n["path"] for n in d["non_media"]} == NON_MEDIA
    assert all(n["reason"] for n in d["non_media"])
    assert d["failed"] == len(BAD) and d["hashed"] == len(info["good"]) + len(BAD)
    # the human summary names them, without a traceback
    r = run("precompute", root, "-m", MODEL, "-s", tmp_path / "s")
    assert r.exit_code == 3 and "Traceback" not in r.output
    assert "bomb.png" in r.stdout and "not media (skipped)" in r.stdout


def test_cron_rerun_reads_nothing_again(tmp_path, corpus):
    """Unchanged files are neither read nor sniffed: a non-media file whose bytes are
    swapped for an image (same size and mtime) stays skipped, a bad file stays failed."""
    root, info = corpus
    fill(tmp_path / "s", root, info["good"])
    first = json.loads(run("precompute", root, "-m", MODEL, "-s", tmp_path / "s",
                           "--json").stdout)
    victim = root / "notes.txt"
    image = png_bytes((8, 8))
    st = victim.stat()
    victim.write_bytes(image[:st.st_size].ljust(st.st_size, b"\0"))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = json.loads(run("precompute", root, "-m", MODEL, "-s", tmp_path / "s",
                            "--json").stdout)
    assert second["hashed"] == 0
    assert second["from_manifest"] == first["hashed"]
    assert second["skipped_non_media"] == len(NON_MEDIA)
    assert {f["path"] for f in second["failures"]} == BAD
    # a real change is noticed: the file becomes an image and is hashed (then missing)
    victim.write_bytes(png_bytes((9, 9)))
    third = json.loads(run("precompute", root, "-m", MODEL, "-s", tmp_path / "s",
                           "--json", "--dry-run").stdout)
    assert third["hashed"] == 1 and third["skipped_non_media"] == len(NON_MEDIA) - 1
    assert third["present"] == len(info["good"])  # the new image is not (dry run)


def test_unexpected_decoder_exception_is_one_files_failure(tmp_path, monkeypatch):
    """Whatever a decoder raises (here a RuntimeError from inside vLLM's image loader,
    for one file only) is that file's failure; the other files are still hashed."""
    from vllm.multimodal.media.image import ImageMediaIO

    root = tmp_path / "c"
    root.mkdir()
    for i in range(3):
        (root / f"img{i}.gif").write_bytes(png_bytes((10 + i, 10), fmt="GIF"))
    poison = (root / "img1.gif").read_bytes()
    real = ImageMediaIO.load_bytes

    def load_bytes(self, data):
        if data == poison:
            raise RuntimeError("decoder exploded\nsecond line")
        return real(self, data)

    monkeypatch.setattr(ImageMediaIO, "load_bytes", load_bytes)
    r = run("precompute", root, "-m", MODEL, "-s", tmp_path / "s", "--json", "--dry-run")
    assert r.exit_code == 3, r.output
    d = json.loads(r.stdout)
    assert [f["path"] for f in d["failures"]] == ["img1.gif"]
    assert d["failures"][0]["error"] == "not a readable image (decoder exploded second line)"
    assert d["hashed"] == 3


def test_a_single_hostile_file_as_corpus(tmp_path, bomb):
    r = run("precompute", bomb, "-m", MODEL, "-s", tmp_path / "s", "--json")
    assert r.exit_code == 3 and json.loads(r.stdout)["failed"] == 1
