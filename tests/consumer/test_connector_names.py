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


def test_one_builder_of_the_transfer_config(tmp_path, monkeypatch):
    """connector-config prints what :func:`transfer_config` builds, the producer engine
    and the demo call the same function: a key is spelled in one place."""
    import ast
    from pathlib import Path

    import pytest

    from encache.connectors.vllm import CONNECTOR_CLASS, CONNECTOR_MODULE, transfer_config

    monkeypatch.chdir(tmp_path)
    built = transfer_config("rel/store", "ec_both", {"max_bytes": 5})
    assert built == {"ec_connector": CONNECTOR_CLASS, "ec_role": "ec_both",
                     "ec_connector_module_path": CONNECTOR_MODULE,
                     "ec_connector_extra_config": {"store": str(tmp_path / "rel" / "store"),
                                                   "max_bytes": 5}}
    assert transfer_config("redis://h:1/0", "ec_consumer")["ec_connector_extra_config"] == \
        {"store": "redis://h:1/0"}  # a URL as given; a local path made absolute
    with pytest.raises(ValueError, match="--role must be one of"):
        transfer_config("s", "ec_sideways")
    cli = json.loads(invoke("connector-config", "-s", "rel/store", "--role", "ec_both",
                            "--max-bytes", "5").stdout)
    assert cli == built
    root = Path(__file__).resolve().parents[2]
    for module in ("cli/connector_config.py", "connectors/vllm/producer.py"):
        tree = ast.parse((root / module).read_text())
        literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)}
        calls = {n.func.id for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "transfer_config" in calls and not {"ec_role", "ec_connector"} & literals, module


def test_every_setting_is_documented_with_its_default():
    """docs/connector.md's settings table names every ConnectorConfig field, and each
    default as the dataclass declares it (the one place defaults are declared)."""
    import re
    from dataclasses import MISSING, fields
    from pathlib import Path

    from encache.connectors.vllm.config import ConnectorConfig

    text = (Path(__file__).resolve().parents[2] / "docs" / "connector.md").read_text()
    section = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, flags=re.M))
    names = {f.name for f in fields(ConnectorConfig)}
    assert set(rows) == names, (sorted(names - set(rows)), sorted(set(rows) - names))
    for f in fields(ConnectorConfig):
        doc = rows[f.name].strip()
        if f.default is MISSING:
            assert "required" in doc, f.name
        elif f.default is None:
            assert doc == "none", (f.name, doc)
        elif isinstance(f.default, bool):
            assert doc == f"`{str(f.default).lower()}`", (f.name, doc)
        elif isinstance(f.default, str):
            assert doc == (f"`{f.default}`" if f.default else '`""`'), (f.name, doc)
        else:
            assert doc.split()[0] == repr(f.default), (f.name, doc)


def test_the_parts_default_to_the_connector_settings():
    """The connector settings are declared once (ConnectorConfig): the lookup's and the
    writer's own keyword defaults, for library users, are the same values (a test, since
    the lookup cannot import the adapter's config)."""
    import inspect
    from dataclasses import fields

    from encache.connectors.lookup import EntryLookup
    from encache.connectors.lookup.metrics import LookupMetrics
    from encache.connectors.vllm.config import ConnectorConfig
    from encache.connectors.vllm.writer import EntryWriter

    cfg = ConnectorConfig(store="x")
    defaults = {f.name: getattr(cfg, f.name) for f in fields(ConnectorConfig)}
    for cls, options in ((EntryLookup, cfg.lookup_options()), (EntryWriter, cfg.writer_options())):
        params = inspect.signature(cls.__init__).parameters
        for key, value in options.items():
            assert params[key].default == value, (cls.__name__, key, params[key].default, value)
    flush = inspect.signature(LookupMetrics.__init__).parameters["counters_flush_s"].default
    assert flush == defaults["counters_flush_s"]
