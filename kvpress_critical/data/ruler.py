"""
A deterministic, offline generator of RULER-style tasks in kvpress's RULER dataset format.

kvpress evaluates on RULER (Hsieh et al., 2024, arXiv 2404.06654) through the Hugging Face dataset
``simonjegou/ruler``, whose rows have the columns ``context, question, answer_prefix, answer, task,
max_new_tokens``, and scores predictions with string matching (``benchmarks/ruler/calculate_metrics.py``:
all answers must appear in the prediction, any one of them for the ``qa`` tasks). This module builds rows of
the same shape without any download, for any tokenizer and context length:

- ``niah_single_1..3``, ``niah_multikey_1..3``, ``niah_multivalue``, ``niah_multiquery``: needles
  ("One of the special magic numbers for <key> is: <value>.") hidden in a haystack of repeated noise,
  generated prose or distractor needles, with RULER's templates;
- ``vt``: variable tracking, a chain of five assignments hidden in noise;
- ``cwe``: common word extraction from a numbered list of words;
- ``fwe``: frequent word extraction from a Zipf-distributed coded text;
- ``qa_1`` (single hop) and ``qa_2`` (two hops): questions about invented towns, people and companies,
  answered by one or two of many short documents (RULER uses SQuAD and HotpotQA; those need a download).

Lengths are measured with the given tokenizer on ``context + question + answer_prefix`` (no special tokens,
no chat template) and land in ``[(1 - LENGTH_TOLERANCE) * context_length, context_length]``. Every answer
appears verbatim in its context. The same arguments give the same rows on every machine.

``save_ruler_dataset`` writes the rows as a local dataset folder that ``datasets.load_dataset(root,
data_dir=..., split="test")`` reads, which is exactly how kvpress's evaluation runner loads RULER.
"""

from __future__ import annotations

import json
import logging
import os
import random
import string
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Sequence

import pandas as pd

from kvpress_critical.data import words
from kvpress_critical.data.text import essay_sentence, noise_sentences

logger = logging.getLogger(__name__)

RULER_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
"""The 13 RULER tasks kvpress's RULER dataset holds, with the same names."""

COLUMNS = ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")
"""Columns of kvpress's RULER dataset, in order."""

MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
"""Generation budget per task family, as in kvpress's RULER dataset."""

LENGTH_TOLERANCE = 0.1
"""Samples are at most ``context_length`` tokens long and at least ``(1 - LENGTH_TOLERANCE)`` of it."""

PARQUET_NAME = "test-00000-of-00001.parquet"


class Sample(NamedTuple):
    """One row before it becomes a DataFrame row."""

    context: str
    question: str
    answer_prefix: str
    answer: list[str]


# ----------------------------------------------------------------------------------------------------------------
# Random building blocks
# ----------------------------------------------------------------------------------------------------------------


def _unique(draw: Callable[[], str], n: int, exclude: set[str] | None = None) -> list[str]:
    """``n`` distinct values of ``draw()`` that are not in ``exclude``."""
    seen = set(exclude or ())
    out: list[str] = []
    while len(out) < n:
        value = draw()
        if value not in seen:
            seen.add(value)
            out.append(value)
    return out


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(words.ADJECTIVES)}-{rng.choice(words.NOUNS)}"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _insert(haystack: list[str], items: list[str], rng: random.Random) -> list[str]:
    """Insert ``items`` (in their order) at random sentence boundaries of ``haystack``."""
    slots = sorted(rng.choices(range(len(haystack) + 1), k=len(items)))
    out = list(haystack)
    for offset, (slot, item) in enumerate(zip(slots, items)):
        out.insert(slot + offset, item)
    return out


def _enumerate_en(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


# ----------------------------------------------------------------------------------------------------------------
# Task builders: (rng, n) -> Sample, where n sizes the haystack (more n, more tokens)
# ----------------------------------------------------------------------------------------------------------------


class _NiahSpec(NamedTuple):
    haystack: str  # "noise", "essay" or "needle"
    key_type: str  # "words" or "uuids"
    value_type: str  # "numbers" or "uuids"
    n_keys: int = 1
    n_values: int = 1
    n_queries: int = 1


# As in RULER's synthetic.yaml
_NIAH_SPECS = {
    "niah_single_1": _NiahSpec("noise", "words", "numbers"),
    "niah_single_2": _NiahSpec("essay", "words", "numbers"),
    "niah_single_3": _NiahSpec("essay", "words", "uuids"),
    "niah_multikey_1": _NiahSpec("essay", "words", "numbers", n_keys=4),
    "niah_multikey_2": _NiahSpec("needle", "words", "numbers"),
    "niah_multikey_3": _NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": _NiahSpec("essay", "words", "numbers", n_values=4),
    "niah_multiquery": _NiahSpec("essay", "words", "numbers", n_keys=4, n_queries=4),
}


def _niah(spec: _NiahSpec, rng: random.Random, n: int) -> Sample:
    draw_key = (lambda: _uuid(rng)) if spec.key_type == "uuids" else (lambda: _word_key(rng))
    draw_value = (lambda: _uuid(rng)) if spec.value_type == "uuids" else (lambda: _number(rng))
    # a distractor needle is long (two uuids: ~50 tokens): n // 8 of them plus n % 8 short noise sentences
    # give the needle haystack a fine enough length granularity
    n_distractors = n // 8 if spec.haystack == "needle" else 0
    keys = _unique(draw_key, spec.n_keys + n_distractors)
    values = _unique(draw_value, spec.n_keys * spec.n_values + n_distractors)
    kind = spec.value_type

    def needle(key: str, value: str) -> str:
        return f"One of the special magic {kind} for {key} is: {value}."

    needles = [
        needle(key, values[k * spec.n_values + v])
        for k, key in enumerate(keys[: spec.n_keys])
        for v in range(spec.n_values)
    ]
    rng.shuffle(needles)
    if spec.haystack == "noise":
        haystack = noise_sentences(n)
    elif spec.haystack == "essay":
        haystack = [essay_sentence(rng) for _ in range(n)]
    else:
        first = spec.n_keys * spec.n_values
        haystack = [needle(key, values[first + i]) for i, key in enumerate(keys[spec.n_keys :])]
        haystack = _insert(haystack, noise_sentences(n % 8), rng)
    text = " ".join(_insert(haystack, needles, rng))

    queried = keys[: spec.n_queries]
    answer = [values[k * spec.n_values + v] for k in range(spec.n_queries) for v in range(spec.n_values)]
    query = _enumerate_en(queried)
    context = (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards.\n{text}\n"
    )
    question = f"What are all the special magic {kind} for {query} mentioned in the provided text? "
    answer_prefix = f"The special magic {kind} for {query} mentioned in the provided text are"
    return Sample(context, question, answer_prefix, answer)


def _vt(rng: random.Random, n: int, hops: int = 4) -> Sample:
    names = _unique(lambda: "".join(rng.choices(string.ascii_uppercase, k=5)), hops + 1)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[i]} = VAR {names[i - 1]}" for i in range(1, hops + 1)]
    text = " ".join(_insert(noise_sentences(n), chain, rng))
    context = f"Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{text}\n"
    question = f"Question: Find all variables that are assigned the value {value} in the text above. "
    answer_prefix = (
        f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
        f"are assigned the value {value}, they are: "
    )
    return Sample(context, question, answer_prefix, names)


_CWE_VOCABULARY = tuple(dict.fromkeys(words.NOUNS + words.VERBS + words.ADJECTIVES))


def _cwe(rng: random.Random, n: int, context_length: int, n_common: int = 10) -> Sample:
    # RULER at 4096 tokens: 10 common words 30 times each, the others 3 times; frequencies scale with the length
    freq_common = max(4, round(30 * context_length / 4096))
    freq_rare = max(1, round(3 * context_length / 4096))
    vocabulary = rng.sample(_CWE_VOCABULARY, min(len(_CWE_VOCABULARY), n_common + n))
    common, rare = vocabulary[:n_common], vocabulary[n_common:]
    items = common * freq_common + rare * freq_rare
    rng.shuffle(items)
    listing = "\n".join(f"{i + 1}. {word}" for i, word in enumerate(items))
    context = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        f"Memorize the ones that appear most often.\n{listing}\n"
    )
    question = "Question: What are the 10 most common words in the above list? "
    answer_prefix = "Answer: The top 10 words that appear most often in the list are:"
    return Sample(context, question, answer_prefix, common)


def _fwe(rng: random.Random, n: int, alpha: float = 2.0) -> Sample:
    vocabulary_size = max(10, n // 8)
    vocabulary = _unique(lambda: "".join(rng.choices(string.ascii_lowercase, k=5)), vocabulary_size)
    weights = [1.0 / (rank + 1) ** alpha for rank in range(vocabulary_size)]
    total = sum(weights)
    counts = [max(1, int(n * w / total)) for w in weights]
    counts[3:] = [min(c, counts[2] - 1) for c in counts[3:]]  # the top three stay strictly first
    tokens = [word for word, count in zip(vocabulary, counts) for _ in range(count)]
    rng.shuffle(tokens)
    pieces: list[str] = []
    while tokens:
        cut = rng.randint(4, 12)
        pieces.append(" ".join(tokens[:cut]))
        tokens = tokens[cut:]
    text = " .... ".join(pieces)
    context = (
        "Read the following coded text and track the frequency of each coded word. "
        f"Find the three most frequently appeared coded words. {text}\n"
    )
    question = (
        "Question: Do not provide any explanation. Please ignore the dots '....'. "
        "What are the three most frequently appeared words in the above coded text? "
    )
    answer_prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
    return Sample(context, question, answer_prefix, vocabulary[:3])


class _World:
    """Invented towns, people and companies, each the subject of at most one document."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.towns = [p + s for p in words.TOWN_PREFIXES for s in words.TOWN_SUFFIXES]
        self.people = [f"{f} {last}" for f in words.FIRST_NAMES for last in words.LAST_NAMES]
        self.companies = [f"{p} {s}" for p in words.COMPANY_PREFIXES for s in words.COMPANY_SUFFIXES]
        for pool in (self.towns, self.people, self.companies):
            rng.shuffle(pool)

    def take(self, kind: str) -> str:
        pool = {"town": self.towns, "person": self.people, "company": self.companies}[kind]
        if not pool:
            raise ValueError(f"the qa tasks ran out of invented {kind} names: use a shorter context_length")
        return pool.pop()

    def mention(self, kind: str) -> str:
        """A name used inside a document (not as its subject), possibly shared with other documents."""
        pool = {"town": self.towns, "person": self.people}[kind]
        if not pool:
            raise ValueError(f"the qa tasks ran out of invented {kind} names: use a shorter context_length")
        return self.rng.choice(pool)

    def town_doc(self, town: str, mayor: str | None = None) -> str:
        rng = self.rng
        mayor = mayor or self.mention("person")
        return (
            f"{town} is a town on the {rng.choice(words.RIVERS)} River. Its mayor is {mayor}, "
            f"and the town is best known for its {rng.choice(words.PRODUCTS)}."
        )

    def person_doc(self, person: str, town: str | None = None, job: str | None = None) -> str:
        rng = self.rng
        first = person.split()[0]
        return (
            f"{person} was born in {town or self.mention('town')} in {rng.randint(1850, 1990)}. "
            f"For most of their life, {first} worked as a {job or rng.choice(words.JOBS)}."
        )

    def company_doc(self, company: str, founder: str | None = None, product: str | None = None) -> str:
        rng = self.rng
        return (
            f"{company} is a company that makes {product or rng.choice(words.PRODUCTS)}. It was founded in "
            f"{rng.randint(1850, 1990)} by {founder or self.mention('person')}, and its offices are in "
            f"{self.mention('town')}."
        )

    def distractor(self) -> str:
        kind = self.rng.choice(("town", "person", "company"))
        subject = self.take(kind)
        return {"town": self.town_doc, "person": self.person_doc, "company": self.company_doc}[kind](subject)

    def short_distractor(self) -> str:
        """A one-line document (fine length adjustment)."""
        return f"{self.take('town')} lies on the {self.rng.choice(words.RIVERS)} River."


def _qa(rng: random.Random, n: int, hops: int, fine: bool = False) -> Sample:
    world = _World(rng)
    if hops == 1:
        kind = rng.choice(("mayor", "job", "founder", "product"))
        if kind == "mayor":
            town, mayor = world.take("town"), world.take("person")
            gold, query, answer = [world.town_doc(town, mayor=mayor)], f"Who is the mayor of {town}?", mayor
        elif kind == "job":
            person, job = world.take("person"), rng.choice(words.JOBS)
            gold, query, answer = [world.person_doc(person, job=job)], f"What was the job of {person}?", job
        else:
            company, founder, product = world.take("company"), world.take("person"), rng.choice(words.PRODUCTS)
            gold = [world.company_doc(company, founder=founder, product=product)]
            query, answer = (
                (f"Who founded {company}?", founder) if kind == "founder" else (f"What does {company} make?", product)
            )
    else:
        if rng.random() < 0.5:
            company, founder, town = world.take("company"), world.take("person"), world.take("town")
            gold = [world.company_doc(company, founder=founder), world.person_doc(founder, town=town)]
            query, answer = f"In which town was the founder of {company} born?", town
        else:
            person, town, mayor = world.take("person"), world.take("town"), world.take("person")
            gold = [world.person_doc(person, town=town), world.town_doc(town, mayor=mayor)]
            query, answer = f"Who is the mayor of the town where {person} was born?", mayor
    if fine:  # n // 3 documents plus n % 3 one-line ones: a fine enough length granularity for short contexts
        documents = [world.distractor() for _ in range(n // 3)] + [world.short_distractor() for _ in range(n % 3)]
        rng.shuffle(documents)
    else:
        documents = [world.distractor() for _ in range(n)]
    for doc in gold:  # each hop lands in its own random place
        documents = _insert(documents, [doc], rng)
    listing = "\n\n".join(f"Document {i + 1}:\n{doc}" for i, doc in enumerate(documents))
    instruction = (
        "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    )
    context = f"{instruction}\n\nThe following are given documents.\n\n{listing}\n\n"
    question = f"{instruction}\n\nQuestion: {query} "
    return Sample(context, question, "Answer:", [answer])


Builder = tuple[Callable[[random.Random, int], Sample], int, int]


def _builders(task: str, context_length: int) -> list[Builder]:
    """
    ``[(build(rng, n), smallest n, largest n), ...]`` for ``task``, tried in order until one reaches the length.

    The QA tasks first try whole documents only and fall back to adding one-line documents when whole ones
    are too coarse to land within the tolerance (short contexts).
    """
    unbounded = 1 << 30
    if task in _NIAH_SPECS:
        spec = _NIAH_SPECS[task]
        return [((lambda rng, n: _niah(spec, rng, n)), 1, unbounded)]
    if task == "vt":
        return [(_vt, 1, unbounded)]
    if task == "cwe":
        return [((lambda rng, n: _cwe(rng, n, context_length)), 1, len(_CWE_VOCABULARY) - 10)]
    if task == "fwe":
        return [(_fwe, 40, unbounded)]
    if task in ("qa_1", "qa_2"):
        hops = int(task[-1])
        return [
            ((lambda rng, n: _qa(rng, n, hops)), 0, unbounded),
            ((lambda rng, n: _qa(rng, n, hops, fine=True)), 0, unbounded),
        ]
    raise ValueError(f"unknown RULER task {task!r}; known tasks: {', '.join(RULER_TASKS)}")


# ----------------------------------------------------------------------------------------------------------------
# Length fitting and the public API
# ----------------------------------------------------------------------------------------------------------------


def _fit(
    build: Callable[[int], Sample], count: Callable[[Sample], int], target: int, n_min: int, n_max: int, guess: int
) -> tuple[int, Sample, int]:
    """The largest haystack size ``n`` in ``[n_min, n_max]`` whose sample has at most ``target`` tokens (bisection)."""
    cache: dict[int, tuple[Sample, int]] = {}

    def length(n: int) -> int:
        if n not in cache:
            sample = build(n)
            cache[n] = (sample, count(sample))
        return cache[n][1]

    if length(n_min) > target:
        raise ValueError(f"context_length={target} is too short for this task ({length(n_min)} tokens at minimum)")
    lo, hi = n_min, min(max(guess, n_min + 1), n_max)
    if length(hi) <= target:  # the guess fits: grow until too long (or the largest size)
        while length(hi) <= target and hi < n_max:
            lo, hi = hi, min(hi * 2, n_max)
        if length(hi) <= target:
            return hi, *cache[hi]
    else:  # the guess is too long: most samples of a task have similar sizes, look just below it
        probe = max(n_min, int(hi * 0.9))
        if length(probe) <= target:
            lo = probe
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if length(mid) <= target else (lo, mid)
    return lo, *cache[lo]


def _token_counter(tokenizer) -> Callable[[Sample], int]:
    def count(sample: Sample) -> int:
        text = sample.context + sample.question + sample.answer_prefix
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return count


def generate_ruler_dataset(
    tokenizer,
    context_length: int = 1024,
    n_samples: int = 10,
    tasks: Sequence[str] | None = None,
    seed: int = 0,
    max_new_tokens: Mapping[str, int] | None = None,
) -> pd.DataFrame:
    """
    Generate RULER-style samples in kvpress's RULER dataset format, offline and deterministically.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Measures the lengths (``context + question + answer_prefix``, without special tokens).
    context_length : int, default=1024
        Target length in tokens; every sample has between ``(1 - LENGTH_TOLERANCE) * context_length``
        and ``context_length`` tokens.
    n_samples : int, default=10
        Samples per task.
    tasks : sequence of str, optional
        Tasks to generate, among ``RULER_TASKS`` (default: all 13).
    seed : int, default=0
        Same seed, tokenizer and arguments: same rows.
    max_new_tokens : mapping, optional
        Generation budgets overriding ``MAX_NEW_TOKENS`` (kvpress's), keyed by task (``"niah_single_2"``) or
        task family (``"niah"``); the task name wins.

    Returns
    -------
    pandas.DataFrame
        Columns ``context, question, answer_prefix, answer (list of str), task, max_new_tokens``, grouped by
        task in the order given.
    """
    tasks = list(RULER_TASKS if tasks is None else tasks)
    unknown = sorted(set(tasks) - set(RULER_TASKS))
    if unknown:
        raise ValueError(f"unknown RULER task(s) {unknown}; known tasks: {', '.join(RULER_TASKS)}")
    if n_samples < 1:
        raise ValueError(f"n_samples must be positive, got {n_samples}")
    overrides = dict(max_new_tokens or {})
    unknown = sorted(set(overrides) - set(RULER_TASKS) - set(MAX_NEW_TOKENS))
    if unknown:
        raise ValueError(
            f"max_new_tokens keys {unknown} are neither tasks nor task families ({sorted(MAX_NEW_TOKENS)})"
        )
    count = _token_counter(tokenizer)
    lower = int((1 - LENGTH_TOLERANCE) * context_length)
    rows = []
    for task in tasks:
        builders = _builders(task, context_length)
        family = task.split("_")[0]
        budget = int(overrides.get(task, overrides.get(family, MAX_NEW_TOKENS[family])))
        guesses = [n_min + 16 for _, n_min, _ in builders]
        for index in range(n_samples):
            sample_seed = f"kvpress-critical-ruler/{seed}/{task}/{index}"
            for variant, (build_task, n_min, n_max) in enumerate(builders):

                def build(n: int, sample_seed: str = sample_seed, build_task=build_task) -> Sample:
                    return build_task(random.Random(sample_seed), n)

                guesses[variant], sample, n_tokens = _fit(build, count, context_length, n_min, n_max, guesses[variant])
                if n_tokens >= lower:
                    break
            else:
                raise ValueError(
                    f"{task} sample {index}: could only reach {n_tokens} tokens for context_length={context_length}"
                )
            rows.append(
                {
                    "context": sample.context,
                    "question": sample.question,
                    "answer_prefix": sample.answer_prefix,
                    "answer": list(sample.answer),
                    "task": task,
                    "max_new_tokens": budget,
                }
            )
    return pd.DataFrame(rows, columns=list(COLUMNS))


def save_ruler_dataset(df: pd.DataFrame, root: str | os.PathLike, data_dir: str, metadata: dict | None = None) -> Path:
    """
    Write ``df`` as the ``test`` split of ``root/data_dir``, a local dataset folder.

    ``datasets.load_dataset(str(root), data_dir=data_dir, split="test")`` reads it back (that is how kvpress's
    evaluation runner loads a dataset registered under the local path ``root``). The parquet file is written
    to a temporary name and renamed, so readers never see a partial file. ``metadata`` (e.g. the generation
    arguments) is stored next to it as ``root/<data_dir>.json``.

    Returns
    -------
    Path
        The parquet file written.
    """
    from datasets import Dataset

    missing = set(COLUMNS) - set(df.columns)
    if missing:
        raise ValueError(f"missing columns {sorted(missing)}; kvpress's RULER format needs {list(COLUMNS)}")
    folder = Path(root) / str(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / PARQUET_NAME
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".parquet", dir=folder)
    os.close(fd)
    try:
        columns = list(COLUMNS) + [c for c in df.columns if c not in COLUMNS]  # extra columns are kept, after
        Dataset.from_pandas(df[columns].reset_index(drop=True), preserve_index=False).to_parquet(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if metadata is not None:
        meta = Path(root) / f"{data_dir}.json"
        meta_tmp = meta.with_name(f".tmp-{meta.name}")
        meta_tmp.write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        os.replace(meta_tmp, meta)
    logger.info("saved %d RULER-style samples to %s", len(df), target)
    return target


def load_ruler_dataset(root: str | os.PathLike, data_dir: str) -> pd.DataFrame:
    """Read a folder written by ``save_ruler_dataset`` through ``datasets.load_dataset``, as kvpress does."""
    from datasets import load_dataset

    return load_dataset(str(root), data_dir=str(data_dir), split="test").to_pandas()
