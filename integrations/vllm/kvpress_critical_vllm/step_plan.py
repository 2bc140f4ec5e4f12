"""The plan of one step on a worker, made once per step when the first attention metadata builder asks for it.

:func:`plan_step` reads the runner's batch, the step's common attention metadata and the scheduler's directives beside
the worker's per-request state (:class:`~kvpress_critical_vllm.worker_state.WorkerState`: the shift of each compacted
uniform request, the region of each compacted head-wise one) and says which rows attend over a shifted view, which
end a prompt (or a chunk of one) to be compacted after the forward pass, which keep their last queries for a later
compaction, and what the head-wise rows give the paged attention (:func:`head_wise_rows`). It changes no state: a
compaction that cannot follow the request's earlier one is answered in the step's report only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpress_critical_vllm.protocol import Compact, PluginStateError, StepDirectives, StepReport
from kvpress_critical_vllm.vllm_compat import batch_rows, block_table, query_starts


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


def plan_step(
    runner,
    cm,
    block_size: int,
    directives: StepDirectives,
    shifts: dict[str, int],
    head_wise: dict[str, HeadWise],
    report: StepReport,
) -> StepPlan:
    """The plan of the step whose rows are the runner's batch and ``cm``'s (checked to agree by the caller), run with
    ``directives`` beside the worker's ``shifts`` and ``head_wise`` regions; a compaction that cannot follow the
    request's earlier one is answered in ``report`` (uncompressed)."""
    num_reqs = cm.num_reqs
    plan = StepPlan()
    starts = query_starts(cm, num_reqs)
    request_ids, computed = batch_rows(runner, num_reqs)
    shift = [0] * num_reqs
    rows_head_wise = []  # (row, request id, tokens after the step, tokens run)
    for row, request_id in enumerate(request_ids):
        before, scheduled = computed[row], starts[row + 1] - starts[row]
        if request_id in shifts:
            shift[row] = shifts[request_id]
        elif request_id in head_wise:
            # the backend's kernel attends over the row's last blocks only (its result is replaced)
            shift[row] = before // block_size * block_size
            rows_head_wise.append((row, request_id, before + scheduled, scheduled))
        job = directives.compact.get(request_id)
        if job is not None:
            evict = job.eviction
            if before + scheduled != evict.seen or evict.block_size != block_size:
                raise PluginStateError(
                    f"kvpress_critical: request {request_id} is to be compacted after its {evict.seen}-token "
                    f"prompt (blocks of {evict.block_size}), but this step runs its positions {before}.."
                    f"{before + scheduled - 1} (blocks of {block_size})"
                )
            if shifts.get(request_id, 0) != evict.start:
                # an earlier compaction of it was not done here (its directive was sent before the report said
                # so, with async scheduling): compacting from another start would read the wrong slots
                report.uncompressed[request_id] = (
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
    for q_len in sorted({rows[3] for rows in rows_head_wise}):
        group = [rows for rows in rows_head_wise if rows[3] == q_len]
        plan.head_wise.append(head_wise_rows(group, starts, block_table(cm), block_size, head_wise))
    return plan


def head_wise_rows(
    rows, starts, block_table: torch.Tensor, block_size: int, head_wise: dict[str, HeadWise]
) -> HeadWiseRows:
    """The paged attention's inputs for the step's head-wise rows: region and tail tables, per-layer segments."""
    device = block_table.device
    regions, tails, counts, tail_lens = [], [], [], []
    for row, request_id, seq_len, _ in rows:
        state = head_wise[request_id]
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
