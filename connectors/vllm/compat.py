"""The vLLM releases whose EC-connector API the adapter has been checked against.

What: :data:`CHECKED_VERSIONS` lists the releases whose ``ECConnectorBase``,
``ECConnectorFactory`` and ``ECTransferConfig`` match :data:`SPEC` (the API encache's
adapter implements), and whose encoder-cache manager, scheduler and worker calls were
checked against what encache relies on. Each release's facts are recorded from its
source (:func:`source_api`, by ``scripts/record_vllm_api.py WHEEL``) in
``tests/vllm_releases/``, since only one release runs here (CI's CPU build);
tests/consumer/test_vllm_releases.py fails loudly when a recorded release differs from
what encache implements, and checks :func:`source_api` against the installed release's
own runtime facts (:func:`installed_spec`). :func:`version_warning` lets the connector
warn (not fail) on a release nobody checked.

Why: vLLM's connector API moves between releases; an engine that starts with a connector
whose hooks silently stopped being called serves 100 % misses ("working, just slower").
To support a new release: ``pip download vllm==X --no-deps``, record it with
``scripts/record_vllm_api.py``, run tests/consumer/test_vllm_releases.py, then add it here.
"""

from __future__ import annotations

#: releases checked against SPEC (each recorded in tests/vllm_releases/)
CHECKED_VERSIONS = ("0.32.0", "0.33.0", "0.34.0")

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
    if version.split("+")[0] in CHECKED_VERSIONS:  # (a local build tag: 0.34.0+cu130)
        return None
    return (f"encache: vLLM {version} is not among the releases its connector API was checked "
            f"against ({', '.join(CHECKED_VERSIONS)}); record it with "
            "scripts/record_vllm_api.py and run tests/consumer/test_vllm_releases.py before "
            "relying on it (a changed API can mean silent misses)")


#: where each release keeps what :func:`source_api` reads (paths under ``vllm/``)
SOURCES = {
    "base": "distributed/ec_transfer/ec_connector/base.py",
    "factory": "distributed/ec_transfer/ec_connector/factory.py",
    "transfer_config": "config/ec_transfer.py",
    "manager": "v1/core/encoder_cache_manager.py",
    "manager_config": "config/ec_manager_config.py",
    "features": "multimodal/inputs.py",
    # where client uuids become item identifiers (encache.connectors.vllm.uuids patches)
    "renderer": "renderers/base.py",
    "processor": "multimodal/processing/processor.py",
    "input_processor": "v1/engine/input_processor.py",
}
#: ``Class.method`` -> the SOURCES file of the functions :mod:`.uuids` wraps or relies on
UUID_HOOKS = {"BaseRenderer._process_multimodal": "renderer",
              "BaseMultiModalProcessor._get_mm_hashes": "processor",
              "InputProcessor._get_mm_identifier": "input_processor"}
#: files whose uses of the connector (``….ec_connector.X``) are recorded
#: (the V2 GPU runner's ``self.ec_connector`` outside gpu/ec_connector.py is its wrapper)
CALLERS = ("v1/core/sched/scheduler.py", "v1/worker/ec_connector_model_runner_mixin.py",
           "v1/worker/gpu/ec_connector.py", "v1/engine/core.py")


def source_api(root) -> dict:
    """A vLLM release's facts read from its source without importing it (``root``: the
    folder holding ``vllm/``, e.g. an unzipped wheel): :data:`SPEC`'s sections, plus the
    encoder-cache manager's methods and state, its config's fields, the multimodal
    feature's fields, the connector members vLLM's scheduler and workers use, and the
    parameters of the functions client uuids pass through (:data:`UUID_HOOKS`; None for
    one the release lacks)."""
    import ast
    from pathlib import Path

    vllm_dir = Path(root) / "vllm"

    def tree(rel):
        return ast.parse((vllm_dir / rel).read_text())

    def cls(rel, name):
        for node in ast.walk(tree(rel)):
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise LookupError(f"{name} not in {rel}")

    def decorators(fn):
        return {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in fn.decorator_list}

    def params(fn, bound=False):
        a = fn.args
        names = [x.arg for x in [*a.posonlyargs, *a.args]]
        names += [a.vararg.arg] if a.vararg else []
        names += [x.arg for x in a.kwonlyargs] + ([a.kwarg.arg] if a.kwarg else [])
        return names[1:] if bound else names

    def methods(node, *, skip_dunder=True):
        out = {}
        for fn in node.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if skip_dunder and fn.name.startswith("__") and fn.name != "__init__":
                    continue
                out[fn.name] = "property" if "property" in decorators(fn) else params(fn)
        return out

    def fields(node):
        return sorted(st.target.id for st in node.body
                      if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                      and "ClassVar" not in ast.unparse(st.annotation))

    base = cls(SOURCES["base"], "ECConnectorBase")
    role = cls(SOURCES["base"], "ECConnectorRole")
    factory = cls(SOURCES["factory"], "ECConnectorFactory")
    transfer = cls(SOURCES["transfer_config"], "ECTransferConfig")
    manager = cls(SOURCES["manager"], "EncoderCacheManager")
    init = next(fn for fn in manager.body if getattr(fn, "name", "") == "__init__")
    state = sorted({t.attr for st in ast.walk(init)
                    for t in (st.targets if isinstance(st, ast.Assign) else
                              [st.target] if isinstance(st, ast.AnnAssign) else [])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                    and t.value.id == "self"})
    used = set()
    for rel in CALLERS:
        if (vllm_dir / rel).exists():
            for node in ast.walk(tree(rel)):
                if isinstance(node, ast.Attribute):
                    recv = node.value
                    last = recv.attr if isinstance(recv, ast.Attribute) else getattr(recv, "id", "")
                    if last in ("ec_connector", "_ec_connector"):
                        used.add(node.attr)
    hooks = {}
    for qualname, source in UUID_HOOKS.items():
        owner, name = qualname.split(".")
        try:
            found = methods(cls(SOURCES[source], owner)).get(name)
        except (LookupError, OSError):
            found = None
        hooks[qualname] = found
    return {
        "base_methods": methods(base),
        "abstract": sorted(fn.name for fn in base.body if isinstance(fn, ast.FunctionDef)
                           and "abstractmethod" in decorators(fn)),
        "roles": [t.id for st in role.body if isinstance(st, ast.Assign) for t in st.targets
                  if isinstance(t, ast.Name)],
        "factory": {fn.name: params(fn, bound=True) for fn in factory.body
                    if isinstance(fn, ast.FunctionDef)
                    and fn.name in ("register_connector", "create_connector")},
        "transfer_config_fields": fields(transfer),
        "transfer_config_properties": sorted(fn.name for fn in transfer.body
                                             if isinstance(fn, ast.FunctionDef)
                                             and fn.name.startswith("is_")),
        "manager_methods": methods(manager, skip_dunder=False),
        "manager_state": state,
        "manager_config_fields": fields(cls(SOURCES["manager_config"],
                                            "EncoderCacheManagerConfig")),
        "feature_fields": fields(cls(SOURCES["features"], "MultiModalFeatureSpec")),
        "connector_members_used": sorted(used),
        "uuid_hooks": hooks,
    }
