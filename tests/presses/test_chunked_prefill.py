"""ChunkedPrefillPress: one chunk is the one-shot compression, and with several chunks every layer holds its budget
for the tokens seen after every chunk, at the entries' original positions, in every layout and model family."""

import pytest
import torch
from helpers import FAMILIES, head_scores, kept_masks, tiny_config, tiny_model
from kvpress import AdaKVPress, DecodingPress, KnormPress, SnapKVPress
from transformers import DynamicCache

from kvpress_critical import (
    CompactCachePress,
    CriticalAdaKVPress,
    CriticalHeadKVPress,
    CriticalKVPress,
    DefensiveKVPress,
    HeadKVPress,
    LayerDefensiveKVPress,
)
from kvpress_critical.cache import CompactLayer, keep_mask_from_indices
from kvpress_critical.modeling import attention_modules
from kvpress_critical.presses.chunked_prefill_press import ChunkedPrefillPress
from kvpress_critical.selection import compute_n_kept

K_LEN, WINDOW = 100, 8


def make_presses(model, ratio):
    snap = lambda: SnapKVPress(ratio, window_size=WINDOW)  # noqa: E731
    return {
        "SnapKV": snap(),
        "Knorm": KnormPress(ratio),
        "CriticalKV": CriticalKVPress(snap()),
        "AdaKV": AdaKVPress(snap()),
        "CriticalAdaKV": CriticalAdaKVPress(snap()),
        "HeadKV": HeadKVPress(snap(), head_scores=head_scores(model, slope=0.1)),
        "CriticalHeadKV": CriticalHeadKVPress(snap(), head_scores=head_scores(model, slope=0.1)),
        "DefensiveKV": DefensiveKVPress(ratio, window_size=WINDOW),
    }


@pytest.mark.parametrize("name", list(make_presses(tiny_model("llama"), 0.5)))
def test_one_chunk_is_the_one_shot_compression(name):
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, K_LEN), generator=torch.Generator().manual_seed(0))
    for ratio in (0.3, 0.7):
        one_shot = kept_masks(model, ids, make_presses(model, ratio)[name])
        chunked = kept_masks(model, ids, ChunkedPrefillPress(make_presses(model, ratio)[name], chunk_size=K_LEN))
        for layer, (a, b) in enumerate(zip(chunked, one_shot)):
            assert torch.equal(a, b), f"{name} ratio {ratio} layer {layer}"


@pytest.fixture
def after_each_chunk(monkeypatch):
    """Record, after every chunk's compression of every layer, what the layer holds: per head counts and positions."""
    records = []
    real = ChunkedPrefillPress._after_layer

    def spy(self, module, args, kwargs, output):
        out = real(self, module, args, kwargs, output)
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        if self.chunk is None:
            return out  # not a chunked prefill
        seen = self.chunk[1]
        if seen == kwargs["hidden_states"].shape[1]:
            return out  # the first chunk: compacted by an outer CompactCachePress after this hook
        if isinstance(layer, CompactLayer):
            per_head = layer.segment_lengths()
            positions = [
                [layer.segments(b, h)[2].long() for h in range(per_head.shape[1])] for b in range(per_head.shape[0])
            ]
        else:
            keep = keep_mask_from_indices(module.masked_key_indices, layer.keys.shape[:3], layer.keys.device)
            per_head, positions = keep.sum(-1), None
        records.append(dict(layer=module.layer_idx, seen=seen, per_head=per_head, positions=positions))
        return out

    monkeypatch.setattr(ChunkedPrefillPress, "_after_layer", spy)
    return records


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bsz", [1, 3])
def test_several_chunks_keep_the_budget_of_the_tokens_seen(family, bsz, after_each_chunk):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (bsz, K_LEN), generator=torch.Generator().manual_seed(bsz))
    heads = model.config.num_kv_heads if hasattr(model.config, "num_kv_heads") else model.config.num_key_value_heads
    ratio, chunk = 0.6, 30  # chunks of 30, 30, 30, 10
    for name in ("CriticalKV", "CriticalAdaKV", "HeadKV", "DefensiveKV"):
        for compact in (False, True):
            if compact and name == "DefensiveKV":
                continue  # its per-entry normalisation across heads needs the aligned layout (a clear error, below)
            after_each_chunk.clear()
            press = ChunkedPrefillPress(make_presses(model, ratio)[name], chunk_size=chunk)
            press = CompactCachePress(press) if compact else press
            cache = DynamicCache()
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
            assert sorted({r["seen"] for r in after_each_chunk}) == [60, 90, 100], name
            for r in after_each_chunk:
                where = f"{name} {'compact' if compact else 'dense'} layer {r['layer']} after {r['seen']} tokens"
                n_target = compute_n_kept(r["seen"], ratio)
                totals = r["per_head"].sum(-1)
                if name == "CriticalKV" and not compact:
                    pass  # pruning: checked on the cache below
                else:
                    assert totals.tolist() == [n_target * heads] * bsz, where
                if r["positions"] is not None:  # compact: every entry at its original position, the newest kept
                    for row in r["positions"]:
                        for pos in row:
                            assert bool((pos[1:] > pos[:-1]).all()) and int(pos.max()) < r["seen"], where
                            assert set(range(r["seen"] - WINDOW, r["seen"])) <= set(pos.tolist()), where
            n_final = compute_n_kept(K_LEN, ratio)
            for layer in cache.layers:
                if isinstance(layer, CompactLayer):
                    assert layer.packed_keys.shape[0] == n_final * heads * bsz
                elif name == "CriticalKV":
                    assert layer.keys.shape[2] == n_final
            out = model(
                input_ids=ids[:, :4], past_key_values=cache, position_ids=torch.arange(K_LEN, K_LEN + 4).expand(bsz, 4)
            )
            assert torch.isfinite(out.logits).all(), name
            for m in attention_modules(model):
                m.masked_key_indices = None


@pytest.mark.slow
def test_answers_stay_sensible_on_smollm2(smollm2_pipeline):
    from kvpress_critical.data.text import haystack_context

    pipe = smollm2_pipeline
    context = haystack_context(pipe.tokenizer, 900, "The secret passphrase for the archive is violet-harbor-42.")
    question = "What is the secret passphrase for the archive?"
    answers = {}
    for name, press in {
        # at 25% eviction the needle survives every chunk (at 50% it does not: each chunk is scored by its own last
        # tokens, before the question exists, and SmolLM2 then answers from the filler)
        "CriticalKV": ChunkedPrefillPress(CriticalKVPress(SnapKVPress(0.25)), chunk_size=256),
        "CriticalAdaKV compact": CompactCachePress(ChunkedPrefillPress(CriticalAdaKVPress(SnapKVPress(0.25)), 256)),
        "CriticalAdaKV masking": ChunkedPrefillPress(CriticalAdaKVPress(SnapKVPress(0.25)), chunk_size=256),
    }.items():
        cache = DynamicCache()
        answers[name] = pipe(context, question=question, press=press, max_new_tokens=12, cache=cache)["answer"]
        assert "violet" in answers[name], (name, answers[name])  # the needle survives chunked compression
        if name.endswith("compact"):
            assert all(isinstance(x, CompactLayer) for x in cache.layers)
            assert all(x.packed_keys.shape[0] == 3 * compute_n_kept(x.context_length, 0.25) for x in cache.layers)
    # the two head-wise layouts need not select the same entries after the first chunk: SnapKV pools its scores
    # over neighbouring entries, which are the packed ones in the compact layout and the dense ones when masking


def test_errors():
    with pytest.raises(ValueError, match="must exceed"):
        ChunkedPrefillPress(SnapKVPress(0.5), chunk_size=64)  # SnapKV's default window is 64
    with pytest.raises(TypeError, match="outside"):
        ChunkedPrefillPress(CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5))), chunk_size=512)
    with pytest.raises(TypeError, match="decoding press"):
        ChunkedPrefillPress(DecodingPress(KnormPress()), chunk_size=512)
    with pytest.raises(TypeError, match="every layer at once"):  # refused when built, not when a long prefill comes
        ChunkedPrefillPress(LayerDefensiveKVPress(0.5, window_size=WINDOW), chunk_size=40)
    with pytest.raises(TypeError, match="aligned dense layout"):
        CompactCachePress(ChunkedPrefillPress(DefensiveKVPress(0.5, window_size=WINDOW), chunk_size=40))
    with pytest.raises(ValueError, match="DefensiveKVPress's window"):
        ChunkedPrefillPress(DefensiveKVPress(0.5, window_size=64), chunk_size=64)
    import kvpress
    from kvpress import (
        ComposedPress,
        DMSPress,
        ExpectedAttentionPress,
        FinchPress,
        KeyRerotationPress,
        PerLayerCompressionPress,
        PyramidKVPress,
        ThinKPress,
    )

    for inner, match in [
        (ExpectedAttentionPress(0.5), "expected future queries"),
        (CriticalKVPress(ExpectedAttentionPress(0.5, use_vnorm=False)), "expected future queries"),
        (PyramidKVPress(0.5, window_size=8), "per-layer budgets"),
        (PerLayerCompressionPress(KnormPress(0.5), [0.5, 0.5]), "each layer's compression ratio"),
        (KeyRerotationPress(KnormPress(0.5)), "re-rotates"),
        (FinchPress(0.5), "delimiter"),
        (ComposedPress([KnormPress(0.2), KnormPress(0.3)]), "each of its presses"),
        (DMSPress(KnormPress(0.5)), "threshold"),
        (ThinKPress(0.5), "channels"),
        (kvpress.CriticalAdaKVPress(SnapKVPress(0.5, window_size=8)), "built-in CriticalKV"),
    ]:
        with pytest.raises(TypeError, match=match):
            ChunkedPrefillPress(inner, chunk_size=512)
    press = ChunkedPrefillPress(CriticalKVPress(SnapKVPress(0.5)), chunk_size=512)
    press.compression_ratio = 0.25
    assert press.press.compression_ratio == 0.25 and "chunk_size=512" in repr(press)
    assert press.press.press.compression_ratio == 0.25  # the scorer holds the ratio


def test_a_short_last_chunk_joins_the_one_before():
    press = ChunkedPrefillPress(SnapKVPress(0.5, window_size=8), chunk_size=30)
    assert press.chunk_bounds(100) == [(0, 30), (30, 60), (60, 90), (90, 100)]
    assert press.chunk_bounds(98) == [(0, 30), (30, 60), (60, 98)]  # 8 tokens could not fill the window
    assert press.chunk_bounds(20) == [(0, 20)]
    assert ChunkedPrefillPress(KnormPress(0.5), chunk_size=30).chunk_bounds(61) == [(0, 30), (30, 60), (60, 61)]


def test_no_cache_given_and_embeddings_as_input():
    """Without past_key_values a cache is created before the chunks; inputs_embeds (how Gemma3's multimodal model
    calls its language model) are chunked like input_ids, with the same selections."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, K_LEN), generator=torch.Generator().manual_seed(0))
    press = ChunkedPrefillPress(CriticalKVPress(SnapKVPress(0.5, window_size=WINDOW)), chunk_size=40)
    with press(model):
        out = model.model(input_ids=ids, use_cache=True)
        from_embeddings = model.model(inputs_embeds=model.model.embed_tokens(ids), past_key_values=DynamicCache())
    assert out.last_hidden_state.shape[1] == K_LEN - 80  # the last chunk
    assert out.past_key_values.get_seq_length() == compute_n_kept(K_LEN, 0.5)
    for a, b in zip(out.past_key_values.layers, from_embeddings.past_key_values.layers):
        assert torch.equal(a.keys, b.keys)


def test_chunks_attend_exactly_over_the_masking_layout(monkeypatch):
    """Multi-token chunks over masked entries: the exact path, never kvpress's fake keys (which can leak)."""
    import kvpress.attention_patch as patch

    def refuse(*args, **kwargs):
        raise AssertionError("kvpress's fake keys were used for a chunk")

    model = tiny_model("qwen3")
    ids = torch.randint(0, 256, (2, K_LEN), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(patch, "search_hyperplane", refuse)
    press = ChunkedPrefillPress(CriticalAdaKVPress(SnapKVPress(0.6, window_size=WINDOW)), chunk_size=30)
    masks = kept_masks(model, ids, press)
    assert all(int(m.sum()) == compute_n_kept(K_LEN, 0.6) * 2 * 2 for m in masks)


def test_masked_attention_is_the_masked_softmax():
    from kvpress_critical.cache.attention import masked_attention

    gen = torch.Generator().manual_seed(0)
    bsz, kv_heads, group, k_len, q_len, d = 2, 2, 3, 40, 7, 16
    query = torch.randn(bsz, kv_heads * group, q_len, d, generator=gen)
    key, value = (
        torch.randn(bsz, kv_heads, k_len, d, generator=gen),
        torch.randn(bsz, kv_heads, k_len, d, generator=gen),
    )
    masked = torch.rand(bsz, kv_heads, k_len, generator=gen) < 0.4
    masked[..., k_len - q_len :] = False  # the chunk itself is never masked
    masked[1, 1, : k_len - q_len] = True  # a head with no older entry left
    indices = masked.nonzero(as_tuple=True)
    out = masked_attention(torch.nn.Module(), query, key, value, indices, scaling=d**-0.5)  # (B, q, H, d)
    k = key.repeat_interleave(group, 1)
    v = value.repeat_interleave(group, 1)
    scores = query @ k.transpose(-1, -2) * d**-0.5  # (B, H, q, K)
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    allowed = causal & ~masked.repeat_interleave(group, 1).unsqueeze(2)
    expected = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# DefensiveKV has no compact case: it is refused inside CompactCachePress (a clear error, test_errors)
NORM_REUSE_CASES = [(n, False) for n in ("CriticalKV", "CriticalAdaKV", "CriticalHeadKV", "DefensiveKV")]
NORM_REUSE_CASES += [(n, True) for n in ("CriticalKV", "CriticalAdaKV", "CriticalHeadKV")]


@pytest.mark.parametrize(
    "name, compact", NORM_REUSE_CASES, ids=[f"{'compact' if c else 'dense'}-{n}" for n, c in NORM_REUSE_CASES]
)
def test_projected_norms_are_computed_once_per_entry(monkeypatch, name, compact):
    """Reusing the norms of entries scored after an earlier chunk selects exactly what recomputing them selects."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (2, K_LEN), generator=torch.Generator().manual_seed(5))

    def run(reuse: bool):
        press = ChunkedPrefillPress(make_presses(model, 0.6)[name], chunk_size=20, reuse_norms=reuse)
        outer = CompactCachePress(press) if compact else press
        cache = DynamicCache()
        with outer(model):
            model.model(input_ids=ids, past_key_values=cache)
        held = []
        for layer, module in zip(cache.layers, attention_modules(model)):
            if isinstance(layer, CompactLayer):
                held.append((layer.segment_lengths(), layer.positions))
            elif module.masked_key_indices is not None:
                held.append(keep_mask_from_indices(module.masked_key_indices, layer.keys.shape[:3], "cpu"))
            else:
                held.append(layer.keys)
            module.masked_key_indices = None
        return held, press.reused_norm_entries

    reused, n_reused = run(True)
    recomputed, n_none = run(False)
    assert n_none == 0 and n_reused > 0
    for a, b in zip(reused, recomputed):
        for x, y in zip(a, b) if isinstance(a, tuple) else [(a, b)]:
            assert torch.equal(x, y)


def test_pruned_caches_stay_in_position_order_and_sliding_layers_are_refused():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, K_LEN), generator=torch.Generator().manual_seed(4))
    full = DynamicCache()
    model.model(input_ids=ids, past_key_values=full)
    cache = DynamicCache()
    with ChunkedPrefillPress(CriticalKVPress(SnapKVPress(0.6, window_size=WINDOW)), chunk_size=30)(model):
        model.model(input_ids=ids, past_key_values=cache)
    kept, original = cache.layers[0], full.layers[0]  # (layer 0's keys do not depend on what earlier chunks kept)
    for b in range(2):
        for h in range(2):  # every kept key is an original key, and they come in increasing positions
            same = (kept.keys[b, h, :, None] == original.keys[b, h, None]).all(-1)
            assert bool(same.any(-1).all())
            match = same.float().argmax(-1)
            assert bool((match[1:] > match[:-1]).all())
    import transformers as tf

    config = tf.MistralConfig(**tiny_config(sliding_window=64))
    windowed = tf.MistralForCausalLM(config).eval()
    with pytest.raises(NotImplementedError, match="sliding window"):
        kept_masks(windowed, ids, ChunkedPrefillPress(CriticalAdaKVPress(SnapKVPress(0.5, window_size=8)), 40))
    with ChunkedPrefillPress(CriticalKVPress(SnapKVPress(0.5, window_size=8)), 40)(windowed):  # pruning works
        out = windowed.model(input_ids=ids, past_key_values=DynamicCache())
    assert out.past_key_values.get_seq_length() == compute_n_kept(K_LEN, 0.5)
