import logging
from contextlib import contextmanager
from dataclasses import dataclass

from kvpress import BasePress, DecodingPress, KeyRerotationPress, PrefillDecodingPress
from kvpress.presses.base_press import is_prefilling
from transformers import Gemma3ForConditionalGeneration

from kvpress_critical.cache import DEFAULT_RESERVE, CompactLayer, compact_layer, install_attention, is_sliding_layer
from kvpress_critical.modeling import attention_modules
from kvpress_critical.presses.checks import check_ratio

logger = logging.getLogger(__name__)


@dataclass
class CompactCachePress(BasePress):
    """
    Frees the memory head-wise presses only mask: each layer's cache keeps just the entries the press selected.

    Wraps any press that compresses during the prefill, in particular the head-wise ones that record their
    selection in ``module.masked_key_indices`` (``CriticalAdaKVPress``, kvpress's ``AdaKVPress``, the HeadKV and
    DefensiveKV presses): right after the inner press has compressed a layer, the layer's dense cache is replaced by
    a :class:`~kvpress_critical.cache.CompactLayer` holding, per (batch row, KV head), only the kept entries, packed,
    in the model's dtype; later tokens go to a dense tail with reserved room (``reserve``, doubled when full), and
    attention runs on that layout through :func:`kvpress_critical.ops.ragged_attention` (``torch``, ``cpp``,
    ``triton`` and ``flash`` backends). Selections are exactly the inner press's, so results match the masking
    layout (kvpress's default, what the inner press does alone) up to floating-point summation order.

    Works through kvpress's unchanged pipeline (``pipe(context, question=...)`` and ``questions=[...]``: each answer
    is removed by shrinking the tail), with ``sdpa`` and ``flash_attention_2``. Sliding-window layers (Gemma3's local
    layers, models configured with a window) keep their dense masked cache: the compact op has no window. Not
    supported: eager attention (its attention function is not registered, so it cannot see the layout), and presses
    that compress during decoding (``DecodingPress``, ``PrefillDecodingPress`` with a decoding press) or re-rotate
    keys (``KeyRerotationPress``): each is a clear error.

    Parameters
    ----------
    press : BasePress
        The press that selects the entries (it holds the ``compression_ratio``).
    reserve : int, default=64
        Tail capacity (tokens per head) reserved at compaction for the question and the answer.
    """

    press: BasePress = None
    reserve: int = DEFAULT_RESERVE

    def __post_init__(self):
        if not isinstance(self.press, BasePress):
            raise TypeError(f"CompactCachePress wraps a kvpress press, e.g. CompactCachePress(CriticalAdaKVPress("
                            f"SnapKVPress(0.5))); got {type(self.press).__name__}")  # fmt: skip
        if isinstance(self.press, CompactCachePress):
            raise TypeError("CompactCachePress wraps a press once: pass its inner press directly")
        decoding = isinstance(self.press, DecodingPress) or (
            isinstance(self.press, PrefillDecodingPress) and self.press.decoding_press is not None
        )
        if decoding:
            raise TypeError(
                "CompactCachePress does not support presses that compress during decoding (DecodingPress, "
                "PrefillDecodingPress with a decoding_press): the compact layout is built once, after the prefill. "
                "Use the decoding press without CompactCachePress (masking layout)."
            )
        if isinstance(self.press, KeyRerotationPress):
            raise TypeError(
                "CompactCachePress does not support KeyRerotationPress (kvpress's pipeline re-positions tokens only "
                "when the outermost press is a KeyRerotationPress); use KeyRerotationPress without it"
            )
        if not isinstance(self.reserve, int) or self.reserve < 1:
            raise ValueError(f"reserve must be a positive number of tokens, got {self.reserve!r}")

    @property
    def compression_ratio(self) -> float:
        return self.press.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        check_ratio(value)
        self.press.compression_ratio = value

    def post_init_from_model(self, model):
        impl = getattr(model.config, "_attn_implementation", None)
        if impl == "eager":
            raise ValueError(
                "CompactCachePress needs a registered attention function (sdpa, flash_attention_2...): eager attention "
                "calls the model's own function, which cannot read the compact layout. Load the model with "
                "attn_implementation='sdpa'."
            )
        self.press.post_init_from_model(model)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError(
            "CompactCachePress changes the layout of the whole cache after the prefill: use it as the outermost press "
            "(e.g. CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)))), not inside another wrapper"
        )

    def _layers(self, model):
        modules = attention_modules(model)
        if isinstance(model, Gemma3ForConditionalGeneration):  # kvpress compresses only its global layers
            modules = [m for m in modules if not m.is_sliding]
        return modules

    @contextmanager
    def __call__(self, model):
        self.post_init_from_model(model)
        install_attention()
        modules = [m for m in self._layers(model) if not is_sliding_layer(m)]
        if not modules:
            logger.warning(
                "CompactCachePress: every layer of this model uses sliding-window attention; none is compacted"
            )
        # a press that compresses every layer only once the last one is scored (Layer-DefensiveKV) sets its masks
        # after the per-layer hooks ran: its layers are compacted when the whole forward pass has ended
        deferred = bool(getattr(self.press, "compresses_after_last_layer", False))
        pending: list = []

        def layer_hook(module, args, kwargs, output):
            if not is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
                return output
            cache = kwargs["past_key_values"]
            if deferred:
                pending.append((cache, module))
            else:
                compact_layer(cache, module.layer_idx, module, self.reserve)
            return output

        def model_hook(base, args, kwargs, output):
            while pending:
                cache, module = pending.pop(0)
                compact_layer(cache, module.layer_idx, module, self.reserve)
            return output

        base_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
        with self.press(model):
            hooks = [m.register_forward_hook(layer_hook, with_kwargs=True) for m in modules]
            hooks.append(base_model.register_forward_hook(model_hook, with_kwargs=True))
            try:
                yield
            finally:
                for hook in hooks:
                    hook.remove()
                pending.clear()


def compact_layers(cache) -> list[CompactLayer]:
    """The compact layers of a cache (e.g. after ``pipe(..., press=CompactCachePress(...), cache=cache)``)."""
    return [layer for layer in cache.layers if isinstance(layer, CompactLayer)]
