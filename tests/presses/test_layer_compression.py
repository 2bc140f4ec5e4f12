"""The one explicit path that compresses a layer (a LayerInput, a budget, a keep mask) and what goes through it:
decoding schedules on kvpress's contract, padded batches selected once, combinations refused when built."""

import pytest
import torch
from helpers import head_scores, tiny_model
from kvpress import (
    CAMPress,
    CompressionRatioDecodingPress,
    DecodingPress,
    KnormPress,
    PrefillDecodingPress,
    SnapKVPress,
)
from transformers import DynamicCache

from kvpress_critical import (
    ChunkedPrefillPress,
    CompactCachePress,
    CompactDecodingCachePress,
    CriticalAdaKVPress,
    CriticalHeadKVPress,
    CriticalKVPress,
    DefensiveKVPress,
    HeadKVPress,
    LayerDefensiveKVPress,
)
from kvpress_critical.capabilities import capabilities
from kvpress_critical.modeling import attention_modules
from kvpress_critical.presses.budgeted import keep_mask
from kvpress_critical.presses.layer_input import LayerInput


def layer_input(model, bsz=2, k_len=40, excluded=None, known_norms=None):
    """The first layer of ``model`` after a prefill, as a compression sees it."""
    ids = torch.randint(0, 256, (bsz, k_len), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    captured = {}

    def hook(module, args, kwargs, output):
        captured.update(kwargs=kwargs, attentions=output[1])

    module = attention_modules(model)[0]
    handle = module.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=cache)
    handle.remove()
    layer = cache.layers[0]
    kwargs = captured["kwargs"]
    return LayerInput(
        module, kwargs["hidden_states"], layer.keys, layer.values, captured["attentions"], kwargs, excluded,
        known_norms or {},
    )  # fmt: skip


# ---- the layer's input: what does not fit is an error, never dropped ---------------------------------------------


def test_a_layer_input_refuses_what_does_not_fit_the_layer():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="excluded must be"):
        layer_input(model, excluded=torch.zeros(2, 2, 39, dtype=torch.bool))
    with pytest.raises(ValueError, match="excluded must be"):
        layer_input(model, excluded=torch.zeros(2, 2, 40))  # not a bool mask
    with pytest.raises(ValueError, match="known l1 norms"):
        layer_input(model, known_norms={"l1": torch.zeros(2, 2, 41)})
    layer = layer_input(model)
    with pytest.raises(ValueError, match="scores of shape"):
        layer.mask_excluded(torch.zeros(2, 2, 39))


@pytest.mark.parametrize(
    "press",
    [
        CriticalKVPress(SnapKVPress(window_size=8)),
        CriticalAdaKVPress(SnapKVPress(window_size=8)),
        DefensiveKVPress(window_size=8),
        SnapKVPress(window_size=8),
        KnormPress(),
    ],
    ids=lambda p: type(p).__name__,
)
def test_excluded_entries_are_never_kept_and_known_norms_are_reused(press):
    model = tiny_model("llama")
    excluded = torch.zeros(2, 2, 40, dtype=torch.bool)
    excluded[:, 0, 5:15] = True  # head 0 holds 10 entries that must not come back
    full = layer_input(model)
    known = {}
    if capabilities(press).applies_criticalkv:
        full.projected_norm(getattr(press, "norm", "l1"), "torch")
        known = {name: norms[:, :, :30] for name, norms in full.computed_norms.items()}
    layer = layer_input(model, excluded=excluded, known_norms=known)
    keep = keep_mask(press, layer, 12)
    assert not bool(keep[excluded].any())
    assert keep.sum().item() == 2 * 2 * 12
    assert layer.reused_entries == (2 * 2 * 30 if known else 0)


# ---- capabilities tell the truth -----------------------------------------------------------------------------------


def test_budgeted_presses_and_only_they_take_an_explicit_budget():
    model = tiny_model("llama")
    uniform = head_scores(model)
    presses = [
        CriticalKVPress(SnapKVPress(window_size=8)),
        CriticalAdaKVPress(SnapKVPress(window_size=8)),
        HeadKVPress(SnapKVPress(window_size=8), head_scores=uniform),
        CriticalHeadKVPress(SnapKVPress(window_size=8), head_scores=uniform),
        DefensiveKVPress(window_size=8),
        LayerDefensiveKVPress(window_size=8),
    ]
    for press in presses:
        press.post_init_from_model(model)
        if capabilities(press).budgeted:
            assert keep_mask(press, layer_input(model), 10).sum().item() == 2 * 2 * 10, type(press).__name__
        else:  # not one of its layers alone: it refuses, never selects per layer
            with pytest.raises(TypeError, match="explicit budget"):
                keep_mask(press, layer_input(model), 10)
            with pytest.raises(NotImplementedError, match="every layer at once"):
                press.keep_mask(layer_input(model), 10)
    assert not capabilities(LayerDefensiveKVPress()).budgeted  # its budget is shared by all layers


# ---- decoding schedules follow kvpress's DecodingPress contract ---------------------------------------------------


def kept_rows(cache, b: int, h: int) -> set:
    """The keys a layer holds for (row, KV head), as rounded tuples (the same entries have the same keys)."""
    layer = cache.layers[0]
    keys = layer.segments(b, h)[0] if hasattr(layer, "segments") else layer.keys[b, h]
    return {tuple(round(x, 4) for x in row) for row in keys.tolist()}


@pytest.mark.parametrize(
    "make",
    [
        lambda: DecodingPress(base_press=KnormPress(), compression_interval=5, target_size=24),
        lambda: CompressionRatioDecodingPress(
            base_press=KnormPress(), compression_interval=5, target_compression_ratio=0.6
        ),
    ],  # fmt: skip
    ids=["DecodingPress", "CompressionRatioDecodingPress"],
)
def test_compact_decoding_keeps_what_kvpress_pruning_keeps(make):
    """Every DecodingPress kvpress ships whose compression is a keep mask: the same entries, step after step."""
    model = tiny_model("llama")
    context = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    steps = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(3))
    caches = {}
    for layout, press in (("kvpress", make()), ("compact", CompactCachePress(make()))):
        cache = DynamicCache()
        with press(model), torch.no_grad():
            model.model(input_ids=context, past_key_values=cache)
            for t in range(steps.shape[1]):
                position = torch.tensor([[30 + t]])
                model.model(input_ids=steps[:, t : t + 1], past_key_values=cache, position_ids=position)
        caches[layout] = cache
    for h in range(2):
        assert kept_rows(caches["compact"], 0, h) == kept_rows(caches["kvpress"], 0, h)
    assert caches["kvpress"].layers[0].keys.shape[2] < 40  # compressed (50 tokens seen)


def test_a_compression_ratio_schedule_keeps_its_ratio_of_the_tokens_seen():
    """The reported bug: CompressionRatioDecodingPress fixes target_size at 1, its target comes from
    _resolve_target_size; the compact layout used target_size and kept one entry per head."""
    model = tiny_model("llama")
    press = CompactCachePress(
        CompressionRatioDecodingPress(
            base_press=CriticalAdaKVPress(KnormPress()), compression_interval=16, target_compression_ratio=0.5
        )
    )
    assert isinstance(press, CompactDecodingCachePress)  # kvpress's pipeline enters it for the answer
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache()
    with press(model):
        model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=33, min_new_tokens=33, do_sample=False)
    for layer in cache.layers:
        # last compression after 32 decoding steps: 95 tokens seen (positions 0..95), half of them per head on average
        assert layer.segment_lengths().float().mean().item() == int(96 * 0.5)
        assert layer.compressed_while_decoding


def test_decoding_presses_that_are_not_a_keep_mask_are_refused_when_built():
    with pytest.raises(TypeError, match="CAMPress: it changes how a DecodingPress compresses"):
        CompactCachePress(CAMPress(base_press=KnormPress(), compression_interval=4, target_size=16))


def test_a_chunked_prefill_and_a_decoding_schedule_are_refused_together():
    chunked = ChunkedPrefillPress(CriticalAdaKVPress(SnapKVPress(0.5, window_size=8)), chunk_size=64)
    decoding = DecodingPress(base_press=CriticalAdaKVPress(KnormPress()), compression_interval=4, target_size=32)
    with pytest.raises(TypeError, match="compress a chunked prefill, or compress while decoding, not both"):
        CompactCachePress(PrefillDecodingPress(prefilling_press=chunked, decoding_press=decoding))


# ---- a padded batch is selected once, row by row ------------------------------------------------------------------


def test_a_padded_batch_is_selected_once_row_by_row(monkeypatch):
    model = tiny_model("llama")
    inner = CriticalAdaKVPress(SnapKVPress(0.5, window_size=8))
    calls = {"keep_mask": 0, "compress": 0}
    real_keep, real_compress = CriticalAdaKVPress.keep_mask, CriticalAdaKVPress.compress

    def counted_keep(self, layer, n_kept):
        calls["keep_mask"] += 1
        assert layer.shape[0] == 1  # one row
        return real_keep(self, layer, n_kept)

    def counted_compress(self, *args):
        calls["compress"] += 1
        return real_compress(self, *args)

    monkeypatch.setattr(CriticalAdaKVPress, "keep_mask", counted_keep)
    monkeypatch.setattr(CriticalAdaKVPress, "compress", counted_compress)
    ids = torch.randint(1, 256, (3, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, :10] = 0
    mask[2, :25] = 0
    with CompactCachePress(inner)(model), torch.no_grad():
        model.model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache())
    layers = len(attention_modules(model))
    assert calls == {"keep_mask": 3 * layers, "compress": 0}
