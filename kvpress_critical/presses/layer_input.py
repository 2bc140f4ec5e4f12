"""One layer as a compression sees it: the one explicit input of every press's selection with a budget.

A press selects a layer's entries from what the layer holds: its attention module, the hidden states of the step,
the cached keys and values (``(B, H_kv, T, d)``, the newest last), the model's attention weights when it returns
them, and the call's keyword arguments (rotary embeddings, positions). Three callers compress a layer after kvpress's
one-shot prefill has ended, and each knows more than that:

- :class:`~kvpress_critical.ChunkedPrefillPress` (after every chunk) and the decoding compressor
  (:mod:`~kvpress_critical.presses.decoding_compression`) see a layer whose view holds entries that must not be
  selected again (evicted but still stored in kvpress's masking layout, padding of the compact layout's view):
  :attr:`LayerInput.excluded`. They get no attention in SnapKV's window and the lowest scores;
- a chunked prefill has already computed the projected-value norms of the entries it kept after the previous chunk:
  :attr:`LayerInput.known_norms` (exact to reuse: an entry's norm depends on its value only); the norms this
  compression computes are left in :attr:`LayerInput.computed_norms` for the next chunk.

All of it is passed as arguments (:func:`~kvpress_critical.presses.budgeted.keep_mask` takes a
:class:`LayerInput`), checked when built: a mask or norm whose shape does not match the layer is an error, never
silently dropped. kvpress's own hooks build one from ``compress``'s arguments (:meth:`LayerInput.from_compress`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from kvpress_critical.modeling import module_projected_norm

__all__ = ["LayerInput"]


@dataclass
class LayerInput:
    """
    What one compression of one attention layer sees (module docstring).

    Parameters
    ----------
    module : nn.Module
        The attention layer (``self_attn``).
    hidden_states : torch.Tensor
        ``(B, q, D)`` the layer's input of the step (the prefill's tokens, or the decoding steps' buffer).
    keys, values : torch.Tensor
        ``(B, H_kv, T, d)`` the entries held, the newest last.
    attentions : torch.Tensor, optional
        The model's attention weights (eager attention), ``(B, H, q, T)``.
    kwargs : dict
        The layer call's keyword arguments (``position_embeddings``, ``cache_position``...).
    excluded : torch.Tensor, optional
        ``(B, H_kv, T)`` bool: entries that must not be selected (nor weigh in the others' scores).
    known_norms : dict
        Projected norms already computed, ``norm name -> (B, H_kv, L)`` float32 for the first ``L <= T`` entries.
    """

    module: nn.Module
    hidden_states: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    attentions: torch.Tensor | None = None
    kwargs: dict = field(default_factory=dict)
    excluded: torch.Tensor | None = None
    known_norms: dict = field(default_factory=dict)
    computed_norms: dict = field(default_factory=dict, init=False)  # norm name -> (B, H_kv, T), what was computed
    reused_entries: int = field(default=0, init=False)  # entries whose norms came from known_norms

    def __post_init__(self):
        shape = tuple(self.keys.shape[:3])
        if self.values.shape[:3] != self.keys.shape[:3]:
            raise ValueError(f"values of shape {tuple(self.values.shape)} for keys of shape {tuple(self.keys.shape)}")
        if self.excluded is not None:
            if tuple(self.excluded.shape) != shape or self.excluded.dtype != torch.bool:
                raise ValueError(
                    f"excluded must be a (batch, kv_heads, entries) = {shape} bool mask, got "
                    f"{tuple(self.excluded.shape)} {self.excluded.dtype}"
                )
            self.excluded = self.excluded.to(self.keys.device)
        for name, norms in self.known_norms.items():
            if tuple(norms.shape[:2]) != shape[:2] or norms.dim() != 3 or norms.shape[2] > shape[2]:
                raise ValueError(
                    f"known {name} norms of shape {tuple(norms.shape)} for a layer of {shape}: they must cover the "
                    "first entries of every (batch row, KV head)"
                )

    @classmethod
    def from_compress(cls, module, hidden_states, keys, values, attentions, kwargs) -> LayerInput:
        """The input of kvpress's ``compress(module, hidden_states, keys, values, attentions, kwargs)``."""
        return cls(module, hidden_states, keys, values, attentions, kwargs)

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(B, H_kv, T)``."""
        return tuple(self.keys.shape[:3])

    def projected_norm(self, norm: str, backend: str) -> torch.Tensor:
        """
        ``(B, H_kv, T)`` float32 projected-value norms of the entries: the known ones reused, the others computed
        (:func:`kvpress_critical.modeling.module_projected_norm`); the full result is kept in
        :attr:`computed_norms`.
        """
        known = self.known_norms.get(norm)
        n_known = 0 if known is None else known.shape[2]
        new = module_projected_norm(self.module, self.values[:, :, n_known:], norm, backend)
        result = new if known is None else torch.cat([known.to(device=new.device, dtype=new.dtype), new], dim=2)
        self.reused_entries += 0 if known is None else known.numel()
        self.computed_norms[norm] = result
        return result

    def mask_excluded(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` (``(B, H_kv, T)``) with the excluded entries at ``-inf``."""
        if tuple(scores.shape) != self.shape:
            raise ValueError(f"scores of shape {tuple(scores.shape)} for a layer of {self.shape}")
        if self.excluded is None:
            return scores
        return scores.masked_fill(self.excluded, float("-inf"))

    def rows(self, row: int, start: int) -> LayerInput:
        """
        Batch row ``row`` from entry ``start`` on, as if alone (a left-padded batch: ``start`` is the row's first real
        token): its hidden states, entries and rotary embeddings; no attention mask, no model attention weights.
        """
        if self.known_norms:
            raise ValueError("a row of a layer is selected without known norms (they cover the whole batch)")
        kwargs = dict(self.kwargs, attention_mask=None)
        if "position_embeddings" in kwargs:
            cos, sin = kwargs["position_embeddings"]  # (1 or B, T, d)
            pick = slice(row, row + 1) if cos.shape[0] > 1 else slice(0, 1)
            kwargs["position_embeddings"] = (cos[pick, start:], sin[pick, start:])
        pick = slice(row, row + 1)
        return replace(
            self,
            hidden_states=self.hidden_states[pick, start:],
            keys=self.keys[pick, :, start:],
            values=self.values[pick, :, start:],
            attentions=None,
            kwargs=kwargs,
            excluded=None if self.excluded is None else self.excluded[pick, :, start:],
            known_norms={},
        )
