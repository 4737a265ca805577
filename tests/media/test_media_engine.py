"""Hostile media through a real vLLM producer engine (the tiny LLaVA, in-process).

* ``precompute`` over a corpus with a decompression bomb, truncated, mislabelled, empty
  and non-media files beside good images and videos: the good images are encoded under
  their served identifiers; every other file is its own one-line failure or a listed
  skip. Files that turn bad *between hashing and encoding* (replaced by a bomb, cut
  short) fail one by one in the engine while the rest of their batch is encoded.
  Videos go to the engine as ``video_url`` items; the LLaVA family takes none, which is
  a per-item failure naming the architecture, never a crash.
* ``warm --compute-missing`` likewise.
"""

from __future__ import annotations

import json
import os

import pytest

from engine_support import PRECOMPUTE_KW, AfterHashing
from media_files import BAD, NON_MEDIA, hostile_corpus, make_bomb, png_bytes

pytestmark = pytest.mark.slow


def SwapAfterHashing(swaps: dict) -> AfterHashing:
    """A ``progress`` object that, once every file is hashed and before the engine reads
    any, replaces files: the engine then meets content the hasher never saw."""
    def swap():
        for path, data in swaps.items():
            path.write_bytes(data)
    return AfterHashing(swap)


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    return make_bomb(tmp_path_factory.mktemp("bomb") / "bomb.png")


def test_precompute_hostile_corpus_through_the_engine(tiny_model, tmp_path, bomb):
    from encache.jobs.precompute import PrecomputeOptions, precompute_corpus
    from encache.connectors.store import open_store
    from encache.connectors.vllm.hashing import identify_file

    root = tmp_path / "corpus"
    info = hostile_corpus(root, bomb=bomb)
    for i in range(3):  # more good images, two of which go bad after hashing
        (root / f"late{i}.png").write_bytes(png_bytes((30 + i, 20), (i * 60, 90, 30)))
    images = [g for g in info["good"] if g not in info["videos"]]
    idents = {g: identify_file(root / g, tiny_model).identifier for g in images}
    late_ok = identify_file(root / "late2.png", tiny_model).identifier
    swaps = {root / "late0.png": bomb.read_bytes(),  # a bomb with a PNG header
             root / "late1.png": png_bytes((50, 50))[:60]}  # cut short
    store_dir = tmp_path / "store"
    options = PrecomputeOptions(model=tiny_model, store=str(store_dir), batch=4, **PRECOMPUTE_KW)
    s = precompute_corpus(str(root), options, progress=SwapAfterHashing(swaps))
    errors = {f["path"]: f["error"] for f in s.failures}
    # hashing-phase failures, engine-phase failures, and videos LLaVA cannot take
    assert set(errors) == BAD | {"late0.png", "late1.png"} | set(info["videos"])
    assert "decompression bomb" in errors["bomb.png"]
    assert "DecompressionBomb" in errors["late0.png"] or "exceeds limit" in errors["late0.png"]
    assert errors["late1.png"]
    for v in info["videos"]:
        assert errors[v].startswith("LlavaForConditionalGeneration takes no video input")
    assert all("\n" not in e and len(e) <= 300 for e in errors.values())
    assert s.skipped_non_media == len(NON_MEDIA)
    assert {n["path"] for n in s.non_media} == NON_MEDIA
    # every good image is encoded under its served identifier -- the batches that
    # held a bad item included
    store = open_store(str(store_dir))
    held = set(store.identifiers())
    assert set(idents.values()) | {late_ok} == held
    assert s.encoded == len(held) and s.engine_started
    assert s.failed == len(errors)


def test_warm_compute_missing_with_hostile_images(tiny_model, tmp_path, bomb, monkeypatch):
    from collections import Counter

    import encache.connectors.vllm.hashing as hashing
    from cli_support import invoke
    from encache.connectors.store.disk.store import DiskStore
    from encache.connectors.vllm.hashing import identify_file

    hashed = Counter()

    def counting(path, *a, **kw):
        hashed[os.path.basename(path)] += 1
        return identify_file(path, *a, **kw)

    monkeypatch.setattr(hashing, "identify_file", counting)

    d = tmp_path / "imgs"
    d.mkdir()
    (d / "new.png").write_bytes(png_bytes((40, 30), (10, 200, 90)))
    (d / "fake.jpg").write_bytes(b"plain text, not a JPEG")
    (d / "empty.png").write_bytes(b"")
    DiskStore(tmp_path / "dst")
    args = ["--engine-arg", f"enforce_eager={json.dumps(True)}", "--engine-arg", "max_num_seqs=4",
            "--engine-arg", "max_num_batched_tokens=256", "--max-model-len", "256",
            "--dtype", "float32"]
    r = invoke("warm", d / "new.png", d / "fake.jpg", d / "empty.png", bomb, "-s",
               tmp_path / "dst", "-m", tiny_model, "--compute-missing", *args, "--json")
    assert r.exit_code == 3, r.output
    out = json.loads(r.stdout)
    assert out["computed"] == 1
    assert {f["path"].rsplit("/", 1)[-1] for f in out["failures"]} == {"fake.jpg", "empty.png",
                                                                      "bomb.png"}
    assert "Traceback" not in r.output
    assert hashed["new.png"] == 1, hashed  # warm's hash is precompute's: read once
    ident = identify_file(d / "new.png", tiny_model).identifier
    assert set(DiskStore(tmp_path / "dst").identifiers()) == {ident}
