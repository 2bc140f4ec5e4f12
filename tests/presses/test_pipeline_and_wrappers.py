"""End to end on the embedded SmolLM2 through kvpress's pipeline, alone and inside every kvpress wrapper."""

import pytest
import torch
from helpers import kept_masks
from kvpress import (
    AdaKVPress,
    ChunkPress,
    ComposedPress,
    DecodingPress,
    KeyRerotationPress,
    KnormPress,
    PerLayerCompressionPress,
    PrefillDecodingPress,
    SnapKVPress,
)
from transformers import DynamicCache

from kvpress_critical import CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.data.text import haystack_context

pytestmark = pytest.mark.slow

NEEDLE = "The secret passphrase for the archive is violet-harbor-42."
QUESTION = "What is the secret passphrase for the archive?"


@pytest.fixture(scope="module")
def context(smollm2):
    return haystack_context(smollm2[1], 300, NEEDLE)


def run(pipe, context, press, max_new_tokens=4):
    cache = DynamicCache()
    answer = pipe(context, question=QUESTION, press=press, max_new_tokens=max_new_tokens, cache=cache)["answer"]
    assert isinstance(answer, str) and answer.strip()
    return answer, [cache.get_seq_length(i) for i in range(len(cache))]


def n_context_tokens(pipe, context):
    return pipe.preprocess(context, [QUESTION], "", max_context_length=10**6)["context_ids"].shape[1]


@pytest.mark.parametrize("press_cls", [CriticalKVPress, CriticalAdaKVPress])
def test_pipeline_end_to_end(smollm2_pipeline, context, press_cls):
    pipe = smollm2_pipeline
    n_ctx = n_context_tokens(pipe, context)
    press = press_cls(SnapKVPress(0.5))
    _, lengths = run(pipe, context, press)
    attn = [layer.self_attn for layer in pipe.model.model.layers]
    if press_cls is CriticalKVPress:
        assert lengths == [int(n_ctx * 0.5)] * len(attn)
    else:  # masking: the cache keeps its size, the masked entries are recorded per layer
        assert lengths == [n_ctx] * len(attn)
        masked = {int(a.masked_key_indices[0].numel()) for a in attn}
        assert masked == {3 * (n_ctx - int(n_ctx * 0.5))}


def test_ratio_zero_changes_nothing(smollm2_pipeline, context):
    full, _ = run(smollm2_pipeline, context, None, max_new_tokens=8)
    for press in (CriticalKVPress(SnapKVPress(0.0)), CriticalAdaKVPress(SnapKVPress(0.0))):
        answer, _ = run(smollm2_pipeline, context, press, max_new_tokens=8)
        assert answer == full


def test_scorer_wrappers(smollm2_pipeline, context):
    pipe = smollm2_pipeline
    n_ctx = n_context_tokens(pipe, context)
    n_layers = pipe.model.config.num_hidden_layers
    cases = {
        "AdaKVPress": (AdaKVPress(CriticalKVPress(SnapKVPress(0.5))), n_ctx),  # masks, keeps the size
        "ChunkPress": (ChunkPress(CriticalKVPress(SnapKVPress(0.5)), chunk_length=128), None),
        "KeyRerotationPress": (KeyRerotationPress(CriticalKVPress(SnapKVPress(0.5))), int(n_ctx * 0.5)),
        "ComposedPress": (
            ComposedPress([CriticalKVPress(SnapKVPress(0.5)), KnormPress(0.5)]),
            int(int(n_ctx * 0.5) * 0.5),
        ),
    }
    for name, (press, expected) in cases.items():
        _, lengths = run(pipe, context, press)
        if expected is None:  # ChunkPress: half of each chunk, rounded down per chunk
            expected = sum(max(1, int(len(range(i, min(i + 128, n_ctx))) * 0.5)) for i in range(0, n_ctx, 128))
        assert lengths == [expected] * n_layers, name


@pytest.mark.parametrize("press_cls", [CriticalKVPress, CriticalAdaKVPress])
def test_decoding_wrappers(smollm2_pipeline, context, press_cls):
    pipe = smollm2_pipeline
    n_ctx = n_context_tokens(pipe, context)
    decoding = DecodingPress(press_cls(KnormPress()), compression_interval=4, target_size=n_ctx - 20)
    run(pipe, context, decoding, max_new_tokens=10)
    assert isinstance(decoding.base_press, AdaKVPress) == (press_cls is CriticalAdaKVPress)

    # same kind in both phases: kvpress cannot remap prefill masks after a pruning decoding press
    both = PrefillDecodingPress(
        prefilling_press=press_cls(SnapKVPress(0.5)),
        decoding_press=DecodingPress(press_cls(KnormPress()), compression_interval=4, target_size=100),
    )
    run(pipe, context, both, max_new_tokens=10)


def test_per_layer_compression(smollm2):
    """PerLayerCompressionPress accepts CriticalKVPress (kvpress's built-in fails its signature check)."""
    model, tokenizer = smollm2
    ratios = [0.25 if i % 2 else 0.75 for i in range(model.config.num_hidden_layers)]
    press = PerLayerCompressionPress(CriticalKVPress(SnapKVPress()), compression_ratios=ratios)
    ids = tokenizer(haystack_context(tokenizer, 200, NEEDLE), return_tensors="pt").input_ids
    masks = kept_masks(model, ids, press)
    assert [int(m[0, 0].sum()) for m in masks] == [int(ids.shape[1] * (1 - r)) for r in ratios]
    assert press.press.compression_ratio == 0.0  # restored after each layer


def test_post_init_from_model_is_forwarded(smollm2):
    model, _ = smollm2
    calls = []

    class Recording(KnormPress):
        def post_init_from_model(self, model):
            calls.append(model)

    for press in (CriticalKVPress(Recording(0.5)), CriticalAdaKVPress(Recording(0.5))):
        press.post_init_from_model(model)
    assert calls == [model, model]


def test_bfloat16_model(smollm2):
    """Scores are float32 even when the model runs in bfloat16."""
    from kvpress_critical.default_model import load_default_model

    model, tokenizer = load_default_model(dtype=torch.bfloat16)
    ids = tokenizer(haystack_context(tokenizer, 200, NEEDLE), return_tensors="pt").input_ids
    for press in (CriticalKVPress(SnapKVPress(0.5)), CriticalAdaKVPress(SnapKVPress(0.5))):
        masks = kept_masks(model, ids, press)
        assert all(int(m.sum()) == 3 * int(ids.shape[1] * 0.5) for m in masks)
