"""The vLLM releases whose EC-connector API the adapter has been checked against.

What: :data:`CHECKED_VERSIONS` lists the releases whose ``ECConnectorBase``,
``ECConnectorFactory`` and ``ECTransferConfig`` were compared with :data:`SPEC` (the API
encache's adapter relies on, recorded from vLLM 0.32.0; 0.33.0's
``ec_connector/base.py``, ``factory.py`` and ``config/ec_transfer.py`` are identical).
:func:`installed_spec` reads the same facts from the installed vLLM, so
tests/consumer/test_adapter_api.py fails loudly on a release whose API differs, and
:func:`version_warning` lets the connector warn (not fail) on a release nobody checked.

Why: vLLM's connector API moves between releases; an engine that starts with a connector
whose hooks silently stopped being called serves 100 % misses ("working, just slower").
To support a new release: install it, run tests/consumer/test_adapter_api.py, then add it here.
"""

from __future__ import annotations

#: releases checked against SPEC (keep pyproject's ``gpu`` extra range in step)
CHECKED_VERSIONS = ("0.32.0", "0.33.0")

#: ECConnectorBase members -> parameter names ("property" for properties)
BASE_METHODS = {
    "__init__": ["self", "vllm_config", "role"],
    "_get_connector_metadata": ["self"],
    "bind_connector_metadata": ["self", "connector_metadata"],
    "build_connector_meta": ["self", "scheduler_output"],
    "build_connector_worker_meta": ["self"],
    "build_ec_connector_stats": ["cls", "data"],
    "build_prom_metrics": ["cls", "vllm_config", "metric_types", "labelnames",
                           "per_engine_labelvalues"],
    "clear_connector_metadata": ["self"],
    "ensure_cache_available": ["self", "request", "num_computed_tokens"],
    "get_ec_connector_stats": ["self"],
    "get_finished": ["self", "finished_req_ids"],
    "has_cache_item": ["self", "identifier"],
    "has_pending_push_work": ["self"],
    "is_consumer": "property",
    "is_producer": "property",
    "register_caches": ["self", "ec_caches"],
    "request_finished": ["self", "request"],
    "role": "property",
    "save_caches": ["self", "encoder_cache", "mm_hash", "kwargs"],
    "shutdown": ["self"],
    "start_load_caches": ["self", "encoder_cache", "kwargs"],
    "start_save_caches": ["self", "kwargs"],
    "start_worker_services": ["self"],
    "take_unavailable_requests": ["self"],
    "update_connector_output": ["self", "connector_output"],
    "update_state_after_alloc": ["self", "request", "index"],
    "update_state_after_free": ["self", "request", "index"],
}

SPEC = {
    "base_methods": BASE_METHODS,
    "abstract": ["build_connector_meta", "has_cache_item", "save_caches", "start_load_caches",
                 "update_state_after_alloc"],
    "roles": ["SCHEDULER", "WORKER"],
    "factory": {"register_connector": ["name", "module_path", "class_name"],
                "create_connector": ["config", "role"]},
    "transfer_config_fields": ["ec_buffer_device", "ec_buffer_size", "ec_connector",
                               "ec_connector_extra_config", "ec_connector_module_path", "ec_ip",
                               "ec_port", "ec_role", "engine_id", "mm_encoder_output_widths"],
    "transfer_config_properties": ["is_ec_consumer", "is_ec_producer",
                                   "is_ec_transfer_instance", "is_encode_only"],
}


def installed_spec() -> dict:
    """The same facts as :data:`SPEC`, read from the installed vLLM."""
    import dataclasses
    import inspect

    from vllm.config.ec_transfer import ECTransferConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    methods: dict = {}
    for name, member in sorted(vars(ECConnectorBase).items()):
        if isinstance(member, property):
            methods[name] = "property"
        elif isinstance(member, (classmethod, staticmethod)) or callable(member):
            fn = getattr(member, "__func__", member)
            methods[name] = list(inspect.signature(fn).parameters)
    methods = {k: v for k, v in methods.items()
               if not k.startswith("__") or k == "__init__"}
    return {
        "base_methods": methods,
        "abstract": sorted(ECConnectorBase.__abstractmethods__),
        "roles": [m.name for m in ECConnectorRole],
        "factory": {n: list(inspect.signature(getattr(ECConnectorFactory, n)).parameters)
                    for n in ("register_connector", "create_connector")},
        "transfer_config_fields": sorted(f.name for f in dataclasses.fields(ECTransferConfig)),
        "transfer_config_properties": sorted(n for n in dir(ECTransferConfig)
                                             if n.startswith("is_")),
    }


def spec_differences(installed: dict, recorded: dict = SPEC) -> list[str]:
    """One line per difference between an installed API spec and the recorded one."""
    out = []
    for section in recorded:
        want, got = recorded[section], installed.get(section)
        if isinstance(want, dict):
            got = got or {}
            for key in sorted(set(want) | set(got)):
                if want.get(key) != got.get(key):
                    out.append(f"{section}.{key}: checked {want.get(key)}, installed {got.get(key)}")
        elif want != got:
            out.append(f"{section}: checked {want}, installed {got}")
    return out


def version_warning(version: str) -> str | None:
    """A one-line warning for a vLLM release the adapter was not checked against."""
    if version in CHECKED_VERSIONS:
        return None
    return (f"encache: vLLM {version} is not among the releases its connector API was checked "
            f"against ({', '.join(CHECKED_VERSIONS)}); run tests/consumer/test_adapter_api.py before "
            "relying on it (a changed API can mean silent misses)")
