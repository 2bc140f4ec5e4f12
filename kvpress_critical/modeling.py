"""What the presses need from a transformers attention layer: its output projection as a dense weight,
its head geometry, and its attention implementation.

Head sizes are read from the module and the weight, never from ``module.config.head_dim`` (Qwen2 and
Phi-3 configs have no ``head_dim``; Gemma3's differs from ``hidden_size / num_heads``).
"""

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary
from transformers import Gemma3ForConditionalGeneration

from kvpress_critical.ops.projected_value_norm import projected_value_norm

SUPPORTED_FAMILIES = "Llama, Mistral, Phi-3, Qwen2, Qwen3, Gemma3"

# dense weights of quantized o_proj layers, computed once per layer (and per in-place update)
_DENSE_WEIGHT_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _layer_name(module: nn.Module) -> str:
    idx = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {idx})" if idx is not None else "")


def decoder(model: nn.Module) -> nn.Module:
    """The text decoder of a causal LM (``model.model``; Gemma3's multimodal models: ``model.model.language_model``)."""
    return model.model.language_model if hasattr(model.model, "language_model") else model.model


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The ``self_attn`` module of every decoder layer."""
    return [layer.self_attn for layer in decoder(model).layers]


def hooked_attention_modules(model: nn.Module) -> list[nn.Module]:
    """
    The attention modules kvpress compresses: every layer's, except the sliding-window layers of
    ``Gemma3ForConditionalGeneration`` (kvpress's ``BasePress.__call__`` hooks only its global layers).
    """
    modules = attention_modules(model)
    if isinstance(model, Gemma3ForConditionalGeneration):
        modules = [m for m in modules if not getattr(m, "is_sliding", False)]
    return modules


def get_o_proj(module: nn.Module) -> nn.Module:
    """The output projection of an attention layer, or a ``TypeError`` that says what is missing."""
    o_proj = getattr(module, "o_proj", None)
    if o_proj is None:
        raise TypeError(
            f"CriticalKV weighs values by the attention output projection, but {_layer_name(module)} has no "
            f"`o_proj` attribute. Supported model families: {SUPPORTED_FAMILIES}; for another architecture, "
            "expose its output projection as `self_attn.o_proj` (an nn.Linear of shape (hidden, heads * head_dim))."
        )
    return o_proj


def _float8_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(
        getattr(torch, n)
        for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
        if hasattr(torch, n)
    )


def _dequantize(linear: nn.Module) -> torch.Tensor | None:
    """Dense ``(out, in)`` weight of a quantized linear layer, or None if its format is unknown."""
    weight = getattr(linear, "weight", None)
    # bitsandbytes 4-bit: Params4bit carries its quant_state
    if weight is not None and getattr(weight, "quant_state", None) is not None:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state)
    # bitsandbytes LLM.int8(): int8 rows with per-row absmax SCB
    scb = getattr(weight, "SCB", None) if weight is not None else None
    if scb is None and weight is not None and weight.dtype == torch.int8:
        scb = getattr(getattr(linear, "state", None), "SCB", None)
    if scb is not None and weight.dtype == torch.int8:
        return weight.data.float() * (scb.float().unsqueeze(1) / 127.0)
    # fp8 weights with block-wise inverse scales (transformers' FP8Linear, DeepSeek-style checkpoints)
    if weight is not None and weight.dtype in _float8_dtypes():
        scale = getattr(linear, "weight_scale_inv", None)
        if scale is None:
            scale = getattr(linear, "weight_scale", None)
        if scale is None:
            return None
        scale = scale.float()
        if scale.dim() == 2:  # block scales -> expand to the weight's shape
            rows = -(-weight.shape[0] // scale.shape[0])
            cols = -(-weight.shape[1] // scale.shape[1])
            scale = scale.repeat_interleave(rows, 0)[: weight.shape[0]].repeat_interleave(cols, 1)[:, : weight.shape[1]]
        return weight.float() * scale
    # HQQ, torchao and others expose a dequantize() method
    if callable(getattr(linear, "dequantize", None)):
        dense = linear.dequantize()
        if isinstance(dense, torch.Tensor) and dense.dim() == 2:
            return dense
    return None


def dense_linear_weight(linear: nn.Module, owner: nn.Module | None = None) -> torch.Tensor:
    """
    ``(out_features, in_features)`` floating-point weight of a (possibly quantized) linear layer.

    Plain ``nn.Linear`` weights are returned as they are. Quantized layers (bitsandbytes 4-bit and 8-bit,
    fp8 with scales, anything with ``dequantize()``) are dequantized once and cached per layer.
    Anything else raises a ``TypeError`` naming the layer type.
    """
    weight = getattr(linear, "weight", None)
    plain = isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.dtype not in _float8_dtypes()
    if plain and type(weight) in (torch.Tensor, nn.Parameter):
        return weight
    cached = _DENSE_WEIGHT_CACHE.get(linear)
    version = weight._version if isinstance(weight, torch.Tensor) else None
    if cached is not None and cached[0] == version:
        return cached[1]
    dense = _dequantize(linear)
    if dense is None and plain:
        dense = weight
    if dense is None:
        where = f" in {_layer_name(owner)}" if owner is not None else ""
        raise TypeError(
            f"cannot get a dense weight from the output projection{where}: layer type "
            f"{type(linear).__module__}.{type(linear).__name__} with weight "
            f"{type(weight).__name__ if weight is not None else None} "
            f"({getattr(weight, 'dtype', None)}) is not a format kvpress-critical knows how to dequantize "
            "(supported: nn.Linear, bitsandbytes Linear4bit/Linear8bitLt, fp8 weights with weight_scale_inv, "
            "modules with a dequantize() method). Load the model unquantized or give the layer a dequantize() method."
        )
    dense = dense.detach()
    _DENSE_WEIGHT_CACHE[linear] = (version, dense)
    return dense


def check_attention_supports_masking(config, press_name: str) -> None:
    """Head-wise presses need kvpress's attention patch, which eager attention does not have."""
    impl = getattr(config, "_attn_implementation", None)
    if impl == "eager":
        raise ValueError(
            f"{press_name} evicts head-wise by masking keys through kvpress's attention patch, which kvpress "
            "applies to every attention function except eager. Load the model with "
            "attn_implementation='sdpa' (or 'flash_attention_2'), e.g. "
            "pipeline('kv-press-text-generation', model=..., model_kwargs={'attn_implementation': 'sdpa'})."
        )


def module_projected_norm(module: nn.Module, values: torch.Tensor, norm: str, backend: str) -> torch.Tensor:
    """``(B, H_kv, T)`` float32 projected-value norms of ``values`` for the attention layer ``module``."""
    weight = dense_linear_weight(get_o_proj(module), owner=module)
    head_dim = values.shape[-1]
    if weight.shape[1] % head_dim:
        raise ValueError(
            f"{_layer_name(module)}: o_proj has {weight.shape[1]} input features, not a multiple of the cached "
            f"values' head_dim {head_dim}"
        )
    if weight.device != values.device:
        weight = weight.to(values.device)
    heads = weight.shape[1] // head_dim
    return projected_value_norm(values, weight, heads, norm=norm, backend=backend)
