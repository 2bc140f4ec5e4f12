"""SCBench's multi-turn tasks (Li et al. 2025, arXiv 2412.10319) in kvpress's dataset columns, and their scoring.

The CriticalKV paper's multi-turn experiment (its appendix B.5) runs three SCBench tasks: Retr.KV (``scbench_kv``:
the value of a key in a large JSON object, 5 turns), Math.Find (``scbench_mf``: the largest, smallest... number of a
long list, 6 turns) and EN.QA (``scbench_qa_eng``: questions on a book, 7 turns). The public dataset
(``microsoft/SCBench`` on the Hugging Face Hub, one config per task, split ``test``) has one row per example:
``id``, ``context`` (a string; for Math.Find a list of integers) and ``multi_turns``, a list of ``{input, answer}``.

:func:`load_scbench` turns each example into one row per turn, in kvpress's columns: ``context`` (SCBench's
instruction and the context, shared by the turns, compressed once), ``question`` (the turn's question as SCBench
writes it), ``answer_prefix`` (empty), ``answer``, ``task``, ``max_new_tokens`` (SCBench's: 150, 5, 40), plus
``context_id``, ``turn_idx`` and ``n_turns``. The runner asks the turns in order as one conversation over the
compressed context (:class:`kvpress_critical.conversation.Conversation`), each turn after SCBench's golden previous
answer. Math.Find's "What is <the largest number>?" line, which SCBench puts before the context, goes at the start of
each turn's question instead, so that the context compressed once does not contain the first turn's question.

Scoring is SCBench's (its ``compute_scores.py``): Retr.KV, the label is a substring of the prediction
(case-sensitive); Math.Find, the first number of the prediction equals the label; EN.QA, a label is a substring of
the prediction, case-insensitive. :func:`calculate_metrics` (kvpress's scorer interface) is the mean over every
(example, turn), in percent; :func:`turn_scores` gives each row's score.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd

SOURCE = "microsoft/SCBench"
#: The tasks of the paper's appendix B.5: turn-1 template of the context (before the question), the question's
#: template, and SCBench's maximum of new tokens.
TASKS = {
    "scbench_kv": dict(
        context="Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n",
        question="{input}",
        max_new_tokens=150,
    ),
    "scbench_mf": dict(context="{context}\n\n", question="{prefix}\n\n{input}", max_new_tokens=5),
    "scbench_qa_eng": dict(
        context="Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n",
        question="Question: {input}\nAnswer:",
        max_new_tokens=40,
    ),
}
COLUMNS = (
    "context",
    "question",
    "answer_prefix",
    "answer",
    "task",
    "max_new_tokens",
    "context_id",
    "turn_idx",
    "n_turns",
)


def _records(task: str, source: str) -> list[dict]:
    """The examples of ``task`` from a local JSONL file, a folder holding ``<task>.jsonl`` (or ``data/...``), or the
    Hub dataset ``source``."""
    path = Path(source).expanduser()
    if path.suffix == ".jsonl" and path.is_file():
        files = [path]
    elif path.is_dir():
        files = [f for f in (path / f"{task}.jsonl", path / "data" / f"{task}.jsonl") if f.is_file()]
        if not files:
            raise FileNotFoundError(f"{path} holds neither {task}.jsonl nor data/{task}.jsonl (SCBench's layout)")
    else:
        from datasets import load_dataset

        try:
            data = load_dataset(source, task, split="test")
        except ValueError:  # the dataset's first versions named the split "train"
            data = load_dataset(source, task, split="train")
        return [dict(row) for row in data]
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


def _math_prefix(question: str) -> str:
    """SCBench's "What is <target>?" line of a Math.Find turn ("The largest number of the list is" -> "What is the
    largest number of the list?")."""
    found = re.findall(r"The .+ is", question)
    if not found:
        raise ValueError(f"a Math.Find question without 'The ... is': {question!r}")
    return f"What is {found[0].lower()[:-3]}?"


def _label(task: str, answer):
    """The label as SCBench's scorer takes it: an int (Math.Find), a list of strings (EN.QA), a string (Retr.KV)."""
    first = answer[0] if isinstance(answer, (list, tuple)) and answer else answer
    if task == "scbench_mf":
        return int(first)
    if task == "scbench_qa_eng":
        return [str(a) for a in answer] if isinstance(answer, (list, tuple)) else [str(answer)]
    return str(first)


def load_scbench(
    task: str, source: str = SOURCE, max_turns: int | None = None, n_samples: int | None = None
) -> pd.DataFrame:
    """
    One row per (example, turn) of an SCBench task, in kvpress's columns (module docstring).

    Parameters
    ----------
    task : {"scbench_kv", "scbench_mf", "scbench_qa_eng"}
    source : str
        The Hub dataset (default ``microsoft/SCBench``), or a local ``.jsonl`` file or folder in its format.
    max_turns : int, optional
        Keep the first turns of each example only.
    n_samples : int, optional
        Keep the first examples only.
    """
    if task not in TASKS:
        raise ValueError(f"unknown SCBench task {task!r}; the paper's multi-turn tasks are {sorted(TASKS)}")
    spec = TASKS[task]
    records = _records(task, source)[:n_samples]
    rows = []
    for example in records:
        context = example["context"]
        if task == "scbench_mf":  # a list of integers, written as SCBench's prompt does (a Python list literal)
            context = str([int(x) for x in context])
        turns = list(example["multi_turns"])[:max_turns]
        for turn_idx, turn in enumerate(turns):
            question = turn["input"]
            prefix = _math_prefix(question) if task == "scbench_mf" else ""
            rows.append(
                dict(
                    context=spec["context"].format(context=context),
                    question=spec["question"].format(input=question, prefix=prefix),
                    answer_prefix="",
                    answer=_label(task, turn["answer"]),
                    task=task,
                    max_new_tokens=spec["max_new_tokens"],
                    context_id=int(example["id"]),
                    turn_idx=turn_idx,
                    n_turns=len(turns),
                )
            )
    if not rows:
        raise ValueError(f"{source}: no example of {task}")
    return pd.DataFrame(rows, columns=list(COLUMNS))


def generate_scbench_dataset(tokenizer=None, task: str = "scbench_kv", **options) -> pd.DataFrame:
    """:func:`load_scbench` under the signature of the dataset generators (a preset's ``generate: {generator:
    scbench, task: ..., source: ..., max_turns: ...}``; the tokenizer is not needed: contexts are truncated to the
    model's ``max_context_length`` when the model runs)."""
    return load_scbench(task, **options)


def score(task: str, prediction: str, answer) -> float:
    """SCBench's score of one turn (1.0 or 0.0)."""
    prediction = "" if prediction is None or prediction != prediction else str(prediction)
    if task == "scbench_kv":
        return float(str(answer) in prediction)
    if task == "scbench_mf":
        label = answer[0] if isinstance(answer, (list, tuple, np.ndarray)) else answer
        found = re.search(r"\d+\.\d+|\d+", prediction)
        return float(found is not None and int(float(found.group(0))) == int(label))
    if task == "scbench_qa_eng":
        labels = list(answer) if isinstance(answer, (list, tuple, np.ndarray)) else [answer]
        return float(any(str(label).upper() in prediction.strip().upper() for label in labels))
    raise ValueError(f"unknown SCBench task {task!r}")


def turn_scores(df: pd.DataFrame) -> pd.Series:
    """Each row's score (``predicted_answer`` against ``answer``, by its ``task``)."""
    return pd.Series(
        [score(t, p, a) for t, p, a in zip(df["task"], df["predicted_answer"], df["answer"])], index=df.index
    )


def calculate_metrics(df: pd.DataFrame) -> float:
    """kvpress's scorer interface: the mean score over every (example, turn), in percent."""
    return float(100 * turn_scores(df).mean())
