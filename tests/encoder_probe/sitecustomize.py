"""Test-only probe: record every vision-encoder run in every process of a vLLM server.

Put this directory on ``PYTHONPATH`` and set ``ENCACHE_TEST_ENCODER_LOG=FILE``: Python
imports ``sitecustomize`` at start-up in the API server, the engine core and the workers
(spawned or forked). When vLLM imports a multimodal model module listed in
:data:`TARGETS`, the model class's ``embed_multimodal`` (the vision tower + projector, the
call an encoder-cache hit skips) is wrapped to append one JSON line per call to FILE:
``{"pid", "model", "shapes": [[rows, width], ...]}`` -- one shape per encoded item. With
``ENCACHE_TEST_ENCODER_DUMP=DIR`` each item's output is also saved (``torch.save``) and its
file named in the line (``"files"``), so a test can compare stored entries with what the
serving engine's own tower computes.

``ENCACHE_TEST_ENCODER_GATE=DIR`` holds every tower run at a gate: the process writes
``DIR/<pid>-<n>.running`` (n counts its tower runs) and waits (up to 10 minutes) until
``DIR/<pid>-<n>.go`` or ``DIR/release`` exists. A fault test uses it to let exactly some
batches through, or to SIGKILL an engine while it is certainly inside a batch, whatever the
machine's speed. Only request batches are held (vLLM's ``_execute_mm_encoder`` on the
stack): never the engine's start-up runs (memory profile, encache's width measurement). Nothing here runs unless one of the variables is set.
"""

import os

_LOG = os.environ.get("ENCACHE_TEST_ENCODER_LOG")
_GATE = os.environ.get("ENCACHE_TEST_ENCODER_GATE")

TARGETS = {
    "vllm.model_executor.models.llava": "LlavaForConditionalGeneration",
    "vllm.model_executor.models.gemma3_mm": "Gemma3ForConditionalGeneration",
    "vllm.model_executor.models.qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    # the families of tests/engine/test_families.py (scripts/tiny_<arch>.py)
    "vllm.model_executor.models.qwen2_vl": "Qwen2VLForConditionalGeneration",
    "vllm.model_executor.models.qwen3_vl": "Qwen3VLForConditionalGeneration",
    "vllm.model_executor.models.llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "vllm.model_executor.models.idefics3": "Idefics3ForConditionalGeneration",
    "vllm.model_executor.models.mistral3": "Mistral3ForConditionalGeneration",
    "vllm.model_executor.models.interns1": "InternS1ForConditionalGeneration",
    "vllm.model_executor.models.paligemma": "PaliGemmaForConditionalGeneration",
    "vllm.model_executor.models.glm4_1v": "Glm4vForConditionalGeneration",
    "vllm.model_executor.models.gemma4_mm": "Gemma4ForConditionalGeneration",
    "vllm.model_executor.models.mllama4": "Llama4ForConditionalGeneration",
    "vllm.model_executor.models.lfm2_vl": "Lfm2VLForConditionalGeneration",
    # (Qwen3_5ForConditionalGeneration inherits Qwen3-VL's embed_multimodal: tapped there)
}


def _stack_names() -> list:
    import sys
    names, frame = [], sys._getframe(1)
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names



def _patch(cls) -> None:
    import itertools
    import json

    original = cls.embed_multimodal
    dump = os.environ.get("ENCACHE_TEST_ENCODER_DUMP")
    seq = itertools.count()
    gate_seq = itertools.count()

    def embed_multimodal(self, **kwargs):
        stack = _stack_names() if _GATE else ()
        if "_execute_mm_encoder" in stack:
            import time
            name = os.path.join(_GATE, f"{os.getpid()}-{next(gate_seq)}")
            with open(name + ".running", "w") as fh:  # the call path, for a failing test
                fh.write(" < ".join(stack))
            deadline = time.monotonic() + 600
            while not (os.path.exists(name + ".go")
                       or os.path.exists(os.path.join(_GATE, "release"))) \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
        out = original(self, **kwargs)
        if not _LOG:
            return out
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


def patch_on_import(patches) -> None:
    """Call ``patches[name](module)`` right after Python executes module ``name`` (an
    import hook: the wrapped classes exist before anything uses them). The benchmark's
    call probe (``scripts/bench/epd_probe``) installs its own patches through this."""
    import importlib.abc
    import sys

    class _PostImportHook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in patches:
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
                patches[name](module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _PostImportHook())


if _LOG or _GATE:
    patch_on_import({name: (lambda module, cls=cls: _patch(getattr(module, cls)))
                     for name, cls in TARGETS.items()})
