"""Per-worker state of the plugin: the requests it compressed, and the scheduler's directives carried out step by step.

Each step, :meth:`WorkerState.begin_step` takes the scheduler's :class:`~kvpress_critical_vllm.protocol.StepDirectives`
(and forgets requests that finished, or were preempted and are run again); the attention metadata builder asks
:meth:`WorkerState.plan_step` for the step's plan (:mod:`kvpress_critical_vllm.step_plan`: which rows attend over a
shifted view, which end a prompt to be compacted, which keep their last queries); each attention layer runs the
head-wise rows' attention (:mod:`kvpress_critical_vllm.head_wise_attention`) and hands its queries to
:meth:`WorkerState.capture`; after the forward pass :meth:`WorkerState.finish_step` compacts the requests whose
prompts ended (:mod:`kvpress_critical_vllm.compaction`: a request is compacted whole, on every tensor-parallel rank,
or left exactly as it was) and records the result. The step's :class:`~kvpress_critical_vllm.protocol.StepReport`
goes back to the scheduler, which frees blocks only for the requests it lists as compacted.

A uniform press keeps the same count in every KV head: the kept entries move into the slots of positions
``E .. N-1`` and the row attends, with the backend's own kernel, over a view that starts after ``E``. A head-wise press
(AdaKV's budgets) keeps a different count in each head: every head keeps the prompt's last ``N mod block_size``
tokens (they share a block with the first new tokens, in the backend's order), and the rest of each head's entries
move, packed head after head, into the whole blocks of positions ``E .. B-1`` (``B`` the last block boundary of the
prompt), read as rows of keys and values (:func:`kvpress_critical_vllm.layouts.region_views`); the row then attends
with :func:`kvpress_critical.ops.paged_ragged_attention.paged_ragged_attention` over its region and its tail
(positions ``B ..``), and the backend's kernel only sees the row's last block, whose result is replaced.

A request is known here from the step that compacts it (or saves its window queries) until it finishes or is
preempted: the state never grows with the requests served.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvpress_critical_vllm.compaction import Compactor, Outcome
from kvpress_critical_vllm.head_wise_attention import HeadWiseAttention
from kvpress_critical_vllm.kv_codes import KVCodes
from kvpress_critical_vllm.model_weights import output_projections
from kvpress_critical_vllm.protocol import (
    DIRECTIVES_ATTRIBUTE,
    Compacted,
    PluginStateError,
    StepDirectives,
    StepReport,
)
from kvpress_critical_vllm.records import SelectionRecords
from kvpress_critical_vllm.step_plan import HeadWise, StepPlan, plan_step
from kvpress_critical_vllm.vllm_compat import batch_of, replace_block_ids, requests_starting_over

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")


class WorkerState:
    """The plugin's side of one worker (its state lives as long as the worker: nothing global refers to it)."""

    def __init__(self, vllm_config, runner) -> None:
        from kvpress_critical_vllm.options import engine_options

        self.vllm_config = vllm_config
        self.runner = runner
        self.engine_options = engine_options(vllm_config.additional_config)
        self.o_proj: dict[str, torch.Tensor] = {}  # attention layer name -> dense (D, H * d) o_proj weight
        self.layout = None  # how to read the paged cache by slot (set once the cache exists)
        self.kv_codes: dict[str, KVCodes] = {}  # compressed layer -> its cache's format and scales (with the layout)
        self.block_size: int | None = None  # the paged cache's block size (set with the layout)
        self.group = 0  # the compressed KV-cache group (the full-attention layers')
        self.tp_size = 1
        self.shifts: dict[str, int] = {}  # compacted request -> evicted positions its attention skips
        self.head_wise: dict[str, HeadWise] = {}  # compacted head-wise request -> its region
        self.queries: dict[str, dict[str, torch.Tensor]] = {}  # request -> layer -> last window queries so far
        self.records = SelectionRecords()  # record_selections only: the kept prompt positions
        self.compacted_requests = 0
        self._head_wise_attention: HeadWiseAttention | None = None
        self._directives = StepDirectives()
        self._plan: StepPlan | None = None
        self._report = StepReport()

    def close(self) -> None:
        self.shifts.clear()
        self.head_wise.clear()
        self.queries.clear()
        self.o_proj.clear()

    @property
    def tracked_requests(self) -> int:
        """Requests this worker keeps state for (compacted, or saving window queries)."""
        return len(self.shifts.keys() | self.head_wise.keys() | self.queries.keys())

    def bind_model(self, model: torch.nn.Module) -> None:
        """The dense output projection of each attention layer
        (:func:`~kvpress_critical_vllm.model_weights.output_projections`)."""
        self.o_proj = output_projections(model)

    # ----------------------------------------------------------------------------------------------------- steps
    def begin_step(self, scheduler_output) -> None:
        """Take the step's directives; forget finished requests and start over for new or resumed ones."""
        for request_id in requests_starting_over(scheduler_output):
            self.shifts.pop(request_id, None)
            self.head_wise.pop(request_id, None)
            self.queries.pop(request_id, None)
        self._directives = getattr(scheduler_output, DIRECTIVES_ATTRIBUTE, None) or StepDirectives()
        # new requests that start from a kept compressed prefix: attend from its first kept position on, as the
        # request that compacted it did (uniform presses: the prefix's blocks hold positions E .. P-1)
        self.shifts.update(self._directives.restore)
        self._plan = None
        self._report = StepReport()

    def plan_step(self, cm, block_size: int) -> StepPlan:
        """
        The plan of the step whose common attention metadata is ``cm``: computed once per step from the runner's
        batch and the scheduler's directives (dummy and profiling runs, with an empty batch, get an empty plan).
        """
        num_reqs = batch_of(self.runner).num_reqs
        if num_reqs == 0:
            return StepPlan()
        if self._plan is not None:
            return self._plan
        if cm.num_reqs != num_reqs:
            raise PluginStateError(
                f"kvpress_critical: the attention metadata covers {cm.num_reqs} of the batch's {num_reqs} requests "
                "(micro-batching?): the plugin needs every row's metadata to compress and shift it"
            )
        if block_size != self.block_size:
            raise PluginStateError(
                f"kvpress_critical: an attention metadata builder has block size {block_size}, the paged cache "
                f"{self.block_size}"
            )
        self._plan = plan_step(self.runner, cm, block_size, self._directives, self.shifts, self.head_wise, self._report)
        return self._plan

    def attend_head_wise(self, layer, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, plan) -> None:
        """The head-wise rows' attention over their regions and tails, written over the backend's output rows (a
        kernel failure ends those rows' requests, never the engine:
        :mod:`kvpress_critical_vllm.head_wise_attention`)."""
        if self._head_wise_attention is None:
            layers = {name: index for index, name in enumerate(self.o_proj)}
            self._head_wise_attention = HeadWiseAttention(
                self.engine_options.head_wise_kernel, layers, self.layout, self.kv_codes
            )
        self._head_wise_attention.attend(layer, query, kv_cache, output, plan, self._report)

    def capture(self, layer_name: str, query: torch.Tensor, plan: StepPlan) -> None:
        """After a layer's attention: keep the window queries the plan needs (clones: the buffer is reused)."""
        for save in plan.saves:
            earlier = self.queries.setdefault(save.request_id, {})
            chunk = query[save.query_start : save.query_end]
            if chunk.shape[0] < save.window and layer_name in earlier:
                chunk = torch.cat([earlier[layer_name], chunk])
            earlier[layer_name] = chunk[-save.window :].clone()
        for job in plan.jobs:
            options = job.directive.options
            if options.needs_queries:
                chunk = query[job.query_start : job.query_end]
                earlier = self.queries.get(job.directive.request_id, {}).get(layer_name)
                if earlier is not None and chunk.shape[0] < options.window_size:
                    chunk = torch.cat([earlier, chunk])
                job.queries[layer_name] = chunk[-options.window_size :].clone()

    # ---------------------------------------------------------------------------------------------- compaction
    @torch.no_grad()
    def finish_step(self, attention_layers: dict) -> None:
        """Compact every request whose prompt ended in this step (after the forward pass), or leave it whole."""
        plan = self._plan
        if plan is None or not plan.jobs:
            return
        try:
            compactor = Compactor(self.layout, self.o_proj, self.tp_size, self.kv_codes)
            outcome = compactor.compact(plan.jobs, attention_layers)
        finally:
            for job in plan.jobs:
                self.queries.pop(job.directive.request_id, None)
        self._apply(outcome)

    def _apply(self, outcome: Outcome) -> None:
        """The compactions' results: the compacted rows' views from the next step on, the report, the records."""
        self._report.uncompressed.update(outcome.uncompressed)
        for job, kept in outcome.written:
            request_id, evict = job.directive.request_id, job.directive.eviction
            if job.directive.redirect:  # written into fresh blocks: the request's table points at them from now on
                replace_block_ids(self.runner, request_id, self.group, dict(job.directive.redirect))
            if job.directive.options.head_wise:
                counts = torch.stack([mask.sum(dim=1) for mask in kept.values()])  # (L, H_kv), the pinned tail in
                pinned = evict.seen - evict.boundary
                self.head_wise[request_id] = HeadWise(evict.evicted, evict.seen - pinned, (counts - pinned).cpu())
            else:
                self.shifts[request_id] = evict.evicted
                counts = torch.full((1, 1), evict.kept)
            self.compacted_requests += 1
            self._report.compacted[request_id] = Compacted(
                evicted=evict.evicted, kept_per_head=evict.kept, kept_min=int(counts.min()), kept_max=int(counts.max())
            )
            if job.directive.options.record_selections:
                self.records.record(request_id, evict, kept)
        for request_id, reason in outcome.broken.items():
            self._report.broken[request_id] = reason
            self._report.compacted.pop(request_id, None)
            self.shifts.pop(request_id, None)
            self.head_wise.pop(request_id, None)

    def take_report(self) -> StepReport:
        report, self._report = self._report, StepReport()
        report.tracked_requests = self.tracked_requests
        return report

    def take_selections(self) -> dict[str, dict[str, Any]]:
        """The recorded selections after each request's last compaction, then forgotten
        (:meth:`~kvpress_critical_vllm.records.SelectionRecords.take_selections`)."""
        return self.records.take_selections()

    def take_stage_selections(self) -> dict[str, list[dict[str, Any]]]:
        """The recorded selections after each compaction of every request, then forgotten
        (:meth:`~kvpress_critical_vllm.records.SelectionRecords.take_stage_selections`)."""
        return self.records.take_stage_selections()
