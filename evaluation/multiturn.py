"""
Multi-turn evaluation through kvpress's own runner: the context compressed once, the turns asked as a conversation.

kvpress's ``EvaluationRunner`` answers the questions of a context independently (each answer removed from the
cache). For datasets with a ``turn_idx`` column (SCBench's multi-turn tasks, :mod:`kvpress_critical.data.scbench`;
the quality benchmark's multi-turn source), :func:`multiturn_runner` subclasses it and replaces only its inference
step: everything else (press setup, model loading, dataset loading, the results folder, ``predictions.csv``,
``metrics.json`` through the dataset's scorer, ``config.yaml``) is kvpress's code. Per context:

1. the context is cut to ``max_context_length`` minus the turns' answer room, in the middle, as SCBench does
   (``max_context_length - sum(max_new_tokens)`` tokens: the first and the last halves; kvpress's pipeline would cut
   the end);
2. it is prefilled and compressed once by the press (:class:`kvpress_critical.conversation.Conversation`), in
   whatever layout the press gives (masking, compact);
3. the turns are asked in order; each greedy answer is recorded, then replaced in the cache by the reference answer
   (SCBench's golden history) before the next turn. With likelihood targets (the quality benchmark), the reference
   is the target, teacher-forced and scored: ``records`` gets its NLL per turn, and its KL from the full-cache
   conversation (computed once per model and dataset, :func:`kvpress_critical.likelihood.computed_once`).

Query-aware compression has no multi-turn meaning (kvpress moves the question into the context) and is refused, as
are presses that compress while decoding (they would compress the turns). ``fraction`` samples whole contexts, with
all their turns.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

TURN = "turn_idx"


def is_multiturn(df) -> bool:
    """Whether a dataset's rows are turns of conversations."""
    return df is not None and TURN in df.columns


def middle_truncated(tokenizer, text: str, max_tokens: int | None) -> str:
    """``text`` cut to its first and last ``max_tokens // 2`` tokens when longer (SCBench's truncation)."""
    if max_tokens is None:
        return text
    if max_tokens < 2:
        raise ValueError(
            f"max_context_length leaves {max_tokens} tokens for the context once the turns' answer room is taken: "
            "raise max_context_length (SCBench's is 100000)"
        )
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return tokenizer.decode(ids[:half]) + tokenizer.decode(ids[-half:])


def reference_answer(row) -> str:
    """What the history holds after a turn: the likelihood target if the data has one, else the (first) answer."""
    target = getattr(row, "target", None)
    if isinstance(target, str) and target:
        return target
    answer = row.answer
    if hasattr(answer, "tolist"):
        answer = answer.tolist()
    if isinstance(answer, (list, tuple)):
        answer = answer[0]
    return str(answer)


def multiturn_runner(evaluate_module, targets: dict | None = None, reference_file: Path | None = None):
    """
    kvpress's ``EvaluationRunner`` (from ``evaluate_module``, its ``evaluate.py``) with the multi-turn inference step
    (module docstring). ``targets`` (``sample_key -> target``) and ``reference_file`` turn on the likelihood records.
    """

    class MultiTurnRunner(evaluate_module.EvaluationRunner):
        records: list[dict]

        def _load_and_prepare_dataset(self):
            # kvpress samples `fraction` of the rows; a conversation needs all its turns: sample whole contexts
            fraction = self.config.fraction
            self.config.fraction = 1.0
            try:
                super()._load_and_prepare_dataset()
            finally:
                self.config.fraction = fraction
            if fraction < 1.0:
                contexts = self.df["context_id"].drop_duplicates()
                kept = contexts.sample(frac=fraction, random_state=self.config.seed)
                self.df = self.df[self.df["context_id"].isin(set(kept))]
                logger.info("kept %d of %d contexts (fraction %.3f), every turn", len(kept), len(contexts), fraction)

        def _run_inference(self):
            from kvpress_critical.likelihood import computed_once

            if self.config.query_aware:
                raise ValueError(
                    "query_aware moves each question into the context; a multi-turn dataset asks its turns after one "
                    "compressed context: set query_aware to false"
                )
            df = self.df.sort_values(["context_id", TURN], kind="stable")
            self.records = []
            reference = None
            if targets and reference_file is not None:
                reference = computed_once(reference_file, lambda: self._conversations(df, None, score_only=True))
            self.df["predicted_answer"] = None
            self._conversations(df, self.press, reference=reference)
            self.df["compression_ratio"] = getattr(self.press, "compression_ratio", 0.0) if self.press else 0.0
            logger.info("multi-turn inference done: %d turns over %d contexts", len(df), df["context_id"].nunique())

        def _conversations(self, df, press, reference=None, score_only: bool = False) -> dict:
            """Every context's conversation with ``press``; returns the reference answers' scores by sample key."""
            from kvpress_critical.conversation import Conversation
            from kvpress_critical.likelihood import coarse_kl, sample_key

            scores = {}
            tokenizer = self.pipeline.tokenizer
            groups = df.groupby("context_id", sort=False)
            desc = "full-cache reference" if score_only else "Running multi-turn inference"
            for _, turns in tqdm(groups, total=df["context_id"].nunique(), desc=desc):
                room = int(turns["max_new_tokens"].sum())
                limit = None if self.config.max_context_length is None else self.config.max_context_length - room
                context = middle_truncated(tokenizer, turns["context"].iloc[0], limit)
                with torch.no_grad():
                    chat = Conversation(self.pipeline, context, press=press)
                    for row in turns.itertuples():
                        key = sample_key(row.context, row.question)
                        max_new = 0 if score_only else int(self.config.max_new_tokens or row.max_new_tokens)
                        target = targets.get(key) if targets else None
                        answer = chat.ask(row.question, max_new, reference_answer=target or reference_answer(row))
                        if not score_only:
                            self.df.loc[row.Index, "predicted_answer"] = answer
                        if target is None:
                            continue
                        scores[key] = chat.reference_scores
                        if score_only:
                            continue
                        record = dict(
                            sample_key=key,
                            turn=int(getattr(row, TURN)),
                            n_target_tokens=int(chat.reference_scores.nll.numel()),
                            nll=float(chat.reference_scores.nll.mean()),
                            nll_sum=float(chat.reference_scores.nll.sum()),
                            first_token_nll=float(chat.reference_scores.nll[0]),
                        )
                        if reference is not None and key in reference:
                            ref = reference[key]
                            kl = coarse_kl(ref.top_ids, ref.top_logp, chat.reference_logp)
                            record.update(
                                kl_topk=float(kl.mean()), kl_topk_max=float(kl.max()), nll_full=float(ref.nll.mean())
                            )
                        self.records.append(record)
                del chat
            return scores

    return MultiTurnRunner
