"""The vLLM adapter: the only encache code that imports vLLM.

Modules import vLLM lazily or at module level only here, so the store core and most
of the CLI never pay for it.
"""
