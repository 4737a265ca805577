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
