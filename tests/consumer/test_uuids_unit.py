"""Client uuids in their own namespace (encache.connectors.vllm.uuids): the mapping, which
engines it applies to, and the hashes vLLM computes again from a mapped uuid."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from encache.connectors.vllm import transfer_config, uuids

HEX64 = "0123456789abcdef" * 4


def _config(role="ec_producer", **extra):
    return SimpleNamespace(ec_transfer_config=SimpleNamespace(
        **transfer_config("/tmp/store", role, extra or None)))


def test_a_uuid_maps_to_one_identifier_everywhere_that_is_never_a_content_hash():
    mapped = uuids.uuid_identifier("doc-7/page 3")
    assert mapped.startswith("uuid=") and ":" not in mapped and len(mapped) == 69
    assert not uuids.is_content_hash(mapped) and uuids.in_namespace(mapped)
    from encache.connectors.store.keys import is_verbatim
    assert is_verbatim(mapped)  # its own file name in a disk store
    there = subprocess.run(
        [sys.executable, "-c", "from encache.connectors.vllm.uuids import uuid_identifier;"
                               "print(uuid_identifier('doc-7/page 3'))"],
        check=True, capture_output=True, text=True).stdout.strip()
    assert there == mapped  # the same on every server
    # a content hash given as a uuid is mapped like any uuid; an identifier already in
    # the namespace (the encoder's reported key, handed back by a proxy) maps to itself
    assert uuids.uuid_identifier(HEX64) != HEX64
    assert uuids.uuid_identifier(mapped) == mapped
    assert uuids.uuid_identifier("uuid=not-hex").startswith("uuid=")
    assert uuids.uuid_identifier("uuid=not-hex") != "uuid=not-hex"


@pytest.mark.parametrize("identifier,content", [
    (HEX64, True), ("lora-a:" + HEX64, True), (HEX64 * 2, True),
    ("uuid=" + HEX64, False), ("lora-a:uuid=" + HEX64, False),
    ("renderer0-mm-1-image-0", False), (HEX64[:-1], False), (HEX64.upper(), False)])
def test_content_hashes_are_hex_digests_with_or_without_a_lora_prefix(identifier, content):
    assert uuids.is_content_hash(identifier) is content


def test_only_engines_with_an_encache_connector_that_is_not_content_keyed_map_uuids():
    assert uuids.namespaces(_config().ec_transfer_config)
    assert uuids.namespaces(_config("ec_consumer").ec_transfer_config)
    assert not uuids.namespaces(_config(content_keyed=True).ec_transfer_config)
    assert not uuids.namespaces(None)
    other = SimpleNamespace(ec_connector="ECExampleConnector", ec_connector_module_path=None,
                            ec_connector_extra_config={})
    assert not uuids.namespaces(other)
    alias = SimpleNamespace(ec_connector="EncacheRedis", ec_connector_module_path=None,
                            ec_connector_extra_config={"store": "redis://x"})
    assert uuids.namespaces(alias)
    assert uuids.patch_target() is not None  # this vLLM has the functions the patch wraps
    uuids.install()  # (what vLLM's loading of the general plugin does in each process)
    uuids.install()  # once
    assert uuids.installed()
    assert uuids.applies(_config()) and uuids.content_keying(_config())
    assert not uuids.applies(SimpleNamespace(ec_transfer_config=None))


def test_where_the_patch_is_not_in_place_nothing_is_claimed(monkeypatch, caplog):
    """A process where vLLM did not run the plugin (``VLLM_PLUGINS`` leaves it out), or a
    vLLM without the functions it wraps: the worker stamps nothing ``keyed_by: content``
    and says why in one line."""
    monkeypatch.setattr(uuids, "installed", lambda: False)
    with caplog.at_level("WARNING", logger="encache.connector"):
        assert not uuids.applies(_config()) and not uuids.content_keying(_config())
    assert [r for r in caplog.records if "did not load encache's general plugin" in r.getMessage()]
    monkeypatch.setattr(uuids, "patch_target", lambda: None)
    caplog.clear()
    with caplog.at_level("WARNING", logger="encache.connector"):
        assert not uuids.content_keying(_config())
    assert [r for r in caplog.records if "namespace client uuids in" in r.getMessage()]


def test_the_request_uuids_are_mapped_and_what_vllm_hashed_again_stays_in_the_namespace():
    given = {"image": ["mine", None], "video": "clip"}
    mapped = uuids._mapped(given)
    assert mapped == {"image": [uuids.uuid_identifier("mine"), None],
                      "video": uuids.uuid_identifier("clip")}
    # hash factors: vLLM hashed the mapped uuid again (hex); the item without one is content
    hashes = {"image": [HEX64, "f" * 64], "video": [uuids.uuid_identifier("clip")]}
    assert uuids._kept_in_namespace(hashes, mapped) == {
        "image": ["uuid=" + HEX64, "f" * 64], "video": [uuids.uuid_identifier("clip")]}
    # modalities that do not line up (a model's unified modality): every hash goes in
    assert uuids._kept_in_namespace({"vision_chunk": [HEX64, "f" * 64]},
                                    {"image": [uuids.uuid_identifier("mine")]}) == {
        "vision_chunk": ["uuid=" + HEX64, "uuid=" + "f" * 64]}
    # uuids the patch did not map (an engine it does not act for): left as they are
    assert uuids._kept_in_namespace({"image": [HEX64]}, {"image": [HEX64]}) == {"image": [HEX64]}



def _processor(fields):
    parser = SimpleNamespace(placeholder_metadata_fields=lambda m: set(fields))
    return SimpleNamespace(info=SimpleNamespace(data_parser=parser))


def test_hex_uuids_on_items_with_data_of_models_without_placeholder_metadata_key_by_bytes(
        monkeypatch):
    """What vLLM's EPD proxy (default mode) does to a LLaVA / Gemma 3 item -- sha256 of its
    URL as the encoder's uuid, the raw item without it to PD -- keys alike on both: the
    hex uuid is left out where the item carries its data, and a later uuid-only
    reference to it gets the hash vLLM gave it. Grid models (PD gets the uuid), other
    uuids and embeddings keep their uuids."""
    monkeypatch.setattr(uuids, "_ALIASES", type(uuids._ALIASES)())
    image, hex2 = object(), "ab" * 32
    given = {"image": [HEX64, "doc-7", None, hex2]}
    data = {"image": [image, image, image, None]}
    out, left = uuids._keyed_by_content(given, data, _processor(()))
    assert out == {"image": [None, "doc-7", None, hex2]}  # (hex2: no data, not known yet)
    assert left == [("image", 0, HEX64)]
    uuids._remember(left, {"image": ["c" * 64, "d", "e", "f"]})
    # a uuid-only reference to it: the hash vLLM gave it, passed as is (not mapped)
    out, left = uuids._keyed_by_content({"image": [HEX64]}, {"image": [None]}, _processor(()))
    assert out == {"image": ["c" * 64]} and left == []
    assert uuids._mapped(out) == {"image": ["c" * 64]}
    assert uuids._mapped({"image": ["doc-7"]}) == {"image": [uuids.uuid_identifier("doc-7")]}
    # the same uuid later sent with other pixels: references to it name neither image
    uuids._remember([("image", 0, HEX64)], {"image": ["d" * 64]})
    out, _ = uuids._keyed_by_content({"image": [HEX64]}, {"image": [None]}, _processor(()))
    assert uuids._mapped(out) == {"image": [uuids.uuid_identifier(HEX64)]}
    uuids._remember([("image", 0, HEX64)], {"image": ["c" * 64]})  # (stays refused)
    assert uuids._keyed_by_content({"image": [HEX64]}, {"image": [None]},
                                   _processor(()))[0] == {"image": [HEX64]}
    # a grid model, embeddings (a dict), a single uuid
    assert uuids._keyed_by_content(given, data, _processor({"image_grid_thw"}))[0] == given
    assert uuids._keyed_by_content({"image": [HEX64]}, {"image": [{"image_embeds": 1}]},
                                   _processor(()))[0] == {"image": [HEX64]}
    assert uuids._keyed_by_content({"image": HEX64}, {"image": image},
                                   _processor(()))[0] == {"image": None}
    # a vLLM that does not declare the fields: left as given
    assert uuids._keyed_by_content(given, data, SimpleNamespace())[0] == given
