"""The base score ``A`` of CriticalKV: the inner press's scores, checked, in float32, exclusions at ``-inf``."""

import logging
from contextlib import contextmanager

import torch
from kvpress import ScorerPress, SnapKVPress

from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.presses.window_attention import window_attention

logger = logging.getLogger(__name__)

_warned_short_context = False


@contextmanager
def ratio_for_budget(press, k_len: int, n_kept: int):
    """
    ``press.compression_ratio`` set, for the block, to a ratio that keeps ``n_kept`` of ``k_len`` entries
    (``int(k_len * (1 - ratio)) == n_kept``), as kvpress's ``DecodingPress`` sets its base press's: scorers whose scores
    depend on the ratio (StreamingLLM evicts exactly ``k_len - n_kept`` entries after its sinks) then score for the
    budget they are given, not for the ratio they were built with.
    """
    ratio = min(max(1.0 - (n_kept + 0.5) / k_len, 0.0), 1.0) if k_len else 0.0
    original = press.compression_ratio
    press.compression_ratio = ratio
    try:
        yield
    finally:
        press.compression_ratio = original


def base_scores(press: ScorerPress, layer: LayerInput, n_kept: int | None = None) -> torch.Tensor:
    """
    ``(B, H_kv, k_len)`` float32 scores of ``press`` on ``layer`` (for a budget of ``n_kept`` entries per head, when
    the scores depend on it: :func:`ratio_for_budget`).

    SnapKV scores every entry of its observation window (the last ``window_size`` tokens) with the same
    top score. When the context is not longer than the window, every entry is in it, so the scores are
    uniform (kvpress's SnapKVPress asserts instead): CriticalKV then ranks by the projected-value norm.

    Entries the layer excludes (:attr:`~kvpress_critical.presses.layer_input.LayerInput.excluded`: evicted after an
    earlier chunk, padding of the compact layout's view) get ``-inf``; SnapKV's window attention gives them no weight:
    it is computed here with the exclusions (:func:`~kvpress_critical.presses.window_attention.window_attention`) and
    handed to SnapKV's own ``score`` as the ``attentions`` it reads when the model's are given.

    The result is always contiguous, whatever strides the scorer returns (KVzap's scores are a transposed
    view): every selection function downstream may reshape it freely.
    """
    global _warned_short_context
    keys, hidden_states = layer.keys, layer.hidden_states
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
        return layer.mask_excluded(torch.ones(keys.shape[:3], dtype=torch.float32, device=keys.device))
    attentions = layer.attentions
    if isinstance(press, SnapKVPress) and layer.excluded is not None:
        window = press.window_size
        weights = window_attention(layer, window)
        bsz, num_kv_heads, group, _, k_len = weights.shape
        # as kvpress's own window attention: probabilities in the keys' dtype, one row per query head and window query
        attentions = weights.reshape(bsz, num_kv_heads * group, window, k_len).to(keys.dtype)
    if n_kept is None:
        scores = press.score(layer.module, hidden_states, keys, layer.values, attentions, layer.kwargs)
    else:
        with ratio_for_budget(press, keys.shape[2], n_kept):
            scores = press.score(layer.module, hidden_states, keys, layer.values, attentions, layer.kwargs)
    if scores.shape != keys.shape[:3]:
        raise ValueError(
            f"{type(press).__name__}.score returned shape {tuple(scores.shape)}, expected "
            f"(batch, kv_heads, k_len) = {tuple(keys.shape[:3])}"
        )
    return layer.mask_excluded(scores.float().contiguous())
