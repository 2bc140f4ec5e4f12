from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from kvpress import BasePress
from torch import nn
from transformers import DynamicCache

from kvpress_critical.cache.attention import attention_wrapping
from kvpress_critical.cache.layouts import StoredNorms, layer_layout
from kvpress_critical.cache.windows import is_sliding_layer
from kvpress_critical.capabilities import (
    Capabilities,
    capabilities,
    chunked_prefill_model_refusal,
    chunked_prefill_refusal,
    nested_presses,
    padded_batch_refusal,
)
from kvpress_critical.modeling import decoder, hooked_attention_modules
from kvpress_critical.presses.budgeted import keep_mask
from kvpress_critical.presses.inner_press import InnerPressMixin
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.selection import compute_n_kept

# the arguments of a prefill call that the chunks recompute (masks and positions follow what the cache holds)
_RECOMPUTED = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache_position", "past_key_values")


@dataclass
class ChunkedPrefillPress(InnerPressMixin, BasePress):
    """
    Prefill in chunks of ``chunk_size`` tokens, compressing every layer back to its budget after each chunk.

    Through kvpress's unchanged pipeline (``pipe(context, press=ChunkedPrefillPress(press, chunk_size=4096))``): the
    context's single prefill call is run as consecutive chunks, each at its original positions (RoPE is applied
    once, when a token's key is computed; nothing is re-rotated). After each chunk, every layer's cache (the entries
    kept so far + the chunk) is compressed by ``press`` to ``(1 - compression_ratio) * seen`` entries per head on
    average, ``seen`` the tokens prefilled so far: the budget follows the context as it is read, and after the last
    chunk the cache holds as many entries as a one-shot compression keeps (not the same ones: earlier chunks were
    scored before the later ones existed). SnapKV-style scorers take their observation window from the chunk's last
    tokens (the newest), as in the paper's chunked-prefill experiment (appendix B.6); a last chunk not longer than
    the window is merged into the one before. With ``chunk_size`` not smaller than the context, it is exactly the
    one-shot compression (the inner press runs as it does alone).

    Layouts: with a pruning press (a ``ScorerPress``, ``CriticalKVPress``) the dense cache is pruned after each
    chunk, and, wrapped in :class:`~kvpress_critical.CompactCachePress`
    (``CompactCachePress(ChunkedPrefillPress(CriticalAdaKVPress(...)))``), a head-wise press's evicted entries are
    freed after each chunk: in both, no layer ever holds more than ``budget + chunk_size`` entries per head. A
    head-wise press alone works in kvpress's masking layout: evicted entries stay in memory, masked, and are never
    selected again; while the chunks are prefilled, their attention skips the masked entries exactly (kvpress's fake
    keys are not used for multi-token queries, see :func:`kvpress_critical.cache.attention.masked_attention`).
    Head-wise scoring of an uneven layout uses a padded view whose padding (and already-evicted entries) gets no
    attention in SnapKV's window and the lowest scores. The projected-value norm of an entry is computed once, when
    its chunk is first compressed (exact, since it depends on the entry's value only: DefensiveKV's normalisation
    across heads is recomputed from these raw norms; the layer's input carries them,
    :class:`~kvpress_critical.presses.layer_input.LayerInput`). A pruning ``ScorerPress`` (SnapKV, Knorm,
    CriticalKV...) is applied as its scores plus a per-head top-k that keeps the entries in position
    order (kvpress's ``compress`` keeps them in score order; the selected set is the same up to ties).

    How it works: a forward pre-hook on the model's decoder runs a long prefill (an empty cache, more than
    ``chunk_size`` tokens) as its chunks, the last one being the original call; after every chunk, a forward hook on
    each attention layer asks the layer's layout (:mod:`kvpress_critical.cache.layouts`: dense, masking or compact)
    for a view of what it holds, gives the press an explicit budget for the tokens seen
    (:func:`kvpress_critical.presses.budgeted.keep_mask`) and keeps what it selects. A prefill that fits in one chunk
    goes to the inner press's own hook, unchanged. Nothing of the model or of the inner press is replaced: only
    hooks are registered, and removed when the ``with`` block ends.

    Refused (a clear error, :func:`kvpress_critical.capabilities.chunked_prefill_refusal`): presses that need the
    whole context at once (ExpectedAttention, PyramidKV, PerLayerCompression, key re-rotation, Finch), presses with
    their own ``__call__`` (KVzip...) or their own ``compress`` (no explicit budget: ChunkPress, BlockPress...),
    decoding presses, Layer-DefensiveKV (one selection across all layers after the last), padded batches, and
    DefensiveKV inside CompactCachePress (its normalisation across heads needs the aligned layout).

    Based on CriticalKV (https://arxiv.org/abs/2502.03805), appendix B.6 (chunked prefill).

    Parameters
    ----------
    press : BasePress
        The press that compresses (it holds the ``compression_ratio``).
    chunk_size : int, default=4096
        Tokens per chunk; must exceed a SnapKV-style scorer's window.
    reuse_norms : bool, default=True
        Reuse the projected-value norms of entries kept after an earlier chunk (exact); False recomputes them.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(selection="wrapper", chunked=True)

    press: BasePress = None
    chunk_size: int = 4096
    reuse_norms: bool = True
    # the state of a prefill in progress (never compared, never shown)
    chunk: tuple[int, int] | None = field(default=None, init=False, repr=False, compare=False)  # chunk being compressed
    reused_norm_entries: int = field(default=0, init=False, repr=False, compare=False)  # norms not recomputed
    _norms: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # layer -> StoredNorms
    _model: nn.Module | None = field(default=None, init=False, repr=False, compare=False)
    _prefill: ExitStack | None = field(default=None, init=False, repr=False, compare=False)  # a chunked prefill's scope
    _running_chunks: bool = field(default=False, init=False, repr=False, compare=False)  # inside the earlier chunks
    # set by an outer CompactCachePress while it is entered: a dense layer is masked, not pruned, after its first chunk
    # (the compact press then packs it with its entries' positions, which pruning would lose)
    compact_outside: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.press, BasePress):
            raise TypeError(f"ChunkedPrefillPress wraps a kvpress press, got {type(self.press).__name__}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {self.chunk_size!r}")
        refusal = chunked_prefill_refusal(self.press)
        if refusal is not None:
            raise TypeError(f"ChunkedPrefillPress cannot wrap {refusal}")
        for inner in nested_presses(self.press):
            window = getattr(inner, "window_size", 0)
            if isinstance(window, int) and window >= self.chunk_size:
                raise ValueError(
                    f"chunk_size {self.chunk_size} must exceed {type(inner).__name__}'s window ({window}): each "
                    "chunk's last tokens are its observation window"
                )

    @property
    def window(self) -> int:
        """The longest observation window of the presses inside (0 without one)."""
        sizes = [getattr(p, "window_size", 0) for p in nested_presses(self.press)]
        return max([w for w in sizes if isinstance(w, int)], default=0)

    def chunk_bounds(self, length: int) -> list[tuple[int, int]]:
        """
        ``(start, end)`` of each chunk of a ``length``-token prefill: ``chunk_size`` tokens each, the last one merged
        into the one before when it is not longer than the observation window (it could not fill it).
        """
        bounds = [(start, min(start + self.chunk_size, length)) for start in range(0, length, self.chunk_size)]
        if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] <= self.window:
            bounds[-2:] = [(bounds[-2][0], length)]
        return bounds

    def budget(self, seen: int) -> int:
        """
        Entries kept per head (on average over the heads) after the chunk that ends at ``seen`` tokens:
        ``max(1, int(seen * (1 - compression_ratio)))``, what a one-shot compression of ``seen`` tokens keeps. A
        subclass may keep other counts (a paged engine's, rounded up to whole blocks); a count not smaller than what
        the layer holds keeps everything.
        """
        return compute_n_kept(seen, self.compression_ratio)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        return self.press.compress(module, hidden_states, keys, values, attentions, kwargs)

    @contextmanager
    def __call__(self, model):
        refusal = chunked_prefill_model_refusal(self.press, model)
        if refusal is not None:
            raise NotImplementedError(refusal)
        self.press.post_init_from_model(model)
        base = decoder(model)
        self._model = model
        # per-layer hooks first: an outer CompactCachePress registers its own after these, and compacts what they left
        hooks = [m.register_forward_hook(self._after_layer, with_kwargs=True) for m in hooked_attention_modules(model)]
        hooks.append(base.register_forward_pre_hook(self._before_prefill, with_kwargs=True))
        hooks.append(base.register_forward_hook(self._after_prefill, with_kwargs=True, always_call=True))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            self._end_prefill()
            self._model = None

    # ---- the prefill: split into chunks (a pre-hook on the decoder) ---------------------------------------------

    def _before_prefill(self, base, args, kwargs):
        """Run a long prefill's chunks but the last; the original call then runs the last one (returned kwargs)."""
        if self._running_chunks:
            return None  # one of the chunks this press runs
        input_ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        tokens = input_ids if input_ids is not None else embeds
        cache = kwargs.get("past_key_values")
        empty = cache is None or cache.get_seq_length() == 0
        if args or tokens is None or tokens.shape[1] <= self.chunk_size or not empty:
            return None  # not a long prefill: a one-shot prefill is compressed by the inner press's own hook
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
            raise NotImplementedError(padded_batch_refusal(self))
        cache = DynamicCache(config=self._model.config) if cache is None else cache  # it must outlive the chunks
        rest = {k: v for k, v in kwargs.items() if k not in _RECOMPUTED}
        bounds = self.chunk_bounds(tokens.shape[1])
        self._prefill = ExitStack()
        self._prefill.enter_context(attention_wrapping(exact_masking=True))  # chunks attend exactly over masked entries
        self._norms = {}

        def chunk_kwargs(start, end):
            # original positions for RoPE; the cache positions (masks) follow what the cache holds
            positions = torch.arange(start, end, device=tokens.device).expand(tokens.shape[0], -1)
            data = {"input_ids": input_ids[:, start:end]} if input_ids is not None else {}
            data.update({"inputs_embeds": embeds[:, start:end]} if embeds is not None else {})
            return {**data, **rest, "past_key_values": cache, "position_ids": positions}

        self._running_chunks = True
        try:
            for start, end in bounds[:-1]:
                self.chunk = (start, end)
                base(**chunk_kwargs(start, end))
        except BaseException:
            self._end_prefill()
            raise
        finally:
            self._running_chunks = False
        self.chunk = bounds[-1]
        return (), chunk_kwargs(*bounds[-1])

    def _after_prefill(self, base, args, kwargs, output):
        if not self._running_chunks:
            self._end_prefill()
        return output

    def _end_prefill(self) -> None:
        self.chunk = None
        self._norms = {}
        if self._prefill is not None:
            self._prefill.close()
            self._prefill = None

    # ---- after every layer: compress back to the budget of the tokens seen --------------------------------------

    def _after_layer(self, module, args, kwargs, output):
        if self.chunk is None:  # a one-shot prefill (or decoding): the inner press as it is alone
            return self.press.forward_hook(module, args, kwargs, output)
        if self.compression_ratio == 0:
            return output
        start, seen = self.chunk
        idx = module.layer_idx
        pruning = capabilities(self.press).selection == "pruning"
        pruning &= not (self.compact_outside and not is_sliding_layer(module))
        layout = layer_layout(kwargs["past_key_values"], idx, module, pruning, self.chunk)
        view = layout.view()
        stored = self._norms.get(idx) if self.reuse_norms else None
        known = layout.known_norms(stored) if stored is not None else {}
        n_kept = self.budget(seen)
        layer = LayerInput(
            module, kwargs["hidden_states"], view.keys, view.values, output[1], kwargs, view.excluded, known
        )
        keep = keep_mask(self.press, layer, n_kept)
        layout.keep(keep)
        self._norms[idx] = StoredNorms(layer.computed_norms, keep)
        self.reused_norm_entries += layer.reused_entries
        return output


__all__ = ["ChunkedPrefillPress"]
