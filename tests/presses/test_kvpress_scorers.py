"""Both critical presses around every ScorerPress kvpress exports (and AdaKVPress around CriticalKVPress).

The scorer list is discovered from kvpress itself, so a scorer added in a new kvpress release is tested
without editing this file. Scorers that load Hub assets in ``post_init_from_model`` (trained filters,
statistics, surrogate models) get stand-ins that build the same objects locally with random weights, the
way kvpress's own tests subclass them. Nothing is skipped silently: see ``NOT_WRAPPABLE`` and
``EAGER_ONLY`` for the two cases that are not the plain path, and why.
"""

import inspect
from dataclasses import dataclass

import kvpress
import pytest
import torch
from helpers import kept_masks, tiny_model
from kvpress import (
    AdaKVPress,
    CompactorPress,
    ExpectedAttentionStatsPress,
    KVzapPress,
    LagKVPress,
    LeverageScorePress,
    NonCausalAttnPress,
    ObservedAttentionPress,
    PyramidKVPress,
    QFilterPress,
    ScorerPress,
    SnapKVPress,
)
from kvpress.presses.kvzap_press import KVzapConfig, KVzapModel

from kvpress_critical import CriticalAdaKVPress, CriticalKVPress
from kvpress_critical.selection import compute_n_kept, safeguard_budget

K_LEN = 128
RATIOS = (0.25, 0.5, 0.8)


# ---- stand-ins for scorers whose post_init_from_model downloads from the Hub --------------------------------------


@dataclass
class LocalQFilterPress(QFilterPress):
    """QFilterPress with random filters instead of the ``nthngdy/<model>_qfilt`` Hub checkpoints."""

    def post_init_from_model(self, model):
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        gen = torch.Generator().manual_seed(1)
        filters = torch.randn(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, generator=gen)
        self.q_filters = filters.to(model.dtype)


@dataclass
class LocalStatsPress(ExpectedAttentionStatsPress):
    """ExpectedAttentionStatsPress with query statistics drawn locally instead of loaded from the Hub."""

    def post_init_from_model(self, model):
        if self.mu is None:
            cfg = model.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            gen = torch.Generator().manual_seed(2)
            shape = (cfg.num_hidden_layers, cfg.num_attention_heads, head_dim)
            self.mu = torch.randn(shape, generator=gen).to(model.dtype)
            factor = torch.randn(*shape, head_dim, generator=gen) / head_dim**0.5
            self.cov = (factor @ factor.transpose(-1, -2)).to(model.dtype)  # symmetric positive semi-definite


@dataclass
class LocalKVzapPress(KVzapPress):
    """KVzapPress with a randomly initialised linear surrogate instead of ``nvidia/KVzap-*`` from the Hub."""

    def post_init_from_model(self, model):
        cfg = model.config
        torch.manual_seed(3)
        self.kvzap_model = KVzapModel(
            KVzapConfig(
                input_dim=cfg.hidden_size,
                output_dim=cfg.num_key_value_heads,
                hidden_dim=None,
                n_modules=cfg.num_hidden_layers,
            )
        )


STAND_INS = {QFilterPress: LocalQFilterPress, ExpectedAttentionStatsPress: LocalStatsPress, KVzapPress: LocalKVzapPress}

# arguments that make each scorer do real work on a 128-token context (its defaults target long contexts)
KWARGS = {
    SnapKVPress: {"window_size": 16},
    PyramidKVPress: {"window_size": 16},
    LagKVPress: {"n_sink": 4, "lag_size": 16},
    CompactorPress: {"chunk_size": 32, "sketch_dimension": 16, "sink_size_start": 2, "sink_size_end": 2},
    NonCausalAttnPress: {"chunk_size": 32},
    LeverageScorePress: {"sketch_dimension": 16},
}

# kvpress's own CriticalKVPress is a ScorerPress too, but it already applies CriticalKV: wrapping it is refused
NOT_WRAPPABLE = {kvpress.CriticalKVPress: "already applies CriticalKV (refused with a TypeError, tested below)"}
# ObservedAttentionPress scores from the eager attention weights; head-wise presses need kvpress's attention patch,
# which eager attention does not have, so only the pruning CriticalKVPress can use it (tested below)
EAGER_ONLY = {ObservedAttentionPress}


def exported_scorers() -> list[type]:
    """Every ScorerPress subclass kvpress exports, except the abstract base."""
    classes = {getattr(kvpress, name) for name in kvpress.__all__}
    return sorted(
        (c for c in classes if inspect.isclass(c) and issubclass(c, ScorerPress) and c is not ScorerPress),
        key=lambda c: c.__name__,
    )


SCORERS = [c for c in exported_scorers() if c not in NOT_WRAPPABLE]


def make_scorer(cls, ratio):
    return STAND_INS.get(cls, cls)(compression_ratio=ratio, **KWARGS.get(cls, {}))


WRAPPERS = {
    "CriticalKV": lambda scorer: CriticalKVPress(scorer),
    "CriticalAdaKV": lambda scorer: CriticalAdaKVPress(scorer),
    "AdaKV(CriticalKV)": lambda scorer: AdaKVPress(CriticalKVPress(scorer)),
}


def check_counts(masks, wrapper: str, bsz: int, num_kv_heads: int, ratio: float) -> None:
    n_kept = compute_n_kept(K_LEN, ratio)
    for layer, kept in enumerate(masks):
        per_head = kept.sum(-1)  # (B, H_kv)
        where = f"layer {layer}, ratio {ratio}"
        assert kept.shape == (bsz, num_kv_heads, K_LEN), where
        if wrapper == "CriticalKV":
            assert bool((per_head == n_kept).all()), f"{where}: {per_head.tolist()} != {n_kept} per head"
        else:  # head-wise: the layer's budget is shared, every row masks exactly the same number of entries
            assert per_head.sum(-1).tolist() == [n_kept * num_kv_heads] * bsz, where
            if wrapper == "CriticalAdaKV":
                assert bool((per_head >= safeguard_budget(n_kept, 0.2)).all()), where


def test_every_exported_scorer_is_covered():
    """A scorer kvpress adds later is either tested here or listed with its reason."""
    assert set(exported_scorers()) == set(SCORERS) | set(NOT_WRAPPABLE)
    assert len(SCORERS) >= 18  # kvpress 0.5.5 exports 19 scorers besides its CriticalKVPress


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("scorer_cls", [c for c in SCORERS if c not in EAGER_ONLY], ids=lambda c: c.__name__)
def test_critical_presses_around_scorer(scorer_cls, wrapper):
    model = tiny_model("llama")
    num_kv_heads = model.config.num_key_value_heads
    for bsz in (1, 2):
        ids = torch.randint(0, 256, (bsz, K_LEN), generator=torch.Generator().manual_seed(bsz))
        for ratio in RATIOS:
            press = WRAPPERS[wrapper](make_scorer(scorer_cls, ratio))
            masks = kept_masks(model, ids, press)
            check_counts(masks, wrapper, bsz, num_kv_heads, ratio)


def test_kvzap_scores_are_not_contiguous():
    """The case of the original crash: KVzap's scores are a transposed view, and CriticalAdaKV must accept them."""
    model = tiny_model("llama")
    press = LocalKVzapPress(compression_ratio=0.2)
    press.post_init_from_model(model)
    module = model.model.layers[0].self_attn
    hidden = torch.randn(1, K_LEN, model.config.hidden_size)
    scores = press.score(module, hidden, None, None, None, {})
    assert not scores.is_contiguous()


@pytest.mark.parametrize("scorer_cls", sorted(EAGER_ONLY, key=lambda c: c.__name__), ids=lambda c: c.__name__)
def test_eager_only_scorers(scorer_cls):
    model = tiny_model("llama", attn_implementation="eager")
    for bsz in (1, 2):
        ids = torch.randint(0, 256, (bsz, K_LEN), generator=torch.Generator().manual_seed(bsz))
        for ratio in RATIOS:
            masks = kept_masks(model, ids, CriticalKVPress(make_scorer(scorer_cls, ratio)))
            check_counts(masks, "CriticalKV", bsz, model.config.num_key_value_heads, ratio)
    with pytest.raises(ValueError, match="eager"):
        kept_masks(model, ids, CriticalAdaKVPress(make_scorer(scorer_cls, 0.5)))


@pytest.mark.parametrize("press_cls", [CriticalKVPress, CriticalAdaKVPress])
def test_builtin_critical_press_is_refused(press_cls):
    with pytest.raises(TypeError, match="already applies CriticalKV"):
        press_cls(kvpress.CriticalKVPress(SnapKVPress(0.5)))
