"""The vLLM adapter: the only encache code that imports vLLM.

Modules import vLLM lazily or at module level only here, so the store core and most
of the CLI never pay for it.
"""

#: the module path users' ``--ec-transfer-config`` names (``ec_connector_module_path``);
#: it must keep working forever. Defined here, where nothing imports vLLM, so the CLI
#: (``connector-config``), the plugin and the producer share one spelling.
CONNECTOR_MODULE = "encache.connectors.vllm.connector"
#: the class in that module (also registered under aliases by :mod:`.plugin`)
CONNECTOR_CLASS = "EncacheConnector"
#: the names an ``ec_connector`` may give it (the store URL picks the backend)
CONNECTOR_NAMES = (CONNECTOR_CLASS, "EncacheDisk", "EncacheRedis")
#: the roles an encache connector takes (``ec_role``)
ROLES = ("ec_consumer", "ec_producer", "ec_both")


def transfer_config(store: str, role: str, extra: dict | None = None) -> dict:
    """The ``--ec-transfer-config`` / ``ec_transfer_config`` dict that points a vLLM engine
    at ``store`` in ``role``; ``extra``: more ``ec_connector_extra_config`` keys. The one
    place it is built (``encache connector-config``, precompute's producer engine, the
    demo), so a key is spelled once. A local path is made absolute: the engine may run in
    another directory. A role not in :data:`ROLES`: ``ValueError``."""
    if role not in ROLES:
        raise ValueError(f"--role must be one of {', '.join(ROLES)}")
    from ..store import names_local_path
    if names_local_path(store) and not store.startswith("file://"):
        import os
        store = os.path.abspath(os.path.expanduser(store))
    return {
        "ec_connector": CONNECTOR_CLASS,
        "ec_role": role,
        "ec_connector_module_path": CONNECTOR_MODULE,
        "ec_connector_extra_config": {"store": store, **(extra or {})},
    }
