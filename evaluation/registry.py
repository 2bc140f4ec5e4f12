"""
Our presses and local datasets, registered into kvpress's evaluation registry.

kvpress's ``evaluate.py`` does ``from evaluate_registry import PRESS_REGISTRY, ...``: it holds references
to the registry's dictionaries, so entries must be added to those very dictionaries (rebinding a name in
``evaluate_registry`` would not reach the runner). ``register`` mutates them in place.

The names below match kvpress's registry for the presses kvpress already has (``critical_snapkv``, ...):
ours replace them, and kvpress's built-in versions stay reachable with a ``kvpress_`` prefix
(``kvpress_critical_snapkv``...) for side-by-side comparisons. This module imports kvpress only when
``register`` or ``our_presses`` is called, so the aggregation can use ``CRITICAL_BASES`` without it.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from types import ModuleType

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "kvpress_"

# critical press -> the press it should be compared against (same base scores, no CriticalKV selection)
CRITICAL_BASES = {
    "critical_snapkv": "snapkv",
    "critical_adakv_snapkv": "adakv_snapkv",
    "critical_headkv_snapkv": "headkv_snapkv",
    "critical_expected_attention": "expected_attention_no_vnorm",
    "critical_adakv_expected_attention": "adakv_expected_attention_no_vnorm",
    "critical_headkv_expected_attention": "headkv_expected_attention_no_vnorm",
}
CRITICAL_BASES.update({f"{name}_l2": base for name, base in list(CRITICAL_BASES.items())})
CRITICAL_BASES.update(
    {
        f"{BUILTIN_PREFIX}{name}": base
        for name, base in list(CRITICAL_BASES.items())
        if not name.endswith("_l2") and "headkv" not in name  # kvpress has no HeadKV press
    }
)
# the authors' follow-up, compared with the press it improves on (the quality benchmark's paired comparisons)
FOLLOW_UPS = {"defensivekv": "critical_adakv_snapkv", "layer_defensivekv": "defensivekv"}
# head-wise presses with the compact layout (CompactCachePress): same selections, memory freed
HEAD_WISE = ("adakv_snapkv", "critical_adakv_snapkv", "headkv_snapkv", "critical_headkv_snapkv")
HEAD_WISE += ("defensivekv", "layer_defensivekv")
COMPACT_SUFFIX = "_compact"
CRITICAL_BASES.update(
    {name + COMPACT_SUFFIX: CRITICAL_BASES[name] + COMPACT_SUFFIX for name in HEAD_WISE if name in CRITICAL_BASES}
)
FOLLOW_UPS.update({f"{name}{COMPACT_SUFFIX}": f"{base}{COMPACT_SUFFIX}" for name, base in list(FOLLOW_UPS.items())})
# chunked prefill (ChunkedPrefillPress): any registered press with the chunk size in its name, registered on demand
CHUNKED = re.compile(r"^(?P<base>.+)_chunk(?P<size>\d+)$")


def chunked_name(name: str, chunk_size: int) -> str:
    """The registry name of ``name`` prefilled in chunks of ``chunk_size`` tokens (it lands in the results folder)."""
    return f"{name}_chunk{chunk_size}"


BASELINE = "no_press"


def our_presses() -> dict:
    """The presses this package adds to kvpress's registry, by name (fresh instances)."""
    from kvpress import AdaKVPress, ExpectedAttentionPress, SnapKVPress

    from kvpress_critical import (
        CompactCachePress,
        CriticalAdaKVPress,
        CriticalHeadKVPress,
        CriticalKVPress,
        DefensiveKVPress,
        HeadKVPress,
        LayerDefensiveKVPress,
    )

    presses = {
        "snapkv": SnapKVPress(),
        "adakv_snapkv": AdaKVPress(SnapKVPress()),
        # HeadKV's budgets need head scores: shipped for the embedded model, a preset's head_scores for others
        "headkv_snapkv": HeadKVPress(SnapKVPress()),
        # the scorer CriticalKV uses with ExpectedAttention: no value norm (CriticalKV brings its own)
        "expected_attention_no_vnorm": ExpectedAttentionPress(use_vnorm=False),
        "adakv_expected_attention_no_vnorm": AdaKVPress(ExpectedAttentionPress(use_vnorm=False)),
        "headkv_expected_attention_no_vnorm": HeadKVPress(ExpectedAttentionPress(use_vnorm=False)),
        "defensivekv": DefensiveKVPress(),
        "layer_defensivekv": LayerDefensiveKVPress(),
    }
    for norm, suffix in (("l1", ""), ("l2", "_l2")):
        presses[f"critical_snapkv{suffix}"] = CriticalKVPress(SnapKVPress(), norm=norm)
        presses[f"critical_adakv_snapkv{suffix}"] = CriticalAdaKVPress(SnapKVPress(), norm=norm)
        presses[f"critical_expected_attention{suffix}"] = CriticalKVPress(
            ExpectedAttentionPress(use_vnorm=False), norm=norm
        )
        presses[f"critical_adakv_expected_attention{suffix}"] = CriticalAdaKVPress(
            ExpectedAttentionPress(use_vnorm=False), norm=norm
        )
        presses[f"critical_headkv_snapkv{suffix}"] = CriticalHeadKVPress(SnapKVPress(), norm=norm)
        presses[f"critical_headkv_expected_attention{suffix}"] = CriticalHeadKVPress(
            ExpectedAttentionPress(use_vnorm=False), norm=norm
        )
    for name in HEAD_WISE:  # fresh inner presses: registry entries are singletons whose ratio the runner sets
        presses[f"{name}{COMPACT_SUFFIX}"] = CompactCachePress(copy.deepcopy(presses[name]))
    return presses


def ensure_press(registry: ModuleType, name: str) -> bool:
    """
    Whether ``name`` is in kvpress's registry, after registering it if it is a chunked variant of a registered press
    (``<press>_chunk<N>``: ``ChunkedPrefillPress(<press>, chunk_size=N)``, inside ``CompactCachePress`` for compact
    variants). Its comparison pairs are registered alongside.
    """
    presses = registry.PRESS_REGISTRY
    if name in presses:
        return True
    match = CHUNKED.match(name)
    if match is None or match["base"] not in presses:
        return False
    from kvpress_critical import CompactCachePress
    from kvpress_critical.presses.chunked_prefill_press import ChunkedPrefillPress

    base, size = presses[match["base"]], int(match["size"])
    if isinstance(base, CompactCachePress):
        press = CompactCachePress(ChunkedPrefillPress(copy.deepcopy(base.press), chunk_size=size), reserve=base.reserve)
    else:
        press = ChunkedPrefillPress(copy.deepcopy(base), chunk_size=size)
    presses[name] = press
    for pairs in (CRITICAL_BASES, FOLLOW_UPS):
        if match["base"] in pairs:
            pairs[name] = chunked_name(pairs[match["base"]], size)
    return True


def set_head_scores(press, head_scores) -> bool:
    """Give ``press`` (or the press it wraps) HeadKV head scores; returns whether it takes them."""
    target = press
    while target is not None and not hasattr(target, "head_scores"):
        target = getattr(target, "press", None)
    if target is None:
        return False
    target.head_scores = head_scores
    return True


def register(registry: ModuleType, datasets: dict[str, str | os.PathLike] | None = None) -> None:
    """
    Add our presses, and local datasets scored like RULER, to kvpress's ``evaluate_registry`` in place.

    Parameters
    ----------
    registry : module
        kvpress's ``evaluate_registry`` (see ``evaluation.kvpress_eval.import_kvpress_evaluation``).
    datasets : dict, optional
        ``{name: local folder}`` of RULER-format datasets (``kvpress_critical.data.save_ruler_dataset``);
        each is loaded by the runner through ``datasets.load_dataset(folder, data_dir=...)`` and scored by
        kvpress's RULER scorer.
    """
    press_registry = registry.PRESS_REGISTRY
    ours = our_presses()
    for name in ours:
        builtin = press_registry.get(name)
        if builtin is not None and name.startswith("critical_"):
            press_registry.setdefault(f"{BUILTIN_PREFIX}{name}", builtin)
    press_registry.update(ours)
    for name, folder in (datasets or {}).items():
        current = registry.DATASET_REGISTRY.get(name)
        if current is not None and current != str(folder) and not os.path.isabs(current):
            raise ValueError(f"dataset name {name!r} is kvpress's own ({current}); give the local dataset another name")
        registry.DATASET_REGISTRY[name] = str(folder)
        registry.SCORER_REGISTRY[name] = registry.SCORER_REGISTRY["ruler"]
    logger.debug("registered %d presses and datasets %s", len(ours), sorted(datasets or {}))
