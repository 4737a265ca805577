"""Every checked vLLM release against what encache implements, from the release's source.

Only one release runs here (CI's CPU build), so each checked release's facts were
recorded from its released source by ``scripts/record_vllm_api.py``
(tests/vllm_releases/vllm-VERSION.json, :func:`encache.connectors.vllm.compat.source_api`).
These tests fail loudly when a recorded release's EC-connector API, the connector members
its scheduler and workers use, or the encoder-cache manager state and methods encache's
policy manager relies on differ from what encache implements; the recording itself is
checked against the installed release's runtime facts. (The policy manager also runs
over each release's own manager source: tests/policy/test_policy_contract.py.)
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

from encache.connectors.vllm import compat

RELEASES = Path(__file__).resolve().parents[1] / "vllm_releases"
ROOT = Path(__file__).resolve().parents[2]


def recorded(version: str) -> dict:
    path = RELEASES / f"vllm-{version}.json"
    assert path.exists(), (f"checked release {version} has no recorded facts: run "
                           f"scripts/record_vllm_api.py on its wheel ({path})")
    return json.loads(path.read_text())


@pytest.mark.parametrize("version", compat.CHECKED_VERSIONS)
def test_each_checked_release_has_the_connector_api_encache_implements(version):
    facts = recorded(version)
    assert facts["version"] == version
    diffs = compat.spec_differences({k: facts.get(k) for k in compat.SPEC})
    assert not diffs, f"vLLM {version}'s EC-connector API differs:\n" + "\n".join(diffs)


def test_a_changed_release_is_caught():
    facts = recorded("0.34.0")
    facts["base_methods"]["save_caches"] = ["self", "encoder_cache", "mm_hash", "stream"]
    facts["abstract"] = [*facts["abstract"], "new_hook"]
    diffs = compat.spec_differences({k: facts[k] for k in compat.SPEC})
    assert len(diffs) == 2 and "save_caches" in diffs[0], diffs


def test_the_recording_reads_what_the_installed_release_reports():
    """source_api over the installed vLLM's source gives the same facts as importing it,
    and the same as its recorded file: the static reading is faithful."""
    vllm = pytest.importorskip("vllm")
    root = Path(vllm.__file__).resolve().parents[1]
    facts = compat.source_api(root)
    runtime = compat.installed_spec()
    assert {k: facts[k] for k in compat.SPEC} == runtime
    version = vllm.__version__.split("+")[0]
    assert {"version": version, **facts} == recorded(version)


@pytest.mark.parametrize("version", compat.CHECKED_VERSIONS)
def test_every_connector_member_vllm_uses_is_there(version):
    """What the scheduler and workers call on a connector exists in the release's base
    class (encache implements the abstract ones), and every hook encache overrides keeps
    its parameters there."""
    pytest.importorskip("vllm")
    from encache.connectors.vllm.connector import EncacheConnector

    facts = recorded(version)
    base = facts["base_methods"]
    missing = [m for m in facts["connector_members_used"] if m not in base]
    assert not missing, f"vLLM {version} calls connector members its base lacks: {missing}"
    for name in facts["abstract"]:
        assert name in vars(EncacheConnector), f"{name} is abstract in {version}"
    for name, member in vars(EncacheConnector).items():
        if name in base and base[name] != "property" and callable(member):
            fn = getattr(member, "__func__", member)
            sig = inspect.signature(fn).parameters
            ours = [p for p in sig if p not in ("kwargs", "cls")]
            theirs = [p for p in base[name] if p not in ("kwargs", "cls")]
            # vLLM's parameters, in order; any more only as optional ones (vLLM passes
            # some as keywords it gathers under **kwargs)
            assert ours[:len(theirs)] == theirs and all(
                sig[p].default is not inspect.Parameter.empty for p in ours[len(theirs):]), (
                f"{name}: vLLM {version} has {theirs}, encache {ours}")


def _policy_manager_needs() -> tuple[set[str], set[str]]:
    """(methods PolicyManagerMixin overrides or calls on vLLM's manager, state it reads),
    read from connectors/vllm/manager.py."""
    tree = ast.parse((ROOT / "connectors" / "vllm" / "manager.py").read_text())
    mixin = next(n for n in ast.walk(tree)
                 if isinstance(n, ast.ClassDef) and n.name == "PolicyManagerMixin")
    own_methods = {f.name for f in mixin.body if isinstance(f, ast.FunctionDef)}
    targets = [t for n in ast.walk(mixin) for t in (
        n.targets if isinstance(n, ast.Assign) else
        [n.target] if isinstance(n, ast.AnnAssign) else [])]
    own_state = {t.attr for t in targets if isinstance(t, ast.Attribute)
                 and isinstance(t.value, ast.Name) and t.value.id == "self"}
    own_state |= {t.id for n in mixin.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                  if isinstance(t, ast.Name)}  # (class attributes)
    own_state -= {"cached", "freeable", "freed", "num_free_slots", "num_freeable_slots",
                  "num_embeds_by_hash", "request_cached_ids"}  # (vLLM's, written here too)
    used = {n.attr for n in ast.walk(mixin) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    supers = {n.func.attr for n in ast.walk(mixin) if isinstance(n, ast.Call)
              and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Call)
              and getattr(n.func.value.func, "id", "") == "super"}
    overridden = own_methods - {"describe", "_first_touch"}
    return overridden | supers, used - own_methods - own_state


@pytest.mark.parametrize("version", compat.CHECKED_VERSIONS)
def test_the_policy_manager_uses_only_what_each_release_has(version):
    facts = recorded(version)
    methods, state = _policy_manager_needs()
    have = facts["manager_methods"]
    missing = sorted(m for m in methods if m not in have)
    assert not missing, f"vLLM {version}'s EncoderCacheManager lacks {missing}"
    from encache.connectors.vllm.manager import PolicyManagerMixin
    for name in methods & set(vars(PolicyManagerMixin)):
        fn = getattr(vars(PolicyManagerMixin)[name], "__func__", vars(PolicyManagerMixin)[name])
        sig = inspect.signature(fn).parameters
        ours, theirs = list(sig), have[name]
        assert ours[:len(theirs)] == theirs and all(   # (more only as optional ones)
            sig[p].default is not inspect.Parameter.empty for p in ours[len(theirs):]), (
            f"{name}: vLLM {version} has {theirs}, encache {ours}")
    missing = sorted(state - set(facts["manager_state"]) - set(have))
    assert not missing, f"vLLM {version}'s EncoderCacheManager has no {missing}"
    assert facts["manager_config_fields"] == ["encoder_cache_manager_cls", "manager_config"]
    assert {"identifier", "mm_position", "data", "modality"} <= set(facts["feature_fields"])


def test_nothing_uses_what_vllm_034_removed():
    removed = ("get_manager_metadata", "EncoderCacheManagerMetadata", "ec_manager_metadata")
    for path in [*(ROOT / "connectors").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        if path.parent == RELEASES or path == Path(__file__).resolve():
            continue
        text = path.read_text()
        assert not any(name in text for name in removed), path
    assert "get_manager_metadata" not in recorded("0.34.0")["manager_methods"]


@pytest.mark.parametrize("version", compat.CHECKED_VERSIONS)
def test_each_checked_release_has_the_functions_client_uuids_are_mapped_in(version):
    """encache.connectors.vllm.uuids wraps the renderer's ``_process_multimodal`` (it takes
    the request's ``mm_uuids``) and the processor's ``_get_mm_hashes(inputs)``, and relies
    on vLLM adding the LoRA prefix afterwards (``_get_mm_identifier``): every checked
    release has all three, so servers of any of them map a client uuid alike."""
    hooks = recorded(version)["uuid_hooks"]
    assert "mm_uuids" in (hooks["BaseRenderer._process_multimodal"] or []), hooks
    assert hooks["BaseMultiModalProcessor._get_mm_hashes"] == ["self", "inputs"], hooks
    assert hooks["InputProcessor._get_mm_identifier"] == ["self", "mm_hash", "lora_request"]
