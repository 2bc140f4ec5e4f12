"""Public API contract: reprs, the compression_ratio property, clear errors for bad input, quantized o_proj."""

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch
from helpers import kept_masks, tiny_model
from kvpress import AdaKVPress, ExpectedAttentionPress, KnormPress, ScorerPress, SnapKVPress
from torch import nn

import kvpress_critical
from kvpress_critical import CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.modeling import dense_linear_weight, module_projected_norm
from kvpress_critical.ops import PROJECTED_VALUE_NORM, Backend, BackendUnavailableError
from kvpress_critical.ops.projected_value_norm import projected_value_norm_ref

PRESSES = [CriticalKVPress, CriticalAdaKVPress]


def test_public_api():
    assert set(kvpress_critical.__all__) >= {
        "CriticalKVPress",
        "CriticalAdaKVPress",
        "projected_value_norm",
        "available_backends",
    }
    assert "torch" in kvpress_critical.available_backends()


@pytest.mark.parametrize("press_cls", PRESSES)
def test_repr_shows_inner_press_and_every_parameter(press_cls):
    press = press_cls(SnapKVPress(0.25, window_size=32), epsilon=1e-3, first_stage_ratio=0.4, norm="l2")
    text = repr(press)
    assert "SnapKVPress(compression_ratio=0.25, window_size=32, kernel_size=5)" in text
    for field in dataclasses.fields(press):
        assert f"{field.name}=" in text
    assert "epsilon=0.001" in text and "first_stage_ratio=0.4" in text and "norm='l2'" in text
    assert "backend='auto'" in text
    assert dataclasses.replace(press, epsilon=0.5).epsilon == 0.5
    assert press == press_cls(SnapKVPress(0.25, window_size=32), epsilon=1e-3, first_stage_ratio=0.4, norm="l2")


@pytest.mark.parametrize("press_cls", PRESSES)
def test_compression_ratio_delegates_to_inner_press(press_cls):
    inner = KnormPress(0.3)
    press = press_cls(inner)
    assert press.compression_ratio == 0.3
    press.compression_ratio = 0.7
    assert inner.compression_ratio == 0.7
    with pytest.raises(ValueError, match=r"compression_ratio must be a number in \[0, 1\)"):
        press.compression_ratio = 1.0
    with pytest.raises(ValueError, match="compression_ratio"):
        press.compression_ratio = -0.1
    assert inner.compression_ratio == 0.7


def test_critical_kv_press_is_a_scorer_press_and_adakv_an_adakv_press():
    assert isinstance(CriticalKVPress(KnormPress(0.5)), ScorerPress)
    assert isinstance(CriticalAdaKVPress(KnormPress(0.5)), AdaKVPress)
    assert CriticalKVPress(KnormPress(0.5), compression_ratio=0.2).press.compression_ratio == 0.2


@pytest.mark.parametrize("press_cls", PRESSES)
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"first_stage_ratio": 1.5}, ValueError, r"first_stage_ratio must be a number in \[0, 1\]"),
        ({"first_stage_ratio": -0.1}, ValueError, "first_stage_ratio"),
        ({"epsilon": -1.0}, ValueError, "epsilon must be a non-negative number"),
        ({"norm": "l3"}, ValueError, "norm must be one of"),
        ({"backend": "cuda-magic"}, ValueError, "unknown backend 'cuda-magic'"),
    ],
)
def test_bad_parameters(press_cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        press_cls(SnapKVPress(0.5), **kwargs)


def test_bad_alpha_safeguard():
    with pytest.raises(ValueError, match=r"alpha_safeguard must be a number in \[0, 1\]"):
        CriticalAdaKVPress(SnapKVPress(0.5), alpha_safeguard=1.2)


@pytest.mark.parametrize("press_cls", PRESSES)
def test_inner_press_must_be_a_scorer(press_cls):
    with pytest.raises(TypeError, match="wraps a kvpress ScorerPress.*got AdaKVPress.*CriticalAdaKVPress"):
        press_cls(AdaKVPress(SnapKVPress(0.5)))
    with pytest.raises(TypeError, match="CriticalKV is applied once"):
        press_cls(CriticalKVPress(SnapKVPress(0.5)))
    with pytest.raises(TypeError, match="ScorerPress"):
        press_cls(None)


def test_inner_press_with_bad_ratio():
    inner = SnapKVPress(0.5)
    inner.compression_ratio = 1.0
    with pytest.raises(ValueError, match="compression_ratio"):
        CriticalKVPress(inner)


def test_expected_attention_with_vnorm_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="kvpress_critical.presses.checks"):
        CriticalKVPress(ExpectedAttentionPress(0.5, use_vnorm=True))
    assert any("use_vnorm=False" in r.getMessage() for r in caplog.records)


def test_unavailable_backend_requested_explicitly():
    saved = dict(PROJECTED_VALUE_NORM.backends)
    PROJECTED_VALUE_NORM.register(Backend("cpp", None, ("cpu",), lambda: "not compiled: run `kvpress-critical-build`"))
    try:
        with pytest.raises(BackendUnavailableError, match="kvpress-critical-build"):
            CriticalKVPress(SnapKVPress(0.5), backend="cpp")
    finally:
        PROJECTED_VALUE_NORM.backends.clear()
        PROJECTED_VALUE_NORM.backends.update(saved)


def test_eager_attention_is_refused_by_the_masking_press():
    model = tiny_model("llama", attn_implementation="eager")
    ids = torch.randint(0, 256, (1, 80))
    with pytest.raises(ValueError, match="eager.*attn_implementation='sdpa'"):
        kept_masks(model, ids, CriticalAdaKVPress(SnapKVPress(0.5)))
    kept_masks(model, ids, CriticalKVPress(SnapKVPress(0.5)))  # pruning works with eager attention


@pytest.mark.parametrize("press_cls", PRESSES)
def test_layer_without_o_proj(press_cls):
    """An attention layer whose output projection has another name (e.g. GPT-NeoX's ``dense``)."""

    class NeoXLikeAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer_idx, self.head_dim = 3, 16
            self.config = tiny_model("llama").config
            self.dense = nn.Linear(64, 64)

    keys = values = torch.randn(1, 2, 20, 16)
    with pytest.raises(TypeError, match=r"NeoXLikeAttention \(layer 3\) has no `o_proj`.*Supported model families"):
        press_cls(KnormPress(0.5)).compress(NeoXLikeAttention(), torch.randn(1, 20, 64), keys, values, None, {})


# ---- quantized o_proj -------------------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """Mimics bitsandbytes' Linear8bitLt after quantization: int8 rows and per-row absmax ``SCB``."""

    def __init__(self, dense):
        super().__init__()
        scb = dense.abs().amax(1)
        self.weight = nn.Parameter(torch.round(dense / scb[:, None] * 127).to(torch.int8), requires_grad=False)
        self.weight.SCB = scb

    def forward(self, x):
        return x @ dense_linear_weight(self).T


class BlockFP8Linear(nn.Module):
    """Mimics transformers' FP8Linear: float8 weight with block-wise inverse scales."""

    def __init__(self, dense, block=(16, 16)):
        super().__init__()
        rows, cols = dense.shape
        blocks = dense.reshape(rows // block[0], block[0], cols // block[1], block[1])
        scale = blocks.abs().amax((1, 3)) / 448.0
        expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        self.weight = nn.Parameter((dense / expanded).to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)


class HasDequantize(nn.Module):
    def __init__(self, dense):
        super().__init__()
        self.packed = dense.clone()

    def dequantize(self):
        return self.packed


class Opaque(nn.Module):
    def __init__(self, dense):
        super().__init__()
        self.qweight = torch.zeros(dense.shape, dtype=torch.int32)


def test_dense_weight_of_quantized_layers():
    dense = torch.randn(64, 64)
    int8 = dense_linear_weight(Int8Linear(dense))
    torch.testing.assert_close(int8, dense, atol=dense.abs().max().item() / 127, rtol=0)
    fp8 = dense_linear_weight(BlockFP8Linear(dense))
    torch.testing.assert_close(fp8, dense, rtol=0.07, atol=1e-3)
    assert torch.equal(dense_linear_weight(HasDequantize(dense)), dense)
    linear = nn.Linear(64, 64)
    assert dense_linear_weight(linear) is linear.weight
    with pytest.raises(TypeError, match=r"layer type .*Opaque .*not a format kvpress-critical knows"):
        dense_linear_weight(Opaque(dense))


def test_quantized_o_proj_in_a_model():
    model = tiny_model("llama", num_layers=1)
    attn = model.model.layers[0].self_attn
    o_proj = attn.o_proj
    try:
        attn.o_proj = Int8Linear(o_proj.weight.data)
        values = torch.randn(1, 2, 9, 16)
        out = module_projected_norm(attn, values, "l1", "auto")
        ref = projected_value_norm_ref(values, dense_linear_weight(attn.o_proj), 4)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert dense_linear_weight(attn.o_proj) is dense_linear_weight(attn.o_proj)  # cached per layer
        attn.o_proj = Opaque(o_proj.weight.data)
        with pytest.raises(TypeError, match=r"LlamaAttention \(layer 0\).*Opaque"):
            module_projected_norm(attn, values, "l1", "auto")
    finally:
        attn.o_proj = o_proj


def test_the_ops_import_without_kvpress_and_the_presses_say_what_to_install():
    """`import kvpress_critical` and the ops need torch only; a press asked for without kvpress names the fix."""
    script = (
        "import sys\n"
        "sys.modules['kvpress'] = None  # as if kvpress were not installed\n"
        "import torch, kvpress_critical\n"
        "from kvpress_critical.ops.projected_value_norm import projected_value_norm\n"
        "assert projected_value_norm(torch.ones(1, 1, 3, 4), torch.ones(5, 8), 2, backend='torch').shape == (1, 1, 3)\n"
        "assert 'kvpress' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n"
        "    kvpress_critical.CriticalKVPress\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "needs kvpress" in run.stdout and "pip install 'kvpress>=0.5.5,<0.6'" in run.stdout
