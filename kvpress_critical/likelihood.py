"""Likelihood metrics of compressed caches: the reference answer's teacher-forced NLL and KL vs the full cache.

String match on greedy answers is a 0/1 signal per question; the log-likelihood of the reference answer under a
compressed cache, and its per-token KL divergence from the full-cache distribution, move smoothly with the
quality of the selection, so far fewer samples tell presses apart.

:class:`LikelihoodPipeline` is kvpress's ``"kv-press-text-generation"`` pipeline with one addition: after it
generates the greedy answer to a question and removes it from the cache (exactly as kvpress does), it feeds
``question + target`` on the same compressed cache and records, per target token, the negative log-likelihood
and the KL divergence ``KL(p_full || p_compressed)`` from a full-cache reference. Everything else (prefill,
compression with the press, greedy decoding, answer removal, chat template) is kvpress's code, unchanged.

The reference is the same teacher-forced pass on the uncompressed cache, computed once per model and dataset
(:func:`ensure_reference`, under a file lock, published atomically) and kept as the top-``k`` log-probabilities
of each target position; the KL recorded, ``kl_topk``, is that of the distributions coarsened to those ``k`` tokens
plus "the rest" (a lower bound of the exact KL, equal to it when the rest holds no mass; with ``k = 512`` the rest
holds < 1e-3 of the full-cache probability on the embedded model). The perturbation analysis
(:mod:`kvpress_critical.analysis.fidelity`) computes the exact KL over the whole vocabulary, ``kl``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock
from kvpress.pipeline import KVPressTextGenerationPipeline

logger = logging.getLogger(__name__)

TOP_K = 512


def sample_key(context: str, question: str) -> str:
    """Identifier of a (context, question) pair as the pipeline sees it."""
    return hashlib.sha1(f"{context}\0{question}".encode()).hexdigest()


@dataclass
class TokenScores:
    """Teacher-forced scores of one target."""

    nll: torch.Tensor  # (L,) float32, -log p(target token) under this cache
    top_ids: torch.Tensor  # (L, k) int64, the k most likely tokens at each position
    top_logp: torch.Tensor  # (L, k) float32, their log-probabilities


def coarse_kl(ref_ids: torch.Tensor, ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """
    Per-position ``KL(p || q)`` of ``p`` (given on its top-k ``ref_ids``) and ``q = exp(logp)``, both coarsened to
    those k tokens plus one bucket for the rest of the vocabulary. ``ref_*``: ``(L, k)``; ``logp``: ``(L, V)``.
    """
    p = ref_logp.double().exp()
    q_logp = logp.double().gather(-1, ref_ids)
    kl = (p * (ref_logp.double() - q_logp)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp_min(0)
    q_rest = (1 - q_logp.exp().sum(-1)).clamp_min(1e-300)
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-300).log() - q_rest.log()), torch.zeros_like(p_rest))
    return (kl + rest).clamp_min(0).float()


def target_tokens(tokenizer, target: str) -> tuple[torch.Tensor, torch.Tensor]:
    """
    Token ids ``(1, L)`` of ``target`` without its ``[[``/``]]`` marks, and which of them to score ``(L,)``: those
    whose characters overlap a marked span. A target without marks is scored whole.
    """
    text, spans, pos = "", [], 0
    while True:
        start = target.find("[[", pos)
        if start < 0:
            text += target[pos:]
            break
        end = target.find("]]", start)
        if end < 0:
            raise ValueError(f"unbalanced [[ ]] in target {target!r}")
        text += target[pos:start]
        spans.append((len(text), len(text) + end - start - 2))
        text += target[start + 2 : end]
        pos = end + 2
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = torch.tensor([encoded["input_ids"]], dtype=torch.long)
    if not spans:
        return ids, torch.ones(ids.shape[1], dtype=torch.bool)
    scored = [any(a < e and s < b for s, e in spans) for a, b in encoded["offset_mapping"]]
    return ids, torch.tensor(scored, dtype=torch.bool)


@torch.no_grad()
def teacher_forced_scores(
    model, cache, question_ids, target_ids, context_length: int, scored: torch.Tensor | None = None, top_k: int = TOP_K
):
    """
    Feed ``question_ids + target_ids`` on ``cache`` (positions after ``context_length``, kvpress's convention) and
    score the target tokens selected by ``scored`` (default: all). The cache keeps the fed tokens: the caller
    removes them.
    """
    ids = torch.cat([question_ids, target_ids.to(question_ids.device)], dim=1).to(model.device)
    position_ids = torch.arange(context_length, context_length + ids.shape[1], device=model.device).unsqueeze(0)
    logits = model(input_ids=ids, past_key_values=cache, position_ids=position_ids).logits[0]
    n_question, n_target = question_ids.shape[1], target_ids.shape[1]
    if scored is None:
        scored = torch.ones(n_target, dtype=torch.bool)
    positions = n_question - 1 + scored.nonzero().squeeze(-1).to(logits.device)  # logits that predict scored tokens
    logp = torch.log_softmax(logits[positions].float(), dim=-1)  # (L_scored, V)
    tokens = target_ids[0].to(logp.device)[scored.to(logp.device)]
    nll = -logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    top = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    return TokenScores(nll.cpu(), top.indices.cpu(), top.values.cpu()), logp


class LikelihoodPipeline(KVPressTextGenerationPipeline):
    """
    kvpress's pipeline, plus the teacher-forced scores of a target answer after each generated answer.

    Set :attr:`targets` (``sample_key(context, question) -> target``: text fed after the question, whose spans
    marked ``[[...]]`` are scored, e.g. ``"The capital is [[ Paris]]."``; questions without a target are only
    answered) and optionally :attr:`reference` (``sample_key -> TokenScores`` of the full cache) before calling it;
    read :attr:`records` afterwards (one dict per scored question, in call order). :attr:`answer_prefixes`
    (``sample_key -> text``) gives a question its own answer prefix, appended after kvpress's common one (the
    greedy answer and the target then continue it). With :attr:`score_only` the greedy answer is skipped (the
    reference pass). Setting :attr:`reference_file` and :attr:`reference_samples`
    instead of :attr:`reference` makes the first call compute or load it (:func:`ensure_reference`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.targets: dict[str, str] = {}
        self.answer_prefixes: dict[str, str] = {}
        self.reference: dict[str, TokenScores] | None = None
        self.records: list[dict] = []
        self.scores: dict[str, TokenScores] = {}
        self.score_only = False
        self.reference_file: Path | None = None
        self.reference_samples: list[tuple[str, list[str]]] = []
        self._pending: list = []

    def preprocess(self, context, questions, answer_prefix, max_context_length, enable_thinking=False):
        out = super().preprocess(context, questions, answer_prefix, max_context_length, enable_thinking)
        keys = [sample_key(context, q) for q in questions]
        prefixes = [self.answer_prefixes.get(k) for k in keys]
        out["questions_ids"] = [
            torch.cat([ids, self.tokenizer.encode(prefix, return_tensors="pt", add_special_tokens=False)], dim=1)
            if prefix
            else ids
            for ids, prefix in zip(out["questions_ids"], prefixes)
        ]
        out["sample_keys"] = keys
        out["target_ids"] = [self.target_ids(self.targets[k]) if k in self.targets else None for k in keys]
        return out

    def target_ids(self, target: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids (1, L), scored (L,) bool)`` of a target: the tokens that overlap a ``[[...]]`` span are scored."""
        return target_tokens(self.tokenizer, target)

    def _forward(self, input_tensors, max_new_tokens=50, press=None, cache=None):
        if self.reference is None and self.reference_file is not None and not self.score_only:
            self.reference = ensure_reference(self, self.reference_file, self.reference_samples)
        self._pending = list(zip(input_tensors.pop("sample_keys"), input_tensors.pop("target_ids")))
        return super()._forward(input_tensors, max_new_tokens=max_new_tokens, press=press, cache=cache)

    def generate_answer(self, question_ids, cache, context_length, max_new_tokens):
        key, target = self._pending.pop(0)
        lengths = [cache.get_seq_length(i) for i in range(len(cache))]
        answer = "" if self.score_only else super().generate_answer(question_ids, cache, context_length, max_new_tokens)
        if target is None:
            return answer
        self._remove_answer_from_cache(cache, lengths)  # score on the cache the answer was generated from
        target_ids, scored = target
        scores, logp = teacher_forced_scores(self.model, cache, question_ids, target_ids, context_length, scored)
        self.scores[key] = scores
        record = dict(
            sample_key=key,
            n_target_tokens=int(scores.nll.numel()),
            nll=float(scores.nll.mean()),
            nll_sum=float(scores.nll.sum()),
            first_token_nll=float(scores.nll[0]),
        )
        if self.reference is not None and key in self.reference:
            ref = self.reference[key]
            kl = coarse_kl(ref.top_ids.to(logp.device), ref.top_logp.to(logp.device), logp).cpu()
            record.update(kl_topk=float(kl.mean()), kl_topk_max=float(kl.max()), nll_full=float(ref.nll.mean()))
        self.records.append(record)
        return answer


def reference_path(output_dir: str | os.PathLike, name: str) -> Path:
    """Where the full-cache reference of a (model, dataset) lives inside a results folder."""
    return Path(output_dir) / "reference" / f"{name}.pt"


def ensure_reference(pipe: LikelihoodPipeline, path: Path, samples: list[tuple[str, list[str]]]) -> dict:
    """
    The full-cache reference scores of every ``(context, questions)`` of ``samples``, computed once.

    The first caller computes them with ``pipe`` (no press, targets only, no generation) under a file lock and
    publishes them atomically; later callers (other configurations of a sweep, even in other processes) load them.
    """

    def compute() -> dict:
        logger.info("computing the full-cache reference for %d contexts into %s", len(samples), path)
        previous = (pipe.score_only, pipe.reference, pipe.records, pipe.scores)
        pipe.score_only, pipe.reference, pipe.records, pipe.scores = True, None, [], {}
        try:
            for context, questions in samples:
                pipe(context, questions=questions, press=None, max_new_tokens=1)
            return dict(pipe.scores)
        finally:
            pipe.score_only, pipe.reference, pipe.records, pipe.scores = previous

    return computed_once(path, compute)


def computed_once(path: Path, compute) -> dict:
    """``compute()``'s result stored at ``path``: computed by the first caller under a file lock and published
    atomically, loaded by later callers (other configurations of a sweep, even in other processes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return torch.load(path, weights_only=False)
        result = compute()
        fd, tmp = tempfile.mkstemp(prefix=".reference-", suffix=".pt", dir=path.parent)
        os.close(fd)
        try:
            torch.save(result, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return result
