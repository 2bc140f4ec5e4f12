"""Argument checks shared by the presses: each failure names the problem and the fix."""

import logging

from kvpress import ExpectedAttentionPress

from kvpress_critical.capabilities import critical_inner_refusal
from kvpress_critical.ops import NORMS, PROJECTED_VALUE_NORM

logger = logging.getLogger(__name__)


def check_ratio(value, name: str = "compression_ratio") -> None:
    if not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(
            f"{name} must be a number in [0, 1) (the fraction of the KV cache to evict), got {value!r}; "
            "e.g. 0.5 keeps half of the cache"
        )


def check_fraction(value, name: str) -> None:
    if not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def check_inner_press(press, owner: str) -> None:
    refusal = critical_inner_refusal(press, owner)
    if refusal is not None:
        raise TypeError(refusal)
    if isinstance(press, ExpectedAttentionPress) and press.use_vnorm:
        logger.warning(
            "%s: ExpectedAttentionPress(use_vnorm=True) already weighs scores by value norms; "
            "use ExpectedAttentionPress(..., use_vnorm=False) with CriticalKV",
            owner,
        )
    check_ratio(press.compression_ratio)


def check_common(press, owner: str, epsilon, first_stage_ratio, norm, backend) -> None:
    check_inner_press(press, owner)
    if not isinstance(epsilon, (int, float)) or epsilon < 0:
        raise ValueError(f"epsilon must be a non-negative number, got {epsilon!r} (default 1e-4)")
    check_fraction(first_stage_ratio, "first_stage_ratio")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    PROJECTED_VALUE_NORM.check_name(backend)
