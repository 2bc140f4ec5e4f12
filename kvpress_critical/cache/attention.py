"""Attention over compact layers: a wrapper around the attention functions transformers registers, while needed.

Transformers' attention modules call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, ...)`` with whatever the cache layer's ``update`` returned. The wrapper recognises a
:class:`CompactKV` handle (what a :class:`~kvpress_critical.cache.compact.CompactLayer` returns) and runs
:func:`kvpress_critical.ops.ragged_attention` on the layer's compact layout; anything else goes to the wrapped
function unchanged, so dense layers behave exactly as before.

It is in ``ALL_ATTENTION_FUNCTIONS`` only while something needs it, and the entries are restored as they were when
the last need ends (:func:`attention_wrapping`): a press's ``with`` block (``CompactCachePress``,
``ChunkedPrefillPress``) holds it for its duration, and a compact layer for its lifetime (kvpress's pipeline generates
the answer after the press's block has ended, over the compact cache the block built). Leases are counted under a
lock, so nested and concurrent holders are safe; functions registered while it is installed are wrapped when the next
holder starts.

While a chunked prefill runs in kvpress's masking layout (``attention_wrapping(exact_masking=True)``), the wrapper
also computes multi-token attention over a dense layer whose older entries a head-wise press masked
(``module.masked_key_indices``) exactly, on the unmasked entries only, instead of kvpress's fake keys (whose weights
do not always underflow for many queries at once: see ``tests/cache/test_compact_cache.py``); a layer it cannot attend
exactly (sliding window, soft-capping, sinks) is an error.

Eager attention is not a registered function (models call their own ``eager_attention_forward``): it cannot see a
compact layer, and :class:`~kvpress_critical.presses.CompactCachePress` refuses models loaded with it.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_critical.cache.windows import effective_window, keep_mask_from_indices
from kvpress_critical.ops.ragged_attention import cu_seqlens_from_lengths, ragged_attention

_MARK = "_kvpress_critical_compact"


@dataclass
class CompactKV:
    """What :meth:`CompactLayer.update` returns to the attention function: the layer and its current state."""

    layer: Any  # the CompactLayer

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.layer.logical_shape

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.device


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
        layer.context_keys,  # as stored: float entries, or codes the kernels dequantize as they read them
        layer.context_values,
        layer.cu_seqlens,
        layer.tail_keys,
        layer.tail_values,
        layer.tail_len,
        scale,
        max_seqlen=layer.max_seqlen,
        backend="auto",  # or $KVPRESS_CRITICAL_RAGGED_ATTENTION_BACKEND
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
        backend="auto",  # or $KVPRESS_CRITICAL_RAGGED_ATTENTION_BACKEND
    )


# ---- when the wrapper is installed: leases ------------------------------------------------------------------------

_LOCK = threading.RLock()
_LEASES = {"all": 0, "exact_masking": 0}
_ORIGINALS: dict[str, Any] = {}  # name -> the function the wrapper replaced


def _install() -> None:
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        func = ALL_ATTENTION_FUNCTIONS[name]
        if not getattr(func, _MARK, False):
            _ORIGINALS[name] = func
            ALL_ATTENTION_FUNCTIONS[name] = _wrap(func)


def _restore() -> None:
    for name, func in _ORIGINALS.items():
        current = ALL_ATTENTION_FUNCTIONS.get(name)
        if getattr(current, _MARK, False) and current.__wrapped__ is func:  # not replaced by someone else since
            ALL_ATTENTION_FUNCTIONS[name] = func
    _ORIGINALS.clear()


def _acquire(exact_masking: bool) -> None:
    with _LOCK:
        _install()  # also wraps functions registered since the last holder started
        _LEASES["all"] += 1
        _LEASES["exact_masking"] += exact_masking


def _release(exact_masking: bool) -> None:
    with _LOCK:
        _LEASES["all"] -= 1
        _LEASES["exact_masking"] -= exact_masking
        if _LEASES["all"] == 0:
            _restore()


@contextmanager
def attention_wrapping(exact_masking: bool = False):
    """
    The wrapper in ``ALL_ATTENTION_FUNCTIONS`` for the block (module docstring); ``exact_masking``: multi-token
    attention over kvpress's masked entries is computed exactly while the block runs.
    """
    _acquire(exact_masking)
    try:
        yield
    finally:
        _release(exact_masking)


def hold_attention_wrapping(owner) -> None:
    """The wrapper in ``ALL_ATTENTION_FUNCTIONS`` for as long as ``owner`` (a compact layer) exists."""
    _acquire(False)
    weakref.finalize(owner, _release, False)


def attention_wrapping_installed() -> bool:
    """Whether the wrapper is in ``ALL_ATTENTION_FUNCTIONS`` now."""
    with _LOCK:
        return _LEASES["all"] > 0


def _exact_masking_applies(module, query, key, kwargs) -> bool:
    """A multi-token forward over a dense layer with masked entries, inside a chunked prefill in the masking layout."""
    if not _LEASES["exact_masking"] or getattr(module, "masked_key_indices", None) is None:
        return False
    if not isinstance(key, torch.Tensor) or not 1 < query.shape[2] < key.shape[2]:
        return False  # one query (decoding: kvpress's fake keys are exact there) or a fresh prefill
    window = effective_window(module, kwargs.get("sliding_window"))
    if window is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError(
            f"layer {getattr(module, 'layer_idx', '?')}: a chunked prefill over kvpress's masked entries attends "
            "exactly on the unmasked ones, which this layer's attention (sliding window, soft-capping or sinks) does "
            "not allow; use a pruning press or a one-shot prefill"
        )
    return True


def _wrap(func):
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
