"""The inputs of the analysis: a context, the question asked after it, and a reference answer.

Text rows (kvpress's evaluation format: ``context``, ``question``, ``answer_prefix``, ``answer``) are
tokenized exactly as kvpress's ``"kv-press-text-generation"`` pipeline does (chat template, the question
suffix and answer prefix appended to the question), so the context compressed here is the one the
pipeline compresses. The question is never seen while compressing.
"""

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch
from kvpress.pipeline import KVPressTextGenerationPipeline

__all__ = ["Sample", "load_rows", "samples_from_rows"]


@dataclass
class Sample:
    """
    One analysis input, batch size 1.

    Attributes
    ----------
    context_ids : torch.Tensor
        ``(1, T)`` the compressed part.
    question_ids : torch.Tensor
        ``(1, Q)`` question, template suffix and answer prefix (never compressed).
    answer_ids : torch.Tensor or None
        ``(1, A)`` reference answer, teacher-forced; None to use the full-cache greedy answer.
    name : str
        Label (task and row index) for reports.
    """

    context_ids: torch.Tensor
    question_ids: torch.Tensor
    answer_ids: torch.Tensor | None = None
    name: str = ""


def _first_answer(answer) -> str | None:
    if answer is None or (isinstance(answer, float) and pd.isna(answer)):
        return None
    if isinstance(answer, str):
        return answer
    answers = [a for a in list(answer) if isinstance(a, str) and a]
    return answers[0] if answers else None


def samples_from_rows(
    rows: pd.DataFrame,
    tokenizer,
    max_answer_tokens: int = 16,
    max_context_length: int | None = None,
    query_aware: bool = False,
) -> list[Sample]:
    """
    Tokenize text rows with kvpress's pipeline preprocessing.

    Parameters
    ----------
    rows : pandas.DataFrame
        Columns ``context`` and ``question``; optional ``answer_prefix``, ``answer`` (str or list of str,
        the first is used) and ``task``.
    tokenizer : transformers.PreTrainedTokenizerBase
        The model's tokenizer.
    max_answer_tokens : int
        Teacher-forced answer tokens kept per sample.
    max_context_length : int, optional
        Truncate contexts to this many tokens (the pipeline's ``max_context_length``).
    query_aware : bool
        Append the question to the context, so that it is compressed with it (and sits in SnapKV's
        observation window, as in the paper's perturbation experiments); only the template suffix and
        the answer prefix follow the compressed part. Default: context-only compression (kvpress).
    """
    # KVPressTextGenerationPipeline.preprocess only reads self.tokenizer
    pipe = SimpleNamespace(tokenizer=tokenizer)
    max_context_length = max_context_length or min(tokenizer.model_max_length, int(1e10))
    samples = []
    for idx, row in enumerate(rows.to_dict("records")):
        prefix = row.get("answer_prefix") or ""
        prefix = "" if isinstance(prefix, float) else prefix
        context, question = row["context"], row["question"]
        if query_aware:
            context, question = f"{context}\n{question}", ""
        encoded = KVPressTextGenerationPipeline.preprocess(pipe, context, [question], prefix, max_context_length)
        answer = _first_answer(row.get("answer"))
        answer_ids = None
        if answer is not None:
            if prefix and not prefix[-1].isspace() and not answer[:1].isspace():
                answer = " " + answer  # the answer continues the prefix as a new word
            ids = tokenizer.encode(answer, add_special_tokens=False)[:max_answer_tokens]
            answer_ids = torch.tensor([ids]) if ids else None
        task = row.get("task", "sample")
        samples.append(
            Sample(
                context_ids=encoded["context_ids"],
                question_ids=encoded["questions_ids"][0],
                answer_ids=answer_ids,
                name=f"{task}/{idx}",
            )
        )
    return samples


def load_rows(
    data: str, tokenizer, context_length: int = 1024, n_samples: int = 2, tasks=None, seed: int = 0
) -> pd.DataFrame:
    """
    Text rows for ``data``: ``"smoke"`` (the offline RULER-style generator) or a file path.

    Parameters
    ----------
    data : str
        ``"smoke"``, or a ``.parquet``, ``.jsonl``, ``.json`` or ``.csv`` file with at least the columns
        ``context`` and ``question``.
    tokenizer : transformers.PreTrainedTokenizerBase
        Used by the generator to size contexts.
    context_length, n_samples, tasks, seed
        Passed to ``generate_ruler_dataset`` for ``"smoke"``; for a file, ``n_samples`` limits the rows
        taken per task (all rows when the file has no ``task`` column: the first ``n_samples``).
    """
    if data == "smoke":
        try:
            from kvpress_critical.data.ruler import generate_ruler_dataset
        except ImportError as err:  # pragma: no cover - depends on the installed version
            raise ImportError(
                "--data smoke needs kvpress_critical.data.ruler (the offline RULER-style generator); "
                "pass a data file instead (--data path/to/rows.jsonl with columns context, question, answer)"
            ) from err
        return generate_ruler_dataset(
            tokenizer, context_length=context_length, n_samples=n_samples, tasks=tasks, seed=seed
        )
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"--data must be 'smoke' or an existing file, got {data!r}")
    readers = {
        ".parquet": pd.read_parquet,
        ".jsonl": lambda p: pd.read_json(p, lines=True),
        ".json": pd.read_json,
        ".csv": pd.read_csv,
    }
    if path.suffix not in readers:
        raise ValueError(f"unsupported data file {path.name}: use one of {sorted(readers)}")
    rows = readers[path.suffix](path)
    missing = {"context", "question"} - set(rows.columns)
    if missing:
        raise ValueError(f"{path} lacks the column(s) {sorted(missing)}")
    if tasks:
        rows = rows[rows["task"].isin(tasks)] if "task" in rows.columns else rows
    if "task" in rows.columns:
        return rows.groupby("task", sort=False).head(n_samples).reset_index(drop=True)
    return rows.head(n_samples).reset_index(drop=True)
