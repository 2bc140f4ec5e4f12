"""The observation-window queries of a transformers attention layer, and their attention in float32, by KV head."""

import torch
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.selection import window_attention as grouped_window_attention


def window_queries(module, hidden_states: torch.Tensor, window: int, position_embeddings) -> torch.Tensor:
    """``(B, H, W, d)`` post-RoPE queries of the last ``W`` positions, recomputed from the layer's input."""
    query = get_prerope_query_states(module, hidden_states[:, -window:])  # (B, H, W, d)
    cos, sin = position_embeddings
    cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
    return query * cos + rotate_half(query) * sin


def window_attention(layer: LayerInput, window: int) -> torch.Tensor:
    """
    ``(B, H_kv, G, W, T)`` float32 attention of the last ``W`` queries of the prefill over all ``T`` entries.

    Full rows (the window's own entries last, causal among them), so a row sums to 1. With eager attention the
    model's own weights (``layer.attentions``, ``(B, H, T, T)``) are used, which are the same numbers; otherwise the
    window queries are recomputed from the layer's input with kvpress's ``get_prerope_query_states`` and the
    layer's RoPE, and :func:`kvpress_critical.selection.window_attention` attends them in float32 without copying
    the keys ``G`` times (kvpress's ``SnapKVPress.compute_window_attention`` returns probabilities in the model's
    dtype, whose bf16 rounding a worst-case aggregation would pick up). The layer's excluded entries (a chunked
    prefill's evicted entries, the padding of a compact view) get no attention.
    """
    module, keys = layer.module, layer.keys
    bsz, num_kv_heads, k_len, head_dim = keys.shape
    group = module.config.num_attention_heads // num_kv_heads
    if layer.attentions is not None and layer.excluded is None:
        return layer.attentions[..., -window:, :].float().reshape(bsz, num_kv_heads, group, window, k_len)
    queries = window_queries(module, layer.hidden_states, window, layer.kwargs["position_embeddings"])
    scaling = getattr(module, "scaling", head_dim**-0.5)
    return grouped_window_attention(queries, keys, scaling, layer.excluded)
