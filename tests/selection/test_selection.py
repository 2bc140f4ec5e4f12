"""The batched selection rules against a literal, loop-per-head transcription of the paper's algorithms."""

import pytest
import torch

from kvpress_critical.selection import (
    adaptive_head_budgets,
    compute_n_kept,
    critical_adakv_keep_mask,
    critical_scores,
    first_stage_budget,
    safeguard_budget,
    two_stage_keep_mask,
)


def literal_algorithm_1(a, n, budget, n_first, eps):
    """Algorithm 1 for one head, written as in the paper (ties in ``a`` go to the larger ``n``)."""
    order = sorted(range(len(a)), key=lambda i: (-a[i], -n[i]))
    kept = order[:n_first]
    rest = sorted((i for i in range(len(a)) if i not in kept), key=lambda i: -(a[i] + eps) * n[i])
    return set(kept + rest[: budget - n_first])


def literal_critical_adakv(a, n, n_kept, alpha_safeguard, first_stage_ratio, eps):
    """AdaKV budgets + Algorithm 1 per head for one batch row (a, n: (H, T) lists)."""
    heads, k_len = len(a), len(a[0])
    n_safe = safeguard_budget(n_kept, alpha_safeguard)
    safe = [set(sorted(range(k_len), key=lambda i: (-a[h][i], -n[h][i]))[:n_safe]) for h in range(heads)]
    boosted = [(float("inf") if i in safe[h] else a[h][i], n[h][i], h, i) for h in range(heads) for i in range(k_len)]
    boosted.sort(key=lambda x: (-x[0], -x[1]))
    budgets = [0] * heads
    for _, _, h, _ in boosted[: n_kept * heads]:
        budgets[h] += 1
    kept = []
    for h in range(heads):
        n_first = max(n_safe, int(budgets[h] * first_stage_ratio))
        kept.append(literal_algorithm_1(a[h], n[h], budgets[h], n_first, eps))
    return kept, budgets


def random_scores(bsz, heads, k_len, seed, window=0):
    """Skewed attention-like scores; the last ``window`` entries tie at the top, like SnapKV's window."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(bsz, heads, k_len, generator=gen) ** 3
    if window:
        a[..., -window:] = 2.0
    n = torch.rand(bsz, heads, k_len, generator=gen) * 4 + 0.1
    return a, n


@pytest.mark.parametrize("k_len", [1, 2, 9, 64, 200])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("first_stage_ratio", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("window", [0, 8])
def test_critical_scores_topk_is_algorithm_1(k_len, ratio, first_stage_ratio, window):
    a, n = random_scores(2, 3, k_len, seed=k_len, window=min(window, k_len))
    n_kept = compute_n_kept(k_len, ratio)
    n_first = first_stage_budget(n_kept, first_stage_ratio)
    scores = critical_scores(a, n, n_first, 1e-4)
    assert scores.dtype == torch.float32
    top = scores.topk(n_kept, dim=-1).indices
    for b in range(2):
        for h in range(3):
            expected = literal_algorithm_1(a[b, h].tolist(), n[b, h].tolist(), n_kept, n_first, 1e-4)
            assert set(top[b, h].tolist()) == expected


def test_first_stage_budget_matches_kvpress_rounding():
    for k_len in range(1, 300):
        for ratio in (0.1, 0.25, 0.3, 0.5, 0.7, 0.875, 0.9):
            kvpress_budget = max(1, int((1 - ratio) * k_len * 0.5))  # kvpress CriticalKVPress.score
            assert first_stage_budget(compute_n_kept(k_len, ratio), 0.5) == kvpress_budget


@pytest.mark.parametrize("k_len", [3, 17, 128])
@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("alpha_safeguard", [0.0, 0.2, 1.0])
@pytest.mark.parametrize("first_stage_ratio", [0.0, 0.5])
@pytest.mark.parametrize("window", [0, 8])
def test_critical_adakv_keep_mask_is_literal_algorithm(k_len, ratio, alpha_safeguard, first_stage_ratio, window):
    bsz, heads = 3, 4
    a, n = random_scores(bsz, heads, k_len, seed=k_len + 7, window=min(window, k_len))
    n_kept = compute_n_kept(k_len, ratio)
    keep, stage1, budgets = critical_adakv_keep_mask(a, n, n_kept, alpha_safeguard, first_stage_ratio, 1e-4)
    assert keep.shape == (bsz, heads, k_len) and keep.dtype == torch.bool
    assert bool((stage1 <= keep).all()), "stage-1 entries must be kept"
    assert keep.view(bsz, -1).sum(-1).tolist() == [n_kept * heads] * bsz
    for b in range(bsz):
        expected, expected_budgets = literal_critical_adakv(
            a[b].tolist(), n[b].tolist(), n_kept, alpha_safeguard, first_stage_ratio, 1e-4
        )
        assert budgets[b].tolist() == expected_budgets
        for h in range(heads):
            assert set(keep[b, h].nonzero().flatten().tolist()) == expected[h]


def test_budgets_are_per_batch_row():
    """Each row's budgets depend on that row alone (kvpress's built-in sums them over the batch)."""
    a, _ = random_scores(4, 5, 50, seed=3)
    batched = adaptive_head_budgets(a, 20, 0.2)
    for b in range(4):
        assert torch.equal(batched[b], adaptive_head_budgets(a[b : b + 1], 20, 0.2)[0])
    assert batched.sum(-1).tolist() == [100] * 4
    assert bool((batched >= safeguard_budget(20, 0.2)).all())


def test_safeguard_guarantees_every_head_a_minimum():
    a = torch.zeros(1, 3, 40)
    a[0, 0] = torch.linspace(1, 2, 40)  # head 0 dominates every global ranking
    budgets = adaptive_head_budgets(a, 10, 0.2)
    assert budgets.tolist() == [[26, 2, 2]]  # 30 in total, 2 (= 0.2 * 10) guaranteed to the others


def test_equal_base_scores_go_to_the_larger_projected_norm():
    """SnapKV gives its whole observation window one score: stage 1 must prefer the larger N among them."""
    a = torch.tensor([[[0.1, 0.2, 0.0, 9.0, 9.0, 9.0, 9.0]]])
    n = torch.tensor([[[1.0, 1.0, 1.0, 0.5, 3.0, 1.0, 2.0]]])
    scores = critical_scores(a, n, n_first=2, epsilon=0.0)
    assert (scores == torch.finfo(torch.float32).max).nonzero()[:, -1].tolist() == [4, 6]
    keep, stage1, _ = critical_adakv_keep_mask(a, n, n_kept=3, alpha_safeguard=0.0, first_stage_ratio=0.5, epsilon=0)
    assert stage1[0, 0].nonzero().flatten().tolist() == [4]
    assert keep[0, 0].nonzero().flatten().tolist() == [4, 5, 6]  # then (A + eps) * N: 9.0 * 1.0 beats 0.2 * 1.0


def test_excluded_entries_are_never_kept_even_with_zero_norms():
    """(A = -inf) * (N = 0) is NaN, which sorts above every number: an excluded entry must still rank last."""
    gen = torch.Generator().manual_seed(0)
    base = torch.rand(2, 3, 20, generator=gen)
    norm = torch.rand(2, 3, 20, generator=gen)
    excluded = torch.zeros(2, 3, 20, dtype=torch.bool)
    excluded[..., :6] = True
    base = base.masked_fill(excluded, float("-inf"))
    norm[..., :3] = 0.0  # excluded, and a zero projected norm (a zero value vector, or padding)
    budgets = torch.full((2, 3), 10)
    keep, stage1 = two_stage_keep_mask(base, norm, budgets, torch.full((2, 3), 2), 1e-4)
    assert not bool((keep & excluded).any()) and bool((keep.sum(-1) == 10).all())
    scores = critical_scores(base, norm, 2, 1e-4)
    assert not bool(scores.isnan().any()) and bool((scores[excluded] == float("-inf")).all())
