"""The compact cache: the layer (packing, appends, answer removal), CompactCachePress on every model family, and
end to end on SmolLM2 against the masking layout (same selection: the same logits and the same greedy answers)."""

import pytest
import torch
from helpers import FAMILIES, tiny_config, tiny_model
from kvpress import AdaKVPress, DecodingPress, KeyRerotationPress, KnormPress, PrefillDecodingPress, SnapKVPress
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvpress_critical import CompactCachePress, CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.cache import CompactKV, CompactLayer, LogicalView, keep_mask_from_indices
from kvpress_critical.modeling import attention_modules

# ---- the layer ---------------------------------------------------------------------------------------------------


def dense_layer(bsz=2, heads=3, k_len=11, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(bsz, heads, k_len, d, generator=gen), torch.randn(bsz, heads, k_len, d, generator=gen)
    keep = torch.rand(bsz, heads, k_len, generator=gen) < 0.5
    keep[0, 0] = False  # an empty head
    keep[-1, -1] = True  # a full one
    return keys, values, keep


def test_packing_keeps_exactly_the_kept_entries_in_order():
    keys, values, keep = dense_layer()
    layer = CompactLayer.from_keep_mask(keys, values, keep, reserve=4)
    assert torch.equal(layer.segment_lengths(), keep.sum(-1))
    for b in range(2):
        for h in range(3):
            k, v, pos = layer.segments(b, h)
            expected = keep[b, h].nonzero().squeeze(-1)
            assert torch.equal(pos.long(), expected)  # original positions, in order
            assert torch.equal(k, keys[b, h, expected]) and torch.equal(v, values[b, h, expected])
    assert layer.packed_keys.shape[0] == int(keep.sum())
    # the layer reports the dense layer's length: positions and masks elsewhere do not change at conversion
    assert layer.context_length == 11 and layer.get_seq_length() == 11


def test_appends_grow_the_tail_in_place_and_removal_shrinks_it():
    keys, values, keep = dense_layer()
    layer = CompactLayer.from_keep_mask(keys, values, keep, reserve=2)
    packed = layer.packed_keys.data_ptr()
    start = layer.get_seq_length()
    new = [torch.randn(2, 3, n, 8) for n in (3, 1, 1, 4)]  # a question, then decoding, then a longer one
    for i, step in enumerate(new):
        handle, same = layer.update(step, step + 1)
        assert isinstance(handle, CompactKV) and handle is same and handle.shape[2] == layer.get_seq_length()
    assert layer.packed_keys.data_ptr() == packed, "the packed context was copied"
    assert layer.tail_len == 9 and layer.tail_keys.shape[2] >= 9
    assert torch.equal(layer.tail_keys[:, :, :9], torch.cat(new, dim=2))
    assert torch.equal(layer.tail_values[:, :, :9], torch.cat(new, dim=2) + 1)
    # kvpress's pipeline removes an answer by slicing the keys and values attributes
    length = start + 4
    layer.keys = layer.keys[:, :, :length]
    layer.values = layer.values[:, :, :length]
    assert layer.get_seq_length() == length and layer.tail_len == 4
    assert torch.equal(layer.tail_keys[:, :, :4], torch.cat(new[:2], dim=2))
    with pytest.raises(ValueError, match="compressed context alone"):
        layer.crop(start - 1)
    with pytest.raises(TypeError, match="cannot be replaced by a tensor"):
        layer.keys = torch.zeros(1)
    view = layer.keys
    assert isinstance(view, LogicalView) and view.shape == (2, 3, layer.get_seq_length(), 8)
    with pytest.raises(TypeError, match="no dense tensor"):
        torch.cat([view, view])
    with pytest.raises(TypeError, match="only \\[:, :, :n\\] slices"):
        view[0]


def test_memory_is_the_kept_entries_plus_the_reserve():
    keys, values, keep = dense_layer(k_len=400, d=64)
    layer = CompactLayer.from_keep_mask(keys, values, keep, reserve=16)
    kept = int(keep.sum()) * 64 * 4 * 2
    assert layer.nbytes(reserved=False) - kept < 0.01 * kept + 8 * 7 + 4 * int(keep.sum())
    assert layer.nbytes() == layer.nbytes(reserved=False) + 2 * 2 * 3 * 16 * 64 * 4


def test_keep_mask_from_indices():
    keep = keep_mask_from_indices((torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([2, 3])), (2, 2, 5), "cpu")
    assert int((~keep).sum()) == 2 and not keep[0, 1, 2] and not keep[1, 0, 3]


# ---- the press on every model family -----------------------------------------------------------------------------


def masked_keep(model, ids, press):
    """Per layer, the (B, H_kv, T) entries a head-wise press keeps in kvpress's masking layout, and the dense keys."""
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    out = []
    for module, layer in zip(attention_modules(model), cache.layers):
        out.append((keep_mask_from_indices(module.masked_key_indices, layer.keys.shape[:3], "cpu"), layer.keys))
        module.masked_key_indices = None
    return out


def compact_cache(model, ids, press):
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


def gemma3_with_sliding_layers():
    import transformers as tf

    config = tf.Gemma3TextConfig(
        **tiny_config(
            num_hidden_layers=3,
            head_dim=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=16,
        )
    )
    torch.manual_seed(0)
    return tf.Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_matrix(family, bsz, dtype):
    model = tiny_model(family, dtype=dtype)
    ids = torch.randint(0, 256, (bsz, 96), generator=torch.Generator().manual_seed(bsz))
    for make in (lambda: CriticalAdaKVPress(SnapKVPress(0.6, window_size=8)), lambda: AdaKVPress(KnormPress(0.6))):
        expected = masked_keep(model, ids, make())
        cache = compact_cache(model, ids, CompactCachePress(make()))
        for layer_idx, ((keep, dense_keys), layer) in enumerate(zip(expected, cache.layers)):
            assert isinstance(layer, CompactLayer), layer_idx
            assert torch.equal(layer.segment_lengths(), keep.sum(-1)), f"layer {layer_idx}: other budgets"
            # key norms tie (RoPE rotates: equal token ids, equal norms): kvpress's topk keeps any of the tied
            # entries, the compact layout's selection the earliest; the kept norms are the same
            norms = dense_keys.float().norm(dim=-1)
            for b in range(bsz):
                for h in range(keep.shape[1]):
                    k, _, pos = layer.segments(b, h)
                    assert torch.equal(k, dense_keys[b, h][pos.long()])
                    same = torch.equal(pos.long(), keep[b, h].nonzero().squeeze(-1))
                    tied = torch.equal(norms[b, h][pos.long()].sort().values, norms[b, h][keep[b, h]].sort().values)
                    assert same or (isinstance(make(), AdaKVPress) and tied), f"layer {layer_idx} ({b}, {h})"
            assert layer.packed_keys.dtype == dtype
            assert all(m.masked_key_indices is None for m in attention_modules(model))
        # decoding on the compact layout runs and stays finite
        out = model(input_ids=ids[:, :3], past_key_values=cache, position_ids=torch.arange(96, 99).expand(bsz, 3))
        assert torch.isfinite(out.logits).all()


def test_gemma3_sliding_layers_stay_dense():
    model = gemma3_with_sliding_layers()
    ids = torch.randint(0, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    cache = compact_cache(model, ids, CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5, window_size=8))))
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicLayer", "CompactLayer", "DynamicLayer"]
    modules = attention_modules(model)
    assert modules[0].masked_key_indices is not None  # the sliding layers keep kvpress's masking
    logits = logits_after(model, cache, ids.shape[1], torch.tensor([[5, 6, 7]]), [8, 9])
    assert all(torch.isfinite(x).all() for x in logits)


def test_pruning_presses_are_compacted_too():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    cache = compact_cache(model, ids, CompactCachePress(CriticalKVPress(SnapKVPress(0.5, window_size=8))))
    assert all(bool((layer.segment_lengths() == 32).all()) for layer in cache.layers)


def test_clear_errors():
    # kvpress's decoding presses are accepted (compression while decoding in the compact layout, test_serving.py)
    decoding = CompactCachePress(
        DecodingPress(CriticalAdaKVPress(KnormPress()), compression_interval=4, target_size=64)
    )
    assert decoding.decoding_schedule is not None and decoding.prefill_press is None
    both = CompactCachePress(
        PrefillDecodingPress(prefilling_press=KnormPress(0.5), decoding_press=DecodingPress(KnormPress()))
    )
    assert isinstance(both, PrefillDecodingPress) and both.compression_ratio == 0.5  # kvpress's pipeline enters it
    with pytest.raises(TypeError, match="KeyRerotationPress"):
        CompactCachePress(KeyRerotationPress(KnormPress(0.5)))
    with pytest.raises(TypeError, match="wraps a kvpress press"):
        CompactCachePress(None)
    with pytest.raises(TypeError, match="once"):
        CompactCachePress(CompactCachePress(KnormPress(0.5)))
    eager = tiny_model("llama", attn_implementation="eager")
    with pytest.raises(ValueError, match="eager"):
        compact_cache(eager, torch.randint(0, 256, (1, 32)), CompactCachePress(KnormPress(0.5)))
    press = CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)))
    press.compression_ratio = 0.25  # kvpress's runner sets the ratio on the outermost press
    assert press.press.compression_ratio == 0.25 and "CriticalAdaKVPress" in repr(press)


def test_presses_that_drive_the_model_themselves_are_refused():
    from kvpress import DMSPress, FinchPress, KVComposePress, KVzipPress, RestoreKVPress

    for press, match in [
        (KVzipPress(0.5), "KVzipPress: it drives the model"),
        (RestoreKVPress(0.5), "RestoreKVPress: it drives the model"),
        (KVComposePress(compression_ratio=0.5), "KVComposePress"),
        (FinchPress(0.5), "FinchPress: kvpress's pipeline re-positions"),
        (DMSPress(KnormPress(0.5), decoding=True), "DMSPress: its decoding compression"),
        (AdaKVPress(KnormPress(0.5)), None),  # nested presses are inspected too, and this one is fine
    ]:
        if match is None:
            CompactCachePress(press)
        else:
            with pytest.raises(TypeError, match=match):
                CompactCachePress(press)
    from kvpress import ComposedPress

    with pytest.raises(TypeError, match="FinchPress"):
        CompactCachePress(ComposedPress([KnormPress(0.2), FinchPress(0.5)]))


def test_conversion_keeps_every_reported_length():
    """get_seq_length is the dense layer's: the positions and masks of the next forward are the masking layout's."""
    model = tiny_model("qwen2")
    ids = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(0))
    masked = DynamicCache()
    with CriticalAdaKVPress(SnapKVPress(0.9, window_size=8))(model):  # < 1 entry per head on some heads
        model.model(input_ids=ids, past_key_values=masked)
    compact = compact_cache(model, ids, CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.9, window_size=8))))
    assert [x.get_seq_length() for x in compact.layers] == [x.get_seq_length() for x in masked.layers] == [50, 50]
    assert compact.get_seq_length() == 50


def test_windows_that_cannot_bind_are_full_attention():
    """Phi-3-mini-128k / Phi-3.5 configure sliding_window 262144 for a 131072-position model: compacted."""
    import transformers as tf

    config = tf.Phi3Config(**tiny_config(sliding_window=4096, pad_token_id=0))
    torch.manual_seed(0)
    model = tf.Phi3ForCausalLM(config).eval()
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    cache = compact_cache(model, ids, CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5, window_size=8))))
    assert all(isinstance(layer, CompactLayer) for layer in cache.layers)
    out = model(input_ids=ids[:, :2], past_key_values=cache, position_ids=torch.tensor([[64, 65]]))
    assert torch.isfinite(out.logits).all()


def test_every_registered_attention_function_reads_the_compact_layout():
    """flash_attention_2 and the others: the wrapper intercepts the compact handle before the wrapped function."""
    keys, values, keep = dense_layer(bsz=1, heads=2, k_len=20, d=16)
    layer = CompactLayer.from_keep_mask(keys, values, keep)
    handle, _ = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    query = torch.randn(1, 4, 1, 16)
    outputs = []
    for name in ("sdpa", "flash_attention_2", "flex_attention"):  # wrapped while the compact layer exists
        if name in ALL_ATTENTION_FUNCTIONS:
            out, weights = ALL_ATTENTION_FUNCTIONS[name](torch.nn.Module(), query, handle, handle, None, scaling=0.25)
            assert weights is None and out.shape == (1, 1, 4, 16)
            outputs.append(out)
    assert len(outputs) >= 2 and all(torch.equal(o, outputs[0]) for o in outputs)


# ---- end to end against the masking layout -----------------------------------------------------------------------


@torch.no_grad()
def logits_after(model, cache, context_length, question_ids, answer_ids):
    """Logits of the question pass (last position) and of each teacher-forced decoding step."""
    bsz = question_ids.shape[0]
    position = torch.arange(context_length, context_length + question_ids.shape[1]).expand(bsz, -1)
    out = [model(input_ids=question_ids, past_key_values=cache, position_ids=position).logits[:, -1]]
    pos = context_length + question_ids.shape[1]
    for token in answer_ids:
        step = torch.full((bsz, 1), token)
        out.append(model(input_ids=step, past_key_values=cache, position_ids=torch.full((bsz, 1), pos)).logits[:, -1])
        pos += 1
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_logits_match_the_masking_layout_on_tiny_models(family):
    """Same selection, same logits. The masking layout is only approximately exact: kvpress's fake key must make
    exp(q.k) underflow for every query of the group, and on these random models a 7-token question sometimes gets a
    fake key with q.k = -7.8 (masked entries then take ~14% of the attention) or none at all (ValueError). The inputs
    here are fixed ones for which kvpress's masking is exact; the compact layout is exact by construction."""
    model = tiny_model(family)
    ids = torch.randint(0, 256, (3, 100), generator=torch.Generator().manual_seed(2))
    question, answer = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(2)), [11, 12, 13, 14]
    press = CriticalAdaKVPress(SnapKVPress(0.7, window_size=8))
    masked = DynamicCache()
    with press(model):
        model.model(input_ids=ids, past_key_values=masked)
    expected = logits_after(model, masked, 100, question, answer)
    for m in attention_modules(model):
        m.masked_key_indices = None
    got = logits_after(model, compact_cache(model, ids, CompactCachePress(press)), 100, question, answer)
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize(  # three ratios over the two presses (each case costs two pipeline calls on SmolLM2)
    ("press_cls", "cases"), [(CriticalAdaKVPress, ((0, 0.5), (1, 0.75))), (AdaKVPress, ((2, 0.25),))]
)
def test_smollm2_logits_and_answers_match_the_masking_layout(smollm2, smollm2_pipeline, press_cls, cases):
    from kvpress_critical.data.text import haystack_context

    model, tokenizer = smollm2
    pipe = smollm2_pipeline
    needles = ["The secret passphrase for the archive is violet-harbor-42.", "The lighthouse keeper is named Oskar."]
    questions = ["What is the secret passphrase for the archive?", "What is the name of the lighthouse keeper?"]
    for seed, ratio in cases:
        context = haystack_context(tokenizer, 300, needles[seed % 2], seed=seed)
        inputs = pipe.preprocess(context, questions, "", max_context_length=10**6)
        ids, question = inputs["context_ids"], inputs["questions_ids"][0]
        # greedy answers through kvpress's unchanged pipeline, several questions (each answer removed afterwards);
        # the caches it leaves (the context, compressed) then give the logits of the same continuation
        masked = DynamicCache()
        plain = pipe(context, questions=questions, press=press_cls(SnapKVPress(ratio)), max_new_tokens=8, cache=masked)
        expected = logits_after(model, masked, ids.shape[1], question, [100, 200, 300])
        for m in attention_modules(model):
            m.masked_key_indices = None
        compact = DynamicCache()
        press = CompactCachePress(press_cls(SnapKVPress(ratio)))
        compacted = pipe(context, questions=questions, press=press, max_new_tokens=8, cache=compact)
        assert compacted["answers"] == plain["answers"], f"ratio {ratio}"
        assert all(isinstance(layer, CompactLayer) for layer in compact.layers)
        n_kept = int(ids.shape[1] * (1 - ratio))
        lengths = [layer.get_seq_length() for layer in compact.layers]
        assert lengths == [ids.shape[1]] * len(compact.layers) and all(x.tail_len == 0 for x in compact.layers)
        assert all(int(layer.packed_keys.shape[0]) == 3 * n_kept for layer in compact.layers)
        got = logits_after(model, compact, ids.shape[1], question, [100, 200, 300])
        for step, (a, b) in enumerate(zip(got, expected)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-4, msg=lambda m: f"ratio {ratio} step {step}: {m}")


def test_kvpress_fake_key_can_leak_where_the_compact_layout_is_exact(monkeypatch):
    """A kvpress 0.5.5 behaviour worth knowing: its masking fake key does not always nullify the masked entries."""
    import kvpress.attention_patch as patch

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (3, 100), generator=torch.Generator().manual_seed(2))
    question = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(0))
    dots, search = [], patch.search_hyperplane

    def spy(queries, max_iter=1000):
        fake = search(queries, max_iter)
        dots.append(float(torch.bmm(queries.float(), fake.float().unsqueeze(-1)).max()))
        return fake

    monkeypatch.setattr(patch, "search_hyperplane", spy)
    press = CriticalAdaKVPress(SnapKVPress(0.7, window_size=8))
    masked = DynamicCache()
    with press(model):
        model.model(input_ids=ids, past_key_values=masked)
    expected = logits_after(model, masked, 100, question, [])[0]
    for m in attention_modules(model):
        m.masked_key_indices = None
    got = logits_after(model, compact_cache(model, ids, CompactCachePress(press)), 100, question, [])[0]
    scale = model.model.layers[0].self_attn.scaling
    assert max(dots) * scale > -5, "kvpress's fake key nullified every masked entry here"  # exp(-2) ~ 0.14 weight
    assert (got[2] - expected[2]).abs().max() > 1e-4  # the row whose masked entries leaked
    torch.testing.assert_close(got[:2], expected[:2], rtol=1e-5, atol=1e-5)  # the others agree


def test_a_decoding_step_over_the_compact_cache_runs_under_torch_compile():
    """torch.compile traces the model over compact layers (graph breaks at the layout's data-dependent checks) and
    gives the eager step's logits; the kernels themselves trace without a break (tests/ops)."""
    import copy

    model = tiny_model("llama", num_kv_heads=2, num_heads=8)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad(), CompactCachePress(CriticalAdaKVPress(SnapKVPress(0.5)))(model):
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
    assert isinstance(cache.layers[0], CompactLayer)
    copied = copy.deepcopy(cache)
    with torch.no_grad():
        eager = model(token, past_key_values=cache).logits
        compiled = torch.compile(model, backend="eager")(token, past_key_values=copied).logits
    torch.testing.assert_close(compiled, eager)
    assert copied.layers[0].get_seq_length() == cache.layers[0].get_seq_length()
