"""The binding's digest (encache.connectors.vllm.binding): what it covers, and that it is
the same in any process (a producer and a consumer are different processes, often hosts)."""

from __future__ import annotations

import subprocess
import sys
from collections import UserDict

import pytest
import torch

from encache.connectors.vllm.binding import item_binding

_SCRIPT = """
import torch
from encache.connectors.vllm.binding import item_binding
g = torch.Generator().manual_seed(7)
item = {"pixel_values": torch.randn(2, 3, 8, 8, generator=g),
        "image_grid_thw": torch.tensor([[1, 4, 4]]), "crops": [torch.ones(2, dtype=torch.bfloat16), 3]}
print(item_binding(item))
"""


def _item():
    g = torch.Generator().manual_seed(7)
    return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g),
            "image_grid_thw": torch.tensor([[1, 4, 4]]),
            "crops": [torch.ones(2, dtype=torch.bfloat16), 3]}


def test_the_same_inputs_bind_the_same_in_another_process():
    here = item_binding(_item())
    there = subprocess.run([sys.executable, "-c", _SCRIPT], check=True, capture_output=True,
                           text=True).stdout.strip()
    assert here == there and here.startswith("blake3:")


@pytest.mark.parametrize("change", ["pixel", "grid", "dtype", "shape", "field", "nested"])
def test_any_difference_in_the_inputs_changes_the_binding(change):
    item = _item()
    if change == "pixel":
        item["pixel_values"][0, 0, 0, 0] += 1e-6
    elif change == "grid":
        item["image_grid_thw"] = torch.tensor([[1, 2, 8]])
    elif change == "dtype":
        item["pixel_values"] = item["pixel_values"].double()
    elif change == "shape":
        item["pixel_values"] = item["pixel_values"].reshape(3, 2, 8, 8)
    elif change == "field":
        item["extra"] = torch.zeros(1)
    else:
        item["crops"] = [torch.ones(2, dtype=torch.bfloat16), 4]
    assert item_binding(item) != item_binding(_item())


def test_inputs_not_here_have_no_binding():
    class Elem:
        data = None
    assert item_binding(None) is None
    assert item_binding({"pixel_values": Elem()}) is None
    assert item_binding({"pixel_values": object()}) is None


def test_a_repeat_of_the_same_inputs_object_is_remembered(monkeypatch):
    from encache.connectors.vllm import binding
    item = UserDict(_item())  # (vLLM's MultiModalKwargsItem is a UserDict)
    first = item_binding(item)
    monkeypatch.setattr(binding, "_collect", lambda *a: pytest.fail("hashed again"))
    assert item_binding(item) == first
