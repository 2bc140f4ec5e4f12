"""Argument checks shared by the presses: each failure names the problem and the fix."""

import logging

import kvpress
from kvpress import ExpectedAttentionPress, ScorerPress

from kvpress_critical.ops import NORMS
from kvpress_critical.ops.projected_norm import check_backend_name

logger = logging.getLogger(__name__)


def nested_presses(press) -> list:
    """``press`` and every press inside it (``press``, ``base_press``, ``presses``, ``prefilling_press``...)."""
    found, seen, stack = [], set(), [press]
    while stack:
        p = stack.pop()
        if p is None or id(p) in seen or not hasattr(p, "compress"):
            continue
        seen.add(id(p))
        found.append(p)
        for name in ("press", "base_press", "prefilling_press", "decoding_press", "presses"):
            child = getattr(p, name, None)
            stack.extend(child if isinstance(child, (list, tuple)) else [child])
    return found


def check_ratio(value, name: str = "compression_ratio") -> None:
    if not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(
            f"{name} must be a number in [0, 1) (the fraction of the KV cache to evict), got {value!r}; "
            "e.g. 0.5 keeps half of the cache"
        )


def check_fraction(value, name: str) -> None:
    if not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


# kvpress's own CriticalKV presses (a ScorerPress and an AdaKVPress), which apply the same selection
_BUILTIN_CRITICAL = tuple(
    getattr(kvpress, name) for name in ("CriticalKVPress", "CriticalAdaKVPress") if hasattr(kvpress, name)
)


def applies_criticalkv(press) -> bool:
    """
    Whether ``press`` already applies CriticalKV's two-stage selection.

    Presses of this package declare it with the class attribute ``applies_criticalkv = True`` (so this
    module needs to import none of them); kvpress's built-in CriticalKV presses are recognised by type.
    """
    return bool(getattr(type(press), "applies_criticalkv", False)) or isinstance(press, _BUILTIN_CRITICAL)


def check_inner_press(press, owner: str) -> None:
    if not isinstance(press, ScorerPress):
        hint = (
            " For head-wise budgets use CriticalAdaKVPress(SnapKVPress(...)) instead of wrapping an AdaKVPress."
            if type(press).__name__.endswith("AdaKVPress")
            else ""
        )
        raise TypeError(
            f"{owner} wraps a kvpress ScorerPress (a press with a score() method, e.g. SnapKVPress(0.5), "
            f"KnormPress(0.5), ExpectedAttentionPress(0.5, use_vnorm=False)); got {type(press).__name__}.{hint}"
        )
    if applies_criticalkv(press):
        raise TypeError(
            f"{owner} got {type(press).__module__}.{type(press).__name__} as its inner press, which already applies "
            "CriticalKV; CriticalKV is applied once. "
            f"Pass the base press directly, e.g. {owner}(SnapKVPress(0.5))."
        )
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
    check_backend_name(backend)
