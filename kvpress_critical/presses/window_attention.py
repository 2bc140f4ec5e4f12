"""The observation-window attention SnapKV-style scorers start from, in float32 and grouped by KV head."""

import torch
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

from kvpress_critical.presses.exclusion import excluded_entries


def window_attention(module, hidden_states, keys, window: int, position_embeddings, attentions=None) -> torch.Tensor:
    """
    ``(B, H_kv, G, W, T)`` float32 attention of the last ``W`` queries of the prefill over all ``T`` entries.

    Full rows (the window's own entries last, causal among them), so a row sums to 1. With eager attention the
    model's own weights (``attentions``, ``(B, H, T, T)``) are used, which are the same numbers; otherwise the
    window queries are recomputed from the layer's input with kvpress's ``get_prerope_query_states`` and the
    layer's RoPE (as kvpress's ``SnapKVPress.compute_window_attention``, but in float32 and without copying the
    keys ``G`` times: kvpress's version returns probabilities in the model's dtype, whose bf16 rounding a worst-case
    aggregation would pick up). Entries excluded by a chunked prefill (:mod:`~kvpress_critical.presses.exclusion`)
    get no attention.
    """
    bsz, num_kv_heads, k_len, head_dim = keys.shape
    heads = module.config.num_attention_heads
    group = heads // num_kv_heads
    excluded = excluded_entries()
    if attentions is not None and excluded is None:
        return attentions[..., -window:, :].float().reshape(bsz, num_kv_heads, group, window, k_len)
    query = get_prerope_query_states(module, hidden_states[:, -window:])  # (B, H, W, d)
    cos, sin = position_embeddings
    cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
    query = (query * cos + rotate_half(query) * sin).float()
    query = query.view(bsz, num_kv_heads, group, window, head_dim)
    scaling = getattr(module, "scaling", head_dim**-0.5)
    scores = torch.einsum("bhgwd,bhtd->bhgwt", query, keys.float()) * scaling  # (B, H_kv, G, W, T)
    causal = (
        torch.arange(k_len, device=keys.device)[None, :]
        > (k_len - window + torch.arange(window, device=keys.device))[:, None]
    )
    scores.masked_fill_(causal, float("-inf"))
    if excluded is not None:
        scores.masked_fill_(excluded.to(scores.device)[:, :, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)
