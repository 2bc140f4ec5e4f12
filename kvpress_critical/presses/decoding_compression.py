"""Compression during decoding in any cache layout, on kvpress's ``DecodingPress`` schedule.

kvpress's ``DecodingPress(base_press, compression_interval, target_size, hidden_states_buffer_size)`` compresses the
cache every ``compression_interval`` forwards after the prefill back to ``target_size`` entries per head, scoring with
the hidden states of the last ``hidden_states_buffer_size`` forwards. Its own hook rewrites a dense cache
(``layer.keys = ...``) and, with a head-wise base press, only masks. :class:`DecodingCompressor` follows the same
schedule, the target included (``_resolve_target_size``, which subclasses such as ``CompressionRatioDecodingPress``
derive from the tokens seen), but trims each layer through its layout (:mod:`kvpress_critical.cache.layouts`): in the
compact layout every (batch row, KV head) keeps its own budget and the evicted entries are freed, so a generation of
thousands of tokens holds the target per head on average (exactly, for a pruning base press) plus at most the tokens
of one interval; between compressions, tokens are appended in place. Entries evicted once are never selected again
(in the masking layout they stay, excluded). The base press gets an explicit budget of the target size
(:func:`~kvpress_critical.presses.budgeted.keep_mask`), and the buffered tokens their own rotary embeddings (kvpress
hands a SnapKV-style scorer the current token's for the whole window).

:class:`~kvpress_critical.CompactCachePress` runs it for ``CompactCachePress(DecodingPress(...))`` and
``CompactCachePress(PrefillDecodingPress(prefilling_press=..., decoding_press=DecodingPress(...)))``;
:func:`decoding_compression` runs it on a model in any layout.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager

import torch
from kvpress import DecodingPress
from kvpress.presses.base_press import is_prefilling
from torch import nn

from kvpress_critical.cache.compact import CompactLayer
from kvpress_critical.cache.layouts import layer_layout
from kvpress_critical.cache.windows import is_sliding_layer
from kvpress_critical.capabilities import capabilities
from kvpress_critical.modeling import decoder, hooked_attention_modules
from kvpress_critical.presses.budgeted import keep_mask
from kvpress_critical.presses.layer_input import LayerInput

__all__ = ["DecodingCompressor", "decoding_compression"]


class DecodingCompressor:
    """
    kvpress's ``DecodingPress`` schedule over any layout (module docstring): call :meth:`after_layer` from a forward
    hook of every attention layer.

    Parameters
    ----------
    schedule : kvpress.DecodingPress
        Its ``base_press`` (a budgeted press: a kvpress ``ScorerPress``, ``AdaKVPress(ScorerPress)``, or this
        package's ``CriticalKVPress`` / ``CriticalAdaKVPress``), ``compression_interval``, ``target_size`` and
        ``hidden_states_buffer_size``.
    model : PreTrainedModel
        The model, for its rotary embedding.
    """

    def __init__(self, schedule: DecodingPress, model: nn.Module):
        self.schedule = schedule
        self.press = schedule.base_press
        self.pruning = capabilities(self.press).selection == "pruning"
        self.rotary = getattr(decoder(model), "rotary_emb", None)
        self.steps: dict[int, int] = defaultdict(int)  # layer -> forwards since its last compression
        self.buffers: dict[int, list] = defaultdict(list)  # layer -> [(hidden states, position ids)] of the forwards
        self.compressions: dict[int, int] = defaultdict(int)  # layer -> compressions so far

    def after_layer(self, module: nn.Module, kwargs: dict, output) -> None:
        """Count a forward after the prefill; compress the layer when the schedule says so."""
        hidden_states = kwargs["hidden_states"]
        q_len = hidden_states.shape[1]
        if is_prefilling(kwargs["cache_position"], q_len):
            return
        idx = module.layer_idx
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = kwargs["cache_position"].unsqueeze(0).expand(hidden_states.shape[0], -1)
        self.buffers[idx].append((hidden_states.detach(), positions))
        self.steps[idx] += 1
        target = self.schedule._resolve_target_size(kwargs)  # kvpress's contract: subclasses derive it per call
        if self.steps[idx] >= self.schedule.compression_interval or q_len >= target:
            self.compress(module, kwargs, output, target)
            self.steps[idx] = 0
            self.buffers[idx] = []
        size = self.schedule.hidden_states_buffer_size
        self.buffers[idx] = self.buffers[idx][-size:] if size > 0 else []

    def compress(self, module: nn.Module, kwargs: dict, output, target: int) -> None:
        """Compress one layer back to ``target`` entries per head (on average), in its own layout."""
        idx = module.layer_idx
        cache = kwargs["past_key_values"]
        layout = layer_layout(cache, idx, module, self.pruning)
        view = layout.view()
        live = view.keys.shape[2] if view.excluded is None else int((~view.excluded).sum(-1).max())
        if live <= target:
            return  # kvpress's DecodingPress leaves a layer at or under its target as it is
        hidden = torch.cat([h for h, _ in self.buffers[idx]], dim=1)
        positions = torch.cat([p for _, p in self.buffers[idx]], dim=1)
        step_kwargs = dict(kwargs)
        if self.rotary is not None:  # the buffered tokens' own rotary embeddings
            step_kwargs["position_embeddings"] = self.rotary(hidden, positions.to(hidden.device))
        attentions = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        layer = LayerInput(module, hidden, view.keys, view.values, attentions, step_kwargs, view.excluded)
        keep = keep_mask(self.press, layer, target)
        layout.keep(keep)
        layer = cache.layers[idx]
        if isinstance(layer, CompactLayer):
            layer.compressed_while_decoding = True
        self.compressions[idx] += 1
        self.kept(module, kwargs, keep)

    def kept(self, module: nn.Module, kwargs: dict, keep: torch.Tensor) -> None:
        """Called after each compression with the ``(B, H_kv, T)`` mask of what the layer kept of its ``T`` entries
        (a subclass may record it); nothing by default."""


@contextmanager
def decoding_compression(model: nn.Module, schedule: DecodingPress, compressor: DecodingCompressor | None = None):
    """
    Inside the block, every attention layer of ``model`` is compressed during decoding on ``schedule``'s terms, in
    whatever layout its cache has (compact layers compact, dense ones pruned by a pruning base press, masked by a
    head-wise one). Yields the :class:`DecodingCompressor` (``compressor``, a subclass's instance built for ``schedule``
    and ``model``, when given).
    """
    schedule.base_press.post_init_from_model(model)
    compressor = compressor if compressor is not None else DecodingCompressor(schedule, model)
    modules = [m for m in hooked_attention_modules(model) if not is_sliding_layer(m)]

    def hook(module, args, kwargs, output):
        compressor.after_layer(module, kwargs, output)
        return output

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        yield compressor
    finally:
        for handle in handles:
            handle.remove()
