"""How a compression after the prefill sees and trims one layer's cache, whatever its layout.

After every chunk, :class:`~kvpress_critical.ChunkedPrefillPress` compresses each layer back to its budget; during
decoding, :class:`~kvpress_critical.presses.decoding_compression.DecodingCompressor` compresses it back to a target
size. Both need two things of a layer, which every layout implements (:class:`ChunkLayout`):

- :meth:`~ChunkLayout.view`: a dense view of the entries the layer holds (the newest tokens last), with the entries
  that must not be selected marked as excluded (evicted but still stored, padding);
- :meth:`~ChunkLayout.keep`: keep only some entries of that view.

The layouts:

- :class:`DenseLayout`: a ``DynamicLayer`` pruned by a pruning press: the view is the layer; keeping drops the
  other entries (the same number per head), in position order;
- :class:`MaskingLayout`: kvpress's masking layout (a head-wise press alone): the view is the layer, the entries
  masked so far excluded; keeping masks the others (``module.masked_key_indices``), nothing is freed;
- :class:`CompactLayout`: a :class:`~kvpress_critical.cache.CompactLayer` (``CompactCachePress``): the view is the
  layer at its positions (:meth:`~kvpress_critical.cache.CompactLayer.aligned_view`), the positions it no longer
  holds excluded, as the masking layout shows them (scores that pool neighbouring positions, SnapKV's, are the same in
  both); keeping packs a new compact layer.

Projected norms computed for an entry are reused after the next chunk
(:attr:`~kvpress_critical.presses.layer_input.LayerInput.known_norms`):
:class:`StoredNorms` keeps the norms of a view and the entries kept from it, and each layout turns them into the
norms of the leading entries of its next view (:meth:`~ChunkLayout.known_norms`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kvpress_critical.cache.compact import CompactLayer
from kvpress_critical.cache.windows import keep_mask_from_indices

__all__ = ["ChunkLayout", "CompactLayout", "DenseLayout", "LayerView", "MaskingLayout", "StoredNorms", "layer_layout"]


@dataclass
class LayerView:
    """Dense ``(B, H_kv, L, d)`` keys and values of what a layer holds, and which of them to leave out."""

    keys: torch.Tensor
    values: torch.Tensor
    excluded: torch.Tensor | None = None  # (B, H_kv, L) bool
    positions: torch.Tensor | None = None  # (B, H_kv, L) int32, where the layout tracks them


@dataclass
class StoredNorms:
    """Projected norms of a view's entries (``name -> (B, H_kv, L)``) and the entries kept from it."""

    norms: dict
    keep: torch.Tensor  # (B, H_kv, L) bool


class ChunkLayout(Protocol):
    """What a chunked prefill needs of one layer's cache (module docstring)."""

    def view(self) -> LayerView: ...

    def keep(self, keep: torch.Tensor) -> None: ...

    def known_norms(self, stored: StoredNorms) -> dict: ...


class DenseLayout:
    """A dense layer whose evicted entries are gone (pruning presses)."""

    def __init__(self, layer):
        self.layer = layer

    def view(self) -> LayerView:
        return LayerView(self.layer.keys, self.layer.values)

    def keep(self, keep: torch.Tensor) -> None:
        keys, values = self.layer.keys, self.layer.values
        bsz, num_kv_heads, _, head_dim = keys.shape
        self.layer.keys = keys[keep].view(bsz, num_kv_heads, -1, head_dim)  # boolean indexing keeps position order
        self.layer.values = values[keep].view(bsz, num_kv_heads, -1, head_dim)

    def known_norms(self, stored: StoredNorms) -> dict:
        bsz, num_kv_heads = stored.keep.shape[:2]
        return {name: norms[stored.keep].view(bsz, num_kv_heads, -1) for name, norms in stored.norms.items()}


class MaskingLayout:
    """A dense layer whose evicted entries stay, masked through ``module.masked_key_indices`` (head-wise presses)."""

    def __init__(self, layer, module: nn.Module):
        self.layer, self.module = layer, module

    def view(self) -> LayerView:
        keys = self.layer.keys
        masked = getattr(self.module, "masked_key_indices", None)
        excluded = None if masked is None else ~keep_mask_from_indices(masked, keys.shape[:3], keys.device)
        return LayerView(keys, self.layer.values, excluded)

    def keep(self, keep: torch.Tensor) -> None:
        self.module.masked_key_indices = tuple((~keep).nonzero(as_tuple=True))

    def known_norms(self, stored: StoredNorms) -> dict:
        return dict(stored.norms)  # every entry stays where it was


class CompactLayout:
    """A :class:`~kvpress_critical.cache.CompactLayer`: kept entries packed per head, the newest tokens in its tail.

    The view places every entry at its position (the positions not held excluded), so a press scores it as it scores
    the masking layout. Keeping builds a new compact layer (same reserve, same quantization) whose context is
    everything the view held: it reports ``context_length`` (default: the logical length so far), its tail is
    empty."""

    def __init__(
        self,
        cache,
        layer_idx: int,
        module: nn.Module,
        tail_positions: torch.Tensor | None = None,
        context_length: int | None = None,
    ):
        self.cache, self.layer_idx, self.module = cache, layer_idx, module
        self.layer: CompactLayer = cache.layers[layer_idx]
        self.context_length = self.layer.get_seq_length() if context_length is None else context_length
        self.aligned = self.layer.aligned_view(self.context_length, tail_positions)

    def view(self) -> LayerView:
        return LayerView(self.aligned.keys, self.aligned.values, ~self.aligned.valid, self.aligned.positions)

    def keep(self, keep: torch.Tensor) -> None:
        self.cache.layers[self.layer_idx] = CompactLayer.from_keep_mask(
            self.aligned.keys,
            self.aligned.values,
            keep,
            reserve=self.layer.reserve,
            positions=self.aligned.positions,
            context_length=self.context_length,
            quantize=self.layer.quantize,
        )
        self.module.masked_key_indices = None

    def known_norms(self, stored: StoredNorms) -> dict:
        return dict(stored.norms)  # every position stays where it was (the evicted ones are excluded)


def layer_layout(
    cache, layer_idx: int, module: nn.Module, pruning: bool, chunk: tuple[int, int] | None = None
) -> ChunkLayout:
    """
    The layout of ``cache.layers[layer_idx]``: compact for a compact layer, else dense (a ``pruning`` press) or
    masking. ``chunk``: the ``(start, end)`` positions of the tokens just appended by a chunked prefill (a compact
    layer then reports ``end`` tokens); without it, the layer's own logical length.
    """
    layer = cache.layers[layer_idx]
    if isinstance(layer, CompactLayer):
        if chunk is None:
            return CompactLayout(cache, layer_idx, module)
        tail_positions = torch.arange(chunk[0], chunk[1], dtype=torch.int32)
        return CompactLayout(cache, layer_idx, module, tail_positions, context_length=chunk[1])
    return DenseLayout(layer) if pruning else MaskingLayout(layer, module)
