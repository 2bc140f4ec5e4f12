"""Every supported family, GQA and MHA, batch 1 and 3, fp32 and bf16, several ratios, short and long contexts:
the presses run, keep the right number of entries per head, and always keep the stage-1 entries."""

import pytest
import torch
from helpers import FAMILIES, kept_masks, tiny_model
from kvpress import SnapKVPress

import kvpress_critical.presses.critical_adakv_press as adakv_module
import kvpress_critical.presses.critical_kv_press as kv_module
from kvpress_critical import CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.selection import compute_n_kept, first_stage_budget, safeguard_budget

CONTEXTS = {"long": 96, "short": 40}  # SnapKV's default window is 64


@pytest.fixture
def recorded_base_scores(monkeypatch):
    """Record, per layer, the base scores A the presses rank with."""
    records = {}

    def spy(press, layer, n_kept=None):
        scores = real(press, layer, n_kept)
        records[layer.module.layer_idx] = scores.clone()
        return scores

    real = kv_module.base_scores
    monkeypatch.setattr(kv_module, "base_scores", spy)
    monkeypatch.setattr(adakv_module, "base_scores", spy)
    return records


def assert_top_entries_kept(base: torch.Tensor, kept: torch.Tensor, n_first: int) -> None:
    """The top ``n_first`` entries of ``base`` are kept; with ties at the cut, enough of the tied ones are."""
    if n_first == 0:
        return
    threshold = base.sort(descending=True).values[n_first - 1]
    above = base > threshold
    assert bool(kept[above].all()), "an entry of stage 1 was evicted"
    assert int((kept & (base == threshold)).sum()) >= n_first - int(above.sum())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("num_kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("press_cls", [CriticalKVPress, CriticalAdaKVPress])
def test_matrix(family, num_kv_heads, bsz, dtype, press_cls, recorded_base_scores):
    model = tiny_model(family, num_kv_heads=num_kv_heads, dtype=dtype)
    for context, k_len in CONTEXTS.items():
        ids = torch.randint(0, 256, (bsz, k_len), generator=torch.Generator().manual_seed(k_len))
        for ratio in (0.0, 0.5, 0.9):
            recorded_base_scores.clear()
            masks = kept_masks(model, ids, press_cls(SnapKVPress(ratio)))
            n_kept = compute_n_kept(k_len, ratio)
            for layer, kept in enumerate(masks):
                where = f"{context} context, ratio {ratio}, layer {layer}"
                assert kept.shape == (bsz, num_kv_heads, k_len), where
                if ratio == 0:
                    assert bool(kept.all()), where
                    continue
                per_head = kept.sum(-1)  # (B, H_kv)
                if press_cls is CriticalKVPress:
                    assert bool((per_head == n_kept).all()), where
                else:
                    assert per_head.sum(-1).tolist() == [n_kept * num_kv_heads] * bsz, where
                    assert bool((per_head >= safeguard_budget(n_kept, 0.2)).all()), where
                base = recorded_base_scores[layer]
                assert base.dtype == torch.float32 and base.shape == kept.shape, where
                for b in range(bsz):
                    for h in range(num_kv_heads):
                        budget = int(per_head[b, h])
                        n_first = (
                            first_stage_budget(budget, 0.5)
                            if press_cls is CriticalKVPress
                            else max(safeguard_budget(n_kept, 0.2), int(budget * 0.5))
                        )
                        assert_top_entries_kept(base[b, h], kept[b, h], n_first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_scores_are_float32(dtype, monkeypatch):
    model = tiny_model("qwen2", dtype=dtype)
    press = CriticalKVPress(SnapKVPress(0.5))
    seen = []
    real_score = CriticalKVPress.score

    def spy(self, *args):
        scores = real_score(self, *args)
        seen.append(scores.dtype)
        return scores

    monkeypatch.setattr(CriticalKVPress, "score", spy)
    kept_masks(model, torch.randint(0, 256, (2, 100)), press)
    assert seen and all(d == torch.float32 for d in seen)
