"""Let PyPI's CUDA-linked torchvision import beside a CPU-only torch.

torchvision registers fake (meta) kernels for ``torchvision::nms``/``qnms`` at import
time; when its compiled ops library cannot load (CUDA build next to ``torch+cpu``) the op
schemas do not exist and ``import torchvision`` fails. vLLM's VLM code needs only the
pure-Python part (``transforms.v2`` via transformers), so defining the two schemas first
(no kernels) is enough; detection ops stay unusable.

``scripts/setup`` installs a ``.pth`` file that imports this module at interpreter start.
It only installs an import hook: torch is imported when (and only when) torchvision is,
so processes that never touch torchvision (the ``encache`` CLI) pay nothing.
"""

from __future__ import annotations

import importlib.abc
import sys


def define_missing_schemas() -> None:
    """Define the op schemas torchvision's Python side expects (CPU torch only)."""
    import torch

    if torch.version.cuda is not None:  # a CUDA torch loads torchvision's ops itself
        return
    try:
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define(
            "qnms(Tensor dets, Tensor scores, float iou_threshold, float scale,"
            " int zero_point) -> Tensor"
        )
        sys.modules[__name__]._library = lib  # keep the registration alive
    except RuntimeError:  # already defined (the real library loaded)
        pass


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            define_missing_schemas()
        return None  # let the normal finders import it


def install() -> None:
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


install()
