"""Which entries a compressed request keeps, per KV head of one layer: this project's selection rules, nothing new.

The base scores come from :mod:`kvpress_critical.selection.scorers` (checked bitwise against kvpress's SnapKV,
Knorm and StreamingLLM presses), CriticalKV's two stages from :mod:`kvpress_critical.selection.criticalkv`, AdaKV's
head-wise budgets (and CriticalKV inside them) from :mod:`kvpress_critical.selection.adakv`, the projected-value norms
from :func:`kvpress_critical.projected_value_norm`: the same calls ``CriticalKVPress(SnapKVPress(...))`` and
``CriticalAdaKVPress(SnapKVPress(...))`` make in transformers for a budget of ``n_kept`` per head.

Memory: a layer is scored a few KV heads at a time (every score here depends on one KV head's keys, values and
query group), so what a compaction holds beside the model is bounded by :func:`compaction_bytes` for a chunk of
heads, not by the whole layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpress_critical.ops.projected_value_norm import projected_value_norm
from kvpress_critical.selection import (
    adaptive_head_budgets,
    critical_adakv_keep_mask,
    critical_scores,
    first_stage_budget,
    knorm_scores,
    snapkv_pad_window,
    snapkv_pooled_scores,
    streaming_llm_scores,
    top_budget_mask,
)
from kvpress_critical_vllm.options import CompressionOptions

# the largest working set of one chunk of KV heads (heads are scored together while it fits)
CHUNK_BYTES = 256 * 2**20

Reader = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (first, end) KV heads -> (N, h, d) keys, values


def compaction_bytes(n_prompt: int, heads: int, group: int, head_size: int, itemsize: int, window: int) -> int:
    """
    Bytes a compaction holds for ``heads`` KV heads of one layer (beyond the scores kept per layer, ``12 * N`` bytes
    per KV head): the keys and values read back (``2 N h d e``), SnapKV's keys repeated over the query group and its
    window attention (``G h N (d e + W (4 + 3 e))``, the float32 softmax and three tensors in the model's dtype),
    and the slot indices (``24 N``), ``e`` the cache's bytes per element.
    """
    read_back = 2 * n_prompt * heads * head_size * itemsize
    window_attention = group * heads * n_prompt * (head_size * itemsize + window * (4 + 3 * itemsize)) if window else 0
    return read_back + window_attention + 24 * n_prompt


def compaction_peak_bytes(
    n_prompt: int, num_kv_heads: int, group: int, head_size: int, itemsize: int, window: int, layers: int,
    head_wise: bool = True,
) -> int:  # fmt: skip
    """
    The most a compaction of an ``n_prompt``-token request holds beside the model and its cache (what
    :meth:`~kvpress_critical_vllm.compaction.Compactor.compact` allocates): one chunk of KV heads
    (:func:`compaction_bytes`, at most :data:`CHUNK_BYTES` unless one head needs more), the layer's scores and
    ranks (``40 H_kv N``), every layer's keep mask until it is written (``L H_kv N``, bool) and the kept keys and
    values while they are written (one head's, ``2 N d e``, with uniform budgets; the layer's, ``2 N H_kv d e``, with
    head-wise ones, which are moved into whole blocks). The worker reserves it from the KV pool on GPUs.
    """
    per_head = compaction_bytes(n_prompt, 1, group, head_size, itemsize, window)
    chunk = max(1, min(num_kv_heads, CHUNK_BYTES // max(per_head, 1)))
    held = compaction_bytes(n_prompt, chunk, group, head_size, itemsize, window)
    written = 2 * n_prompt * (num_kv_heads if head_wise else 1) * head_size * itemsize
    return held + 40 * num_kv_heads * n_prompt + layers * num_kv_heads * n_prompt + written


def window_queries_bytes(requests: int, layers: int, window: int, num_heads: int, head_size: int, itemsize: int) -> int:
    """What ``requests`` requests hold at most in window queries: SnapKV scores a compaction with its last ``window``
    queries of every layer, kept (``L W H d e`` bytes each, ``H`` the query heads) from the step they are computed in
    until the compaction, when that comes steps later (a last prompt chunk shorter than the window, every decoding
    compaction). The worker reserves it for ``max_num_seqs`` requests beside :func:`compaction_peak_bytes`."""
    return requests * layers * window * num_heads * head_size * itemsize


def heads_per_chunk(
    options: CompressionOptions, n_prompt: int, num_kv_heads: int, group: int, head_size: int, itemsize: int
) -> int:
    """How many KV heads are scored together: all of them while :data:`CHUNK_BYTES` holds them, else fewer."""
    window = options.window_size if options.needs_queries else 0
    per_head = compaction_bytes(n_prompt, 1, group, head_size, itemsize, window)
    return max(1, min(num_kv_heads, CHUNK_BYTES // max(per_head, 1)))


def layer_scores(
    options: CompressionOptions,
    read: Reader,
    num_kv_heads: int,
    n_keep: int,
    queries: torch.Tensor | None = None,
    o_proj_weight: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """
    A layer's base scores ``(1, H_kv, T)`` (SnapKV's before its window is padded: ``T = N - W``) and, for CriticalKV,
    its projected-value norms ``(1, H_kv, N)``, scored ``chunk`` KV heads at a time.

    Parameters
    ----------
    options : CompressionOptions
        The request's press and its parameters.
    read : callable
        ``read(first, end)`` returns the ``(N, end - first, d)`` post-RoPE keys and the values of the whole prompt for
        KV heads ``first .. end - 1``, as the paged cache holds them.
    num_kv_heads : int
        KV heads of the layer (on this rank).
    n_keep : int
        Entries per head (``Eviction.kept``; on average over the heads for head-wise presses).
    queries : torch.Tensor, optional
        ``(W, H, d)`` post-RoPE queries of the prompt's last ``W >= window_size`` positions (SnapKV-based presses).
    o_proj_weight : torch.Tensor, optional
        ``(D, H * d)`` output projection of the layer (this rank's shard under tensor parallelism), for CriticalKV.
    chunk : int, optional
        KV heads scored together (all of them when None).
    """
    if options.needs_queries and queries is None:
        raise ValueError("SnapKV-based presses need the prompt's window queries")
    if options.critical and o_proj_weight is None:
        raise ValueError("CriticalKV needs the layer's output projection")
    chunk = chunk or num_kv_heads
    base_parts, norm_parts = [], []
    for first in range(0, num_kv_heads, chunk):
        end = min(first + chunk, num_kv_heads)
        keys, values = read(first, end)  # (N, h, d)
        n_prompt, _, head_size = keys.shape
        keys_b = keys.permute(1, 0, 2).unsqueeze(0)  # (1, h, N, d)
        if options.base == "snapkv":
            group = queries.shape[1] // num_kv_heads
            window_queries = queries[:, first * group : end * group].permute(1, 0, 2).unsqueeze(0)  # (1, G h, W, d)
            if n_prompt <= options.window_size:
                base_parts.append(torch.ones(1, end - first, n_prompt, device=keys.device))
            else:
                base_parts.append(
                    snapkv_pooled_scores(window_queries, keys_b, options.window_size, options.kernel_size)
                )
        elif options.base == "knorm":
            base_parts.append(knorm_scores(keys_b))
        else:
            base_parts.append(streaming_llm_scores(keys_b, n_keep, options.n_sink))
        if options.critical:
            values_b = values.permute(1, 0, 2).unsqueeze(0)
            group_size = o_proj_weight.shape[1] // head_size // num_kv_heads
            columns = slice(first * group_size * head_size, end * group_size * head_size)
            norm_parts.append(
                projected_value_norm(
                    values_b, o_proj_weight[:, columns], (end - first) * group_size, norm=options.norm,
                    backend=options.backend,
                )
            )  # fmt: skip
        del keys, values, keys_b
    return torch.cat(base_parts, dim=1), torch.cat(norm_parts, dim=1) if options.critical else None


def select(
    options: CompressionOptions, base: torch.Tensor, norms: torch.Tensor | None, n_keep: int, n_prompt: int
) -> torch.Tensor:
    """
    ``(H_kv, N)`` bool from :func:`layer_scores` (of every head of the layer, for head-wise presses): uniform presses
    keep ``n_keep`` in every head, head-wise ones (AdaKV's budgets) ``n_keep * H_kv`` over the heads, each head its
    own count.
    """
    if options.base == "snapkv" and base.shape[-1] + options.window_size == n_prompt:
        base = snapkv_pad_window(base, options.window_size)  # the window: the maximum over every head + 1
    base = base.float()
    if options.head_wise and options.critical:
        keep, _, _ = critical_adakv_keep_mask(
            base, norms, n_keep, options.alpha_safeguard, options.first_stage_ratio, options.epsilon
        )
    elif options.head_wise:
        keep = top_budget_mask(base, adaptive_head_budgets(base, n_keep, options.alpha_safeguard))
    else:
        if options.critical:
            base = critical_scores(base, norms, first_stage_budget(n_keep, options.first_stage_ratio), options.epsilon)
        keep = top_budget_mask(base, torch.full(base.shape[:2], n_keep, device=base.device))
    return keep[0]


def keep_mask(
    options: CompressionOptions,
    read: Reader,
    num_kv_heads: int,
    n_keep: int,
    queries: torch.Tensor | None = None,
    o_proj_weight: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """``(H_kv, N)`` bool: the entries each KV head keeps (:func:`layer_scores` then :func:`select`, one rank); ``N``
    is read from the keys (``read``)."""
    sizes = []

    def sized(first: int, end: int):
        keys, values = read(first, end)
        sizes.append(keys.shape[0])
        return keys, values

    base, norms = layer_scores(options, sized, num_kv_heads, n_keep, queries, o_proj_weight, chunk)
    return select(options, base, norms, n_keep, sizes[0])
