"""The scheduler side: free a compressed request's evicted blocks once its prefill has run, and log it.

After the step that ends a request's prompt has run, the workers have moved every KV head's kept entries into the
slots of positions ``E .. N-1`` (``E`` = :attr:`~kvpress_critical_vllm.budget.Eviction.evicted`); the blocks of
positions ``0 .. E-1`` then hold nothing the request reads, and go back to vLLM's pool (replaced by the null block
in the request's block table, as vLLM's sliding-window manager does). The request's positions keep counting from
``N``. A preempted request is recomputed with its prompt as one prefill (its chunks stop at ``N``) and compressed
again, so it resumes over the same cache it had.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import Request

from kvpress_critical_vllm.budget import Eviction, eviction
from kvpress_critical_vllm.engine_config import EngineConfigError
from kvpress_critical_vllm.options import CompressionOptions, engine_options, resolve_options

# under vLLM's logger, so that the lines appear in vLLM's log at its level (VLLM_LOGGING_LEVEL)
logger = logging.getLogger(f"vllm.{__name__}")


@dataclass
class CompressionRecord:
    """What happened to one request (``LLM.llm_engine`` in-process, or the log line, report it)."""

    request_id: str
    press: str
    compression_ratio: float
    prompt_tokens: int
    kept_per_head: int
    blocks_freed: int
    blocks_before: int
    preemptions: int


class CompressingSchedulerMixin:
    """Frees the evicted blocks of compressed requests; keeps a resumed request's prompt chunks within the prompt."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kvpress_options: CompressionOptions = engine_options(self.vllm_config.additional_config)
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
            specs = ", ".join(type(group.kv_cache_spec).__name__ for group in groups) or "none"
            raise EngineConfigError(
                "kvpress_critical cannot compress with this engine: the model's KV cache has groups of "
                f"{specs}, and the plugin evicts from one group of full-attention layers. Serve a model whose "
                "layers are all full attention."
            )
        self.kvpress_block_size = groups[0].kv_cache_spec.block_size
        self._kvpress_evictions: dict[str, Eviction] = {}
        self._kvpress_options_of: dict[str, CompressionOptions] = {}
        self._kvpress_logged: set[tuple[str, int]] = set()
        self.kvpress_records: dict[str, CompressionRecord] = {}

    def add_request(self, request: Request) -> None:
        if request.request_id not in self.requests and request.sampling_params is not None:
            options = resolve_options(self.kvpress_options, request.sampling_params.extra_args)
            plan = eviction(options, request.num_prompt_tokens, self.kvpress_block_size)
            if plan.active:
                self._kvpress_evictions[request.request_id] = plan
            self._kvpress_options_of[request.request_id] = options
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        self._free_evicted_blocks()
        return super().schedule(*args, **kwargs)

    def _free_evicted_blocks(self) -> None:
        """Free ``[0, E / bs)`` of every running request whose compressing step has run (idempotent)."""
        if not self._kvpress_evictions:
            return
        managers = self.kv_cache_manager.coordinator.single_type_managers
        for request in self.running:
            plan = self._kvpress_evictions.get(request.request_id)
            if plan is None:
                continue
            processed = request.num_computed_tokens - request.num_in_flight_tokens
            if processed < plan.n_prompt:
                continue
            blocks_before = len(managers[0].req_to_blocks.get(request.request_id, ()))
            for manager in managers:
                manager._remove_blocks_in_range(request.request_id, 0, plan.evicted // manager.block_size)
            key = (request.request_id, request.num_preemptions)
            if key not in self._kvpress_logged:
                self._kvpress_logged.add(key)
                options = self._kvpress_options_of[request.request_id]
                record = CompressionRecord(
                    request_id=request.request_id,
                    press=options.press,
                    compression_ratio=options.compression_ratio,
                    prompt_tokens=plan.n_prompt,
                    kept_per_head=plan.kept,
                    blocks_freed=plan.blocks_freed,
                    blocks_before=blocks_before,
                    preemptions=request.num_preemptions,
                )
                self.kvpress_records[request.request_id] = record
                logger.info(
                    "kvpress_critical: request %s: prompt %d tokens, %d entries kept per KV head (%s, "
                    "compression_ratio %.3g, budget %d), %d of %d blocks freed%s",
                    request.request_id,
                    plan.n_prompt,
                    plan.kept,
                    options.press,
                    options.compression_ratio,
                    plan.budget,
                    plan.blocks_freed,
                    blocks_before,
                    f" (after {request.num_preemptions} preemption(s))" if request.num_preemptions else "",
                )

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int, num_new_tokens: int) -> int:
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        plan = self._kvpress_evictions.get(request.request_id)
        if plan is not None and num_computed_tokens < plan.n_prompt < num_computed_tokens + num_new_tokens:
            # a resumed request recomputes prompt + output: compress after the prompt, then attend over the
            # compressed cache for the outputs, as the request did before it was preempted
            num_new_tokens = plan.n_prompt - num_computed_tokens
        return num_new_tokens

    def _free_request(self, request: Request, *args, **kwargs):
        self._kvpress_evictions.pop(request.request_id, None)
        self._kvpress_options_of.pop(request.request_id, None)
        return super()._free_request(request, *args, **kwargs)


class CriticalKVScheduler(CompressingSchedulerMixin, Scheduler):
    """vLLM's scheduler with the plugin's block freeing (``async_scheduling=False``)."""


class CriticalKVAsyncScheduler(CompressingSchedulerMixin, AsyncScheduler):
    """vLLM's async scheduler with the plugin's block freeing (the default)."""
