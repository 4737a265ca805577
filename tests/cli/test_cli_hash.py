"""`encache hash`: identifiers vLLM will use, presence in the store, and their inputs.

Imports vLLM (its hasher); the first test pays the import (~10 s).
"""

from __future__ import annotations

import json

import pytest

from encache.cli import errors
from encache.connectors.store.disk.store import DiskStore
from cli_support import invoke
from entries import put_entry

pytestmark = pytest.mark.slow
MODEL = "org/some-vlm"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    from PIL import Image
    d = tmp_path_factory.mktemp("img")
    Image.new("RGB", (32, 24), (200, 10, 10)).save(d / "red.png")
    Image.new("RGBA", (16, 16), (0, 0, 255, 128)).save(d / "blue.png")
    (d / "notes.jpg").write_bytes(b"not an image")
    return d


def hashes(*args):
    r = invoke("hash", *args, "--json")
    return r, json.loads(r.stdout) if r.stdout else None


def test_identifier_and_inputs(images):
    r, d = hashes(images / "red.png", images / "blue.png", "-m", MODEL)
    assert r.exit_code == 0, r.output
    assert d["model"] == MODEL and d["hash_algo"] == "blake3" and d["store"] is None
    red, blue = d["files"]
    assert len(red["identifier"]) == 64 and int(red["identifier"], 16) >= 0
    assert red["identifier"] == red["base_hash"] and red["lora"] is None
    assert red["in_store"] is None  # no store given
    assert (red["width"], red["height"], red["mode"]) == (32, 24, "RGB")
    assert red["io_config"] is None
    assert blue["mode"] == "RGBA" and blue["io_config"]  # vLLM converts RGBA -> RGB
    assert red["identifier"] != blue["identifier"]


def test_model_string_and_algorithm_change_the_identifier(images):
    base = hashes(images / "red.png", "-m", MODEL)[1]["files"][0]["identifier"]
    slash = hashes(images / "red.png", "-m", MODEL + "/")[1]["files"][0]["identifier"]
    sha = hashes(images / "red.png", "-m", MODEL, "--hash-algo", "sha256")[1]["files"][0]
    assert len({base, slash, sha["identifier"]}) == 3 and sha["hash_algo"] == "sha256"


def test_lora_prefix(images):
    _, d = hashes(images / "red.png", "-m", MODEL)
    _, dl = hashes(images / "red.png", "-m", MODEL, "--lora", "ad1")
    f = dl["files"][0]
    assert f["identifier"] == "ad1:" + d["files"][0]["identifier"] and f["lora"] == "ad1"


def test_presence_in_store(images, tmp_path):
    s = DiskStore(tmp_path / "s")
    _, d = hashes(images / "red.png", images / "blue.png", "-m", MODEL, "-s", s.root)
    red, blue = d["files"]
    assert red["in_store"] is False and blue["in_store"] is False
    put_entry(s, red["identifier"], model=MODEL)
    put_entry(s, blue["identifier"], model="another/model")
    _, d = hashes(images / "red.png", images / "blue.png", "-m", MODEL, "-s", s.root)
    red, blue = d["files"]
    assert red["in_store"] is True and red["stored"]["model"] == MODEL
    assert blue["in_store"] is True and blue["stored"]["model"] == "another/model"
    r = invoke("hash", images / "red.png", images / "blue.png", "-m", MODEL, "-s", s.root)
    assert r.exit_code == 0
    assert "made for 'another/model'" in r.stdout and repr(MODEL) in r.stdout


def test_bad_files(images, tmp_path):
    r, d = hashes(images / "notes.jpg", "-m", MODEL)
    assert r.exit_code == errors.EXIT_USAGE and d["files"][0]["error"]
    r, d = hashes(images / "red.png", images / "notes.jpg", "-m", MODEL)
    assert r.exit_code == errors.EXIT_PARTIAL
    assert d["files"][0]["error"] is None and d["files"][1]["error"]
    assert invoke("hash", tmp_path / "missing.png", "-m", MODEL).exit_code == errors.EXIT_USAGE
    assert invoke("hash", images / "red.png").exit_code == errors.EXIT_USAGE  # no --model
    r = invoke("hash", images / "red.png", "-m", MODEL, "--hash-algo", "md5")
    assert r.exit_code == errors.EXIT_USAGE
    r = invoke("hash", images / "red.png", "-m", MODEL, "--media-io-kwargs", "{nope")
    assert r.exit_code == errors.EXIT_USAGE


def test_server_and_request_media_io_kwargs_are_merged_and_hashed(images):
    """As the OpenAI server does (measured): the server's --media-io-kwargs are a hash
    factor even for an RGB image, and a request's own merge over them."""
    bg = {"image": {"rgba_background_color": [0, 0, 0]}}
    def files(*args):
        r, d = hashes(images / "red.png", "-m", MODEL, *args)
        assert r.exit_code == 0, r.output
        return d["files"][0]
    plain = files()["identifier"]
    server = files("--media-io-kwargs", json.dumps(bg))
    assert server["identifier"] != plain and server["hash_factors"] == {"media_io_kwargs": bg}
    both = files("--media-io-kwargs", json.dumps(bg), "--request-media-io-kwargs",
                 '{"image": {"extra": 1}}')
    assert both["hash_factors"] == {"media_io_kwargs": {"image": {
        "rgba_background_color": [0, 0, 0], "extra": 1}}}
    assert files("--request-media-io-kwargs", json.dumps(bg))["identifier"] == \
        server["identifier"]


def test_media_io_kwargs_are_inputs(images):
    _, plain = hashes(images / "blue.png", "-m", MODEL)
    _, bg = hashes(images / "blue.png", "-m", MODEL, "--media-io-kwargs",
                   '{"image": {"rgba_background_color": [0, 0, 0]}}')
    assert bg["media_io_kwargs"] == {"image": {"rgba_background_color": [0, 0, 0]}}
    assert bg["files"][0]["identifier"] != plain["files"][0]["identifier"]


def test_without_vllm_exit_code(images, tmp_path):
    """A machine without a working vLLM: exit 8 and one line, not a traceback."""
    import os
    import subprocess
    import sys
    fake = tmp_path / "site"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("raise ImportError('simulated: vLLM missing')\n")
    p = subprocess.run([sys.executable, "-m", "encache.cli", "hash", str(images / "red.png"),
                        "-m", MODEL], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(fake), "ENCACHE_DEBUG": ""})
    assert p.returncode == errors.EXIT_ENGINE, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1 and "vLLM" in lines[0] and "Traceback" not in p.stderr
