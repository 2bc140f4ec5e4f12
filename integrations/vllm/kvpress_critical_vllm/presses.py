"""Which entries a compressed request keeps, per KV head of one layer: this project's selection rules, nothing new.

The base scores come from :mod:`kvpress_critical.selection.scorers` (checked bitwise against kvpress's SnapKV,
Knorm and StreamingLLM presses), CriticalKV's two stages from :mod:`kvpress_critical.selection.criticalkv`, the
projected-value norms from :func:`kvpress_critical.projected_value_norm`: the same calls
``CriticalKVPress(SnapKVPress(...)).keep_mask(..., n_kept)`` makes in transformers.
"""

from __future__ import annotations

import torch

from kvpress_critical.ops.projected_value_norm import projected_value_norm
from kvpress_critical.selection import (
    critical_scores,
    first_stage_budget,
    knorm_scores,
    snapkv_scores,
    streaming_llm_scores,
    top_budget_mask,
)
from kvpress_critical_vllm.options import CompressionOptions


def keep_positions(
    options: CompressionOptions,
    keys: torch.Tensor,
    values: torch.Tensor,
    n_keep: int,
    queries: torch.Tensor | None = None,
    o_proj_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    ``(H_kv, n_keep)`` positions each KV head keeps, ascending.

    Parameters
    ----------
    options : CompressionOptions
        The request's press and its parameters.
    keys, values : torch.Tensor
        ``(N, H_kv, d)`` post-RoPE keys and the values of the whole prompt, as the paged cache holds them.
    n_keep : int
        Entries per head (``Eviction.kept``).
    queries : torch.Tensor, optional
        ``(W, H, d)`` post-RoPE queries of the prompt's last ``W >= window_size`` positions (SnapKV-based presses).
    o_proj_weight : torch.Tensor, optional
        ``(D, H * d)`` output projection of the layer (this rank's shard under tensor parallelism), for CriticalKV.
    """
    keys_b = keys.permute(1, 0, 2).unsqueeze(0)  # (1, H_kv, N, d)
    if options.base == "snapkv":
        if queries is None:
            raise ValueError("SnapKV-based presses need the prompt's window queries")
        base = snapkv_scores(queries.permute(1, 0, 2).unsqueeze(0), keys_b, options.window_size, options.kernel_size)
    elif options.base == "knorm":
        base = knorm_scores(keys_b)
    else:
        base = streaming_llm_scores(keys_b, n_keep, options.n_sink)
    if options.critical:
        if o_proj_weight is None:
            raise ValueError("CriticalKV needs the layer's output projection")
        values_b = values.permute(1, 0, 2).unsqueeze(0)
        heads = o_proj_weight.shape[1] // values.shape[-1]
        norms = projected_value_norm(values_b, o_proj_weight, heads, norm=options.norm, backend=options.backend)
        scores = critical_scores(base, norms, first_stage_budget(n_keep, options.first_stage_ratio), options.epsilon)
    else:
        scores = base
    keep = top_budget_mask(scores, torch.full(scores.shape[:2], n_keep, device=scores.device))[0]  # (H_kv, N)
    return keep.nonzero()[:, 1].view(keep.shape[0], n_keep)
