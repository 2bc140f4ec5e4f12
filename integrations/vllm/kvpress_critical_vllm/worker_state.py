"""Per-worker state of the plugin: which requests end their prompt in a step, and compressing one layer of them.

Everything here is derived from the model runner's own batch (request order, tokens computed before the step,
prompt lengths, sampling parameters) and the request's options, so a step's plan is the same on every rank and
needs no message from the scheduler:

- a request whose computed tokens reach its prompt length ``N`` in this step is compacted after each layer's
  attention (its window queries are this chunk's last queries, with earlier chunks' kept when a chunk is short);
- a request that reached ``N`` in an earlier step attends over a view shifted by its evicted positions;
- a request still in an earlier chunk of its prompt keeps its last ``window_size`` queries per layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpress_critical_vllm.budget import Eviction, eviction
from kvpress_critical_vllm.options import CompressionOptions, engine_options, resolve_options
from kvpress_critical_vllm.presses import keep_positions

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")

_STATES: dict[int, WorkerState] = {}


def state_of(vllm_config) -> WorkerState | None:
    """The plugin's state of the worker running ``vllm_config``, or None where the plugin is not enabled."""
    return _STATES.get(id(vllm_config))


@dataclass(frozen=True)
class Compaction:
    """A request whose prompt ends in this step: rows ``query_start .. query_end`` hold its last prompt tokens."""

    request_id: str
    options: CompressionOptions
    eviction: Eviction
    query_start: int
    query_end: int
    first_chunk: bool
    block_ids: torch.Tensor  # the request's block-table row (device), unshifted


@dataclass(frozen=True)
class QuerySave:
    """A request in an earlier chunk of its prompt: keep the last window queries of rows ``start .. end``."""

    request_id: str
    window: int
    query_start: int
    query_end: int
    first_chunk: bool


@dataclass
class StepPlan:
    state: WorkerState
    shift: torch.Tensor | None = None  # (num_reqs,) evicted positions of each row already compressed
    compactions: list[Compaction] = field(default_factory=list)
    saves: list[QuerySave] = field(default_factory=list)

    @property
    def has_work(self) -> bool:
        return bool(self.compactions or self.saves)


@torch.no_grad()
def dense_weight(linear: torch.nn.Module) -> torch.Tensor | None:
    """
    ``(out, in)`` dense weight of a vLLM linear layer (this rank's shard), or None if it is not unquantized.

    On CPUs vLLM packs unquantized weights for oneDNN after loading and empties ``weight``; the packed layer applied
    to the identity gives the weight back exactly (each output is one product by 1.0), once per layer.
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
    """The plugin's side of one worker: options per request, per-step plans, layer compaction, recorded selections."""

    def __init__(self, vllm_config, runner) -> None:
        self.vllm_config = vllm_config
        self.runner = runner
        self.engine_options: CompressionOptions = engine_options(vllm_config.additional_config)
        self.o_proj: dict[str, torch.Tensor] = {}  # attention layer name -> dense (D, H * d) o_proj weight
        self._options: dict[str, CompressionOptions] = {}
        self._queries: dict[str, dict[str, torch.Tensor]] = {}
        self.selections: dict[str, dict[str, torch.Tensor]] = {}
        self.compacted_requests = 0
        self.layout = None  # how to read the paged cache by slot (set once the cache exists)
        _STATES[id(vllm_config)] = self

    def close(self) -> None:
        _STATES.pop(id(self.vllm_config), None)

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

    # --------------------------------------------------------------------------------------------------- options
    def options_for(self, request_id: str) -> CompressionOptions:
        options = self._options.get(request_id)
        if options is None:
            params = self.runner.requests[request_id].sampling_params
            extra = params.extra_args if params is not None else None
            options = self._options[request_id] = resolve_options(self.engine_options, extra)
        return options

    def _forget_finished(self) -> None:
        live = self.runner.requests
        for table in (self._options, self._queries):
            for request_id in [r for r in table if r not in live]:
                del table[request_id]

    # ----------------------------------------------------------------------------------------------------- plans
    def plan_step(self, cm, block_size: int) -> StepPlan:
        """The plan of the step whose common attention metadata is ``cm`` (empty for dummy and profiling runs)."""
        plan = StepPlan(state=self)
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        if num_reqs == 0 or cm.num_reqs < num_reqs:
            return plan
        self._forget_finished()
        starts = cm.query_start_loc_cpu[: num_reqs + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:num_reqs].tolist()
        prompts = batch.num_prompt_tokens[:num_reqs].tolist()
        shift = [0] * num_reqs
        for row, request_id in enumerate(batch.req_ids[:num_reqs]):
            options = self.options_for(request_id)
            evict = eviction(options, prompts[row], block_size)
            if not evict.active:
                continue
            before, scheduled = computed[row], starts[row + 1] - starts[row]
            if before >= evict.n_prompt:
                shift[row] = evict.evicted
            elif before + scheduled >= evict.n_prompt:
                if before + scheduled > evict.n_prompt:
                    raise RuntimeError(
                        f"kvpress_critical: request {request_id} runs positions {before}..{before + scheduled - 1} "
                        f"in one step across the end of its {evict.n_prompt}-token prompt; the plugin's scheduler "
                        "stops prompt chunks at the prompt's end"
                    )
                plan.compactions.append(
                    Compaction(
                        request_id=request_id,
                        options=options,
                        eviction=evict,
                        query_start=starts[row],
                        query_end=starts[row + 1],
                        first_chunk=before == 0,
                        block_ids=cm.block_table_tensor[row, : -(-evict.n_prompt // block_size)],
                    )
                )
            elif options.needs_queries:
                plan.saves.append(
                    QuerySave(request_id, options.window_size, starts[row], starts[row + 1], first_chunk=before == 0)
                )
        if any(shift):
            plan.shift = torch.tensor(shift, dtype=torch.int64)
        return plan

    # ---------------------------------------------------------------------------------------------- compaction
    def _window_queries(self, request_id: str, layer_name: str, chunk: torch.Tensor, window: int, first: bool):
        """The last ``window`` queries of the prompt so far: this chunk's, after the earlier chunks' kept ones."""
        earlier = None if first else self._queries.get(request_id, {}).get(layer_name)
        if earlier is not None and chunk.shape[0] < window:
            chunk = torch.cat([earlier, chunk])
        return chunk[-window:]

    @torch.no_grad()
    def compress_layer(self, impl, layer, query: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan) -> None:
        layer_name = layer.layer_name
        for save in plan.saves:
            tail = self._window_queries(
                save.request_id, layer_name, query[save.query_start : save.query_end], save.window, save.first_chunk
            )
            self._queries.setdefault(save.request_id, {})[layer_name] = tail.clone()
        for job in plan.compactions:
            evict = job.eviction
            block_size = evict.block_size
            positions = torch.arange(evict.n_prompt, device=job.block_ids.device)
            slots = job.block_ids[positions // block_size].long() * block_size + positions % block_size
            keys, values = self.layout.read(kv_cache, slots)  # (N, H_kv, d)
            queries = None
            if job.options.needs_queries:
                queries = self._window_queries(
                    job.request_id,
                    layer_name,
                    query[job.query_start : job.query_end],
                    job.options.window_size,
                    job.first_chunk,
                )
            kept = keep_positions(
                job.options,
                keys,
                values,
                evict.kept,
                queries=queries,
                o_proj_weight=self.o_proj[layer_name] if job.options.critical else None,
            )  # (H_kv, kept)
            index = kept.t().unsqueeze(-1).expand(-1, -1, keys.shape[-1])  # (kept, H_kv, d)
            impl.do_kv_cache_update(
                layer, keys.gather(0, index), values.gather(0, index), kv_cache, slots[evict.evicted :]
            )
            if job.options.record_selections:
                self.selections.setdefault(job.request_id, {})[layer_name] = kept.cpu()
        if plan.compactions and layer_name == next(reversed(self.o_proj)):
            for job in plan.compactions:
                self._queries.pop(job.request_id, None)
                self.compacted_requests += 1

    def take_selections(self) -> dict[str, dict[str, Any]]:
        """The recorded selections (``{request_id: {layer_name: (H_kv, kept) positions}}``), then forgotten."""
        selections, self.selections = self.selections, {}
        return {rid: {name: kept.tolist() for name, kept in layers.items()} for rid, layers in selections.items()}
