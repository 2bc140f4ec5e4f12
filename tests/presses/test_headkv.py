"""HeadKV and CriticalHeadKV: the budget rule against a literal transcription of HeadKV's allocation, equality with the
uniform-budget presses, the head-importance profiler on a model with a planted retrieval head, and the score files."""

import json
import math

import pytest
import torch
from helpers import FAMILIES, head_scores, kept_masks, tiny_config, tiny_model
from kvpress import PrefillDecodingPress, SnapKVPress

from kvpress_critical import CompactCachePress, CriticalHeadKVPress, CriticalKVPress, HeadKVPress
from kvpress_critical.cache import CompactLayer
from kvpress_critical.head_scores import (
    Trial,
    head_scores_for,
    load_head_scores,
    parse_head_scores,
    profile_head_scores,
    save_head_scores,
    shipped_models,
)
from kvpress_critical.selection import compute_n_kept, headkv_budgets, integer_budgets

# ---- the budget rule ---------------------------------------------------------------------------------------------


def literal_headkv(scores, base_capacity, window, beta, temperature):
    """HeadKV's allocation written as in its code (ReasonSnapKVCluster.__init__), per query head, unrounded."""
    flat = [s for layer in scores for s in layer]
    total = sum(flat)
    p = [s / total for s in flat]
    p = [x**temperature for x in p]
    p = [x / sum(p) for x in p]
    b = base_capacity - window
    n_layers, n_heads = len(scores), len(scores[0])
    pool = (b // beta) * n_layers * n_heads
    floor = b - b // beta
    return [[p[layer * n_heads + h] * pool + floor + window for h in range(n_heads)] for layer in range(n_layers)]


@pytest.mark.parametrize("beta, temperature", [(1.5, 1.0), (1.01, 1.0), (5.0, 2.0), (1.2, 0.5)])
@pytest.mark.parametrize("group", [1, 4])
def test_budgets_follow_headkv_rule(beta, temperature, group):
    gen = torch.Generator().manual_seed(int(beta * 10 + group))
    n_layers, kv_heads, k_len, window = 5, 3, 400, 16
    scores = torch.rand(n_layers, kv_heads * group, generator=gen) ** 3
    n_kept = compute_n_kept(k_len, 0.6)
    budgets = headkv_budgets(scores, n_kept, k_len, beta, temperature, window, num_kv_heads=kv_heads)
    literal = torch.tensor(literal_headkv(scores.tolist(), n_kept, window, beta, temperature), dtype=torch.float64)
    per_kv = literal.view(n_layers, kv_heads, group).mean(-1)  # a KV head's budget: the mean of its group's
    assert budgets.dtype == torch.int64 and bool((budgets >= 0).all())
    assert int(budgets.sum()) == n_kept * n_layers * kv_heads  # exactly the overall budget
    assert bool((budgets <= k_len).all())
    capped = per_kv > k_len
    if not bool(capped.any()):
        assert bool(((budgets - per_kv).abs() <= 1).all())  # each within one of HeadKV's real-valued budget
    else:  # the capped heads hold the whole context; what HeadKV would give beyond it goes to the others
        assert bool((budgets[capped] == k_len).all())
        assert bool((budgets[~capped] >= per_kv[~capped].floor() - 1).all())
        extra = float((per_kv[capped] - k_len).sum())
        assert float((budgets[~capped] - per_kv[~capped]).sum()) == pytest.approx(extra, abs=1e-6 * extra + 1)
    order = per_kv.flatten().argsort()
    assert bool((budgets.flatten()[order].diff() >= -1).all())  # more important heads never get fewer entries
    floor = (n_kept - window) - math.floor((n_kept - window) / beta) + window
    if temperature == 1.0:  # HeadKV's floor: every head gets it (its share of the pool is non-negative)
        assert bool((budgets >= math.floor(floor) - 1).all())


def test_uniform_scores_give_uniform_budgets_and_caps_redistribute():
    budgets = headkv_budgets(torch.ones(4, 3), 50, 200, window=8)
    assert bool((budgets == 50).all())
    # one head would get more than the context: capped at k_len, the rest spread over the others
    skewed = torch.tensor([[100.0, 1.0], [1.0, 1.0]])
    budgets = headkv_budgets(skewed, 60, 100, beta=1.01)
    assert int(budgets.max()) == 100 and int(budgets.sum()) == 240
    assert integer_budgets(torch.tensor([2.5, 2.5, 5.0]), 10, 4).tolist() == [3, 3, 4]


@pytest.mark.parametrize(
    "ideal, total, cap",
    [
        ([0.0, 0.0, 0.0, 0.0], 10, 5),  # no preference: spread evenly
        ([0.0, 0.0, 9.0], 12, 5),  # the cap frees entries for heads whose ideal is zero
        ([3.3, 3.3, 3.4], 30, 8),  # asks for more than the caps allow: every head full
        ([1e-12, 7.0, 2.0], 9, 9),
        ([0.6] * 7, 4, 1),
        ([5.0, 5.0], 0, 3),
    ],
)
def test_integer_budgets_edge_cases(ideal, total, cap):
    budgets = integer_budgets(torch.tensor(ideal), total, cap)
    assert int(budgets.sum()) == min(total, cap * len(ideal)), budgets
    assert bool((budgets >= 0).all() & (budgets <= cap).all()), budgets
    if sum(ideal) == 0:
        assert int(budgets.max()) - int(budgets.min()) <= 1, budgets
    with pytest.raises(ValueError, match="NaN"):
        integer_budgets(torch.tensor([1.0, float("nan")]), 2, 2)
    with pytest.raises(ValueError, match="re-profile"):
        headkv_budgets(torch.tensor([[1.0, float("nan")]]), 2, 10)


# ---- the presses -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("ratio", [0.3, 0.7])
def test_uniform_scores_select_like_the_uniform_presses(family, ratio):
    model = tiny_model(family)
    ids = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(1))  # distinct ids: no ties
    scores = head_scores(model)
    pairs = [
        (HeadKVPress(SnapKVPress(ratio, window_size=8), head_scores=scores), SnapKVPress(ratio, window_size=8)),
        (
            CriticalHeadKVPress(SnapKVPress(ratio, window_size=8), head_scores=scores),
            CriticalKVPress(SnapKVPress(ratio, window_size=8)),
        ),
    ]
    for head_press, uniform_press in pairs:
        got, expected = kept_masks(model, ids, head_press), kept_masks(model, ids, uniform_press)
        for layer, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), f"{type(head_press).__name__} layer {layer}"


def skewed_scores(model, seed=0):
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    values = torch.rand(cfg.num_hidden_layers, cfg.num_attention_heads, generator=gen) ** 4
    return {
        f"{layer}-{h}": [float(values[layer, h])] for layer in range(values.shape[0]) for h in range(values.shape[1])
    }


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("press_cls", [HeadKVPress, CriticalHeadKVPress])
def test_model_matrix(family, bsz, dtype, press_cls):
    model = tiny_model(family, dtype=dtype)
    ids = torch.randint(0, 256, (bsz, 96), generator=torch.Generator().manual_seed(bsz))
    scores = skewed_scores(model)
    press = press_cls(SnapKVPress(0.6, window_size=8), head_scores=scores)
    masks = kept_masks(model, ids, press)
    press.post_init_from_model(model)
    budgets = [press.layer_budgets(m.self_attn, 96) for m in model.model.layers]
    assert sum(int(b.sum()) for b in budgets) == compute_n_kept(96, 0.6) * model.config.num_key_value_heads * len(
        budgets
    )
    assert len({int(b.sum()) for b in budgets}) > 1 or len(budgets) == 1  # layers keep different totals
    for layer, (mask, budget) in enumerate(zip(masks, budgets)):
        assert torch.equal(mask.sum(-1), budget.expand(bsz, -1)), f"layer {layer}"
        assert bool(mask[..., -8:].all()), "SnapKV's window is always kept"


def test_compact_layout_and_wrappers(smollm2_pipeline):
    pipe = smollm2_pipeline
    context = " ".join(["The quick brown fox jumps over the lazy dog."] * 30) + " The code word is tangerine."
    question = "What is the code word?"
    masked = pipe(context, question=question, press=HeadKVPress(SnapKVPress(0.5)), max_new_tokens=8)["answer"]
    from transformers import DynamicCache

    cache = DynamicCache()
    compact = pipe(
        context,
        question=question,
        press=CompactCachePress(HeadKVPress(SnapKVPress(0.5))),
        max_new_tokens=8,
        cache=cache,
    )["answer"]
    assert compact == masked  # the same selection in another layout
    assert all(isinstance(layer, CompactLayer) for layer in cache.layers)
    press = HeadKVPress(SnapKVPress(0.5))
    press.post_init_from_model(pipe.model)
    k_len = cache.layers[0].context_length
    for layer, module in zip(cache.layers, pipe.model.model.layers):  # each head holds HeadKV's budget
        assert torch.equal(layer.segment_lengths()[0], press.layer_budgets(module.self_attn, k_len))
    lengths = [layer.segment_lengths() for layer in cache.layers]
    assert len({int(x.sum()) for x in lengths}) > 1  # per-layer totals differ (HeadKV's shared pool)
    both = PrefillDecodingPress(prefilling_press=HeadKVPress(SnapKVPress(0.5)), decoding_press=None)
    assert pipe(context, question=question, press=both, max_new_tokens=8)["answer"] == masked


def test_errors():
    with pytest.raises(ValueError, match="beta must be"):
        HeadKVPress(SnapKVPress(0.5), beta=0.5)
    with pytest.raises(ValueError, match="temperature"):
        CriticalHeadKVPress(SnapKVPress(0.5), temperature=0)
    with pytest.raises(TypeError, match="already applies CriticalKV"):
        HeadKVPress(CriticalKVPress(SnapKVPress(0.5)))
    model = tiny_model("llama")
    with pytest.raises(FileNotFoundError, match="python -m kvpress_critical.head_scores"):
        HeadKVPress(SnapKVPress(0.5)).post_init_from_model(model)
    with pytest.raises(ValueError, match="profiled on another model"):
        HeadKVPress(SnapKVPress(0.5), head_scores={"0-0": [1.0]}).post_init_from_model(model)
    with pytest.raises(RuntimeError, match="post_init_from_model"):
        HeadKVPress(SnapKVPress(0.5), head_scores=head_scores(model)).layer_budgets(model.model.layers[0].self_attn, 10)


# ---- score files -------------------------------------------------------------------------------------------------


def test_headkv_format_round_trip(tmp_path):
    scores = {"1-0": [0.5, 1.5], "0-1": [2.0], "0-0": [1.0, 3.0], "1-1": [0.0]}  # any key order
    path = save_head_scores(scores, tmp_path / "m.json", metadata={"model": "x"})
    assert list(json.loads(path.read_text())) == ["0-0", "0-1", "1-0", "1-1"]  # layer-major, as HeadKV writes
    assert json.loads((tmp_path / "m.meta.json").read_text()) == {"model": "x"}
    assert load_head_scores(path).tolist() == [[2.0, 2.0], [1.0, 0.0]]
    # HeadKV's published files: one line, lists of per-trial scores; also plain numbers and a matrix
    (tmp_path / "headkv.json").write_text('{"0-0": [0.1, 0.3], "0-1": [0.0], "1-0": [1.0], "1-1": [0.5, 0.5]}')
    assert load_head_scores(tmp_path / "headkv.json").tolist() == [[0.2, 0.0], [1.0, 0.5]]
    assert parse_head_scores({"0-0": 1, "0-1": 2}).tolist() == [[1.0, 2.0]]
    assert parse_head_scores([[1, 2], [3, 4]]).shape == (2, 2)
    with pytest.raises(ValueError, match="miss"):
        parse_head_scores({"0-0": [1.0], "1-1": [1.0]})
    with pytest.raises(ValueError, match="'<layer>-<head>'"):
        parse_head_scores({"layer0": [1.0]})


def test_scores_ship_for_the_embedded_model(smollm2):
    model, _ = smollm2
    assert "SmolLM2-135M-Instruct" in shipped_models()
    scores = head_scores_for(None, model)
    assert scores.shape == (30, 9) and bool((scores >= 0).all()) and float(scores.sum()) > 0


# ---- the profiler on a planted retrieval head --------------------------------------------------------------------

NEEDLE_TOKENS = list(range(200, 206))


def planted_model():
    """Layer 1, query head 2 looks at the needle: every token shares an 'always on' direction the head's queries read,
    needle tokens carry a marker direction its keys read, on the slowest RoPE pair (negligible rotation)."""
    import transformers as tf

    config = tf.LlamaConfig(
        **tiny_config(intermediate_size=64, head_dim=16, rope_theta=1e9, max_position_embeddings=4096)
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0, 0.02)
        emb[:, 0] = 1.0  # always on
        emb[NEEDLE_TOKENS, 1] = 1.0  # needle marker
        for layer in model.model.layers:  # the residual stream stays the embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            layer.self_attn.q_proj.weight.zero_()
            layer.self_attn.k_proj.weight.zero_()
        attn = model.model.layers[1].self_attn
        d, slow = 16, 7  # RoPE pairs (i, i + d/2); pair 7 rotates slowest
        head, kv = 2, 2 // 2
        attn.q_proj.weight[head * d + slow, 0] = 60.0
        attn.k_proj.weight[kv * d + slow, 1] = 60.0
    return model


def planted_trials(n=6):
    trials = []
    gen = torch.Generator().manual_seed(0)
    for i in range(n):
        length = 60 + 20 * i
        ids = torch.randint(0, 150, (length,), generator=gen)
        at = int((i + 0.5) / n * (length - len(NEEDLE_TOKENS)))
        ids[at : at + len(NEEDLE_TOKENS)] = torch.tensor(NEEDLE_TOKENS)
        trials.append(Trial(ids.unsqueeze(0), (at, at + len(NEEDLE_TOKENS)), "x", context_length=length))
    return trials


def test_planted_retrieval_head_ranks_first(tmp_path):
    model = planted_model()
    scores, summary = profile_head_scores(
        model, None, planted_trials(), "reasoning", require_correct=False, progress=False
    )
    assert summary["counted"] == 6 and all(len(v) == 6 for v in scores.values())
    matrix = parse_head_scores(scores)
    assert matrix.shape == (2, 4)
    assert int(matrix.flatten().argmax()) == 1 * 4 + 2  # layer 1, query head 2
    assert float(matrix[1, 2]) > 10 * float(matrix.flatten().sort().values[-2])
    # the budgets follow: the planted head's KV head keeps far more than the others of its layer
    budgets = headkv_budgets(matrix.float(), 40, 200, beta=1.5, num_kv_heads=2)
    assert int(budgets[1, 1]) > int(budgets[1, 0])
    save_head_scores(scores, tmp_path / "planted.json")
    assert torch.equal(load_head_scores(tmp_path / "planted.json"), matrix)
    # the retrieval (copy-paste) variant runs on the same trials
    copy_scores, _ = profile_head_scores(
        model, None, planted_trials(2), "retrieval", require_correct=False, progress=False
    )
    assert set(copy_scores) == set(scores)
