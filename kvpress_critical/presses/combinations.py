"""Which press combines with which wrapper, layout and serving feature: the table of ``docs/presses.md``.

Every answer comes from :mod:`kvpress_critical.capabilities` (or, where kvpress itself refuses, from kvpress's rule):
:func:`answer` gives, for a row press and a column, ``None`` (it works) or the reason it is refused, which is the
message the combination raises when it is built, entered or run. :func:`markdown` writes the table;
``python -m kvpress_critical.presses.combinations`` prints it, ``--write docs/presses.md`` updates the page between
its ``combinations`` markers. ``tests/presses/test_combinations.py`` runs every cell on a tiny model and checks that
what happens is what the table says.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

import kvpress
from kvpress import (
    AdaKVPress,
    CAMPress,
    DecodingPress,
    ExpectedAttentionPress,
    KeyRerotationPress,
    KnormPress,
    PyramidKVPress,
    ScorerPress,
    SnapKVPress,
    StreamingLLMPress,
    ThinKPress,
)

from kvpress_critical.capabilities import (
    chunked_prefill_refusal,
    compact_refusal,
    conversation_refusal,
    critical_inner_refusal,
    padded_batch_refusal,
)
from kvpress_critical.presses.chunked_prefill_press import ChunkedPrefillPress
from kvpress_critical.presses.compact_cache_press import split_phases
from kvpress_critical.presses.critical_adakv_press import CriticalAdaKVPress
from kvpress_critical.presses.critical_headkv_press import CriticalHeadKVPress
from kvpress_critical.presses.critical_kv_press import CriticalKVPress
from kvpress_critical.presses.defensivekv_press import DefensiveKVPress
from kvpress_critical.presses.headkv_press import HeadKVPress
from kvpress_critical.presses.layer_defensivekv_press import LayerDefensiveKVPress

RATIO, WINDOW, CHUNK = 0.5, 8, 24  # small enough for the tests' tiny models


def _snap() -> SnapKVPress:
    return SnapKVPress(RATIO, window_size=WINDOW)


# row name -> factory (head scores for HeadKV's presses: None loads the embedded model's shipped scores)
ROWS: dict[str, Callable[..., kvpress.BasePress]] = {
    "SnapKVPress": lambda head_scores=None: _snap(),
    "KnormPress": lambda head_scores=None: KnormPress(RATIO),
    "StreamingLLMPress": lambda head_scores=None: StreamingLLMPress(RATIO),
    "ExpectedAttentionPress": lambda head_scores=None: ExpectedAttentionPress(RATIO, use_vnorm=False),
    "PyramidKVPress": lambda head_scores=None: PyramidKVPress(RATIO, window_size=WINDOW),
    "ThinKPress": lambda head_scores=None: ThinKPress(RATIO, window_size=WINDOW),
    "AdaKVPress(SnapKVPress)": lambda head_scores=None: AdaKVPress(_snap()),
    "KeyRerotationPress(SnapKVPress)": lambda head_scores=None: KeyRerotationPress(_snap()),
    "CriticalKVPress(SnapKVPress)": lambda head_scores=None: CriticalKVPress(_snap()),
    "CriticalAdaKVPress(SnapKVPress)": lambda head_scores=None: CriticalAdaKVPress(_snap()),
    "HeadKVPress(SnapKVPress)": lambda head_scores=None: HeadKVPress(_snap(), head_scores=head_scores),
    "CriticalHeadKVPress(SnapKVPress)": lambda head_scores=None: CriticalHeadKVPress(_snap(), head_scores=head_scores),
    "DefensiveKVPress": lambda head_scores=None: DefensiveKVPress(RATIO, window_size=WINDOW),
    "LayerDefensiveKVPress": lambda head_scores=None: LayerDefensiveKVPress(RATIO, window_size=WINDOW),
    "DecodingPress(KnormPress)": lambda head_scores=None: DecodingPress(
        base_press=KnormPress(), compression_interval=2, target_size=40
    ),
    "CAMPress(KnormPress)": lambda head_scores=None: CAMPress(
        base_press=KnormPress(), compression_interval=2, target_size=40
    ),
}


def decoding_base_refusal(press) -> str | None:
    """kvpress's own rule: ``DecodingPress`` takes a ``ScorerPress`` or an ``AdaKVPress`` as its base press."""
    if not isinstance(press, (ScorerPress, AdaKVPress)):
        return "DecodingPress requires a ScorerPress as input (kvpress's rule: a ScorerPress or an AdaKVPress)"
    return None


def _chunked_in_compact(press) -> str | None:
    return chunked_prefill_refusal(press) or compact_refusal(ChunkedPrefillPress(press, chunk_size=CHUNK))


def _decoding_in_compact(press) -> str | None:
    if decoding_base_refusal(press) is not None:
        return decoding_base_refusal(press)
    quiet = logging.getLogger("kvpress.presses.decoding_press")
    level, quiet.level = quiet.level, logging.ERROR  # kvpress warns that the base press's ratio is overridden
    try:
        return compact_refusal(DecodingPress(base_press=press, compression_interval=2, target_size=40))
    finally:
        quiet.level = level


# column name -> the reason a row press is refused there (None: it works)
COLUMNS: dict[str, Callable[[kvpress.BasePress], str | None]] = {
    "CompactCachePress(p)": compact_refusal,
    "padded batch, CompactCachePress(p)": lambda p: compact_refusal(p) or padded_batch_refusal(split_phases(p)[0]),
    "ChunkedPrefillPress(p)": chunked_prefill_refusal,
    "CompactCachePress(ChunkedPrefillPress(p))": _chunked_in_compact,
    "CompactCachePress(DecodingPress(base_press=p))": _decoding_in_compact,
    "Conversation(press=p)": conversation_refusal,
    "CriticalKVPress(p)": lambda p: critical_inner_refusal(p, "CriticalKVPress"),
}


def answer(row: str, column: str) -> str | None:
    """``None`` if the row's press works in the column's combination, else the reason it is refused."""
    return COLUMNS[column](ROWS[row]())


def markdown() -> str:
    """The table (one row per press, one column per combination; a refused cell refers to its reason), then the
    reasons, numbered."""
    header = ["press", *(f"`{c}`" for c in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    reasons: list[str] = []
    for row in ROWS:
        cells = []
        for column in COLUMNS:
            reason = answer(row, column)
            if reason is None:
                cells.append("yes")
                continue
            if reason not in reasons:
                reasons.append(reason)
            cells.append(f"no ({reasons.index(reason) + 1})")
        lines.append(f"| `{row}` | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"{i}. {reason}" for i, reason in enumerate(reasons, start=1)]
    return "\n".join(lines)


START, END = "<!-- combinations: generated by python -m kvpress_critical.presses.combinations -->", "<!-- end -->"


def write(page: Path) -> None:
    """Replace the table between ``page``'s markers by :func:`markdown`."""
    text = page.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{START}\n{markdown()}\n{END}{tail}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="update this page's table (between its combinations markers)")
    args = parser.parse_args(argv)
    if args.write is not None:
        write(args.write)
    else:
        print(markdown())


if __name__ == "__main__":
    main()
