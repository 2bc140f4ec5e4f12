"""The quality benchmark's data: facts planted in real prose (or generated filler), several questions per context.

Each context is a haystack — consecutive sentences of the Python Language Reference (``haystack="prose"``,
:mod:`kvpress_critical.data.text`) or generated filler sentences (``haystack="synthetic"``, the generator of the
RULER-style smoke data) — with planted facts for five RULER-like tasks, each asked by its own question:

- ``niah_multikey``: four needles "The special magic word for <key> is <value>.", one key asked;
- ``niah_multiquery``: two other keys of the same four needles asked together (both values);
- ``niah_multivalue``: one more key planted three times with three values, all asked;
- ``qa_two_hop``: "<person> keeps the <object> in the <building>." and "The <building> stands in <town>.", asked
  "In which town does <person> keep the <object>?" (two facts, far apart, must both survive);
- ``agg_frequency``: "The <committee> met in <town>." three times for one town and once for two others, asked which
  town it met in most often (aggregation over four sentences).

The questions of a context are independent rows sharing its ``context`` (kvpress's runner then prefills and
compresses the context once and answers every question on the same compressed cache, context-only compression as in
the paper). Values are single common words. Rows have kvpress's RULER
columns (scored by its RULER scorer: every answer must appear in the prediction, any of them for ``qa_*``) plus
``target`` (the canonical answer text, teacher-forced by :mod:`kvpress_critical.likelihood`) and ``context_id``.
Planted facts are verbatim in the context and their values do not occur anywhere else in it.
"""

from __future__ import annotations

import random
from typing import Sequence

import pandas as pd

from kvpress_critical.data import words
from kvpress_critical.data.ruler import LENGTH_TOLERANCE, _fit, _insert, _unique
from kvpress_critical.data.text import essay_sentence, prose_passage

QUALITY_TASKS = ("niah_multikey", "niah_multiquery", "niah_multivalue", "qa_two_hop", "agg_frequency")
HAYSTACKS = ("prose", "synthetic")
COLUMNS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens", "target", "context_id")
ANSWER_PREFIX = ""  # shared by every question of a context (kvpress's runner requires it): the model answers freely
MAX_NEW_TOKENS = 16  # a sentence such as "The garden committee met most often in Zelton." (about 12 tokens)

_VALUES = tuple(
    dict.fromkeys(
        """violin pelican lantern walnut compass saffron harbor orchid canoe glacier meadow falcon marble
        cinnamon tractor lighthouse avocado trumpet porcupine volcano mango kettle sapphire cactus peacock
        blizzard carousel jasmine dolphin pyramid""".split()
    )
)
_OBJECTS = ("old maps", "spare keys", "family letters", "violin case", "silver spoons", "tax records", "seed jars")
_BUILDINGS = ("granary", "boathouse", "clock tower", "chapel", "mill", "observatory", "bakery", "post office")
_COMMITTEES = ("garden committee", "chess club", "harbour board", "choir council", "lantern society")


def _words_in(text: str) -> set[str]:
    return {w.strip(".,;:!?\"'()").lower() for w in text.split()}


class _Context:
    """The planted facts and questions of one context, drawn from ``rng``."""

    def __init__(self, rng: random.Random, forbidden: set[str]):
        keys = _unique(lambda: f"{rng.choice(words.ADJECTIVES)} {rng.choice(words.NOUNS)}", 5)
        in_keys = {w for key in keys for w in key.split()}
        values = [v for v in _VALUES if v not in forbidden and v not in in_keys]
        rng.shuffle(values)
        self.values = values[:7]  # 4 single keys + 3 values of the multi-value key
        towns = _unique(lambda: rng.choice(words.TOWN_PREFIXES) + rng.choice(words.TOWN_SUFFIXES), 4)
        towns = [t for t in towns if t.lower() not in forbidden][:4]
        while len(towns) < 4:  # a town name happens to occur in the haystack: draw another
            town = rng.choice(words.TOWN_PREFIXES) + rng.choice(words.TOWN_SUFFIXES)
            if town.lower() not in forbidden and town not in towns:
                towns.append(town)
        person = f"{rng.choice(words.FIRST_NAMES)} {rng.choice(words.LAST_NAMES)}"
        thing, building, committee = rng.choice(_OBJECTS), rng.choice(_BUILDINGS), rng.choice(_COMMITTEES)
        v = self.values

        def needle(key: str, value: str) -> str:
            return f"The special magic word for {key} is {value}."

        self.facts = [needle(keys[i], v[i]) for i in range(4)] + [needle(keys[4], v[4 + j]) for j in range(3)]
        self.facts += [f"{person} keeps the {thing} in the {building}.", f"The {building} stands in {towns[0]}."]
        self.facts += [f"The {committee} met in {towns[1]}."] * 3
        self.facts += [f"The {committee} met in {towns[2]}.", f"The {committee} met in {towns[3]}."]

        # task -> (question, answers, target): the target is the answer in the needles' own words, teacher-forced;
        # only the spans in [[...]] (the answer words) are scored (kvpress_critical.likelihood)
        def says(key: str, value: str, lead: str = "The") -> str:
            return f"{lead} special magic word for {key} is [[{value}]]."

        self.questions = {
            "niah_multikey": (f"What is the special magic word for {keys[0]}?", [v[0]], says(keys[0], v[0])),
            "niah_multiquery": (
                f"What are the special magic words for {keys[1]} and for {keys[2]}?",
                [v[1], v[2]],
                f"{says(keys[1], v[1])} {says(keys[2], v[2])}",
            ),
            "niah_multivalue": (
                f"What are all the special magic words for {keys[4]}?",
                [v[4], v[5], v[6]],
                " ".join([says(keys[4], v[4]), says(keys[4], v[5], "Another"), says(keys[4], v[6], "Another")]),
            ),
            "qa_two_hop": (
                f"In which town does {person} keep the {thing}?",
                [towns[0]],
                f"{person} keeps the {thing} in the town of [[{towns[0]}]].",
            ),
            "agg_frequency": (
                f"In which town did the {committee} meet most often?",
                [towns[1]],
                f"The {committee} met most often in [[{towns[1]}]].",
            ),
        }


_INTRO = (
    "Below is a long text. Some facts have been inserted into it; memorize them, I will ask you about them "
    "afterwards.\n\n"
)


def _haystack(haystack: str, rng: random.Random, n: int) -> list[str]:
    if haystack == "prose":
        return prose_passage(rng, n)
    return [essay_sentence(rng) for _ in range(n)]


def _build(haystack: str, sample_seed: str, n: int, tasks: Sequence[str]) -> tuple[str, dict]:
    rng = random.Random(sample_seed)
    filler = _haystack(haystack, rng, n)
    planted = _Context(rng, forbidden=set().union(*(_words_in(s) for s in filler)) if filler else set())
    facts = list(planted.facts)
    rng.shuffle(facts)
    text = " ".join(_insert(filler, facts, rng))
    return _INTRO + text + "\n\n", {t: planted.questions[t] for t in tasks}


def generate_quality_dataset(
    tokenizer,
    context_length: int = 1024,
    n_contexts: int = 16,
    haystack: str = "prose",
    tasks: Sequence[str] | None = None,
    seed: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
    turns: bool = False,
) -> pd.DataFrame:
    """
    Contexts with planted facts and one question per task, offline and deterministic.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Measures lengths: ``context + question + answer_prefix`` (the longest question) lands in
        ``[(1 - LENGTH_TOLERANCE) * context_length, context_length]`` tokens.
    context_length : int, default=1024
    n_contexts : int, default=16
        Contexts; each gives ``len(tasks)`` rows.
    haystack : {"prose", "synthetic"}
        Real prose (the Python Language Reference) or generated filler sentences.
    tasks : sequence of str, optional
        Among :data:`QUALITY_TASKS` (default: all five).
    seed : int, default=0
    max_new_tokens : int, default=16
    turns : bool, default=False
        Ask a context's questions as the turns of one conversation, in the order of ``tasks`` (columns ``turn_idx``
        and ``n_turns``; :mod:`evaluation.multiturn`): each question after the earlier ones and their targets.

    Returns
    -------
    pandas.DataFrame
        Columns :data:`COLUMNS`; ``answer`` is a list of strings, ``target`` the teacher-forced answer text.
    """
    tasks = list(QUALITY_TASKS if tasks is None else tasks)
    unknown = sorted(set(tasks) - set(QUALITY_TASKS))
    if unknown:
        raise ValueError(f"unknown quality task(s) {unknown}; known tasks: {', '.join(QUALITY_TASKS)}")
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack must be one of {HAYSTACKS}, got {haystack!r}")
    if n_contexts < 1:
        raise ValueError(f"n_contexts must be positive, got {n_contexts}")

    def count(built) -> int:
        context, questions = built
        longest = max(len(tokenizer(q, add_special_tokens=False)["input_ids"]) for q, *_ in questions.values())
        return len(tokenizer(context + ANSWER_PREFIX, add_special_tokens=False)["input_ids"]) + longest

    lower = int((1 - LENGTH_TOLERANCE) * context_length)
    guess = max(8, context_length // 30)
    rows = []
    for index in range(n_contexts):
        sample_seed = f"kvpress-critical-quality/{haystack}/{seed}/{index}"

        def build(n: int, sample_seed: str = sample_seed):
            return _build(haystack, sample_seed, n, tasks)

        guess, (context, questions), n_tokens = _fit(build, count, context_length, 1, 1 << 20, guess)
        if n_tokens < lower:
            raise ValueError(f"context {index}: reached only {n_tokens} tokens for context_length={context_length}")
        for turn, (task, (question, answer, target)) in enumerate(questions.items()):
            rows.append(
                dict(
                    context=context,
                    question=question,
                    answer_prefix=ANSWER_PREFIX,
                    answer=list(answer),
                    task=task,
                    max_new_tokens=max_new_tokens,
                    target=target,
                    context_id=f"{haystack}-{seed}-{index}",
                    **(dict(turn_idx=turn, n_turns=len(questions)) if turns else {}),
                )
            )
    return pd.DataFrame(rows, columns=list(COLUMNS) + (["turn_idx", "n_turns"] if turns else []))
