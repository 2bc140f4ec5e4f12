"""DefensiveKV and Layer-DefensiveKV against a literal per-head transcription of the method, on every model family."""

import pytest
import torch
import torch.nn.functional as F
from helpers import FAMILIES, kept_masks, tiny_model
from transformers import DynamicCache

from kvpress_critical import CompactCachePress, DefensiveKVPress, LayerDefensiveKVPress
from kvpress_critical.cache import CompactLayer, keep_mask_from_indices
from kvpress_critical.modeling import attention_modules, module_projected_norm
from kvpress_critical.presses import defensivekv_press
from kvpress_critical.presses.layer_input import LayerInput
from kvpress_critical.presses.window_attention import window_attention
from kvpress_critical.selection import compute_n_kept


def literal_defensive(attn, norms, n_kept, kernel=5, mass=0.9):
    """Steps 1-5, one batch row and one head at a time. attn: (H, G, W, T), norms: (H, T). Returns (keep, forced)."""
    heads, group, window, k_len = attn.shape
    prefix_len = k_len - window
    scores, forced = {}, set()
    for h in range(heads):
        prefix = attn[h, ..., :prefix_len].double()  # (G, W, P)
        pooled = torch.zeros_like(prefix)
        for g in range(group):
            for w in range(window):
                row = prefix[g, w]
                p = F.avg_pool1d(row.view(1, 1, -1), kernel, padding=kernel // 2, stride=1).view(-1)
                pooled[g, w] = p * row.sum() / p.sum() if p.sum() > 0 else p
        m = [max(float(pooled[g, w, i]) for g in range(group) for w in range(window)) for i in range(prefix_len)]
        mean_m = sum(m) / len(m)
        for i in range(prefix_len):
            total = sum(float(norms[x, i]) for x in range(heads))  # 0 for Phi-3's padding token (a zero embedding)
            n_hat = float(norms[h, i]) / total if total > 0 else 0.0
            scores[h, i] = max(m[i], mean_m) * n_hat
        mean_attention = [float(prefix[:, :, i].mean()) for i in range(prefix_len)]
        target = mass - (1 - sum(mean_attention))
        order = sorted(range(prefix_len), key=lambda i: (-mean_attention[i], i))
        chosen, total = [], 0.0
        if target > 0:
            for i in order:
                if len(chosen) >= max(0, n_kept - window):
                    break
                chosen.append(i)
                total += mean_attention[i]
                if total >= target:
                    break
        forced |= {(h, i) for i in chosen} | {(h, i) for i in range(k_len - min(window, n_kept), k_len)}
    rest = sorted((k for k in scores if k not in forced), key=lambda k: (-scores[k], k[0] * k_len + k[1]))
    kept = forced | set(rest[: max(0, n_kept * heads - len(forced))])
    keep = torch.zeros(heads, k_len, dtype=torch.bool)
    for h, i in kept:
        keep[h, i] = True
    forced_mask = torch.zeros_like(keep)
    for h, i in forced:
        forced_mask[h, i] = True
    return keep, forced_mask


@pytest.fixture
def recorded_inputs(monkeypatch):
    """Per layer, the window attention and projected norms the press computed from (to feed the literal version)."""
    records = {}
    real = defensivekv_press.window_attention

    def spy(layer, window):
        attn = real(layer, window)
        records[layer.module.layer_idx] = attn.clone()
        return attn

    monkeypatch.setattr(defensivekv_press, "window_attention", spy)
    return records


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bsz", [1, 3])
def test_defensivekv_matches_the_literal_method(family, bsz, recorded_inputs):
    model = tiny_model(family)
    k_len, window = 80, 16
    ids = torch.randint(0, 256, (bsz, k_len), generator=torch.Generator().manual_seed(bsz))
    for ratio in (0.5, 0.8):
        press = DefensiveKVPress(ratio, window_size=window)
        masks = kept_masks(model, ids, press)
        n_kept = compute_n_kept(k_len, ratio)
        cache = DynamicCache()
        model.model(input_ids=ids, past_key_values=cache)
        for layer, (mask, module) in enumerate(zip(masks, attention_modules(model))):
            norms = module_projected_norm(module, cache.layers[layer].values, "l1", "auto").detach()
            for b in range(bsz):
                keep, forced = literal_defensive(recorded_inputs[layer][b], norms[b], n_kept)
                assert torch.equal(mask[b], keep), f"ratio {ratio} layer {layer} row {b}"
                assert bool(mask[b][forced].all()), "a stage-1 or window entry was evicted"
            assert bool(mask[..., -min(window, n_kept) :].all()), "the window is always kept"
            assert mask.sum((1, 2)).tolist() == [n_kept * model.config.num_key_value_heads] * bsz  # exact budget
        for m in attention_modules(model):
            m.masked_key_indices = None


def test_window_attention_is_the_same_with_eager_weights():
    """With eager attention the model's own weights are used: the same selection as recomputing them under sdpa."""
    ids = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    masks = {
        impl: kept_masks(tiny_model("llama", attn_implementation=impl), ids, DefensiveKVPress(0.6, window_size=8))
        for impl in ("sdpa",)
    }
    eager = tiny_model("llama", attn_implementation="eager")
    cache = DynamicCache()
    out = eager.model(input_ids=ids, past_key_values=cache, output_attentions=True)
    module = attention_modules(eager)[0]
    keys = cache.layers[0].keys
    from_weights = window_attention(LayerInput(module, None, keys, keys, out.attentions[0]), 8)
    sdpa = tiny_model("llama")
    with torch.no_grad():
        hidden = sdpa.model.embed_tokens(ids)
        hidden_in = sdpa.model.layers[0].input_layernorm(hidden)
        position = sdpa.model.rotary_emb(hidden, torch.arange(70).unsqueeze(0))
    layer = LayerInput(attention_modules(sdpa)[0], hidden_in, keys, keys, None, {"position_embeddings": position})
    recomputed = window_attention(layer, 8)
    torch.testing.assert_close(from_weights, recomputed, rtol=1e-5, atol=1e-6)
    assert masks["sdpa"][0].shape == (2, 2, 70)
    with pytest.raises(ValueError, match="eager"):
        kept_masks(eager, ids, DefensiveKVPress(0.5))  # head-wise masking needs kvpress's attention patch


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bsz", [1, 3])
def test_layer_defensivekv_shares_one_budget(family, bsz):
    model = tiny_model(family, num_layers=3)
    # random tiny models attend diffusely: with the 90% target, stage 1 alone would fill every layer's budget (then
    # every layer keeps exactly its own); a 30% target leaves room for the shared budget to move between layers
    k_len, window, ratio, mass = 80, 16, 0.5, 0.3
    ids = torch.randint(0, 256, (bsz, k_len), generator=torch.Generator().manual_seed(7))
    layer_masks = kept_masks(model, ids, LayerDefensiveKVPress(ratio, window_size=window, mass=mass))
    per_layer = kept_masks(model, ids, DefensiveKVPress(ratio, window_size=window, mass=mass))
    n_kept = compute_n_kept(k_len, ratio)
    heads = model.config.num_key_value_heads
    totals = torch.stack([m.sum((1, 2)) for m in layer_masks], dim=1)  # (B, layers)
    assert totals.sum(1).tolist() == [n_kept * heads * len(layer_masks)] * bsz  # the overall budget, exactly
    assert len(set(totals[0].tolist())) > 1, "layers keep different totals"
    for mask, single in zip(layer_masks, per_layer):
        assert bool(mask[..., -window:].all())  # the window of every layer is kept
        assert single.sum((1, 2)).tolist() == [n_kept * heads] * bsz  # DefensiveKV: each layer its own budget
    # the selection is recorded once for all layers, and it is what the masks say
    press = LayerDefensiveKVPress(ratio, window_size=window, mass=mass)
    press.post_init_from_model(model)
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    for layer, keep in press.last_selection.items():
        assert torch.equal(keep, layer_masks[layer])


def test_compact_layout_compacts_after_the_last_layer():
    model = tiny_model("qwen3", num_layers=3)
    ids = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(3))
    expected = kept_masks(model, ids, LayerDefensiveKVPress(0.6, window_size=16))
    cache = DynamicCache()
    with CompactCachePress(LayerDefensiveKVPress(0.6, window_size=16))(model):
        model.model(input_ids=ids, past_key_values=cache)
    for keep, layer in zip(expected, cache.layers):
        assert isinstance(layer, CompactLayer) and torch.equal(layer.segment_lengths(), keep.sum(-1))
    out = model(input_ids=ids[:, :2], past_key_values=cache, position_ids=torch.arange(80, 82).expand(2, 2))
    assert torch.isfinite(out.logits).all()


def test_errors_and_short_contexts():
    with pytest.raises(ValueError, match="compression_ratio"):
        DefensiveKVPress(1.2)
    with pytest.raises(ValueError, match="odd"):
        DefensiveKVPress(0.5, kernel_size=4)
    with pytest.raises(RuntimeError, match="post_init_from_model"):
        LayerDefensiveKVPress(0.5).compress(
            attention_modules(tiny_model("llama"))[0], None, torch.zeros(1, 2, 8, 16), None, None, {}
        )
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 20))  # shorter than the default 32-entry window
    masks = kept_masks(model, ids, DefensiveKVPress(0.5))
    assert all(int(m.sum()) == 2 * compute_n_kept(20, 0.5) for m in masks)
    keep = keep_mask_from_indices(None, (1, 2, 3), "cpu")
    assert bool(keep.all())
