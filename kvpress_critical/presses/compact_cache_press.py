import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
from kvpress import BasePress
from kvpress.presses.base_press import is_prefilling

from kvpress_critical.cache import DEFAULT_RESERVE, CompactLayer, compact_layer, install_attention, is_sliding_layer
from kvpress_critical.capabilities import Capabilities, capabilities, compact_refusal, nested_presses
from kvpress_critical.modeling import decoder, hooked_attention_modules
from kvpress_critical.presses.inner_press import InnerPressMixin

logger = logging.getLogger(__name__)


@dataclass
class CompactCachePress(InnerPressMixin, BasePress):
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
    is removed by shrinking the tail), with ``sdpa`` and ``flash_attention_2``. The layer reports the length the dense
    layer had (``get_seq_length``), so positions and masks of the other layers are unchanged by the conversion.
    Sliding-window layers (Gemma3's local layers, models configured with a real window) keep their dense masked cache:
    the compact op has no window. Not supported, each a clear error: eager attention (its attention function is not
    registered, so it cannot see the layout), padded batches, presses that compress during decoding
    (``DecodingPress``, ``PrefillDecodingPress`` with a decoding press, ``DMSPress(decoding=True)``), re-rotate keys
    (``KeyRerotationPress``, ``FinchPress(rerotate_keys=True)``) or drive the model themselves (KVzip, RestoreKV,
    KVCompose, KVgrad).

    Based on CriticalKV's head-wise budgets (https://arxiv.org/abs/2502.03805) and AdaKV
    (https://arxiv.org/abs/2407.11550), with a varlen layout as in flash-attn's ``cu_seqlens``.

    Parameters
    ----------
    press : BasePress
        The press that selects the entries (it holds the ``compression_ratio``).
    reserve : int, default=64
        Tail capacity (tokens per head) reserved at compaction for the question and the answer.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(selection="wrapper", changes_layout=True)

    press: BasePress = None
    reserve: int = DEFAULT_RESERVE

    def __post_init__(self):
        if not isinstance(self.press, BasePress):
            raise TypeError(
                f"CompactCachePress wraps a kvpress press, e.g. CompactCachePress(CriticalAdaKVPress("
                f"SnapKVPress(0.5))); got {type(self.press).__name__}"
            )
        refusal = compact_refusal(self.press)
        if refusal is not None:
            raise TypeError(f"CompactCachePress does not support {refusal}")
        if not isinstance(self.reserve, int) or self.reserve < 1:
            raise ValueError(f"reserve must be a positive number of tokens, got {self.reserve!r}")

    def post_init_from_model(self, model):
        self.check_attention(model)
        self.press.post_init_from_model(model)

    @staticmethod
    def check_attention(model) -> None:
        configs = [model.config, getattr(model.config, "text_config", None)]
        if any(getattr(c, "_attn_implementation", None) == "eager" for c in configs if c is not None):
            raise ValueError(
                "CompactCachePress needs a registered attention function (sdpa, flash_attention_2...): eager attention "
                "calls the model's own function, which cannot read the compact layout. Load the model with "
                "attn_implementation='sdpa'."
            )

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError(
            "CompactCachePress changes the layout of the whole cache after the prefill: use it as the outermost press "
            "(e.g. CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)))), not inside another wrapper"
        )

    @contextmanager
    def __call__(self, model):
        self.check_attention(model)
        install_attention()
        modules = [m for m in hooked_attention_modules(model) if not is_sliding_layer(m)]
        if not modules:
            logger.warning(
                "CompactCachePress: every layer of this model uses sliding-window attention; none is compacted"
            )
        # a press that compresses every layer only once the last one is scored (Layer-DefensiveKV) sets its masks
        # after the per-layer hooks ran: its layers are compacted when the whole forward pass has ended
        deferred = any(capabilities(p).selects_after_last_layer for p in nested_presses(self.press))
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

        def padding_check(base, args, kwargs):
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
                raise NotImplementedError(
                    "CompactCachePress does not support padded batches (the compact attention has no padding mask): "
                    "run the rows one at a time, or use the inner press alone (masking layout)"
                )

        base_model = decoder(model)
        with self.press(model):  # calls the inner press's post_init_from_model
            hooks = [m.register_forward_hook(layer_hook, with_kwargs=True) for m in modules]
            hooks.append(base_model.register_forward_pre_hook(padding_check, with_kwargs=True))
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
