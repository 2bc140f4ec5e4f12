"""
Our presses and local datasets, registered into kvpress's evaluation registry.

kvpress's ``evaluate.py`` does ``from evaluate_registry import PRESS_REGISTRY, ...``: it holds references
to the registry's dictionaries, so entries must be added to those very dictionaries (rebinding a name in
``evaluate_registry`` would not reach the runner). ``register`` mutates them in place.

The names below match kvpress's registry for the presses kvpress already has (``critical_snapkv``, ...):
ours replace them, and kvpress's built-in versions stay reachable with a ``kvpress_`` prefix
(``kvpress_critical_snapkv``...) for side-by-side comparisons. This module imports kvpress only when
``register`` or ``our_presses`` is called, so the aggregation can pair presses (:func:`critical_base`) without it.
Nothing here changes after import: the pairs are constants, their variants (L2, compact, chunked, kvpress's own) are
resolved from the names.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from types import MappingProxyType, ModuleType

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "kvpress_"
COMPACT_SUFFIX = "_compact"
L2_SUFFIX = "_l2"
BASELINE = "no_press"
# chunked prefill (ChunkedPrefillPress): any registered press with the chunk size in its name, registered on demand
CHUNKED = re.compile(r"^(?P<base>.+)_chunk(?P<size>\d+)$")

# press parameters set from a name suffix (``critical_adakv_snapkv_alpha0.2``, ``snapkv_window256_kernel1``): the
# suffix names the variant in the results folder, the press's repr in config.yaml shows the value.
# suffix -> (attribute set on every press inside that has it, type, whether the critical press alone owns it)
PARAMETERS = MappingProxyType(
    {
        "alpha": ("first_stage_ratio", float, True),  # CriticalKV's first-stage ratio (the paper's alpha)
        "window": ("window_size", int, False),  # the scorer's observation window (SnapKV, PyramidKV...)
        "kernel": ("kernel_size", int, False),  # the scorer's pooling kernel (1: none)
    }
)
VARIANT = re.compile(r"^(?P<base>.+)_(?P<key>" + "|".join(PARAMETERS) + r")(?P<value>\d+(?:\.\d+)?)$")
# kvpress's presses whose size is a head compression ratio (the sweep's ratio is passed as head_compression_ratio)
HEAD_RATIO_PRESSES = frozenset({"duo_attention", "duo_attention_on_the_fly", f"{BUILTIN_PREFIX}duo_attention"})

# critical press -> the press it is compared against (same base scores, no CriticalKV selection); the L2, compact,
# chunked and kvpress-built-in variants follow from these by name (critical_base)
CRITICAL_BASES = MappingProxyType(
    {
        "critical_snapkv": "snapkv",
        "critical_adakv_snapkv": "adakv_snapkv",
        "critical_headkv_snapkv": "headkv_snapkv",
        "critical_expected_attention": "expected_attention_no_vnorm",
        "critical_adakv_expected_attention": "adakv_expected_attention_no_vnorm",
        "critical_headkv_expected_attention": "headkv_expected_attention_no_vnorm",
    }
)
# the authors' follow-up, compared with the press it improves on (the quality benchmark's paired comparisons)
FOLLOW_UPS = MappingProxyType({"defensivekv": "critical_adakv_snapkv", "layer_defensivekv": "defensivekv"})


def chunked_name(name: str, chunk_size: int) -> str:
    """The registry name of ``name`` prefilled in chunks of ``chunk_size`` tokens (it lands in the results folder)."""
    return f"{name}_chunk{chunk_size}"


def variant_name(press: str, **parameters) -> str:
    """
    The registry name of ``press`` with ``parameters`` set (attribute names: ``first_stage_ratio``, ``window_size``,
    ``kernel_size``; ``norm="l2"`` picks the ``_l2`` press): ``variant_name("snapkv", window_size=256,
    kernel_size=1) == "snapkv_window256_kernel1"``.
    """
    by_attribute = {attribute: key for key, (attribute, _, _) in PARAMETERS.items()}
    name = press
    norm = parameters.pop("norm", None)
    if norm not in (None, "l1", "l2"):
        raise ValueError(f"{press}: norm must be 'l1' or 'l2', got {norm!r}")
    if norm == "l2":  # the L2 presses are registered as <press>_l2 (and <press>_l2_compact)
        compact = name.endswith(COMPACT_SUFFIX)
        name = name.removesuffix(COMPACT_SUFFIX) + L2_SUFFIX + (COMPACT_SUFFIX if compact else "")
    unknown = sorted(set(parameters) - set(by_attribute))
    if unknown:
        raise ValueError(f"{press}: unknown press parameter(s) {unknown}; known: norm, {', '.join(by_attribute)}")
    for attribute in by_attribute:  # one canonical order: one name per variant
        if attribute in parameters:
            key = by_attribute[attribute]
            value = PARAMETERS[key][1](parameters[attribute])
            if value < 0:
                raise ValueError(f"{press}: {attribute} must be >= 0, got {value}")
            name += f"_{key}{value:g}" if isinstance(value, float) else f"_{key}{value}"
    return name


def _paired(name: str, pairs, variants: bool) -> str | None:
    match = VARIANT.match(name)
    if match is not None:  # a parameter of the critical press alone disappears from its base's name
        base = _paired(match["base"], pairs, variants)
        if base is None or PARAMETERS[match["key"]][2]:
            return base
        return f"{base}_{match['key']}{match['value']}"
    match = CHUNKED.match(name)
    if match is not None:
        base = _paired(match["base"], pairs, variants)
        return None if base is None else chunked_name(base, int(match["size"]))
    if name.endswith(COMPACT_SUFFIX):
        base = _paired(name.removesuffix(COMPACT_SUFFIX), pairs, variants)
        return None if base is None else base + COMPACT_SUFFIX
    if variants and name.startswith(BUILTIN_PREFIX):  # kvpress's own critical presses (no L2, no HeadKV)
        stem = name.removeprefix(BUILTIN_PREFIX)
        return None if stem.endswith(L2_SUFFIX) or "headkv" in stem else pairs.get(stem)
    if variants and name.endswith(L2_SUFFIX):
        return pairs.get(name.removesuffix(L2_SUFFIX))
    return pairs.get(name)


def critical_base(name: str) -> str | None:
    """The press a CriticalKV press ``name`` is compared against (None: ``name`` is not a critical press)."""
    return _paired(name, CRITICAL_BASES, variants=True)


def follow_up_base(name: str) -> str | None:
    """The press a follow-up press (DefensiveKV, Layer-DefensiveKV) is compared against, or None."""
    return _paired(name, FOLLOW_UPS, variants=False)


def comparison_pairs(names) -> dict[str, str]:
    """``{press: the press it is compared against}`` for the presses among ``names`` that have one."""
    pairs = {}
    for name in names:
        base = critical_base(name) or follow_up_base(name)
        if base is not None and name != BASELINE:
            pairs[name] = base
    return pairs


def our_presses() -> dict:
    """The presses this package adds to kvpress's registry, by name (fresh instances)."""
    from kvpress import AdaKVPress, ExpectedAttentionPress, SnapKVPress

    from evaluation.duo_attention import DuoAttentionPatternPress
    from kvpress_critical import (
        CompactCachePress,
        CriticalAdaKVPress,
        CriticalHeadKVPress,
        CriticalKVPress,
        DefensiveKVPress,
        HeadKVPress,
        LayerDefensiveKVPress,
    )
    from kvpress_critical.capabilities import supports_compact

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
        # kvpress's, with Llama-3.1's current name and a local pattern folder ($KVPRESS_DUO_PATTERNS)
        "duo_attention": DuoAttentionPatternPress(),
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
    # a compact variant of every press whose selection the compact layout frees (head-wise presses); fresh inner
    # presses: registry entries are singletons whose ratio the runner sets
    for name, press in list(presses.items()):
        if supports_compact(press):
            presses[f"{name}{COMPACT_SUFFIX}"] = CompactCachePress(copy.deepcopy(press))
    return presses


def set_parameter(press, attribute: str, value) -> list:
    """Set ``attribute`` on every press inside ``press`` that has it; returns those presses (empty: none has it)."""
    from kvpress_critical.capabilities import nested_presses

    targets = [p for p in nested_presses(press) if attribute in getattr(p, "__dataclass_fields__", {})]
    for target in targets:
        setattr(target, attribute, value)
    return targets


def ensure_press(registry: ModuleType, name: str) -> bool:
    """
    Whether ``name`` is in kvpress's registry, after registering it if it is a variant of a registered press: a
    parameter suffix (``<press>_alpha0.2``, ``_window256``, ``_kernel1``: :data:`PARAMETERS`, a copy of the press
    with that parameter set) or a chunked prefill (``<press>_chunk<N>``: ``ChunkedPrefillPress(<press>,
    chunk_size=N)``, inside ``CompactCachePress`` for compact variants). Its comparison pair follows from the name
    (:func:`critical_base`). A parameter no press inside has raises ``ValueError``.
    """
    presses = registry.PRESS_REGISTRY
    if name in presses:
        return True
    variant = VARIANT.match(name)
    if variant is not None:
        if not ensure_press(registry, variant["base"]):
            return False
        attribute, kind, _ = PARAMETERS[variant["key"]]
        press = copy.deepcopy(presses[variant["base"]])
        if not set_parameter(press, attribute, kind(variant["value"])):
            raise ValueError(
                f"press {name!r}: {variant['base']} ({type(press).__name__}) has no {attribute} to set from the "
                f"suffix _{variant['key']}"
            )
        presses[name] = press
        return True
    match = CHUNKED.match(name)
    if match is None or not ensure_press(registry, match["base"]):
        return False
    from kvpress_critical import CompactCachePress
    from kvpress_critical.presses.chunked_prefill_press import ChunkedPrefillPress

    base, size = presses[match["base"]], int(match["size"])
    if isinstance(base, CompactCachePress):
        press = CompactCachePress(
            ChunkedPrefillPress(copy.deepcopy(base.press), chunk_size=size),
            reserve=base.reserve,
            quantize=base.quantize,
        )
    else:
        press = ChunkedPrefillPress(copy.deepcopy(base), chunk_size=size)
    presses[name] = press
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


def register(
    registry: ModuleType,
    datasets: dict[str, str | os.PathLike] | None = None,
    scorers: dict[str, str] | None = None,
) -> None:
    """
    Add our presses, and local datasets, to kvpress's ``evaluate_registry`` in place.

    Parameters
    ----------
    registry : module
        kvpress's ``evaluate_registry`` (see ``evaluation.kvpress_eval.import_kvpress_evaluation``).
    datasets : dict, optional
        ``{name: local folder}`` of datasets in kvpress's columns (``kvpress_critical.data.save_ruler_dataset``);
        each is loaded by the runner through ``datasets.load_dataset(folder, data_dir=...)``.
    scorers : dict, optional
        ``{name: scorer}`` for those datasets: ``"ruler"`` (kvpress's RULER scorer, the default) or ``"scbench"``
        (:func:`kvpress_critical.data.scbench.calculate_metrics`).
    """
    press_registry = registry.PRESS_REGISTRY
    ours = our_presses()
    for name in ours:
        builtin = press_registry.get(name)
        if builtin is not None and (name.startswith("critical_") or name == "duo_attention"):
            press_registry.setdefault(f"{BUILTIN_PREFIX}{name}", builtin)
    press_registry.update(ours)
    for name, folder in (datasets or {}).items():
        current = registry.DATASET_REGISTRY.get(name)
        if current is not None and current != str(folder) and not os.path.isabs(current):
            raise ValueError(f"dataset name {name!r} is kvpress's own ({current}); give the local dataset another name")
        registry.DATASET_REGISTRY[name] = str(folder)
        scorer = (scorers or {}).get(name, "ruler")
        if scorer == "scbench":
            from kvpress_critical.data.scbench import calculate_metrics

            registry.SCORER_REGISTRY[name] = calculate_metrics
        elif scorer == "ruler":
            registry.SCORER_REGISTRY[name] = registry.SCORER_REGISTRY["ruler"]
        else:
            raise ValueError(f"dataset {name!r}: unknown scorer {scorer!r} (ruler or scbench)")
    logger.debug("registered %d presses and datasets %s", len(ours), sorted(datasets or {}))
