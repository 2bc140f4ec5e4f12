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

import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "kvpress_"

# critical press -> the press it should be compared against (same base scores, no CriticalKV selection)
CRITICAL_BASES = {
    "critical_snapkv": "snapkv",
    "critical_adakv_snapkv": "adakv_snapkv",
    "critical_expected_attention": "expected_attention_no_vnorm",
    "critical_adakv_expected_attention": "adakv_expected_attention_no_vnorm",
}
CRITICAL_BASES.update({f"{name}_l2": base for name, base in list(CRITICAL_BASES.items())})
CRITICAL_BASES.update(
    {f"{BUILTIN_PREFIX}{name}": base for name, base in list(CRITICAL_BASES.items()) if not name.endswith("_l2")}
)

BASELINE = "no_press"


def our_presses() -> dict:
    """The presses this package adds to kvpress's registry, by name (fresh instances)."""
    from kvpress import AdaKVPress, ExpectedAttentionPress, SnapKVPress

    from kvpress_critical import CriticalAdaKVPress, CriticalKVPress

    presses = {
        "snapkv": SnapKVPress(),
        "adakv_snapkv": AdaKVPress(SnapKVPress()),
        # the scorer CriticalKV uses with ExpectedAttention: no value norm (CriticalKV brings its own)
        "expected_attention_no_vnorm": ExpectedAttentionPress(use_vnorm=False),
        "adakv_expected_attention_no_vnorm": AdaKVPress(ExpectedAttentionPress(use_vnorm=False)),
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
    return presses


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
