"""The selection rules of kvpress-critical as pure tensor functions, one module per method.

Everything here works on float32 scores of shape ``(B, H_kv, T)`` and is batched over rows and heads: no Python loop
over heads and no host synchronisation. The presses call these functions; the analysis tools reuse them to know
which entries each stage selected; the vLLM plugin (``integrations/vllm``) selects with them inside the engine. The
package needs torch only (not kvpress, not transformers).

- :mod:`.ranking`: budgets, deterministic ranks and top-k masks every rule shares;
- :mod:`.scorers`: base scores from tensors alone (SnapKV's window attention, key norms, StreamingLLM), equal to
  kvpress's presses on the same inputs;
- :mod:`.criticalkv`: CriticalKV's two stages (Algorithm 1 of arXiv 2502.03805);
- :mod:`.adakv`: AdaKV's head-wise budgets, and CriticalKV inside them;
- :mod:`.headkv`: HeadKV's offline per-head budgets;
- :mod:`.defensivekv`: DefensiveKV's scores.
"""

from kvpress_critical.selection.adakv import adaptive_head_budgets, critical_adakv_keep_mask, safeguard_budget
from kvpress_critical.selection.criticalkv import (
    critical_scores,
    first_stage_budget,
    first_stage_mask,
    stage2_scores,
    two_stage_keep_mask,
)
from kvpress_critical.selection.defensivekv import defensive_scores, mass_prefix_mask
from kvpress_critical.selection.headkv import headkv_budgets, integer_budgets, kv_head_importance
from kvpress_critical.selection.ranking import compute_n_kept, descending_rank, global_top_mask, top_budget_mask
from kvpress_critical.selection.scorers import (
    knorm_scores,
    snapkv_pad_window,
    snapkv_pooled_scores,
    snapkv_scores,
    streaming_llm_scores,
    window_attention,
)

__all__ = [
    "adaptive_head_budgets",
    "compute_n_kept",
    "critical_adakv_keep_mask",
    "critical_scores",
    "defensive_scores",
    "descending_rank",
    "first_stage_budget",
    "first_stage_mask",
    "global_top_mask",
    "headkv_budgets",
    "knorm_scores",
    "integer_budgets",
    "kv_head_importance",
    "mass_prefix_mask",
    "safeguard_budget",
    "snapkv_pad_window",
    "snapkv_pooled_scores",
    "snapkv_scores",
    "stage2_scores",
    "streaming_llm_scores",
    "top_budget_mask",
    "two_stage_keep_mask",
    "window_attention",
]
