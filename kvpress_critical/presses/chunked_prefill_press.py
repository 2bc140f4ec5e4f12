import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import kvpress
import torch
from kvpress import (
    BasePress,
    ComposedPress,
    DecodingPress,
    DMSPress,
    ExpectedAttentionPress,
    FinchPress,
    KeyRerotationPress,
    PerLayerCompressionPress,
    PrefillDecodingPress,
    PyramidKVPress,
    ScorerPress,
    SnapKVPress,
    ThinKPress,
)
from transformers import DynamicCache

from kvpress_critical.cache import CompactLayer, is_sliding_layer, keep_mask_from_indices
from kvpress_critical.cache.attention import exact_masked_attention
from kvpress_critical.modeling import attention_modules, decoder, hooked_attention_modules
from kvpress_critical.norm_reuse import reusing_norms
from kvpress_critical.presses.checks import nested_presses
from kvpress_critical.presses.exclusion import excluding, mask_excluded
from kvpress_critical.presses.inner_press import InnerPressMixin
from kvpress_critical.presses.window_attention import window_attention
from kvpress_critical.selection import compute_n_kept, top_budget_mask

logger = logging.getLogger(__name__)


# presses whose scores or budgets assume they see the whole context at once, from position 0
_WHOLE_CONTEXT = {
    ExpectedAttentionPress: "it rotates its expected future queries from the chunk's length, not the position reached",
    PyramidKVPress: "its per-layer budgets are derived from the context length it is called with",
    PerLayerCompressionPress: "it sets each layer's compression ratio itself, replacing the chunk's effective ratio",
    KeyRerotationPress: "it re-rotates the kept keys, while chunks are prefilled at their original positions",
    FinchPress: "it locates the question in the context by a delimiter, which only the whole context contains",
    ComposedPress: "it compresses with each of its presses in turn, through their own hooks only",
    DMSPress: "it sets its threshold, not a compression ratio, which the chunks need to follow the budget",
    ThinKPress: "it compresses channels, not entries",
}
# kvpress's own CriticalKV presses: their (A + eps) * N ranks a padded or evicted entry (A = -inf, N = 0) first (NaN)
_BUILTIN_CRITICAL = tuple(getattr(kvpress, n) for n in ("CriticalKVPress", "CriticalAdaKVPress") if hasattr(kvpress, n))


def _unsupported_inside_chunked(press) -> str | None:
    for cls, reason in _WHOLE_CONTEXT.items():
        if isinstance(press, cls):
            return reason
    if isinstance(press, _BUILTIN_CRITICAL):
        return (
            "kvpress's built-in CriticalKV presses rank an excluded entry (score -inf, norm 0) first; use "
            "kvpress_critical.CriticalKVPress / CriticalAdaKVPress, which select the same entries otherwise"
        )
    if isinstance(press, (DecodingPress, PrefillDecodingPress)):
        return "ChunkedPrefillPress compresses the prefill: wrap a prefill press, not a decoding press"
    if type(press).__name__ == "CompactCachePress":
        return (
            "put the compact layout outside: CompactCachePress(ChunkedPrefillPress(press, chunk_size=...)) "
            "(ChunkedPrefillPress compresses with the inner press after every chunk, then the layer is compacted)"
        )
    if type(press).__call__ is not BasePress.__call__:
        return "it drives the model with its own __call__, which cannot be repeated per chunk"
    return None


def _scorers(press) -> list[ScorerPress]:
    """The ScorerPress instances inside ``press`` (itself, or the presses it wraps)."""
    return [p for p in nested_presses(press) if isinstance(p, ScorerPress)]


@contextmanager
def _patched_scorers(press):
    """While active, the scorers inside ``press`` give excluded entries ``-inf`` and SnapKV's window ignores them."""
    patched = []
    for scorer in _scorers(press):
        original_score = scorer.score
        scorer.score = lambda *args, _f=original_score, **kw: mask_excluded(_f(*args, **kw))
        patched.append((scorer, "score"))
        if isinstance(scorer, SnapKVPress):

            def masked_window(module, hidden_states, keys, window_size, position_embeddings):
                attn = window_attention(module, hidden_states, keys, window_size, position_embeddings)
                bsz, num_kv_heads, group, window, k_len = attn.shape
                flat = attn.reshape(bsz, num_kv_heads * group, window, k_len)[..., :-window_size]
                return flat.to(keys.dtype)  # as kvpress's: probabilities over the entries before the window

            scorer.compute_window_attention = masked_window
            patched.append((scorer, "compute_window_attention"))
    try:
        yield
    finally:
        for scorer, name in patched:
            scorer.__dict__.pop(name, None)


def _dense_view(layer: CompactLayer):
    """
    A compact layer (packed context + the chunk just appended to its tail) as dense ``(B, H_kv, L, d)`` tensors:
    each head's context entries first (original order), padding up to the longest head, then the tail, so that the
    newest tokens are the last entries as every scorer expects. Returns keys, values, padding mask, positions and the
    ``(B, H_kv, width)`` mask of where the packed entries went.
    """
    bsz, num_kv_heads, d = layer.batch_size, layer.num_kv_heads, layer.head_dim
    lengths = layer.segment_lengths()  # (B, H_kv)
    width = int(lengths.max()) if lengths.numel() else 0
    tail = layer.tail_len
    total = width + tail
    device, dtype = layer.device, layer.dtype
    keys = torch.zeros(bsz, num_kv_heads, total, d, dtype=dtype, device=device)
    values = torch.zeros_like(keys)
    slot = torch.arange(width, device=device).expand(bsz, num_kv_heads, width)
    filled = slot < lengths.to(device).unsqueeze(-1)  # (B, H_kv, width): where the packed entries go
    keys[:, :, :width][filled] = layer.packed_keys
    values[:, :, :width][filled] = layer.packed_values
    keys[:, :, width:] = layer.tail_keys[:, :, :tail]
    values[:, :, width:] = layer.tail_values[:, :, :tail]
    positions = torch.full((bsz, num_kv_heads, total), -1, dtype=torch.int32, device=device)
    positions[:, :, :width][filled] = layer.positions
    positions[:, :, width:] = layer.tail_positions[:tail].to(device)
    padding = torch.zeros(bsz, num_kv_heads, total, dtype=torch.bool, device=device)
    padding[:, :, :width] = ~filled
    return keys, values, padding, positions, filled


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
    its chunk is first compressed (:mod:`kvpress_critical.norm_reuse`; exact, since it depends on the entry's value
    only: DefensiveKV's normalisation across heads is recomputed from these raw norms), except for the entries the
    first chunk kept, and for presses that prune with their own ``compress`` (kvpress's wrappers), whose kept order
    is not known. A pruning ``ScorerPress`` (SnapKV, Knorm, CriticalKV...) is applied here as its scores plus a
    per-head top-k that keeps the entries in position order (kvpress's ``compress`` keeps them in score order; the
    selected set is the same up to ties).

    Refused (a clear error): presses that need the whole context at once (ExpectedAttention, PyramidKV,
    PerLayerCompression, key re-rotation, Finch), presses with their own ``__call__`` (KVzip...), decoding presses,
    Layer-DefensiveKV (one selection across all layers after the last), padded batches, and DefensiveKV inside
    CompactCachePress (its normalisation across heads needs the aligned layout).

    Based on CriticalKV (https://arxiv.org/abs/2502.03805), appendix B.6 (chunked prefill).

    Parameters
    ----------
    press : BasePress
        The press that compresses (it holds the ``compression_ratio``).
    chunk_size : int, default=4096
        Tokens per chunk; must exceed a SnapKV-style scorer's window.
    """

    press: BasePress = None
    chunk_size: int = 4096
    _norms: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # layer -> norms held
    reused_norm_entries: int = field(default=0, init=False, repr=False, compare=False)

    compact_compatible: ClassVar[bool] = True  # CompactCachePress may wrap it (it compacts after each chunk)

    def __post_init__(self):
        if not isinstance(self.press, BasePress):
            raise TypeError(f"ChunkedPrefillPress wraps a kvpress press, got {type(self.press).__name__}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive number of tokens, got {self.chunk_size!r}")
        for inner in nested_presses(self.press):
            problem = _unsupported_inside_chunked(inner)
            if problem:
                raise TypeError(f"ChunkedPrefillPress cannot wrap {type(inner).__name__}: {problem}")
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

    @property
    def compresses_after_last_layer(self) -> bool:
        return bool(getattr(self.press, "compresses_after_last_layer", False))

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        return self.press.compress(module, hidden_states, keys, values, attentions, kwargs)

    @contextmanager
    def __call__(self, model):
        base = decoder(model)
        original_forward = base.forward

        def chunked_forward(*args, input_ids=None, inputs_embeds=None, past_key_values=None, **kwargs):
            tokens = input_ids if input_ids is not None else inputs_embeds
            empty = past_key_values is None or past_key_values.get_seq_length() == 0
            if args or tokens is None or tokens.shape[1] <= self.chunk_size or not empty:
                # one shot: the inner press's own hooks compress, exactly as without ChunkedPrefillPress
                return original_forward(*args, input_ids=input_ids, inputs_embeds=inputs_embeds,
                                        past_key_values=past_key_values, **kwargs)  # fmt: skip
            if self.compresses_after_last_layer:
                raise NotImplementedError(
                    f"{type(self.press).__name__} selects every layer at once after the last one: it cannot compress "
                    "each layer after each chunk. Use DefensiveKVPress (per-layer budgets) with ChunkedPrefillPress."
                )
            self._check_layers(model)
            mask = kwargs.get("attention_mask")  # (Gemma3's multimodal model passes its per-layer-type masks: a dict)
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
                raise NotImplementedError(
                    "ChunkedPrefillPress does not support padded batches: prefill rows one by one"
                )
            for name in ("attention_mask", "position_ids", "cache_position"):
                kwargs.pop(name, None)
            if past_key_values is None:  # the cache must outlive the chunks
                past_key_values = DynamicCache(config=model.config)
            output = None
            with self._compressing(model):
                for start, end in self.chunk_bounds(tokens.shape[1]):
                    self._seen = end
                    # original positions for RoPE; the cache positions (masks) follow what the cache holds
                    positions = torch.arange(start, end, device=tokens.device).expand(tokens.shape[0], -1)
                    chunk = {"input_ids": input_ids[:, start:end]} if input_ids is not None else {
                        "inputs_embeds": inputs_embeds[:, start:end]}  # fmt: skip
                    output = original_forward(
                        **chunk, past_key_values=past_key_values, position_ids=positions, **kwargs
                    )
            return output

        # the inner press's hooks stay registered first: they compress a one-shot prefill and the first chunk (the
        # only forward they see as a prefill); the later chunks are compressed by _after_chunk
        with self.press(model):
            base.forward = chunked_forward
            try:
                yield
            finally:
                if base.__dict__.get("forward") is chunked_forward:
                    del base.forward  # back to the class's (or a previous instance) forward
                    if base.forward != original_forward:
                        base.forward = original_forward

    @property
    def _own_selection(self) -> bool:
        """A pruning scorer applied as its scores + an ordered per-head top-k (its class keeps kvpress's compress)."""
        return isinstance(self.press, ScorerPress) and type(self.press).compress is ScorerPress.compress

    def _check_layers(self, model) -> None:
        hooked = hooked_attention_modules(model)
        pruning = isinstance(self.press, ScorerPress)
        if pruning and len(hooked) != len(attention_modules(model)):
            raise NotImplementedError(
                f"{type(model).__name__}: kvpress compresses only some layers of this model, and a pruning press "
                "would leave the layers with different lengths, which the chunks' causal masks cannot follow; use a "
                "head-wise press (e.g. CriticalAdaKVPress) with ChunkedPrefillPress on it"
            )
        sliding = [m.layer_idx for m in hooked if is_sliding_layer(m)]
        if sliding and not pruning:
            raise NotImplementedError(
                f"layers {sliding} attend through a sliding window, which the exact masked attention of the chunks "
                "does not implement (kvpress's fake keys can leak); use a pruning press or a one-shot prefill"
            )

    def _ordered_compress(self, module, hidden_states, keys, values, attentions, kwargs):
        """``ScorerPress.compress`` keeping the selected entries in position order (kvpress: score order)."""
        if self.press.compression_ratio == 0:
            return keys, values
        scores = self.press.score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = compute_n_kept(keys.shape[2], self.press.compression_ratio)
        keep = top_budget_mask(scores, torch.full(scores.shape[:2], n_kept, device=scores.device))
        bsz, num_kv_heads, _, head_dim = keys.shape
        return keys[keep].view(bsz, num_kv_heads, -1, head_dim), values[keep].view(bsz, num_kv_heads, -1, head_dim)

    @contextmanager
    def _compressing(self, model):
        """Hooks compressing each layer after each chunk's forward."""
        modules = hooked_attention_modules(model)  # the layers the inner press compresses
        handles = [m.register_forward_hook(self._after_chunk, with_kwargs=True) for m in modules]
        if self._own_selection:  # the first chunk too: the pruned cache stays in position order
            self.press.compress = self._ordered_compress
        try:
            with exact_masked_attention():  # chunks attend exactly over the masking layout (no fake keys)
                yield
        finally:
            self.press.__dict__.pop("compress", None)
            for handle in handles:
                handle.remove()

    def _after_chunk(self, module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        idx = module.layer_idx
        layer = cache.layers[idx]
        hidden_states = kwargs["hidden_states"]
        seen = self._seen
        chunk = hidden_states.shape[1]
        if seen == chunk:  # the first chunk: the inner press's own hook compressed it
            self._norms.pop(idx, None)
            return output
        compact = isinstance(layer, CompactLayer)
        stored = self._norms.pop(idx, {})  # norm name -> norms of the entries held, in the layout's order
        if compact:
            layer.tail_positions = torch.arange(seen - chunk, seen, dtype=torch.int32)
            keys, values, excluded, positions, filled = _dense_view(layer)
            known = {}
            for name, packed in stored.items():  # packed (N,) -> the padded view's (B, H_kv, width)
                dense = torch.zeros(filled.shape, dtype=packed.dtype, device=packed.device)
                dense[filled] = packed
                known[name] = dense
        else:
            keys, values = layer.keys, layer.values
            masked = getattr(module, "masked_key_indices", None)
            excluded = None if masked is None else ~keep_mask_from_indices(masked, keys.shape[:3], keys.device)
            positions, known = None, stored
        view_len = keys.shape[2]
        n_target = compute_n_kept(seen, self.compression_ratio)
        if n_target >= view_len and excluded is None:
            self._norms[idx] = stored  # nothing to evict yet (still a prefix of what the layer holds)
            return output
        ratio = self.compression_ratio
        effective = min(max(1.0 - (n_target + 0.5) / view_len, 0.0), 1.0 - 1e-9)  # compute_n_kept(view_len, .) = target
        module.masked_key_indices = None
        self.press.compression_ratio = effective
        own_selection = self._own_selection
        try:
            with excluding(excluded), _patched_scorers(self.press), reusing_norms(known) as norms:
                if own_selection:  # a pruning press: its scores, our top-k (which keeps the entries in order)
                    scores = self.press.score(module, hidden_states, keys, values, output[1], kwargs)
                    budgets = torch.full(scores.shape[:2], min(n_target, view_len), device=scores.device)
                    keep = top_budget_mask(mask_excluded(scores), budgets)
                else:
                    new_keys, new_values = self.press.compress(module, hidden_states, keys, values, output[1], kwargs)
                    masked = getattr(module, "masked_key_indices", None)
                    keep = None if masked is None else keep_mask_from_indices(masked, keys.shape[:3], keys.device)
        finally:
            self.press.compression_ratio = ratio
        if keep is None and new_keys.shape[2] < view_len:  # pruned by the press: which entries stay is not known
            layer.keys, layer.values = new_keys, new_values
            return output
        if keep is None:  # the press kept every entry
            keep = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
        if excluded is not None:
            keep &= ~excluded
        if compact:
            cache.layers[idx] = CompactLayer.from_keep_mask(
                keys, values, keep, reserve=layer.reserve, positions=positions, context_length=seen
            )
            module.masked_key_indices = None
            self._norms[idx] = {name: full[keep] for name, full in norms.computed.items()}  # packed order
        elif own_selection:  # pruning: the dense cache keeps the selected entries, in their order
            bsz, num_kv_heads, _, head_dim = keys.shape
            layer.keys = keys[keep].view(bsz, num_kv_heads, -1, head_dim)
            layer.values = values[keep].view(bsz, num_kv_heads, -1, head_dim)
            self._norms[idx] = {name: full[keep].view(bsz, num_kv_heads, -1) for name, full in norms.computed.items()}
        else:  # masking layout: every entry not kept (now or before) is masked; the dense entries all stay
            module.masked_key_indices = tuple((~keep).nonzero(as_tuple=True))
            self._norms[idx] = dict(norms.computed)
        self.reused_norm_entries += norms.reused_entries
        return output


__all__ = ["ChunkedPrefillPress"]
