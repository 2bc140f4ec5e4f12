"""End-to-end fidelity of a compressed cache: next-token distributions over a teacher-forced answer."""

from dataclasses import dataclass

import torch

__all__ = ["Fidelity", "next_token_fidelity"]


@dataclass
class Fidelity:
    """
    Per answer token (``(A,)`` float64 tensors).

    Attributes
    ----------
    kl : torch.Tensor
        ``KL(p_full || p_compressed)`` of the next-token distribution predicting each answer token.
    logprob_full, logprob_compressed : torch.Tensor
        Log-probability of each answer token under the full and the compressed cache.
    top1_agree : torch.Tensor
        1.0 where both caches predict the same most likely token.
    """

    kl: torch.Tensor
    logprob_full: torch.Tensor
    logprob_compressed: torch.Tensor
    top1_agree: torch.Tensor

    @property
    def loglik_gap(self) -> float:
        """Mean per-token ``log p_full - log p_compressed`` of the answer (positive: the compressed cache is worse)."""
        return float((self.logprob_full - self.logprob_compressed).mean())


def next_token_fidelity(
    full_logits: torch.Tensor, compressed_logits: torch.Tensor, answer_ids: torch.Tensor, answer_start: int
) -> Fidelity:
    """
    Compare two ``(L, V)`` logit sequences over the answer tokens they were teacher-forced with.

    Parameters
    ----------
    full_logits, compressed_logits : torch.Tensor
        Logits of the same post-context tokens with the full and the compressed cache.
    answer_ids : torch.Tensor
        ``(A,)`` answer token ids, at positions ``answer_start .. answer_start + A - 1`` of the input.
    answer_start : int
        Index of the first answer token in the input (the logits at ``answer_start - 1`` predict it).
    """
    n = answer_ids.numel()
    rows = slice(answer_start - 1, answer_start - 1 + n)
    log_p = full_logits[rows].double().log_softmax(-1)
    log_q = compressed_logits[rows].double().log_softmax(-1)
    kl = torch.nn.functional.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    target = answer_ids.reshape(-1, 1).to(log_p.device)
    return Fidelity(
        kl=kl,
        logprob_full=log_p.gather(-1, target)[:, 0],
        logprob_compressed=log_q.gather(-1, target)[:, 0],
        top1_agree=(log_p.argmax(-1) == log_q.argmax(-1)).double(),
    )
