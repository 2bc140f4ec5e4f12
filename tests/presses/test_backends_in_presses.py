"""Press level: every available projected-norm backend makes the presses select exactly the same entries."""

import pytest
import torch
from helpers import kept_masks, tiny_model
from kvpress import SnapKVPress
from op_helpers import usable

from kvpress_critical import CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.ops import PROJECTED_VALUE_NORM


@pytest.mark.parametrize("norm", ["l1", "l2"])
@pytest.mark.parametrize("press_cls", [CriticalKVPress, CriticalAdaKVPress])
def test_presses_select_the_same_entries_with_every_backend(press_cls, norm):
    """On CPU: torch, cpp and Triton (interpreter, see conftest); on a GPU machine the same on CPU tensors."""
    on_cpu = [n for n in ("cpp", "triton") if usable(n)[0] and "cpu" in PROJECTED_VALUE_NORM[n].device_types()]
    names = ["torch"] + on_cpu
    if len(names) < 2:
        pytest.skip(f"no fused CPU backend here: cpp: {usable('cpp')[1]}; triton: {usable('triton')[1]}")
    model = tiny_model("llama", num_kv_heads=2, num_heads=8)
    input_ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    masks = {}
    for name in names:
        press = press_cls(SnapKVPress(compression_ratio=0.6, window_size=8), norm=norm, backend=name)
        masks[name] = kept_masks(model, input_ids, press)
    for name, layers in masks.items():
        for layer, (mask, expected) in enumerate(zip(layers, masks["torch"])):
            assert torch.equal(mask, expected), f"{name} keeps other entries than torch in layer {layer}"
