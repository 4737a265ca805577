"""vLLM general plugin: registers encache's connector names with ``ECConnectorFactory``.

Installed as the ``vllm.general_plugins`` entry point ``encache``; vLLM calls
:func:`register` in every process it starts (API server, engine core, workers), so a
config can say ``"ec_connector": "EncacheConnector"`` without a module path.
``EncacheDisk`` and ``EncacheRedis`` are aliases of the same class: the store URL in
``ec_connector_extra_config`` picks the backend. It also puts client uuids in a namespace
of their own (:mod:`.uuids`: acts only for engines that use an encache connector).
"""

from __future__ import annotations

from . import CONNECTOR_CLASS, CONNECTOR_MODULE as MODULE, CONNECTOR_NAMES


def register() -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    for name in CONNECTOR_NAMES:
        try:
            ECConnectorFactory.register_connector(name, MODULE, CONNECTOR_CLASS)
        except ValueError:  # already registered: vLLM may load plugins more than once
            pass
    from . import uuids

    uuids.install()
