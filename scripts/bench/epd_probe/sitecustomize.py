"""Benchmark-only probe: time the connector's calls inside every process of a vLLM server.

``scripts/bench/epd_bench.py`` puts this directory on a server's ``PYTHONPATH`` with
``ENCACHE_BENCH_CALL_LOG=FILE``; Python imports ``sitecustomize`` at start-up in the API
server, the engine core and the workers. When vLLM imports a module in :data:`TARGETS`,
the named methods are wrapped to append one JSON line per call to FILE: ``{"pid", "f",
"t0", "dt"}`` (``time.perf_counter``, the system's monotonic clock: comparable across
processes), so the benchmark can say how much of a request's latency the connector's own
calls took -- encache's and ECExampleConnector's, the same methods vLLM calls on the
request path -- how much the vision tower (``_execute_mm_encoder``), and when the
worker's step starts (``execute_model``) after the scheduler built its metadata.

It runs the tests' encoder probe (``tests/encoder_probe``: which requests ran the tower,
when its variables are set), which a second ``sitecustomize`` on the path would otherwise
shadow, and installs its own patches through that probe's import hook. Nothing is
patched unless a variable is set.
"""

import functools
import json
import os
import runpy
import time

_LOG = os.environ.get("ENCACHE_BENCH_CALL_LOG")

_CONNECTOR = ("has_cache_item", "ensure_cache_available", "update_state_after_alloc",
              "build_connector_meta", "start_load_caches", "save_caches", "get_finished",
              "request_finished")
TARGETS = {  # module: (class, methods)
    "encache.connectors.vllm.connector": ("EncacheConnector", _CONNECTOR),
    "vllm.distributed.ec_transfer.ec_connector.example_connector":
        ("ECExampleConnector", _CONNECTOR),
    "vllm.v1.worker.gpu_model_runner": ("GPUModelRunner", ("_execute_mm_encoder",
                                                            "execute_model")),
}


def _timed(cls, name: str) -> None:
    f = cls.__dict__.get(name)
    if f is None:  # not overridden: the base class's no-op, nothing to time
        return

    @functools.wraps(f)
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            line = json.dumps({"pid": os.getpid(), "f": f"{cls.__name__}.{name}", "t0": t0,
                               "dt": time.perf_counter() - t0})
            with open(_LOG, "a") as fh:
                fh.write(line + "\n")

    setattr(cls, name, call)


def _patch(module) -> None:
    cls_name, methods = TARGETS[module.__name__]
    cls = getattr(module, cls_name)
    for method in methods:
        _timed(cls, method)


# the tests' encoder probe: its own patches when its variables are set, and the hook
_tests_probe = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                           "..", "..", "tests", "encoder_probe",
                                           "sitecustomize.py"))
if _LOG:
    _tests_probe["patch_on_import"]({name: _patch for name in TARGETS})
