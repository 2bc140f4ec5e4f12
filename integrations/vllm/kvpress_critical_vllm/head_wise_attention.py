"""The head-wise rows' attention: a compacted head-wise request attends, in every layer, over its region (each KV
head's kept entries, packed head after head into whole blocks) and its tail (positions from the prompt's last block
boundary on) with :func:`kvpress_critical.ops.paged_ragged_attention.paged_ragged_attention`; its result replaces the
backend's output rows, whose kernel saw only the row's last blocks. The layer's logits soft cap and attention sinks,
where it has them, are the op's (as the backend applies them to the other rows).

A failure of the kernel ends the requests of those rows (reported broken: the scheduler discards their tokens of this
step and ends them with an error), never the step or the engine: their rows keep the backend's output, which the
other rows of the step do not read.
"""

from __future__ import annotations

import logging

import torch

from kvpress_critical_vllm.kv_codes import KVCodes
from kvpress_critical_vllm.layouts import block_memory, region_views
from kvpress_critical_vllm.protocol import StepReport
from kvpress_critical_vllm.step_plan import StepPlan

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")


def softmax_terms(impl) -> dict:
    """The softmax's own terms of an attention layer (``impl``: vLLM's attention implementation), as
    :func:`~kvpress_critical.ops.paged_ragged_attention.paged_ragged_attention` takes them: a logits soft cap
    (Gemma 2; vLLM's backends keep 0 or None for none) and attention sinks (gpt-oss: one logit per query head of
    this rank)."""
    terms = {}
    cap = getattr(impl, "logits_soft_cap", None)
    if cap:
        terms["soft_cap"] = float(cap)
    sinks = getattr(impl, "sinks", None)
    if sinks is not None:
        terms["sinks"] = sinks
    return terms


class HeadWiseAttention:
    """One worker's head-wise attention: the kernel named by the engine's ``head_wise_kernel``, the tail's element
    offsets in the backend's block (read from the first cache it sees: every layer's cache has the same layout)."""

    def __init__(self, kernel: str, layer_index: dict[str, int], layout, kv_codes: dict[str, KVCodes]) -> None:
        self.kernel = kernel
        self.layer_index = layer_index  # attention layer name -> its index among the compressed layers
        self.layout = layout
        self.kv_codes = kv_codes  # layer -> its cache's format: fp8 codes are read in place with their scales
        self.tail_offsets: tuple[torch.Tensor, torch.Tensor] | None = None  # (H_kv, bs, d) element offsets

    def attend(
        self, layer, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, plan: StepPlan,
        report: StepReport,
    ) -> None:  # fmt: skip
        """The head-wise rows' attention in ``layer`` (``query`` and ``output``: (tokens, H, d)), written over the
        backend's output rows; the requests of rows whose kernel failed go to ``report`` as broken."""
        from kvpress_critical.ops.paged_ragged_attention import paged_ragged_attention

        index = self.layer_index[layer.layer_name]
        codes = self.kv_codes.get(layer.layer_name, KVCodes())
        region_keys, region_values = (codes.codes(view) for view in region_views(kv_cache))
        flat = codes.codes(block_memory(kv_cache))  # (blocks, block elements): the tail's element offsets index it
        scales = {"k_scale": codes.k_scale, "v_scale": codes.v_scale} if codes.code_dtype is not None else {}
        terms = softmax_terms(layer.impl)
        if self.tail_offsets is None:
            self.tail_offsets = self.layout.tail_offsets(kv_cache)
        key_offsets, value_offsets = self.tail_offsets
        for rows in plan.head_wise:
            if all(request_id in report.broken for request_id in rows.request_ids):
                continue  # failed in an earlier layer of this step
            try:
                tokens = rows.tokens.view(-1)
                queries = query.index_select(0, tokens).unflatten(0, rows.tokens.shape).transpose(1, 2)  # (rows,H,q,d)
                out = paged_ragged_attention(
                    queries, region_keys, region_values, rows.region_table, rows.seg_start[index],
                    rows.seg_len[index], flat, flat, rows.tail_table, rows.tail_len, key_offsets, value_offsets,
                    layer.impl.scale, backend=self.kernel, max_len=rows.max_len[index], **scales, **terms,
                    validate=index == 0,  # the step's inputs checked in its first layer: every layer has their shapes
                )  # fmt: skip
                output.index_copy_(0, tokens, out.to(output.dtype).flatten(0, 1))  # out: (rows, q, H, d)
            except Exception as error:  # noqa: BLE001 - these requests end with an error, never the engine
                logger.error(
                    "kvpress_critical: the head-wise attention failed in layer %s for requests %s: %r",
                    layer.layer_name, ", ".join(rows.request_ids), error,
                )  # fmt: skip
                for request_id in rows.request_ids:
                    report.broken[request_id] = f"its head-wise attention failed ({error!r})"
