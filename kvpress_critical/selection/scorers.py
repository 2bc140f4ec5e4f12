"""Base scores computed from tensors alone: SnapKV's observation-window attention, key norms, StreamingLLM.

Each function takes what an attention layer holds after its prefill (post-RoPE window queries, cached keys) and
returns ``(B, H_kv, T)`` scores whose per-head top-``n_kept`` is the press's selection. They need torch only, so the
same rules run inside kvpress's hooks (through kvpress's own presses, which the tests check these functions
against, entry for entry) and inside a serving engine that has no kvpress (the vLLM plugin).
"""

import math

import torch
import torch.nn.functional as F


def _grouped_window_logits(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``(B, H_kv, G, W, T)`` float32 ``q . k * scale`` of the window queries, causal among the window's own entries."""
    bsz, num_kv_heads, k_len, head_dim = keys.shape
    window = queries.shape[2]
    group = queries.shape[1] // num_kv_heads
    query = queries.float().reshape(bsz, num_kv_heads, group, window, head_dim)
    logits = torch.einsum("bhgwd,bhtd->bhgwt", query, keys.float()) * scale
    positions = torch.arange(k_len, device=keys.device)
    causal = positions[None, :] > (k_len - window + torch.arange(window, device=keys.device))[:, None]
    return logits.masked_fill_(causal, float("-inf"))


def window_attention(
    queries: torch.Tensor, keys: torch.Tensor, scale: float, excluded: torch.Tensor | None = None
) -> torch.Tensor:
    """
    ``(B, H_kv, G, W, T)`` float32 attention of the last ``W`` queries of a prefill over all ``T`` cached entries.

    Full rows (the window's own entries last, causal among them), so each row sums to 1; the keys are never copied
    ``G`` times (grouped-query heads share their KV head's keys).

    Parameters
    ----------
    queries : torch.Tensor
        ``(B, H, W, d)`` post-RoPE queries of the prefill's last ``W`` positions, query heads grouped by KV head
        (head ``h`` reads KV head ``h // G``, as transformers and vLLM lay them out).
    keys : torch.Tensor
        ``(B, H_kv, T, d)`` post-RoPE cached keys; the window's own keys are the last ``W``.
    scale : float
        The layer's softmax scale (``head_dim ** -0.5`` for most models).
    excluded : torch.Tensor, optional
        ``(B, H_kv, T)`` bool, entries that get no attention (evicted by an earlier chunk, padding).
    """
    logits = _grouped_window_logits(queries, keys, scale)
    if excluded is not None:
        logits.masked_fill_(excluded.to(logits.device)[:, :, None, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1)


def snapkv_scores(queries: torch.Tensor, keys: torch.Tensor, window_size: int, kernel_size: int) -> torch.Tensor:
    """
    SnapKV's scores (https://arxiv.org/abs/2404.14469) as kvpress's ``SnapKVPress.score`` computes them, in float32.

    The same arithmetic in the same order and dtypes as kvpress 0.5.5 (logits in the keys' dtype divided by
    ``sqrt(d)``, softmax in float32 rounded back to the keys' dtype, mean over the window queries, average pooling,
    mean over each KV head's query group, the window itself padded with the maximum + 1), so that on the same
    tensors the scores are bitwise kvpress's. When the prompt is not longer than the window every entry is in it:
    the scores are uniform (kvpress asserts instead; CriticalKV then ranks by the projected norm alone).

    Parameters
    ----------
    queries : torch.Tensor
        ``(B, H, W', d)`` post-RoPE queries of the prompt's last ``W' >= window_size`` positions (only the last
        ``window_size`` are used).
    keys : torch.Tensor
        ``(B, H_kv, T, d)`` post-RoPE keys of the whole prompt.
    window_size, kernel_size : int
        SnapKV's observation window and pooling kernel (kvpress's defaults: 64 and 5).
    """
    if keys.shape[2] <= window_size:
        return torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device)
    return snapkv_pad_window(snapkv_pooled_scores(queries, keys, window_size, kernel_size), window_size)


def snapkv_pooled_scores(queries: torch.Tensor, keys: torch.Tensor, window_size: int, kernel_size: int) -> torch.Tensor:
    """
    ``(B, H_kv, T - W)`` SnapKV scores of the entries before the window, in the keys' dtype (before
    :func:`snapkv_pad_window`). Each KV head's scores depend on its own keys and query group only, so a long prompt
    can be scored a few KV heads at a time (the vLLM plugin bounds its memory that way) and concatenated.
    """
    bsz, num_kv_heads, k_len, head_dim = keys.shape
    query = queries[:, :, -window_size:].to(keys.dtype)
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    # kvpress's compute_window_attention: repeat_kv, matmul, / sqrt(d), causal mask, float32 softmax, back to dtype
    key_states = keys[:, :, None].expand(bsz, num_kv_heads, group, k_len, head_dim)
    key_states = key_states.reshape(bsz, num_heads, k_len, head_dim)
    weights = torch.matmul(query, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    causal = torch.triu(torch.ones(window_size, k_len, dtype=torch.bool, device=keys.device), k_len - window_size + 1)
    weights = weights.masked_fill(causal, float("-inf"))
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)[..., :-window_size]
    scores = weights.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    return scores.view(bsz, num_kv_heads, group, k_len - window_size).mean(2)


def snapkv_pad_window(pooled: torch.Tensor, window_size: int) -> torch.Tensor:
    """SnapKV's scores from :func:`snapkv_pooled_scores`: the window's entries get the maximum + 1 (of all heads)."""
    return F.pad(pooled, (0, window_size), value=pooled.max().item() + 1).float()


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """Key-norm scores (https://arxiv.org/abs/2406.11430): ``-||k||_2`` per entry, in at least float32 (kvpress's)."""
    return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.promote_types(keys.dtype, torch.float32)).float()


def streaming_llm_scores(keys: torch.Tensor, n_kept: int, n_sink: int = 4) -> torch.Tensor:
    """
    StreamingLLM's scores (https://arxiv.org/abs/2309.17453): 1 for the ``n_sink`` first entries and the most recent
    ones, 0 for the ``T - n_kept`` entries right after the sinks (kvpress's ``StreamingLLMPress`` for a budget of
    ``n_kept``). Exactly ``n_kept`` entries score 1 whenever ``n_kept >= n_sink``.
    """
    k_len = keys.shape[2]
    if k_len <= n_sink:
        raise ValueError(f"StreamingLLM needs more entries than its {n_sink} sink tokens, got {k_len}")
    scores = torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device)
    scores[:, :, n_sink : n_sink + k_len - n_kept] = 0
    return scores
