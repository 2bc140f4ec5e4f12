"""Attention over compact layers: a wrapper around every attention function transformers registers.

Transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, ...)`` with whatever the cache layer's ``update`` returned. :func:`install` wraps every
registered function (``sdpa``, ``flash_attention_2``, ... — outside kvpress's masking patch, which kvpress applies
on import) once: when ``key`` is a :class:`~kvpress_critical.cache.compact.CompactKV` handle, the wrapper runs
:func:`kvpress_critical.ops.ragged_attention` on the layer's compact layout; anything else goes to the wrapped
function unchanged, so dense layers (and every model without a compact layer) behave exactly as before.

Eager attention is not a registered function (models call their own ``eager_attention_forward``): it cannot see a
compact layer, and :class:`~kvpress_critical.presses.CompactCachePress` refuses models loaded with it.
"""

from __future__ import annotations

import logging
import os

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_critical.cache.compact import CompactKV
from kvpress_critical.ops.ragged_attention import ragged_attention

logger = logging.getLogger(__name__)

_MARK = "_kvpress_critical_compact"


def compact_attention(module, query, key: CompactKV, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``(output (B, q, H, d), None)`` of ``query`` over the compact layer behind ``key``."""
    window = kwargs.get("sliding_window")
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
        backend=os.environ.get("KVPRESS_CRITICAL_ATTENTION_BACKEND", "auto"),
    )
    return out, None


def _wrap(func):
    if getattr(func, _MARK, False):
        return func

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(key, CompactKV):
            return compact_attention(module, query, key, attention_mask, *args, **kwargs)
        return func(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(wrapper, _MARK, True)
    wrapper.__wrapped__ = func
    return wrapper


def install() -> None:
    """Wrap every registered attention function (idempotent; also wraps functions registered since)."""
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        ALL_ATTENTION_FUNCTIONS[name] = _wrap(ALL_ATTENTION_FUNCTIONS[name])
