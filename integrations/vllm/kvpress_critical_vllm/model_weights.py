"""The model's weights the plugin reads: each attention layer's dense output projection ``W_O``, which CriticalKV's
projected norm multiplies the values by."""

from __future__ import annotations

import torch

from kvpress_critical_vllm.vllm_compat import attention_modules


@torch.no_grad()
def dense_weight(linear: torch.nn.Module) -> torch.Tensor | None:
    """
    ``(out, in)`` dense weight of a vLLM linear layer (this rank's shard), or None if it is not unquantized.

    On CPUs vLLM packs unquantized weights for oneDNN after loading and empties ``weight``; the packed layer applied
    to the identity gives the weight back exactly (each output is one product by 1.0), once per layer. That copy is
    the plugin's largest resident memory on CPUs: every layer's ``o_proj``, ``L * D * H * d`` elements (1 GiB for
    Llama-3.1-8B in bfloat16); on GPUs the model's own weight is read.
    """
    weight = getattr(linear, "weight", None)
    method = getattr(linear, "quant_method", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dtype.itemsize < 2:
        return None
    if weight.dim() == 2 and weight.numel() > 0:
        return weight.detach()
    if type(method).__name__ != "UnquantizedLinearMethod":
        return None
    identity = torch.eye(linear.input_size_per_partition, dtype=weight.dtype, device=weight.device)
    return method.apply(linear, identity).t().contiguous()


def output_projections(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{attention layer name: dense (D, H * d) o_proj weight}`` of every full-attention layer, in the model's order
    (``<prefix>.attn`` beside ``<prefix>.o_proj``); an :class:`~kvpress_critical_vllm.engine_config.EngineConfigError`
    where a layer has none the plugin can read. A hybrid model's sliding-window layers are never compressed (vLLM
    keeps them in groups of their own), so their weight is not copied."""
    from kvpress_critical_vllm.engine_config import EngineConfigError

    modules = dict(model.named_modules())
    weights = {}
    for name, module in attention_modules(model):
        if module.sliding_window is not None:
            continue
        o_proj = getattr(modules.get(name.rpartition(".")[0]), "o_proj", None)
        weight = dense_weight(o_proj) if o_proj is not None else None
        if weight is None:
            raise EngineConfigError(
                f"kvpress_critical cannot compress with this model: attention layer {module.layer_name} has no "
                "unquantized o_proj beside it, whose weight CriticalKV's projected norm reads. Supported: "
                "models whose attention block holds `attn` and a dense `o_proj` (Llama, Mistral, Qwen2/3, Phi-3)."
            )
        weights[module.layer_name] = weight
    if not weights:
        raise EngineConfigError("kvpress_critical found no attention layer to compress in this model")
    return weights
