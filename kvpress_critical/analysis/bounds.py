"""Per-head attention-output perturbation and its bounds for fixed queries (arXiv 2502.03805, section 3).

For one attention layer, a set of queries captured in the full-cache run and the full keys and values
they attend to, :func:`layer_reference` computes everything that does not depend on the press (full
attention weights ``A``, projected-value norms ``N``, ``C = sum_i A_i N_i``...) and
:func:`measure_selection` the perturbation of one kept set:

- ``actual = ||o - ô||_1`` with ``o = (A V) W_O^h`` and ``ô = (Â V) W_O^h``, ``Â`` the softmax of the
  same logits restricted to the kept entries: exactly the attention of the same query over the
  compressed cache;
- ``theta = (1/s - 1) C + (2 - 1/s) X`` (CriticalKV's bound) and ``theta_prev = 2 (1 - s) max_j N_j``
  (the attention-only bound), ``s`` the retained attention mass, ``X = sum_{i evicted} A_i N_i``;
- ``s1``, the mass retained by the first-stage set (Assumption 3.4 holds when ``s1 >= 1/2``).

``N_i`` here is per *query* head (``||V_i W_O^h||_1`` of that head), whereas the presses score a KV head
with the mean over its query group. All arithmetic is float64 on the float32 captured tensors, so
``actual <= theta`` holds up to float64 rounding and the float32 accumulation of ``N``.

Entries after the context (question and answer tokens) are never evicted: they count as kept.
"""

from dataclasses import dataclass

import torch

from kvpress_critical.ops.projected_value_norm import projected_value_norm

__all__ = [
    "LayerReference",
    "SelectionMeasure",
    "layer_reference",
    "measure_selection",
    "theta_bound",
    "theta_prev_bound",
]


def theta_bound(s: torch.Tensor, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """CriticalKV's bound ``(1/s - 1) C + (2 - 1/s) X`` (valid for any ``s`` in (0, 1])."""
    return (1 / s - 1) * c + (2 - 1 / s) * x


def theta_prev_bound(s: torch.Tensor, max_norm: torch.Tensor) -> torch.Tensor:
    """Attention-only bound ``2 (1 - s) max_j N_j``."""
    return 2 * (1 - s) * max_norm


@dataclass
class LayerReference:
    """
    Press-independent quantities of one layer for ``L`` queries over ``T = n_context + L`` entries.

    Attributes
    ----------
    logits : torch.Tensor
        ``(H, L, T)`` float64 attention logits, ``-inf`` where causally masked.
    attention : torch.Tensor
        ``(H, L, T)`` float64 full-cache attention weights ``A``.
    values : torch.Tensor
        ``(H, T, d)`` float64 values seen by each query head.
    w_o : torch.Tensor
        ``(H, d, D)`` float64 per-head output projections ``W_O^h``.
    output : torch.Tensor
        ``(H, L, d)`` float64 full-cache head outputs before ``o_proj`` (``A V``).
    norms : torch.Tensor
        ``(H, T)`` float64 per-query-head projected-value L1 norms ``N``.
    weighted_norm : torch.Tensor
        ``(H, L)`` ``C = sum_i A_i N_i``.
    max_norm : torch.Tensor
        ``(H, L)`` ``max_j N_j`` over the entries each query sees.
    n_context : int
        Number of (compressible) context entries, the first ``n_context`` of ``T``.
    """

    logits: torch.Tensor
    attention: torch.Tensor
    values: torch.Tensor
    w_o: torch.Tensor
    output: torch.Tensor
    norms: torch.Tensor
    weighted_norm: torch.Tensor
    max_norm: torch.Tensor
    n_context: int

    @property
    def num_heads(self) -> int:
        return self.attention.shape[0]


@dataclass
class SelectionMeasure:
    """``(H, L)`` float64 measures of one kept set for every query head and query (see module docstring)."""

    actual: torch.Tensor
    theta: torch.Tensor
    theta_prev: torch.Tensor
    retained: torch.Tensor
    retained_stage1: torch.Tensor | None


def _per_query_head(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat a ``(H_kv, ...)`` tensor for the query heads of each KV head's group."""
    return x.repeat_interleave(num_heads // x.shape[0], dim=0)


@torch.no_grad()
def layer_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    o_proj_weight: torch.Tensor,
    n_context: int,
    scaling: float,
    softcap: float | None = None,
) -> LayerReference:
    """
    Full-cache attention of ``L`` queries and the press-independent terms of the bounds.

    Parameters
    ----------
    query : torch.Tensor
        ``(H, L, d)`` post-RoPE queries (as the attention function received them).
    keys, values : torch.Tensor
        ``(H_kv, T, d)`` full cache after the queries' own entries were appended, ``T = n_context + L``.
    o_proj_weight : torch.Tensor
        ``(D, H * d)`` dense output-projection weight.
    n_context : int
        Number of context entries (the only ones a press may evict).
    scaling : float
        Logit scale the model uses (``module.scaling``).
    softcap : float, optional
        Attention logit soft-capping (``softcap * tanh(logits / softcap)``), if the model uses it.
    """
    num_heads, n_queries, head_dim = query.shape
    n_total = keys.shape[1]
    if n_total != n_context + n_queries:
        raise ValueError(f"expected {n_context} + {n_queries} cached entries, got {n_total}")
    k = _per_query_head(keys.double(), num_heads)
    v = _per_query_head(values.double(), num_heads)
    logits = torch.einsum("hld,htd->hlt", query.double(), k) * scaling
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    # query l (absolute index n_context + l) sees every context entry and the query entries up to itself
    positions = torch.arange(n_total, device=query.device)
    visible = positions.unsqueeze(0) <= n_context + positions[:n_queries].unsqueeze(1)  # (L, T)
    logits = logits.masked_fill(~visible, float("-inf"))
    attention = logits.softmax(dim=-1)

    hidden = o_proj_weight.shape[0]
    w_o = o_proj_weight.detach().double().reshape(hidden, num_heads, head_dim).permute(1, 2, 0)  # (H, d, D)
    # per query head: a group of one, so projected_value_norm returns ||V_i W_O^h||_1 of each head
    norms = projected_value_norm(
        _per_query_head(values, num_heads).unsqueeze(0), o_proj_weight.to(values.dtype), num_heads, norm="l1"
    )[0].double()
    weighted_norm = (attention * norms.unsqueeze(1)).sum(-1)
    max_norm = norms.unsqueeze(1).masked_fill(~visible, float("-inf")).amax(-1)
    return LayerReference(
        logits=logits,
        attention=attention,
        values=v,
        w_o=w_o,
        output=attention @ v,
        norms=norms,
        weighted_norm=weighted_norm,
        max_norm=max_norm,
        n_context=n_context,
    )


def _extend_mask(ref: LayerReference, context_mask: torch.Tensor) -> torch.Tensor:
    """``(H_kv, n_context)`` context mask -> ``(H, T)``, the query entries always set."""
    per_head = _per_query_head(context_mask.bool(), ref.num_heads)
    tail = torch.ones(ref.num_heads, ref.logits.shape[-1] - ref.n_context, dtype=torch.bool, device=per_head.device)
    return torch.cat([per_head, tail], dim=-1)


def project_heads(ref: LayerReference, head_outputs: torch.Tensor) -> torch.Tensor:
    """``(H, L, d)`` head outputs before ``o_proj`` -> ``(H, L)`` L1 norms of ``x W_O^h``."""
    return torch.einsum("hld,hdo->hlo", head_outputs.double(), ref.w_o).abs().sum(-1)


@torch.no_grad()
def measure_selection(ref: LayerReference, keep: torch.Tensor, stage1: torch.Tensor | None = None) -> SelectionMeasure:
    """
    Perturbation and bounds of the kept set ``keep`` for every query head and query of ``ref``.

    Parameters
    ----------
    ref : LayerReference
        Output of :func:`layer_reference`.
    keep : torch.Tensor
        ``(H_kv, n_context)`` bool, the context entries the press kept for each KV head.
    stage1 : torch.Tensor, optional
        ``(H_kv, n_context)`` bool, the entries CriticalKV's first stage chose (a subset of ``keep``).
    """
    kept = _extend_mask(ref, keep).unsqueeze(1)  # (H, 1, T)
    compressed = ref.logits.masked_fill(~kept, float("-inf")).softmax(dim=-1)
    actual = project_heads(ref, (ref.attention - compressed) @ ref.values)
    attention = ref.attention
    retained = (attention * kept).sum(-1)
    evicted_weighted = (attention * ref.norms.unsqueeze(1) * ~kept).sum(-1)
    retained_stage1 = None
    if stage1 is not None:
        retained_stage1 = (attention * _extend_mask(ref, stage1).unsqueeze(1)).sum(-1)
    return SelectionMeasure(
        actual=actual,
        theta=theta_bound(retained, ref.weighted_norm, evicted_weighted),
        theta_prev=theta_prev_bound(retained, ref.max_norm),
        retained=retained,
        retained_stage1=retained_stage1,
    )
