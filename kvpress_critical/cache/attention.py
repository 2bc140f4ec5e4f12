"""Attention over compact layers: a wrapper around every attention function transformers registers.

Transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, ...)`` with whatever the cache layer's ``update`` returned. :func:`install` wraps every
registered function (``sdpa``, ``flash_attention_2``, ... — outside kvpress's masking patch, which kvpress applies
on import) once: when ``key`` is a :class:`~kvpress_critical.cache.compact.CompactKV` handle, the wrapper runs
:func:`kvpress_critical.ops.ragged_attention` on the layer's compact layout; anything else goes to the wrapped
function unchanged, so dense layers (and every model without a compact layer) behave exactly as before.

Inside :func:`exact_masked_attention` (ChunkedPrefillPress in kvpress's masking layout), the wrapper also computes
multi-token attention over a dense layer whose older entries a head-wise press masked (``module.masked_key_indices``)
exactly, on the unmasked entries only, instead of kvpress's fake keys (whose weights do not always underflow for
many queries at once: see ``tests/test_compact_cache.py``).

Eager attention is not a registered function (models call their own ``eager_attention_forward``): it cannot see a
compact layer, and :class:`~kvpress_critical.presses.CompactCachePress` refuses models loaded with it.
"""

from __future__ import annotations

import contextvars
import os
from contextlib import contextmanager

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_critical.cache.compact import CompactKV
from kvpress_critical.cache.convert import effective_window, keep_mask_from_indices
from kvpress_critical.ops.ragged_attention import cu_seqlens_from_lengths, ragged_attention

_MARK = "_kvpress_critical_compact"
_EXACT_MASKING = contextvars.ContextVar("kvpress_critical_exact_masking", default=False)


def _backend() -> str:
    return os.environ.get("KVPRESS_CRITICAL_ATTENTION_BACKEND", "auto")


def _check_supported(module, dropout, kwargs) -> None:
    window = effective_window(module, kwargs.get("sliding_window"))
    if window is not None:
        raise NotImplementedError(
            f"layer {getattr(module, 'layer_idx', '?')} uses sliding-window attention ({window}), which the compact "
            "layout does not implement; CompactCachePress keeps sliding layers dense"
        )
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            "attention logit soft-capping and attention sinks are not supported on compact layers"
        )
    if dropout:
        raise NotImplementedError("attention dropout is not supported on compact layers (eval mode only)")


def compact_attention(module, query, key: CompactKV, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``(output (B, q, H, d), None)`` of ``query`` over the compact layer behind ``key``."""
    _check_supported(module, dropout, kwargs)
    layer = key.layer
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = ragged_attention(
        query,
        layer.packed_keys,
        layer.packed_values,
        layer.cu_seqlens,
        layer.tail_keys,
        layer.tail_values,
        layer.tail_len,
        scale,
        max_seqlen=layer.max_seqlen,
        backend=_backend(),
    )
    return out, None


def masked_attention(module, query, key, value, masked_key_indices, scaling=None) -> torch.Tensor:
    """
    ``(B, q, H, d)`` attention of the ``q`` newest tokens over a dense ``(B, H_kv, K, d)`` layer, skipping the
    entries ``masked_key_indices`` lists (all among the ``K - q`` older ones): the older unmasked entries are packed
    per head as the compact layout's context, the ``q`` newest are its tail (causal).
    """
    q_len, k_len = query.shape[2], key.shape[2]
    prefix = k_len - q_len
    keep = keep_mask_from_indices(masked_key_indices, key.shape[:3], key.device)[:, :, :prefix]  # (B, H_kv, P)
    cu = cu_seqlens_from_lengths(keep.sum(-1))
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return ragged_attention(
        query,
        key[:, :, :prefix][keep],
        value[:, :, :prefix][keep],
        cu,
        key[:, :, prefix:],
        value[:, :, prefix:],
        q_len,
        scale,
        max_seqlen=int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0,
        backend=_backend(),
    )


@contextmanager
def exact_masked_attention():
    """While active, multi-token forwards over a masked dense layer use :func:`masked_attention` (exact)."""
    install()
    token = _EXACT_MASKING.set(True)
    try:
        yield
    finally:
        _EXACT_MASKING.reset(token)


def _exact_masking_applies(module, query, key, kwargs) -> bool:
    masked = getattr(module, "masked_key_indices", None)
    return (
        _EXACT_MASKING.get()
        and masked is not None
        and isinstance(key, torch.Tensor)
        and 1 < query.shape[2] < key.shape[2]
        and effective_window(module, kwargs.get("sliding_window")) is None
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
    )


def _wrap(func):
    if getattr(func, _MARK, False):
        return func

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(key, CompactKV):
            return compact_attention(module, query, key, attention_mask, *args, **kwargs)
        if _exact_masking_applies(module, query, key, kwargs):
            _check_supported(module, args[0] if args else kwargs.get("dropout", 0.0), kwargs)
            out = masked_attention(module, query, key, value, module.masked_key_indices, kwargs.get("scaling"))
            return out, None
        return func(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    wrapper.__wrapped__ = func
    return wrapper


def install() -> None:
    """Wrap every registered attention function (idempotent; also wraps functions registered since)."""
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        ALL_ATTENTION_FUNCTIONS[name] = _wrap(ALL_ATTENTION_FUNCTIONS[name])
