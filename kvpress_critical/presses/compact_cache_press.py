import logging
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from kvpress import BasePress, DecodingPress, PrefillDecodingPress
from kvpress.presses.base_press import is_prefilling
from transformers import QuantizedCache

from kvpress_critical.cache import DEFAULT_RESERVE, attention_wrapping, compact_layer, is_sliding_layer
from kvpress_critical.capabilities import (
    Capabilities,
    capabilities,
    compact_model_refusal,
    compact_refusal,
    nested_presses,
    padded_batch_refusal,
)
from kvpress_critical.modeling import decoder, hooked_attention_modules
from kvpress_critical.ops.ragged_attention.codes import FORMATS
from kvpress_critical.presses.budgeted import keep_mask
from kvpress_critical.presses.checks import check_ratio
from kvpress_critical.presses.decoding_compression import DecodingCompressor
from kvpress_critical.presses.inner_press import InnerPressMixin
from kvpress_critical.presses.layer_input import LayerInput
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
      scale per entry, ``"kivi4"`` in KIVI's layout (4-bit keys with one scale and zero per channel of each group of
      32 entries of a head, 4-bit values with one scale and zero per entry; arXiv 2402.02750)
      (:mod:`kvpress_critical.ops.ragged_attention.codes`). The attention kernels read the codes and dequantize block
      by block as they attend (no float copy of a layer); the tail stays in the model's dtype. transformers'
      ``QuantizedCache`` is refused: use this option instead.

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
    quantize : {None, "int8", "int4", "kivi4"}, default=None
        Store the kept context entries quantized: one scale per entry (int8, int4), or KIVI's layout (kivi4).
    """

    capabilities: ClassVar[Capabilities] = Capabilities(selection="wrapper", changes_layout=True)

    press: BasePress = None
    reserve: int = DEFAULT_RESERVE
    quantize: str | None = None
    # the state of a forward in progress (never compared, never shown): the rows' first real token, for a padded batch
    _row_starts: list | None = field(default=None, init=False, repr=False, compare=False)
    _decoding: DecodingCompressor | None = field(default=None, init=False, repr=False, compare=False)

    def __new__(cls, *args, **kwargs):
        # with a decoding press inside: CompactDecodingCachePress, a PrefillDecodingPress that kvpress's pipeline enters
        # for the answers too (its docstring says why)
        press = kwargs.get("press", args[0] if args else None)
        if cls is CompactCachePress and isinstance(press, BasePress) and split_phases(press)[1] is not None:
            cls = CompactDecodingCachePress
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
            raise ValueError(f"quantize must be None or one of {sorted(FORMATS)}, got {self.quantize!r}")

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
        refusal = compact_model_refusal(model)
        if refusal is not None:
            raise ValueError(refusal)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError(
            "CompactCachePress changes the layout of the whole cache after the prefill: use it as the outermost press "
            "(e.g. CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)))), not inside another wrapper"
        )

    @contextmanager
    def __call__(self, model):
        self.check_attention(model)
        modules = hooked_attention_modules(model)
        compacted = [m for m in modules if not is_sliding_layer(m)]
        if not compacted:
            logger.warning(
                "CompactCachePress: every layer of this model uses sliding-window attention; none is compacted"
            )
        prefill, schedule = self.prefill_press, self.decoding_schedule
        # a budgeted press is given the layer explicitly here (one selection, packed from its keep mask); any other
        # press compresses through its own hooks first (e.g. ChunkedPrefillPress's chunks), then its layers are packed
        explicit = prefill is not None and capabilities(prefill).budgeted
        # a press that compresses every layer only once the last one is scored (Layer-DefensiveKV) sets its masks
        # after the per-layer hooks ran: its layers are compacted when the whole forward pass has ended
        deferred = prefill is not None and any(
            capabilities(p).selects_after_last_layer for p in nested_presses(prefill)
        )
        pending: list = []

        def layer_hook(module, args, kwargs, output):
            if not is_prefilling(kwargs["cache_position"], kwargs["hidden_states"].shape[1]):
                if self._decoding is not None and not is_sliding_layer(module):
                    self._decoding.after_layer(module, kwargs, output)
                return output
            if is_sliding_layer(module):  # kept dense: compressed by the press as it is alone
                return prefill.forward_hook(module, args, kwargs, output) if explicit else output
            cache, idx = kwargs["past_key_values"], module.layer_idx
            if explicit:
                dense = cache.layers[idx]
                layer = LayerInput(module, kwargs["hidden_states"], dense.keys, dense.values, output[1], kwargs)
                compact_layer(cache, idx, module, self.reserve, keep=self._keep(layer), quantize=self.quantize)
            elif deferred:
                pending.append((cache, module))
            else:  # what the press's own hook selected: masked entries, or the entries a pruning press left
                compact_layer(cache, idx, module, self.reserve, quantize=self.quantize)
            return output

        def before_forward(base, args, kwargs):
            self._row_starts = None
            cache = kwargs.get("past_key_values")
            if isinstance(cache, QuantizedCache):
                raise TypeError(
                    "CompactCachePress keeps its own layout and cannot compact transformers' QuantizedCache (its "
                    "layers would stay full-length); for quantized entries use CompactCachePress(press, "
                    "quantize='int8', 'int4' or 'kivi4') with a DynamicCache"
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
            return output

        base_model = decoder(model)
        chunked = [p for p in nested_presses(self.press) if capabilities(p).chunked]
        with ExitStack() as stack:
            stack.enter_context(attention_wrapping())
            for press in chunked:  # its layers keep their positions (masked, not pruned) until packed here
                press.compact_outside = True
                stack.callback(setattr, press, "compact_outside", False)
            if explicit:
                prefill.post_init_from_model(model)
            elif prefill is not None:
                stack.enter_context(prefill(model))  # its own hooks compress, as it does alone
            if schedule is not None:
                schedule.base_press.post_init_from_model(model)
                self._decoding = DecodingCompressor(schedule, model)
            hooks = [m.register_forward_hook(layer_hook, with_kwargs=True) for m in modules]
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

    def _keep(self, layer: LayerInput) -> torch.Tensor:
        """
        ``(B, H_kv, T)`` bool: what the prefill press keeps of ``layer``, selected once; in a left-padded batch, every
        row on its own tokens with its own budget (padding never kept).
        """
        ratio = self.compression_ratio
        if self._row_starts is None:
            if ratio == 0:
                return torch.ones(layer.shape, dtype=torch.bool, device=layer.keys.device)
            return keep_mask(self.prefill_press, layer, compute_n_kept(layer.shape[2], ratio))
        keep = torch.zeros(layer.shape, dtype=torch.bool, device=layer.keys.device)
        for row, start in enumerate(self._row_starts):
            if ratio == 0:
                keep[row, :, start:] = True
            else:
                n_kept = compute_n_kept(layer.shape[2] - start, ratio)
                keep[row : row + 1, :, start:] = keep_mask(self.prefill_press, layer.rows(row, start), n_kept)
        return keep

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
        refusal = padded_batch_refusal(self.prefill_press)
        if refusal is not None:
            raise NotImplementedError(refusal)
        return starts.tolist()


class CompactDecodingCachePress(CompactCachePress, PrefillDecodingPress):
    """
    What ``CompactCachePress(press)`` builds when ``press`` compresses while decoding (a ``DecodingPress``, or a
    ``PrefillDecodingPress`` with one): the same press, also a kvpress ``PrefillDecodingPress``.

    kvpress's pipeline enters a press for the answer's generation only when it is a ``DecodingPress`` or a
    ``PrefillDecodingPress`` (``KVPressTextGenerationPipeline._forward``); without this class the decoding schedule
    would never run there. As for kvpress's own decoding presses, the pipeline then asks one question per context.
    ``CompactCachePress.__new__`` chooses it, so users write ``CompactCachePress(DecodingPress(...))``; it is the one
    place where the class differs from the one called (``tests/presses/test_layer_compression.py`` checks both).
    """
