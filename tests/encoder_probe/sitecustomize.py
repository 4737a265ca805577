"""Test-only probe: record every vision-encoder run in every process of a vLLM server.

Put this directory on ``PYTHONPATH`` and set ``ENCACHE_TEST_ENCODER_LOG=FILE``: Python
imports ``sitecustomize`` at start-up in the API server, the engine core and the workers
(spawned or forked). When vLLM imports a multimodal model module listed in
:data:`TARGETS`, the model class's ``embed_multimodal`` (the vision tower + projector, the
call an encoder-cache hit skips) is wrapped to append one JSON line per call to FILE:
``{"pid", "model", "shapes": [[rows, width], ...]}`` -- one shape per encoded item. With
``ENCACHE_TEST_ENCODER_DUMP=DIR`` each item's output is also saved (``torch.save``) and its
file named in the line (``"files"``), so a test can compare stored entries with what the
serving engine's own tower computes. Nothing here runs unless the variable is set.
"""

import os

_LOG = os.environ.get("ENCACHE_TEST_ENCODER_LOG")

TARGETS = {
    "vllm.model_executor.models.llava": "LlavaForConditionalGeneration",
    "vllm.model_executor.models.gemma3_mm": "Gemma3ForConditionalGeneration",
    "vllm.model_executor.models.qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}


def _patch(cls) -> None:
    import itertools
    import json

    original = cls.embed_multimodal
    dump = os.environ.get("ENCACHE_TEST_ENCODER_DUMP")
    seq = itertools.count()

    def embed_multimodal(self, **kwargs):
        out = original(self, **kwargs)
        items = list(out) if isinstance(out, (list, tuple)) else list(out.unbind(0))
        record = {"pid": os.getpid(), "model": cls.__name__,
                  "shapes": [list(t.shape) for t in items]}
        if dump and items:
            import torch
            files = []
            for t in items:
                name = os.path.join(dump, f"{os.getpid()}-{next(seq):06d}.pt")
                torch.save(t.detach().to("cpu", copy=True), name)
                files.append(name)
            record["files"] = files
        with open(_LOG, "a") as f:  # one short O_APPEND write per call
            f.write(json.dumps(record) + "\n")
        return out

    cls.embed_multimodal = embed_multimodal


if _LOG:
    import importlib.abc
    import sys

    class _PostImportHook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in TARGETS:
                return None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                _patch(getattr(module, TARGETS[name]))

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _PostImportHook())
