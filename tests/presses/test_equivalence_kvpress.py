"""Our presses select exactly the entries kvpress's built-in CriticalKV presses select, where those work.

Where several entries have exactly the same base score and only some of them fit in stage 1, kvpress keeps
whichever torch.topk returns first (device- and size-dependent); ours keeps those with the larger projected
norm (tests/selection/test_selection.py). The comparisons therefore avoid such ties: distinct token ids (repeated
tokens tie Knorm in layer 0) and a SnapKV window no larger than the safeguard budget, so the window (whose
entries all share one score) always fits in stage 1.
"""

import kvpress
import pytest
import torch
from helpers import kept_masks, prefill_keys, tiny_model
from kvpress import ExpectedAttentionPress, KnormPress, SnapKVPress

from kvpress_critical import CriticalAdaKVPress, CriticalKVPress

BASES = {
    "snapkv": lambda r: SnapKVPress(r, window_size=4),
    "knorm": lambda r: KnormPress(r),
    "expected_attention": lambda r: ExpectedAttentionPress(r, use_vnorm=False),
}
PAIRS = {  # ours, kvpress's
    "critical": (CriticalKVPress, kvpress.CriticalKVPress),
    "critical_adakv": (CriticalAdaKVPress, kvpress.CriticalAdaKVPress),
}


def unique_ids(bsz, k_len, vocab=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(vocab, generator=gen)[:k_len] for _ in range(bsz)])


def assert_same_selection(model, ids, ours, theirs, original=None):
    original = prefill_keys(model, ids) if original is None else original
    mine = kept_masks(model, ids, ours, original)
    reference = kept_masks(model, ids, theirs, original)
    for layer, (a, b) in enumerate(zip(mine, reference)):
        diff = int((a != b).sum())
        assert diff == 0, f"layer {layer}: {diff} entries differ from kvpress ({type(ours).__name__})"
    return mine


# kvpress 0.5.5's ExpectedAttentionPress itself fails on Gemma3 (its rotary embedding needs a layer type)
FAMILY_BASES = [(f, b) for f in ("llama", "mistral", "qwen3", "gemma3") for b in sorted(BASES)]
FAMILY_BASES.remove(("gemma3", "expected_attention"))


@pytest.mark.parametrize("family, base", FAMILY_BASES)
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_tiny_models_match_kvpress(family, base, pair):
    model = tiny_model(family)
    ids = unique_ids(1, 256, seed=1)
    original = prefill_keys(model, ids)
    ours_cls, theirs_cls = PAIRS[pair]
    for ratio in (0.1, 0.3, 0.5, 0.7, 0.9):
        assert_same_selection(model, ids, ours_cls(BASES[base](ratio)), theirs_cls(BASES[base](ratio)), original)


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_configs_without_head_dim(family):
    """Ours works on configs without head_dim (kvpress's built-in reads it) and equals kvpress's built-in once the
    config is given one."""
    model = tiny_model(family)
    ids = unique_ids(1, 160, seed=2)
    assert not hasattr(model.config, "head_dim")
    ours = kept_masks(model, ids, CriticalKVPress(SnapKVPress(0.5)))  # before patching: must work as is
    model.config.head_dim = model.model.layers[0].self_attn.head_dim
    try:
        reference = kept_masks(model, ids, kvpress.CriticalKVPress(SnapKVPress(0.5)))
        for pair in PAIRS.values():
            assert_same_selection(model, ids, pair[0](KnormPress(0.6)), pair[1](KnormPress(0.6)))
    finally:
        del model.config.head_dim
    assert all(torch.equal(a, b) for a, b in zip(ours, reference))


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_batch_rows_match_kvpress_per_row(pair):
    """Batch > 1: each row selects what kvpress selects for that row alone (kvpress's built-in CriticalAdaKV budgets
    across the batch, so it is compared row by row)."""
    model = tiny_model("llama")
    ids = unique_ids(3, 200, seed=3)
    ours_cls, theirs_cls = PAIRS[pair]
    batched = kept_masks(model, ids, ours_cls(SnapKVPress(0.6)))
    for row in range(3):
        reference = kept_masks(model, ids[row : row + 1], theirs_cls(SnapKVPress(0.6)))
        for layer, (a, b) in enumerate(zip(batched, reference)):
            assert torch.equal(a[row : row + 1], b), f"row {row}, layer {layer}"


@pytest.fixture(scope="module")
def smollm2_prefill(smollm2):
    """800 tokens of SmolLM2 and their full-cache keys (shared by the cases below)."""
    ids = unique_ids(1, 800, vocab=49152, seed=4)
    return ids, prefill_keys(smollm2[0], ids)


@pytest.mark.slow
@pytest.mark.parametrize("base, ratio", [("snapkv", 0.1), ("snapkv", 0.9), ("knorm", 0.5), ("expected_attention", 0.7)])
def test_smollm2_matches_kvpress(smollm2, smollm2_prefill, base, ratio):
    """SmolLM2 with 800 tokens; SnapKV's window is 16 so that it fits in the safeguard budget (>= 16)."""
    model, _ = smollm2
    ids, original = smollm2_prefill
    make = (lambda r: SnapKVPress(r, window_size=16)) if base == "snapkv" else BASES[base]
    for ours_cls, theirs_cls in PAIRS.values():
        mine = assert_same_selection(model, ids, ours_cls(make(ratio)), theirs_cls(make(ratio)), original)
        assert int(mine[0].sum()) == int(800 * (1 - ratio)) * model.config.num_key_value_heads
