"""Per-worker state of the plugin: carrying out the scheduler's directives, and what each compressed row attends to.

Each step, :meth:`WorkerState.begin_step` takes the scheduler's :class:`~kvpress_critical_vllm.protocol.StepDirectives`
(and forgets requests that finished, or were preempted and are run again); the attention metadata builder asks
:meth:`WorkerState.plan_step` for the step's plan (which rows attend over a shifted view, which rows end a prompt
to be compacted, which rows keep their last queries); each attention layer hands its queries to
:meth:`WorkerState.capture`; after the forward pass :meth:`WorkerState.finish_step` compacts the requests whose
prompts ended, all layers at once: every layer is selected first and written only if all selections succeeded (on
every tensor-parallel rank), so a request is either compacted whole or left exactly as it was. The step's
:class:`~kvpress_critical_vllm.protocol.StepReport` goes back to the scheduler, which frees blocks only for the
requests it lists as compacted.

A request is known here from the step that compacts it (or saves its window queries) until it finishes or is
preempted: the state never grows with the requests served.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpress_critical_vllm.presses import heads_per_chunk, keep_positions
from kvpress_critical_vllm.protocol import DIRECTIVES_ATTRIBUTE, Compact, Compacted, StepDirectives, StepReport

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")


class PluginStateError(RuntimeError):
    """The workers and the scheduler disagree about a request: a bug, which stops rather than answers wrongly."""


@dataclass
class Job:
    """A request whose prompt ends in this step: rows ``query_start .. query_end`` hold its last prompt tokens."""

    directive: Compact
    row: int
    query_start: int
    query_end: int
    block_ids: torch.Tensor  # the request's block-table row (device), unshifted
    queries: dict[str, torch.Tensor] = field(default_factory=dict)  # layer -> its last window queries (W, H, d)


@dataclass
class QuerySave:
    """A request in an earlier chunk of its prompt: keep the last ``window`` queries of rows ``start .. end``."""

    request_id: str
    window: int
    query_start: int
    query_end: int


@dataclass
class StepPlan:
    shift: torch.Tensor | None = None  # (num_reqs,) evicted positions of each row already compressed
    jobs: list[Job] = field(default_factory=list)
    saves: list[QuerySave] = field(default_factory=list)

    @property
    def captures(self) -> bool:
        return bool(self.jobs or self.saves)


@torch.no_grad()
def dense_weight(linear: torch.nn.Module) -> torch.Tensor | None:
    """
    ``(out, in)`` dense weight of a vLLM linear layer (this rank's shard), or None if it is not unquantized.

    On CPUs vLLM packs unquantized weights for oneDNN after loading and empties ``weight``; the packed layer applied
    to the identity gives the weight back exactly (each output is one product by 1.0), once per layer. That copy is
    the plugin's largest resident memory on CPUs: every layer's ``o_proj``, ``L * D * H * d`` elements (1 GiB for
    Llama-3.1-8B in bfloat16); on GPUs the model's own weight is read.
    """
    weight = getattr(linear, "weight", None)
    method = getattr(linear, "quant_method", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dtype.itemsize < 2:
        return None
    if weight.dim() == 2 and weight.numel() > 0:
        return weight.detach()
    if type(method).__name__ != "UnquantizedLinearMethod":
        return None
    identity = torch.eye(linear.input_size_per_partition, dtype=weight.dtype, device=weight.device)
    return method.apply(linear, identity).t().contiguous()


class WorkerState:
    """The plugin's side of one worker (its state lives as long as the worker: nothing global refers to it)."""

    def __init__(self, vllm_config, runner) -> None:
        from kvpress_critical_vllm.options import engine_options

        self.vllm_config = vllm_config
        self.runner = runner
        self.engine_options = engine_options(vllm_config.additional_config)
        self.o_proj: dict[str, torch.Tensor] = {}  # attention layer name -> dense (D, H * d) o_proj weight
        self.layout = None  # how to read the paged cache by slot (set once the cache exists)
        self.block_size: int | None = None  # the paged cache's block size (set with the layout)
        self.tp_size = 1
        self.shifts: dict[str, int] = {}  # compacted request -> evicted positions its attention skips
        self.queries: dict[str, dict[str, torch.Tensor]] = {}  # request -> layer -> last window queries so far
        self.selections: dict[str, dict[str, torch.Tensor]] = {}  # record_selections only
        self.compacted_requests = 0
        self._directives = StepDirectives()
        self._plan: StepPlan | None = None
        self._report = StepReport()

    def close(self) -> None:
        self.shifts.clear()
        self.queries.clear()
        self.o_proj.clear()

    @property
    def tracked_requests(self) -> int:
        """Requests this worker keeps state for (compacted, or saving window queries)."""
        return len(self.shifts.keys() | self.queries.keys())

    # ---------------------------------------------------------------------------------------------------- model
    def bind_model(self, model: torch.nn.Module) -> None:
        """The dense output projection of each attention layer (``<prefix>.attn`` -> ``<prefix>.o_proj``)."""
        from vllm.model_executor.layers.attention import Attention

        from kvpress_critical_vllm.engine_config import EngineConfigError

        modules = dict(model.named_modules())
        for name, module in modules.items():
            if not isinstance(module, Attention):
                continue
            o_proj = getattr(modules.get(name.rpartition(".")[0]), "o_proj", None)
            weight = dense_weight(o_proj) if o_proj is not None else None
            if weight is None:
                raise EngineConfigError(
                    f"kvpress_critical cannot compress with this model: attention layer {module.layer_name} has no "
                    "unquantized o_proj beside it, whose weight CriticalKV's projected norm reads. Supported: "
                    "models whose attention block holds `attn` and a dense `o_proj` (Llama, Mistral, Qwen2/3, Phi-3)."
                )
            self.o_proj[module.layer_name] = weight
        if not self.o_proj:
            raise EngineConfigError("kvpress_critical found no attention layer to compress in this model")

    # ----------------------------------------------------------------------------------------------------- steps
    def begin_step(self, scheduler_output) -> None:
        """Take the step's directives; forget finished requests and start over for new or resumed ones."""
        gone = set(scheduler_output.finished_req_ids)
        gone.update(request.req_id for request in scheduler_output.scheduled_new_reqs)
        gone.update(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        for request_id in gone:
            self.shifts.pop(request_id, None)
            self.queries.pop(request_id, None)
        self._directives = getattr(scheduler_output, DIRECTIVES_ATTRIBUTE, None) or StepDirectives()
        self._plan = None
        self._report = StepReport()

    def plan_step(self, cm, block_size: int) -> StepPlan:
        """
        The plan of the step whose common attention metadata is ``cm``: computed once per step from the runner's
        batch and the scheduler's directives (dummy and profiling runs, with an empty batch, get an empty plan).
        """
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
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
        plan = StepPlan()
        starts = cm.query_start_loc_cpu[: num_reqs + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:num_reqs].tolist()
        shift = [0] * num_reqs
        directives = self._directives
        for row, request_id in enumerate(batch.req_ids[:num_reqs]):
            if request_id in self.shifts:
                shift[row] = self.shifts[request_id]
            job = directives.compact.get(request_id)
            before, scheduled = computed[row], starts[row + 1] - starts[row]
            if job is not None:
                evict = job.eviction
                if before + scheduled != evict.n_prompt or evict.block_size != block_size:
                    raise PluginStateError(
                        f"kvpress_critical: request {request_id} is to be compacted after its {evict.n_prompt}-token "
                        f"prompt (blocks of {evict.block_size}), but this step runs its positions {before}.."
                        f"{before + scheduled - 1} (blocks of {block_size})"
                    )
                table = cm.block_table_tensor[row, : -(-evict.n_prompt // block_size)]
                plan.jobs.append(Job(job, row, starts[row], starts[row + 1], table))
            window = directives.save_queries.get(request_id)
            if window is not None:
                plan.saves.append(QuerySave(request_id, window, starts[row], starts[row + 1]))
        missing = (directives.compact.keys() | directives.save_queries.keys()) - set(batch.req_ids[:num_reqs])
        if missing:
            raise PluginStateError(f"kvpress_critical: directives for requests not in this step's batch: {missing}")
        if any(shift):
            plan.shift = torch.tensor(shift, dtype=torch.int64)
        self._plan = plan
        return plan

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
        selected: list[dict[str, torch.Tensor] | None] = []
        for job in plan.jobs:
            try:
                selected.append(self._select(job, attention_layers))
            except Exception as error:  # noqa: BLE001 - any failure leaves this request whole, never the engine down
                logger.warning(
                    "kvpress_critical: selection failed for request %s; it stays uncompressed: %r",
                    job.directive.request_id,
                    error,
                )
                selected.append(None)
            finally:
                self.queries.pop(job.directive.request_id, None)
        failed = self._agree_across_ranks([kept is None for kept in selected])
        for job, kept, fail in zip(plan.jobs, selected, failed):
            request_id = job.directive.request_id
            if fail:
                self._report.uncompressed[request_id] = (
                    "its selection failed on this worker" if kept is None else "its selection failed on another rank"
                )
                continue
            try:
                self._write(job, kept, attention_layers)
            except Exception as error:  # noqa: BLE001 - written in part: only this request is lost
                logger.error("kvpress_critical: compaction of request %s failed midway: %r", request_id, error)
                self._report.broken[request_id] = f"its compaction failed midway ({error!r})"
                continue
            evict = job.directive.eviction
            self.shifts[request_id] = evict.evicted
            self.compacted_requests += 1
            self._report.compacted[request_id] = Compacted(evicted=evict.evicted, kept_per_head=evict.kept)
            if job.directive.options.record_selections:
                self.selections[request_id] = {name: positions.cpu() for name, positions in kept.items()}

    def _slots(self, job: Job) -> torch.Tensor:
        evict = job.directive.eviction
        positions = torch.arange(evict.n_prompt, device=job.block_ids.device)
        return job.block_ids[positions // evict.block_size].long() * evict.block_size + positions % evict.block_size

    def _select(self, job: Job, attention_layers: dict) -> dict[str, torch.Tensor]:
        """The kept positions of every layer, ``{layer: (H_kv, kept)}``; nothing is written."""
        options, evict = job.directive.options, job.directive.eviction
        slots = self._slots(job)
        kept = {}
        for name in self.o_proj:
            layer = attention_layers[name]
            kv_cache, impl = layer.kv_cache, layer.impl
            num_kv_heads = impl.num_kv_heads
            chunk = heads_per_chunk(
                options, evict.n_prompt, num_kv_heads, impl.num_heads // num_kv_heads, impl.head_size,
                kv_cache.element_size(),
            )  # fmt: skip

            def read(first: int, end: int, kv_cache=kv_cache):
                return self.layout.read(kv_cache, slots, slice(first, end))

            kept[name] = keep_positions(
                options,
                read,
                num_kv_heads,
                evict.kept,
                queries=job.queries.get(name),
                o_proj_weight=self.o_proj[name] if options.critical else None,
                chunk=chunk,
            )
        return kept

    def _write(self, job: Job, kept: dict[str, torch.Tensor], attention_layers: dict) -> None:
        """Each head's kept entries into its slots of positions ``E .. N-1``, in position order, one head at a time
        (what it holds beside the cache: one head's kept keys and values)."""
        slots = self._slots(job)
        target = slots[job.directive.eviction.evicted :]
        for name, positions in kept.items():
            kv_cache = attention_layers[name].kv_cache
            for head in range(positions.shape[0]):
                heads = slice(head, head + 1)
                keys, values = self.layout.read(kv_cache, slots[positions[head]], heads)
                self.layout.write(kv_cache, target, heads, keys, values)

    def _agree_across_ranks(self, failed: list[bool]) -> list[bool]:
        """Under tensor parallelism a request is compacted only if every rank selected it (one all-reduce)."""
        if self.tp_size == 1:
            return failed
        import torch.distributed as dist
        from vllm.distributed import get_tp_group

        flags = torch.tensor(failed, dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=get_tp_group().cpu_group)
        return [bool(flag) for flag in flags.tolist()]

    def take_report(self) -> StepReport:
        report, self._report = self._report, StepReport()
        report.tracked_requests = self.tracked_requests
        return report

    def take_selections(self) -> dict[str, dict[str, Any]]:
        """The recorded selections (``{request_id: {layer_name: (H_kv, kept) positions}}``), then forgotten."""
        selections, self.selections = self.selections, {}
        return {rid: {name: kept.tolist() for name, kept in layers.items()} for rid, layers in selections.items()}
