"""The kvpress-free base scores of ``kvpress_critical.selection.scorers`` against kvpress's own presses, bitwise.

The vLLM plugin selects with these functions; the transformers presses call kvpress's. Equal scores on the same
tensors are what makes both select the same entries.
"""

import pytest
import torch
from helpers import tiny_model
from kvpress import KnormPress, SnapKVPress, StreamingLLMPress
from kvpress.utils import compute_n_kept as kvpress_compute_n_kept

from kvpress_critical.modeling import attention_modules
from kvpress_critical.presses.window_attention import window_queries
from kvpress_critical.selection import (
    compute_n_kept,
    knorm_scores,
    snapkv_scores,
    streaming_llm_scores,
    top_budget_mask,
    window_attention,
)


def _layer_inputs(family, num_kv_heads, num_heads, dtype, bsz, k_len, seed=0):
    """An attention layer of a tiny model with random hidden states, its RoPE and keys of the right shape."""
    model = tiny_model(family, num_kv_heads=num_kv_heads, num_heads=num_heads, dtype=dtype)
    module = attention_modules(model)[0]
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(bsz, k_len, model.config.hidden_size, generator=gen).to(dtype)
    head_dim = module.head_dim
    keys = torch.randn(bsz, num_kv_heads, k_len, head_dim, generator=gen).to(dtype)
    positions = torch.arange(k_len)[None].expand(bsz, -1)
    rotary = model.model.rotary_emb
    cos, sin = rotary(hidden, positions)
    return module, hidden, keys, (cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,num_kv_heads,num_heads", [("llama", 2, 4), ("llama", 1, 4), ("qwen3", 2, 2)])
@pytest.mark.parametrize("bsz,k_len,window,kernel", [(1, 77, 16, 5), (2, 130, 64, 7), (1, 40, 8, 1)])
def test_snapkv_scores_equal_kvpress(dtype, family, num_kv_heads, num_heads, bsz, k_len, window, kernel):
    module, hidden, keys, rope = _layer_inputs(family, num_kv_heads, num_heads, dtype, bsz, k_len)
    press = SnapKVPress(compression_ratio=0.5, window_size=window, kernel_size=kernel)
    expected = press.score(module, hidden, keys, keys, None, {"position_embeddings": rope})
    queries = window_queries(module, hidden, window, rope)
    got = snapkv_scores(queries, keys, window, kernel)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected.float())


def test_snapkv_scores_are_uniform_when_the_prompt_fits_the_window():
    keys = torch.randn(1, 2, 16, 8)
    scores = snapkv_scores(torch.randn(1, 4, 16, 8), keys, window_size=16, kernel_size=5)
    assert torch.equal(scores, torch.ones(1, 2, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_knorm_scores_equal_kvpress(dtype):
    keys = torch.randn(2, 3, 50, 16).to(dtype)
    expected = KnormPress(compression_ratio=0.5).score(None, None, keys, keys, None, {})
    assert torch.equal(knorm_scores(keys), expected.float())


@pytest.mark.parametrize("k_len,ratio,n_sink", [(50, 0.5, 4), (33, 0.25, 2), (100, 0.9, 4)])
def test_streaming_llm_scores_keep_what_kvpress_keeps(k_len, ratio, n_sink):
    keys = torch.randn(1, 2, k_len, 8)
    expected = StreamingLLMPress(compression_ratio=ratio, n_sink=n_sink).score(None, None, keys, keys, None, {})
    n_kept = compute_n_kept(k_len, ratio)
    scores = streaming_llm_scores(keys, n_kept, n_sink)
    assert torch.equal(scores, expected.float())
    keep = top_budget_mask(scores, torch.full((1, 2), n_kept))
    assert torch.equal(
        keep[0, 0].nonzero().flatten(), torch.cat([torch.arange(n_sink), torch.arange(k_len - n_kept + n_sink, k_len)])
    )


@pytest.mark.parametrize("k_len", [1, 7, 100, 1000, 4097])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 0.3, 0.5, 0.7, 0.75, 0.875, 0.9, 0.999, 1.0])
def test_compute_n_kept_is_kvpress_rule(k_len, ratio):
    assert compute_n_kept(k_len, ratio) == kvpress_compute_n_kept(k_len, ratio)


@pytest.mark.parametrize(("group", "window", "k_len"), [(1, 4, 9), (3, 5, 5), (2, 1, 7)])
def test_window_attention_is_causal_softmax_with_each_query_on_its_own_key(group, window, k_len):
    """Each window query attends over every entry up to and including its own position (the reference: one softmax
    per query, written out), grouped query heads over their KV head's keys."""
    g = torch.Generator().manual_seed(k_len)
    bsz, num_kv_heads, head_dim, scale = 2, 2, 8, 0.3
    queries = torch.randn(bsz, num_kv_heads * group, window, head_dim, generator=g)
    keys = torch.randn(bsz, num_kv_heads, k_len, head_dim, generator=g)
    got = window_attention(queries, keys, scale)  # (B, H_kv, G, W, T)
    for b in range(bsz):
        for h in range(num_kv_heads * group):
            for w in range(window):
                position = k_len - window + w  # the query's own position: its key is the last it sees
                row = torch.softmax(keys[b, h // group, : position + 1] @ queries[b, h, w] * scale, dim=0)
                expected = torch.cat([row, torch.zeros(k_len - position - 1)])
                torch.testing.assert_close(got[b, h // group, h % group, w], expected, rtol=1e-5, atol=1e-6)
