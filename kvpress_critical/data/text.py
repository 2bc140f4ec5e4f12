"""Filler text for the offline datasets, the demo and the tests: one module for every kind of haystack.

- Real English prose, available offline everywhere: the Python Language Reference that ships with CPython. Every
  CPython installation carries ``pydoc_data.topics`` (what ``help("if")`` prints): the reference chapters on the
  language's statements, expressions and data model, written by people for people. On Python 3.11 it holds 79
  topics, 465 KB of text. :func:`prose_sentences` keeps its prose only: code examples, grammar productions, tables,
  headings and footnotes are dropped, paragraphs are re-joined and split into sentences, and sentences that are
  mostly punctuation or identifiers are left out. The result (about 2,300 sentences, ~80K tokens of SmolLM2) is the
  haystack of the quality benchmark (:mod:`kvpress_critical.data.quality`): natural text whose statistics a language
  model knows, unlike generated filler.
- Generated sentences from the word lists of :mod:`kvpress_critical.data.words`: :func:`essay_sentence` (RULER's
  "essay" haystack), :func:`noise_sentences` (RULER's repeated "noise"), and :func:`haystack_context` (short
  sentences around one needle, for tests and benchmarks that need a context of a given length).
"""

from __future__ import annotations

import functools
import random
import re

from kvpress_critical.data import words

SOURCE = "pydoc_data.topics (the Python Language Reference shipped with CPython)"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "cf.", "vs.", "Mr.", "Dr.", "No.")
_HEADING_RULE = re.compile(r"^[*=\-~^]{3,}\s*$")
_WORD = re.compile(r"[A-Za-z]{2,}")


def _paragraphs(text: str) -> list[str]:
    """Paragraphs of one topic (blank-line separated, lines re-joined), headings and table rules removed.

    Indentation is not a criterion: the reference indents whole method descriptions. Code, grammar productions and
    tables are removed sentence by sentence instead (:func:`_is_prose`).
    """
    paragraphs, current = [], []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        following = lines[i + 1].strip() if i + 1 < len(lines) else ""
        heading = bool(_HEADING_RULE.match(following)) or bool(_HEADING_RULE.match(stripped))
        if not stripped or heading or stripped.startswith(("+", "|", ">>>", "...")):
            if current:
                paragraphs.append(" ".join(current))
                current = []
            continue
        current.append(stripped.lstrip("* "))
    if current:
        paragraphs.append(" ".join(current))
    return paragraphs


def _split_sentences(paragraph: str) -> list[str]:
    """Sentences of a paragraph; a break after an abbreviation ("e.g.", "i.e."...) is not a sentence end."""
    sentences: list[str] = []
    for piece in _SENTENCE_END.split(paragraph):
        piece = piece.strip()
        if sentences and sentences[-1].endswith(_ABBREVIATIONS):
            sentences[-1] += " " + piece
        elif piece:
            sentences.append(piece)
    return sentences


def _is_prose(sentence: str) -> bool:
    words = _WORD.findall(sentence)
    if len(words) < 6 or len(sentence) > 400 or not sentence.endswith((".", "!", "?")):
        return False
    if "::" in sentence or " = " in sentence or "__" in sentence:
        return False
    symbols = sum(not (c.isalnum() or c.isspace() or c in ",.;:'\"()-") for c in sentence)
    return symbols <= 2 and sum(len(w) for w in words) >= 0.65 * len(sentence)


@functools.lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """Sentences of the Python Language Reference in document order (deterministic for a Python version)."""
    from pydoc_data.topics import topics

    sentences = []
    for name in sorted(topics):
        for paragraph in _paragraphs(topics[name]):
            sentences.extend(s for s in _split_sentences(paragraph) if _is_prose(s))
    return tuple(sentences)


def prose_passage(rng, n_sentences: int) -> list[str]:
    """``n_sentences`` consecutive sentences from a random place of the text (wrapping around at its end)."""
    sentences = prose_sentences()
    start = rng.randrange(len(sentences))
    return [sentences[(start + i) % len(sentences)] for i in range(n_sentences)]


def essay_sentence(rng: random.Random) -> str:
    """One sentence of RULER's "essay" haystack: subject, verb, object and ending drawn from the word lists."""
    return (
        f"{rng.choice(words.ESSAY_SUBJECTS)} {rng.choice(words.ESSAY_VERBS)} "
        f"{rng.choice(words.ESSAY_OBJECTS)} {rng.choice(words.ESSAY_ENDINGS)}."
    )


def noise_sentences(n: int) -> list[str]:
    """``n`` sentences of RULER's "noise" haystack (the same five sentences, repeated)."""
    return [words.NOISE_SENTENCES[i % len(words.NOISE_SENTENCES)] for i in range(n)]


# the short sentences of haystack_context: the first ten subjects, verbs and objects of the essay haystack
_SHORT = (words.ESSAY_SUBJECTS[:10], words.ESSAY_VERBS[:10], words.ESSAY_OBJECTS[:10])


def haystack_context(tokenizer, n_tokens: int, needle: str, depth: float = 0.5, seed: int = 0) -> str:
    """About ``n_tokens`` tokens of varied short sentences with ``needle`` inserted at ``depth`` (deterministic)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    while len(tokenizer(" ".join(sentences)).input_ids) < n_tokens:
        sentences.extend(" ".join(rng.choice(part) for part in _SHORT) + "." for _ in range(20))
    sentences.insert(int(len(sentences) * depth), needle)
    return " ".join(sentences)
