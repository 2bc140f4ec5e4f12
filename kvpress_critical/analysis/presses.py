"""The presses compared by the analysis: a base press and its CriticalKV variant, per ratio and mode."""

from dataclasses import dataclass
from typing import Callable

from kvpress import AdaKVPress, BasePress, ScorerPress

from kvpress_critical.presses import (
    CriticalAdaKVPress,
    CriticalHeadKVPress,
    CriticalKVPress,
    DefensiveKVPress,
    HeadKVPress,
    LayerDefensiveKVPress,
)
from kvpress_critical.presses.catalogue import BASE_PRESSES

__all__ = ["MODES", "PressPair", "press_pairs"]

#: mode -> (base press, critical variant) built from a fresh base ScorerPress for each
MODES: dict[str, tuple[str, Callable[[ScorerPress], BasePress], str, Callable[[ScorerPress], BasePress]]] = {
    "kv": ("{base}", lambda press: press, "CriticalKV({base})", CriticalKVPress),
    "adakv": ("AdaKV({base})", AdaKVPress, "CriticalAdaKV({base})", CriticalAdaKVPress),
    # offline budgets from the head scores shipped for the model (or profiled: python -m kvpress_critical.head_scores)
    "headkv": ("HeadKV({base})", HeadKVPress, "CriticalHeadKV({base})", CriticalHeadKVPress),
    # the authors' follow-up against the press it improves on (its own window attention: the base press sets the ratio)
    "defensivekv": (
        "CriticalAdaKV({base})",
        CriticalAdaKVPress,
        "DefensiveKV",
        lambda press: DefensiveKVPress(compression_ratio=press.compression_ratio),
    ),
    "layer_defensivekv": (
        "DefensiveKV",
        lambda press: DefensiveKVPress(compression_ratio=press.compression_ratio),
        "LayerDefensiveKV",
        lambda press: LayerDefensiveKVPress(compression_ratio=press.compression_ratio),
    ),
}


@dataclass
class PressPair:
    """A base press and its critical variant at one compression ratio."""

    mode: str
    ratio: float
    base_name: str
    critical_name: str
    base: BasePress
    critical: BasePress

    def labelled(self) -> dict[str, BasePress]:
        """``{"<name>@<ratio>": press}`` for both presses."""
        return {label(self.base_name, self.ratio): self.base, label(self.critical_name, self.ratio): self.critical}


def label(name: str, ratio: float) -> str:
    """Key of one press at one ratio in results."""
    return f"{name}@{ratio:g}"


def press_pairs(
    base: str | Callable[[float], ScorerPress], ratios, modes=("kv", "adakv"), base_name: str | None = None
) -> list[PressPair]:
    """
    Base / critical pairs for every mode and ratio.

    Parameters
    ----------
    base : str or callable
        A name from :data:`kvpress_critical.presses.catalogue.BASE_PRESSES` (``"snapkv"``, ``"knorm"``,
        ``"expected_attention"``) or ``ratio -> ScorerPress``.
    ratios : iterable of float
        Compression ratios (fraction evicted).
    modes : iterable of str
        ``"kv"`` (base vs ``CriticalKVPress``), ``"adakv"`` (``AdaKVPress`` vs ``CriticalAdaKVPress``) and/or
        ``"headkv"`` (``HeadKVPress`` vs ``CriticalHeadKVPress``).
    base_name : str, optional
        Display name of the base press (default: its class name without ``Press``).
    """
    if isinstance(base, str):
        if base not in BASE_PRESSES:
            raise ValueError(f"unknown base press {base!r}; choose one of {sorted(BASE_PRESSES)}")
        factory = BASE_PRESSES[base]
    else:
        factory = base
    pairs = []
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {sorted(MODES)}")
        base_fmt, make_base, critical_fmt, make_critical = MODES[mode]
        for ratio in ratios:
            name = base_name or type(factory(ratio)).__name__.removesuffix("Press")
            pairs.append(
                PressPair(
                    mode=mode,
                    ratio=float(ratio),
                    base_name=base_fmt.format(base=name),
                    critical_name=critical_fmt.format(base=name),
                    base=make_base(factory(ratio)),
                    critical=make_critical(factory(ratio)),
                )
            )
    return pairs
