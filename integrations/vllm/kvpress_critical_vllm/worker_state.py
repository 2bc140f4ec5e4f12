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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpress_critical_vllm.layouts import block_memory, region_views
from kvpress_critical_vllm.presses import heads_per_chunk, layer_scores, select
from kvpress_critical_vllm.protocol import DIRECTIVES_ATTRIBUTE, Compact, Compacted, StepDirectives, StepReport
from kvpress_critical_vllm.vllm_compat import batch_of, batch_rows, block_table, query_starts, requests_starting_over

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")


class PluginStateError(RuntimeError):
    """The workers and the scheduler disagree about a request: a bug, which stops rather than answers wrongly."""


class LayoutError(ValueError):
    """A selection the head-wise layout cannot hold (the request then stays uncompressed)."""


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
class HeadWise:
    """A compacted head-wise request: its region (whole blocks of positions ``evicted .. region_end - 1``) and the
    entries each KV head keeps there, per layer, packed head after head."""

    evicted: int
    region_end: int
    counts: torch.Tensor  # (L, H_kv) int64, on the host: a step's attention inputs are planned without a device read


@dataclass
class HeadWiseRows:
    """Head-wise rows of a step that run the same number of tokens ``q`` (one when decoding; a recomputed output
    after a preemption runs several), as :func:`paged_ragged_attention` takes them."""

    request_ids: list[str]  # (rows,)
    tokens: torch.Tensor  # (rows, q) int64 the tokens of each row in the step's query / output
    region_table: torch.Tensor  # (rows, M) int64
    seg_start: torch.Tensor  # (L, rows * H_kv) int64
    seg_len: torch.Tensor  # (L, rows * H_kv) int64
    tail_table: torch.Tensor  # (rows, T) int64
    tail_len: torch.Tensor  # (rows,) int64
    max_len: list[int]  # (L,) the longest region segment plus tail of a layer, known on the host (the op's grid)


@dataclass
class StepPlan:
    shift: torch.Tensor | None = None  # (num_reqs,) positions out of each row's view (the backend's kernel)
    jobs: list[Job] = field(default_factory=list)
    saves: list[QuerySave] = field(default_factory=list)
    head_wise: list[HeadWiseRows] = field(default_factory=list)  # one group per number of tokens run

    @property
    def captures(self) -> bool:
        return bool(self.jobs or self.saves or self.head_wise)


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
        self.head_wise: dict[str, HeadWise] = {}  # compacted head-wise request -> its region
        self.layer_index: dict[str, int] = {}  # attention layer name -> its index among the compressed layers
        self.tail_offsets: tuple[torch.Tensor, torch.Tensor] | None = None  # (H_kv, bs, d) element offsets
        self.queries: dict[str, dict[str, torch.Tensor]] = {}  # request -> layer -> last window queries so far
        self.selections: dict[str, dict[str, list[torch.Tensor]]] = {}  # record_selections only: kept positions
        self.stage_selections: dict[str, list[tuple[int, dict]]] = {}  # ... after each compaction (tokens seen, kept)
        self.compacted_requests = 0
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
            self.layer_index[module.layer_name] = len(self.layer_index)
        if not self.o_proj:
            raise EngineConfigError("kvpress_critical found no attention layer to compress in this model")

    # ----------------------------------------------------------------------------------------------------- steps
    def begin_step(self, scheduler_output) -> None:
        """Take the step's directives; forget finished requests and start over for new or resumed ones."""
        for request_id in requests_starting_over(scheduler_output):
            self.shifts.pop(request_id, None)
            self.head_wise.pop(request_id, None)
            self.queries.pop(request_id, None)
        self._directives = getattr(scheduler_output, DIRECTIVES_ATTRIBUTE, None) or StepDirectives()
        self._plan = None
        self._report = StepReport()

    def plan_step(self, cm, block_size: int) -> StepPlan:
        """
        The plan of the step whose common attention metadata is ``cm``: computed once per step from the runner's
        batch and the scheduler's directives (dummy and profiling runs, with an empty batch, get an empty plan).
        """
        batch = batch_of(self.runner)
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
        starts = query_starts(cm, num_reqs)
        request_ids, computed = batch_rows(self.runner, num_reqs)
        shift = [0] * num_reqs
        head_wise_rows = []
        directives = self._directives
        for row, request_id in enumerate(request_ids):
            before, scheduled = computed[row], starts[row + 1] - starts[row]
            if request_id in self.shifts:
                shift[row] = self.shifts[request_id]
            elif request_id in self.head_wise:
                # the backend's kernel attends over the row's last blocks only (its result is replaced)
                shift[row] = before // block_size * block_size
                head_wise_rows.append((row, request_id, before + scheduled, scheduled))
            job = directives.compact.get(request_id)
            if job is not None:
                evict = job.eviction
                if before + scheduled != evict.seen or evict.block_size != block_size:
                    raise PluginStateError(
                        f"kvpress_critical: request {request_id} is to be compacted after its {evict.seen}-token "
                        f"prompt (blocks of {evict.block_size}), but this step runs its positions {before}.."
                        f"{before + scheduled - 1} (blocks of {block_size})"
                    )
                if self.shifts.get(request_id, 0) != evict.start:
                    # an earlier compaction of it was not done here (its directive was sent before the report said
                    # so, with async scheduling): compacting from another start would read the wrong slots
                    self._report.uncompressed[request_id] = (
                        f"its compaction from position {evict.start} follows one that was not done"
                    )
                else:
                    table = block_table(cm)[row, : -(-evict.seen // block_size)]
                    plan.jobs.append(Job(job, row, starts[row], starts[row + 1], table))
            window = directives.save_queries.get(request_id)
            if window is not None:
                plan.saves.append(QuerySave(request_id, window, starts[row], starts[row + 1]))
        missing = (directives.compact.keys() | directives.save_queries.keys()) - set(request_ids)
        if missing:
            raise PluginStateError(f"kvpress_critical: directives for requests not in this step's batch: {missing}")
        if any(shift):
            plan.shift = torch.tensor(shift, dtype=torch.int64)
        for q_len in sorted({rows[3] for rows in head_wise_rows}):
            group = [rows for rows in head_wise_rows if rows[3] == q_len]
            plan.head_wise.append(self._head_wise_rows(group, starts, block_table(cm), block_size))
        self._plan = plan
        return plan

    def _head_wise_rows(self, rows, starts, block_table: torch.Tensor, block_size: int) -> HeadWiseRows:
        """The paged attention's inputs for the step's head-wise rows: region and tail tables, per-layer segments."""
        device = block_table.device
        regions, tails, counts, tail_lens = [], [], [], []
        for row, request_id, seq_len, _ in rows:
            state = self.head_wise[request_id]
            first, boundary = state.evicted // block_size, state.region_end // block_size
            regions.append(block_table[row, first:boundary])
            tails.append(block_table[row, boundary : -(-seq_len // block_size)])
            counts.append(state.counts)
            tail_lens.append(seq_len - state.region_end)
        counts = torch.stack(counts, dim=1)  # (L, rows, H_kv) on the host
        tail_len = torch.tensor(tail_lens, dtype=torch.int64)
        longest = (counts.max(dim=2).values + tail_len).max(dim=1).values  # (L,)
        seg_len = counts.reshape(counts.shape[0], -1)
        seg_start = (torch.cumsum(counts, dim=2) - counts).reshape(counts.shape[0], -1)

        def table(parts):
            width = max(1, max(part.numel() for part in parts))
            out = torch.zeros(len(parts), width, dtype=torch.int64, device=device)
            for i, part in enumerate(parts):
                out[i, : part.numel()] = part
            return out

        tokens = [list(range(starts[row], starts[row] + q_len)) for row, _, _, q_len in rows]
        return HeadWiseRows(
            request_ids=[request_id for _, request_id, _, _ in rows],
            tokens=torch.tensor(tokens, dtype=torch.int64, device=device),
            region_table=table(regions),
            seg_start=seg_start.to(device),
            seg_len=seg_len.to(device),
            tail_table=table(tails),
            tail_len=tail_len,
            max_len=longest.tolist(),
        )

    def attend_head_wise(self, layer, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor, plan) -> None:
        """
        The head-wise rows' attention over their regions and tails, written over the backend's output rows.

        A failure of the kernel ends the requests of those rows (reported broken: the scheduler discards their tokens
        of this step and ends them with an error), never the step or the engine: their rows keep the backend's output,
        which the other rows of the step do not read.
        """
        from kvpress_critical.ops.paged_ragged_attention import paged_ragged_attention

        index = self.layer_index[layer.layer_name]
        region_keys, region_values = region_views(kv_cache)
        flat = block_memory(kv_cache)  # (blocks, block elements): the tail's element offsets index it
        if self.tail_offsets is None:
            self.tail_offsets = self.layout.tail_offsets(kv_cache)
        key_offsets, value_offsets = self.tail_offsets
        for rows in plan.head_wise:
            if all(request_id in self._report.broken for request_id in rows.request_ids):
                continue  # failed in an earlier layer of this step
            try:
                queries = query[rows.tokens].transpose(1, 2)  # (rows, H, q, d)
                out = paged_ragged_attention(
                    queries, region_keys, region_values, rows.region_table, rows.seg_start[index],
                    rows.seg_len[index], flat, flat, rows.tail_table, rows.tail_len, key_offsets, value_offsets,
                    layer.impl.scale, backend=self.engine_options.head_wise_kernel, max_len=rows.max_len[index],
                )  # fmt: skip
                output[rows.tokens] = out.to(output.dtype)  # (rows, q, H, d)
            except Exception as error:  # noqa: BLE001 - these requests end with an error, never the engine
                logger.error(
                    "kvpress_critical: the head-wise attention failed in layer %s for requests %s: %r",
                    layer.layer_name, ", ".join(rows.request_ids), error,
                )  # fmt: skip
                for request_id in rows.request_ids:
                    self._report.broken[request_id] = f"its head-wise attention failed ({error!r})"

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
        selected: list[dict | None] = []  # per job: {layer: (H_kv, N) kept}, or None where its selection failed
        reasons: dict[str, str] = {}
        for job in plan.jobs:
            request_id = job.directive.request_id
            try:
                selected.append(self._select(job, self._score(job, attention_layers)))
            except LayoutError as error:
                logger.info("kvpress_critical: request %s: %s", request_id, error)
                reasons[request_id] = f"its selection does not fit the head-wise layout ({error})"
                selected.append(None)
            except Exception as error:  # noqa: BLE001 - any failure leaves this request whole, never the engine down
                logger.warning(
                    "kvpress_critical: selection failed for request %s; it stays uncompressed: %r", request_id, error
                )
                reasons[request_id] = "its selection failed on this worker"
                selected.append(None)
            finally:
                self.queries.pop(request_id, None)
        # every layer of every request is selected before anything is written, and on every rank
        failed = self._agree_across_ranks([kept is None for kept in selected])
        broken = []
        for job, kept, fail in zip(plan.jobs, selected, failed):
            request_id = job.directive.request_id
            if fail:
                self._report.uncompressed[request_id] = reasons.get(request_id, "its selection failed on another rank")
                continue
            try:
                self._write(job, kept, attention_layers)
            except Exception as error:  # noqa: BLE001 - written in part: only this request is lost
                logger.error("kvpress_critical: compaction of request %s failed midway: %r", request_id, error)
                broken.append((job, f"its compaction failed midway ({error!r})"))
                continue
            self._record(job, kept)
        # a request whose write broke on one rank is broken on all (the scheduler reads one rank's report)
        flags = self._agree_across_ranks([any(job is b for b, _ in broken) for job in plan.jobs])
        for job, flag in zip(plan.jobs, flags):
            request_id = job.directive.request_id
            if flag:
                reason = next((why for b, why in broken if b is job), "its compaction failed midway on another rank")
                self._report.broken[request_id] = reason
                self._report.compacted.pop(request_id, None)
                self.shifts.pop(request_id, None)
                self.head_wise.pop(request_id, None)

    def _record(self, job: Job, kept: dict[str, torch.Tensor]) -> None:
        """A finished compaction: the row's view from the next step on, the report, the recorded selection."""
        request_id, evict = job.directive.request_id, job.directive.eviction
        if job.directive.options.head_wise:
            counts = torch.stack([mask.sum(dim=1) for mask in kept.values()])  # (L, H_kv), the pinned tail in
            pinned = evict.seen % evict.block_size
            self.head_wise[request_id] = HeadWise(evict.evicted, evict.seen - pinned, (counts - pinned).cpu())
        else:
            self.shifts[request_id] = evict.evicted
            counts = torch.full((1, 1), evict.kept)
        self.compacted_requests += 1
        self._report.compacted[request_id] = Compacted(
            evicted=evict.evicted, kept_per_head=evict.kept, kept_min=int(counts.min()), kept_max=int(counts.max())
        )
        if job.directive.options.record_selections:
            # the prompt positions each head keeps: what it held (the earlier compactions' kept positions, then the
            # positions after them) filtered by this compaction's mask
            earlier = self.selections.get(request_id, {}) if evict.start else {}
            stages = self.stage_selections.setdefault(request_id, []) if evict.start else []
            self.stage_selections[request_id] = stages
            chosen = {}
            for name, mask in kept.items():
                heads = []
                for h in range(mask.shape[0]):
                    before = earlier[name][h] if name in earlier else torch.arange(0)
                    held = torch.cat([before, torch.arange(evict.start + before.numel(), evict.seen)])
                    heads.append(held[mask[h].nonzero().flatten().cpu()])
                chosen[name] = heads
            self.selections[request_id] = chosen
            stages.append((evict.seen, chosen))

    def _slots(self, job: Job) -> torch.Tensor:
        """``(held,)`` slots of the positions the compaction scores, ``start .. seen - 1``."""
        evict = job.directive.eviction
        positions = torch.arange(evict.start, evict.seen, device=job.block_ids.device)
        return job.block_ids[positions // evict.block_size].long() * evict.block_size + positions % evict.block_size

    def _score(self, job: Job, attention_layers: dict) -> Iterator[tuple[str, tuple]]:
        """Each layer's scores, ``(layer, (base, norms))`` (:func:`~kvpress_critical_vllm.presses.layer_scores`), one
        layer at a time (:meth:`_select` keeps its mask and drops its scores before the next is scored): the part of
        a selection that may fail on one rank alone; nothing is written."""
        options, evict = job.directive.options, job.directive.eviction
        slots = self._slots(job)
        for name in self.o_proj:
            layer = attention_layers[name]
            kv_cache, impl = layer.kv_cache, layer.impl
            num_kv_heads = impl.num_kv_heads
            chunk = heads_per_chunk(
                options, evict.held, num_kv_heads, impl.num_heads // num_kv_heads, impl.head_size,
                kv_cache.element_size(),
            )  # fmt: skip

            def read(first: int, end: int, kv_cache=kv_cache):
                return self.layout.read(kv_cache, slots, slice(first, end))

            yield (
                name,
                layer_scores(
                    options,
                    read,
                    num_kv_heads,
                    evict.kept,
                    queries=job.queries.get(name),
                    o_proj_weight=self.o_proj[name] if options.critical else None,
                    chunk=chunk,
                ),
            )

    def _select(self, job: Job, scores: Iterable[tuple[str, tuple]]) -> dict[str, torch.Tensor]:
        """The kept entries of every layer, ``{layer: (H_kv, N) bool}``, from its scores, layer after layer (head-wise
        presses run with one rank only: :func:`~kvpress_critical_vllm.options.check_layout`)."""
        options, evict = job.directive.options, job.directive.eviction
        kept = {}
        for name, (base, norms) in scores:
            mask = select(options, base, norms, evict.kept, evict.held)
            del base, norms  # the next layer's scores are made without this one's
            if options.head_wise:
                boundary = evict.seen // evict.block_size * evict.block_size
                if not bool(mask[:, boundary:].all()):
                    raise LayoutError(
                        f"layer {name} drops some of the prompt's last {evict.seen - boundary} tokens in a KV "
                        "head, which the head-wise layout keeps in every head"
                    )
            kept[name] = mask
        return kept

    def _write(self, job: Job, kept: dict[str, torch.Tensor], attention_layers: dict) -> None:
        """
        Uniform presses: each head's kept entries into its slots of positions ``E .. N-1``, in position order, one head
        at a time (what it holds beside the cache: one head's kept keys and values). Head-wise presses: each head's
        kept entries before the prompt's last block boundary ``B``, packed head after head into the rows of the whole
        blocks of positions ``E .. B-1`` (the layer's kept entries are read first: they move within those blocks).
        """
        slots = self._slots(job)
        evict = job.directive.eviction
        if job.directive.options.head_wise:
            boundary = evict.seen // evict.block_size * evict.block_size
            region = job.block_ids[evict.evicted // evict.block_size : boundary // evict.block_size].long()
            for name, mask in kept.items():
                kv_cache = attention_layers[name].kv_cache
                parts = [
                    self.layout.read(kv_cache, slots[mask[head, :boundary].nonzero().flatten()], slice(head, head + 1))
                    for head in range(mask.shape[0])
                ]
                keys = torch.cat([k[:, 0] for k, _ in parts])  # (region rows, d), head after head
                values = torch.cat([v[:, 0] for _, v in parts])
                region_keys, region_values = region_views(kv_cache)
                rows = region_keys.shape[1]
                if keys.shape[0] != region.numel() * rows:
                    raise PluginStateError(
                        f"kvpress_critical: {keys.shape[0]} kept entries for a region of {region.numel()} blocks"
                    )
                if region.numel():  # E == B: every kept entry is in the pinned tail
                    region_keys[region] = keys.view(region.numel(), rows, keys.shape[-1])
                    region_values[region] = values.view(region.numel(), rows, values.shape[-1])
            return
        target = slots[evict.evicted - evict.start :]
        for name, mask in kept.items():
            kv_cache = attention_layers[name].kv_cache
            for head in range(mask.shape[0]):
                heads = slice(head, head + 1)
                keys, values = self.layout.read(kv_cache, slots[mask[head].nonzero().flatten()], heads)
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
        """The recorded selections (``{request_id: {layer_name: [prompt positions each KV head keeps]}}``, after the
        request's last compaction), then forgotten."""
        selections, self.selections = self.selections, {}
        return {
            rid: {name: [positions.tolist() for positions in heads] for name, heads in layers.items()}
            for rid, layers in selections.items()
        }

    def take_stage_selections(self) -> dict[str, list[dict[str, Any]]]:
        """The recorded selections after each compaction of every request (several with ``compression_chunk_size``:
        (``{request_id: [{"seen": tokens, "kept": {layer_name: [positions of each KV head]}}, ...]}``), then
        forgotten."""
        stages, self.stage_selections = self.stage_selections, {}
        return {
            rid: [
                {"seen": seen, "kept": {name: [p.tolist() for p in heads] for name, heads in layers.items()}}
                for seen, layers in entries
            ]
            for rid, entries in stages.items()
        }
