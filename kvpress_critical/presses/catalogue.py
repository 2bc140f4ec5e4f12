"""The base presses CriticalKV is paired with, by name: what the demo and the perturbation analysis compare.

Each entry builds a fresh kvpress ``ScorerPress`` at a compression ratio. ExpectedAttention is taken without its own
value-norm weighting (``use_vnorm=False``): CriticalKV brings the projected-value norm itself.
"""

from kvpress import ExpectedAttentionPress, KnormPress, SnapKVPress

BASE_PRESSES = {
    "snapkv": lambda ratio: SnapKVPress(ratio),
    "expected_attention": lambda ratio: ExpectedAttentionPress(ratio, use_vnorm=False),
    "knorm": lambda ratio: KnormPress(ratio),
}

__all__ = ["BASE_PRESSES"]
