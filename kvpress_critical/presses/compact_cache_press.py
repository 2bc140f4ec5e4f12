import logging
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from kvpress import BasePress, DecodingPress, PrefillDecodingPress
from kvpress.presses.base_press import is_prefilling
from transformers import QuantizedCache

from kvpress_critical.cache import DEFAULT_RESERVE, CompactLayer, compact_layer, install_attention, is_sliding_layer
from kvpress_critical.cache.quantize import FORMATS
from kvpress_critical.capabilities import Capabilities, capabilities, compact_refusal, nested_presses
from kvpress_critical.modeling import decoder, hooked_attention_modules
from kvpress_critical.presses.budgeted import keep_mask
from kvpress_critical.presses.checks import check_ratio
from kvpress_critical.presses.decoding_compression import DecodingCompressor
from kvpress_critical.presses.inner_press import InnerPressMixin
from kvpress_critical.selection import compute_n_kept

logger = logging.getLogger(__name__)


def split_phases(press: BasePress) -> tuple[BasePress | None, DecodingPress | None]:
    """``(the press that compresses the prefill, the DecodingPress that compresses while decoding)``, either None."""
    if isinstance(press, DecodingPress):
        return None, press
    if isinstance(press, PrefillDecodingPress):
        return press.prefilling_press, press.decoding_press
    return press, None


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
    is removed by shrinking the tail) and ``model.generate``, with ``sdpa`` and ``flash_attention_2``. The layer
    reports the logical length (``get_seq_length``), so positions and the other layers' masks are unchanged by the
    conversion. Sliding-window layers (Gemma3's local layers, models configured with a real window) keep their dense
    masked cache: the compact op has no window.

    - **Padded batches** (``model.generate`` on a left-padded batch): each row is compressed as if it were alone,
      on its own tokens with its own budget (``(1 - ratio) x`` its length), and its segments hold only its kept
      entries: padding is never kept. Needs a press with an explicit budget (this package's presses, a kvpress
      ``ScorerPress`` or ``AdaKVPress``; :mod:`kvpress_critical.capabilities`).
    - **Compression during decoding**: ``CompactCachePress(DecodingPress(base_press=..., compression_interval=N,
      target_size=M))`` and ``CompactCachePress(PrefillDecodingPress(prefilling_press=..., decoding_press=
      DecodingPress(...)))`` compress every layer back to ``M`` entries per head (on average; exactly for a pruning
      base press) every ``N`` forwards after the prefill, each (row, KV head) to its own budget, in the compact layout
      (:mod:`kvpress_critical.presses.decoding_compression`). ``base_press`` may be a head-wise press such as
      ``CriticalAdaKVPress``. kvpress's pipeline then enters the press for the answer too, and asks one question per
      context, as for its own decoding presses.
    - **Quantized entries**: ``quantize="int8"`` or ``"int4"`` stores the kept context entries as codes with one
      scale per entry (:mod:`kvpress_critical.cache.quantize`), dequantized for each step's attention; the tail
      stays in the model's dtype. transformers' ``QuantizedCache`` is refused: use this option instead.

    Not supported, each a clear error: eager attention (its attention function is not registered, so it cannot see
    the layout), right-padded batches, ``DMSPress(decoding=True)``, presses that re-rotate keys
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
    quantize : {None, "int8", "int4"}, default=None
        Store the kept context entries quantized, one scale per entry.
    """

    capabilities: ClassVar[Capabilities] = Capabilities(selection="wrapper", changes_layout=True)

    press: BasePress = None
    reserve: int = DEFAULT_RESERVE
    quantize: str | None = None
    # the state of a forward in progress (never compared, never shown): the rows' first real token, for a padded batch
    _row_starts: list | None = field(default=None, init=False, repr=False, compare=False)
    _padded: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # layer -> dense K, V, keep
    _decoding: DecodingCompressor | None = field(default=None, init=False, repr=False, compare=False)

    def __new__(cls, *args, **kwargs):
        # with a decoding press inside, kvpress's pipeline must enter the press for the answers too: it does so for
        # PrefillDecodingPress instances, which the compact press with a decoding schedule then is
        press = kwargs.get("press", args[0] if args else None)
        if cls is CompactCachePress and isinstance(press, BasePress) and split_phases(press)[1] is not None:
            cls = _CompactDecodingCachePress
        return super().__new__(cls)

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
        if self.quantize is not None and self.quantize not in FORMATS:
            raise ValueError(f"quantize must be None, 'int8' or 'int4', got {self.quantize!r}")

    @property
    def compression_ratio(self) -> float:
        """The prefill press's ratio (0 without one: a decoding press has a target size instead)."""
        prefill = self.prefill_press
        return 0.0 if prefill is None else prefill.compression_ratio

    @compression_ratio.setter
    def compression_ratio(self, value: float) -> None:
        check_ratio(value)
        prefill = self.prefill_press
        if prefill is not None:
            prefill.compression_ratio = value
        elif value:
            raise ValueError(
                f"{type(self.press).__name__} compresses while decoding only (its target_size sets the budget): it "
                "has no compression ratio to set"
            )

    @property
    def prefill_press(self) -> BasePress | None:
        """The press that compresses the prefill (None: the prefill is compacted as it is)."""
        return split_phases(self.press)[0]

    @property
    def decoding_schedule(self) -> DecodingPress | None:
        """The ``DecodingPress`` whose schedule compresses the cache while decoding (None: no compression then)."""
        return split_phases(self.press)[1]

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
        prefill, schedule = self.prefill_press, self.decoding_schedule
        # a press that compresses every layer only once the last one is scored (Layer-DefensiveKV) sets its masks
        # after the per-layer hooks ran: its layers are compacted when the whole forward pass has ended
        deferred = prefill is not None and any(
            capabilities(p).selects_after_last_layer for p in nested_presses(prefill)
        )
        pending: list = []

        def select_rows(module, args, kwargs, output):  # first: the dense layer as the prefill left it
            if self._row_starts is not None and is_prefilling(
                kwargs["cache_position"], kwargs["hidden_states"].shape[1]
            ):
                layer = kwargs["past_key_values"].layers[module.layer_idx]
                self._padded[module.layer_idx] = (layer.keys, layer.values, self._padded_keep(module, kwargs))
            return output

        def layer_hook(module, args, kwargs, output):  # last: after the inner press compressed the layer
            if not is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
                if self._decoding is not None:
                    self._decoding.after_layer(module, kwargs, output)
                return output
            cache, idx = kwargs["past_key_values"], module.layer_idx
            if deferred:
                pending.append((cache, module))
            elif idx in self._padded:  # a padded batch: each row selected as if alone (whatever the press did)
                keys, values, keep = self._padded.pop(idx)
                cache.layers[idx] = CompactLayer.from_keep_mask(
                    keys, values, keep, reserve=self.reserve, quantize=self.quantize
                )
                module.masked_key_indices = None
            else:
                compact_layer(cache, idx, module, self.reserve, quantize=self.quantize)
            return output

        def before_forward(base, args, kwargs):
            self._row_starts = None
            cache = kwargs.get("past_key_values")
            if isinstance(cache, QuantizedCache):
                raise TypeError(
                    "CompactCachePress keeps its own layout and cannot compact transformers' QuantizedCache (its "
                    "layers would stay full-length); for quantized entries use CompactCachePress(press, "
                    "quantize='int8' or 'int4') with a DynamicCache"
                )
            mask = kwargs.get("attention_mask")
            empty = cache is None or cache.get_seq_length() == 0
            if empty and isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
                self._row_starts = self._padding(mask)

        def after_forward(base, args, kwargs, output):
            while pending:
                cache, module = pending.pop(0)
                compact_layer(cache, module.layer_idx, module, self.reserve, quantize=self.quantize)
            self._row_starts = None
            self._padded.clear()
            return output

        base_model = decoder(model)
        with ExitStack() as stack:
            if prefill is not None:
                stack.enter_context(prefill(model))  # its own hooks compress, as it does alone
            if schedule is not None:
                schedule.base_press.post_init_from_model(model)
                self._decoding = DecodingCompressor(schedule, model)
            hooks = [m.register_forward_hook(select_rows, with_kwargs=True, prepend=True) for m in modules]
            hooks += [m.register_forward_hook(layer_hook, with_kwargs=True) for m in modules]
            hooks.append(base_model.register_forward_pre_hook(before_forward, with_kwargs=True))
            hooks.append(base_model.register_forward_hook(after_forward, with_kwargs=True, always_call=True))
            try:
                yield
            finally:
                for hook in hooks:
                    hook.remove()
                pending.clear()
                self._decoding = None
                self._row_starts = None
                self._padded.clear()

    def _padding(self, mask: torch.Tensor) -> list[int]:
        """The first real token of every row of a left-padded batch (an error for other paddings)."""
        mask = mask.bool()
        lengths = mask.sum(-1)
        starts = mask.shape[1] - lengths
        left_padded = bool((mask == (torch.arange(mask.shape[1], device=mask.device) >= starts[:, None])).all())
        if not left_padded:
            raise NotImplementedError(
                "CompactCachePress compresses a padded batch row by row and needs each row's tokens last: pad on the "
                "left (tokenizer.padding_side = 'left', as model.generate expects)"
            )
        prefill = self.prefill_press
        caps = None if prefill is None else capabilities(prefill)
        if caps is not None and caps.selects_after_last_layer:
            raise NotImplementedError(
                f"CompactCachePress compresses a padded batch row by row, with each row's own budget, but "
                f"{type(prefill).__name__} selects every layer at once after the last one; run the rows one at a time"
            )
        if caps is not None and not caps.budgeted:
            raise NotImplementedError(
                f"CompactCachePress compresses a padded batch row by row, with each row's own budget, which "
                f"{type(prefill).__name__} cannot be given (it selects with its own compress()); run the rows one at "
                "a time, or use a press of this package, a kvpress ScorerPress or AdaKVPress"
            )
        return starts.tolist()

    def _padded_keep(self, module, kwargs) -> torch.Tensor:
        """``(B, H_kv, T)`` bool: every row's selection on its own tokens, with its own budget; padding never kept."""
        cache = kwargs["past_key_values"]
        layer = cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values
        keep = torch.zeros(keys.shape[:3], dtype=torch.bool, device=keys.device)
        prefill = self.prefill_press
        for row, start in enumerate(self._row_starts):
            length = keys.shape[2] - start
            if prefill is None or self.compression_ratio == 0:
                keep[row, :, start:] = True
                continue
            cos, sin = kwargs["position_embeddings"]  # (1 or B, T, d)
            pick = slice(row, row + 1) if cos.shape[0] > 1 else slice(0, 1)
            row_kwargs = {
                **kwargs,
                "attention_mask": None,
                "position_embeddings": (cos[pick, start:], sin[pick, start:]),
            }
            keep[row : row + 1, :, start:] = keep_mask(
                prefill,
                module,
                kwargs["hidden_states"][row : row + 1, start:],
                keys[row : row + 1, :, start:],
                values[row : row + 1, :, start:],
                None,
                row_kwargs,
                compute_n_kept(length, self.compression_ratio),
            )
        return keep


class _CompactDecodingCachePress(CompactCachePress, PrefillDecodingPress):
    """``CompactCachePress`` around a decoding press: a ``PrefillDecodingPress`` too, so that kvpress's pipeline
    enters it for the answers (and asks one question per context, as for its own decoding presses)."""

    def __repr__(self):
        return super().__repr__().replace(type(self).__name__, "CompactCachePress", 1)


def compact_layers(cache) -> list[CompactLayer]:
    """The compact layers of a cache (e.g. after ``pipe(..., press=CompactCachePress(...), cache=cache)``)."""
    return [layer for layer in cache.layers if isinstance(layer, CompactLayer)]
