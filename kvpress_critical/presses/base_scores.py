"""The base score ``A`` of CriticalKV: the inner press's scores, checked and in float32."""

import logging

import torch
from kvpress import ScorerPress, SnapKVPress

logger = logging.getLogger(__name__)

_warned_short_context = False


def base_scores(press: ScorerPress, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
    """
    ``(B, H_kv, k_len)`` float32 scores of ``press``.

    SnapKV scores every entry of its observation window (the last ``window_size`` tokens) with the same
    top score. When the context is not longer than the window, every entry is in it, so the scores are
    uniform (kvpress's SnapKVPress asserts instead): CriticalKV then ranks by the projected-value norm.

    The result is always contiguous, whatever strides the scorer returns (KVzap's scores are a transposed
    view): every selection function downstream may reshape it freely.
    """
    global _warned_short_context
    if isinstance(press, SnapKVPress) and hidden_states.shape[1] <= press.window_size:
        if not _warned_short_context:
            _warned_short_context = True
            logger.warning(
                "context of %d tokens is not longer than %s's window (%d): every entry is in the observation "
                "window, so base scores are uniform and CriticalKV ranks by the projected-value norm",
                hidden_states.shape[1],
                type(press).__name__,
                press.window_size,
            )
        return torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device)
    scores = press.score(module, hidden_states, keys, values, attentions, kwargs)
    if scores.shape != keys.shape[:3]:
        raise ValueError(
            f"{type(press).__name__}.score returned shape {tuple(scores.shape)}, expected "
            f"(batch, kv_heads, k_len) = {tuple(keys.shape[:3])}"
        )
    return scores.float().contiguous()
