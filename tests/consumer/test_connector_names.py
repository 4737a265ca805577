"""The connector's module path is part of users' configs: one constant, spelled once,
importable without vLLM, and what connector-config and the vLLM plugin hand out."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from cli_support import invoke


def test_module_path_is_the_published_one_and_exists():
    from encache.connectors.vllm import CONNECTOR_CLASS, CONNECTOR_MODULE

    assert CONNECTOR_MODULE == "encache.connectors.vllm.connector"  # users' configs say so
    assert CONNECTOR_CLASS == "EncacheConnector"
    assert importlib.util.find_spec(CONNECTOR_MODULE) is not None
    src = open(importlib.util.find_spec(CONNECTOR_MODULE).origin).read()
    assert f"class {CONNECTOR_CLASS}(" in src


def test_constant_imports_no_vllm():
    code = ("import sys; import encache.cli.connector_config, encache.connectors.vllm.plugin; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def test_connector_config_and_plugin_use_it(tmp_path):
    from encache.connectors.vllm import CONNECTOR_MODULE, plugin

    cfg = json.loads(invoke("connector-config", "-s", tmp_path).stdout)
    assert cfg["ec_connector_module_path"] == CONNECTOR_MODULE
    assert plugin.MODULE == CONNECTOR_MODULE and cfg["ec_connector"] in plugin.CONNECTOR_NAMES
