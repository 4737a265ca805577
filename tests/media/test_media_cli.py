"""`encache hash` and `encache warm` over hostile files and videos: one bad file is that
file's error (exit 3 when others succeed), never the command's; videos are explained.
"""

from __future__ import annotations

import json

import pytest

from encache.cli import errors
from encache.connectors.store.disk.store import DiskStore
from media_files import BAD, NON_MEDIA, hostile_corpus, make_bomb, make_video
from cli_support import invoke
from entries import put_entry

pytestmark = pytest.mark.slow
MODEL = "org/some-vlm"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    bomb = make_bomb(d / "the-bomb.png")
    root = d / "corpus"
    return root, hostile_corpus(root, bomb=bomb)


def hashes(*args):
    r = invoke("hash", *args, "--json")
    return r, json.loads(r.stdout) if r.stdout else None


def test_hash_hostile_files_are_per_file_errors(hostile):
    root, info = hostile
    files = [root / "red.png", *(root / b for b in sorted(BAD)), root / "album.png",
             root / "notes.txt"]
    r, d = hashes(*files, "-m", MODEL)
    assert r.exit_code == errors.EXIT_PARTIAL, r.output
    recs = {rec["path"].rsplit("/", 1)[-1]: rec for rec in d["files"]}
    assert recs["red.png"]["error"] is None and len(recs["red.png"]["identifier"]) == 64
    for name in [*BAD, "album.png", "notes.txt"]:
        assert recs[name]["error"], name
        assert "\n" not in recs[name]["error"]
    assert "decompression bomb" in recs["bomb.png"]["error"]
    assert "directory" in recs["album.png"]["error"]
    # only bad files: usage exit, still one line each and no traceback
    r = invoke("hash", root / "bomb.png", root / "truncated.jpg", "-m", MODEL)
    assert r.exit_code == errors.EXIT_USAGE and "Traceback" not in r.output
    assert "decompression bomb" in r.output


def test_hash_finds_media_by_content(hostile):
    root, info = hostile
    r, d = hashes(*(root / g for g in info["good"]), "-m", MODEL)
    assert r.exit_code == 0, r.output
    kinds = {rec["path"].split("corpus/", 1)[1]: rec["kind"] for rec in d["files"]}
    assert {k for k, v in kinds.items() if v == "video"} == set(info["videos"])
    fmts = {rec["path"].rsplit("/", 1)[-1]: rec["format"] for rec in d["files"]}
    assert fmts["really_a_jpeg.png"] == "JPEG" and fmts["anim.apng"] == "PNG"
    assert fmts["stereo.mpo"] == "MPO" and fmts["favicon.ico"] == "ICO"


def test_hash_explains_a_video_identifier(tmp_path):
    clip = make_video(tmp_path / "clip.mp4", frames=24, fps=8.0)
    r, d = hashes(clip, "-m", MODEL)
    assert r.exit_code == 0, r.output
    v = d["files"][0]
    assert v["kind"] == "video" and v["format"] == "mp4" and v["io_config"] is None
    assert v["video"]["frames"] == 24 and v["video"]["source_fps"] == 8.0
    assert v["video"]["loader"] == "opencv"
    r2, d2 = hashes(clip, "-m", MODEL, "--media-io-kwargs", '{"video": {"num_frames": 4}}')
    v2 = d2["files"][0]
    assert v2["video"]["frames"] == 4 and v2["identifier"] != v["identifier"]
    assert v2["hash_factors"] == {"media_io_kwargs": {"video": {"num_frames": 4}}}
    r3 = invoke("hash", clip, "-m", MODEL, env={"COLUMNS": "250"})
    assert r3.exit_code == 0
    assert "video mp4 64×48: 24 of 24 frames" in r3.stdout and "sampler opencv" in r3.stdout
    assert v["identifier"] in r3.stdout


def test_hash_video_presence_in_store(tmp_path):
    clip = make_video(tmp_path / "clip.webm", fourcc="VP80")
    s = DiskStore(tmp_path / "s")
    _, d = hashes(clip, "-m", MODEL, "-s", s.root)
    assert d["files"][0]["in_store"] is False
    put_entry(s, d["files"][0]["identifier"], model=MODEL)
    _, d = hashes(clip, "-m", MODEL, "-s", s.root)
    assert d["files"][0]["in_store"] is True


def test_warm_directory_with_hostile_files(hostile, tmp_path):
    """warm DIR: good images and videos copied, bad files failures with their path,
    non-media listed as skipped; exit 3."""
    from encache.connectors.vllm.hashing import identify_file
    root, info = hostile
    src = DiskStore(tmp_path / "src")
    DiskStore(tmp_path / "dst")
    good = {identify_file(root / g, MODEL).identifier for g in info["good"]}
    for ident in good:
        put_entry(src, ident, model=MODEL)
    r = invoke("warm", root, "--from", src.root, "-s", tmp_path / "dst", "-m", MODEL, "--json")
    assert r.exit_code == errors.EXIT_PARTIAL, r.output
    d = json.loads(r.stdout)
    assert d["copied"] == len(good)
    assert set(DiskStore(tmp_path / "dst").identifiers()) == good
    failed = {f["path"].rsplit("/", 1)[-1] for f in d["failures"]}
    assert failed == BAD
    assert all(f["identifier"] is None for f in d["failures"])
    assert d["skipped_non_media"] == len(NON_MEDIA)
    assert {n["path"].rsplit("/", 1)[-1] for n in d["non_media"]} == NON_MEDIA
    r = invoke("warm", root, "--from", src.root, "-s", tmp_path / "dst", "-m", MODEL)
    assert r.exit_code == errors.EXIT_PARTIAL and "Traceback" not in r.output
    assert "not media (skipped)" in r.stdout


def test_warm_only_non_media_is_a_usage_error(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    (d / "a.txt").write_text("text")
    DiskStore(tmp_path / "src")
    DiskStore(tmp_path / "dst")
    r = invoke("warm", d, "--from", tmp_path / "src", "-s", tmp_path / "dst", "-m", MODEL)
    assert r.exit_code == errors.EXIT_USAGE and "no image or video files" in r.output
