"""The compact per-head KV layout of one attention layer, as a transformers cache layer.

After a head-wise press has chosen, for every (batch row, KV head), which context entries to keep,
:meth:`CompactLayer.from_keep_mask` packs exactly those entries, segment after segment (``keys`` / ``values``:
``(N, d)``, segment ``s = b * H_kv + h`` at rows ``cu_seqlens[s]:cu_seqlens[s + 1]``, each in its original order,
with the position each entry had in the dense layer it came from in ``positions``), in the model's dtype. The dense
full-length cache of the layer is then released: the layer holds ``N = sum of the budgets`` entries, not
``H_kv * T`` per row.

Tokens added afterwards (the question, the generated tokens) go to every head alike, into a dense **tail**
``(B, H_kv, C, d)`` with reserved capacity ``C``: appending writes in place, and when the tail is full its capacity
doubles (amortised O(1) per token; the packed context is never copied again). Removing an answer (kvpress's
pipeline does it between questions) only moves the tail's length back.

:meth:`CompactLayer.update` returns a :class:`~kvpress_critical.cache.attention.CompactKV` handle instead of dense
tensors; the attention wrapper (:mod:`kvpress_critical.cache.attention`, in transformers' attention functions for as
long as a compact layer exists) recognises it and runs :func:`kvpress_critical.ops.ragged_attention`.
The layer keeps the ``keys`` / ``values`` attributes kvpress's pipeline slices to remove answers
(``layer.keys = layer.keys[:, :, :n]``): they are :class:`LogicalView` objects of the layer's logical shape
``(B, H_kv, length, d)``, whose slicing along the sequence crops the tail; any other use of them as tensors is an
error that says so (the layer holds no dense tensor of that shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from kvpress_critical.cache.attention import CompactKV, hold_attention_wrapping
from kvpress_critical.ops.ragged_attention.codes import FORMATS, QuantizedEntries, quantize_entries
from kvpress_critical.ops.ragged_attention.layout import cu_seqlens_from_lengths

DEFAULT_RESERVE = 64
"""Tail capacity reserved at compaction (grown by doubling)."""


@dataclass
class AlignedView:
    """:meth:`CompactLayer.aligned_view`: a dense copy of a compact layer, every entry at its position."""

    keys: torch.Tensor  # (B, H_kv, L, d)
    values: torch.Tensor  # (B, H_kv, L, d)
    valid: torch.Tensor  # (B, H_kv, L) bool: False where the position is not held
    positions: torch.Tensor  # (B, H_kv, L) int32: 0 .. L-1


class LogicalView:
    """
    The ``keys`` / ``values`` attribute of a :class:`CompactLayer`: its logical shape, sliceable along the sequence.

    ``view[:, :, :n]`` is another view of length ``n``; assigning it back to the layer crops the layer to ``n``
    tokens (what kvpress's pipeline does to remove an answer). It is not a tensor.
    """

    def __init__(self, layer: "CompactLayer", length: int):
        self.layer = layer
        self.length = length

    @property
    def shape(self) -> tuple[int, int, int, int]:
        bsz, heads, _, head_dim = self.layer.logical_shape
        return bsz, heads, self.length, head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.layer.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.device

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            index = (index,)
        if index and index[0] is Ellipsis:  # view[..., :n, :]
            index = (slice(None), slice(None), *index[1:])
        full = all(isinstance(i, slice) and i == slice(None) for i in index[:2]) and all(
            isinstance(i, slice) and i == slice(None) for i in index[3:]
        )
        if len(index) >= 3 and full and isinstance(index[2], slice) and index[2].step in (None, 1):
            start, stop, _ = index[2].indices(self.length)
            if start == 0:
                return LogicalView(self.layer, stop)
        raise TypeError(
            "a CompactLayer holds each head's kept entries in a packed layout, not a dense (batch, heads, seq, dim) "
            "tensor: only [:, :, :n] slices (to crop) are supported; read the entries with layer.segments()"
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise TypeError(
            f"{func.__name__} on a CompactLayer's keys/values: the layer has no dense tensor (kvpress-critical's "
            "compact layout). Use layer.segments() or layer.aligned_view(n) (a dense copy at the entries' "
            "positions) to read it."
        )

    def __repr__(self):
        return f"LogicalView(shape={self.shape}, layer={self.layer!r})"


class CompactLayer(CacheLayerMixin):
    """
    One layer's KV cache in the compact per-head layout (module docstring).

    Build it with :meth:`from_keep_mask`; transformers and kvpress then use it through the cache layer interface.
    """

    is_compileable = False
    is_sliding = False

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        cu_seqlens: torch.Tensor,
        positions: torch.Tensor,
        batch_size: int,
        num_kv_heads: int,
        context_length: int,
        reserve: int = DEFAULT_RESERVE,
        quantize: str | None = None,
    ):
        super().__init__()
        if quantize is not None and quantize not in FORMATS:
            raise ValueError(f"quantize must be None or one of {sorted(FORMATS)}, got {quantize!r}")
        self.quantize = quantize
        self.dtype, self.device = keys.dtype, keys.device
        if quantize is None:
            self._keys, self._values = keys, values
        else:  # codes and one scale per entry; the tail stays in the model's dtype
            key_spec, value_spec = FORMATS[quantize]
            self._keys = quantize_entries(keys, key_spec, cu_seqlens)
            self._values = quantize_entries(values, value_spec, cu_seqlens)
        self.cu_seqlens = cu_seqlens  # (S + 1,) int64, on CPU (read by the kernels' launchers)
        self.positions = positions  # (N,) int32, original position of every packed entry
        self.batch_size, self.num_kv_heads, self.head_dim = batch_size, num_kv_heads, keys.shape[-1]
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        self.max_seqlen = int(lengths.max()) if lengths.numel() else 0
        # the length the dense layer reported: positions and masks elsewhere in the model do not change at conversion
        self.context_length = context_length
        self.reserve = max(1, reserve)
        # compressed while decoding: the context holds tokens added after the prefill (answers cannot be removed)
        self.compressed_while_decoding = False
        shape = (batch_size, num_kv_heads, self.reserve, self.head_dim)
        self.tail_keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.tail_values = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.tail_len = 0
        self.is_initialized = True
        hold_attention_wrapping(self)  # attention can read the layer for as long as it exists

    @property
    def context_keys(self) -> torch.Tensor | QuantizedEntries:
        """The packed context keys as stored: ``(N, d)`` in the model's dtype, or their codes when quantized (what
        the attention reads)."""
        return self._keys

    @property
    def context_values(self) -> torch.Tensor | QuantizedEntries:
        """The packed context values as stored (see :attr:`context_keys`)."""
        return self._values

    @property
    def packed_keys(self) -> torch.Tensor:
        """``(N, d)`` the packed context keys, in the model's dtype (a dequantized copy when the layer is quantized:
        for inspection and re-selection, never for a step's attention)."""
        return self._packed(self._keys)

    @property
    def packed_values(self) -> torch.Tensor:
        """``(N, d)`` the packed context values, in the model's dtype (see :attr:`packed_keys`)."""
        return self._packed(self._values)

    def _packed(self, stored):
        return stored if self.quantize is None else stored.dequantize(self.dtype)

    @property
    def num_entries(self) -> int:
        """Context entries held, over every (batch row, KV head)."""
        return int(self.cu_seqlens[-1])

    # ---- construction -----------------------------------------------------------------------------------------

    @classmethod
    def from_keep_mask(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        keep: torch.Tensor,
        reserve: int = DEFAULT_RESERVE,
        positions: torch.Tensor | None = None,
        context_length: int | None = None,
        quantize: str | None = None,
    ) -> "CompactLayer":
        """
        Pack the entries ``keep`` marks of a dense ``(B, H_kv, T, d)`` layer.

        ``keep``: ``(B, H_kv, T)`` bool (rows and heads may keep different numbers of entries). ``positions``:
        ``(B, H_kv, T)`` positions of the dense entries (default ``0..T-1``). ``context_length``: the length the layer
        reports to the model (``get_seq_length``; default ``T``, what the dense layer reported). ``quantize``:
        ``"int8"`` or ``"int4"`` stores the packed entries as codes with one scale per entry
        (:mod:`~kvpress_critical.ops.ragged_attention.codes`).
        """
        bsz, num_kv_heads, k_len, _ = keys.shape
        if keep.shape != keys.shape[:3]:
            raise ValueError(f"keep mask of shape {tuple(keep.shape)} for a cache of shape {tuple(keys.shape)}")
        keep = keep.to(keys.device)
        cu = cu_seqlens_from_lengths(keep.sum(-1))  # (S + 1,), on the host
        if positions is None:
            positions = torch.arange(k_len, device=keys.device, dtype=torch.int32).expand(bsz, num_kv_heads, k_len)
        # boolean indexing walks (b, h, t) in order: segments are contiguous, entries in their original order
        return cls(
            keys[keep].contiguous(),
            values[keep].contiguous(),
            cu,
            positions.to(keys.device)[keep].to(torch.int32),
            bsz,
            num_kv_heads,
            k_len if context_length is None else context_length,
            reserve,
            quantize,
        )

    # ---- the cache layer interface ----------------------------------------------------------------------------

    def lazy_initialization(self, key_states, value_states) -> None:  # built initialised
        pass

    @property
    def logical_shape(self) -> tuple[int, int, int, int]:
        return self.batch_size, self.num_kv_heads, self.get_seq_length(), self.head_dim

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs=None):
        """Append ``(B, H_kv, n, d)`` new tokens to every head's tail (in place, doubling the capacity when full)."""
        n = key_states.shape[2]
        if key_states.shape[:2] != (self.batch_size, self.num_kv_heads) or key_states.shape[3] != self.head_dim:
            raise ValueError(
                f"new keys of shape {tuple(key_states.shape)} for a compact layer of batch {self.batch_size}, "
                f"{self.num_kv_heads} KV heads, head_dim {self.head_dim}"
            )
        needed = self.tail_len + n
        if needed > self.tail_keys.shape[2]:
            self._grow(max(needed, 2 * self.tail_keys.shape[2]))
        self.tail_keys[:, :, self.tail_len : needed] = key_states
        self.tail_values[:, :, self.tail_len : needed] = value_states
        self.tail_len = needed
        handle = CompactKV(self)
        return handle, handle

    def _grow(self, capacity: int) -> None:
        shape = (self.batch_size, self.num_kv_heads, capacity, self.head_dim)
        for name in ("tail_keys", "tail_values"):
            old = getattr(self, name)
            new = torch.empty(shape, dtype=old.dtype, device=old.device)
            new[:, :, : self.tail_len] = old[:, :, : self.tail_len]
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self.context_length + self.tail_len

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.get_seq_length() + cache_position.shape[0], 0

    def get_max_cache_shape(self) -> int:
        return -1

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` logical tokens (the context is never cut: only the tail shrinks)."""
        if max_length < 0:
            max_length = self.get_seq_length() + max_length
        if max_length < self.context_length and self.compressed_while_decoding:
            # tokens added after the prefill were compressed into the context with it: only the tail can go (what
            # kvpress's pipeline does after an answer generated with a decoding press, one question per context)
            self.tail_len = 0
            return
        if max_length < self.context_length:
            raise ValueError(
                f"cannot crop a compact layer to {max_length} tokens: its compressed context alone is "
                f"{self.context_length} (only tokens added after the compression can be removed)"
            )
        self.tail_len = min(self.tail_len, max_length - self.context_length)

    def reset(self) -> None:
        self.tail_len = 0

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("beam search is not supported on the compact layout (CompactCachePress)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the compact layout does not support batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("the compact layout does not support batch_select_indices")

    def offload(self):  # nothing is offloaded: the packed layout stays where it is
        pass

    def prefetch(self):
        pass

    # kvpress's pipeline removes answers with `layer.keys = layer.keys[:, :, :n]` (and the same for values)
    @property
    def keys(self):  # type: ignore[override]
        return LogicalView(self, self.get_seq_length()) if self.is_initialized else None

    @keys.setter
    def keys(self, value) -> None:
        self._assign(value)

    @property
    def values(self):  # type: ignore[override]
        return LogicalView(self, self.get_seq_length()) if self.is_initialized else None

    @values.setter
    def values(self, value) -> None:
        self._assign(value)

    def _assign(self, value) -> None:
        if value is None and not getattr(self, "is_initialized", False):  # CacheLayerMixin.__init__
            return
        if isinstance(value, LogicalView) and value.layer is self:
            self.crop(value.length)
            return
        raise TypeError(
            "a CompactLayer's keys/values cannot be replaced by a tensor (its entries are packed per head); "
            "crop with layer.crop(n), or build a new layer with CompactLayer.from_keep_mask"
        )

    # ---- inspection -------------------------------------------------------------------------------------------

    def segment_lengths(self) -> torch.Tensor:
        """``(B, H_kv)`` context entries held per (batch row, KV head)."""
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).view(self.batch_size, self.num_kv_heads)

    def segments(self, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, positions)`` of the context entries of batch row ``b``, KV head ``h`` (views)."""
        s = b * self.num_kv_heads + h
        lo, hi = int(self.cu_seqlens[s]), int(self.cu_seqlens[s + 1])
        return self.packed_keys[lo:hi], self.packed_values[lo:hi], self.positions[lo:hi]

    def nbytes(self, reserved: bool = True) -> int:
        """Bytes held: packed context (codes and scales when quantized), tail (its whole capacity when
        ``reserved``) and index tensors."""
        tail = self.tail_keys if reserved else self.tail_keys[:, :, : self.tail_len]
        element = self.tail_keys.element_size()
        if self.quantize is None:
            context = 2 * self.num_entries * self.head_dim * element
        else:
            context = self._keys.nbytes + self._values.nbytes
        return context + 2 * tail.numel() * element + self.cu_seqlens.numel() * 8 + self.positions.numel() * 4

    def aligned_view(self, length: int, tail_positions: torch.Tensor | None = None) -> AlignedView:
        """
        A dense copy of the layer at its positions, ``(B, H_kv, length, d)``: every entry held (packed context and
        tail) in the slot of its original position, the evicted positions empty (``valid`` False). Scores that mix
        neighbouring positions (SnapKV's pooling) then see the neighbourhoods kvpress's masking layout shows them.
        ``length``: the positions covered (at least every position held); ``tail_positions`` (``(tail_len,)``): the
        tail's positions (default: after ``context_length``).
        """
        bsz, num_kv_heads, d = self.batch_size, self.num_kv_heads, self.head_dim
        tail = self.tail_len
        if tail_positions is None:
            tail_positions = torch.arange(self.context_length, self.context_length + tail)
        tail_positions = tail_positions.to(device=self.device, dtype=torch.long)
        keys = torch.zeros(bsz * num_kv_heads, length, d, dtype=self.dtype, device=self.device)
        values = torch.zeros_like(keys)
        valid = torch.zeros(bsz * num_kv_heads, length, dtype=torch.bool, device=self.device)
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(self.device)
        segment = torch.repeat_interleave(torch.arange(bsz * num_kv_heads, device=self.device), lengths)
        position = self.positions.long()
        keys[segment, position] = self.packed_keys
        values[segment, position] = self.packed_values
        valid[segment, position] = True
        keys = keys.view(bsz, num_kv_heads, length, d)
        values = values.view(bsz, num_kv_heads, length, d)
        valid = valid.view(bsz, num_kv_heads, length)
        keys[:, :, tail_positions] = self.tail_keys[:, :, :tail]
        values[:, :, tail_positions] = self.tail_values[:, :, :tail]
        valid[:, :, tail_positions] = True
        positions = torch.arange(length, dtype=torch.int32, device=self.device).expand(bsz, num_kv_heads, length)
        return AlignedView(keys, values, valid, positions)

    def __repr__(self):
        return (
            f"CompactLayer(batch={self.batch_size}, kv_heads={self.num_kv_heads}, entries={self.num_entries}, "
            f"context_length={self.context_length}, tail={self.tail_len}/{self.tail_keys.shape[2]})"
        )
